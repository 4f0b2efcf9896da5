"""Persistent CTAs of the sm_90 forward (`fwd.py`), a mixin of `FlashFwdSm90`.

Persistent configurations (`persistent`: head dims 64 to 128) launch one CTA per SM, and each
walks the tiles blockIdx.x, + gridDim.x, ... (or those of the tile counter, below) in the order
of `tile_coords` (sections of (batch, head) pairs whose K/V fit in L2, longest tiles first for
causal masks and local windows). Producer and consumers walk the same sequence; the ring states
of Q and K/V carry over from tile to tile, the consumers release Q once a tile's last S GEMM is
done, so the producer loads the next tile's Q and first K blocks while this tile's last P·V and
epilogue run. O then has its own shared memory instead of Q's. The ping-pong turn carries over
too: both warpgroups run the same number of blocks per tile.

With a causal mask the tiles differ in length and a fixed stride leaves some SMs with far more
work than others: such a configuration (`tile_counter`) takes its first tile from blockIdx.x
and every later one from a global counter (one atomic add by the producer warp, issued once
it has issued the current tile's loads, `late_take`), longest first in `tile_coords`' order,
so a CTA that finishes early takes the next tile, as the hardware's grid scheduler would. The
producer hands each tile index to the consumers through shared memory between two named
barriers. The call's last add sets the counter back to 0 (`reset_counter_after_last_add`), so
one counter per stream serves every call (`CuteSm90Backend.tile_counter`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from ..common.mask import AttentionMask
from .fwd_sync import BARRIER_PINGPONG, BARRIER_TILE_EMPTY, BARRIER_TILE_FULL, cluster_tile_coords, tile_coords


class PersistentTiles:
    """Mixin of `FlashFwdSm90`: a persistent CTA's walk over its tiles, the tile counter, and each
    tile's share of the producer and the consumers."""

    def persistent_tile(self, tile, num_m_blocks, num_heads, num_batch, heads_per_section, mQ, mK, mCuSeqlensQ,
                        mCuSeqlensK, mSeqUsedK, window_left, window_right) -> tuple:
        """(m_block, head, batch, lone) of a persistent CTA's tile `tile` (`tile_coords`, longest
        first with a causal mask or window; with `cluster_kv` `cluster_tile_coords`, whose `lone`
        tiles load their K/V without the other CTA, else None) and that sequence's `sequence`."""
        cfg = self.cfg
        lone = None
        if cutlass.const_expr(cfg.cluster_kv):
            # `tile` is a pair of query blocks (or, `lone`, the last ones of two heads); this CTA
            # takes the one of its rank in the cluster (one head per section: no mask)
            m_block, pair, lone = cluster_tile_coords(tile, num_m_blocks, cute.arch.block_idx_in_cluster(), cutlass.max)
            head, batch = pair % num_heads, pair // num_heads
        else:
            m_block, head, batch = tile_coords(
                tile, num_m_blocks, num_heads, num_batch, heads_per_section, cfg.causal or cfg.local, cutlass.min
            )
        return (m_block, head, batch, lone) + self.sequence(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left, window_right
        )

    @cute.jit
    def run_persistent(
        self, tidx, warp_idx, mQ, mK, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
        tma_Q, tma_mQ, tma_K, tma_mK, tma_V, tma_mV, tma_O, tma_mO, sQ, sK, sV, sO, sP,
        pipeline_q, pipeline_k, pipeline_v, tiled_mma_qk, tiled_mma_pv,
        softmax_scale_log2, softcap_prescale, window_left, window_right,
        num_m_blocks, num_batch, heads_per_section, mTileCounter, sNextTile,
    ):
        """Every tile of this CTA, producer and consumers walking the same sequence with ring
        states that carry over from tile to tile: blockIdx.x, + gridDim.x, ..., or, with
        `tile_counter`, blockIdx.x and then whatever the counter hands out."""
        cfg = self.cfg
        num_heads, _ = self.head_counts(mQ, mK)
        num_tiles = num_m_blocks * num_heads * num_batch
        first_tile, _, _ = cute.arch.block_idx()
        tile_step = cute.arch.grid_dim()[0]
        if cutlass.const_expr(cfg.cluster_kv):
            # a cluster walks the pairs of neighbouring query blocks (`persistent_tile`)
            num_tiles, first_tile, tile_step = num_tiles // 2, first_tile // 2, tile_step // 2
        # what `persistent_tile` takes besides the tile: producer and consumers walk the same tiles
        tile_args = (num_m_blocks, num_heads, num_batch, heads_per_section, mQ, mK, mCuSeqlensQ, mCuSeqlensK,
                     mSeqUsedK, window_left, window_right)
        # the producer warp and every consumer thread meet at the hand-over barriers
        handover_threads = 32 + self.num_consumer_threads
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.registers[1])
            if warp_idx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
                load_args = (tma_Q, tma_mQ, tma_K, tma_mK, tma_V, tma_mV, sQ, sK, sV,
                             pipeline_q, pipeline_k, pipeline_v)
                if cutlass.const_expr(cfg.tile_counter):
                    tile = first_tile
                    while tile < num_tiles:
                        # `late_take`: taken once this tile's loads are issued, so that the next
                        # tile goes to a CTA about to be free, as the grid scheduler would hand it
                        # out; else taken now, and read after the loads, which hide its latency
                        taken = None if cutlass.const_expr(cfg.late_take) else self.take_tile(mTileCounter)
                        q_state, kv_state = self.load_persistent_tile(tile, tile_args, load_args, q_state, kv_state)
                        if cutlass.const_expr(cfg.late_take):
                            taken = self.take_tile(mTileCounter)
                        self.reset_counter_after_last_add(mTileCounter, taken, num_tiles - 1)
                        next_tile = cute.arch.shuffle_sync(taken, 0) + tile_step
                        cute.arch.barrier(barrier_id=BARRIER_TILE_EMPTY, number_of_threads=handover_threads)
                        sNextTile[0] = next_tile
                        cute.arch.barrier_arrive(barrier_id=BARRIER_TILE_FULL, number_of_threads=handover_threads)
                        tile = next_tile
                else:
                    for tile in cutlass.range(first_tile, num_tiles, tile_step, unroll=1):
                        q_state, kv_state = self.load_persistent_tile(tile, tile_args, load_args, q_state, kv_state)
                if cutlass.const_expr(cfg.cluster_kv):
                    self.kv_tail(pipeline_k, pipeline_v, kv_state)
        else:
            cute.arch.setmaxregister_increase(cfg.registers[0])
            ctidx = tidx - 128
            if cutlass.const_expr(cfg.pingpong):
                # The first warpgroup holds the first GEMM-issue turn (once: the turns carry over).
                if ctidx < 128:
                    cute.arch.barrier_arrive(barrier_id=BARRIER_PINGPONG, number_of_threads=256)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
            consume_args = (ctidx, warp_idx, mO, mLSE, tma_O, tma_mO, sQ, sK, sV, sO, sP,
                            pipeline_q, pipeline_k, pipeline_v, tiled_mma_qk, tiled_mma_pv)
            if cutlass.const_expr(cfg.tile_counter):
                tile = first_tile
                while tile < num_tiles:
                    # the slot is free again: the index of this tile was read from it
                    cute.arch.barrier_arrive(barrier_id=BARRIER_TILE_EMPTY, number_of_threads=handover_threads)
                    q_state, kv_state = self.consume_persistent_tile(
                        tile, tile_args, consume_args, softmax_scale_log2, softcap_prescale, q_state, kv_state
                    )
                    cute.arch.barrier(barrier_id=BARRIER_TILE_FULL, number_of_threads=handover_threads)
                    tile = sNextTile[0]
            else:
                for tile in cutlass.range(first_tile, num_tiles, tile_step, unroll=1):
                    q_state, kv_state = self.consume_persistent_tile(
                        tile, tile_args, consume_args, softmax_scale_log2, softcap_prescale, q_state, kv_state
                    )

    @cute.jit
    def take_tile(self, mTileCounter: cute.Tensor):
        """One atomic add on the tile counter by lane 0, whose old value is returned (in lane 0; the
        caller broadcasts it): the CTA's next tile is num_ctas + that value (the first num_ctas
        tiles went by blockIdx.x)."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(mTileCounter.iterator, Int32(1), sem="relaxed", scope="gpu")
        return taken

    @cute.jit
    def reset_counter_after_last_add(self, mTileCounter: cute.Tensor, taken, last):
        """Lane 0 sets the tile counter back to 0 if its add (`taken`) was the call's last.

        Every tile a CTA works on costs it exactly one add (its last tile's add hands out none),
        so a call makes num_tiles adds in all, which return 0, 1, ..., num_tiles - 1 in the order
        the counter takes them: the add that returned `last` (num_tiles - 1) was the call's last,
        and after it the counter is the next call's on the stream. Called after the tile's
        loads, like the read of `taken`, so that no load waits for the atomic."""
        if cute.arch.lane_idx() == 0:
            if taken == last:
                cute.arch.atomic_exch(mTileCounter.iterator, Int32(0), sem="relaxed", scope="gpu")

    @cute.jit
    def load_persistent_tile(self, tile, tile_args, load_args, q_state, kv_state):
        """The producer's loads of persistent tile `tile` (none if it has no visible key)."""
        cfg = self.cfg
        num_heads, num_heads_k = self.head_counts(tile_args[4], tile_args[5])
        m_block, head, batch, lone, seqlen, left, right, block_info = self.persistent_tile(tile, *tile_args)
        if m_block * cfg.tile_m < seqlen.seqlen_q:
            n_block_min, n_block_max = block_info.n_block_range(seqlen, m_block)
            if n_block_max > n_block_min:
                q_state, kv_state = self.load(
                    *load_args, seqlen, m_block, head, head // (num_heads // num_heads_k), batch,
                    n_block_min, n_block_max, states=(q_state, kv_state), lone=lone,
                )
        return q_state, kv_state

    @cute.jit
    def consume_persistent_tile(self, tile, tile_args, consume_args, softmax_scale_log2, softcap_prescale,
                                q_state, kv_state):
        """The consumers' share of persistent tile `tile`."""
        cfg = self.cfg
        m_block, head, batch, _, seqlen, left, right, block_info = self.persistent_tile(tile, *tile_args)
        if m_block * cfg.tile_m < seqlen.seqlen_q:
            n_block_min, n_block_max = block_info.n_block_range(seqlen, m_block)
            mask = AttentionMask(cfg.tile_m, cfg.tile_n, seqlen.seqlen_q, seqlen.seqlen_k, left, right, cfg.mask_bits)
            q_state, kv_state = self.consume(
                *consume_args, seqlen, block_info, mask, m_block, head, batch, n_block_min, n_block_max,
                softmax_scale_log2, softcap_prescale, states=(q_state, kv_state),
            )
        return q_state, kv_state
