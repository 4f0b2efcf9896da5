"""FlashAttention forward for sm_90a: TMA + WGMMA, one producer warp and 2-3 consumer warpgroups.

A CTA computes (query block, head, batch) tiles of O, one per CTA or, in a persistent
configuration, several in turn (see below), with `1 + num_consumer_wgs` warpgroups:

1. Producer (warpgroup 0, which gives most of its registers away with `setmaxnreg`): its first
   warp issues TMA loads -- the Q tile once, then K and V tiles into `num_stages`-deep rings
   guarded by mbarriers (`PipelineTmaAsync`: the consumer releases a slot, the producer waits
   for it, re-arms the slot's transaction count and launches the next copy). Key blocks are
   visited from the last visible one down to the first, in the order K(n), K(n-1), V(n),
   K(n-2), V(n-1), ... which is the order the consumers need them in. TMA clips at the tensor
   bounds and zero-fills, so no memory outside Q, K or V ever reaches a WGMMA. With
   `seqused_k`, the V rows past it still lie inside the tensor: the consumers zero them in
   shared memory before the first P·V (`zero_unused_keys`), so a stale cache cannot leak NaN.
2. Consumers (warpgroups 1.., each owning 64 query rows): S = Q·Kᵀ by WGMMA with both
   operands in shared memory; the mask sets hidden scores to -inf; the online softmax (log2
   space, scale folded in, exp2) turns S into P, which is rounded to 16 bits in registers and
   used directly as the register A operand of O += P·V (V as the MN-major B operand).
   Intra-warpgroup overlap: the S GEMM of block n-1 and the P·V GEMM of block n are issued
   together; the softmax of block n-1 runs while P·V is still in flight, and O is rescaled after
   that GEMM is waited for (before the next P·V is issued, with `rescale_o_before_pv`).
   Ping-pong: named barriers let one warpgroup issue its GEMMs while the other one is in its
   softmax, so the tensor cores and the MUFU unit stay busy.
   With `masked_halves` a warpgroup whose 64 rows see at most the first half of a masked key
   block runs its GEMMs over those 64 keys only (`fwd_halves.py`).
3. Epilogue: O / rowsum rounded to the input dtype (round-to-nearest-even) goes to shared
   memory (over the Q tile; a buffer of its own when persistent) by `stmatrix`, then out by
   one TMA store (clipped at the sequence and head-dim ends); varlen batches store with predicated 128-bit copies instead, because a
   TMA box would run into the next sequence's rows. LSE (natural log, float32) is written by
   the lanes that own column 0.

Tiles with no visible key do no loads and no GEMMs: O = 0, LSE = -inf. Causal and local tiles
are launched from the last query block down, so the longest tiles start first, across the heads
of a section of (batch, head) pairs whose K/V fit in L2 (`tile_coords`): the grid's last tiles
are then the shortest of all, not the last head's longest.

Persistent configurations (`persistent`: head dims 64 to 128) launch one CTA per SM, which walks
its tiles in turn (`fwd_persistent.py`), with a tile counter where a causal mask makes the tiles'
lengths differ (`tile_counter`).

K/V clusters (`cluster_kv`: calls without a window, varlen or seqused_k, with an even number of
query blocks, on tiles of 80 keys or more): the grid is launched in clusters of two CTAs on
neighbouring query blocks of one (batch, head) -- persistent CTAs walk pairs of query blocks,
the cluster's rank picking the block -- and each CTA's producer loads its half of every K and V
tile by TMA multicast into the slots of both. A slot's full barrier expects the whole tile (half
from each CTA's copy); its empty barrier counts the consumer warps of both CTAs (lanes 0 and 1 of
a warp arrive on CTA 0's and CTA 1's), so a producer overwrites a slot only once both CTAs are
done with it. Before a producer leaves, it waits for every slot to be released (`kv_tail`), so
that no arrive of the other CTA reaches a CTA that has exited. Both CTAs walk the same key
blocks; the arithmetic is unchanged (O is bitwise that of single CTAs), and L2 serves half the
K/V bytes, which at the H200's power cap shows as a higher SM clock. In the persistent loop an
odd number of query blocks takes the clusters too, for an even number of (batch, head) pairs:
the last query blocks of two neighbouring pairs make one `lone` tile of the cluster
(`cluster_tile_coords`), on which each producer loads both halves of its own K/V tiles into its
own slots alone (the multicast mask of its rank), so that both CTAs still walk the same number
of key blocks and the barriers count as above. Causal calls with enough
query blocks take the clusters too, on one CTA per tile (`with_cluster_kv`): the later query
block of a pair sees a key block or two more than the earlier one, so both CTAs walk the later
one's blocks (`cluster_walk_end`) and the earlier one waits for those past its own and releases
them unread.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup

from ..common.block_info import BlockInfo, effective_window
from ..common.fake_tensors import element_type
from ..common.mask import AttentionMask
from ..common.seqlen_info import SeqlenInfo
from ..common.smem_layouts import make_row_tiled_copy, wgmma_smem_layout_tile
from ..common.softmax import OnlineSoftmax
from ..common.tiles import LAZY_RESCALE_LOG2
from ..common.timeline import TimelineCounters
from ..common.utils import acc_mn_view, col_predicate, store_pairs_16bit, tanhf, transposed
from .fwd_config import TIMELINE_PHASES, Sm90FwdConfig
from .fwd_halves import MaskedHalves, MaskedHalvesPath
from .fwd_persistent import PersistentTiles
from .fwd_sync import BARRIER_EPILOGUE, BARRIER_PINGPONG, tile_coords
from .wgmma import acc_as_mma_sync, gemm, probs_as_operand_a

class ProbsInSmem(NamedTuple):
    """`p_in_smem`: a thread's 16-bit P and where it goes in its warpgroup's rows of sP."""
    regs: cute.Tensor  # shaped like the S accumulator
    copy: cute.TiledCopy  # stmatrix, sliced for the thread
    dst: cute.Tensor  # the thread's part of sP


def tma_view(mX: cute.Tensor, varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
    """(b, s, h, d) -> (s, d, h, b), or varlen (total, h, d) -> (total, d, h): the tiled modes
    (tokens, head dim) first, as TMA tiles the leading modes of its tensor."""
    order = [0, 2, 1] if cutlass.const_expr(varlen) else [1, 3, 2, 0]
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=order))


def multicast(mask) -> dict:
    """The keyword arguments of a TMA `cute.copy` into the CTAs of `mask` (none for a CTA's own copy)."""
    return {} if mask is None else {"mcast_mask": mask}


class FlashFwdSm90(PersistentTiles, MaskedHalvesPath, TimelineCounters):
    """The sm_90 forward kernel for one `Sm90FwdConfig` (all compile-time choices live there)."""

    def __init__(self, config: Sm90FwdConfig):
        self.cfg = config
        self.dtype = element_type(config.dtype)
        self.num_consumer_threads = 128 * config.num_consumer_wgs
        self.cluster_size = 2 if config.cluster_kv else 1

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
        num_ctas: Int32,  # persistent: the grid (one CTA per SM, at most one per tile)
        heads_per_section: Int32,  # the tile order of causal / local grids (`tile_coords`)
        mTileCounter: Optional[cute.Tensor],  # int32 (1,), zero: `tile_counter`'s next tile - num_ctas
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        sQ_layout = wgmma_smem_layout_tile(self.dtype, cfg.tile_m, cfg.head_dim)
        sK_layout = wgmma_smem_layout_tile(self.dtype, cfg.tile_n, cfg.head_dim, cfg.num_stages)
        sV_layout = wgmma_smem_layout_tile(self.dtype, cfg.tile_n, cfg.head_dim_v, cfg.num_stages)
        sO_layout = wgmma_smem_layout_tile(self.dtype, cfg.tile_m, cfg.head_dim_v)
        # `p_in_smem`: P (tile_m, tile_n) as the K-major A operand of P·V, 64 rows per warpgroup
        sP_layout = wgmma_smem_layout_tile(self.dtype, cfg.tile_m, cfg.tile_n)
        sP_elems = cute.cosize(sP_layout) if cutlass.const_expr(cfg.p_in_smem) else 0
        # O is staged over Q once every consumer is done with Q; the region holds either. A
        # persistent CTA loads the next tile's Q during this tile's epilogue: O has its own.
        if cutlass.const_expr(cfg.persistent):
            sQO_elems, sO_elems = cute.cosize(sQ_layout), cute.cosize(sO_layout)
        else:
            sQO_elems, sO_elems = max(cute.cosize(sQ_layout), cute.cosize(sO_layout)), 0

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            next_tile: cute.struct.MemRange[Int32, 1]  # `tile_counter`: the producer's hand-over
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, sQO_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, sO_elems], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, sP_elems], 1024]

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(
            load, tma_view(mQ, cfg.varlen_q), sQ_layout, (cfg.tile_m, cfg.head_dim)
        )
        # `cluster_kv`: each CTA of a cluster loads half of a K/V tile into both CTAs
        load_kv = cpasync.CopyBulkTensorTileG2SMulticastOp() if cutlass.const_expr(cfg.cluster_kv) else load
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(
            load_kv, tma_view(mK, cfg.varlen_k), cute.select(sK_layout, mode=[0, 1]), (cfg.tile_n, cfg.head_dim),
            num_multicast=self.cluster_size,
        )
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(
            load_kv, tma_view(mV, cfg.varlen_k), cute.select(sV_layout, mode=[0, 1]), (cfg.tile_n, cfg.head_dim_v),
            num_multicast=self.cluster_size,
        )
        tma_O, tma_mO = None, None
        if cutlass.const_expr(not cfg.varlen_q):
            tma_O, tma_mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), tma_view(mO, False), sO_layout, (cfg.tile_m, cfg.head_dim_v)
            )

        # Each consumer warpgroup takes 64 rows of the tile (atom layout wgs x 1 x 1).
        wgs = (cfg.num_consumer_wgs, 1, 1)
        K_major, MN_major = OperandMajorMode.K, OperandMajorMode.MN
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major, K_major, Float32, wgs, (64, cfg.tile_n)
        )
        # V is stored with the head dim contiguous: the MN-major B operand of P·V, whose P comes
        # from registers (or, `p_in_smem`, from shared memory).
        p_source = warpgroup.OperandSource.SMEM if cutlass.const_expr(cfg.p_in_smem) else warpgroup.OperandSource.RMEM
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major, MN_major, Float32, wgs, (64, cfg.head_dim_v), a_source=p_source,
        )

        num_m_blocks = (max_seqlen_q + cfg.tile_m - 1) // cfg.tile_m
        num_heads, _ = self.head_counts(mQ, mK)
        grid = [num_m_blocks, num_heads, num_batch]
        if cutlass.const_expr(cfg.persistent):
            grid = [num_ctas, 1, 1]
        self.kernel(
            mQ, mK, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
            tma_Q, tma_mQ, tma_K, tma_mK, tma_V, tma_mV, tma_O, tma_mO,
            softmax_scale_log2, softcap_prescale, window_left, window_right,
            num_m_blocks, num_batch, heads_per_section, mTileCounter,
            sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout, tiled_mma_qk, tiled_mma_pv, SharedStorage,
        ).launch(
            grid=grid,
            block=[cfg.num_threads, 1, 1],
            cluster=[self.cluster_size, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        tma_Q: cute.CopyAtom,
        tma_mQ: cute.Tensor,
        tma_K: cute.CopyAtom,
        tma_mK: cute.Tensor,
        tma_V: cute.CopyAtom,
        tma_mV: cute.Tensor,
        tma_O: Optional[cute.CopyAtom],
        tma_mO: Optional[cute.Tensor],
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_m_blocks: Int32,
        num_batch: Int32,
        heads_per_section: Int32,
        mTileCounter: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_O):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # one arrive per consumer warp (lane 0 signals the empty barrier)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        # `cluster_kv`: a K/V slot is free once the consumer warps of both CTAs have released it
        # (lanes 0 and 1 of each warp arrive on the barriers of CTAs 0 and 1)
        kv_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_size * self.num_consumer_threads // 32)
        kv_cluster = cute.make_layout((1, 2, 1, 1)) if cutlass.const_expr(cfg.cluster_kv) else None
        tx_bytes = self.dtype.width // 8
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=cfg.tile_m * cfg.head_dim * tx_bytes, defer_sync=True,
        )
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(), num_stages=cfg.num_stages, producer_group=producer,
            consumer_group=kv_consumers, tx_count=cfg.tile_n * cfg.head_dim * tx_bytes, defer_sync=True,
            cta_layout_vmnk=kv_cluster, mcast_mode_mn=(0, 1),
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(), num_stages=cfg.num_stages, producer_group=producer,
            consumer_group=kv_consumers, tx_count=cfg.tile_n * cfg.head_dim_v * tx_bytes, defer_sync=True,
            cta_layout_vmnk=kv_cluster, mcast_mode_mn=(0, 1),
        )
        # with a cluster, the peer's TMA and arrives may reach this CTA's barriers only once they are initialized
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_size, 1), is_relaxed=True)

        # The WGMMA atoms swizzle byte addresses: the swizzle goes on the pointer.
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if cutlass.const_expr(cfg.persistent):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sP = None
        if cutlass.const_expr(cfg.p_in_smem):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        if cutlass.const_expr(cfg.persistent):
            pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_size, 1))
            self.run_persistent(
                tidx, warp_idx, mQ, mK, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
                tma_Q, tma_mQ, tma_K, tma_mK, tma_V, tma_mV, tma_O, tma_mO, sQ, sK, sV, sO, sP,
                pipeline_q, pipeline_k, pipeline_v, tiled_mma_qk, tiled_mma_pv,
                softmax_scale_log2, softcap_prescale, window_left, window_right,
                num_m_blocks, num_batch, heads_per_section, mTileCounter, storage.next_tile.get_tensor((1,)),
            )
        else:
            block_x, head, batch = cute.arch.block_idx()
            m_block = block_x
            if cutlass.const_expr(cfg.causal or cfg.local):
                # The longest tiles (query blocks near the end see the most keys) launch first,
                # across the heads of an L2 section (`tile_coords`; one head per section: the
                # query blocks of each head from the last down).
                num_heads_q, _ = self.head_counts(mQ, mK)
                # with `cluster_kv` the groups of neighbouring query blocks go in that order, the
                # cluster's rank picking the block
                n = self.cluster_size
                linear = block_x // n + (num_m_blocks // n) * (head + num_heads_q * batch)
                m_group, head, batch = tile_coords(
                    linear, num_m_blocks // n, num_heads_q, num_batch, heads_per_section, True, cutlass.min
                )
                m_block = n * m_group + block_x % n
            seqlen, window_left_eff, window_right_eff, block_info = self.sequence(
                batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left, window_right
            )
            num_heads, num_heads_k = self.head_counts(mQ, mK)
            head_k = head // (num_heads // num_heads_k)

            pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_size, 1))
            # A CTA past the end of its (varlen) sequence has nothing to do; all its threads leave.
            if m_block * cfg.tile_m < seqlen.seqlen_q:
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(cfg.registers[1])
                    # The key-block range is computed on each side of the register split: a range
                    # computed before it stays live into the producer's 24 registers (which spilled).
                    n_block_min, _ = block_info.n_block_range(seqlen, m_block)
                    n_walk_max = self.cluster_walk_end(block_info, seqlen, m_block)
                    if warp_idx == 0 and n_walk_max > n_block_min:
                        self.load(
                            tma_Q, tma_mQ, tma_K, tma_mK, tma_V, tma_mV, sQ, sK, sV,
                            pipeline_q, pipeline_k, pipeline_v, seqlen, m_block, head, head_k, batch,
                            n_block_min, n_walk_max,
                        )
                else:
                    cute.arch.setmaxregister_increase(cfg.registers[0])
                    n_block_min, n_block_max = block_info.n_block_range(seqlen, m_block)
                    ctidx = tidx - 128
                    mask = AttentionMask(cfg.tile_m, cfg.tile_n, seqlen.seqlen_q, seqlen.seqlen_k, window_left_eff,
                                         window_right_eff, cfg.mask_bits)
                    self.consume(
                        ctidx, warp_idx, mO, mLSE, tma_O, tma_mO, sQ, sK, sV, sO, sP,
                        pipeline_q, pipeline_k, pipeline_v, tiled_mma_qk, tiled_mma_pv,
                        seqlen, block_info, mask, m_block, head, batch, n_block_min, n_block_max,
                        softmax_scale_log2, softcap_prescale,
                        n_walk_max=self.cluster_walk_end(block_info, seqlen, m_block),
                    )

    def cluster_walk_end(self, block_info: BlockInfo, seqlen: SeqlenInfo, m_block):
        """One past the last key block the producer of `m_block`'s CTA loads: its own n_block_max,
        or, with causal K/V clusters, that of the cluster's last query block, which sees the most
        keys (the CTAs of a cluster load every K/V tile together, so they walk the same blocks)."""
        _, n_block_max = block_info.n_block_range(seqlen, m_block)
        if cutlass.const_expr(self.cfg.cluster_kv and self.cfg.causal):
            last = m_block - m_block % self.cluster_size + self.cluster_size - 1
            _, n_block_max = block_info.n_block_range(seqlen, last)
        return n_block_max

    def head_counts(self, mQ: cute.Tensor, mK: cute.Tensor) -> tuple:
        """(query heads, KV heads) of the call (trace time)."""
        cfg = self.cfg
        num_heads = mQ.shape[1] if cutlass.const_expr(cfg.varlen_q) else mQ.shape[2]
        num_heads_k = mK.shape[1] if cutlass.const_expr(cfg.varlen_k) else mK.shape[2]
        return num_heads, num_heads_k

    def sequence(self, batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left, window_right) -> tuple:
        """(lengths, effective window left / right, block ranges) of sequence `batch`."""
        cfg = self.cfg
        seqlen = SeqlenInfo.create(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        left, right = effective_window(seqlen, window_left, window_right, cfg.local)
        return seqlen, left, right, BlockInfo(cfg.tile_m, cfg.tile_n, cfg.causal, cfg.local, left, right)

    # ------------------------------------------------------------------------------------------
    # producer
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load(
        self, tma_Q, tma_mQ, tma_K, tma_mK, tma_V, tma_mV, sQ, sK, sV,
        pipeline_q, pipeline_k, pipeline_v, seqlen: SeqlenInfo, m_block, head, head_k, batch,
        n_block_min, n_block_max, states=None, lone=None,
    ):
        """The loads of one tile. `states`: the (Q, K/V) ring states of a persistent CTA, returned
        advanced past this tile; None for the one tile of a non-persistent CTA. `lone` (persistent
        `cluster_kv`): 1 where the cluster's CTAs are on different heads (`cluster_tile_coords`),
        each then loading both halves of every K/V tile into its own slots alone."""
        cfg = self.cfg
        gQ = cute.local_tile(self.rows(tma_mQ, cfg.varlen_q, seqlen.offset_q, batch, head),
                             (cfg.tile_m, cfg.head_dim), (m_block, 0))
        gK = cute.local_tile(self.rows(tma_mK, cfg.varlen_k, seqlen.offset_k, batch, head_k),
                             (cfg.tile_n, cfg.head_dim), (None, 0))
        gV = cute.local_tile(self.rows(tma_mV, cfg.varlen_k, seqlen.offset_k, batch, head_k),
                             (cfg.tile_n, cfg.head_dim_v), (None, 0))
        one_cta = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_Q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        # `cluster_kv`: this CTA's half of each K/V tile, multicast to both CTAs of the cluster
        kv_rank, kv_ctas, mcast = 0, one_cta, None
        if cutlass.const_expr(cfg.cluster_kv):
            kv_rank, kv_ctas, mcast = cute.arch.block_idx_in_cluster(), cute.make_layout(2), cutlass.Int16(3)
        tKsK, tKgK = cpasync.tma_partition(tma_K, kv_rank, kv_ctas, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_V, kv_rank, kv_ctas, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        # a `lone` tile: both halves, each to this CTA alone (the mask of its own rank)
        other_k = other_v = None
        if cutlass.const_expr(cfg.cluster_kv and lone is not None):
            mcast = cutlass.Int16(3 - lone * (2 - kv_rank))
            tKsK1, tKgK1 = cpasync.tma_partition(tma_K, 1 - kv_rank, kv_ctas, cute.group_modes(sK, 0, 2),
                                                 cute.group_modes(gK, 0, 2))
            tVsV1, tVgV1 = cpasync.tma_partition(tma_V, 1 - kv_rank, kv_ctas, cute.group_modes(sV, 0, 2),
                                                 cute.group_modes(gV, 0, 2))
            other_k, other_v = (tKgK1, tKsK1, lone), (tVgV1, tVsV1, lone)

        if cutlass.const_expr(states is None):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        else:
            q_state, kv_state = states
        # K first: the first S GEMM needs only Q and K.
        self.load_tile(pipeline_k, tma_K, tKgK, tKsK, n_block_max - 1, kv_state, mcast, other_k)
        pipeline_q.producer_acquire(q_state)
        cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            n_block = n_block_max - 2 - i
            v_state = kv_state.clone()
            kv_state.advance()
            self.load_tile(pipeline_k, tma_K, tKgK, tKsK, n_block, kv_state, mcast, other_k)
            self.load_tile(pipeline_v, tma_V, tVgV, tVsV, n_block + 1, v_state, mcast, other_v)
        self.load_tile(pipeline_v, tma_V, tVgV, tVsV, n_block_min, kv_state, mcast, other_v)
        if cutlass.const_expr(cfg.cluster_kv and states is None):
            kv_state.advance()
            self.kv_tail(pipeline_k, pipeline_v, kv_state)
        if cutlass.const_expr(states is not None):
            q_state.advance()  # the next tile's Q waits for the consumers to release this one
            kv_state.advance()
            return q_state, kv_state

    @cute.jit
    def load_tile(self, pipe, tma_atom, tXgX, tXsX, n_block, state, mcast=None, other=None):
        """Wait for ring slot `state` to be free, arm its barrier and TMA key block `n_block` into it
        (with `mcast`, this CTA's part of it into the slot of every CTA of the mask; `other`: the
        other CTA's part (its partition of global and shared memory) and `lone`, which, when 1,
        loads that part too, with the same mask)."""
        pipe.producer_acquire(state)
        cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state),
                  **multicast(mcast))
        if cutlass.const_expr(other is not None):
            other_g, other_s, lone = other
            if lone == 1:
                cute.copy(tma_atom, other_g[None, n_block], other_s[None, state.index],
                          tma_bar_ptr=pipe.producer_get_barrier(state), **multicast(mcast))

    @staticmethod
    def kv_tail(pipeline_k, pipeline_v, kv_state):
        """`cluster_kv`: before the producer leaves, every K/V slot is released by the consumers of
        both CTAs, so that no arrive of the other CTA reaches this one's barriers after it exits
        (and the other CTA has read all this one loaded into it). `kv_state`: the next slot."""
        pipeline_k.producer_tail(kv_state.clone())
        pipeline_v.producer_tail(kv_state)

    @staticmethod
    def rows(tma_mX: cute.Tensor, varlen: cutlass.Constexpr[bool], offset, batch, head) -> cute.Tensor:
        """(tokens, head dim) of one (batch, head) of a `tma_view` tensor."""
        if cutlass.const_expr(varlen):
            return cute.domain_offset((offset, 0), tma_mX[None, None, head])
        return tma_mX[None, None, head, batch]

    # ------------------------------------------------------------------------------------------
    # consumers
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, ctidx, warp_idx, mO, mLSE, tma_O, tma_mO, sQ, sK, sV, sO, sP,
        pipeline_q, pipeline_k, pipeline_v, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        seqlen: SeqlenInfo, block_info: BlockInfo, mask: AttentionMask, m_block, head, batch,
        n_block_min, n_block_max, softmax_scale_log2, softcap_prescale, states=None, n_walk_max=None,
    ):
        """One tile of O. `states`: as in `load` (a persistent CTA's consumer ring states,
        returned advanced past this tile; its caller holds the ping-pong's first turn).
        `n_walk_max`: with causal K/V clusters, one past the last key block loaded for the
        cluster (`cluster_walk_end`), whose blocks past n_block_max this CTA lets go unread."""
        cfg = self.cfg
        wg_idx = cute.arch.make_warp_uniform(ctidx // 128)
        thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
        thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
        # The shared-memory operands are the same for every thread of a warpgroup: slicing them
        # by the warpgroup's first thread (a warp-uniform value) keeps the WGMMA descriptors in
        # uniform registers; slicing by the thread index made ptxas rebuild them per thread
        # (R2UR and descriptor arithmetic before every HGMMA). Only the accumulator
        # partitions (partition_C, partition_shape_C) are per thread.
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        # Vᵀ (dv, n, stage) over V's bytes: the B operand of P·V.
        sVt = transposed(sV)
        tSrQ = tiled_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = tiled_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        halves = None
        if cutlass.const_expr(cfg.masked_halves):
            halves = self.masked_halves(sQ, sK, wg_idx, mask, m_block)
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((cfg.tile_m, cfg.head_dim_v)), Float32)
        acc_O.fill(0.0)
        rP = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((cfg.tile_m, cfg.tile_n)), self.dtype)
        if cutlass.const_expr(cfg.p_in_smem):
            # P·V reads this warpgroup's rows of sP; `probs_to_16bit` stores rP there
            tOrP = tiled_mma_pv.make_fragment_A(wg_mma_pv.partition_A(sP))
            stsm_P = cute.make_tiled_copy_C(
                cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype), tiled_mma_qk
            ).get_slice(ctidx)
            rP = ProbsInSmem(rP, stsm_P, stsm_P.partition_D(sP))
        else:
            tOrP = probs_as_operand_a(rP, thr_mma_pv, (cfg.tile_m, cfg.tile_n))
        cS = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        tScS_mn = acc_mn_view(acc_as_mma_sync(thr_mma_qk.partition_C(cS)))
        # thread 0's coordinates: compile-time constants for the mask's comparisons
        t0ScS_mn = acc_mn_view(acc_as_mma_sync(tiled_mma_qk.get_slice(0).partition_C(cS)))
        num_rows = cute.size(tScS_mn, mode=[0])
        softmax = OnlineSoftmax.create(softmax_scale_log2, num_rows, LAZY_RESCALE_LOG2 if cfg.lazy_rescale else 0.0,
                                        cfg.keep_vote)
        correction = cute.make_rmem_tensor(num_rows, Float32)
        if cutlass.const_expr(cfg.rescale_o_before_pv):
            correction.fill(1.0)  # the first block leaves no factor; O is still 0 then
        # `timeline` (a profiling build): globaltimer stamps of this tile and clock cycles per
        # phase of its later key blocks (see `Sm90FwdConfig.timeline`)
        stamps = cute.make_rmem_tensor((5,), Int32)
        phases = cute.make_rmem_tensor((TIMELINE_PHASES + 1,), Int32)
        if cutlass.const_expr(cfg.timeline):
            phases.fill(0)
            stamps.fill(0)
        self.stamp(stamps, 0)

        if cutlass.const_expr(cfg.pingpong and states is None):
            # The first warpgroup holds the first GEMM-issue turn.
            if wg_idx == 0:
                cute.arch.barrier_arrive(barrier_id=BARRIER_PINGPONG, number_of_threads=256)

        if cutlass.const_expr(states is None):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        else:
            q_state, kv = states
        if cutlass.const_expr(cfg.cluster_kv and cfg.causal):
            # Key blocks only the cluster's later query blocks see: each is waited for (a slot is
            # released only once both CTAs' copies into it are in, so that its barrier is not
            # re-armed while bytes are still on their way) and released unread.
            for _ in cutlass.range(n_walk_max - n_block_max, unroll=1):
                pipeline_k.consumer_wait(kv)
                pipeline_k.consumer_release(kv)
                pipeline_v.consumer_wait(kv)
                pipeline_v.consumer_release(kv)
                kv.advance()
            if n_walk_max > n_block_min and n_block_max <= n_block_min:
                # a tile that sees no key, whose Q was loaded for the cluster: O goes over Q once it is in
                pipeline_q.consumer_wait(q_state)
        if n_block_max > n_block_min:
            pipeline_q.consumer_wait(q_state)
            self.stamp(stamps, 1)

            # First block: carries the key-length tail (and the diagonal / window edge).
            n_last = n_block_max - 1
            pipeline_k.consumer_wait(kv)
            acc_S = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
            if cutlass.const_expr(halves is None):
                gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True)
                warpgroup.wait_group(0)
                pipeline_k.consumer_release(kv)
                self.scores_to_probs(acc_S, n_last, True, True, cfg.causal, cfg.local,
                                     softmax, correction, mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale)
                self.probs_to_16bit(acc_S, rP)
            else:
                # a warpgroup that sees no key of the first block leaves its softmax as created
                # (rows at -inf, which the next block's takes as "nothing seen yet")
                seen = self.keys_seen(halves, n_last)
                if seen > 0:
                    if seen > cfg.tile_n // 2:
                        gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True)
                        warpgroup.wait_group(0)
                    else:
                        self.s_half(halves, acc_S, kv.index)
                    pipeline_k.consumer_release(kv)
                    self.scores_to_probs(acc_S, n_last, True, True, cfg.causal, cfg.local,
                                         softmax, correction, mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale)
                    self.probs_to_16bit(acc_S, rP)
                else:
                    pipeline_k.consumer_release(kv)
            if cutlass.const_expr(cfg.seqused_k):
                self.zero_unused_keys(sV, kv, seqlen.seqlen_k - n_last * cfg.tile_n, ctidx, pipeline_v)
            if cutlass.const_expr(not cfg.intra_wg_overlap):
                kv = self.pv_block(kv, tiled_mma_pv, tOrP, tOrVt, acc_O, pipeline_v)
            self.stamp(stamps, 2)

            # Then the blocks that cross the causal diagonal / window edge, then the clean ones.
            n_split = n_last
            if cutlass.const_expr(cfg.local):
                n_split = n_block_min
            elif cutlass.const_expr(cfg.causal):
                n_right = block_info.n_block_right_masked(seqlen, m_block)
                n_split = cutlass.max(cutlass.min(n_right, n_last), n_block_min)
            for i in cutlass.range(n_last - n_split, unroll=1):
                if cutlass.const_expr(cfg.masked_halves):
                    kv = self.attend_block_halves(
                        kv, n_last - 1 - i, cfg.causal, cfg.local, wg_idx, tiled_mma_qk, tiled_mma_pv,
                        tSrQ, tSrK, tOrP, tOrVt, acc_O, rP, pipeline_k, pipeline_v, softmax, correction,
                        mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale, phases, halves,
                    )
                else:
                    kv = self.attend_block(
                        kv, n_last - 1 - i, cfg.causal, cfg.local, wg_idx, tiled_mma_qk, tiled_mma_pv,
                        tSrQ, tSrK, tOrP, tOrVt, acc_O, rP, pipeline_k, pipeline_v, softmax, correction,
                        mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale, phases,
                    )
            if cutlass.const_expr(cfg.masked_halves):
                # the first clean block's P·V is that of the last masked block, maybe a half
                if n_split > n_block_min:
                    kv = self.attend_block_halves(
                        kv, n_split - 1, False, False, wg_idx, tiled_mma_qk, tiled_mma_pv,
                        tSrQ, tSrK, tOrP, tOrVt, acc_O, rP, pipeline_k, pipeline_v, softmax, correction,
                        mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale, phases, halves,
                    )
                    n_split -= 1
            for i in cutlass.range(n_split - n_block_min, unroll=1):
                kv = self.attend_block(
                    kv, n_split - 1 - i, False, False, wg_idx, tiled_mma_qk, tiled_mma_pv,
                    tSrQ, tSrK, tOrP, tOrVt, acc_O, rP, pipeline_k, pipeline_v, softmax, correction,
                    mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale, phases,
                )
            if cutlass.const_expr(states is not None):
                # every S GEMM of the tile is waited for: the next tile's Q may come in
                pipeline_q.consumer_release(q_state)
                q_state.advance()
            if cutlass.const_expr(cfg.intra_wg_overlap):
                if cutlass.const_expr(cfg.rescale_o_before_pv):
                    self.rescale_O(softmax, acc_O, correction)
                kv = self.pv_block(kv, tiled_mma_pv, tOrP, tOrVt, acc_O, pipeline_v, halves, n_block_min)
            self.stamp(stamps, 3)

        self.epilogue(acc_O, softmax, mO, mLSE, tma_O, tma_mO, sO, seqlen, tiled_mma_pv, thr_mma_pv,
                      ctidx, warp_idx, m_block, head, batch)
        if cutlass.const_expr(cfg.timeline):
            self.stamp(stamps, 4)
            self.write_timeline(stamps, phases, mLSE, seqlen, m_block, head, batch,
                                cutlass.max(n_block_max - n_block_min, 0),
                                ctidx, wg_idx)
        if cutlass.const_expr(states is not None):
            return q_state, kv

    @cute.jit
    def attend_block(
        self, kv, n_block, mask_causal: cutlass.Constexpr, mask_local: cutlass.Constexpr, wg_idx,
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrP, tOrVt, acc_O, rP, pipeline_k, pipeline_v,
        softmax: OnlineSoftmax, correction, mask: AttentionMask, tScS_mn, t0ScS_mn, m_block,
        softcap_prescale, phases,
    ):
        """One key block n; `kv` is the ring slot to read next, the returned one the slot after.

        With intra-warpgroup overlap `kv` holds block n + 1, whose P is in rP: S(n) = Q K(n)ᵀ and
        O += P(n+1) V(n+1) are issued together and the softmax of S(n) runs while P·V is in
        flight. Without it, block n is done start to end: S, softmax, P·V.
        """
        cfg = self.cfg
        kv_s, tick = self.take_turn(kv, pipeline_k, wg_idx, phases)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.get_slice(0).partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
        gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_s.index], zero_init=True)
        if cutlass.const_expr(cfg.rescale_o_before_pv):
            # block n + 1's factors, for the O that P(n + 1) V(n + 1) is about to add to; S(n)'s
            # GEMM does not touch acc_O
            self.rescale_O(softmax, acc_O, correction)
        if cutlass.const_expr(cfg.intra_wg_overlap):
            pipeline_v.consumer_wait(kv)
            gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv.index], zero_init=False)
        self.pass_turn(wg_idx)
        tick = self.tick(phases, 2, tick)
        warpgroup.wait_group(1 if cutlass.const_expr(cfg.intra_wg_overlap) else 0)  # S is in
        tick = self.tick(phases, 3, tick)
        pipeline_k.consumer_release(kv_s)
        self.scores_to_probs(acc_S, n_block, False, False, mask_causal, mask_local,
                             softmax, correction, mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale,
                             self.pv_wait_midway())
        tick = self.tick(phases, 4, tick)
        if cutlass.const_expr(cfg.intra_wg_overlap):
            if cutlass.const_expr(cfg.pv_wait_at < 0):
                warpgroup.wait_group(0)  # P·V is done with rP and acc_O
            pipeline_v.consumer_release(kv)
        tick = self.tick(phases, 5, tick)
        if cutlass.const_expr(cfg.rescale_o_before_pv):
            self.probs_to_16bit(acc_S, rP)
        else:
            self.rescale_O_and_store_P(softmax, acc_O, correction, acc_S, rP)
        if cutlass.const_expr(not cfg.intra_wg_overlap):
            kv_s = self.pv_block(kv_s, tiled_mma_pv, tOrP, tOrVt, acc_O, pipeline_v)
        tick = self.tick(phases, 6, tick)
        if cutlass.const_expr(cfg.timeline):
            phases[TIMELINE_PHASES] = phases[TIMELINE_PHASES] + 1
        return kv_s

    @cute.jit
    def take_turn(self, kv, pipeline_k, wg_idx, phases):
        """The start of a key block: the ring slot of its K (the one after `kv` with the
        intra-warpgroup overlap), waited for, then the ping-pong's GEMM-issue turn; returns the
        slot and the `timeline` clock."""
        kv_s = kv
        if cutlass.const_expr(self.cfg.intra_wg_overlap):
            kv_s = kv.clone()
            kv_s.advance()
        tick = self.tick(phases, -1, Int32(0))
        pipeline_k.consumer_wait(kv_s)
        tick = self.tick(phases, 0, tick)
        if cutlass.const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=BARRIER_PINGPONG + wg_idx, number_of_threads=256)
        tick = self.tick(phases, 1, tick)
        return kv_s, tick

    @cute.jit
    def pass_turn(self, wg_idx):
        """Ping-pong: hand the GEMM-issue turn to the next consumer warpgroup."""
        if cutlass.const_expr(self.cfg.pingpong):
            next_wg = (wg_idx + 1) % self.cfg.num_consumer_wgs
            cute.arch.barrier_arrive(barrier_id=BARRIER_PINGPONG + next_wg, number_of_threads=256)

    @cute.jit
    def write_timeline(self, stamps, phases, mLSE, seqlen: SeqlenInfo, m_block, head, batch, blocks, ctidx, wg_idx):
        """`timeline`: this tile's record over the LSE of its first 32 query rows, after the
        epilogue (whose barriers order its LSE stores first); none for a tile with fewer rows."""
        cfg = self.cfg
        if seqlen.seqlen_q - m_block * cfg.tile_m >= 32:
            gLSE = cute.local_tile(seqlen.lse_row(mLSE, batch, head), (cfg.tile_m,), (m_block,))
            row = cute.make_tensor(cute.recast_ptr(gLSE.iterator, dtype=Int32), cute.make_layout(32))
            self.write_record(row, stamps, 5, phases, blocks, ctidx, wg_idx)

    @cute.jit
    def rescale_O(self, softmax: OnlineSoftmax, acc_O, correction):
        """O *= the last softmax's correction factors (with the lazy rescale a warp skips this
        when all of its factors are 1: `OnlineSoftmax.rescale`)."""
        softmax.rescale(acc_as_mma_sync(acc_O), correction)

    @cute.jit
    def rescale_O_and_store_P(self, softmax: OnlineSoftmax, acc_O, correction, acc_S, rP):
        """The end of a block once its P·V is waited for: O's rescale and P to 16 bits. With
        `p_in_smem` P's stores go first and drain behind the rescale's FMULs."""
        if cutlass.const_expr(self.cfg.p_in_smem):
            self.probs_to_16bit(acc_S, rP, publish=False)
            self.rescale_O(softmax, acc_O, correction)
            self.publish_probs()
        else:
            self.rescale_O(softmax, acc_O, correction)
            self.probs_to_16bit(acc_S, rP)

    @cute.jit
    def probs_to_16bit(self, acc_S, rP, publish: cutlass.Constexpr = True):
        """P rounded to 16 bits into rP (round to nearest even); with `p_in_smem` rP is a
        `ProbsInSmem`, and P goes on into this warpgroup's rows of sP (made visible to P·V by
        `publish_probs` here, or by the caller once it has done more).

        `.to()` packs two values per F2FP only when tile_n is a multiple of 64 (SASS at 64 and
        128); at 80 and 96 it converted one value at a time and packed them with PRMT (twice the
        F2FP, plus the PRMTs), so those tiles convert explicitly in pairs. The multiples of 64
        keep `.to()`: the same F2FPs, and the explicit form perturbed ptxas's register choice
        there (uniform-register descriptors back in vector registers at hd 256, tile_n 64).
        """
        rP_regs = rP.regs if cutlass.const_expr(self.cfg.p_in_smem) else rP
        if cutlass.const_expr(self.cfg.tile_n % 64 == 0):
            rP_regs.store(acc_S.load().to(self.dtype))
        else:
            store_pairs_16bit(acc_S, rP_regs)
        if cutlass.const_expr(self.cfg.p_in_smem):
            # the last P·V of this warpgroup has been waited for (every caller), so its slot is free
            cute.copy(rP.copy, rP.copy.retile(rP_regs), rP.dst)
            if cutlass.const_expr(publish):
                self.publish_probs()

    @cute.jit
    def publish_probs(self):
        """`p_in_smem`: this thread's P stores (stmatrix, the generic proxy) made visible to the
        P·V WGMMA (the async proxy). A warp's 16 rows of the warpgroup's m64 GEMM read only the
        16 rows of P that warp stored, so the warp, not the warpgroup, meets."""
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()

    @cute.jit
    def zero_unused_keys(self, sV, kv, rows_valid, ctidx, pipeline_v):
        """Zero the rows of the first V block past seqused_k before any P·V reads them.

        With `seqused_k` the keys past it still lie inside the tensor, so TMA loads them as they
        are, and a stale cache may hold NaN or Inf there: P is exactly 0 on those columns, but
        0 * NaN is NaN. Only the first visited block can be partial. Every consumer warpgroup
        zeroes its share, then all of them meet before the first GEMM on that slot (this runs
        before any ping-pong barrier, so the meeting cannot wait on a GEMM-issue turn).
        """
        cfg = self.cfg
        if rows_valid < cfg.tile_n:
            pipeline_v.consumer_wait(kv)
            sV_slot = sV[None, None, kv.index]
            elems = cfg.tile_n * cfg.head_dim_v
            for i in cutlass.range_constexpr((elems + self.num_consumer_threads - 1) // self.num_consumer_threads):
                idx = ctidx + i * self.num_consumer_threads
                row, col = idx // cfg.head_dim_v, idx % cfg.head_dim_v
                if row >= rows_valid and row < cfg.tile_n:
                    sV_slot[row, col] = self.dtype(0)
            # generic-proxy writes, read next by WGMMA through the async proxy
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BARRIER_EPILOGUE, number_of_threads=self.num_consumer_threads)

    @cute.jit
    def pv_block(self, kv, tiled_mma_pv, tOrP, tOrVt, acc_O, pipeline_v, halves: Optional[MaskedHalves] = None,
                 n_block=None):
        """O += P V(kv), waited for (with `halves`, over the keys of block `n_block` this
        warpgroup sees); returns the next ring slot."""
        pipeline_v.consumer_wait(kv)
        self.pv_gemm(halves, n_block, tiled_mma_pv, acc_O, tOrP, tOrVt, kv.index)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(kv)
        kv_next = kv.clone()
        kv_next.advance()
        return kv_next

    def pv_wait_midway(self):
        """With `pv_wait_at`, the P·V wait that `OnlineSoftmax.probs` issues among the block's
        exponentials (on every path of it); None otherwise."""
        if self.cfg.pv_wait_at < 0:
            return None
        return lambda: warpgroup.wait_group(0)  # P·V is done with rP and acc_O

    @cute.jit
    def scores_to_probs(
        self, acc_S, n_block, is_first: cutlass.Constexpr, mask_seqlen: cutlass.Constexpr,
        mask_causal: cutlass.Constexpr, mask_local: cutlass.Constexpr,
        softmax: OnlineSoftmax, correction, mask: AttentionMask, tScS_mn, t0ScS_mn, m_block,
        softcap_prescale, midway=None,
    ):
        """Soft-cap, mask and exponentiate S in place (fp32), leaving O's correction factors
        (`midway`: `OnlineSoftmax.probs`)."""
        if cutlass.const_expr(self.cfg.softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = tanhf(acc_S[i] * softcap_prescale)
        acc_S_mma = acc_as_mma_sync(acc_S)
        if cutlass.const_expr(mask_seqlen or mask_causal or mask_local):
            mask.apply(acc_S_mma, tScS_mn, t0ScS_mn, m_block, n_block, mask_seqlen, mask_causal, mask_local)
        softmax.probs(acc_S_mma, correction, is_first, midway, self.cfg.pv_wait_at)

    # ------------------------------------------------------------------------------------------
    # epilogue
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(
        self, acc_O, softmax: OnlineSoftmax, mO, mLSE, tma_O, tma_mO, sO,
        seqlen: SeqlenInfo, tiled_mma_pv, thr_mma_pv, ctidx, warp_idx, m_block, head, batch,
    ):
        cfg = self.cfg
        acc_O_mma = acc_as_mma_sync(acc_O)
        cO = cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v))
        tOcO_mn = acc_mn_view(acc_as_mma_sync(thr_mma_pv.partition_C(cO)))
        lse = cute.make_rmem_tensor(cute.size(tOcO_mn, mode=[0]), Float32)
        softmax.finalize(acc_O_mma, lse)
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))  # cvt.rn: round to nearest even
        rows_left = seqlen.seqlen_q - m_block * cfg.tile_m

        if cutlass.const_expr(mLSE is not None):
            gLSE = cute.local_tile(seqlen.lse_row(mLSE, batch, head), (cfg.tile_m,), (m_block,))
            if tOcO_mn[0, 0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(tOcO_mn, mode=[0])):
                    row = tOcO_mn[r, 0][0]
                    if row < rows_left:
                        gLSE[row] = lse[r]

        # Every consumer warpgroup is done reading sQ before O overwrites it (O has a buffer of its
        # own in a persistent configuration; the barrier stays).
        cute.arch.barrier(barrier_id=BARRIER_EPILOGUE, number_of_threads=self.num_consumer_threads)
        stsm = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype), tiled_mma_pv
        ).get_slice(ctidx)
        cute.copy(stsm, stsm.retile(rO), stsm.partition_D(sO))
        # stmatrix wrote through the generic proxy; the TMA store reads through the async one.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BARRIER_EPILOGUE, number_of_threads=self.num_consumer_threads)

        if cutlass.const_expr(not cfg.varlen_q):
            if warp_idx == 4:
                gO = cute.local_tile(tma_mO[None, None, head, batch], (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
                )
                cute.copy(tma_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            headdim_v = mO.shape[2]
            gO = cute.local_tile(seqlen.q_rows(mO, batch, head), (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
            copy_O = make_row_tiled_copy(cute.nvgpu.CopyUniversalOp(), self.dtype, cfg.head_dim_v,
                                         self.num_consumer_threads)
            thr_copy_O = copy_O.get_slice(ctidx)
            tOsO = thr_copy_O.partition_S(sO)
            tOgO = thr_copy_O.partition_D(gO)
            tOcO = thr_copy_O.partition_D(cO)
            tOrO = cute.make_fragment_like(tOsO, self.dtype)
            cute.autovec_copy(tOsO, tOrO)
            tOpD = col_predicate(tOcO, headdim_v)
            for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
                if tOcO[0, m, 0][0] < rows_left:
                    cute.copy(copy_O, tOrO[None, m, None], tOgO[None, m, None], pred=tOpD[None, m, None])
