"""The consumers of the sm_90 backward's `keys_n` tile (`bwd.py`; head dim 192: 96 keys per CTA,
48 per warpgroup, the keys on the N side of every GEMM), a mixin of `FlashBwdSm90`."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32
from cutlass.cute.nvgpu import warp, warpgroup

from ..common.seqlen_info import SeqlenInfo
from ..common.utils import acc_mn_view, transposed
from .bwd_sync import BARRIER_BOTH, BARRIER_WG, QueryWalk
from .wgmma import acc_as_mma_sync, gemm, gemm_accumulate_if, smem_operands


class KeysNConsumer:
    """Mixin of `FlashBwdSm90`: `consume_keys_n`."""

    @cute.jit
    def consume_keys_n(
        self, ctidx, tma_dQ, tma_mdQ, mdK, mdV, sQ, sdO, sK, sV, sdS, sLSE, sD, sdQ, pipeline_kv, pipeline_q,
        tiled_mma_SdP: cute.TiledMma, tiled_mma_dK: cute.TiledMma, tiled_mma_dV: cute.TiledMma,
        tiled_mma_dQ: cute.TiledMma, seqlen: SeqlenInfo, n_block, head_k, batch, walk: QueryWalk,
        left, right, softmax_scale, softmax_scale_log2, softcap_prescale, pipeline_do,
    ):
        """The consumer warpgroups of the `keys_n` tile (head dim 192, 96 keys per CTA): warpgroup w
        owns keys [48w, 48w + 48) and keeps dK^T and dV^T (the whole head dims x its keys) in fp32
        registers. Per query block:

            S  = Q K_w^T,  dP = dO V_w^T            (A = Q, dO; B = K, V rows: shared memory)
            P  = exp2(S * scale_log2 - LSE_log2[query])   0 where masked
            P  -> shared memory as P^T (keys x queries), then dV^T += dO^T P   (B = P^T)
            dS = P * (dP - D[query])  -> shared memory as dS^T, then both warpgroups' are waited for
            dQ = dS K[:, half w]  (all 96 keys: the dQ tile of `dq_split`, to the writer warp)
            dK^T += Q^T dS                                       (B = dS^T)

        The tails, masks, soft-capping and the dQ writer are those of `consume`; dK and dV go out
        through the shared memory of K and V. With `single_dout` dO and D come through a
        one-stage ring of their own (`pipeline_do`), released once dV^T is done, and dS^T has one
        buffer: a warpgroup writes its rows only after the other has arrived from the previous
        block's dQ GEMM (`barrier_ds_read`)."""
        cfg = self.cfg
        wg_idx = cute.arch.make_warp_uniform(ctidx // 128)
        # (dK^T and dV^T share one tiled MMA: head dim x keys; `__call__`)
        (thr_mma_SdP, wg_mma_SdP), (thr_mma_dK, wg_mma_dK), (thr_mma_dV, wg_mma_dV), (thr_mma_dQ, wg_mma_dQ) = (
            self.mma_slices(ctidx, wg_idx, tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ))

        # S = Q K^T and dP = dO V^T: queries on M
        tSrQ, tSrK = smem_operands(tiled_mma_SdP, wg_mma_SdP, sQ, sK)
        tdPrdO, tdPrV = smem_operands(tiled_mma_SdP, wg_mma_SdP, sdO, sV)
        # dV^T / dK^T: A the MN-major views of dO and Q, B the warpgroup's keys of P^T / dS^T
        tdVrdOt = tiled_mma_dV.make_fragment_A(wg_mma_dV.partition_A(transposed(sdO)))
        tdKrQt, tdKVrPdS = smem_operands(tiled_mma_dK, wg_mma_dK, transposed(sQ), sdS)  # (..., ds_stages + 1)
        # dQ: A = dS (MN-major view of dS^T, all 96 keys), B = K^T over this warpgroup's columns
        sK_wg = cute.local_tile(sK, (cfg.tile_n, cfg.dq_cols), (0, wg_idx))
        tdQrdS, tdQrKt = smem_operands(tiled_mma_dQ, wg_mma_dQ, transposed(sdS), transposed(sK_wg))
        # P and dS (queries x keys fragments) into the (keys, queries) tiles: transposing stmatrix
        stsm_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(True, 4), self.dtype), tiled_mma_SdP
        ).get_slice(ctidx)
        tPdSsPdS = stsm_PdS.partition_D(transposed(sdS))  # (..., ds_stages + 1)
        p_stage = cfg.ds_stages
        r2s_dQ, tdQsdQ, dq_swap = self.dq_smem_copy(tiled_mma_dQ, sdQ, wg_idx, ctidx)

        tile_S = (cfg.tile_m, cfg.tile_n)
        # (query, key) coordinates: this thread's first and thread 0's (see `consume`)
        cS = cute.make_identity_tensor(tile_S)
        thr_query, thr_key = acc_mn_view(acc_as_mma_sync(thr_mma_SdP.partition_C(cS)))[0, 0]
        t0ScS_mn = acc_mn_view(acc_as_mma_sync(tiled_mma_SdP.get_slice(0).partition_C(cS)))
        rP = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), self.dtype)
        rdS = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), self.dtype)
        acc_dK = cute.make_rmem_tensor(thr_mma_dK.partition_shape_C((cfg.head_dim, cfg.tile_n)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_mma_dV.partition_shape_C((cfg.head_dim_v, cfg.tile_n)), Float32)
        rows_k = seqlen.seqlen_k - n_block * cfg.tile_n

        if walk.m_steps > 0:
            pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            offset, n_lo, stat_query = self.walk_start(sK, sV, rows_k, seqlen, n_block, thr_query, ctidx, wg_idx)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
            do_state = None
            if cutlass.const_expr(cfg.single_dout):
                do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.dout_stages)
            steps = walk.steps
            for it in cutlass.range(steps, unroll=1):
                _, m_block = walk.coords(it)
                m_lo = m_block * cfg.tile_m
                stage = state.index
                pipeline_q.consumer_wait(state)
                do_stage = stage  # of dO and D
                if cutlass.const_expr(cfg.single_dout):
                    pipeline_do.consumer_wait(do_state)
                    do_stage = do_state.index
                sLSE_thr = cute.domain_offset((stat_query,), sLSE[None, stage])
                sD_thr = cute.domain_offset((stat_query,), sD[None, do_stage])
                acc_S = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), Float32)
                acc_dP = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), Float32)
                gemm(tiled_mma_SdP, acc_S, tSrQ[None, None, None, stage], tSrK, zero_init=True)
                if cutlass.const_expr(not cfg.softcap):
                    gemm(tiled_mma_SdP, acc_dP, tdPrdO[None, None, None, do_stage], tdPrV, zero_init=True)
                if cutlass.const_expr(cfg.dq_fence_late):
                    if it > 0:
                        self.hand_over_dq(wg_idx, (it - 1) % cfg.dq_stages)
                warpgroup.wait_group(0 if cutlass.const_expr(cfg.softcap) else 1)  # S is in

                if self.masked_block(seqlen, n_lo, m_lo, offset, left, right):
                    limits = self.hidden_limits(seqlen, n_lo + thr_key, m_lo + thr_query, offset, left, right)
                    self.probs(acc_S, rP, sLSE_thr, None, t0ScS_mn, limits, softmax_scale_log2, softcap_prescale,
                               query_mode=0)
                else:
                    self.probs(acc_S, rP, sLSE_thr, None, t0ScS_mn, None, softmax_scale_log2, softcap_prescale,
                               query_mode=0)
                if cutlass.const_expr(cfg.softcap):
                    gemm(tiled_mma_SdP, acc_dP, tdPrdO[None, None, None, do_stage], tdPrV, zero_init=True)
                else:
                    rP.store(acc_S.load().to(self.dtype))
                # this warpgroup's P^T rows, read only by its own dV^T GEMM (waited for below)
                cute.copy(stsm_PdS, stsm_PdS.retile(rP), tPdSsPdS[None, None, None, p_stage])
                if cutlass.const_expr(not cfg.dv_after_ds):
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=BARRIER_WG + wg_idx, number_of_threads=128)
                    gemm_accumulate_if(tiled_mma_dV, acc_dV, tdVrdOt[None, None, None, do_stage],
                                       tdKVrPdS[None, None, None, p_stage], it > 0)
                warpgroup.wait_group(0 if cutlass.const_expr(cfg.dv_after_ds) else 1)  # dP is in; dV^T runs on

                # dS = P (dP - D), with soft-capping P (1 - tanh^2) (dP - D)
                acc_S_mn = acc_mn_view(acc_as_mma_sync(acc_S))
                acc_dP_mn = acc_mn_view(acc_as_mma_sync(acc_dP))
                for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                    d_row = sD_thr[t0ScS_mn[r, 0][0]]
                    for c in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
                        acc_dP_mn[r, c] = acc_S_mn[r, c] * (acc_dP_mn[r, c] - d_row)
                rdS.store(acc_dP.load().to(self.dtype))
                ds_stage = it % cfg.ds_stages
                if cutlass.const_expr(cfg.single_dout):
                    if it > 0:  # the other warpgroup's last dQ GEMM has read the one dS^T buffer
                        cute.arch.barrier(barrier_id=self.barrier_ds_read + 1 - wg_idx,
                                          number_of_threads=self.num_consumer_threads)
                cute.copy(stsm_PdS, stsm_PdS.retile(rdS), tPdSsPdS[None, None, None, ds_stage])
                cute.arch.fence_view_async_shared()
                # both warpgroups' dS^T rows are in (see `consume` for the two buffers)
                cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
                if cutlass.const_expr(cfg.dv_after_ds):  # (flash-attn-4's order)
                    gemm_accumulate_if(tiled_mma_dV, acc_dV, tdVrdOt[None, None, None, do_stage],
                                       tdKVrPdS[None, None, None, p_stage], it > 0)
                acc_dQ = cute.make_rmem_tensor(thr_mma_dQ.partition_shape_C((cfg.tile_m, cfg.dq_cols)), Float32)
                gemm(tiled_mma_dQ, acc_dQ, tdQrdS[None, None, None, ds_stage], tdQrKt, zero_init=True)
                gemm_accumulate_if(tiled_mma_dK, acc_dK, tdKrQt[None, None, None, stage],
                                   tdKVrPdS[None, None, None, ds_stage], it > 0)
                warpgroup.wait_group(1)  # dV^T and dQ are in; dK^T runs on
                if cutlass.const_expr(cfg.single_dout):
                    pipeline_do.consumer_release(do_state)  # dV^T was the last reader of dO
                    do_state.advance()
                    if it + 1 < steps:  # this warpgroup is done reading dS^T
                        cute.arch.barrier_arrive(barrier_id=self.barrier_ds_read + wg_idx,
                                                 number_of_threads=self.num_consumer_threads)

                self.write_dq_tile(r2s_dQ, acc_dQ, tdQsdQ, dq_swap, wg_idx, it, sdQ[None, None, wg_idx, None])
                warpgroup.wait_group(0)  # dK^T is in: the end of every read of this stage
                pipeline_q.consumer_release(state)
                state.advance()
            if cutlass.const_expr(cfg.dq_fence_late):
                self.hand_over_dq(wg_idx, (steps - 1) % cfg.dq_stages)
            acc_dK.store(acc_dK.load() * softmax_scale)
            # (every dQ GEMM, which reads all of K, is done before K's memory is rewritten)
            self.stage_dkv(acc_dK, acc_dV, sK, sV, tiled_mma_dK, tiled_mma_dV, ctidx, transpose=True)
        else:  # no query block sees these keys: dK = dV = 0
            self.zero_rows(sK, cfg.head_dim, 0, ctidx, wg_idx)
            self.zero_rows(sV, cfg.head_dim_v, 0, ctidx, wg_idx)
        self.store_dkv(sK, sV, mdK, mdV, seqlen, batch, head_k, n_block, ctidx)
