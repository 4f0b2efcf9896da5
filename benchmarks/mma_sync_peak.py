"""The ceiling of the sm_80 kernels on a GPU: mma.sync alone (m16n8k16, bf16 into fp32).

Every warp of every CTA runs `--iters` rounds of 32 independent m16n8k16 MMAs on operands that
stay in registers: no memory traffic, no other work, so the result is the most TFLOP/s any
mma.sync kernel (FlashAttention-2, `cute-sm80`) can reach on this GPU. An attention kernel's
fraction of it says how much its loads, softmax and synchronisation cost.

    python benchmarks/mma_sync_peak.py                # GPU: 4 and 8 warps per CTA
    python benchmarks/mma_sync_peak.py --compile-only # CPU: compiles for sm_90a only

Measured on an H200 (132 SMs), three runs each: 560.3-578.3 TFLOP/s with 4 warps per CTA,
567.9-578.1 with 8.
"""

from __future__ import annotations

import argparse
import sys

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import warp

MMAS_PER_ROUND = 32  # a 64 x 64 accumulator tile of m16n8 atoms: 32 independent chains
FLOP_PER_MMA = 2 * 16 * 8 * 16


def make_kernel(warps: int, iters: int):
    @cute.kernel
    def kernel(out: cute.Tensor, seed: Float32):
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1))
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        thr = tiled_mma.get_slice(tidx % 32)
        a = cute.make_rmem_tensor(thr.partition_shape_A((64, 16)), BFloat16)
        b = cute.make_rmem_tensor(thr.partition_shape_B((64, 16)), BFloat16)
        c = cute.make_rmem_tensor(thr.partition_shape_C((64, 64)), Float32)
        for i in cutlass.range_constexpr(cute.size(a)):
            a[i] = BFloat16(seed * (i + 1))
        for i in cutlass.range_constexpr(cute.size(b)):
            b[i] = BFloat16(seed * (i + 3))
        c.fill(0.0)
        for _ in cutlass.range(iters, unroll=2):
            cute.gemm(tiled_mma, c, a, b, c)
        total = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(c)):
            total = total + c[i]
        out[bidx * (warps * 32) + tidx] = total  # keeps every accumulator live

    @cute.jit
    def launch(out: cute.Tensor, seed: Float32, blocks: Int32):
        kernel(out, seed).launch(grid=(blocks, 1, 1), block=(warps * 32, 1, 1))

    return launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warps", default="4,8", help="comma list of warps per CTA")
    p.add_argument("--iters", type=int, default=4096, help="rounds of 32 MMAs per warp")
    p.add_argument("--ctas-per-sm", type=int, default=16)
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90a on the CPU and stop")
    args = p.parse_args(argv)
    warps_list = [int(w) for w in args.warps.split(",")]
    if args.compile_only:
        from cutlass.cute.runtime import make_fake_tensor

        for warps in warps_list:
            out = make_fake_tensor(Float32, (cute.sym_int32(),), (1,))
            cute.compile(make_kernel(warps, args.iters), out, Float32(1e-3), Int32(1), options="--gpu-arch sm_90a")
            print(f"{warps} warps per CTA: compiled")
        return 0

    import torch
    from cutlass.cute.runtime import from_dlpack

    blocks = torch.cuda.get_device_properties(0).multi_processor_count * args.ctas_per_sm
    for warps in warps_list:
        out = torch.zeros(blocks * warps * 32, device="cuda")
        fn = cute.compile(make_kernel(warps, args.iters), from_dlpack(out), Float32(1e-3), Int32(blocks))
        fn(from_dlpack(out), Float32(1e-3), Int32(blocks))  # warm-up
        flop = blocks * warps * args.iters * MMAS_PER_ROUND * FLOP_PER_MMA
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(from_dlpack(out), Float32(1e-3), Int32(blocks))
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            print(f"{warps} warps per CTA: {ms:.3f} ms, {flop / ms * 1e-9:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
