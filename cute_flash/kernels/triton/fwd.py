"""Attention forward in Triton: one program per (query block, head, batch).

1. Which tile: the flat program id is split into (batch, head, query block), the query block
   varying fastest so that neighbouring programs read the same K/V (L2 reuse); within a head
   the blocks run last-first, which under a causal mask starts the longest ones first.
2. The program loads its Q tile once (rows past the sequence, and head-dim columns past
   HEAD_DIM, read as 0) and visits the key blocks its rows can see (`common.key_range`).
3. Per key block: S = Q K^T in fp32, scaled (and soft-capped) into log2 space, hidden scores
   set to -inf; the online softmax keeps the running row max m and row sum l, rescales the
   accumulator by exp2(m_old - m_new), and adds P V with P rounded to the input dtype. A row
   that has seen no visible key keeps m = -inf; it subtracts 0 instead, so it stays at
   P = 0, l = 0, never NaN.
4. Epilogue: O = acc / l rounded to the output dtype (round-to-nearest-even), and
   LSE = (m + log2 l) * ln 2 in float32; rows without a visible key get O = 0, LSE = -inf.

Tensor layouts are those of `cute_flash.backends.base.Backend.fwd`; a varlen call passes a
zero batch stride and finds each sequence through `cu_seqlens_q/k`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LN2, SIZE_ARGS, key_range, log2_scores, mma, sequence_bounds, visible


@triton.jit(do_not_specialize=SIZE_ARGS)
def attn_fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_lm,
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
    nheads, group, num_m_blocks, seqlen_q, seqlen_k,
    qk_pre, qk_post, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    bh = pid // num_m_blocks
    h = (bh % nheads).to(tl.int64)
    b = (bh // nheads).to(tl.int64)
    hk = h // group
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K
    )
    m_lo = m_block * BLOCK_M
    if m_lo >= seqlen_q:
        return

    offs_m = m_lo + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    rows64 = (q_start + offs_m).to(tl.int64)
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    K_seq = K + b * stride_kb + hk * stride_kh
    V_seq = V + b * stride_vb + hk * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_o = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = key_range(m_lo, tl.minimum(m_lo + BLOCK_M, seqlen_q), seqlen_q, seqlen_k, window_left, window_right,
                       HAS_LEFT, HAS_RIGHT, BLOCK_N)
    for n_lo in range(lo, hi, BLOCK_N):
        offs_n = n_lo + tl.arange(0, BLOCK_N)
        col_ok = offs_n < seqlen_k
        keys64 = (k_start + offs_n).to(tl.int64)
        k = tl.load(K_seq + keys64[:, None] * stride_kn + offs_d[None, :],
                    mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        qk = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_IN_FP32)
        s = log2_scores(qk, qk_pre, qk_post, HAS_SOFTCAP)
        ok = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                     HAS_LEFT, HAS_RIGHT)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_seq + keys64[:, None] * stride_vn + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        acc_o = mma(p.to(v.dtype), v, acc_o * alpha[:, None], DOT_IN_FP32)
        m_i = m_new

    live = l_i > 0.0
    l_safe = tl.where(live, l_i, 1.0)
    o = acc_o / l_safe[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + rows64[:, None] * stride_om + offs_dv[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    lse = tl.where(live, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(LSE + b * stride_lb + h * stride_lh + rows64 * stride_lm, lse, mask=row_ok)
