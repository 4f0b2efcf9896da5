"""Backward postprocess: dQ = softmax_scale * dQ_accum, rounded to the input dtype.

One CTA covers `tile_m` rows of one (head, batch); each thread reads 8 consecutive fp32 of the
accumulator (two 128-bit loads), scales them, converts them with round-to-nearest-even (the
`cvt.rn` of `Tensor.to`) and writes one 128-bit vector of dQ. The accumulator has the padded
tile head dim; only the columns below the actual head dim are read and written.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.fake_tensors import element_type
from ..common.seqlen_info import SeqlenInfo
from ..common.utils import make_s2g_copy
from .bwd_config import PRE_THREADS_PER_ROW, Sm80BwdPostConfig


class FlashBwdPostSm80:
    def __init__(self, config: Sm80BwdPostConfig):
        self.cfg = config
        self.dtype = element_type(config.dtype)

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # float32 (b, sq, h, d_tile) or varlen (total_q, h, d_tile)
        mdQ: cute.Tensor,  # (b, sq, h, d) or varlen (total_q, h, d), written
        mCuSeqlensQ: Optional[cute.Tensor],
        num_batch: Int32,
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        vec = 128 // self.dtype.width
        atom_cols = PRE_THREADS_PER_ROW * vec
        copy_dQ = make_s2g_copy(self.dtype, cfg.num_threads, atom_cols)
        # the same threads and columns as copy_dQ, 8 fp32 (two 128-bit loads) per thread
        copy_acc = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_ordered_layout((cfg.num_threads // PRE_THREADS_PER_ROW, PRE_THREADS_PER_ROW), order=(1, 0)),
            cute.make_layout((1, vec)),
        )
        num_heads = mdQ.shape[2] if cutlass.const_expr(not cfg.varlen_q) else mdQ.shape[1]
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale, copy_acc, copy_dQ).launch(
            grid=[(max_seqlen_q + cfg.tile_m - 1) // cfg.tile_m, num_heads, num_batch],
            block=[cfg.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        softmax_scale: Float32,
        copy_acc: cute.TiledCopy,
        copy_dQ: cute.TiledCopy,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo.create(batch, mdQ, mdQ, mCuSeqlensQ, None, None)
        rows = seqlen.seqlen_q - m_block * cfg.tile_m
        if rows > 0:
            headdim = mdQ.shape[3] if cutlass.const_expr(not cfg.varlen_q) else mdQ.shape[2]
            tile = (cfg.tile_m, cfg.head_dim)
            gAcc = cute.local_tile(seqlen.q_rows(mdQaccum, batch, head), tile, (m_block, 0))
            gdQ = cute.local_tile(seqlen.q_rows(mdQ, batch, head), tile, (m_block, 0))
            thr_acc = copy_acc.get_slice(tidx)
            thr_dQ = copy_dQ.get_slice(tidx)
            tAgAcc = thr_acc.partition_S(gAcc)
            tQgdQ = thr_dQ.partition_D(gdQ)
            tQcdQ = thr_dQ.partition_D(cute.make_identity_tensor(tile))
            rAcc = cute.make_fragment_like(tAgAcc, Float32)
            rdQ = cute.make_fragment_like(tQgdQ, self.dtype)
            for m in cutlass.range_constexpr(cute.size(tQgdQ, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tQgdQ, mode=[2])):
                    ok = tQcdQ[0, m, k][0] < rows
                    if cutlass.const_expr(cfg.check_hdim):
                        ok = ok & (tQcdQ[0, m, k][1] < headdim)
                    if ok:
                        cute.copy(copy_acc, tAgAcc[None, m, k], rAcc[None, m, k])
                        for v in cutlass.range_constexpr(cute.size(rAcc, mode=[0])):
                            rAcc[v, m, k] = rAcc[v, m, k] * softmax_scale
                        rdQ[None, m, k].store(rAcc[None, m, k].load().to(self.dtype))
                        cute.copy(copy_dQ, rdQ[None, m, k], tQgdQ[None, m, k])
