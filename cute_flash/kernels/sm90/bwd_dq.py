"""The dQ path of the sm_90 backward (`bwd.py`): a mixin of `FlashBwdSm90`, from the consumers'
dQ accumulators to the fp32 accumulator in global memory (and, with `dq_convert`, on to dQ).

In the basic dQ path each warpgroup multiplies only its own 64 rows of K, V and dS^T, so the
two never wait for each other: each writes its partial dQ (over its own keys, fp32) to its
own shared-memory tile, and its first warp adds that tile to the fp32 accumulator in global
memory with one TMA reduce-add (`cp.reduce.async.bulk.tensor`; the preprocess kernel cleared the
accumulator, the postprocess kernel scales and rounds it). Before the tile is rewritten for
the next query block that warp waits for the previous reduce-add to have read it. Scalar
`red.add`s from registers, 64 per thread and block, kept the L2 so busy that the kernel ran
at under a third of this speed.

Two refinements (`bwd_config.py`; the shipped tiles use both at head dims 64, 96 and 128): with
`dq_split` both warpgroups' dS^T rows are written before either multiplies (one barrier of
both, two dS^T buffers so that the next step's rows never overwrite those the other warpgroup
still reads) and each computes half of dQ's columns over all 128 keys: one dQ tile per block
instead of two partials. With `dq_writer` the producer warpgroup's second warp issues the
reduce-adds: a consumer warpgroup writes its tile, arrives on a named barrier (DQ_FULL) and
goes on, and waits (DQ_EMPTY) only if the previous reduce-add has not yet read the tile it is
about to rewrite.

With `dq_flat` (fixed-length calls with the writer warp) the tile is not row-major: each thread
stores its accumulator registers in their own order, 128 bits at a time, into a flat tile, which
goes to a flat accumulator, (batch, head, padded seqlen, d), in one 1-D bulk reduce-add
(`cp.reduce.async.bulk ... add.f32`); the preprocess clears the accumulator, and an sm_90
postprocess (`bwd_post.py`) puts the rows back in order -- or, with `dq_convert` (an A/B option:
`bwd_config.py` has its measurements), this kernel itself: the grid ends in one conversion CTA
per SM, launched after every key block's, so they take only SMs that no key block is left for.
At the end of a key block's CTA, once its reduce-adds are performed, the writer warp adds one to
a counter per (batch, query head, query block) of its walk (`count_added`), and each warpgroup
of a conversion CTA waits for its query block's count of key blocks (`BlockInfo.n_block_range`,
as the deterministic turns count them) before it rounds the block into dQ (`convert_dq`). The
conversions of the heads that have finished fill the grid's last wave, where the postprocess
kernel would run after it.

Ordered dQ (`deterministic`): the reduce-adds of the key blocks that see a query block land in
key-block order, so the fp32 sums, and dQ, are the same bits on every run. A turn counter per
(batch, query head, query block) in global memory (zeroed by the host) counts the key blocks
that have added; the dQ writer warp of key block n waits (acquire) until it reaches n's place
among them (`BlockInfo.key_block_turn`), issues the step's reduce-adds, waits for them to be
performed and passes the turn on (release). Every CTA walks its query
blocks in the same order, and the CTA whose turn comes first is launched first, so the CTA a
CTA waits for never waits for it; clusters and rotated walks, which break that, are off. The
grid is `lpt`'s: key block n of a section's heads next to each other, so that the CTAs that
start together hold few blocks of each head, and each turn waits for few hand-overs. Without a
mask the turns and the launches go from the first key block up. With a causal mask or a window
(`shortest_first`) they go from the last key block down, while every walk still goes up from
its first query block: key block n + 1's walk starts at n's first query block or a later one,
so it reaches each block no later than n, and in lockstep no CTA waits at all. (Walks from the
last block down, with turns from the first key block up, made every CTA of a head reach a
block at the same step and wait there for all the key blocks before it:
`benchmarks/ab_deterministic.py` on an H200, hd 64, 2 x 8192 x 32 heads, causal: 414.9
TFLOP/s, shortest first 461.0; hd 128 level.)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from ..common.block_info import BlockInfo
from ..common.seqlen_info import SeqlenInfo
from ..common.smem_layouts import swizzle_params
from ..common.tiles import COPY_BITS
from ..common.utils import bulk_reduce_add_f32, elem_pointer, pass_turn, wait_for_count, wait_for_turn
from .bwd_config import NUM_CONSUMER_WGS, NUM_CONVERT_GROUPS
from .bwd_sync import BARRIER_DQ_FULL, QueryWalk
from .fwd import FlashFwdSm90

# `dq_convert`: the counter loads after which a wait means a count that never comes (`wait_for_count` traps)
CONVERT_MAX_POLLS = 1 << 24
# ... and the pause between two of them: the polls of every waiting warp stay off the L2, which the
# key blocks' reduce-adds keep busy
CONVERT_PAUSE_NS = 500


class DqSwap(NamedTuple):
    """`dq_swap`'s trace-time plan of one thread's dQ stores (`DqPath.dq_smem_copy`)."""

    pairing: list  # per copy slot k: (k, the slot 16 columns away, k's anchor slot, k's offset past it)
    odd_flip: object  # bytes XORed into an odd row's store addresses (64), else 0 (a runtime value)
    mask: int  # the tiles' byte swizzle: the address bits XORed, ...
    shift: int  # ... shifted down by this, into the 16-byte chunk index
    pair_copy: object  # the 64-bit copy atom


class DqPath:
    """Mixin of `FlashBwdSm90`: the dQ writer warp, the consumers' dQ tiles in shared memory and
    their hand-over, and the conversion CTAs of `dq_convert`."""

    @cute.jit
    def write_dq(self, tma_dQ, tma_mdQ, mdQflat: Optional[cute.Tensor], sdQ, seqlen: SeqlenInfo, batch,
                 walk: QueryWalk, n_block, block_info: BlockInfo, mdQsem: Optional[cute.Tensor]):
        """The dQ writer warp (`dq_writer`): for every query block, in the consumers' order, each
        warpgroup's dQ tile goes to dQaccum by a TMA reduce-add (`dq_flat`: a 1-D bulk one) as
        soon as it is written.

        `deterministic`: the key blocks that see a query block add into it in a fixed key-block
        order. The query block's turn counter (`mdQsem`) counts the key blocks that have added;
        this CTA's turn is its key block's place among them (`BlockInfo.key_block_turn`, from the
        last key block down with `shortest_first`), and the CTA whose turn comes first is launched
        first, so it never waits for this one. Once both of this step's reduce-adds are complete,
        the counter passes the turn on."""
        cfg = self.cfg
        writer_and_wg = 32 + 128
        steps = walk.steps
        lane = cute.arch.lane_idx() if cutlass.const_expr(cfg.deterministic) else None
        for it in cutlass.range(steps, unroll=1):
            head, m_block = walk.coords(it)
            buf = it % cfg.dq_stages
            sem_ptr, turn = None, None
            if cutlass.const_expr(cfg.deterministic):
                sem_ptr = elem_pointer(mdQsem, (batch, head, m_block))
                turn = block_info.key_block_turn(seqlen, n_block, m_block, cfg.shortest_first)
            for w in cutlass.range_constexpr(NUM_CONSUMER_WGS):
                cute.arch.barrier(barrier_id=self.dq_barrier(BARRIER_DQ_FULL, w, buf), number_of_threads=writer_and_wg)
                if cutlass.const_expr(cfg.deterministic and w == 0):
                    if lane == 0:
                        wait_for_turn(sem_ptr, turn)
                    cute.arch.sync_warp()
                    # the reduce-adds (async proxy) come after the previous key block's
                    cute.arch.fence_proxy("async.global")
                if cutlass.const_expr(cfg.dq_flat):
                    self.reduce_add_dq_flat(mdQflat, sdQ[None, None, w, buf], batch, head, m_block, w)
                else:
                    self.reduce_add_dq(tma_dQ, tma_mdQ, sdQ[None, None, w, buf], seqlen, batch, head, m_block, w)
                if cutlass.const_expr(cfg.deterministic and w == NUM_CONSUMER_WGS - 1):
                    cute.arch.cp_async_bulk_wait_group(0)  # both reduce-adds performed, not just read
                    if lane == 0:
                        cute.arch.fence_proxy("async.global")
                        pass_turn(sem_ptr, turn)
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                if it + cfg.dq_stages < steps:  # the warpgroup writes this tile again only after this
                    cute.arch.barrier_arrive(barrier_id=self.dq_barrier(self.barrier_dq_empty, w, buf),
                                             number_of_threads=writer_and_wg)
        cute.arch.cp_async_bulk_wait_group(0)  # every reduce-add done before the CTA leaves
        if cutlass.const_expr(cfg.dq_convert):
            self.count_added(mdQsem, batch, walk)

    @cute.jit
    def count_added(self, mdQcount: cute.Tensor, batch, walk: QueryWalk):
        """`dq_convert`: every step's dQ tiles are added (the reduce-adds, issued by lane 0, are
        performed); one more on the counter of each step's (batch, query head, query block), by
        release adds (GPU scope) of the writer warp's lanes, 32 steps at a time. Once per CTA, at
        its end, off the writer's path between steps (a count after every step measured slower,
        `Sm90BwdConfig.dq_convert`); the conversion CTAs run in the grid's last wave, when most
        heads are whole anyway."""
        lane = cute.arch.lane_idx()
        if lane == 0:
            cute.arch.fence_proxy("async.global")
        cute.arch.sync_warp()  # lane 0's writes before every lane's release
        for it in cutlass.range(lane, walk.steps, 32, unroll=1):
            head, m_block = walk.coords(it)
            cute.arch.atomic_add(elem_pointer(mdQcount, (batch, head, m_block)), Int32(1), sem="release", scope="gpu")

    @cute.jit
    def convert_dq(self, mdQflat: cute.Tensor, mdQ: cute.Tensor, mdQcount: cute.Tensor, mQ, mK, mCuSeqlensQ,
                   mCuSeqlensK, mSeqUsedK, tiled_mma_dQ: cute.TiledMma, num_batch, num_heads, cta,
                   num_convert_ctas, softmax_scale: Float32, window_left, window_right, tidx):
        """`dq_convert`: each warpgroup of conversion CTA `cta` (of `num_convert_ctas`) takes every
        `NUM_CONVERT_GROUPS * num_convert_ctas`-th chunk of the flat accumulator (`dq_chunks` per
        query block), in (batch, head, query block) order -- the order in which the key blocks'
        CTAs are launched and mostly finish them. For each, its threads wait (acquire) until every
        key block that sees the query block (`BlockInfo.n_block_range`; none for rows no key is
        visible to, whose cleared floats give dQ = 0) has added into it, then read their floats
        back as the postprocess kernel does and store each rounded pair of columns straight to
        mdQ: no shared memory, no barrier, one chunk's loads in flight per warpgroup."""
        cfg = self.cfg
        group, t = tidx // 128, tidx % 128
        num_m_blocks = (mQ.shape[1] + cfg.tile_m - 1) // cfg.tile_m
        per_batch = num_heads * num_m_blocks
        headdim = mdQ.shape[3]
        pair_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                         num_bits_per_copy=2 * self.dtype.width)
        stride = NUM_CONVERT_GROUPS * num_convert_ctas
        for item in cutlass.range(cta * NUM_CONVERT_GROUPS + group, num_batch * per_batch * cfg.dq_chunks, stride,
                                  unroll=1):
            j, chunk_idx = item // cfg.dq_chunks, item % cfg.dq_chunks
            batch = j // per_batch
            head = (j % per_batch) // num_m_blocks
            m_block = j % num_m_blocks
            seqlen = SeqlenInfo.create(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
            block_info = self.visibility(seqlen, window_left, window_right)[2]
            n_block_min, n_block_max = block_info.n_block_range(seqlen, m_block)
            wait_for_count(elem_pointer(mdQcount, (batch, head, m_block)), n_block_max - n_block_min,
                           CONVERT_MAX_POLLS, CONVERT_PAUSE_NS)
            rows = seqlen.seqlen_q - m_block * cfg.tile_m
            gdQ = cute.local_tile(mdQ[batch, None, head, None], (cfg.tile_m, cfg.head_dim), (m_block, 0))

            def store(row, col, pair):
                if (row < rows) & (col < headdim):
                    addr = (gdQ.iterator + cute.crd2idx((row, col), gdQ.layout)).toint()
                    dst = cute.make_ptr(self.dtype, addr, cute.AddressSpace.gmem, assumed_align=4)
                    cute.copy(pair_store, pair, cute.make_tensor(dst, cute.make_layout(2)))

            self.flat_dq.rounded_pairs(mdQflat, batch, head, m_block, chunk_idx, t, softmax_scale, tiled_mma_dQ, store)

    @cute.jit
    def reduce_add_dq(self, tma_dQ, tma_mdQ, sdQ_wg, seqlen: SeqlenInfo, batch, head, m_block, wg_idx):
        """One warpgroup's dQ tile (in `sdQ_wg`) added to dQaccum by TMA; called by a whole warp.
        TMA clips the rows past the tensor; in a varlen batch the rows past this sequence belong to
        the next one and get + 0.0 (P, and so dS and dQ, are 0 there)."""
        cfg = self.cfg
        row_block, col_block = m_block, 0
        if cutlass.const_expr(cfg.dq_split):
            col_block = wg_idx
        if cutlass.const_expr(cfg.dq_rows):
            row_block = m_block * NUM_CONSUMER_WGS + wg_idx
        gdQ = cute.local_tile(FlashFwdSm90.rows(tma_mdQ, cfg.varlen_q, seqlen.offset_q, batch, head),
                              (cfg.dq_rows_per_wg, cfg.dq_cols), (row_block, col_block))
        tdQsdQ, tdQgdQ = cpasync.tma_partition(
            tma_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ_wg, 0, 2), cute.group_modes(gdQ, 0, 2)
        )
        cute.copy(tma_dQ, tdQsdQ, tdQgdQ)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def reduce_add_dq_flat(self, mdQflat: cute.Tensor, sdQ_wg, batch, head, m_block, wg_idx):
        """`dq_flat`: one warpgroup's flat dQ tile added to its run of the query block's floats in
        mdQaccum, (batch, head, padded seqlen, d), by a 1-D bulk reduce-add that one lane issues;
        called by a whole warp. Where both warpgroups hold partial sums of the whole tile they add
        into the same run (`Sm90BwdConfig.dq_chunks`)."""
        cfg = self.cfg
        chunk = cfg.dq_rows_per_wg * cfg.dq_cols
        block = cute.local_tile(mdQflat[batch, head, None, None], (cfg.tile_m, cfg.head_dim), (m_block, 0))
        gaddr = block.iterator.toint() + (wg_idx * chunk * 4 if cutlass.const_expr(cfg.dq_chunks > 1) else 0)
        if cute.arch.lane_idx() == 0:
            bulk_reduce_add_f32(gaddr, sdQ_wg.iterator.toint(), chunk * 4)
        cute.arch.cp_async_bulk_commit_group()

    def dq_smem_copy(self, tiled_mma_dQ: cute.TiledMma, sdQ, wg_idx, ctidx):
        """The copy of this warpgroup's fp32 dQ tile (pairs of floats) from its accumulator to its
        shared-memory tiles (`dq_stages` of them), the sources of its TMA reduce-adds: (copy, the
        thread's partition of the tiles, `dq_swap`'s plan or None).

        The plan (`DqSwap`): for each copy slot k (two floats of a row) of the thread, the slot p
        with the same rows 16 columns away, and the slot whose address k's is a multiple of the
        swizzle's period (8 rows of 128 bytes) from, so that k's address is that slot's plus an
        immediate; 64 if this thread's rows are odd, else 0; the swizzle's mask and shift."""
        cfg = self.cfg
        pair_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        tiled_r2s = cute.make_tiled_copy_C(pair_copy, tiled_mma_dQ)
        r2s_dQ = tiled_r2s.get_slice(ctidx % 128)
        tdQsdQ = r2s_dQ.partition_D(sdQ[None, None, wg_idx, None])
        if cutlass.const_expr(not cfg.dq_swap):
            return r2s_dQ, tdQsdQ, None
        # (row, column) of each value: thread 0's are compile-time constants, and a thread's are
        # its first one's plus those (the accumulator's column offsets stay below 8). A slot is a
        # pair of values (one 64-bit store): mode 0's first sub-mode.
        cD = cute.make_identity_tensor((cfg.dq_rows_per_wg, cfg.dq_cols))
        t0cD = tiled_r2s.get_slice(0).partition_D(cD)
        assert cute.size(t0cD, mode=[1]) == cute.size(t0cD, mode=[2]) == 1 and cute.size(t0cD.shape[0][0]) == 2
        slots = cute.size(t0cD) // 2
        where = {tuple(t0cD[2 * k]): k for k in range(slots)}
        # the slots' element offsets from the thread's first (the same for every thread)
        offsets = [cute.crd2idx(((0, k), 0, 0, 0), tdQsdQ.layout) for k in range(slots)]
        # the tiles' byte swizzle (`swizzle_params`, on byte addresses for TMA): the 16-byte chunk
        # index XORed with the row inside an atom of 8 rows of 128 bytes (32 columns), which
        # repeats every 8 rows; columns c ^ 16 are 64 bytes away, inside the chunk bits
        p = swizzle_params(Float32.width, cfg.dq_cols)
        row_bytes, chunk_bits = p.atom_cols * Float32.width // 8, (COPY_BITS // 8).bit_length() - 1
        assert row_bytes == 128 and 16 * Float32.width // 8 == row_bytes // 2
        mask = ((1 << p.bits) - 1) << (chunk_bits + p.shift)
        anchor = {}
        pairing = []
        for k in range(slots):
            row, col = t0cD[2 * k]
            first = anchor.setdefault((offsets[k] * 4) % (p.atom_rows * row_bytes), k)
            pairing.append((k, where[(row, col ^ 16)], first, offsets[k] - offsets[first]))
        odd_flip = (r2s_dQ.partition_D(cD)[0][0] % 2) * (row_bytes // 2)
        return r2s_dQ, tdQsdQ, DqSwap(pairing, odd_flip, mask, p.shift, pair_copy)

    @cute.jit
    def store_dq_flat(self, acc_dQ, sdQ_tile):
        """`dq_flat`: the accumulator in its register order, 128 bits per store: values 4 i .. 4 i + 3
        of thread t at float 4 (128 i + t) of the warpgroup's flat tile, so that a warp's stores
        are 512 consecutive bytes (no bank conflicts)."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        base = sdQ_tile.iterator.toint() + (cute.arch.thread_idx()[0] % 128) * 16
        for i in cutlass.range_constexpr(cute.size(acc_dQ) // 4):
            vals = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            for v in cutlass.range_constexpr(4):
                vals[v] = acc_dQ[4 * i + v]
            ptr = cute.make_ptr(Float32, base + i * 128 * 16, cute.AddressSpace.smem, assumed_align=16)
            cute.copy(atom, vals, cute.make_tensor(ptr, cute.make_layout(4)))

    @cute.jit
    def store_dq(self, r2s_dQ, acc_dQ, tdQsdQ_buf, swap):
        """The dQ accumulator into one shared-memory tile (`dq_smem_copy`'s partition of it).

        With `dq_swap` a thread of an odd row stores, in each slot's instruction, the values of
        the slot 16 columns away at that slot's place: the tile's 128-byte swizzle XORs the
        16-byte chunk index with the row inside its 8-row atom, so that rows 2i and 2i + 1 put a
        column pair in the same banks and a half-warp's four rows collided two by two (each
        64-bit store took four wavefronts instead of two); columns c ^ 16 lie in the other half
        of the banks. The place of column c ^ 16 is that of c XOR 64 bytes after the swizzle
        (its bit 6 is one of the XOR's targets), computed here from the swizzled address."""
        src = r2s_dQ.retile(acc_dQ)
        if cutlass.const_expr(swap is None):
            cute.copy(r2s_dQ, src, tdQsdQ_buf)
        else:
            odd = swap.odd_flip != 0
            pair = cute.make_layout(2)
            base = {}
            for k, p, first, delta in swap.pairing:
                if cutlass.const_expr(first == k):
                    # the byte address after the tile's swizzle, then for odd rows the other half
                    # of the row's banks
                    logical = tdQsdQ_buf[(None, k), 0, 0].iterator.toint()
                    base[k] = (logical ^ ((logical & swap.mask) >> swap.shift)) ^ swap.odd_flip
                values = cute.make_rmem_tensor(pair, Float32)
                for v in cutlass.range_constexpr(2):
                    values[v] = Float32(cutlass.select_(odd, src[2 * p + v], src[2 * k + v]))
                ptr = cute.make_ptr(Float32, base[first] + delta * 4, cute.AddressSpace.smem, assumed_align=8)
                cute.copy(swap.pair_copy, values, cute.make_tensor(ptr, pair))

    @cute.jit
    def write_dq_tile(self, r2s_dQ, acc_dQ, tdQsdQ, dq_swap, wg_idx, it, sdQ_wg):
        """`dq_writer`: block `it`'s dQ tile into this warpgroup's shared-memory tile, once the
        writer warp's last reduce-add from it has read it, and (unless `dq_fence_late`) over to
        the writer."""
        cfg = self.cfg
        buf = it % cfg.dq_stages
        if it >= cfg.dq_stages:
            cute.arch.barrier(barrier_id=self.dq_barrier(self.barrier_dq_empty, wg_idx, buf), number_of_threads=128 + 32)
        if cutlass.const_expr(cfg.dq_flat):
            self.store_dq_flat(acc_dQ, sdQ_wg[None, None, buf])
        else:
            self.store_dq(r2s_dQ, acc_dQ, tdQsdQ[None, None, None, buf], dq_swap)
        if cutlass.const_expr(not cfg.dq_fence_late):
            self.hand_over_dq(wg_idx, buf)

    @cute.jit
    def hand_over_dq(self, wg_idx, buf):
        """The warpgroup's dQ tile `buf`, stored to shared memory, goes to the writer warp
        (`dq_writer`)."""
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read next by TMA
        cute.arch.barrier_arrive(barrier_id=self.dq_barrier(BARRIER_DQ_FULL, wg_idx, buf), number_of_threads=128 + 32)

    def dq_barrier(self, base, wg_idx, buf):
        """The named barrier of warpgroup `wg_idx`'s dQ tile `buf` among the FULL (or EMPTY)
        barriers that start at `base`."""
        return base + wg_idx * self.cfg.dq_stages + buf
