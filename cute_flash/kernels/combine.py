"""Split-KV combine: merge the float32 partial results of the key splits into O and LSE.

Split s of a row produced O_s (already divided by its own softmax sum) and LSE_s = log of that
sum (natural log, scores scaled). The row's result is

    LSE = log(sum_s exp(LSE_s)),      O = sum_s exp(LSE_s - LSE) * O_s,

computed with the largest LSE_s subtracted first so that nothing overflows. A split whose
LSE_s is -inf saw no visible key and has weight 0; it is skipped rather than multiplied, so
-inf - (-inf) is never formed. A row whose splits are all empty gets O = 0 and LSE = -inf.

Which splits hold data is not stored anywhere: the forward kernel cuts the key blocks
[0, n_blocks) of a sequence into runs of n_per_split = ceil(n_blocks / num_splits) and a split
whose run starts past the sequence writes nothing. The combine recomputes the same count of
live splits, ceil(n_blocks / n_per_split), from the same per-sequence key length, so it never
reads a partial slot that this call did not write (a graph captured for the longest batch and
replayed with shorter sequences leaves stale data there, unread).

One warp merges one (query row, head): each lane owns 4 consecutive columns of every 128, so
the partial rows (float32) are read with 128-bit loads and the output written with 64-bit
stores; rounding to the output dtype is round-to-nearest-even (cvt.rn). The combine of a
one-token decode is a chain of memory latencies (the partials are fresh in L2), so it keeps
that chain short: one load per lane brings the LSEs of 32 splits, a warp butterfly reduces
them, each lane turns its split's LSE into a weight, and the rows of up to 16 splits are all
requested before the first is summed. Reading the LSEs split after split, and the rows 4
splits at a time after their LSEs, took 7 us at batch 1 with 16 splits on an H200 (8 CTAs,
caches flushed), next to the split kernel's 12.7 us.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common.fake_tensors import element_type
from .common.utils import LN_2, LOG2_E, exp2f, log2f

VEC = 4  # float32 columns per lane and access: 128 bits
# partial-row loads (128 columns each) of one (row, head) issued before the first is used: 16
# splits' rows at head dim <= 128, 8 at 192 / 256 (64 registers either way)
SPLIT_ROWS_IN_FLIGHT = 16


@cute.jit
def merge_max_sum(m_a: Float32, s_a: Float32, m_b: Float32, s_b: Float32):
    """Merge two (max, sum of exp(x - max)) pairs of LSEs; an empty pair is (-inf, 0) and adds
    nothing (-inf - (-inf) is never formed)."""
    m = cute.arch.fmax(m_a, m_b)
    s = s_a
    if m != -Float32.inf:
        s = s_a * exp2f((m_a - m) * LOG2_E) + s_b * exp2f((m_b - m) * LOG2_E)
    return m, s


class FlashCombine:
    """The combine kernel for one `CombineConfig` (see `combine_config.py`)."""

    def __init__(self, config):
        self.cfg = config
        self.dtype = element_type(config.dtype)
        self.num_threads = config.rows_per_cta * 32

    @cute.jit
    def __call__(
        self,
        mOPartial: cute.Tensor,  # float32 (splits, b, sq, h, dv) or varlen (splits, total_q, h, dv)
        mLSEPartial: cute.Tensor,  # float32 (splits, b, h, sq) or varlen (splits, h, total_q)
        mO: cute.Tensor,  # (b, sq, h, dv) or varlen (total_q, h, dv), fp16/bf16
        mLSE: Optional[cute.Tensor],  # float32 (b, h, sq) or varlen (h, total_q)
        mCuSeqlensQ: Optional[cute.Tensor],  # int32 (b + 1)
        mCuSeqlensK: Optional[cute.Tensor],  # int32 (b + 1)
        mSeqUsedK: Optional[cute.Tensor],  # int32 (b)
        seqlen_k: Int32,  # keys of every sequence when neither tensor above gives them
        num_batch: Int32,
        max_seqlen_q: Int32,
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        num_heads = mO.shape[2] if cutlass.const_expr(not cfg.varlen_q) else mO.shape[1]
        grid_x = (max_seqlen_q + cfg.rows_per_cta - 1) // cfg.rows_per_cta
        self.kernel(
            mOPartial, mLSEPartial, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, seqlen_k, num_splits,
        ).launch(
            grid=[grid_x, num_heads, num_batch],
            block=[self.num_threads, 1, 1],
            stream=stream,
            # .minnctapersm 1: without it ptxas held hd256 to 48 registers for occupancy and
            # spilled the partial rows in flight (sm_90a); 64 registers still fit 8 CTAs per SM
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mOPartial: cute.Tensor,
        mLSEPartial: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        seqlen_k: Int32,
        num_splits: Int32,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        block_x, head, batch = cute.arch.block_idx()
        lane = tidx % 32
        row = block_x * cfg.rows_per_cta + tidx // 32

        offset_q, seqlen_q = Int32(0), Int32(mO.shape[1])
        if cutlass.const_expr(cfg.varlen_q):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        keys = seqlen_k
        if cutlass.const_expr(cfg.seqused_k):
            keys = mSeqUsedK[batch]
        elif cutlass.const_expr(cfg.varlen_k):
            keys = mCuSeqlensK[batch + 1] - mCuSeqlensK[batch]

        if row < seqlen_q:
            # the forward kernel's partition of the key blocks (see the module docstring)
            n_blocks = (keys + cfg.tile_n - 1) // cfg.tile_n
            n_per_split = (n_blocks + num_splits - 1) // num_splits
            live_splits = Int32(0)
            if n_blocks > 0:
                live_splits = (n_blocks + n_per_split - 1) // n_per_split

            # rank-1 views of this row in every buffer, indexed by split (LSE) or column (O)
            if cutlass.const_expr(cfg.varlen_q):
                lse_p = mLSEPartial[None, head, offset_q + row]
                o_row = mO[offset_q + row, head, None]
            else:
                lse_p = mLSEPartial[None, batch, head, row]
                o_row = mO[batch, row, head, None]

            # The LSEs: lane i reads those of splits i, i + 32, ... (one load per 32 splits, all
            # in flight together) and keeps an online (max, sum); a butterfly merges the lanes.
            lse_max = Float32(-Float32.inf)
            lse_sum = Float32(0.0)
            lse_first = Float32(-Float32.inf)  # this lane's split among the first 32
            num_lse_chunks = (live_splits + 31) // 32
            for c in cutlass.range(num_lse_chunks, unroll=1):
                x = self.split_lse(lse_p, c * 32 + lane, live_splits)
                if c == 0:
                    lse_first = x
                lse_max, lse_sum = merge_max_sum(lse_max, lse_sum, x, Float32(1.0))
            for i in cutlass.range_constexpr(5):
                other_max = cute.arch.shuffle_sync_bfly(lse_max, offset=16 >> i)
                other_sum = cute.arch.shuffle_sync_bfly(lse_sum, offset=16 >> i)
                lse_max, lse_sum = merge_max_sum(lse_max, lse_sum, other_max, other_sum)
            lse_row = -Float32.inf if lse_sum == 0.0 else lse_max + log2f(lse_sum) * LN_2

            num_chunks = (cfg.head_dim_v + 32 * VEC - 1) // (32 * VEC)
            in_flight = SPLIT_ROWS_IN_FLIGHT // num_chunks
            acc = cute.make_rmem_tensor((VEC, num_chunks), Float32)
            acc.fill(0.0)
            if lse_sum > 0.0:
                # Each lane turns its split's LSE into a weight; the weights of `in_flight`
                # splits are then broadcast and their rows all read before the first is summed.
                # A split with weight 0 (LSE -inf: no visible key) is not read.
                for c in cutlass.range(num_lse_chunks, unroll=1):
                    x = lse_first
                    if c > 0:  # past 32 splits: this lane's LSE of chunk c, read again
                        x = self.split_lse(lse_p, c * 32 + lane, live_splits)
                    weight = Float32(0.0)
                    if x != -Float32.inf:
                        weight = exp2f((x - lse_row) * LOG2_E)
                    for b in cutlass.range(32 // in_flight, unroll=1):
                        first = c * 32 + b * in_flight  # the batch's first split
                        if first < live_splits:
                            w = cute.make_rmem_tensor(in_flight, Float32)
                            parts = cute.make_rmem_tensor((VEC, num_chunks, in_flight), Float32)
                            for u in cutlass.range_constexpr(in_flight):
                                w[u] = cute.arch.shuffle_sync(weight, offset=b * in_flight + u)
                            for u in cutlass.range_constexpr(in_flight):
                                if w[u] > 0.0:
                                    o_p = self.partial_row(mOPartial, first + u, batch, offset_q, row, head)
                                    for j in cutlass.range_constexpr(num_chunks):
                                        col = (j * 32 + lane) * VEC
                                        if self.column_ok(col, o_row):
                                            src = cute.local_tile(o_p, (VEC,), (col // VEC,))
                                            cute.autovec_copy(src, parts[None, j, u])
                            for u in cutlass.range_constexpr(in_flight):
                                if w[u] > 0.0:
                                    for j in cutlass.range_constexpr(num_chunks):
                                        for e in cutlass.range_constexpr(VEC):
                                            acc[e, j] = acc[e, j] + w[u] * parts[e, j, u]

            for j in cutlass.range_constexpr(num_chunks):
                col = (j * 32 + lane) * VEC
                if self.column_ok(col, o_row):
                    out = cute.make_rmem_tensor(VEC, self.dtype)
                    out.store(acc[None, j].load().to(self.dtype))  # cvt.rn: round to nearest even
                    cute.autovec_copy(out, cute.local_tile(o_row, (VEC,), (col // VEC,)))
            if cutlass.const_expr(mLSE is not None):
                if lane == 0:
                    if cutlass.const_expr(cfg.varlen_q):
                        mLSE[head, offset_q + row] = lse_row
                    else:
                        mLSE[batch, head, row] = lse_row

    @cute.jit
    def split_lse(self, lse_p: cute.Tensor, split, live_splits) -> Float32:
        """The LSE of `split` (-inf past the live splits, whose slots this call did not write)."""
        x = Float32(-Float32.inf)
        if split < live_splits:
            x = lse_p[split]
        return x

    def partial_row(self, mOPartial: cute.Tensor, split, batch, offset_q, row, head) -> cute.Tensor:
        """The (dv,) float32 row of split `split`."""
        if cutlass.const_expr(self.cfg.varlen_q):
            return mOPartial[split, offset_q + row, head, None]
        return mOPartial[split, batch, row, head, None]

    def column_ok(self, col, o_row: cute.Tensor):
        """Whether the 4 columns starting at `col` exist (the head dim is a multiple of 8)."""
        if cutlass.const_expr(self.cfg.check_hdim_v):
            return col < cute.size(o_row)
        if cutlass.const_expr(self.cfg.head_dim_v % (32 * VEC) != 0):
            return col < self.cfg.head_dim_v
        return True
