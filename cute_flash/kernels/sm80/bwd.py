"""FlashAttention-2 backward for sm_80 and later: cp.async + ldmatrix + mma.sync.

One CTA owns `tile_n` keys of one (KV head, batch) and keeps their dK and dV in fp32 registers
while it walks, for every query head of the GQA group in turn, the query blocks that see those
keys. The group's sum is therefore formed in registers and dK/dV are written once, already in
the input dtype: no fp32 dK/dV buffers and no reduction pass.

Everything is computed transposed (keys x queries), so that the probabilities come out of the
MMA in the A-operand layout of the key-side products and never touch shared memory:

    S^T  = K Q^T                     (A = K, B = Q, both from shared memory)
    P^T  = exp2(S^T * scale_log2 - LSE_log2[query])     LSE_log2 = +inf for rows that saw no key
    dV  += P^T dO                    (A = P^T from registers, B = dO^T by transposing ldmatrix)
    dP^T = V dO^T                    (A = V, B = dO)
    dS^T = P^T * (dP^T - D[query])   [* (1 - tanh^2) with soft-capping]
    dK  += dS^T Q                    (A = dS^T from registers, B = Q^T by transposing ldmatrix)
    dQ   = dS K                      (dS^T staged in shared memory, read transposed; B = K^T)

dQ of the query block is added to an fp32 accumulator in global memory with `red.add` (the
preprocess kernel cleared it; the postprocess kernel scales and rounds it). The softmax scale is
applied once: to dK here and to dQ in the postprocess. Above head dim 128 the CTAs of a key
block split the columns of dK, dV and dQ (`col_tiles`, see `bwd_config`): S^T and dP^T take all
of Q, K, V and dO, the three accumulating products only the CTA's columns of dO, Q and K.

Tails: Q and dO rows past seqlen_q are zero-filled and their LSE_log2 is +inf, so their P and
dS are 0, and their dQ is not added. K and V rows past seqlen_k are zero-filled and their P is
set to 0 like a masked score's: unmasked, exp2(0 - LSE_log2) can overflow for a row whose LSE is
very negative, and an inf in dS would turn dQ += dS K into NaN even against K = 0. Rows of dK
and dV past seqlen_k are not stored.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from ..common.block_info import BlockInfo, effective_window
from ..common.fake_tensors import element_type
from ..common.seqlen_info import SeqlenInfo
from ..common.smem_layouts import smem_layout_tile, smem_layout_transposed, swizzle_params
from ..common.utils import (
    acc_as_operand_a,
    acc_mn_view,
    col_predicate,
    cp_async_tile,
    elem_pointer,
    exp2f,
    make_g2s_copy,
    pass_turn,
    tanhf,
    wait_for_turn,
)
from .bwd_config import Sm80BwdConfig
from .mma import gemm_rs, gemm_ss


class FlashBwdSm80:
    """The sm_80 backward kernel for one `Sm80BwdConfig`."""

    def __init__(self, config: Sm80BwdConfig):
        self.cfg = config
        self.dtype = element_type(config.dtype)
        self.num_threads = config.num_warps * 32

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d) or varlen (total_q, h, d)
        mK: cute.Tensor,  # (b, sk, hk, d) or varlen (total_k, hk, d)
        mV: cute.Tensor,  # (b, sk, hk, dv) or varlen (total_k, hk, dv)
        mdO: cute.Tensor,  # like mQ with dv
        mLSE: cute.Tensor,  # float32 log2-space LSE (b, h, sq) or varlen (h, total_q)
        mD: cute.Tensor,  # float32 rowsum(dO * O) - dlse, like mLSE
        mdQaccum: cute.Tensor,  # float32, like mQ with the padded tile head dim
        mdK: cute.Tensor,  # like mK
        mdV: cute.Tensor,  # like mV
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mdQsem: Optional[cute.Tensor],  # int32 (b, h, query blocks) of zeros with `deterministic`
        num_batch: Int32,
        max_seqlen_k: Int32,
        softmax_scale: Float32,
        softmax_scale_log2: Float32,  # scale * log2(e), or softcap * log2(e) with softcap
        softcap_prescale: Float32,  # scale / softcap (unused without softcap)
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        bits = self.dtype.width
        # swizzle atoms of the column tiles' width (`col_tile_t`): the whole head dim without them
        sQ_layout = smem_layout_tile(bits, cfg.tile_m, cfg.head_dim, atom_cols_of=cfg.dk_cols)
        sdO_layout = smem_layout_tile(bits, cfg.tile_m, cfg.head_dim_v, atom_cols_of=cfg.dv_cols)
        sK_layout = smem_layout_tile(bits, cfg.tile_n, cfg.head_dim, atom_cols_of=cfg.dk_cols)
        sV_layout = smem_layout_tile(bits, cfg.tile_n, cfg.head_dim_v, atom_cols_of=cfg.dv_cols)
        sdS_layout = smem_layout_tile(bits, cfg.tile_n, cfg.tile_m)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cfg.tile_m], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, cfg.tile_m], 128]

        gmem_copy_QK = make_g2s_copy(self.dtype, self.num_threads, swizzle_params(bits, cfg.dk_cols).atom_cols)
        gmem_copy_VdO = make_g2s_copy(self.dtype, self.num_threads, swizzle_params(bits, cfg.dv_cols).atom_cols)

        atom = warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16))
        # key-side products (S^T, dP^T, dV, dK): warps split the keys, 16 each, so that every
        # warp holds whole rows of P^T and dS^T, which is what the A operand from registers needs
        tiled_mma = cute.make_tiled_mma(atom, (cfg.num_warps, 1, 1), permutation_mnk=(cfg.num_warps * 16, 16, 16))
        dq_warps_n = cfg.num_warps // cfg.dq_warps_m
        tiled_mma_dq = cute.make_tiled_mma(
            atom, (cfg.dq_warps_m, dq_warps_n, 1), permutation_mnk=(cfg.dq_warps_m * 16, dq_warps_n * 16, 16)
        )

        num_n_blocks = (max_seqlen_k + cfg.tile_n - 1) // cfg.tile_n
        num_heads_k = mK.shape[2] if cutlass.const_expr(not cfg.varlen_k) else mK.shape[1]
        self.kernel(
            mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mdQsem,
            softmax_scale, softmax_scale_log2, softcap_prescale, window_left, window_right,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
            gmem_copy_QK, gmem_copy_VdO, tiled_mma, tiled_mma_dq, SharedStorage,
        ).launch(
            grid=[num_n_blocks * cfg.col_tiles, num_heads_k, num_batch],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mD: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mdQsem: Optional[cute.Tensor],
        softmax_scale: Float32,
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        gmem_copy_QK: cute.TiledCopy,
        gmem_copy_VdO: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_k, batch = cute.arch.block_idx()
        col_block = 0  # the CTA's column tile of dK, dV and dQ
        if cutlass.const_expr(cfg.col_tiles > 1):
            col_block = n_block % cfg.col_tiles
            n_block = n_block // cfg.col_tiles
        seqlen = SeqlenInfo.create(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        if n_block * cfg.tile_n < seqlen.seqlen_k:
            self.key_block(
                mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mdQsem, seqlen, n_block, col_block, head_k, batch, tidx,
                softmax_scale, softmax_scale_log2, softcap_prescale, window_left, window_right,
                sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
                gmem_copy_QK, gmem_copy_VdO, tiled_mma, tiled_mma_dq, SharedStorage,
            )

    @cute.jit
    def key_block(
        self,
        mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mdQsem, seqlen: SeqlenInfo, n_block, col_block, head_k, batch,
        tidx,
        softmax_scale, softmax_scale_log2, softcap_prescale, window_left, window_right,
        sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
        gmem_copy_QK, gmem_copy_VdO, tiled_mma, tiled_mma_dq, SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        bits = self.dtype.width
        num_heads = mQ.shape[2] if cutlass.const_expr(not cfg.varlen_q) else mQ.shape[1]
        num_heads_k = mK.shape[2] if cutlass.const_expr(not cfg.varlen_k) else mK.shape[1]
        group = num_heads // num_heads_k
        headdim = mQ.shape[3] if cutlass.const_expr(not cfg.varlen_q) else mQ.shape[2]
        headdim_v = mV.shape[3] if cutlass.const_expr(not cfg.varlen_k) else mV.shape[2]

        # ---- shared memory (and the transposed views the MMAs read through ldmatrix.trans) ----
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sdO = storage.sdO.get_tensor(sdO_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        sdS = storage.sdS.get_tensor(sdS_layout)
        sLSE = storage.sLSE.get_tensor(cute.make_layout(cfg.tile_m))
        sD = storage.sD.get_tensor(cute.make_layout(cfg.tile_m))
        # the operands of the accumulating products: this CTA's columns of Q, dO and K, transposed
        sQt = self.col_tile_t(sQ, cfg.tile_m, cfg.dk_cols, col_block)
        sdOt = self.col_tile_t(sdO, cfg.tile_m, cfg.dv_cols, col_block)
        sKt = self.col_tile_t(sK, cfg.tile_n, cfg.dk_cols, col_block)
        sdSt = cute.make_tensor(sdS.iterator, smem_layout_transposed(bits, cfg.tile_n, cfg.tile_m))

        # ---- gmem -> smem copies of this CTA's K and V (once) ----
        gK = cute.local_tile(seqlen.k_rows(mK, batch, head_k), (cfg.tile_n, cfg.head_dim), (n_block, 0))
        gV = cute.local_tile(seqlen.k_rows(mV, batch, head_k), (cfg.tile_n, cfg.head_dim_v), (n_block, 0))
        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_VdO = gmem_copy_VdO.get_slice(tidx)
        tKcK = thr_copy_QK.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim)))
        tVcV = thr_copy_VdO.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim_v)))
        tQcQ = thr_copy_QK.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim)))
        tdOcdO = thr_copy_VdO.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v)))
        # column predicates depend only on the column: Q shares K's, dO shares V's
        tQKpD = col_predicate(tKcK, headdim) if cutlass.const_expr(cfg.check_hdim) else None
        tVpD = col_predicate(tVcV, headdim_v) if cutlass.const_expr(cfg.check_hdim_v) else None
        k_rows = seqlen.seqlen_k - n_block * cfg.tile_n
        cp_async_tile(gmem_copy_QK, thr_copy_QK.partition_S(gK), thr_copy_QK.partition_D(sK), tKcK, tQKpD, k_rows)
        cp_async_tile(gmem_copy_VdO, thr_copy_VdO.partition_S(gV), thr_copy_VdO.partition_D(sV), tVcV, tVpD, k_rows)
        cute.arch.cp_async_commit_group()

        # ---- MMA partitions ----
        thr_mma = tiled_mma.get_slice(tidx)
        thr_mma_dq = tiled_mma_dq.get_slice(tidx)
        tSrK = thr_mma.make_fragment_A(thr_mma.partition_A(sK))
        tSrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ))
        tdPrV = thr_mma.make_fragment_A(thr_mma.partition_A(sV))
        tdPrdO = thr_mma.make_fragment_B(thr_mma.partition_B(sdO))
        tdVrdOt = thr_mma.make_fragment_B(thr_mma.partition_B(sdOt))
        tdKrQt = thr_mma.make_fragment_B(thr_mma.partition_B(sQt))
        tdQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdSt))
        tdQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt))

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        smem_copy_A = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        smem_copy_B = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        smem_copy_Bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        smem_copy_dq_At = cute.make_tiled_copy_A(ldsm_t, tiled_mma_dq).get_slice(tidx)
        smem_copy_dq_Bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma_dq).get_slice(tidx)
        tSsK = smem_copy_A.partition_S(sK)
        tSsQ = smem_copy_B.partition_S(sQ)
        tdPsV = smem_copy_A.partition_S(sV)
        tdPsdO = smem_copy_B.partition_S(sdO)
        tdVsdOt = smem_copy_Bt.partition_S(sdOt)
        tdKsQt = smem_copy_Bt.partition_S(sQt)
        tdQsdS = smem_copy_dq_At.partition_S(sdSt)
        tdQsKt = smem_copy_dq_Bt.partition_S(sKt)
        smem_copy_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
        ).get_slice(tidx)
        tdSsdS = smem_copy_dS.partition_D(sdS)

        # this thread's (key, query) coordinates inside an S^T tile
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_n, cfg.tile_m))))

        acc_dK = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_n, cfg.dk_cols)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_n, cfg.dv_cols)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # ---- the query blocks that see at least one of these keys ----
        offset = seqlen.seqlen_k - seqlen.seqlen_q  # query i is aligned with key i + offset
        left, right = effective_window(seqlen, window_left, window_right, cfg.local)
        if cutlass.const_expr(cfg.causal):
            right = Int32(0)
        block_info = BlockInfo(cfg.tile_m, cfg.tile_n, cfg.causal, cfg.local, left, right)
        m_block_min, m_block_max = block_info.m_block_range(seqlen, n_block)
        m_steps = cutlass.max(m_block_max - m_block_min, 0)
        n_lo = n_block * cfg.tile_n  # the first key of this block

        for it in cutlass.range(m_steps * group, unroll=1):
            head = head_k * group + it // m_steps
            m_block = m_block_min + it % m_steps
            rows_q = seqlen.seqlen_q - m_block * cfg.tile_m
            # every warp is done with the previous block's Q, dO, LSE, D and dS
            cute.arch.barrier()
            gQ = cute.local_tile(seqlen.q_rows(mQ, batch, head), (cfg.tile_m, cfg.head_dim), (m_block, 0))
            gdO = cute.local_tile(seqlen.q_rows(mdO, batch, head), (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
            cp_async_tile(gmem_copy_QK, thr_copy_QK.partition_S(gQ), thr_copy_QK.partition_D(sQ), tQcQ, tQKpD, rows_q)
            cp_async_tile(gmem_copy_VdO, thr_copy_VdO.partition_S(gdO), thr_copy_VdO.partition_D(sdO), tdOcdO, tVpD,
                           rows_q)
            cute.arch.cp_async_commit_group()
            if tidx < cfg.tile_m:
                gLSE = cute.local_tile(seqlen.lse_row(mLSE, batch, head), (cfg.tile_m,), (m_block,))
                gD = cute.local_tile(seqlen.lse_row(mD, batch, head), (cfg.tile_m,), (m_block,))
                if tidx < rows_q:
                    sLSE[tidx] = gLSE[tidx]
                    sD[tidx] = gD[tidx]
                else:  # rows past the sequence (never read from memory): P = exp2(s - inf) = 0
                    sLSE[tidx] = Float32.inf
                    sD[tidx] = Float32(0.0)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

            # ---- S^T = K Q^T, P^T ----
            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_n, cfg.tile_m)), Float32)
            acc_S.fill(0.0)
            gemm_ss(tiled_mma, acc_S, tSrK, tSrQ, tSsK, tSsQ, smem_copy_A, smem_copy_B)
            acc_S_mn = acc_mn_view(acc_S)
            if cutlass.const_expr(cfg.softcap):
                # keep tanh in acc_S for the chain rule; P goes into its own fragment
                acc_P = cute.make_fragment_like(acc_S, Float32)
            else:
                acc_P = acc_S
            acc_P_mn = acc_mn_view(acc_P)
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                key = n_lo + tScS_mn[r, 0][0]
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    col = tScS_mn[r, c][1]
                    s = acc_S_mn[r, c]
                    if cutlass.const_expr(cfg.softcap):
                        s = tanhf(s * softcap_prescale)
                        acc_S_mn[r, c] = s
                    p = exp2f(s * softmax_scale_log2 - sLSE[col])
                    hidden = key >= seqlen.seqlen_k
                    if cutlass.const_expr(cfg.causal or cfg.local):
                        query = m_block * cfg.tile_m + col + offset
                        hidden = hidden | (key > query + right)
                        if cutlass.const_expr(cfg.local):
                            hidden = hidden | (key < query - left)
                    acc_P_mn[r, c] = Float32(0.0) if hidden else p

            # ---- dP^T = V dO^T; dS^T = P^T (dP^T - D) ----
            acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_n, cfg.tile_m)), Float32)
            acc_dP.fill(0.0)
            gemm_ss(tiled_mma, acc_dP, tdPrV, tdPrdO, tdPsV, tdPsdO, smem_copy_A, smem_copy_B)

            # ---- dV += P^T dO ----
            rP = cute.make_fragment_like(acc_P, self.dtype)
            rP.store(acc_P.load().to(self.dtype))
            gemm_rs(tiled_mma, acc_dV, acc_as_operand_a(rP), tdVrdOt, tdVsdOt, smem_copy_Bt)

            acc_dP_mn = acc_mn_view(acc_dP)
            for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
                    ds = acc_P_mn[r, c] * (acc_dP_mn[r, c] - sD[tScS_mn[r, c][1]])
                    if cutlass.const_expr(cfg.softcap):
                        t = acc_S_mn[r, c]
                        ds = ds * (1.0 - t * t)
                    acc_dP_mn[r, c] = ds
            rdS = cute.make_fragment_like(acc_dP, self.dtype)
            rdS.store(acc_dP.load().to(self.dtype))

            # ---- dK += dS^T Q ----
            gemm_rs(tiled_mma, acc_dK, acc_as_operand_a(rdS), tdKrQt, tdKsQt, smem_copy_Bt)

            # ---- dQ = dS K, added to the fp32 accumulator ----
            cute.copy(smem_copy_dS, smem_copy_dS.retile(rdS), tdSsdS)
            cute.arch.barrier()
            acc_dQ = cute.make_rmem_tensor(thr_mma_dq.partition_shape_C((cfg.tile_m, cfg.dk_cols)), Float32)
            acc_dQ.fill(0.0)
            gemm_ss(tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, tdQsdS, tdQsKt, smem_copy_dq_At, smem_copy_dq_Bt)
            gdQ = cute.local_tile(seqlen.q_rows(mdQaccum, batch, head), (cfg.tile_m, cfg.dk_cols), (m_block, col_block))
            tdQgdQ = thr_mma_dq.partition_C(gdQ)
            tdQcdQ = thr_mma_dq.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.dk_cols)))
            sem_ptr, turn = None, None
            if cutlass.const_expr(cfg.deterministic):
                # this CTA's turn at the query block: the key blocks that see it add in order
                # (one turn counter per column tile: their additions touch different columns)
                sem_ptr = elem_pointer(mdQsem, (batch, head, m_block * cfg.col_tiles + col_block))
                turn = block_info.key_block_turn(seqlen, n_block, m_block)
                if tidx == 0:
                    wait_for_turn(sem_ptr, turn)
                cute.arch.barrier()
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                if tdQcdQ[i][0] < rows_q:
                    cute.arch.red(elem_pointer(tdQgdQ, i), acc_dQ[i], op="add", dtype="f32",
                                  sem="relaxed", scope="gpu")
            if cutlass.const_expr(cfg.deterministic):
                # every thread's additions are visible before the next key block's turn
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier()
                if tidx == 0:
                    pass_turn(sem_ptr, turn)

        # ---- epilogue: dK (scaled) and dV in the input dtype ----
        cute.arch.cp_async_wait_group(0)  # K and V land even when no query block sees them
        for i in cutlass.range_constexpr(cute.size(acc_dK)):
            acc_dK[i] = acc_dK[i] * softmax_scale
        self.store_rows(acc_dK, mdK, seqlen, batch, head_k, n_block, col_block, cfg.dk_cols, headdim,
                        cfg.check_hdim, thr_mma)
        self.store_rows(acc_dV, mdV, seqlen, batch, head_k, n_block, col_block, cfg.dv_cols, headdim_v,
                        cfg.check_hdim_v, thr_mma)

    @cute.jit
    def col_tile_t(self, sX: cute.Tensor, rows: cutlass.Constexpr, cols: cutlass.Constexpr, col_block) -> cute.Tensor:
        """The transposed (cols, rows) view of column tile `col_block` of a (rows, cols * col_tiles)
        shared-memory tile. The tile is built from the atom of `cols`-wide rows, whose panels lie
        one after the other (rows first, see `smem_layouts`), so a column tile is a tile of `cols`
        columns of its own starting `col_block * rows * cols` elements in, swizzled alike (a
        multiple of the 8-row atom)."""
        base = sX.iterator
        if cutlass.const_expr(self.cfg.col_tiles > 1):
            base = base + cute.assume(col_block * (rows * cols), divby=rows * cols)
        return cute.make_tensor(base, smem_layout_transposed(self.dtype.width, rows, cols))

    @cute.jit
    def store_rows(self, acc, mX, seqlen: SeqlenInfo, batch, head_k, n_block, col_block, tile_d: cutlass.Constexpr,
                   d, check_d: cutlass.Constexpr, thr_mma):
        """Round an fp32 (tile_n, tile_d) accumulator, column tile `col_block`, to the input dtype
        (RNE) and store its valid part."""
        cfg = self.cfg
        r = cute.make_fragment_like(acc, self.dtype)
        r.store(acc.load().to(self.dtype))
        gX = cute.local_tile(seqlen.k_rows(mX, batch, head_k), (cfg.tile_n, tile_d), (n_block, col_block))
        tXgX = thr_mma.partition_C(gX)
        tXcX = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_n, tile_d)))
        rows = seqlen.seqlen_k - n_block * cfg.tile_n
        for i in cutlass.range_constexpr(cute.size(r)):
            ok = tXcX[i][0] < rows
            if cutlass.const_expr(check_d):
                ok = ok & (tXcX[i][1] + col_block * tile_d < d)
            if ok:
                tXgX[i] = r[i]
