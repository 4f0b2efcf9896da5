"""FlashAttention backward for sm_90a: TMA + WGMMA, one producer warp and two consumer warpgroups.

One CTA owns `tile_n` = 128 keys of one (KV head, batch) and keeps their dK and dV in fp32
registers while it walks, for every query head of the GQA group in turn, the query blocks that
see those keys (the same walk as the sm_80 kernel, `kernels/sm80/bwd.py`). The group's sum is
formed in registers and dK/dV are written once, in the input dtype.

1. Producer (warpgroup 0, which gives its registers away with `setmaxnreg`): its first warp
   loads K and V once, then (Q, dO, LSE_log2, D) of each query block into a `num_stages`-deep
   ring guarded by mbarriers (`PipelineTmaAsync`), all by TMA. TMA clips at the tensor bounds
   and zero-fills, so nothing outside the tensors is ever read. A box must start 16-byte
   aligned in its innermost dimension: for Q, dO, K and V that is the head dim (from 0); the
   LSE / D rows of a varlen sequence start anywhere, so their box starts up to 3 rows early
   (`stat_block`).
2. Consumers (warpgroups 1 and 2, each owning 64 of the keys). Everything is computed
   transposed (keys x queries), so that the probabilities come out of the WGMMA in the layout of
   the register A operand of the key-side products and never touch shared memory:

       S^T  = K Q^T                   (A = K, B = Q: shared memory, K-major)
       dP^T = V dO^T                  (A = V, B = dO)
       P^T  = exp2(S^T * scale_log2 - LSE_log2[query])       0 where masked
       dV  += P^T dO                  (A = P^T from registers, B = dO^T: MN-major view of dO)
       dS^T = P^T * (dP^T - D[query])  [* (1 - tanh^2) with soft-capping]
       dK  += dS^T Q                  (A = dS^T from registers, B = Q^T)
       dQ_w = dS[:, keys of w] K[keys of w, :]   (dS^T of the warpgroup staged in shared memory)

   S^T and dP^T are issued together and P^T is computed while dP^T is in flight (with
   soft-capping dP^T waits for P^T: tanh's values leave no room for it at head dim 128); dV
   runs while dS^T is formed (`overlap_dv`; with soft-capping it is waited for first), and dK
   while dS^T goes to shared memory, or, at head dim 64 (`dk_after_dq`), after the dQ GEMM and
   on into the next query block, its Q stage released there. 64 * (d + dv) / 128 registers of
   dK and dV, the fp32 S^T and dP^T tiles and two 16-bit ones leave little room for more in
   flight (see `bwd_config.py`; at head dim 128 ptxas serializes the WGMMAs with both).
   In the basic dQ path each warpgroup multiplies only its own 64 rows of K, V and dS^T, so the
   two never wait for each other: each writes its partial dQ (over its own keys, fp32) to its
   own shared-memory tile, and its first warp adds that tile to the fp32 accumulator in global
   memory with one TMA reduce-add (`cp.reduce.async.bulk.tensor`; the preprocess kernel cleared the
   accumulator, the postprocess kernel scales and rounds it). Before the tile is rewritten for
   the next query block that warp waits for the previous reduce-add to have read it. Scalar
   `red.add`s from registers, 64 per thread and block, kept the L2 so busy that the kernel ran
   at under a third of this speed.
   Two refinements (`bwd_config.py`; the shipped tiles use both at head dims 64, 96 and
   128): with `dq_split` both warpgroups' dS^T rows
   are written before either multiplies (one barrier of both, two dS^T buffers so that the next
   step's rows never overwrite those the other warpgroup still reads) and each computes half of
   dQ's columns over all 128 keys: one dQ tile per block instead of two partials. With
   `dq_writer` the producer warpgroup's second warp issues the reduce-adds: a consumer
   warpgroup writes its tile, arrives on a named barrier (DQ_FULL) and goes on, and waits
   (DQ_EMPTY) only if the previous reduce-add has not yet read the tile it is about to rewrite.
   With `dq_flat` (fixed-length calls with the writer warp) the tile is not row-major: each
   thread stores its accumulator registers in their own order, 128 bits at a time, into a flat
   tile, which goes to a flat accumulator, (batch, head, padded seqlen, d), in one 1-D bulk
   reduce-add (`cp.reduce.async.bulk ... add.f32`); the preprocess clears the accumulator, and an
   sm_90 postprocess (`bwd_post.py`) puts the rows back in order -- or, with `dq_convert` (an
   A/B option: `bwd_config.py` has its measurements), this kernel itself: the grid ends in one
   conversion CTA per SM, launched after every key block's, so they take only SMs that no key
   block is left for.
   At the end of a key block's CTA, once its reduce-adds are performed, the writer warp adds one
   to a counter per (batch, query head, query block) of its walk (`count_added`), and each
   warpgroup of a conversion CTA waits for its query block's count of key blocks
   (`BlockInfo.n_block_range`, as the deterministic turns count them) before it rounds the block
   into dQ (`convert_dq`). The conversions of the heads that have finished fill the grid's last
   wave, where the postprocess kernel would run after it.
   Two smaller ones, per head dim and mask (`bwd_config.py`): `stats_early` reads a block's
   LSE into registers before its S^T GEMM is issued, and `dq_fence_late` hands a dQ tile to the
   writer only after the next block's GEMMs are issued, so that the tile's stores drain meanwhile.
   The softmax scale is applied once: to dK here and to dQ in the postprocess.
   dK and dV start from their first query block's GEMMs, not from a zero fill: the compiler
   would hoist the zeros above the warp-role branch and spill them there.
   Head dims 192 and 256 (`dkv_split`): 64 keys per CTA, shared by both warpgroups. Warpgroup w
   computes S^T and dP^T for queries [32w, 32w + 32) of the block (all 64 keys), writes its P^T
   and dS^T columns to shared memory, and after a barrier of both issues dV += P^T dO,
   dK += dS^T Q and dQ = dS K for its half of the head dim's columns, every A operand read from
   shared memory. Q, dO and K take swizzle atoms that tile a half row (`split_atom`).
   Head dim 192 (`keys_n`, `consume_keys_n`): 96 keys per CTA, 48
   per warpgroup, with the keys on the N side of every GEMM -- S = Q K^T and dP = dO V^T are
   m64n48 instead of m64n32, and each Q / dO block serves 96 keys instead of 64; P and dS go to
   shared memory transposed (stmatrix .trans) for dV^T += dO^T P and dK^T += Q^T dS, each
   warpgroup's dV^T and dK^T over the whole head dims and its own keys. With V's head dim 192
   dO and D come through a one-stage ring of their own, Q through two (`single_dout`).
3. Epilogue: dK (scaled) and dV rounded to the input dtype (RNE), stored row-predicated. TMA
   clips the dQ reduce-adds at the tensor's last row; in a varlen batch the rows of a block past
   its sequence are those of the next one, and they get + 0.0 (P^T, so dS^T and that part of
   dQ, is 0 there).

Q/dO clusters (`cluster_q`: unmasked calls without varlen or seqused_k, with an even number of
key blocks, at head dims 64 and 96): the grid is launched in clusters of two CTAs on
neighbouring key blocks of one (KV head, batch), which walk the same query blocks; each CTA's
producer loads its half of every Q and dO tile by TMA multicast into the stages of both (each
its own LSE and D rows). A stage's empty barrier counts the consumer warps of both CTAs, and a
producer waits for every stage to be released before it leaves (`producer_tail`).

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

Rotated walks (`rotate_queries`: unmasked calls at head dims 192 and 256): CTA (or cluster) j of
a (KV head, batch)'s p starts its walk at query block j * m_steps / p of its range and wraps
around, instead of every CTA starting at the first. The CTAs of one KV head run side by side, so
without it they all reduce-add their dQ tiles into the same query block at the same time, and at
those head dims (a 64 x 256 fp32 tile is 64 KB) the atomics on the same lines serialise: the
backward ran at 1980 MHz and 629 W, well below the power cap (H200, hd 256, 2 x 8192 x 8 heads:
321 TFLOP/s; rotated 378). At 64 and 128 the shared start measured faster (its Q / dO reads meet
in L2).

Tails: a query block that reaches past seqlen_q, a key block that reaches past seqlen_k and the
query blocks on a causal diagonal or window edge take the masked path, where P^T is set (not
multiplied) to 0 for hidden (key, query) pairs, which makes dS^T 0 there too. The rows TMA loads
past a sequence are zero-filled or belong to the next sequence of a varlen batch (finite), so
dP^T stays finite and 0 * (dP^T - D) is 0. With `seqused_k` or varlen keys, the K and V rows past
seqlen_k may hold anything (a stale cache: NaN, Inf): the consumers zero them in shared memory
before the first GEMM, since dQ += dS K would turn 0 * NaN into NaN. dQ rows past seqlen_q and
dK/dV rows past seqlen_k are not written. Key blocks no query block sees write dK = dV = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from ..common.mask import keep_from, keep_left_of, mma_columns
from ..common.seqlen_info import SeqlenInfo
from ..common.smem_layouts import (
    swizzle_params,
    wgmma_smem_layout_atom,
    wgmma_smem_layout_tile,
)
from ..common.tiles import COPY_BITS
from ..common.timeline import TimelineCounters
from ..common.utils import (
    bulk_reduce_add_f32,
    acc_mn_view,
    elem_pointer,
    exp2f,
    make_s2g_copy,
    pass_turn,
    store_staged_rows,
    tanhf,
    wait_for_count,
    wait_for_turn,
)
from .bwd_config import (
    LPT_GROUP_CTAS,
    NUM_CONSUMER_WGS,
    NUM_CONVERT_GROUPS,
    STAT_ALIGN,
    TIMELINE_PHASES,
    Sm90BwdConfig,
    make_post_config,
)
from .bwd_post import FlatDq
from .fwd import FlashFwdSm90, multicast, tile_coords, tma_view
from .wgmma import acc_as_mma_sync, gemm, gemm_accumulate_if, probs_as_operand_a


class DqSwap(NamedTuple):
    """`dq_swap`'s trace-time plan of one thread's dQ stores (`FlashBwdSm90.dq_smem_copy`)."""

    pairing: list  # per copy slot k: (k, the slot 16 columns away, k's anchor slot, k's offset past it)
    odd_flip: object  # bytes XORed into an odd row's store addresses (64), else 0 (a runtime value)
    mask: int  # the tiles' byte swizzle: the address bits XORed, ...
    shift: int  # ... shifted down by this, into the 16-byte chunk index
    pair_copy: object  # the 64-bit copy atom

# Named barrier (0 is __syncthreads) of one consumer warpgroup, + its index: its own dS^T rows
# (and K/V tail rows) are written before its WGMMAs read them.
BARRIER_WG = 1
# Named barrier of both consumer warpgroups (`dq_split`): every row of dS^T is written.
BARRIER_BOTH = BARRIER_WG + NUM_CONSUMER_WGS
# Named barriers between a consumer warpgroup (+ its index) and the dQ writer warp (`dq_writer`):
# its dQ tile is written (consumers arrive, the writer waits) / read by the last reduce-add (the
# writer arrives, consumers wait). With `dq_stages` = 2, one of each per warpgroup and tile, the
# EMPTY ones after the four FULL ones (`FlashBwdSm90.dq_barrier`).
BARRIER_DQ_FULL = BARRIER_BOTH + 1
# `dq_convert`: the counter loads after which a wait means a count that never comes (`wait_for_count` traps)
CONVERT_MAX_POLLS = 1 << 24
# ... and the pause between two of them: the polls of every waiting warp stay off the L2, which the
# key blocks' reduce-adds keep busy
CONVERT_PAUSE_NS = 500


@dataclass(frozen=True)
class QueryWalk:
    """The steps of a CTA's walk over (query head, query block), which the producer, the consumers
    and the dQ writer take in the same order: query blocks [m_block_min, m_block_min + m_steps) of
    the first query head of the KV head's group, then of the next head; with `m_rot`
    (`rotate_queries`) each head's blocks from the `m_rot`-th on, wrapping around."""

    head_k: Int32  # the CTA's KV head
    group: Int32  # query heads per KV head
    m_block_min: Int32
    m_steps: Int32  # query blocks per head
    m_rot: Optional[Int32] = None  # None: every head's walk from its first block

    @property
    def steps(self):
        return self.m_steps * self.group

    def coords(self, it):
        """(query head, query block) of step `it`."""
        head = self.head_k * self.group + it // self.m_steps
        if self.m_rot is None:
            return head, self.m_block_min + it % self.m_steps
        return head, self.m_block_min + (it % self.m_steps + self.m_rot) % self.m_steps


