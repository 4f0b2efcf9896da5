"""Which (key, query) pairs a step of the sm_90 backward (`bwd.py`) sees, and P^T from S^T: a
mixin of `FlashBwdSm90`.

Tails: a query block that reaches past seqlen_q, a key block that reaches past seqlen_k and the
query blocks on a causal diagonal or window edge take the masked path, where P^T is set (not
multiplied) to 0 for hidden (key, query) pairs, which makes dS^T 0 there too. The rows TMA loads
past a sequence are zero-filled or belong to the next sequence of a varlen batch (finite), so
dP^T stays finite and 0 * (dP^T - D) is 0. With `seqused_k` or varlen keys, the K and V rows past
seqlen_k may hold anything (a stale cache: NaN, Inf): the consumers zero them in shared memory
before the first GEMM, since dQ += dS K would turn 0 * NaN into NaN. dQ rows past seqlen_q and
dK/dV rows past seqlen_k are not written. Key blocks no query block sees write dK = dV = 0.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.block_info import BlockInfo, effective_window
from ..common.mask import keep_from, keep_left_of, mma_columns
from ..common.seqlen_info import SeqlenInfo
from ..common.utils import acc_mn_view, exp2f, tanhf
from .bwd_config import NUM_CONSUMER_WGS, STAT_ALIGN
from .bwd_sync import BARRIER_BOTH, BARRIER_WG
from .wgmma import acc_as_mma_sync


class BwdMasks:
    """Mixin of `FlashBwdSm90`: block ranges and the masked path's limits, the probabilities, and
    the key rows past a sequence zeroed in shared memory."""

    def visibility(self, seqlen: SeqlenInfo, window_left, window_right) -> tuple:
        """(left, right, BlockInfo) of a (batch)'s sequences: the window's effective sides, right 0
        with a causal mask, and the block ranges they give on this tile; the key blocks' CTAs and the
        conversion CTAs (`dq_convert`) count the same blocks from them."""
        cfg = self.cfg
        left, right = effective_window(seqlen, window_left, window_right, cfg.local)
        if cfg.causal:
            right = Int32(0)
        return left, right, BlockInfo(cfg.tile_m, cfg.tile_n, cfg.causal, cfg.local, left, right)

    @cute.jit
    def masked_block(self, seqlen: SeqlenInfo, n_lo, m_lo, offset, left, right):
        """Whether the block of keys from `n_lo` and queries from `m_lo` takes the masked path:
        tails on either side, the causal diagonal, the window edges."""
        cfg = self.cfg
        masked = (n_lo + cfg.tile_n > seqlen.seqlen_k) | (m_lo + cfg.tile_m > seqlen.seqlen_q)
        if cutlass.const_expr(cfg.causal or cfg.local):
            masked = masked | (n_lo + cfg.tile_n - 1 > m_lo + offset + right)
        if cutlass.const_expr(cfg.local):
            masked = masked | (n_lo < m_lo + cfg.tile_m - 1 + offset - left)
        return masked

    def hidden_limits(self, seqlen: SeqlenInfo, key0, query0, offset, left, right) -> tuple:
        """The masked path's limits for `probs`: a (key, query) pair of this thread is key0 + k,
        query0 + q with (k, q) thread 0's coordinates; the limits move this thread's part to the
        right side."""
        return (
            seqlen.seqlen_k - key0,  # k >= this: key past seqlen_k
            seqlen.seqlen_q - query0,  # q >= this: query past seqlen_q
            query0 + offset + right - key0,  # k - q > this: right of the window / diagonal
            query0 + offset - left - key0,  # k - q < this: left of the window
        )

    @cute.jit
    def walk_start(self, sK, sV, rows_k, seqlen: SeqlenInfo, n_block, thr_query, ctidx, wg_idx) -> tuple:
        """A consumer's start of its walk, K and V in shared memory: their rows at or past `rows_k`
        zeroed where a key sequence may end inside the tile (`seqused_k`, varlen keys), and
        (seqlen_k - seqlen_q, the CTA's first key, this thread's first row of the LSE / D buffers)."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.seqused_k or cfg.varlen_k):
            if rows_k < cfg.tile_n:
                self.zero_kv_tail(sK, sV, rows_k, ctidx, wg_idx)
        return seqlen.seqlen_k - seqlen.seqlen_q, n_block * cfg.tile_n, self.stat_row(thr_query, seqlen)

    @cute.jit
    def stat_row(self, thr_query, seqlen: SeqlenInfo):
        """This thread's first query in the LSE / D buffers, which start `offset_q % STAT_ALIGN`
        rows early in a varlen batch (`stat_block`)."""
        row = thr_query
        if cutlass.const_expr(self.cfg.varlen_q):
            row = thr_query + seqlen.offset_q % STAT_ALIGN
        return row

    @cute.jit
    def thread_stats(self, sX_thr, t0ScS_mn) -> cute.Tensor:
        """This thread's entries of a query block's LSE rows (`stats_early`), one per column of
        its S^T fragment, in registers."""
        n = cute.size(t0ScS_mn, mode=[1])
        r = cute.make_rmem_tensor((n,), Float32)
        for c in cutlass.range_constexpr(n):
            r[c] = sX_thr[t0ScS_mn[0, c][1]]
        return r

    @cute.jit
    def probs(self, acc_S, rP, sLSE_thr, lse_r, t0ScS_mn, limits, softmax_scale_log2, softcap_prescale,
              query_mode: cutlass.Constexpr = 1):
        """P^T = exp2(S^T * scale_log2 - LSE_log2[query]), in place in acc_S (fp32).

        With soft-capping, S^T is first t = tanh(S^T * scale / softcap) and the chain rule needs
        1 - t^2 next to P^T: P^T goes to rP (16 bits, the dV operand) here, and acc_S keeps the
        product P^T (1 - t^2), the one factor dS^T needs -- one fp32 tile instead of two.
        `lse_r`: this thread's LSE entries in registers (`stats_early`), or None to read them from
        `sLSE_thr`. With `limits` (the masked path, see `consume`), hidden (key, query) pairs get P = 0:
        keys past seqlen_k, queries past seqlen_q, and pairs outside the causal / local window.
        `query_mode`: the mode of the tile's queries, 1 in S^T (keys x queries) and 0 in the
        (queries x keys) S of `keys_n`."""
        cfg = self.cfg
        key_mode = 1 - query_mode
        acc_S_mn = acc_mn_view(acc_as_mma_sync(acc_S))
        rP_mn = acc_mn_view(acc_as_mma_sync(rP))
        rows, cols = (cute.size(acc_S_mn, mode=[m]) for m in (0, 1))
        visible_bits = None
        if cutlass.const_expr(limits is not None and cfg.mask_bits and cols <= 32 and mma_columns(t0ScS_mn)):
            visible_bits = self.visible_bits(t0ScS_mn, limits, rows, query_mode)
        for i in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[query_mode])):
            q = t0ScS_mn[(0, i) if cutlass.const_expr(query_mode == 1) else (i, 0)][query_mode]
            lse = lse_r[i] if cutlass.const_expr(lse_r is not None) else sLSE_thr[q]
            for j in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[key_mode])):
                rc = (j, i) if cutlass.const_expr(query_mode == 1) else (i, j)
                s = acc_S_mn[rc]
                if cutlass.const_expr(cfg.softcap):
                    s = tanhf(s * softcap_prescale)
                p = exp2f(s * softmax_scale_log2 - lse)
                if cutlass.const_expr(visible_bits is not None):
                    visible = cutlass.Boolean(visible_bits[rc[0]] & cutlass.Uint32(1 << rc[1]))
                    p = p if visible else Float32(0.0)
                elif cutlass.const_expr(limits is not None):
                    k = t0ScS_mn[rc][key_mode]
                    hidden = (k >= limits[0]) | (q >= limits[1])
                    if cutlass.const_expr(cfg.causal or cfg.local):
                        hidden = hidden | (k - q > limits[2])
                    if cutlass.const_expr(cfg.local):
                        hidden = hidden | (k - q < limits[3])
                    p = Float32(0.0) if hidden else p
                if cutlass.const_expr(cfg.softcap):
                    rP_mn[rc] = p.to(self.dtype)
                    p = p * (1.0 - s * s)
                acc_S_mn[rc] = p

    @cute.jit
    def visible_bits(self, t0ScS_mn, limits, rows: cutlass.Constexpr[int], query_mode: cutlass.Constexpr[int]) -> list:
        """`mask_bits`: per row of the accumulator, a word whose bit c says whether column c's
        (key, query) pair is visible under `limits` (`hidden_limits`), which ptxas tests bit by
        bit into predicates instead of comparing each pair. The columns are queries in S^T
        (`query_mode` 1) and keys in the S of `keys_n`; a row's constraints on them become bit
        masks of its elements (`keep_left_of`, `keep_from`), and a row wholly outside its sequence
        keeps nothing."""
        cfg = self.cfg
        masked = cfg.causal or cfg.local
        words = []
        for r in cutlass.range_constexpr(rows):
            x = t0ScS_mn[r, 0][0]  # the row's key (S^T) or query (S)
            if cutlass.const_expr(query_mode == 1):
                # queries q: q < seqlen limit; k - q <= right limit: q >= k - limits[2];
                # k - q >= left limit: q < k - limits[3] + 1
                word = keep_left_of(limits[1])
                if cutlass.const_expr(masked):
                    word = word & keep_from(x - limits[2])
                if cutlass.const_expr(cfg.local):
                    word = word & keep_left_of(x - limits[3] + 1)
                outside = x >= limits[0]
            else:
                # keys k: k < seqlen limit; k <= q + right limit; k >= q + left limit
                word = keep_left_of(limits[0])
                if cutlass.const_expr(masked):
                    word = word & keep_left_of(x + limits[2] + 1)
                if cutlass.const_expr(cfg.local):
                    word = word & keep_from(x + limits[3])
                outside = x >= limits[1]
            words.append(cutlass.Uint32(0) if outside else word)
        return words

    @cute.jit
    def zero_kv_tail(self, sK, sV, rows_k, ctidx, wg_idx):
        """K and V rows at or past `rows_k` (a stale cache past seqlen_k may hold NaN) set to 0
        before any GEMM reads them; with `dkv_split` both warpgroups read every row."""
        cfg = self.cfg
        self.zero_rows(sK, cfg.head_dim, rows_k, ctidx, wg_idx)
        self.zero_rows(sV, cfg.head_dim_v, rows_k, ctidx, wg_idx)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read next by WGMMA
        if cutlass.const_expr(cfg.dkv_split):
            cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        else:
            cute.arch.barrier(barrier_id=BARRIER_WG + wg_idx, number_of_threads=128)

    @cute.jit
    def zero_rows(self, sX, cols: cutlass.Constexpr, rows_valid, ctidx, wg_idx):
        """Zero the rows of this warpgroup's share of a key tile (its 64 rows, or half of the 64
        with `dkv_split`) that lie at or past `rows_valid`."""
        tid = ctidx % 128
        wg_rows = self.cfg.tile_n // NUM_CONSUMER_WGS if cutlass.const_expr(self.cfg.dkv_split) else 64
        for i in cutlass.range(wg_rows * cols // 128, unroll_full=True):
            idx = tid + i * 128
            row = wg_idx * wg_rows + idx // cols
            if row >= rows_valid:
                sX[row, idx % cols] = self.dtype(0)
