"""The epilogue of the sm_90 backward (`bwd.py`), a mixin of `FlashBwdSm90`: dK (scaled) and dV
rounded to the input dtype (RNE) and stored row-predicated, staged through shared memory
(`dkv_staged`) or straight from registers."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from ..common.seqlen_info import SeqlenInfo
from ..common.smem_layouts import swizzle_params
from ..common.utils import make_s2g_copy, store_staged_rows, transposed
from .bwd_sync import BARRIER_BOTH


class DkvEpilogue:
    """Mixin of `FlashBwdSm90`: dK and dV from their accumulators to global memory."""

    @cute.jit
    def stage_dkv(self, acc_dK, acc_dV, sdK, sdV, tiled_mma_dK: cute.TiledMma, tiled_mma_dV: cute.TiledMma, ctidx,
                  transpose: cutlass.Constexpr = False):
        """dK and dV rounded to the input dtype (RNE) into the (tile_n, d) tiles `sdK` / `sdV` by
        stmatrix, once both warpgroups are done reading that shared memory: Q's and dO's
        (`dkv_staged`, `staging_tile`) or, for `keys_n`, whose accumulators are dK^T and dV^T
        (`transpose`), K's and V's. `store_dkv` stores them."""
        cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        self.stage_acc(acc_dK, sdK, tiled_mma_dK, ctidx, transpose=transpose)
        self.stage_acc(acc_dV, sdV, tiled_mma_dV, ctidx, transpose=transpose)

    @cute.jit
    def store_dkv(self, sdK, sdV, mdK, mdV, seqlen: SeqlenInfo, batch, head_k, n_block, ctidx):
        """The staged dK and dV tiles to global memory by 128-bit copies, rows inside the key
        sequence and columns inside the actual head dims only (after a barrier of both warpgroups:
        each stores rows the other staged)."""
        cfg = self.cfg
        cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        rows = seqlen.seqlen_k - n_block * cfg.tile_n
        self.store_staged_tile(sdK, mdK, seqlen, batch, head_k, n_block, rows, cfg.head_dim, ctidx)
        self.store_staged_tile(sdV, mdV, seqlen, batch, head_k, n_block, rows, cfg.head_dim_v, ctidx)

    def staging_tile(self, sX, tile_d: int) -> cute.Tensor:
        """A (tile_n, tile_d) tile over the (tile_m, tile_d, 2 stages) of Q or dO: the same swizzle
        atom (its pointer carries the swizzle), as many elements."""
        layout = cute.tile_to_shape(self.split_atom(tile_d), (self.cfg.tile_n, tile_d), (0, 1))
        assert cute.cosize(layout) <= cute.cosize(sX.layout), "the staging tile does not fit"
        return cute.make_tensor(sX.iterator, layout.outer)

    @cute.jit
    def stage_acc(self, acc, sT, tiled_mma: cute.TiledMma, ctidx, transpose: cutlass.Constexpr = False):
        """The fp32 accumulator `acc` rounded to the input dtype into `sT` by stmatrix; with
        `transpose` `acc` is the (cols, rows) tile of `sT` (`keys_n`: dK^T, dV^T) and stmatrix
        transposes its 8 x 8 blocks."""
        stsm = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose, 4), self.dtype), tiled_mma
        ).get_slice(ctidx)
        rX = cute.make_fragment_like(acc, self.dtype)
        rX.store(acc.load().to(self.dtype))
        cute.copy(stsm, stsm.retile(rX), stsm.partition_D(transposed(sT) if cutlass.const_expr(transpose) else sT))

    @cute.jit
    def store_staged_tile(self, sT, mX, seqlen: SeqlenInfo, batch, head_k, n_block, rows, tile_d: cutlass.Constexpr,
                          ctidx):
        """The staged tile `sT` to its rows of `mX`, 128 bits per copy."""
        cfg = self.cfg
        d = mX.shape[2] if cutlass.const_expr(cfg.varlen_k) else mX.shape[3]
        gX = cute.local_tile(seqlen.k_rows(mX, batch, head_k), (cfg.tile_n, tile_d), (n_block, 0))
        s2g = make_s2g_copy(self.dtype, self.num_consumer_threads, swizzle_params(self.dtype.width, tile_d).atom_cols)
        store_staged_rows(s2g, sT, gX, ctidx, rows, d)

    @cute.jit
    def store_rows(self, acc, mX, seqlen: SeqlenInfo, batch, head_k, n_block, tile_d: cutlass.Constexpr,
                   tiled_mma: cute.TiledMma, ctidx):
        """Round an fp32 (tile_n, tile_d) accumulator to the input dtype (RNE), or zeros for
        `acc` None, and store the part inside the key sequence and the actual head dim: two
        neighbouring columns per 32-bit store (the head dim is a multiple of 8, so a pair is
        inside or outside it together)."""
        cfg = self.cfg
        d = mX.shape[2] if cutlass.const_expr(cfg.varlen_k) else mX.shape[3]
        gX = cute.local_tile(seqlen.k_rows(mX, batch, head_k), (cfg.tile_n, tile_d), (n_block, 0))
        rX = cute.make_rmem_tensor(tiled_mma.get_slice(ctidx).partition_C(gX).shape, self.dtype)
        if cutlass.const_expr(acc is None):
            rX.fill(0)
        else:
            rX.store(acc.load().to(self.dtype))
        r2g = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma
        ).get_slice(ctidx)
        tXgX = r2g.partition_D(gX)
        tXrX = r2g.retile(rX)
        tXcX = r2g.partition_D(cute.make_identity_tensor((cfg.tile_n, tile_d)))
        rows = seqlen.seqlen_k - n_block * cfg.tile_n
        # mode 0 of the partitions is (pair, pairs): each thread's whole fragment, one pair per store
        for i in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tXgX, mode=[2])):
                for v in cutlass.range_constexpr(cute.size(tXgX.shape[0][1])):
                    if tXcX[(0, v), i, j][0] < rows:
                        if tXcX[(0, v), i, j][1] < d:
                            cute.copy(r2g, tXrX[(None, v), i, j], tXgX[(None, v), i, j])