def transposed(t: cute.Tensor) -> cute.Tensor:
    """The (cols, rows[, stages]) view of a (rows, cols[, stages]) shared-memory tile: the
    MN-major operand over the same bytes."""
    order = [1, 0, 2] if cutlass.const_expr(cute.rank(t) == 3) else [1, 0]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def smem_operands(tiled_mma: cute.TiledMma, wg_mma, a: cute.Tensor, b: cute.Tensor) -> tuple:
    """The A and B fragments of a GEMM whose operands both come from shared memory, partitioned
    by the warpgroup's slice `wg_mma` (`FlashBwdSm90.mma_slices`)."""
    return tiled_mma.make_fragment_A(wg_mma.partition_A(a)), tiled_mma.make_fragment_B(wg_mma.partition_B(b))


def stats_view(mX: cute.Tensor, varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
    """LSE / D (b, h, s) -> (s, h, b), or varlen (h, total) -> (total, h): tokens first, for TMA."""
    order = [1, 0] if cutlass.const_expr(varlen) else [2, 1, 0]
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=order))


class FlashBwdSm90(TimelineCounters):
    """The sm_90 backward kernel for one `Sm90BwdConfig`."""

    def __init__(self, config: Sm90BwdConfig):
        self.cfg = config
        self.dtype = element_type(config.dtype)
        self.num_consumer_threads = 128 * NUM_CONSUMER_WGS
        self.cluster_size = 2 if config.cluster_q else 1
        if config.dq_convert:  # the conversion CTAs read the accumulator as the postprocess of any head dim would
            self.flat_dq = FlatDq(make_post_config(config, None), self.dtype)
        # the EMPTY barriers of the dQ tiles follow their FULL ones
        self.barrier_dq_empty = BARRIER_DQ_FULL + NUM_CONSUMER_WGS * config.dq_stages
        # `single_dout`: one per consumer warpgroup, arrived at once it is done reading dS^T
        self.barrier_ds_read = self.barrier_dq_empty + NUM_CONSUMER_WGS * config.dq_stages

    def split_atom(self, cols: int, of_k: bool = False):
        """The swizzle atom of Q, dO and K (`of_k`) (rows of `cols` elements). With `dkv_split` each
        warpgroup reads half of their columns as an MN-major operand (dK, dV, dQ), so the atom
        must tile that half: at head dim 192 the 96 columns take 32-column atoms (64-byte
        swizzle) where a whole row would take 64-column ones. With `keys_n` only K's halves are
        read (dQ's B operand); Q and dO keep whole-row atoms. With `dq_split` each warpgroup's dQ
        GEMM reads half of K's columns too, which must fill whole atoms or lie inside one: where
        a half would straddle them (head dim 96: 48 columns of 32-column atoms) K takes the
        half's atoms (16 columns, 32-byte swizzle, three to a warpgroup)."""
        half = cols // NUM_CONSUMER_WGS
        atom = swizzle_params(self.dtype.width, cols).atom_cols
        straddles = half % atom != 0 and atom % half != 0
        halves = (self.cfg.dkv_split and (of_k or not self.cfg.keys_n)) or (of_k and self.cfg.dq_split and straddles)
        return wgmma_smem_layout_atom(self.dtype, half if halves else cols)

    def stat_layout(self, stages: int) -> cute.Layout:
        """The shared-memory LSE or D rows of `stages` query blocks: (rows, stage)."""
        return cute.make_layout((self.cfg.stat_box, stages), stride=(1, self.cfg.stat_stage_stride))

    def shared_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sStat_layout, sStatD_layout,
                       sdQ_layout):
        """The CTA's shared memory (`Sm90BwdConfig.smem_bytes` sizes it field by field). The
        `keys_n` tile fills it to the limit: there the LSE rows sit in the padding between the
        mbarriers and the first 1024-aligned tile, and D after the dQ tiles, which leaves room
        for a varlen call's longer boxes."""
        cfg = self.cfg
        num_stages = cfg.num_stages
        dtype = self.dtype
        stat = cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128]
        stat_d = cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStatD_layout)], 128]

        def tile(dt, layout):
            return cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layout)], 1024]

        fields = {
            "mbar_KV": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_Q": cute.struct.MemRange[cutlass.Int64, 2 * num_stages],
            "sQ": tile(dtype, sQ_layout),
            "sdO": tile(dtype, sdO_layout),
            "sK": tile(dtype, sK_layout),
            "sV": tile(dtype, sV_layout),
            "sdS": tile(dtype, sdS_layout),
            "sLSE": stat,
            "sD": stat_d,
            "sdQ": tile(Float32, sdQ_layout),
        }
        order = list(fields)
        if cfg.keys_n:
            order = ["mbar_KV", "mbar_Q", "sLSE", "sQ", "sdO", "sK", "sV", "sdS", "sdQ", "sD"]
        if cfg.single_dout:  # the (dO, D) stage's own mbarriers
            fields["mbar_dO"] = cute.struct.MemRange[cutlass.Int64, 2]
            order.insert(2, "mbar_dO")
        # (the module's postponed annotations would leave a class body's as strings)
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": {f: fields[f] for f in order}}))
        return SharedStorage

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
        mLSE: cute.Tensor,  # float32 log2-space LSE (b, h, sq) or varlen (h, total_q); 16-byte strides
        mD: cute.Tensor,  # float32 rowsum(dO * O) - dlse, like mLSE
        mdQaccum: cute.Tensor,  # float32, like mQ with the padded tile head dim; `dq_flat`: (b, h, padded sq, d)
        mdK: cute.Tensor,  # like mK
        mdV: cute.Tensor,  # like mV
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mdQsem: Optional[cute.Tensor],  # int32 (b, h, query blocks) of zeros with `deterministic` or `dq_convert`
        mdQ: Optional[cute.Tensor],  # like mQ, written with `dq_convert`
        num_batch: Int32,
        max_seqlen_k: Int32,
        num_convert_ctas: Int32,  # `dq_convert`: CTAs after the key blocks' (even with `cluster_q`)
        softmax_scale: Float32,
        softmax_scale_log2: Float32,  # scale * log2(e), or softcap * log2(e) with softcap
        softcap_prescale: Float32,  # scale / softcap (unused without softcap)
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        # (rows, cols, stage), with a stage mode of 1 too
        sQ_layout = cute.tile_to_shape(self.split_atom(cfg.head_dim),
                                       (cfg.tile_m, cfg.head_dim, cfg.num_stages), (0, 1, 2))
        sdO_layout = cute.tile_to_shape(self.split_atom(cfg.head_dim_v),
                                        (cfg.tile_m, cfg.head_dim_v, cfg.dout_stages), (0, 1, 2))
        sK_layout = cute.tile_to_shape(self.split_atom(cfg.head_dim, of_k=True), (cfg.tile_n, cfg.head_dim), (0, 1))
        sV_layout = wgmma_smem_layout_tile(self.dtype, cfg.tile_n, cfg.head_dim_v)
        # the dS^T stages, then (`dkv_split`) the P^T ones; with `ds_kmajor` the dS stages,
        # (queries, keys) with the keys contiguous
        if cutlass.const_expr(cfg.ds_kmajor):
            sdS_layout = cute.tile_to_shape(wgmma_smem_layout_atom(self.dtype, cfg.tile_n),
                                            (cfg.tile_m, cfg.tile_n, cfg.ds_stages), (0, 1, 2))
        else:
            sdS_layout = cute.tile_to_shape(wgmma_smem_layout_atom(self.dtype, cfg.tile_m),
                                            (cfg.tile_n, cfg.tile_m, cfg.ds_stages + cfg.p_stages), (0, 1, 2))
        sStat_layout = self.stat_layout(cfg.num_stages)
        # `dq_stages` fp32 dQ partials per consumer warpgroup, the sources of its TMA reduce-adds:
        # (rows, cols, warpgroup, stage)
        sdQ_layout = cute.tile_to_shape(wgmma_smem_layout_atom(Float32, cfg.dq_cols),
                                        (cfg.dq_rows_per_wg, cfg.dq_cols, NUM_CONSUMER_WGS, cfg.dq_stages),
                                        (0, 1, 2, 3))

        SharedStorage = self.shared_storage(sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sStat_layout,
                                            self.stat_layout(cfg.dout_stages), sdQ_layout)

        load = cpasync.CopyBulkTensorTileG2SOp()
        # `cluster_q`: each CTA of a cluster loads half of a Q / dO tile into both
        load_q = cpasync.CopyBulkTensorTileG2SMulticastOp() if cutlass.const_expr(cfg.cluster_q) else load
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(
            load_q, tma_view(mQ, cfg.varlen_q), cute.select(sQ_layout, mode=[0, 1]), (cfg.tile_m, cfg.head_dim),
            num_multicast=self.cluster_size,
        )
        tma_dO, tma_mdO = cpasync.make_tiled_tma_atom(
            load_q, tma_view(mdO, cfg.varlen_q), cute.select(sdO_layout, mode=[0, 1]), (cfg.tile_m, cfg.head_dim_v),
            num_multicast=self.cluster_size,
        )
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(
            load, tma_view(mK, cfg.varlen_k), sK_layout, (cfg.tile_n, cfg.head_dim)
        )
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(
            load, tma_view(mV, cfg.varlen_k), sV_layout, (cfg.tile_n, cfg.head_dim_v)
        )
        stat_tile, stat_box = cute.select(sStat_layout, mode=[0]), (cfg.stat_box,)
        tma_LSE, tma_mLSE = cpasync.make_tiled_tma_atom(load, stats_view(mLSE, cfg.varlen_q), stat_tile, stat_box)
        tma_D, tma_mD = cpasync.make_tiled_tma_atom(load, stats_view(mD, cfg.varlen_q), stat_tile, stat_box)
        tma_dQ, tma_mdQ = None, None
        if cutlass.const_expr(not cfg.dq_flat):  # `dq_flat`: 1-D bulk reduce-adds into a flat mdQaccum
            tma_dQ, tma_mdQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), tma_view(mdQaccum, cfg.varlen_q),
                cute.select(sdQ_layout, mode=[0, 1]), (cfg.dq_rows_per_wg, cfg.dq_cols),
            )

        K_major, MN_major = OperandMajorMode.K, OperandMajorMode.MN
        if cutlass.const_expr(cfg.keys_n):
            # the keys on N: S / dP (queries x keys) and dK^T / dV^T (head dim x keys), warpgroup w
            # taking keys [48w, 48w + 48); A operands Q, dO (K-major) and Q^T, dO^T (MN-major)
            wgs = (1, NUM_CONSUMER_WGS, 1)
            n_wg = cfg.tile_n // NUM_CONSUMER_WGS
            tiled_mma_SdP = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, K_major, Float32, wgs, (64, n_wg)
            )
            tiled_mma_dK = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_major, K_major, Float32, wgs, (64, n_wg)
            )
            tiled_mma_dV = tiled_mma_dK
        elif cutlass.const_expr(cfg.dkv_split):
            # the 64 keys are both warpgroups': S^T / dP^T split over the queries, dK / dV over
            # the columns, with P^T and dS^T read from shared memory
            wgs = (1, NUM_CONSUMER_WGS, 1)
            tiled_mma_SdP = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, K_major, Float32, wgs, (64, cfg.tile_m // NUM_CONSUMER_WGS)
            )
            tiled_mma_dK = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, MN_major, Float32, wgs, (64, cfg.head_dim // NUM_CONSUMER_WGS)
            )
            tiled_mma_dV = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, MN_major, Float32, wgs, (64, cfg.head_dim_v // NUM_CONSUMER_WGS)
            )
        else:
            wgs = (NUM_CONSUMER_WGS, 1, 1)  # each consumer warpgroup takes 64 of the keys
            tiled_mma_SdP = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, K_major, Float32, wgs, (64, cfg.tile_m)
            )
            rmem = warpgroup.OperandSource.RMEM
            tiled_mma_dK = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, MN_major, Float32, wgs, (64, cfg.head_dim), a_source=rmem
            )
            tiled_mma_dV = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, MN_major, Float32, wgs, (64, cfg.head_dim_v), a_source=rmem
            )
        # one warpgroup's dQ tile: A = dS (MN-major view of dS^T; K-major with `ds_kmajor`), B = K^T
        # (MN-major view of K)
        tiled_mma_dQ = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major if cutlass.const_expr(cfg.ds_kmajor) else MN_major, MN_major, Float32,
            (1, 1, 1), (64, cfg.dq_cols)
        )

        num_n_blocks = (max_seqlen_k + cfg.tile_n - 1) // cfg.tile_n
        num_heads_k = mK.shape[1] if cutlass.const_expr(cfg.varlen_k) else mK.shape[2]
        grid = [num_n_blocks, num_heads_k, num_batch]
        lpt_heads = cutlass.max(LPT_GROUP_CTAS // num_n_blocks, 1)  # (batch, KV head) pairs per group (`lpt`)
        if cutlass.const_expr(cfg.lpt or cfg.dq_convert):
            grid = [num_n_blocks * num_heads_k * num_batch, 1, 1]
        if cutlass.const_expr(cfg.dq_convert):
            grid[0] = grid[0] + num_convert_ctas
        self.kernel(
            mQ, mK, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mdQsem, mdQ,
            mdQaccum if cutlass.const_expr(cfg.dq_flat) else None, num_batch, num_n_blocks, lpt_heads, num_convert_ctas,
            tma_Q, tma_mQ, tma_dO, tma_mdO, tma_K, tma_mK, tma_V, tma_mV, tma_LSE, tma_mLSE, tma_D, tma_mD,
            tma_dQ, tma_mdQ, softmax_scale, softmax_scale_log2, softcap_prescale, window_left, window_right,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sStat_layout, sdQ_layout,
            tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ, SharedStorage,
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
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mdQsem: Optional[cute.Tensor],
        mdQ: Optional[cute.Tensor],
        mdQflat: Optional[cute.Tensor],
        num_batch: Int32,
        num_n_blocks: Int32,
        lpt_heads: Int32,
        num_convert_ctas: Int32,
        tma_Q: cute.CopyAtom,
        tma_mQ: cute.Tensor,
        tma_dO: cute.CopyAtom,
        tma_mdO: cute.Tensor,
        tma_K: cute.CopyAtom,
        tma_mK: cute.Tensor,
        tma_V: cute.CopyAtom,
        tma_mV: cute.Tensor,
        tma_LSE: cute.CopyAtom,
        tma_mLSE: cute.Tensor,
        tma_D: cute.CopyAtom,
        tma_mD: cute.Tensor,
        tma_dQ: cute.CopyAtom,
        tma_mdQ: cute.Tensor,
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
        sStat_layout: cute.Layout,
        sdQ_layout: cute.ComposedLayout,
        tiled_mma_SdP: cute.TiledMma,
        tiled_mma_dK: cute.TiledMma,
        tiled_mma_dV: cute.TiledMma,
        tiled_mma_dQ: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_Q, tma_dO, tma_K, tma_V, tma_LSE, tma_D, tma_dQ):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # one arrive per consumer warp (lane 0 signals the empty barrier)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        elem_bytes = self.dtype.width // 8
        pipeline_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_KV.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=cfg.tile_n * (cfg.head_dim + cfg.head_dim_v) * elem_bytes,
            defer_sync=True,
        )
        q_bytes = cfg.tile_m * cfg.head_dim * elem_bytes + cfg.stat_box * 4  # Q and the LSE rows
        do_bytes = cfg.tile_m * cfg.head_dim_v * elem_bytes + cfg.stat_box * 4  # dO and the D rows
        # `cluster_q`: a (Q, dO) stage is free once the consumer warps of both CTAs have released
        # it (lanes 0 and 1 of each warp arrive on the barriers of CTAs 0 and 1)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=cfg.num_stages, producer_group=producer,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.cluster_size * self.num_consumer_threads // 32),
            tx_count=q_bytes if cutlass.const_expr(cfg.single_dout) else q_bytes + do_bytes, defer_sync=True,
            cta_layout_vmnk=cute.make_layout((1, 2, 1, 1)) if cutlass.const_expr(cfg.cluster_q) else None,
            mcast_mode_mn=(0, 1),
        )
        pipeline_do = None  # `single_dout`: dO and D in a ring of their own
        if cutlass.const_expr(cfg.single_dout):
            pipeline_do = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_dO.data_ptr(), num_stages=cfg.dout_stages, producer_group=producer,
                consumer_group=consumers, tx_count=do_bytes, defer_sync=True,
            )
        # with a cluster, the peer's TMA and arrives may reach this CTA's barriers only once they are initialized
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_size, 1), is_relaxed=True)

        # The WGMMA atoms swizzle byte addresses: the swizzle goes on the pointer.
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sD = storage.sD.get_tensor(self.stat_layout(cfg.dout_stages))
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        num_heads = mQ.shape[1] if cutlass.const_expr(cfg.varlen_q) else mQ.shape[2]
        num_heads_k = mK.shape[1] if cutlass.const_expr(cfg.varlen_k) else mK.shape[2]
        group = num_heads // num_heads_k
        key_ctas = num_n_blocks * num_heads_k * num_batch
        cta = cute.arch.block_idx()[0]
        if cutlass.const_expr(cfg.dq_convert):
            cta = cutlass.min(cta, key_ctas - 1)  # a conversion CTA: any key block's coordinates, unused
        if cutlass.const_expr(cfg.lpt):
            # causal: key block 0 meets every query block, so the forward's tile order, not
            # reversed, is longest first; `shortest_first` reverses it
            n_block, head_k, batch = tile_coords(
                cta, num_n_blocks, num_heads_k, num_batch, lpt_heads, cfg.shortest_first, cutlass.min,
            )
        elif cutlass.const_expr(cfg.dq_convert):  # the 3-D grid's order, on one axis
            n_block = cta % num_n_blocks
            head_k = (cta // num_n_blocks) % num_heads_k
            batch = cta // (num_n_blocks * num_heads_k)
        else:
            n_block, head_k, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo.create(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        left, right, block_info = self.visibility(seqlen, window_left, window_right)
        m_block_min, m_block_max = block_info.m_block_range(seqlen, n_block)
        m_steps = cutlass.max(m_block_max - m_block_min, 0)
        m_rot = None  # every walk from the first query block
        if cutlass.const_expr(cfg.rotate_queries):
            # CTA (cluster: both CTAs alike) j of p starts at query block j * m_steps / p of its range
            pairs = (num_n_blocks + self.cluster_size - 1) // self.cluster_size
            m_rot = (n_block // self.cluster_size) * m_steps // pairs
        walk = QueryWalk(head_k, group, m_block_min, m_steps, m_rot)

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_size, 1))
        # A CTA past the end of its (varlen) key sequence has nothing to do; all its threads leave.
        has_keys = n_block * cfg.tile_n < seqlen.seqlen_k
        if cutlass.const_expr(cfg.dq_convert):
            convert_cta = cute.arch.block_idx()[0] - key_ctas
            if convert_cta >= 0:
                self.convert_dq(mdQflat, mdQ, mdQsem, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, tiled_mma_dQ,
                                num_batch, num_heads, convert_cta, num_convert_ctas, softmax_scale, window_left,
                                window_right, tidx)
            has_keys = has_keys & (convert_cta < 0)
        if has_keys:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(cfg.registers[1])
                if warp_idx == 0 and m_steps > 0:
                    self.load(
                        tma_Q, tma_mQ, tma_dO, tma_mdO, tma_K, tma_mK, tma_V, tma_mV, tma_LSE, tma_mLSE,
                        tma_D, tma_mD, sQ, sdO, sK, sV, sLSE, sD, pipeline_kv, pipeline_q,
                        seqlen, n_block, head_k, batch, walk, pipeline_do,
                    )
                if cutlass.const_expr(cfg.dq_writer):
                    if warp_idx == 1 and m_steps > 0:
                        self.write_dq(tma_dQ, tma_mdQ, mdQflat, sdQ, seqlen, batch, walk, n_block, block_info,
                                      mdQsem)
            else:
                cute.arch.setmaxregister_increase(cfg.registers[0])
                args = (
                    tidx - 128, tma_dQ, tma_mdQ, mdK, mdV, sQ, sdO, sK, sV, sdS, sLSE, sD, sdQ, pipeline_kv,
                    pipeline_q,
                    tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ, seqlen, n_block, head_k, batch,
                    walk, left, right, softmax_scale, softmax_scale_log2,
                    softcap_prescale,
                )
                if cutlass.const_expr(cfg.keys_n):
                    self.consume_keys_n(*args, pipeline_do)
                else:
                    self.consume(*args)

    # ------------------------------------------------------------------------------------------
    # producer
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load(
        self, tma_Q, tma_mQ, tma_dO, tma_mdO, tma_K, tma_mK, tma_V, tma_mV, tma_LSE, tma_mLSE, tma_D, tma_mD,
        sQ, sdO, sK, sV, sLSE, sD, pipeline_kv, pipeline_q, seqlen: SeqlenInfo, n_block, head_k, batch,
        walk: QueryWalk, pipeline_do=None,
    ):
        cfg = self.cfg
        one_cta = cute.make_layout(1)
        rows = FlashFwdSm90.rows
        gK = cute.local_tile(rows(tma_mK, cfg.varlen_k, seqlen.offset_k, batch, head_k),
                             (cfg.tile_n, cfg.head_dim), (n_block, 0))
        gV = cute.local_tile(rows(tma_mV, cfg.varlen_k, seqlen.offset_k, batch, head_k),
                             (cfg.tile_n, cfg.head_dim_v), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_K, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_V, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_kv.producer_acquire(kv_state)
        cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))

        # `cluster_q`: this CTA's half of each Q / dO tile, multicast to both CTAs of the cluster
        q_rank, q_ctas, mcast = 0, one_cta, None
        if cutlass.const_expr(cfg.cluster_q):
            q_rank, q_ctas, mcast = cute.arch.block_idx_in_cluster(), cute.make_layout(2), cutlass.Int16(3)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        do_state = None
        if cutlass.const_expr(cfg.single_dout):
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.dout_stages)
        for it in cutlass.range(walk.steps, unroll=1):
            head, m_block = walk.coords(it)
            gQ = cute.local_tile(rows(tma_mQ, cfg.varlen_q, seqlen.offset_q, batch, head),
                                 (cfg.tile_m, cfg.head_dim), (m_block, 0))
            gdO = cute.local_tile(rows(tma_mdO, cfg.varlen_q, seqlen.offset_q, batch, head),
                                  (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
            gLSE = self.stat_block(tma_mLSE, seqlen.offset_q, batch, head, m_block)
            gD = self.stat_block(tma_mD, seqlen.offset_q, batch, head, m_block)
            tQsQ, tQgQ = cpasync.tma_partition(tma_Q, q_rank, q_ctas, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_dO, q_rank, q_ctas, cute.group_modes(sdO, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(tma_LSE, 0, one_cta, cute.group_modes(sLSE, 0, 1),
                                               cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma_D, 0, one_cta, cute.group_modes(sD, 0, 1),
                                               cute.group_modes(gD, 0, 1))
            pipeline_q.producer_acquire(state)
            bar = pipeline_q.producer_get_barrier(state)
            cute.copy(tma_Q, tQgQ, tQsQ[None, state.index], tma_bar_ptr=bar, **multicast(mcast))
            cute.copy(tma_LSE, tLgL, tLsL[None, state.index], tma_bar_ptr=bar)
            do_index = state.index
            if cutlass.const_expr(cfg.single_dout):  # dO and D wait for their own stage
                pipeline_do.producer_acquire(do_state)
                bar = pipeline_do.producer_get_barrier(do_state)
                do_index = do_state.index
                do_state.advance()
            cute.copy(tma_dO, tdOgdO, tdOsdO[None, do_index], tma_bar_ptr=bar, **multicast(mcast))
            cute.copy(tma_D, tDgD, tDsD[None, do_index], tma_bar_ptr=bar)
            state.advance()
        if cutlass.const_expr(cfg.cluster_q):
            # every stage released by the consumers of both CTAs before the producer leaves: no
            # arrive of the other CTA reaches this one's barriers after it exits
            pipeline_q.producer_tail(state)

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

    def visibility(self, seqlen: SeqlenInfo, window_left, window_right) -> tuple:
        """(left, right, BlockInfo) of a (batch)'s sequences: the window's effective sides, right 0
        with a causal mask, and the block ranges they give on this tile; the key blocks' CTAs and the
        conversion CTAs (`dq_convert`) count the same blocks from them."""
        cfg = self.cfg
        left, right = effective_window(seqlen, window_left, window_right, cfg.local)
        if cfg.causal:
            right = Int32(0)
        return left, right, BlockInfo(cfg.tile_m, cfg.tile_n, cfg.causal, cfg.local, left, right)

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

    @cute.jit
    def stat_block(self, tma_mX: cute.Tensor, offset, batch, head, m_block) -> cute.Tensor:
        """The TMA box of LSE / D rows of query block `m_block` of one (batch, head) of a
        `stats_view` tensor. In a varlen batch it starts at the 16-byte-aligned row at or below the
        block's first (`offset % STAT_ALIGN` rows early, see `bwd_config.py`): a box that starts
        elsewhere is an illegal instruction."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.varlen_q):
            first = offset - offset % STAT_ALIGN + m_block * cfg.tile_m
            return cute.local_tile(cute.domain_offset((first,), tma_mX[None, head]), (cfg.stat_box,), (0,))
        return cute.local_tile(tma_mX[None, head, batch], (cfg.tile_m,), (m_block,))

    # ------------------------------------------------------------------------------------------
    # consumers
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, ctidx, tma_dQ, tma_mdQ, mdK, mdV, sQ, sdO, sK, sV, sdS, sLSE, sD, sdQ, pipeline_kv, pipeline_q,
        tiled_mma_SdP: cute.TiledMma, tiled_mma_dK: cute.TiledMma, tiled_mma_dV: cute.TiledMma,
        tiled_mma_dQ: cute.TiledMma, seqlen: SeqlenInfo, n_block, head_k, batch, walk: QueryWalk,
        left, right, softmax_scale, softmax_scale_log2, softcap_prescale,
    ):
        cfg = self.cfg
        wg_idx = cute.arch.make_warp_uniform(ctidx // 128)
        (thr_mma_SdP, wg_mma_SdP), (thr_mma_dK, wg_mma_dK), (thr_mma_dV, wg_mma_dV), (thr_mma_dQ, wg_mma_dQ) = (
            self.mma_slices(ctidx, wg_idx, tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ))

        # S^T = K Q^T and dP^T = V dO^T: keys on M
        tSrK, tSrQ = smem_operands(tiled_mma_SdP, wg_mma_SdP, sK, sQ)
        tdPrV, tdPrdO = smem_operands(tiled_mma_SdP, wg_mma_SdP, sV, sdO)
        tdVrdOt = tiled_mma_dV.make_fragment_B(wg_mma_dV.partition_B(transposed(sdO)))
        tdKrQt = tiled_mma_dK.make_fragment_B(wg_mma_dK.partition_B(transposed(sQ)))
        # dS^T as (keys, queries, stage): the tile itself, or (`ds_kmajor`) the view of dS
        sdSt = transposed(sdS) if cutlass.const_expr(cfg.ds_kmajor) else sdS
        if cutlass.const_expr(cfg.dq_split):
            # every key of dS^T (both warpgroups' rows) and this warpgroup's half of K's columns
            sdS_wg = sdSt
            sK_wg = cute.local_tile(sK, (cfg.tile_n, cfg.dq_cols), (0, wg_idx))
        elif cutlass.const_expr(cfg.dq_rows):
            # every key of dS^T, this warpgroup's 64 queries of the block; all of K
            sdS_wg = cute.local_tile(sdSt, (cfg.tile_n, cfg.dq_rows_per_wg, cfg.ds_stages), (0, wg_idx, 0))
            sK_wg = sK
        else:
            # this warpgroup's 64 keys: its rows of dS^T and K
            sdS_wg = cute.local_tile(sdSt, (64, cfg.tile_m, cfg.ds_stages), (wg_idx, 0, 0))
            sK_wg = cute.local_tile(sK, (64, cfg.head_dim), (wg_idx, 0))
        tdQrdS = tiled_mma_dQ.make_fragment_A(wg_mma_dQ.partition_A(transposed(sdS_wg)))
        tdQrKt = tiled_mma_dQ.make_fragment_B(wg_mma_dQ.partition_B(transposed(sK_wg)))
        if cutlass.const_expr(cfg.dq_own_first):
            # the dQ GEMM in two halves of the keys: this warpgroup's 64 (its own dS^T rows), then
            # the other's; of each, dS^T's columns of the warpgroup's queries (all of the block's
            # with `dq_split`, its 64 with `dq_rows`) and K's rows, this warpgroup's half of K's
            # columns with `dq_split` (all of them with `dq_rows`)
            q_block = wg_idx if cutlass.const_expr(cfg.dq_rows) else 0
            k_block = wg_idx if cutlass.const_expr(cfg.dq_split) else 0
            tdQrdS_own, tdQrdS_other = (
                tiled_mma_dQ.make_fragment_A(wg_mma_dQ.partition_A(transposed(cute.local_tile(
                    sdSt, (64, cfg.dq_rows_per_wg, cfg.ds_stages), (w, q_block, 0))))) for w in (wg_idx, 1 - wg_idx))
            tdQrKt_own, tdQrKt_other = (
                tiled_mma_dQ.make_fragment_B(wg_mma_dQ.partition_B(transposed(
                    cute.local_tile(sK, (64, cfg.dq_cols), (w, k_block))))) for w in (wg_idx, 1 - wg_idx))
        # dS^T from the accumulator's layout; with `ds_kmajor` transposing, into the tile of dS
        stsm_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(cfg.ds_kmajor, 4), self.dtype), tiled_mma_SdP
        ).get_slice(ctidx)
        tdSsdS = stsm_dS.partition_D(sdSt)  # (..., ds_stages [+ p_stages])
        if cutlass.const_expr(cfg.dkv_split):
            # P^T and dS^T as the shared-memory A operands of dV and dK: (..., ds_stages + p_stages)
            tdVsP = tiled_mma_dV.make_fragment_A(wg_mma_dV.partition_A(sdS))
            tdKsdS = tiled_mma_dK.make_fragment_A(wg_mma_dK.partition_A(sdS))
        # this warpgroup's fp32 dQ partial -> its shared-memory tile (pairs of floats), which it
        # then adds to dQaccum in global memory with a TMA reduce-add
        sdQ_wg = sdQ[None, None, wg_idx, None]  # (rows, cols, stage)
        r2s_dQ, tdQsdQ, dq_swap = self.dq_smem_copy(tiled_mma_dQ, sdQ, wg_idx, ctidx)
        # the warpgroup's first warp issues it (a TMA copy elects its lane among a whole warp)
        dq_warp = cute.arch.make_warp_uniform(ctidx // 32) % 4 == 0

        tile_S = (cfg.tile_n, cfg.tile_m)
        # (key, query) coordinates inside an S^T tile: thread 0's are compile-time constants and
        # every thread's are its first one's plus thread 0's, so that per-element comparisons are
        # against immediates (rather than 2 * 32 loop-invariant coordinates held in registers)
        cS = cute.make_identity_tensor(tile_S)
        thr_key, thr_query = acc_mn_view(acc_as_mma_sync(thr_mma_SdP.partition_C(cS)))[0, 0]
        t0ScS_mn = acc_mn_view(acc_as_mma_sync(tiled_mma_SdP.get_slice(0).partition_C(cS)))
        rP = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), self.dtype)
        rdS = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), self.dtype)
        if cutlass.const_expr(not cfg.dkv_split):
            tdVrP = probs_as_operand_a(rP, thr_mma_dV, tile_S)
            tdKrdS = probs_as_operand_a(rdS, thr_mma_dK, tile_S)

        # no zero fill: the first query block's GEMMs overwrite them (`gemm_accumulate_if`)
        acc_dK = cute.make_rmem_tensor(thr_mma_dK.partition_shape_C((cfg.tile_n, cfg.head_dim)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_mma_dV.partition_shape_C((cfg.tile_n, cfg.head_dim_v)), Float32)

        # `timeline` (a profiling build): globaltimer stamps of this CTA and clock cycles per phase
        # of a step, summed over its steps (see `Sm90BwdConfig.timeline`)
        stamps = cute.make_rmem_tensor((6,), Int32)
        phases = cute.make_rmem_tensor((TIMELINE_PHASES + 1,), Int32)
        self.stamp(stamps, 0)
        if walk.m_steps > 0:
            pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            self.stamp(stamps, 1)
            rows_k = seqlen.seqlen_k - n_block * cfg.tile_n
            if cutlass.const_expr(cfg.seqused_k or cfg.varlen_k):
                if rows_k < cfg.tile_n:
                    self.zero_kv_tail(sK, sV, rows_k, ctidx, wg_idx)

            offset = seqlen.seqlen_k - seqlen.seqlen_q
            n_lo = n_block * cfg.tile_n
            stat_query = self.stat_row(thr_query, seqlen)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
            # with `dk_after_dq` a stage is released one block late, once its dK GEMM is done
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
            if cutlass.const_expr(cfg.timeline):
                phases.fill(0)
            for it in cutlass.range(walk.steps, unroll=1):
                head, m_block = walk.coords(it)
                m_lo = m_block * cfg.tile_m
                stage = state.index
                tick = self.tick(phases, -1, Int32(0))
                pipeline_q.consumer_wait(state)
                tick = self.tick(phases, 0, tick)
                if cutlass.const_expr(cfg.timeline):
                    if it == 0:
                        self.stamp(stamps, 2)
                    if it == 2:
                        self.stamp(stamps, 3)
                # this thread's LSE and D: its first query's entry + thread 0's column (immediates)
                sLSE_thr = cute.domain_offset((stat_query,), sLSE[None, stage])
                sD_thr = cute.domain_offset((stat_query,), sD[None, stage])
                lse_r = None
                if cutlass.const_expr(cfg.stats_early):
                    lse_r = self.thread_stats(sLSE_thr, t0ScS_mn)
                acc_S = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), Float32)
                acc_dP = cute.make_rmem_tensor(thr_mma_SdP.partition_shape_C(tile_S), Float32)
                gemm(tiled_mma_SdP, acc_S, tSrK, tSrQ[None, None, None, stage], zero_init=True)
                # dP^T runs while P^T is computed, except with soft-capping, whose tanh leaves no
                # room for the dP^T tile in flight next to dK and dV at head dim 128
                if cutlass.const_expr(not cfg.softcap):
                    gemm(tiled_mma_SdP, acc_dP, tdPrV, tdPrdO[None, None, None, stage], zero_init=True)
                if cutlass.const_expr(cfg.dq_fence_late):
                    if it > 0:  # the previous block's dQ tile is stored: hand it to the writer warp
                        self.hand_over_dq(wg_idx, (it - 1) % cfg.dq_stages)
                warpgroup.wait_group(0 if cutlass.const_expr(cfg.softcap) else 1)  # S^T is in
                tick = self.tick(phases, 1, tick)
                if cutlass.const_expr(cfg.dk_after_dq):
                    if it > 0:  # the previous block's dK GEMM, the last reader of its stage, is done
                        pipeline_q.consumer_release(release_state)
                        release_state.advance()

                if self.masked_block(seqlen, n_lo, m_lo, offset, left, right):
                    limits = self.hidden_limits(seqlen, n_lo + thr_key, m_lo + thr_query, offset, left, right)
                    self.probs(acc_S, rP, sLSE_thr, lse_r, t0ScS_mn, limits, softmax_scale_log2, softcap_prescale)
                else:
                    self.probs(acc_S, rP, sLSE_thr, lse_r, t0ScS_mn, None, softmax_scale_log2, softcap_prescale)
                if cutlass.const_expr(cfg.softcap):
                    gemm(tiled_mma_SdP, acc_dP, tdPrV, tdPrdO[None, None, None, stage], zero_init=True)
                else:
                    rP.store(acc_S.load().to(self.dtype))
                if cutlass.const_expr(cfg.dkv_split):
                    p_stage = cfg.ds_stages + it % cfg.p_stages
                    cute.copy(stsm_dS, stsm_dS.retile(rP), tdSsdS[None, None, None, p_stage])
                elif cutlass.const_expr(not cfg.dv_after_ds):
                    gemm_accumulate_if(tiled_mma_dV, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], it > 0)
                # dP^T is in; without `overlap_dv` dV is done with rP too, which keeps P^T and dS^T
                # from being live together
                warpgroup.wait_group(1 if cutlass.const_expr(cfg.overlap_dv and not cfg.softcap) else 0)
                tick = self.tick(phases, 2, tick)

                # dS^T = P^T (dP^T - D), with soft-capping P^T (1 - tanh^2) (dP^T - D)
                acc_S_mn = acc_mn_view(acc_as_mma_sync(acc_S))
                acc_dP_mn = acc_mn_view(acc_as_mma_sync(acc_dP))
                for c in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
                    d_row = sD_thr[t0ScS_mn[0, c][1]]
                    for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                        acc_dP_mn[r, c] = acc_S_mn[r, c] * (acc_dP_mn[r, c] - d_row)
                rdS.store(acc_dP.load().to(self.dtype))
                if cutlass.const_expr(cfg.dv_after_ds):
                    gemm_accumulate_if(tiled_mma_dV, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], it > 0)
                if cutlass.const_expr(not cfg.dk_after_dq and not cfg.dk_behind_dq and not cfg.dkv_split):
                    gemm_accumulate_if(tiled_mma_dK, acc_dK, tdKrdS, tdKrQt[None, None, None, stage], it > 0)

                # dS^T of this warpgroup's keys -> shared memory -> dQ partial
                ds_stage = it % cfg.ds_stages
                cute.copy(stsm_dS, stsm_dS.retile(rdS), tdSsdS[None, None, None, ds_stage])
                cute.arch.fence_view_async_shared()  # stmatrix wrote through the generic proxy
                if cutlass.const_expr(not cfg.dq_writer):
                    if dq_warp:
                        # the previous block's reduce-add is done reading sdQ_wg before it is rewritten
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                dq_shape = thr_mma_dQ.partition_shape_C((cfg.dq_rows_per_wg, cfg.dq_cols))
                if cutlass.const_expr(cfg.dq_own_first):
                    # this warpgroup's own dS^T rows are in: the dQ GEMM over its keys goes first
                    cute.arch.barrier(barrier_id=BARRIER_WG + wg_idx, number_of_threads=128)
                    acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
                    gemm(tiled_mma_dQ, acc_dQ, tdQrdS_own[None, None, None, ds_stage], tdQrKt_own, zero_init=True)
                if cutlass.const_expr(cfg.dq_split or cfg.dq_rows):
                    # both warpgroups' dS^T rows are in; each last read the other buffer before it
                    # arrived here, so the next step may overwrite that one
                    cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
                else:
                    cute.arch.barrier(barrier_id=BARRIER_WG + wg_idx, number_of_threads=128)
                tick = self.tick(phases, 3, tick)
                if cutlass.const_expr(cfg.dkv_split):
                    # P^T and dS^T of both warpgroups are in shared memory
                    gemm_accumulate_if(tiled_mma_dV, acc_dV, tdVsP[None, None, None, p_stage],
                                       tdVrdOt[None, None, None, stage], it > 0)
                    gemm_accumulate_if(tiled_mma_dK, acc_dK, tdKsdS[None, None, None, ds_stage],
                                       tdKrQt[None, None, None, stage], it > 0)
                if cutlass.const_expr(cfg.dq_own_first):
                    gemm_accumulate_if(tiled_mma_dQ, acc_dQ, tdQrdS_other[None, None, None, ds_stage], tdQrKt_other,
                                       True)
                else:
                    acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
                    gemm(tiled_mma_dQ, acc_dQ, tdQrdS[None, None, None, ds_stage], tdQrKt, zero_init=True)
                if cutlass.const_expr(cfg.dk_after_dq or cfg.dk_behind_dq):
                    gemm_accumulate_if(tiled_mma_dK, acc_dK, tdKrdS, tdKrQt[None, None, None, stage], it > 0)
                    warpgroup.wait_group(1)  # dQ (and dV) in; the end of every read of sdS
                else:
                    warpgroup.wait_group(0)  # also the end of every read of this stage and of sdS
                    pipeline_q.consumer_release(state)
                tick = self.tick(phases, 4, tick)
                if cutlass.const_expr(not cfg.dk_behind_dq):
                    state.advance()

                if cutlass.const_expr(cfg.dq_writer):
                    self.write_dq_tile(r2s_dQ, acc_dQ, tdQsdQ, dq_swap, wg_idx, it, sdQ[None, None, wg_idx, None])
                else:
                    self.store_dq(r2s_dQ, acc_dQ, tdQsdQ[None, None, None, 0], dq_swap)
                    cute.arch.fence_view_async_shared()  # generic-proxy writes, read next by TMA
                    cute.arch.barrier(barrier_id=BARRIER_WG + wg_idx, number_of_threads=128)
                    if dq_warp:
                        self.reduce_add_dq(tma_dQ, tma_mdQ, sdQ_wg[None, None, 0], seqlen, batch, head, m_block, wg_idx)
                tick = self.tick(phases, 5, tick)
                if cutlass.const_expr(cfg.dk_behind_dq):
                    warpgroup.wait_group(0)  # dK in: the end of every read of this stage
                    pipeline_q.consumer_release(state)
                    state.advance()
                tick = self.tick(phases, 6, tick)
                if cutlass.const_expr(cfg.timeline):
                    phases[TIMELINE_PHASES] = phases[TIMELINE_PHASES] + 1
            self.stamp(stamps, 4)
            if cutlass.const_expr(cfg.timeline):
                if walk.steps <= 2:  # no third step: its stamp is the end of the walk
                    stamps[3] = stamps[4]
            if cutlass.const_expr(cfg.dq_fence_late):
                self.hand_over_dq(wg_idx, (walk.steps - 1) % cfg.dq_stages)  # the last block's dQ tile
            if cutlass.const_expr(cfg.dk_after_dq):
                warpgroup.wait_group(0)  # the last block's dK
                pipeline_q.consumer_release(release_state)
            if cutlass.const_expr(not cfg.dq_writer):
                if dq_warp:
                    cute.arch.cp_async_bulk_wait_group(0)  # every reduce-add done before the CTA leaves

            # ---- epilogue: dK (scaled) and dV in the input dtype ----
            acc_dK.store(acc_dK.load() * softmax_scale)
            if cutlass.const_expr(cfg.dkv_staged):
                sdK, sdV = self.staging_tile(sQ, cfg.head_dim), self.staging_tile(sdO, cfg.head_dim_v)
                self.stage_dkv(acc_dK, acc_dV, sdK, sdV, tiled_mma_dK, tiled_mma_dV, ctidx)
                self.store_dkv(sdK, sdV, mdK, mdV, seqlen, batch, head_k, n_block, ctidx)
            else:
                self.store_rows(acc_dK, mdK, seqlen, batch, head_k, n_block, cfg.head_dim, tiled_mma_dK, ctidx)
                self.store_rows(acc_dV, mdV, seqlen, batch, head_k, n_block, cfg.head_dim_v, tiled_mma_dV, ctidx)
            if cutlass.const_expr(cfg.timeline):
                self.write_timeline(stamps, phases, mdK, seqlen, batch, head_k, n_block, walk.steps, ctidx, wg_idx)
        else:  # no query block sees these keys
            self.store_rows(None, mdK, seqlen, batch, head_k, n_block, cfg.head_dim, tiled_mma_dK, ctidx)
            self.store_rows(None, mdV, seqlen, batch, head_k, n_block, cfg.head_dim_v, tiled_mma_dV, ctidx)

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
            if cutlass.const_expr(cfg.seqused_k or cfg.varlen_k):
                if rows_k < cfg.tile_n:
                    self.zero_kv_tail(sK, sV, rows_k, ctidx, wg_idx)

            offset = seqlen.seqlen_k - seqlen.seqlen_q
            n_lo = n_block * cfg.tile_n
            stat_query = self.stat_row(thr_query, seqlen)
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

    def mma_slices(self, ctidx, wg_idx, *tiled_mmas) -> list:
        """Each tiled MMA sliced twice: (by this thread, for its accumulator partitions; by its
        warpgroup's first thread, for the shared-memory operands, partition_A / partition_B, which
        are the same for every thread of a warpgroup). Sliced by the thread index, the operands'
        descriptors are not warp-uniform and ptxas rebuilds them before every HGMMA (R2UR and
        64-bit adds). A tiled MMA of one warpgroup (dQ's) is sliced within it."""
        one_wg = [t.size <= 128 for t in tiled_mmas]
        return [(t.get_slice(ctidx % 128 if one else ctidx), t.get_slice(0 if one else wg_idx * 128))
                for t, one in zip(tiled_mmas, one_wg)]

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
    def zero_kv_tail(self, sK, sV, rows_k, ctidx, wg_idx):
        """K and V rows at or past `rows_k` (a stale cache past seqlen_k may hold NaN) set to 0
        before any GEMM reads them; with `dkv_split` both warpgroups read every row."""
        cfg = self.cfg
        self.zero_rows(sK, cfg.head_dim, rows_k, ctidx, wg_idx)
        self.zero_rows(sV, cfg.head_dim_v, rows_k, ctidx, wg_idx)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read next by WGMMA
        if cutlass.const_expr(cfg.dkv_split):
            cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        else:
            cute.arch.barrier(barrier_id=BARRIER_WG + wg_idx, number_of_threads=128)

    @cute.jit
    def stat_row(self, thr_query, seqlen: SeqlenInfo):
        """This thread's first query in the LSE / D buffers, which start `offset_q % STAT_ALIGN`
        rows early in a varlen batch (`stat_block`)."""
        row = thr_query
        if cutlass.const_expr(self.cfg.varlen_q):
            row = thr_query + seqlen.offset_q % STAT_ALIGN
        return row

    @cute.jit
    def masked_block(self, seqlen: SeqlenInfo, n_lo, m_lo, offset, left, right):
        """Whether the block of keys from `n_lo` and queries from `m_lo` takes the masked path:
        tails on either side, the causal diagonal, the window edges."""
        cfg = self.cfg
        masked = (n_lo + cfg.tile_n > seqlen.seqlen_k) | (m_lo + cfg.tile_m > seqlen.seqlen_q)
        if cutlass.const_expr(cfg.causal or cfg.local):
            masked = masked | (n_lo + cfg.tile_n - 1 > m_lo + offset + right)
        if cutlass.const_expr(cfg.local):
            masked = masked | (n_lo < m_lo + cfg.tile_m - 1 + offset - left)
        return masked

    def hidden_limits(self, seqlen: SeqlenInfo, key0, query0, offset, left, right) -> tuple:
        """The masked path's limits for `probs`: a (key, query) pair of this thread is key0 + k,
        query0 + q with (k, q) thread 0's coordinates; the limits move this thread's part to the
        right side."""
        return (
            seqlen.seqlen_k - key0,  # k >= this: key past seqlen_k
            seqlen.seqlen_q - query0,  # q >= this: query past seqlen_q
            query0 + offset + right - key0,  # k - q > this: right of the window / diagonal
            query0 + offset - left - key0,  # k - q < this: left of the window
        )

    @cute.jit
    def write_timeline(self, stamps, phases, mdK, seqlen: SeqlenInfo, batch, head_k, n_block, steps, ctidx, wg_idx):
        """`timeline`: this CTA's record over the first row of its dK tile, after the epilogue has
        stored it (see `Sm90BwdConfig.timeline` for the layout)."""
        cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        self.stamp(stamps, 5)
        row = cute.recast_tensor(seqlen.k_rows(mdK, batch, head_k)[n_block * self.cfg.tile_n, None], Int32)
        self.write_record(row, stamps, 6, phases, steps, ctidx, wg_idx)

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

    @cute.jit
    def thread_stats(self, sX_thr, t0ScS_mn) -> cute.Tensor:
        """This thread's entries of a query block's LSE rows (`stats_early`), one per column of
        its S^T fragment, in registers."""
        n = cute.size(t0ScS_mn, mode=[1])
        r = cute.make_rmem_tensor((n,), Float32)
        for c in cutlass.range_constexpr(n):
            r[c] = sX_thr[t0ScS_mn[0, c][1]]
        return r

    @cute.jit
    def probs(self, acc_S, rP, sLSE_thr, lse_r, t0ScS_mn, limits, softmax_scale_log2, softcap_prescale,
              query_mode: cutlass.Constexpr = 1):
        """P^T = exp2(S^T * scale_log2 - LSE_log2[query]), in place in acc_S (fp32).

        With soft-capping, S^T is first t = tanh(S^T * scale / softcap) and the chain rule needs
        1 - t^2 next to P^T: P^T goes to rP (16 bits, the dV operand) here, and acc_S keeps the
        product P^T (1 - t^2), the one factor dS^T needs -- one fp32 tile instead of two.
        `lse_r`: this thread's LSE entries in registers (`stats_early`), or None to read them from
        `sLSE_thr`. With `limits` (the masked path, see `consume`), hidden (key, query) pairs get P = 0:
        keys past seqlen_k, queries past seqlen_q, and pairs outside the causal / local window.
        `query_mode`: the mode of the tile's queries, 1 in S^T (keys x queries) and 0 in the
        (queries x keys) S of `keys_n`."""
        cfg = self.cfg
        key_mode = 1 - query_mode
        acc_S_mn = acc_mn_view(acc_as_mma_sync(acc_S))
        rP_mn = acc_mn_view(acc_as_mma_sync(rP))
        rows, cols = (cute.size(acc_S_mn, mode=[m]) for m in (0, 1))
        visible_bits = None
        if cutlass.const_expr(limits is not None and cfg.mask_bits and cols <= 32 and mma_columns(t0ScS_mn)):
            visible_bits = self.visible_bits(t0ScS_mn, limits, rows, query_mode)
        for i in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[query_mode])):
            q = t0ScS_mn[(0, i) if cutlass.const_expr(query_mode == 1) else (i, 0)][query_mode]
            lse = lse_r[i] if cutlass.const_expr(lse_r is not None) else sLSE_thr[q]
            for j in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[key_mode])):
                rc = (j, i) if cutlass.const_expr(query_mode == 1) else (i, j)
                s = acc_S_mn[rc]
                if cutlass.const_expr(cfg.softcap):
                    s = tanhf(s * softcap_prescale)
                p = exp2f(s * softmax_scale_log2 - lse)
                if cutlass.const_expr(visible_bits is not None):
                    visible = cutlass.Boolean(visible_bits[rc[0]] & cutlass.Uint32(1 << rc[1]))
                    p = p if visible else Float32(0.0)
                elif cutlass.const_expr(limits is not None):
                    k = t0ScS_mn[rc][key_mode]
                    hidden = (k >= limits[0]) | (q >= limits[1])
                    if cutlass.const_expr(cfg.causal or cfg.local):
                        hidden = hidden | (k - q > limits[2])
                    if cutlass.const_expr(cfg.local):
                        hidden = hidden | (k - q < limits[3])
                    p = Float32(0.0) if hidden else p
                if cutlass.const_expr(cfg.softcap):
                    rP_mn[rc] = p.to(self.dtype)
                    p = p * (1.0 - s * s)
                acc_S_mn[rc] = p

    @cute.jit
    def visible_bits(self, t0ScS_mn, limits, rows: cutlass.Constexpr[int], query_mode: cutlass.Constexpr[int]) -> list:
        """`mask_bits`: per row of the accumulator, a word whose bit c says whether column c's
        (key, query) pair is visible under `limits` (`hidden_limits`), which ptxas tests bit by
        bit into predicates instead of comparing each pair. The columns are queries in S^T
        (`query_mode` 1) and keys in the S of `keys_n`; a row's constraints on them become bit
        masks of its elements (`keep_left_of`, `keep_from`), and a row wholly outside its sequence
        keeps nothing."""
        cfg = self.cfg
        masked = cfg.causal or cfg.local
        words = []
        for r in cutlass.range_constexpr(rows):
            x = t0ScS_mn[r, 0][0]  # the row's key (S^T) or query (S)
            if cutlass.const_expr(query_mode == 1):
                # queries q: q < seqlen limit; k - q <= right limit: q >= k - limits[2];
                # k - q >= left limit: q < k - limits[3] + 1
                word = keep_left_of(limits[1])
                if cutlass.const_expr(masked):
                    word = word & keep_from(x - limits[2])
                if cutlass.const_expr(cfg.local):
                    word = word & keep_left_of(x - limits[3] + 1)
                outside = x >= limits[0]
            else:
                # keys k: k < seqlen limit; k <= q + right limit; k >= q + left limit
                word = keep_left_of(limits[0])
                if cutlass.const_expr(masked):
                    word = word & keep_left_of(x + limits[2] + 1)
                if cutlass.const_expr(cfg.local):
                    word = word & keep_from(x + limits[3])
                outside = x >= limits[1]
            words.append(cutlass.Uint32(0) if outside else word)
        return words

    @cute.jit
    def zero_rows(self, sX, cols: cutlass.Constexpr, rows_valid, ctidx, wg_idx):
        """Zero the rows of this warpgroup's share of a key tile (its 64 rows, or half of the 64
        with `dkv_split`) that lie at or past `rows_valid`."""
        tid = ctidx % 128
        wg_rows = self.cfg.tile_n // NUM_CONSUMER_WGS if cutlass.const_expr(self.cfg.dkv_split) else 64
        for i in cutlass.range(wg_rows * cols // 128, unroll_full=True):
            idx = tid + i * 128
            row = wg_idx * wg_rows + idx // cols
            if row >= rows_valid:
                sX[row, idx % cols] = self.dtype(0)

    @cute.jit
    def stage_dkv(self, acc_dK, acc_dV, sdK, sdV, tiled_mma_dK: cute.TiledMma, tiled_mma_dV: cute.TiledMma, ctidx,
                  transpose: cutlass.Constexpr = False):
        """dK and dV rounded to the input dtype (RNE) into the (tile_n, d) tiles `sdK` / `sdV` by
        stmatrix, once both warpgroups are done reading that shared memory: Q's and dO's
        (`dkv_staged`, `staging_tile`) or, for `keys_n`, whose accumulators are dK^T and dV^T
        (`transpose`), K's and V's. `store_dkv` stores them."""
        cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        self.stage_acc(acc_dK, sdK, tiled_mma_dK, ctidx, transpose=transpose)
        self.stage_acc(acc_dV, sdV, tiled_mma_dV, ctidx, transpose=transpose)

    @cute.jit
    def store_dkv(self, sdK, sdV, mdK, mdV, seqlen: SeqlenInfo, batch, head_k, n_block, ctidx):
        """The staged dK and dV tiles to global memory by 128-bit copies, rows inside the key
        sequence and columns inside the actual head dims only (after a barrier of both warpgroups:
        each stores rows the other staged)."""
        cfg = self.cfg
        cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        rows = seqlen.seqlen_k - n_block * cfg.tile_n
        self.store_staged_tile(sdK, mdK, seqlen, batch, head_k, n_block, rows, cfg.head_dim, ctidx)
        self.store_staged_tile(sdV, mdV, seqlen, batch, head_k, n_block, rows, cfg.head_dim_v, ctidx)

    def staging_tile(self, sX, tile_d: int) -> cute.Tensor:
        """A (tile_n, tile_d) tile over the (tile_m, tile_d, 2 stages) of Q or dO: the same swizzle
        atom (its pointer carries the swizzle), as many elements."""
        layout = cute.tile_to_shape(self.split_atom(tile_d), (self.cfg.tile_n, tile_d), (0, 1))
        assert cute.cosize(layout) <= cute.cosize(sX.layout), "the staging tile does not fit"
        return cute.make_tensor(sX.iterator, layout.outer)

    @cute.jit
    def stage_acc(self, acc, sT, tiled_mma: cute.TiledMma, ctidx, transpose: cutlass.Constexpr = False):
        """The fp32 accumulator `acc` rounded to the input dtype into `sT` by stmatrix; with
        `transpose` `acc` is the (cols, rows) tile of `sT` (`keys_n`: dK^T, dV^T) and stmatrix
        transposes its 8 x 8 blocks."""
        stsm = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose, 4), self.dtype), tiled_mma
        ).get_slice(ctidx)
        rX = cute.make_fragment_like(acc, self.dtype)
        rX.store(acc.load().to(self.dtype))
        cute.copy(stsm, stsm.retile(rX), stsm.partition_D(transposed(sT) if cutlass.const_expr(transpose) else sT))

    @cute.jit
    def store_staged_tile(self, sT, mX, seqlen: SeqlenInfo, batch, head_k, n_block, rows, tile_d: cutlass.Constexpr,
                          ctidx):
        """The staged tile `sT` to its rows of `mX`, 128 bits per copy."""
        cfg = self.cfg
        d = mX.shape[2] if cutlass.const_expr(cfg.varlen_k) else mX.shape[3]
        gX = cute.local_tile(seqlen.k_rows(mX, batch, head_k), (cfg.tile_n, tile_d), (n_block, 0))
        s2g = make_s2g_copy(self.dtype, self.num_consumer_threads, swizzle_params(self.dtype.width, tile_d).atom_cols)
        store_staged_rows(s2g, sT, gX, ctidx, rows, d)

    @cute.jit
    def store_rows(self, acc, mX, seqlen: SeqlenInfo, batch, head_k, n_block, tile_d: cutlass.Constexpr,
                   tiled_mma: cute.TiledMma, ctidx):
        """Round an fp32 (tile_n, tile_d) accumulator to the input dtype (RNE), or zeros for
        `acc` None, and store the part inside the key sequence and the actual head dim: two
        neighbouring columns per 32-bit store (the head dim is a multiple of 8, so a pair is
        inside or outside it together)."""
        cfg = self.cfg
        d = mX.shape[2] if cutlass.const_expr(cfg.varlen_k) else mX.shape[3]
        gX = cute.local_tile(seqlen.k_rows(mX, batch, head_k), (cfg.tile_n, tile_d), (n_block, 0))
        rX = cute.make_rmem_tensor(tiled_mma.get_slice(ctidx).partition_C(gX).shape, self.dtype)
        if cutlass.const_expr(acc is None):
            rX.fill(0)
        else:
            rX.store(acc.load().to(self.dtype))
        r2g = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma
        ).get_slice(ctidx)
        tXgX = r2g.partition_D(gX)
        tXrX = r2g.retile(rX)
        tXcX = r2g.partition_D(cute.make_identity_tensor((cfg.tile_n, tile_d)))
        rows = seqlen.seqlen_k - n_block * cfg.tile_n
        # mode 0 of the partitions is (pair, pairs): each thread's whole fragment, one pair per store
        for i in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tXgX, mode=[2])):
                for v in cutlass.range_constexpr(cute.size(tXgX.shape[0][1])):
                    if tXcX[(0, v), i, j][0] < rows:
                        if tXcX[(0, v), i, j][1] < d:
                            cute.copy(r2g, tXrX[(None, v), i, j], tXgX[(None, v), i, j])
