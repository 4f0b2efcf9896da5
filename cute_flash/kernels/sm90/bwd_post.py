"""Backward postprocess of the sm_90 kernel's flat dQ accumulator (`Sm90BwdConfig.dq_flat`):
dQ = softmax_scale * dQ_accum, rounded to the input dtype, rows and columns put back in order.

The main kernel adds each warpgroup's fp32 dQ tile to mdQaccum (batch, head, padded seqlen, d)
in the order of the WGMMA accumulator: in the run of `tile_m` x d floats of a query block, value
group i (values 4 i .. 4 i + 3) of thread t of the warpgroup at float 4 (128 i + t) of the
warpgroup's chunk (`dq_chunks` chunks of `dq_rows_per_wg` x `dq_cols`, the warpgroups' columns
with `dq_split`, their rows with `dq_rows`). One CTA of 128 threads per chunk and query block
reads the chunks back the same way, 128 bits per load, finds each value's row and column
through the same tiled MMA (its accumulator partition of an identity tensor), and writes the
scaled, rounded pairs of columns into a shared-memory tile of the block (rows padded by 16 bytes,
so that the 8 rows x 4 pairs of a warp's store fall in 32 different banks); the CTA then writes
the tile's rows to dQ 128 bits at a time.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode

from ..common.fake_tensors import element_type
from .bwd_config import Sm90BwdPostConfig

# bf16 / fp16 elements after each row of the shared-memory tile (16 bytes: see the docstring)
PAD = 8


class FlashBwdPostSm90:
    def __init__(self, config: Sm90BwdPostConfig):
        self.cfg = config
        self.dtype = element_type(config.dtype)

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # float32 (b, h, padded sq, d_tile), in accumulator order per query block
        mdQ: cute.Tensor,  # (b, sq, h, d), written
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        mn = OperandMajorMode.MN
        # the main kernel's dQ MMA (`FlashBwdSm90`): one warpgroup, 64 x dq_cols per atom
        tiled_mma = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, mn, mn, Float32, (1, 1, 1),
                                                      (64, cfg.dq_cols))
        self.kernel(mdQaccum, mdQ, softmax_scale, tiled_mma).launch(
            grid=[(max_seqlen_q + cfg.tile_m - 1) // cfg.tile_m, mdQ.shape[2], mdQ.shape[0]],
            block=[128 * cfg.dq_chunks, 1, 1],
            smem=cfg.tile_m * (cfg.head_dim + PAD) * (self.dtype.width // 8) + 128,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, tiled_mma: cute.TiledMma):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        rows = mdQ.shape[1] - m_block * cfg.tile_m
        headdim = mdQ.shape[3]
        sdQ = cutlass.memory.SmemAllocator().allocate_tensor(
            self.dtype, cute.make_layout((cfg.tile_m, cfg.head_dim), stride=(cfg.head_dim + PAD, 1)), 16
        )
        pair_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width)

        def stage(row, col, out):
            addr = (sdQ.iterator + cute.crd2idx((row, col), sdQ.layout)).toint()
            dst = cute.make_ptr(self.dtype, addr, cute.AddressSpace.smem, assumed_align=4)
            cute.copy(pair_store, out, cute.make_tensor(dst, cute.make_layout(2)))

        FlatDq(cfg, self.dtype).rounded_pairs(mdQaccum, batch, head, m_block, tidx // 128, tidx % 128, softmax_scale,
                                              tiled_mma, stage)
        cute.arch.barrier()
        # the tile's rows to dQ, 128 bits per thread and step
        vec = 128 // self.dtype.width
        vecs = cfg.head_dim // vec
        gdQ = cute.local_tile(mdQ[batch, None, head, None], (cfg.tile_m, cfg.head_dim), (m_block, 0))
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        threads = 128 * cfg.dq_chunks
        for k in cutlass.range_constexpr((cfg.tile_m * vecs + threads - 1) // threads):
            idx = tidx + k * threads
            row, v = idx // vecs, idx % vecs
            ok = (idx < cfg.tile_m * vecs) & (row < rows)
            if cutlass.const_expr(cfg.check_hdim):
                ok = ok & (v * vec < headdim)
            if ok:
                frag = cute.make_rmem_tensor(cute.make_layout(vec), self.dtype)
                s_addr = (sdQ.iterator + cute.crd2idx((row, v * vec), sdQ.layout)).toint()
                s_ptr = cute.make_ptr(self.dtype, s_addr, cute.AddressSpace.smem, assumed_align=16)
                cute.copy(copy16, cute.make_tensor(s_ptr, cute.make_layout(vec)), frag)
                g_addr = (gdQ.iterator + cute.crd2idx((row, v * vec), gdQ.layout)).toint()
                g_ptr = cute.make_ptr(self.dtype, g_addr, cute.AddressSpace.gmem, assumed_align=16)
                cute.copy(copy16, frag, cute.make_tensor(g_ptr, cute.make_layout(vec)))


class FlatDq:
    """Reading a flat dQ accumulator back (`cfg`: an `Sm90BwdPostConfig`): for this kernel, and for
    the conversion CTAs of a main kernel with `Sm90BwdConfig.dq_convert`, which store each pair
    straight to dQ."""

    def __init__(self, cfg, dtype):
        self.cfg = cfg
        self.dtype = dtype

    @cute.jit
    def rounded_pairs(self, mdQaccum: cute.Tensor, batch, head, m_block, chunk_idx, t, softmax_scale: Float32,
                      tiled_mma: cute.TiledMma, store):
        """Thread `t` (of 128) of chunk `chunk_idx` of query block `m_block` of (batch, head): its
        value groups, 128 bits per load, scaled and rounded to pairs of columns; `store(row, col,
        pair)` for each, (row, col) in the block (a trace-time callback)."""
        cfg = self.cfg
        chunk = cfg.dq_rows_per_wg * cfg.dq_cols
        gAcc = cute.local_tile(mdQaccum[batch, head, None, None], (cfg.tile_m, cfg.head_dim), (m_block, 0))
        base = gAcc.iterator.toint() + (chunk_idx * chunk + t * 4) * 4  # bytes
        # (row, column) of each accumulator value of thread t inside its warpgroup's tile
        cD = tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor((cfg.dq_rows_per_wg, cfg.dq_cols)))
        row0 = chunk_idx * cfg.dq_rows_per_wg if cutlass.const_expr(cfg.dq_rows) else 0
        col0 = chunk_idx * cfg.dq_cols if cutlass.const_expr(cfg.dq_split) else 0
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(cute.size(cD) // 4):
            vals = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            src = cute.make_ptr(Float32, base + i * 128 * 16, cute.AddressSpace.gmem, assumed_align=16)
            cute.copy(load, cute.make_tensor(src, cute.make_layout(4)), vals)
            for p in cutlass.range_constexpr(2):  # the two column pairs of the group (rows r, r + 8)
                row, col = cD[4 * i + 2 * p]
                pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                for v in cutlass.range_constexpr(2):
                    pair[v] = vals[2 * p + v] * softmax_scale
                out = cute.make_rmem_tensor(cute.make_layout(2), self.dtype)
                out.store(pair.load().to(self.dtype))
                store(row + row0, col + col0, out)
