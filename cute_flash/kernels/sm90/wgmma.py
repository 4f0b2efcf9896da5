"""WGMMA helpers for the sm_90 kernels: issuing a warpgroup GEMM and viewing its fragments.

The accumulator fragment of a WGMMA m64nNk16 is, per thread, ((2, 2, N/8), MMA_M, MMA_N): a
column pair, a row half (8 rows apart) and the N/8 column groups. Each warp holds 16 rows of
the 64 and, as in mma.sync's m16n8 C fragment, a row is spread over the 4 lanes of a quad, so
the row-wise helpers of `kernels/common` (masks, online softmax) apply once the N/8 groups are
moved next to MMA_N: ((2, 2), MMA_M, (N/8, MMA_N)).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def acc_as_mma_sync(acc: cute.Tensor) -> cute.Tensor:
    """View a WGMMA accumulator ((2, 2, V), M, N) as the mma.sync form ((2, 2), M, (V, N))."""
    shape, stride = acc.layout.shape, acc.layout.stride
    layout = cute.make_layout(
        ((shape[0][0], shape[0][1]), shape[1], (shape[0][2], shape[2])),
        stride=((stride[0][0], stride[0][1]), stride[1], (stride[0][2], stride[2])),
    )
    return cute.make_tensor(acc.iterator, layout)


def probs_as_operand_a(rP: cute.Tensor, thr_mma_pv, tile_mk: tuple) -> cute.Tensor:
    """The 16-bit copy of a compact S accumulator as the register A operand of P·V.

    In a compact ((2, 2, V), 1, 1) accumulator, element (c, r, v) sits at c + 2r + 4v; the A
    fragment ((2, 2, 2), 1, V/2) of k16 block j wants columns 16j..16j+15, i.e. v = 2j and
    2j + 1, at c + 2r + 4(v - 2j) + 8j -- the same offset. So P needs a new shape, no moves.
    """
    return cute.make_tensor(rP.iterator, cute.make_layout(thr_mma_pv.partition_shape_A(tile_mk)))


@cute.jit
def smem_operands(tiled_mma: cute.TiledMma, wg_mma, a: cute.Tensor, b: cute.Tensor) -> tuple:
    """The A and B fragments of a GEMM whose operands both come from shared memory, partitioned
    by the warpgroup's slice `wg_mma` (`FlashBwdSm90.mma_slices`)."""
    return tiled_mma.make_fragment_A(wg_mma.partition_A(a)), tiled_mma.make_fragment_B(wg_mma.partition_B(b))


def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    k_blocks: cutlass.Constexpr = None,
):
    """Issue acc (+)= A B over every k block (the first `k_blocks` where given) as one WGMMA
    group (commit, no wait)."""
    gemm_accumulate_if(tiled_mma, acc, tCrA, tCrB, not zero_init, k_blocks)


@cute.jit
def gemm_accumulate_if(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, accumulate,
                       k_blocks: cutlass.Constexpr = None):
    """Issue acc = A B (+ acc where `accumulate`, which may be a run-time Boolean) over every k
    block (the first `k_blocks` where given) as one WGMMA group (commit, no wait).

    A run-time flag lets an accumulator that lives across a loop start from its first GEMM
    instead of a zero fill, whose constants the compiler may hoist ahead of the warp-role branch
    and then hold (or spill) through the whole kernel. A fresh atom carries the ACCUMULATE
    flag, so flipping it here never touches the tiled MMA shared by the caller's loops.
    """
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2]) if k_blocks is None else k_blocks):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
