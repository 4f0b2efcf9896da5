"""Attention backward in Triton: three kernels, no atomics, so every run gives the same bits.

With P = exp2(S - LSE * log2 e) recomputed from the saved LSE (S in log2 space, see `common`):

    dV = P^T dO        dP = dO V^T        dS = P * (dP - D)  [* (1 - tanh^2) when soft-capped]
    dQ = scale * dS K  dK = scale * dS^T Q    with D = rowsum(dO * O) - dlse

1. `attn_bwd_delta`: D per (row, head), one program per (row block, head, batch). A gradient
   flowing into the LSE enters only here: d lse / d s = P, so it shifts D.
2. `attn_bwd_dkdv`: one program per (key block, KV head, batch) keeps dK and dV in fp32
   registers and walks every query block that sees its keys, for each query head of the GQA
   group in turn, so the group's sum needs no second pass.
3. `attn_bwd_dq`: one program per (query block, head, batch) walks the key blocks its rows see
   (as the forward does) and accumulates dQ in fp32 registers.

Rows whose LSE is -inf saw no key: their P is forced to 0 (LSE treated as +inf). Tiles read
past a sequence as 0 and masked scores give P = 0, so tails contribute nothing; dK/dV rows
past a sequence's keys are not written (the host zeroes them when `seqused_k` leaves them
unused).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LOG2E, SIZE_ARGS, key_range, log2_scores, mma, query_range, sequence_bounds, visible


@triton.jit(do_not_specialize=SIZE_ARGS)
def attn_bwd_delta(
    O, DO, DLSE, DELTA,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    nheads, num_m_blocks, seqlen,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    bh = pid // num_m_blocks
    h = (bh % nheads).to(tl.int64)
    b = (bh // nheads).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows64 = offs_m.to(tl.int64)
    row_ok = offs_m < seqlen
    tile_ok = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows64[:, None] * stride_om + offs_dv[None, :],
                mask=tile_ok, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows64[:, None] * stride_dom + offs_dv[None, :],
                 mask=tile_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * stride_lb + h * stride_lh + rows64 * stride_lm, mask=row_ok, other=0.0)
    tl.store(DELTA + b * stride_db + h * stride_dh + rows64 * stride_dm, delta, mask=row_ok)


@triton.jit(do_not_specialize=SIZE_ARGS)
def attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
    nheads_k, group, num_n_blocks, seqlen_q, seqlen_k,
    softmax_scale, qk_pre, qk_post, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    n_block = pid % num_n_blocks
    bh = pid // num_n_blocks
    hk = (bh % nheads_k).to(tl.int64)
    b = (bh // nheads_k).to(tl.int64)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_K
    )
    n_lo = n_block * BLOCK_N
    if n_lo >= seqlen_k:
        return

    offs_n = n_lo + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < seqlen_k
    keys64 = (k_start + offs_n).to(tl.int64)
    k_mask = col_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    v_mask = col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    k = tl.load(K + b * stride_kb + hk * stride_kh + keys64[:, None] * stride_kn + offs_d[None, :],
                mask=k_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + keys64[:, None] * stride_vn + offs_dv[None, :],
                mask=v_mask, other=0.0)

    acc_dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    acc_dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, hi = query_range(n_lo, n_lo + BLOCK_N, seqlen_q, seqlen_k, window_left, window_right,
                         HAS_LEFT, HAS_RIGHT, BLOCK_M)
    for g in range(group):
        h = hk * group + g
        Q_head = Q + b * stride_qb + h * stride_qh
        DO_head = DO + b * stride_dob + h * stride_doh
        LSE_head = LSE + b * stride_lb + h * stride_lh
        DELTA_head = DELTA + b * stride_db + h * stride_dh
        for m_lo in range(lo, hi, BLOCK_M):
            offs_m = m_lo + tl.arange(0, BLOCK_M)
            row_ok = offs_m < seqlen_q
            rows64 = (q_start + offs_m).to(tl.int64)
            q = tl.load(Q_head + rows64[:, None] * stride_qm + offs_d[None, :],
                        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            do = tl.load(DO_head + rows64[:, None] * stride_dom + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
            lse = tl.load(LSE_head + rows64 * stride_lm, mask=row_ok, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
            delta = tl.load(DELTA_head + rows64 * stride_dm, mask=row_ok, other=0.0)

            # Transposed tiles (keys x rows), so that dV and dK come out of the MMA unshuffled.
            qk_t = mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), DOT_IN_FP32)
            s_t = log2_scores(qk_t, qk_pre, qk_post, HAS_SOFTCAP)
            ok = visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                         HAS_LEFT, HAS_RIGHT)
            p_t = tl.where(ok, tl.exp2(s_t - lse[None, :]), 0.0)
            acc_dv = mma(p_t.to(do.dtype), do, acc_dv, DOT_IN_FP32)
            dp_t = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), DOT_IN_FP32)
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_SOFTCAP:
                tanh_t = s_t / qk_post
                ds_t = ds_t * (1.0 - tanh_t * tanh_t)
            acc_dk = mma(ds_t.to(q.dtype), q, acc_dk, DOT_IN_FP32)

    dk = acc_dk * softmax_scale
    tl.store(DK + b * stride_dkb + hk * stride_dkh + keys64[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + keys64[:, None] * stride_dvn + offs_dv[None, :],
             acc_dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit(do_not_specialize=SIZE_ARGS)
def attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    stride_dqb, stride_dqm, stride_dqh,
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
    nheads, group, num_m_blocks, seqlen_q, seqlen_k,
    softmax_scale, qk_pre, qk_post, window_left, window_right,
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
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qm + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows64[:, None] * stride_dom + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + rows64 * stride_lm, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(DELTA + b * stride_db + h * stride_dh + rows64 * stride_dm, mask=row_ok, other=0.0)

    K_seq = K + b * stride_kb + hk * stride_kh
    V_seq = V + b * stride_vb + hk * stride_vh
    acc_dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_range(m_lo, tl.minimum(m_lo + BLOCK_M, seqlen_q), seqlen_q, seqlen_k, window_left, window_right,
                       HAS_LEFT, HAS_RIGHT, BLOCK_N)
    for n_lo in range(lo, hi, BLOCK_N):
        offs_n = n_lo + tl.arange(0, BLOCK_N)
        col_ok = offs_n < seqlen_k
        keys64 = (k_start + offs_n).to(tl.int64)
        k = tl.load(K_seq + keys64[:, None] * stride_kn + offs_d[None, :],
                    mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        v = tl.load(V_seq + keys64[:, None] * stride_vn + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        qk = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_IN_FP32)
        s = log2_scores(qk, qk_pre, qk_post, HAS_SOFTCAP)
        ok = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                     HAS_LEFT, HAS_RIGHT)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_IN_FP32)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            tanh = s / qk_post
            ds = ds * (1.0 - tanh * tanh)
        acc_dq = mma(ds.to(k.dtype), k, acc_dq, DOT_IN_FP32)

    dq = acc_dq * softmax_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows64[:, None] * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)
