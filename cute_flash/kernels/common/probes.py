"""Probe kernels: every shared-memory access of the attention kernels on one tile, for the audit.

A probe computes O = bf16(Q·Kᵀ)·V for a single (64 x head_dim) tile with the kernels' layouts
and copies, so its SASS shows what each layout turns into without the rest of attention around
it (no softmax, no masking, no pipeline):

* sm_80: Q, K and V arrive by 128-bit cp.async into the swizzled tiles of `smem_layouts`;
  `ldmatrix.x4` feeds Q·Kᵀ (mma.sync m16n8k16); the S accumulator, rounded to bf16, is the A
  operand of P·V straight from registers; V reaches the MMA through `ldmatrix.x4.trans`; O goes
  to shared memory with 32-bit stores from the accumulator layout (over the Q tile) and out to
  global memory with 128-bit loads and stores.
* sm_90a: Q, K and V arrive by TMA into the WGMMA layouts of `smem_layouts`; one warpgroup runs
  S = Q·Kᵀ (WGMMA, both operands in shared memory) and O = P·V (WGMMA, P from registers); O
  goes to shared memory by `stmatrix` and out by a TMA store.

`audit_targets(arch)` lists them for `cute_flash.audit`. Probes are compiled, never launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.cute.runtime import make_fake_tensor

from . import smem_layouts
from .utils import acc_as_operand_a

PROBE_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class ProbeConfig:
    """One probe tile: (tile_m x head_dim) for Q and O, (tile_n x head_dim) for K and V."""

    head_dim: int
    tile_m: int = 64
    tile_n: int = 64
    num_warps: int = 4

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    def name(self, kernel: str) -> str:
        return f"probe_{kernel}_hd{self.head_dim}_bf16"


class Sm80TileProbe:
    """cp.async -> swizzled smem -> ldmatrix -> mma.sync -> smem -> global, on one tile."""

    dtype = cutlass.BFloat16

    def __init__(self, config: ProbeConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 stream: cuda.CUstream):
        cfg = self.cfg
        bits = self.dtype.width
        sQ_layout = smem_layouts.smem_layout_tile(bits, cfg.tile_m, cfg.head_dim)
        sKV_layout = smem_layouts.smem_layout_tile(bits, cfg.tile_n, cfg.head_dim)
        sVt_layout = smem_layouts.smem_layout_transposed(bits, cfg.tile_n, cfg.head_dim)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        g2s = smem_layouts.make_row_tiled_copy(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype, cfg.head_dim, cfg.num_threads,
        )
        s2g = smem_layouts.make_row_tiled_copy(
            cute.nvgpu.CopyUniversalOp(), self.dtype, cfg.head_dim, cfg.num_threads
        )
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (cfg.num_warps, 1, 1),
            permutation_mnk=(cfg.num_warps * 16, 16, 16),
        )
        self.kernel(
            mQ, mK, mV, mO, sQ_layout, sKV_layout, sVt_layout, g2s, s2g, tiled_mma, SharedStorage
        ).launch(grid=(1, 1, 1), block=(cfg.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sVt_layout: cute.ComposedLayout, g2s: cute.TiledCopy, s2g: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = cute.make_tensor(sV.iterator, sVt_layout)

        thr_g2s = g2s.get_slice(tidx)
        for mX, sX in ((mQ, sQ), (mK, sK), (mV, sV)):
            cute.copy(g2s, thr_g2s.partition_S(mX), thr_g2s.partition_D(sX))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), self.dtype)
        copy_Q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        copy_K = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        copy_V = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        tSsQ, tSrQ_view = copy_Q.partition_S(sQ), copy_Q.retile(tSrQ)
        tSsK, tSrK_view = copy_K.partition_S(sK), copy_K.retile(tSrK)
        tOsVt, tOrVt_view = copy_V.partition_S(sVt), copy_V.retile(tOrVt)

        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
        acc_S.fill(0.0)
        # One k16 slice at a time, as the kernels do, so only one slice of operands is live.
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.copy(copy_Q, tSsQ[None, None, k], tSrQ_view[None, None, k])
            cute.copy(copy_K, tSsK[None, None, k], tSrK_view[None, None, k])
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        tOrP = acc_as_operand_a(rP)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_m, cfg.head_dim)), Float32)
        acc_O.fill(0.0)
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.copy(copy_V, tOsVt[None, None, k], tOrVt_view[None, None, k])
            cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)

        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # Every warp is done reading sQ before O overwrites it.
        cute.arch.barrier()
        # Each thread holds column pairs of the accumulator: 32-bit stores, one per pair.
        sts_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32),
            tiled_mma,
        ).get_slice(tidx)
        cute.copy(sts_O, sts_O.retile(rO), sts_O.partition_D(sQ))
        cute.arch.barrier()

        thr_s2g = s2g.get_slice(tidx)
        tOsO = thr_s2g.partition_S(sQ)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        cute.copy(s2g, tOrO, thr_s2g.partition_D(mO))


class Sm90TileProbe:
    """TMA -> WGMMA layouts -> WGMMA (S from smem, O with P from registers) -> stmatrix -> TMA.

    Warpgroup 0 only issues the TMA loads and gives registers back (setmaxnreg), warpgroup 1 runs
    the MMAs and the epilogue, as in the sm_90 kernel's producer/consumer split.
    """

    dtype = cutlass.BFloat16
    producer_registers = 40
    consumer_registers = 232

    def __init__(self, config: ProbeConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 stream: cuda.CUstream):
        cfg = self.cfg
        sQ_layout = smem_layouts.wgmma_smem_layout_tile(self.dtype, cfg.tile_m, cfg.head_dim)
        sKV_layout = smem_layouts.wgmma_smem_layout_tile(self.dtype, cfg.tile_n, cfg.head_dim)

        @cute.struct
        class SharedStorage:
            load_done: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(load, mQ, sQ_layout, (cfg.tile_m, cfg.head_dim))
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(load, mK, sKV_layout, (cfg.tile_n, cfg.head_dim))
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(load, mV, sKV_layout, (cfg.tile_n, cfg.head_dim))
        tma_O, tma_mO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (cfg.tile_m, cfg.head_dim)
        )
        K_major, MN_major = OperandMajorMode.K, OperandMajorMode.MN
        mma_QK = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major, K_major, Float32, (1, 1, 1), (cfg.tile_m, cfg.tile_n)
        )
        # V is stored with the head dim contiguous: the N-major B operand of P·V.
        mma_PV = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major, MN_major, Float32, (1, 1, 1),
            (cfg.tile_m, cfg.head_dim), a_source=warpgroup.OperandSource.RMEM,
        )
        self.kernel(
            tma_Q, tma_mQ, tma_K, tma_mK, tma_V, tma_mV, tma_O, tma_mO,
            sQ_layout, sKV_layout, mma_QK, mma_PV, SharedStorage,
        ).launch(grid=(1, 1, 1), block=(256, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tma_Q: cute.CopyAtom, tma_mQ: cute.Tensor, tma_K: cute.CopyAtom,
               tma_mK: cute.Tensor, tma_V: cute.CopyAtom, tma_mV: cute.Tensor,
               tma_O: cute.CopyAtom, tma_mO: cute.Tensor, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, mma_QK: cute.TiledMma, mma_PV: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        load_done = storage.load_done.data_ptr()
        # The WGMMA atoms swizzle byte addresses: the swizzle goes on the pointer.
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sVt = cute.composition(
            sV, cute.make_layout((cfg.head_dim, cfg.tile_n), stride=(cfg.tile_n, 1))
        )
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(load_done, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                tile_bytes = (cfg.tile_m + 2 * cfg.tile_n) * cfg.head_dim * self.dtype.width // 8
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(load_done, tile_bytes)
                for atom, mX, sX in ((tma_Q, tma_mQ, sQ), (tma_K, tma_mK, sK), (tma_V, tma_mV, sV)):
                    tXsX, tXgX = cpasync.tma_partition(
                        atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                        cute.group_modes(mX, 0, 2),
                    )
                    cute.copy(atom, tXgX, tXsX, tma_bar_ptr=load_done)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            self.consume(tidx - 128, sQ, sK, sVt, mma_QK, mma_PV, load_done)
            # stmatrix wrote sQ through the generic proxy; the TMA store reads it via the async one.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1, number_of_threads=128)
            if warp_idx == 4:
                tOsO, tOgO = cpasync.tma_partition(
                    tma_O, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                    cute.group_modes(tma_mO, 0, 2),
                )
                cute.copy(tma_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume(self, tidx, sQ, sK, sVt, mma_QK: cute.TiledMma, mma_PV: cute.TiledMma, load_done):
        """S = Q·Kᵀ and O = P·V by WGMMA, then O into sQ by stmatrix (consumer warpgroup)."""
        cfg = self.cfg
        thr_QK = mma_QK.get_slice(tidx)
        thr_PV = mma_PV.get_slice(tidx)
        tSrQ = mma_QK.make_fragment_A(thr_QK.partition_A(sQ))
        tSrK = mma_QK.make_fragment_B(thr_QK.partition_B(sK))
        tOrVt = mma_PV.make_fragment_B(thr_PV.partition_B(sVt))
        acc_S = cute.make_rmem_tensor(thr_QK.partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
        acc_O = cute.make_rmem_tensor(thr_PV.partition_shape_C((cfg.tile_m, cfg.head_dim)), Float32)
        cute.arch.mbarrier_wait(load_done, 0)

        mma_QK.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(mma_QK, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
            mma_QK.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # The accumulator's registers are, in order, the A fragments of the next WGMMA
        # (see layouts/tv_layouts.py): P needs only a new shape, no data movement.
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        tOrP = cute.make_tensor(
            rP.iterator, cute.make_layout(thr_PV.partition_shape_A((cfg.tile_m, cfg.tile_n)))
        )
        mma_PV.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(mma_PV, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)
            mma_PV.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        stsm = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_PV
        ).get_slice(tidx)
        cute.copy(stsm, stsm.retile(rO), stsm.partition_D(sQ))


def _tile_tensor(dtype, rows: int, cols: int):
    return make_fake_tensor(dtype, (rows, cols), (cols, 1), assumed_align=16)


def compile_sm80_probe(config: ProbeConfig, options: str):
    """cute.compile the sm_80 probe of `config` on fake tensors."""
    dtype = Sm80TileProbe.dtype
    q = _tile_tensor(dtype, config.tile_m, config.head_dim)
    kv = _tile_tensor(dtype, config.tile_n, config.head_dim)
    return cute.compile(Sm80TileProbe(config), q, kv, kv, q, cuda.CUstream(0), options=options)


def compile_sm90_probe(config: ProbeConfig, options: str):
    """cute.compile the sm_90a probe of `config` on fake tensors."""
    dtype = Sm90TileProbe.dtype
    q = _tile_tensor(dtype, config.tile_m, config.head_dim)
    kv = _tile_tensor(dtype, config.tile_n, config.head_dim)
    return cute.compile(Sm90TileProbe(config), q, kv, kv, q, cuda.CUstream(0), options=options)


def audit_targets(arch: str) -> list:
    """The probes `cute_flash.audit` compiles for `arch`.

    sm_80 gets the sm_80 probes; sm_90a gets them too (the sm_80 kernel is what an H200 runs
    when compiled for it) and the TMA + WGMMA probes.
    """
    from cute_flash.audit import AuditTarget

    def compiler(compile_probe, config: ProbeConfig):
        return lambda options: compile_probe(config, options)

    configs = [ProbeConfig(hd) for hd in PROBE_HEAD_DIMS]
    targets = [AuditTarget(c.name("sm80"), arch, compiler(compile_sm80_probe, c)) for c in configs]
    if arch == "sm_90a":
        targets += [
            AuditTarget(c.name("sm90"), arch, compiler(compile_sm90_probe, c)) for c in configs
        ]
    return targets
