"""Device helpers shared by the Triton forward and backward kernels.

Conventions every kernel follows:

* A sequence of a batch is (q_start, k_start, seqlen_q, seqlen_k): its first query row and
  first key in the tensors (non-zero only for packed varlen tensors; in batch mode the batch
  stride places it) and its lengths; `seqused_k` overrides the number of keys.
* Windows are FlashAttention-2's, bottom-right aligned: query i sees key j iff
  i + shift - left <= j <= i + shift + right with shift = seqlen_k - seqlen_q and an absent
  side unbounded; causal is (left, right) = (-1, 0).
* Scores live in log2 space: s = log2(e) * scale * q.k (or, soft-capped,
  log2(e) * softcap * tanh(scale * q.k / softcap)), so the softmax uses exp2. The host folds
  the constants into `qk_pre` (applied to q.k) and `qk_post` (applied after tanh).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Sizes and window bounds change from call to call; specializing on their values (== 1,
# divisible by 16) would compile a kernel per combination and buys nothing here. Strides stay
# specialized: their divisibility is what lets Triton vectorize loads.
SIZE_ARGS = ("nheads", "nheads_k", "group", "num_m_blocks", "num_n_blocks", "seqlen", "seqlen_q", "seqlen_k",
             "window_left", "window_right")


@triton.jit
def sequence_bounds(
    b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
):
    """(q_start, k_start, seqlen_q, seqlen_k) of sequence b; starts are 64-bit."""
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + b).to(tl.int64)
        k_start = tl.load(CU_SEQLENS_K + b).to(tl.int64)
        seqlen_q = (tl.load(CU_SEQLENS_Q + b + 1) - q_start).to(tl.int32)
        seqlen_k = (tl.load(CU_SEQLENS_K + b + 1) - k_start).to(tl.int32)
    else:
        q_start = tl.full([], 0, tl.int64)
        k_start = tl.full([], 0, tl.int64)
    if HAS_SEQUSED_K:
        seqlen_k = tl.load(SEQUSED_K + b)
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def key_range(
    m_lo, m_hi, seqlen_q, seqlen_k, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Keys [lo, hi) that some query row in [m_lo, m_hi) sees; lo is a multiple of BLOCK_N,
    so that key blocks stay aligned to the tensor's rows."""
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(m_lo + shift - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m_hi + shift + window_right, seqlen_k)
    return lo, hi


@triton.jit
def query_range(
    n_lo, n_hi, seqlen_q, seqlen_k, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Query rows [lo, hi) that see some key in [n_lo, n_hi); lo is a multiple of BLOCK_M."""
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(n_lo - shift - window_right, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n_hi - shift + window_left, seqlen_q)
    return lo, hi


@triton.jit
def visible(
    rows, cols, seqlen_q, seqlen_k, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Which (row, key) pairs of a tile count: the key exists and lies in the row's window.
    `rows` and `cols` are sequence indices that broadcast against each other."""
    shift = seqlen_k - seqlen_q
    ok = cols < seqlen_k
    if HAS_LEFT:
        ok = ok & (cols >= rows + shift - window_left)
    if HAS_RIGHT:
        ok = ok & (cols <= rows + shift + window_right)
    return ok


@triton.jit
def tanh(x):
    # 1 - 2 / (e^2x + 1): exact limits +-1 for large |x| (e^2x overflows to inf or underflows
    # to 0), absolute error of a few fp32 ulps of 1 near 0. Portable to every Triton target,
    # unlike a libdevice call.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def log2_scores(qk, qk_pre, qk_post, HAS_SOFTCAP: tl.constexpr):
    """Scores in log2 space from the raw products q.k (see the module docstring)."""
    if HAS_SOFTCAP:
        s = tanh(qk * qk_pre) * qk_post
    else:
        s = qk * qk_pre
    return s


@triton.jit
def mma(a, b, acc, DOT_IN_FP32: tl.constexpr):
    """acc + a @ b with fp32 accumulation. DOT_IN_FP32 upcasts the operands and multiplies in
    full fp32 (no TF32): what fp32 inputs need, and how bf16 runs under the Triton
    interpreter, whose bf16 dot is wrong; for fp16/bf16 values the products are exact either way."""
    if DOT_IN_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
