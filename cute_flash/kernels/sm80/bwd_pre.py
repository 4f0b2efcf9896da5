"""Backward preprocess: D = rowsum(dO * O) (minus dlse) and the LSE in log2 space, per query row.

One CTA covers `tile_m` rows of one (head, batch). Eight threads share a row, each reading
128-bit vectors of O and dO at columns 8 * (chunk * 8 + lane); their fp32 partial sums meet
with three butterfly shuffles (lanes of a row are adjacent), and the row's first lane writes

    D[row]        = sum_j dO[row, j] * O[row, j]  -  dlse[row]   (dlse when given)
    LSE_log2[row] = LSE[row] * log2(e), or +inf where LSE = -inf

+inf for a row that saw no key makes the main kernel's P = exp2(s - LSE_log2) exactly 0 there
instead of exp2(-inf + inf) = NaN.

With `dq_accum_cols` the CTA also clears its rows of the fp32 dQ accumulator that the main
kernel adds into (128-bit stores, whole rows), so the host needs no separate fill (a launch, and
a pass over the accumulator, saved per backward). A flat accumulator (`dq_flat`: the sm_90
kernel's (batch, head, padded seqlen, d), each query block's floats in accumulator order) is
cleared whole, padding rows included: the grid then covers its padded rows, and the CTAs past
the sequence's end only clear.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.fake_tensors import element_type
from ..common.seqlen_info import SeqlenInfo
from ..common.utils import LOG2_E, make_s2g_copy
from .bwd_config import PRE_THREADS_PER_ROW, Sm80BwdPreConfig


class FlashBwdPreSm80:
    def __init__(self, config: Sm80BwdPreConfig):
        self.cfg = config
        self.dtype = element_type(config.dtype)

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (b, sq, h, dv) or varlen (total_q, h, dv)
        mdO: cute.Tensor,  # like mO
        mLSE: cute.Tensor,  # float32 (b, h, sq) or varlen (h, total_q)
        mdLSE: Optional[cute.Tensor],  # like mLSE
        mLSElog2: cute.Tensor,  # like mLSE (written)
        mD: cute.Tensor,  # like mLSE (written)
        # float32 (b, sq, h, dq_accum_cols) or varlen (total_q, h, ...), or flat (b, h, padded sq,
        # dq_accum_cols) with `dq_flat`; cleared
        mdQaccum: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        num_batch: Int32,
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        # 128-bit vectors, PRE_THREADS_PER_ROW threads per row
        gmem_copy = make_s2g_copy(self.dtype, cfg.num_threads, PRE_THREADS_PER_ROW * 128 // self.dtype.width)
        num_heads = mO.shape[2] if cutlass.const_expr(not cfg.varlen_q) else mO.shape[1]
        # a flat accumulator's padded rows (a multiple of tile_m, at least max_seqlen_q) set the grid
        rows = mdQaccum.shape[2] if cutlass.const_expr(cfg.dq_flat) else max_seqlen_q
        self.kernel(mO, mdO, mLSE, mdLSE, mLSElog2, mD, mdQaccum, mCuSeqlensQ, gmem_copy).launch(
            grid=[(rows + cfg.tile_m - 1) // cfg.tile_m, num_heads, num_batch],
            block=[cfg.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: Optional[cute.Tensor],
        mLSElog2: cute.Tensor,
        mD: cute.Tensor,
        mdQaccum: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        gmem_copy: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        # only the query side of SeqlenInfo is used; O stands in for K
        seqlen = SeqlenInfo.create(batch, mO, mO, mCuSeqlensQ, None, None)
        rows = seqlen.seqlen_q - m_block * cfg.tile_m
        if rows > 0:
            headdim_v = mO.shape[3] if cutlass.const_expr(not cfg.varlen_q) else mO.shape[2]
            tile = (cfg.tile_m, cfg.head_dim_v)
            gO = cute.local_tile(seqlen.q_rows(mO, batch, head), tile, (m_block, 0))
            gdO = cute.local_tile(seqlen.q_rows(mdO, batch, head), tile, (m_block, 0))
            thr_copy = gmem_copy.get_slice(tidx)
            tOgO = thr_copy.partition_S(gO)
            tOgdO = thr_copy.partition_S(gdO)
            tOcO = thr_copy.partition_S(cute.make_identity_tensor(tile))
            tOrO = cute.make_fragment_like(tOgO, self.dtype)
            tOrdO = cute.make_fragment_like(tOgdO, self.dtype)
            tOrO.fill(0)
            tOrdO.fill(0)
            for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tOgO, mode=[2])):
                    ok = tOcO[0, m, k][0] < rows
                    if cutlass.const_expr(cfg.check_hdim_v):
                        ok = ok & (tOcO[0, m, k][1] < headdim_v)
                    if ok:
                        cute.copy(gmem_copy, tOgO[None, m, k], tOrO[None, m, k])
                        cute.copy(gmem_copy, tOgdO[None, m, k], tOrdO[None, m, k])

            gLSE = cute.local_tile(seqlen.lse_row(mLSE, batch, head), (cfg.tile_m,), (m_block,))
            gLSElog2 = cute.local_tile(seqlen.lse_row(mLSElog2, batch, head), (cfg.tile_m,), (m_block,))
            gD = cute.local_tile(seqlen.lse_row(mD, batch, head), (cfg.tile_m,), (m_block,))
            for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
                acc = Float32(0.0)
                for k in cutlass.range_constexpr(cute.size(tOgO, mode=[2])):
                    for v in cutlass.range_constexpr(cute.size(tOrO, mode=[0])):
                        acc += Float32(tOrO[v, m, k]) * Float32(tOrdO[v, m, k])
                for offset in (PRE_THREADS_PER_ROW // 2, PRE_THREADS_PER_ROW // 4, 1):
                    acc += cute.arch.shuffle_sync_bfly(acc, offset=offset)
                row = tOcO[0, m, 0][0]
                if tOcO[0, m, 0][1] == 0 and row < rows:
                    if cutlass.const_expr(mdLSE is not None):
                        gdLSE = cute.local_tile(seqlen.lse_row(mdLSE, batch, head), (cfg.tile_m,), (m_block,))
                        acc = acc - gdLSE[row]
                    gD[row] = acc
                    lse = gLSE[row]
                    gLSElog2[row] = Float32.inf if lse == -Float32.inf else lse * LOG2_E
            if cutlass.const_expr(cfg.dq_accum_cols and not cfg.dq_flat):
                gAcc = cute.local_tile(seqlen.q_rows(mdQaccum, batch, head), (cfg.tile_m, cfg.dq_accum_cols),
                                       (m_block, 0))
                self.clear_rows(gAcc, rows, tidx)
        if cutlass.const_expr(cfg.dq_flat):
            # every row of the padded accumulator is the grid's (a multiple of tile_m rows)
            gAcc = cute.local_tile(mdQaccum[batch, head, None, None], (cfg.tile_m, cfg.dq_accum_cols), (m_block, 0))
            self.clear_rows(gAcc, None, tidx)

    @cute.jit
    def clear_rows(self, gAcc: cute.Tensor, rows, tidx):
        """Zero the first `rows` rows (None: all) of this CTA's (tile_m, dq_accum_cols) tile of the
        dQ accumulator, 4 floats per store, consecutive threads on consecutive columns."""
        cfg = self.cfg
        vecs_per_row = cfg.dq_accum_cols // 4
        zero = cute.make_rmem_tensor(4, Float32)
        zero.fill(0.0)
        for i in cutlass.range_constexpr(cfg.tile_m * vecs_per_row // cfg.num_threads):
            vec = tidx + i * cfg.num_threads
            row = vec // vecs_per_row
            dst = cute.local_tile(gAcc[row, None], (4,), (vec % vecs_per_row,))
            if cutlass.const_expr(rows is None):
                cute.autovec_copy(zero, dst)
            elif row < rows:
                cute.autovec_copy(zero, dst)
