"""FlashAttention-2 forward for sm_80 and later: cp.async + ldmatrix + mma.sync.

One CTA computes one (query block, head, batch) tile of O:

1. cp.async (128-bit, zero-filled where out of range) brings the Q tile and the first K tile
   into swizzled shared memory. K and V live in `num_stages`-deep rings so that the copy of the
   next tile overlaps the MMAs of the current one.
2. Key blocks are visited from the last visible one down to the first: the first visited
   block is the only one that can be partial (key-length tail), and with a causal mask the
   diagonal blocks come first, so masking is confined to the first few iterations.
3. Per key block: ldmatrix feeds S = Q K^T (mma.sync m16n8k16, fp32 accumulators); the mask
   sets hidden scores to -inf; the online softmax (exp2, scale folded into log2 space, quad
   shuffles for row reductions) turns S into P and rescales O; P is converted to fp16/bf16 in
   registers and used directly as the A operand of O += P V (V^T via transposing ldmatrix).
4. Epilogue: O / rowsum is rounded to the input dtype (round-to-nearest-even), staged in
   shared memory (over the Q tile), and stored with 128-bit predicated stores; the LSE
   (natural log, float32) is written by the lane that owns column 0 of each row.

The ping-pong schedule (`pingpong`: 8 warps, 256 rows, unmasked calls) runs the same steps in two
groups of four warps that take turns, one group's MMAs (P V of a block, then S of the next)
beside the other's softmax, each SM sub-partition holding one warp of each; see `attend_pingpong`.

Tiles that hold no visible key do no loads and no MMAs; their rows get O = 0 and LSE = -inf.
A CTA whose query rows all lie past seqlen_q writes nothing.

Paged KV (`paged_kv`): K/V rows are gathered page by page (`common/paged.py`); everything else
is unchanged. Split-KV (`split_kv`): the grid's z mode is (split, batch); the key blocks
[0, n_blocks) of a sequence are cut into `num_splits` runs of n_per_split = ceil(n_blocks /
num_splits) and split s attends run s (intersected with the mask's range), writing its
normalised O and its LSE in float32 to the partial buffers (`kernels/combine.py` merges them).
A split whose run starts at or past n_blocks exits before touching memory, so a grid sized
for the longest sequence (e.g. a captured CUDA graph) writes nothing for the surplus splits;
the combine derives the same count of live splits from the same lengths.
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
from ..common.mask import AttentionMask
from ..common.paged import PagedKV
from ..common.seqlen_info import SeqlenInfo
from ..common.smem_layouts import swizzle_params, smem_layout_tile
from ..common.softmax import OnlineSoftmax
from ..common.tiles import LAZY_RESCALE_LOG2
from ..common.utils import (
    acc_as_operand_a,
    acc_mn_view,
    col_predicate,
    cp_async_tile,
    make_g2s_copy,
    make_s2g_copy,
    store_staged_rows,
    tanhf,
)
from .fwd_config import Sm80FwdConfig
from .mma import gemm_rs, gemm_ss


class FlashFwdSm80:
    """The sm_80 forward kernel for one `Sm80FwdConfig` (all compile-time choices live there)."""

    def __init__(self, config: Sm80FwdConfig):
        self.cfg = config
        self.dtype = element_type(config.dtype)
        self.num_threads = config.num_warps * 32
        # K and V copies partition a key tile the same way (one thread layout, same rows per
        # thread) when their rows have the same swizzle atom width: a paged cache with pages
        # smaller than a tile then looks up a key block's pages once for both, with two stages. With one stage the pages held
        # from the K copy to the V copy, across O += P V, spilled the 128x128 tile; its V copy
        # repeats the lookup instead, which then hits L1 (the K copy's lookup loaded the entries).
        bits = self.dtype.width
        self.kv_rows_shared = config.num_stages == 2 and (
            swizzle_params(bits, config.head_dim).atom_cols == swizzle_params(bits, config.head_dim_v).atom_cols
        )

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d) or varlen (total_q, h, d)
        mK: cute.Tensor,  # (b, sk, hk, d) or varlen (total_k, hk, d)
        mV: cute.Tensor,  # (b, sk, hk, dv) or varlen (total_k, hk, dv)
        mO: cute.Tensor,  # like mQ with dv
        mLSE: Optional[cute.Tensor],  # float32 (b, h, sq) or varlen (h, total_q)
        mCuSeqlensQ: Optional[cute.Tensor],  # int32 (b + 1)
        mCuSeqlensK: Optional[cute.Tensor],  # int32 (b + 1)
        mSeqUsedK: Optional[cute.Tensor],  # int32 (b)
        num_batch: Int32,
        max_seqlen_q: Int32,
        softmax_scale_log2: Float32,  # scale * log2(e), or softcap * log2(e) with softcap
        softcap_prescale: Float32,  # scale / softcap (unused without softcap)
        window_left: Int32,  # -1 = unbounded
        window_right: Int32,
        mPageTable: Optional[cute.Tensor],  # int32 (b, max_pages), with paged_kv
        mOPartial: Optional[cute.Tensor],  # float32 (splits, *O's shape), with split_kv
        mLSEPartial: Optional[cute.Tensor],  # float32 (splits, *LSE's shape), with split_kv
        num_splits: Int32,  # 1 without split_kv
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        bits = self.dtype.width
        sQ_layout = smem_layout_tile(bits, cfg.tile_m, cfg.head_dim)
        sK_layout = smem_layout_tile(bits, cfg.tile_n, cfg.head_dim, cfg.num_stages)
        sV_layout = smem_layout_tile(bits, cfg.tile_n, cfg.head_dim_v, cfg.num_stages)
        sO_layout = smem_layout_tile(bits, cfg.tile_m, cfg.head_dim_v)

        # O is staged over Q once Q is no longer needed; the region holds either.
        sQO_elems = max(cute.cosize(sQ_layout), cute.cosize(sO_layout))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, sQO_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        qk_atom_cols = swizzle_params(bits, cfg.head_dim).atom_cols
        vo_atom_cols = swizzle_params(bits, cfg.head_dim_v).atom_cols
        gmem_copy_QK = make_g2s_copy(self.dtype, self.num_threads, qk_atom_cols)
        gmem_copy_V = make_g2s_copy(self.dtype, self.num_threads, vo_atom_cols)
        gmem_copy_O = make_s2g_copy(self.dtype, self.num_threads, vo_atom_cols)

        # Warps split the query rows; a 16-wide N permutation lets one ldmatrix.x4 feed two n8 MMAs.
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (cfg.num_warps, 1, 1),
            permutation_mnk=(cfg.num_warps * 16, 16, 16),
        )

        num_m_blocks = (max_seqlen_q + cfg.tile_m - 1) // cfg.tile_m
        num_heads = mQ.shape[2] if cutlass.const_expr(not cfg.varlen_q) else mQ.shape[1]
        grid_z = num_batch * num_splits if cutlass.const_expr(cfg.split_kv) else num_batch
        self.kernel(
            mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, mOPartial, mLSEPartial,
            softmax_scale_log2, softcap_prescale, window_left, window_right, num_splits,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            gmem_copy_QK, gmem_copy_V, gmem_copy_O, tiled_mma, SharedStorage,
        ).launch(
            grid=[num_m_blocks, num_heads, grid_z],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.cfg.min_ctas_per_sm,
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
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        mOPartial: Optional[cute.Tensor],
        mLSEPartial: Optional[cute.Tensor],
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        gmem_copy_QK: cute.TiledCopy,
        gmem_copy_V: cute.TiledCopy,
        gmem_copy_O: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        block_x, head, block_z = cute.arch.block_idx()
        m_block = block_x
        if cutlass.const_expr(cfg.causal):
            # Causal query blocks near the end see the most keys: launch them first.
            m_block = cute.arch.grid_dim()[0] - 1 - block_x
        batch, split = block_z, Int32(0)
        if cutlass.const_expr(cfg.split_kv):
            batch, split = block_z // num_splits, block_z % num_splits

        seqlen = SeqlenInfo.create(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        if cutlass.const_expr(cfg.paged_kv and not cfg.seqused_k):
            # mK.shape[1] is the page size here, not a sequence length
            seqlen = SeqlenInfo(seqlen.offset_q, seqlen.offset_k, seqlen.seqlen_q,
                                PagedKV.capacity(mPageTable, mK), seqlen.varlen_q, seqlen.varlen_k)
        split_range = None
        live = m_block * cfg.tile_m < seqlen.seqlen_q
        if cutlass.const_expr(cfg.split_kv):
            n_blocks = (seqlen.seqlen_k + cfg.tile_n - 1) // cfg.tile_n
            n_per_split = (n_blocks + num_splits - 1) // num_splits
            split_range = (split * n_per_split, (split + 1) * n_per_split)
            live = live & (split * n_per_split < n_blocks)
        if live:
            self.attend_tile(
                mQ, mK, mV, mO, mLSE, mPageTable, mOPartial, mLSEPartial, seqlen, split_range,
                m_block, head, batch, split, tidx,
                softmax_scale_log2, softcap_prescale, window_left, window_right,
                sQ_layout, sK_layout, sV_layout, sO_layout,
                gmem_copy_QK, gmem_copy_V, gmem_copy_O, tiled_mma, SharedStorage,
            )

    @cute.jit
    def attend_tile(
        self,
        mQ, mK, mV, mO, mLSE, mPageTable, mOPartial, mLSEPartial, seqlen: SeqlenInfo, split_range,
        m_block, head, batch, split, tidx,
        softmax_scale_log2, softcap_prescale, window_left, window_right,
        sQ_layout, sK_layout, sV_layout, sO_layout,
        gmem_copy_QK, gmem_copy_V, gmem_copy_O, tiled_mma, SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        num_heads = mQ.shape[2] if cutlass.const_expr(not cfg.varlen_q) else mQ.shape[1]
        num_heads_k = mK.shape[2] if cutlass.const_expr(not cfg.varlen_k) else mK.shape[1]
        head_k = head // (num_heads // num_heads_k)
        headdim = mQ.shape[3] if cutlass.const_expr(not cfg.varlen_q) else mQ.shape[2]
        headdim_v = mV.shape[3] if cutlass.const_expr(not cfg.varlen_k) else mV.shape[2]

        # ---- global tiles (every offset below is token * 64-bit stride) ----
        gQ = cute.local_tile(seqlen.q_rows(mQ, batch, head), (cfg.tile_m, cfg.head_dim), (m_block, 0))
        if cutlass.const_expr(not cfg.paged_kv):
            gK = cute.local_tile(seqlen.k_rows(mK, batch, head_k), (cfg.tile_n, cfg.head_dim), (None, 0))
            gV = cute.local_tile(seqlen.k_rows(mV, batch, head_k), (cfg.tile_n, cfg.head_dim_v), (None, 0))

        # ---- shared memory ----
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        # V^T as (dv, n[, stage]) over the same memory: the B operand of O = P V.
        sVt_shape, sVt_stride = (cfg.head_dim_v, cfg.tile_n), (cfg.tile_n, 1)
        if cutlass.const_expr(cfg.num_stages > 1):
            sVt_shape, sVt_stride = sVt_shape + (cfg.num_stages,), sVt_stride + (cfg.tile_n * cfg.head_dim_v,)
        sVt = cute.composition(sV, cute.make_layout(sVt_shape, stride=sVt_stride))

        # ---- gmem -> smem copies and their predicates ----
        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_V = gmem_copy_V.get_slice(tidx)
        tQgQ, tQsQ = thr_copy_QK.partition_S(gQ), thr_copy_QK.partition_D(sQ)
        tKsK, tVsV = thr_copy_QK.partition_D(sK), thr_copy_V.partition_D(sV)
        if cutlass.const_expr(not cfg.paged_kv):
            tKgK, tVgV = thr_copy_QK.partition_S(gK), thr_copy_V.partition_S(gV)
        tQcQ = thr_copy_QK.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim)))
        tKcK = thr_copy_QK.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim)))
        tVcV = thr_copy_V.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim_v)))
        # column predicates depend only on the column, so Q and K (same head dim) share them
        tQKpD = col_predicate(tKcK, headdim) if cutlass.const_expr(cfg.check_hdim) else None
        tVpD = col_predicate(tVcV, headdim_v) if cutlass.const_expr(cfg.check_hdim_v) else None

        # ---- MMA partitions ----
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(self.stage_of(sK, 0)))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(self.stage_of(sVt, 0)))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((cfg.tile_m, cfg.head_dim_v)), Float32)
        acc_O.fill(0.0)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        smem_copy_Q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        smem_copy_K = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        smem_copy_V = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        tSsQ = smem_copy_Q.partition_S(sQ)
        tSsK = smem_copy_K.partition_S(sK)
        tOsVt = smem_copy_V.partition_S(sVt)

        cS = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        tScS_mn = acc_mn_view(thr_mma.partition_C(cS))
        t0ScS_mn = acc_mn_view(tiled_mma.get_slice(0).partition_C(cS))

        # ---- masks and block range ----
        window_left_eff, window_right_eff = effective_window(seqlen, window_left, window_right, cfg.local)
        block_info = BlockInfo(cfg.tile_m, cfg.tile_n, cfg.causal, cfg.local, window_left_eff, window_right_eff)
        mask = AttentionMask(
            cfg.tile_m, cfg.tile_n, seqlen.seqlen_q, seqlen.seqlen_k, window_left_eff, window_right_eff
        )
        n_block_min, n_block_max = block_info.n_block_range(seqlen, m_block)
        if cutlass.const_expr(cfg.split_kv):
            n_block_min = cutlass.max(n_block_min, split_range[0])
            n_block_max = cutlass.min(n_block_max, split_range[1])
        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(tScS_mn, mode=[0]),
                                       LAZY_RESCALE_LOG2 if cfg.lazy_rescale else 0.0, cfg.keep_vote)

        k_rows_left = seqlen.seqlen_k - (n_block_max - 1) * cfg.tile_n
        lookup_K = None
        if cutlass.const_expr(cfg.paged_kv):
            # The pages of a key block are looked up ahead of its K copy (`lookup_K`, see
            # attend_block) and kept for its V copy: one page per block when pages hold whole
            # tiles, else one per row this thread copies (each row checked against seqlen_k, so
            # those copies ignore the row count), kept only with kv_rows_shared.
            paged = PagedKV.create(mPageTable, batch, mK, seqlen.seqlen_k, cfg.tile_n, cfg.page_size_pow2)
            if cutlass.const_expr(cfg.pages_hold_tiles):
                kv_page = paged.make_page()
                lookup_K = lambda n: paged.lookup_page(n, kv_page)  # noqa: E731
                load_K = lambda n, stage, rows: paged.load_page_tile(  # noqa: E731
                    gmem_copy_QK, mK, head_k, n, kv_page, self.stage_of(tKsK, stage), tKcK, tQKpD, tidx,
                    cfg.head_dim, rows,
                )
                load_V = lambda n, stage, rows: paged.load_page_tile(  # noqa: E731
                    gmem_copy_V, mV, head_k, n, kv_page, self.stage_of(tVsV, stage), tVcV, tVpD, tidx,
                    cfg.head_dim_v, rows,
                )
            else:
                kv_rows = paged.make_rows(tKsK)
                lookup_K = lambda n: paged.lookup(n, tKcK, kv_rows)  # noqa: E731
                load_K = lambda n, stage, rows: paged.load_tile(  # noqa: E731
                    gmem_copy_QK, mK, head_k, n, kv_rows, self.stage_of(tKsK, stage), tKcK, tQKpD, tidx,
                    cfg.head_dim,
                )
                if cutlass.const_expr(self.kv_rows_shared):
                    load_V = lambda n, stage, rows: paged.load_tile(  # noqa: E731
                        gmem_copy_V, mV, head_k, n, kv_rows, self.stage_of(tVsV, stage), tVcV, tVpD, tidx,
                        cfg.head_dim_v,
                    )
                else:
                    load_V = lambda n, stage, rows: paged.gather_tile(  # noqa: E731
                        gmem_copy_V, mV, head_k, n, self.stage_of(tVsV, stage), tVcV, tVpD, tidx, cfg.head_dim_v
                    )
        else:
            load_K = lambda n, stage, rows: cp_async_tile(  # noqa: E731
                gmem_copy_QK, tKgK[None, None, None, n], self.stage_of(tKsK, stage), tKcK, tQKpD, rows
            )
            load_V = lambda n, stage, rows: cp_async_tile(  # noqa: E731
                gmem_copy_V, tVgV[None, None, None, n], self.stage_of(tVsV, stage), tVcV, tVpD, rows
            )

        if n_block_max > n_block_min:
            # ---- prologue: Q, K[last] and, with two stages, V[last] and K[last - 1] ----
            n_last = n_block_max - 1
            cp_async_tile(gmem_copy_QK, tQgQ, tQsQ, tQcQ, tQKpD, seqlen.seqlen_q - m_block * cfg.tile_m)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(lookup_K is not None):
                lookup_K(n_last)
            load_K(n_last, 0, k_rows_left)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(cfg.num_stages == 2):
                load_V(n_last, 0, k_rows_left)
                cute.arch.cp_async_commit_group()
                if cutlass.const_expr(lookup_K is not None):
                    lookup_K(n_last - 1)
                if n_last - 1 >= n_block_min:
                    load_K(n_last - 1, 1, None)
                cute.arch.cp_async_commit_group()

            if cutlass.const_expr(cfg.pingpong):
                self.attend_pingpong(
                    n_last, n_block_min, tidx >= self.num_threads // 2, tiled_mma, acc_O, tSrQ, tSrK,
                    tOrVt, tSsQ, tSsK, tOsVt, smem_copy_Q, smem_copy_K, smem_copy_V, load_K, load_V, softmax,
                    mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale,
                )
            else:
                self.attend_blocks(
                    n_last, n_block_min, k_rows_left, block_info, seqlen, tiled_mma, acc_O, tSrQ, tSrK, tOrVt,
                    tSsQ, tSsK, tOsVt, smem_copy_Q, smem_copy_K, smem_copy_V, lookup_K, load_K, load_V,
                    softmax, mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale,
                )

        # ---- epilogue ----
        lse = cute.make_rmem_tensor(cute.size(tScS_mn, mode=[0]), Float32)
        softmax.finalize(acc_O, lse)
        if cutlass.const_expr(cfg.split_kv):
            self.store_partial(acc_O, lse, self.split_slot(mOPartial, split), self.split_slot(mLSEPartial, split),
                               seqlen, m_block, head, batch, tidx, tiled_mma, headdim_v)
        else:
            self.store_O(acc_O, lse, mO, mLSE, seqlen, m_block, head, batch, tidx, sQ, sO_layout,
                         gmem_copy_O, tiled_mma, headdim_v)

    @cute.jit
    def attend_blocks(
        self, n_last, n_block_min, k_rows_left, block_info, seqlen, tiled_mma, acc_O, tSrQ, tSrK, tOrVt,
        tSsQ, tSsK, tOsVt, smem_copy_Q, smem_copy_K, smem_copy_V, lookup_K, load_K, load_V,
        softmax, mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale,
    ):
        """The key blocks one after another (`attend_block`), masked ones first."""
        cfg = self.cfg
        step = lambda n, is_first, mask_seqlen, mask_causal, mask_local: self.attend_block(  # noqa: E731
            n, n_last, n_block_min, k_rows_left, is_first, mask_seqlen, mask_causal, mask_local,
            tiled_mma, acc_O, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt, smem_copy_Q, smem_copy_K,
            smem_copy_V, lookup_K, load_K, load_V, softmax, mask, tScS_mn, t0ScS_mn, m_block,
            softcap_prescale,
        )
        # The first block carries the key-length tail (and the diagonal, if causal).
        step(n_last, True, True, cfg.causal, cfg.local)
        # Then the blocks that cross the causal diagonal / window edge, then the clean ones.
        n_split = n_last
        if cutlass.const_expr(cfg.local):
            n_split = n_block_min
        elif cutlass.const_expr(cfg.causal):
            n_split = cutlass.max(
                cutlass.min(block_info.n_block_right_masked(seqlen, m_block), n_last), n_block_min
            )
        for i in cutlass.range(n_last - n_split, unroll=1):
            step(n_last - 1 - i, False, False, cfg.causal, cfg.local)
        for i in cutlass.range(n_split - n_block_min, unroll=1):
            step(n_split - 1 - i, False, False, False, False)

    @cute.jit
    def attend_block(
        self,
        n_block, n_last, n_block_min, k_rows_left,
        is_first: cutlass.Constexpr, mask_seqlen: cutlass.Constexpr,
        mask_causal: cutlass.Constexpr, mask_local: cutlass.Constexpr,
        tiled_mma, acc_O, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt, smem_copy_Q, smem_copy_K,
        smem_copy_V, lookup_K, load_K, load_V, softmax: OnlineSoftmax, mask: AttentionMask, tScS_mn,
        t0ScS_mn, m_block, softcap_prescale,
    ):
        """One key block: S = Q K^T, mask, online softmax, O += P V, with the next loads in flight.

        cp.async groups are committed in a fixed order (empty when there is nothing to load), so
        the number of groups allowed in flight at each wait is a constant: 2 * stages - 2.
        A paged cache (`lookup_K` not None) looks up the pages of the next K tile (block
        n_block - stages). With two stages the lookup comes right after the V copy, the last
        reader of the previous lookup, has been issued; ptxas sinks the table loads below
        S = Q K^T to just before the barrier ahead of the softmax (SASS of the hd128 decode
        tile), so their latency overlaps that barrier and the softmax instead of stalling the
        K copy. With one stage it comes right before the K copy: per-row pages held across
        S = Q K^T spilled the 128x128 tile (sm_90a) and, held across the wait for V[n] only,
        hd256 (sm_80).
        """
        cfg = self.cfg
        stages = cfg.num_stages
        stage = (n_last - n_block) % stages if cutlass.const_expr(stages > 1) else 0
        in_flight = 2 * stages - 2

        # K[n] has landed, and every warp is done with the buffers the next loads overwrite.
        cute.arch.cp_async_wait_group(in_flight)
        cute.arch.barrier()
        if cutlass.const_expr(stages == 1):
            load_V(n_block, 0, k_rows_left if cutlass.const_expr(is_first) else None)
        elif n_block - 1 >= n_block_min:
            load_V(n_block - 1, 1 - stage, None)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(lookup_K is not None and stages == 2):
            lookup_K(n_block - 2)

        acc_S = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
        acc_S.fill(0.0)
        gemm_ss(tiled_mma, acc_S, tSrQ, tSrK, tSsQ, self.stage_of(tSsK, stage), smem_copy_Q, smem_copy_K)

        if cutlass.const_expr(cfg.softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = tanhf(acc_S[i] * softcap_prescale)

        if cutlass.const_expr(stages == 1):
            # V[n] has landed and every warp is done reading K[n]: prefetch K[n - 1].
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if n_block - 1 >= n_block_min:
                if cutlass.const_expr(lookup_K is not None):
                    lookup_K(n_block - 1)
                load_K(n_block - 1, 0, None)
            cute.arch.cp_async_commit_group()

        if cutlass.const_expr(mask_seqlen or mask_causal or mask_local):
            mask.apply(acc_S, tScS_mn, t0ScS_mn, m_block, n_block, mask_seqlen, mask_causal, mask_local)
        softmax.step(acc_S, acc_O, is_first)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))

        if cutlass.const_expr(stages == 2):
            # V[n] has landed and every warp is done reading K[n]: prefetch K[n - 2] into its slot.
            cute.arch.cp_async_wait_group(in_flight)
            cute.arch.barrier()
            if n_block - 2 >= n_block_min:
                load_K(n_block - 2, stage, None)
            cute.arch.cp_async_commit_group()

        gemm_rs(tiled_mma, acc_O, acc_as_operand_a(rP), tOrVt, self.stage_of(tOsVt, stage), smem_copy_V)

    # ---- the ping-pong schedule (`Sm80FwdConfig.pingpong`) ------------------------------------
    # Two groups of four warps (warps 0-3 and 4-7, so every SM sub-partition holds one warp of
    # each) take turns: while one issues its MMAs (O += P V of a block, then S = Q K^T of the
    # next), the other runs its softmax, and a CTA barrier separates the turns. Group B runs one
    # turn behind group A. Trip i (i = 0 .. blocks) holds two turns: in the first, A runs the
    # MMAs of `pp_gemms` and B the softmax of block n_last + 1 - i; in the second, A the
    # softmax of block n_last - i and B the same MMAs. K and V of the block after next are copied
    # at the start of each trip into the slots the trip before last left, and waited for at its
    # end (two turns later, before the barrier that makes them visible).

    @cute.jit
    def attend_pingpong(self, n_last, n_block_min, second, tiled_mma, acc_O, tSrQ, tSrK, tOrVt,
                        tSsQ, tSsK, tOsVt, smem_copy_Q, smem_copy_K, smem_copy_V, load_K, load_V, softmax,
                        mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale):
        acc_S = cute.make_rmem_tensor(
            tiled_mma.get_slice(0).partition_shape_C((self.cfg.tile_m, self.cfg.tile_n)), Float32)
        pp = _PingPong(n_last, n_block_min, second, tiled_mma, acc_O, tSrQ, tSrK, tOrVt, tSsQ,
                       tSsK, tOsVt, smem_copy_Q, smem_copy_K, smem_copy_V, load_K, load_V, softmax, mask,
                       tScS_mn, t0ScS_mn, m_block, softcap_prescale, acc_S,
                       cute.make_fragment_like(acc_S, self.dtype))
        # Each group runs its own copy of the schedule, so that neither's registers are live in
        # the other's code; both pass the same CTA barriers in the same order.
        if second:
            self.pp_schedule(pp, True)
        else:
            self.pp_schedule(pp, False)

    @cute.jit
    def pp_schedule(self, pp, group_b: cutlass.Constexpr):
        n_last = pp.n_last
        cute.arch.cp_async_wait_group(1)  # Q and K[last]
        cute.arch.barrier()
        # trip 0: S of the first block (A), then its softmax (A) and S (B)
        if cutlass.const_expr(not group_b):
            self.pp_scores(pp, n_last)
        cute.arch.barrier()
        if cutlass.const_expr(group_b):
            self.pp_scores(pp, n_last)
        else:
            self.pp_probs(pp, n_last, True)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        n_blocks = n_last + 1 - pp.n_block_min
        # trip 1: B's softmax of the first block; the next block's S where there is one
        self.pp_trip(pp, 1, group_b, True, n_blocks > 1)
        for i in cutlass.range(2, n_blocks, unroll=1):
            self.pp_trip(pp, i, group_b, False, True)
        if n_blocks > 1:
            self.pp_trip(pp, n_blocks, group_b, False, False)

    @cute.jit
    def pp_trip(self, pp, i, group_b: cutlass.Constexpr, b_first: cutlass.Constexpr, has_s):
        """Trip i of the ping-pong for one group: its two turns, each closed by a barrier."""
        n_pv, n_s = pp.n_last + 1 - i, pp.n_last - i
        self.pp_loads(pp, i)
        if cutlass.const_expr(group_b):
            self.pp_probs(pp, n_pv, b_first)
        else:
            self.pp_gemms(pp, n_pv, n_s, has_s)
        cute.arch.barrier()
        if cutlass.const_expr(group_b):
            self.pp_gemms(pp, n_pv, n_s, has_s)
        elif has_s:
            self.pp_probs(pp, n_s, False)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

    @cute.jit
    def pp_loads(self, pp, i):
        """At the start of trip i: K of block n_last - 1 - i and V of block n_last - i (the block
        after next for each), into slot (n_last - block) % 2."""
        n_last, n_block_min, load_K, load_V = pp.n_last, pp.n_block_min, pp.load_K, pp.load_V
        if n_last - 1 - i >= n_block_min:
            load_K(n_last - 1 - i, (i + 1) % 2, None)
        if n_last - i >= n_block_min:
            load_V(n_last - i, i % 2, None)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def pp_gemms(self, pp, n_pv, n_s, has_s):
        """A turn's MMAs: O += P V of block n_pv, then S = Q K^T of block n_s if has_s."""
        gemm_rs(pp.tiled_mma, pp.acc_O, acc_as_operand_a(pp.rP), pp.tOrVt,
                self.stage_of(pp.tOsVt, (pp.n_last - n_pv) % 2), pp.smem_copy_V)
        if has_s:
            self.pp_scores(pp, n_s)

    @cute.jit
    def pp_scores(self, pp, n):
        pp.acc_S.fill(0.0)
        gemm_ss(pp.tiled_mma, pp.acc_S, pp.tSrQ, pp.tSrK, pp.tSsQ, self.stage_of(pp.tSsK, (pp.n_last - n) % 2),
                pp.smem_copy_Q, pp.smem_copy_K)
        if cutlass.const_expr(self.cfg.softcap):
            for j in cutlass.range_constexpr(cute.size(pp.acc_S)):
                pp.acc_S[j] = tanhf(pp.acc_S[j] * pp.softcap_prescale)

    @cute.jit
    def pp_probs(self, pp, n, is_first: cutlass.Constexpr):
        """A turn's softmax of block n (the first block carries the key-length tail) into rP."""
        if cutlass.const_expr(is_first):
            pp.mask.apply(pp.acc_S, pp.tScS_mn, pp.t0ScS_mn, pp.m_block, n, True, False, False)
        pp.softmax.step(pp.acc_S, pp.acc_O, is_first)
        pp.rP.store(pp.acc_S.load().to(self.dtype))

    def stage_of(self, t: cute.Tensor, stage) -> cute.Tensor:
        """Slot `stage` of a K/V ring (its last mode); a one-stage ring has no stage mode."""
        if cutlass.const_expr(self.cfg.num_stages == 1):
            return t
        return t[(None,) * (cute.rank(t) - 1) + (stage,)]

    @staticmethod
    def split_slot(t: cute.Tensor, split) -> cute.Tensor:
        """Split `split`'s part of a partial buffer (its first mode): shaped like O or the LSE."""
        return t[(split,) + (None,) * (cute.rank(t) - 1)]

    @cute.jit
    def store_lse(self, lse, mLSE, seqlen: SeqlenInfo, m_block, head, batch, tidx, tiled_mma):
        """The lane holding column 0 of a row writes the row's LSE."""
        cfg = self.cfg
        rows_left = seqlen.seqlen_q - m_block * cfg.tile_m
        gLSE = cute.local_tile(seqlen.lse_row(mLSE, batch, head), (cfg.tile_m,), (m_block,))
        tOcO_mn = acc_mn_view(tiled_mma.get_slice(tidx).partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v))))
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(tOcO_mn, mode=[0])):
                row = tOcO_mn[r, 0][0]
                if row < rows_left:
                    gLSE[row] = lse[r]

    @cute.jit
    def store_partial(self, acc_O, lse, mOp, mLSEp, seqlen: SeqlenInfo, m_block, head, batch, tidx,
                      tiled_mma, headdim_v):
        """Split-KV epilogue: normalised O and LSE of this split, float32, straight from registers.

        Column pairs of the C fragment are adjacent, so each store is 64 bits; the partial rows
        are re-read once by the combine, which is why they skip the shared-memory staging.
        """
        cfg = self.cfg
        rows_left = seqlen.seqlen_q - m_block * cfg.tile_m
        cute.arch.cp_async_wait_group(0)  # nothing may land in shared memory after the CTA exits
        self.store_lse(lse, mLSEp, seqlen, m_block, head, batch, tidx, tiled_mma)
        gO = cute.local_tile(seqlen.q_rows(mOp, batch, head), (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
        thr_mma = tiled_mma.get_slice(tidx)
        tOgO = acc_mn_view(thr_mma.partition_C(gO))
        tOcO = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v))))
        acc_O_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            if tOcO[r, 0][0] < rows_left:
                for c in cutlass.range_constexpr(cute.size(tOcO, mode=[1])):
                    if cutlass.const_expr(cfg.check_hdim_v):
                        if tOcO[r, c][1] < headdim_v:
                            tOgO[r, c] = acc_O_mn[r, c]
                    else:
                        tOgO[r, c] = acc_O_mn[r, c]

    @cute.jit
    def store_O(
        self, acc_O, lse, mO, mLSE, seqlen: SeqlenInfo, m_block, head, batch, tidx, sQ, sO_layout,
        gmem_copy_O, tiled_mma, headdim_v,
    ):
        cfg = self.cfg
        rows_left = seqlen.seqlen_q - m_block * cfg.tile_m
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))  # cvt.rn: round to nearest even

        if cutlass.const_expr(mLSE is not None):
            self.store_lse(lse, mLSE, seqlen, m_block, head, batch, tidx, tiled_mma)

        # Every warp is done reading sQ / sV before O overwrites the Q tile.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        sO = cute.make_tensor(sQ.iterator, sO_layout)
        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
        ).get_slice(tidx)
        cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))
        cute.arch.barrier()

        gO = cute.local_tile(seqlen.q_rows(mO, batch, head), (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
        cols = headdim_v if cutlass.const_expr(cfg.check_hdim_v) else None
        store_staged_rows(gmem_copy_O, sO, gO, tidx, rows_left, cols)


class _PingPong:
    """What the ping-pong schedule's turns share (`FlashFwdSm80.attend_pingpong`): the block
    range, the MMA operands and copies, the softmax, and the score and P fragments that live
    from one turn to the next."""

    def __init__(self, n_last, n_block_min, second, tiled_mma, acc_O, tSrQ, tSrK, tOrVt,
                 tSsQ, tSsK, tOsVt, smem_copy_Q, smem_copy_K, smem_copy_V, load_K, load_V, softmax,
                 mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale, acc_S, rP):
        self.n_last, self.n_block_min = n_last, n_block_min
        self.second = second  # group B: warps 4-7, one turn behind
        self.tiled_mma, self.acc_O = tiled_mma, acc_O
        self.tSrQ, self.tSrK, self.tOrVt, self.tSsQ, self.tSsK, self.tOsVt = tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt
        self.smem_copy_Q, self.smem_copy_K, self.smem_copy_V = smem_copy_Q, smem_copy_K, smem_copy_V
        self.load_K, self.load_V, self.softmax, self.mask = load_K, load_V, softmax, mask
        self.tScS_mn, self.t0ScS_mn, self.m_block, self.softcap_prescale = tScS_mn, t0ScS_mn, m_block, softcap_prescale
        self.acc_S, self.rP = acc_S, rP
