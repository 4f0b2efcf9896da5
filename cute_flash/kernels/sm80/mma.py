"""The two GEMM loops of the sm_80 kernels (forward and backward): mma.sync over the k-slices
of a tile, with the shared-memory operands brought into registers by ldmatrix one k-slice
ahead of the MMA that needs them."""

from __future__ import annotations

import cutlass.cute as cute


def gemm_ss(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, smem_copy_A, smem_copy_B):
    """acc += A B with both operands streamed from shared memory one k-slice ahead."""
    tCrA_view = smem_copy_A.retile(tCrA)
    tCrB_view = smem_copy_B.retile(tCrB)
    num_k = cute.size(tCsA, mode=[2])
    cute.copy(smem_copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(smem_copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in range(num_k):
        if k + 1 < num_k:
            cute.copy(smem_copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(smem_copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


def gemm_rs(tiled_mma, acc, tCrA, tCrB, tCsB, smem_copy_B):
    """acc += A B with A already in registers and B streamed from shared memory."""
    tCrB_view = smem_copy_B.retile(tCrB)
    num_k = cute.size(tCrA, mode=[2])
    cute.copy(smem_copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in range(num_k):
        if k + 1 < num_k:
            cute.copy(smem_copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
