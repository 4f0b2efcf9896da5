"""Probe kernels that run device helpers of `cute_flash.kernels.triton` on many inputs, for
tests to compare with brute force. Imports Triton: load it where the kernels may run."""

import triton
import triton.language as tl

from cute_flash.kernels.triton.common import key_range, query_range


@triton.jit
def block_ranges(
    PROBLEMS, RANGES, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Row i of PROBLEMS (int32: m_lo, n_lo, seqlen_q, seqlen_k, left, right) gets in RANGES the
    key range of the query block at m_lo and the query range of the key block at n_lo, called
    as the forward / dQ and the dK/dV kernels call them."""
    row = PROBLEMS + 6 * tl.program_id(0)
    m_lo = tl.load(row)
    n_lo = tl.load(row + 1)
    seqlen_q = tl.load(row + 2)
    seqlen_k = tl.load(row + 3)
    left = tl.load(row + 4)
    right = tl.load(row + 5)
    k_lo, k_hi = key_range(m_lo, tl.minimum(m_lo + BLOCK_M, seqlen_q), seqlen_q, seqlen_k, left, right,
                           HAS_LEFT, HAS_RIGHT, BLOCK_N)
    q_lo, q_hi = query_range(n_lo, n_lo + BLOCK_N, seqlen_q, seqlen_k, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M)
    out = RANGES + 4 * tl.program_id(0)
    tl.store(out, k_lo)
    tl.store(out + 1, k_hi)
    tl.store(out + 2, q_lo)
    tl.store(out + 3, q_hi)
