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
   dQ goes to an fp32 accumulator in global memory by TMA reduce-adds (`bwd_dq.py`: the column
   split of `dq_split`, the writer warp, the flat tile, the in-kernel conversion, and the ordered
   reduce-adds of `deterministic`). Two smaller options, per head dim and mask (`bwd_config.py`):
   `stats_early` reads a block's LSE into registers before its S^T GEMM is issued, and
   `dq_fence_late` hands a dQ tile to the writer only after the next block's GEMMs are issued,
   so that the tile's stores drain meanwhile.
   The softmax scale is applied once: to dK here and to dQ in the postprocess.
   dK and dV start from their first query block's GEMMs, not from a zero fill: the compiler
   would hoist the zeros above the warp-role branch and spill them there.
   Head dims 192 and 256 (`dkv_split`): 64 keys per CTA, shared by both warpgroups. Warpgroup w
   computes S^T and dP^T for queries [32w, 32w + 32) of the block (all 64 keys), writes its P^T
   and dS^T columns to shared memory, and after a barrier of both issues dV += P^T dO,
   dK += dS^T Q and dQ = dS K for its half of the head dim's columns, every A operand read from
   shared memory. Q, dO and K take swizzle atoms that tile a half row (`split_atom`).
   Head dim 192 (`keys_n`, `bwd_keys_n.py`): 96 keys per CTA, 48
   per warpgroup, with the keys on the N side of every GEMM -- S = Q K^T and dP = dO V^T are
   m64n48 instead of m64n32, and each Q / dO block serves 96 keys instead of 64; P and dS go to
   shared memory transposed (stmatrix .trans) for dV^T += dO^T P and dK^T += Q^T dS, each
   warpgroup's dV^T and dK^T over the whole head dims and its own keys. With V's head dim 192
   dO and D come through a one-stage ring of their own, Q through two (`single_dout`).
3. Epilogue (`bwd_epilogue.py`): dK (scaled) and dV rounded to the input dtype (RNE), stored
   row-predicated. TMA clips the dQ reduce-adds at the tensor's last row; in a varlen batch the
   rows of a block past its sequence are those of the next one, and they get + 0.0 (P^T, so dS^T
   and that part of dQ, is 0 there).

Q/dO clusters (`cluster_q`: unmasked calls without varlen or seqused_k, with an even number of
key blocks, at head dims 64 and 96): the grid is launched in clusters of two CTAs on
neighbouring key blocks of one (KV head, batch), which walk the same query blocks; each CTA's
producer loads its half of every Q and dO tile by TMA multicast into the stages of both (each
its own LSE and D rows). A stage's empty barrier counts the consumer warps of both CTAs, and a
producer waits for every stage to be released before it leaves (`producer_tail`).

The walk's order, rotated at head dims 192 and 256, and the named barriers are in `bwd_sync.py`;
the masked path, tails included, in `bwd_masks.py`.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup

from ..common.fake_tensors import element_type
from ..common.seqlen_info import SeqlenInfo
from ..common.smem_layouts import (
    swizzle_params,
    wgmma_smem_layout_atom,
    wgmma_smem_layout_tile,
)
from ..common.timeline import TimelineCounters
from ..common.utils import acc_mn_view, transposed
from .bwd_config import (
    LPT_GROUP_CTAS,
    NUM_CONSUMER_WGS,
    STAT_ALIGN,
    TIMELINE_PHASES,
    Sm90BwdConfig,
    make_post_config,
)
from .bwd_dq import DqPath
from .bwd_epilogue import DkvEpilogue
from .bwd_keys_n import KeysNConsumer
from .bwd_masks import BwdMasks
from .bwd_post import FlatDq
from .bwd_sync import BARRIER_BOTH, BARRIER_DQ_FULL, BARRIER_WG, QueryWalk
from .fwd import FlashFwdSm90, multicast, tma_view
from .fwd_sync import tile_coords
from .wgmma import acc_as_mma_sync, gemm, gemm_accumulate_if, probs_as_operand_a, smem_operands


def stats_view(mX: cute.Tensor, varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
    """LSE / D (b, h, s) -> (s, h, b), or varlen (h, total) -> (total, h): tokens first, for TMA."""
    order = [1, 0] if cutlass.const_expr(varlen) else [2, 1, 0]
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=order))


class FlashBwdSm90(KeysNConsumer, DqPath, BwdMasks, DkvEpilogue, TimelineCounters):
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
            offset, n_lo, stat_query = self.walk_start(sK, sV, rows_k, seqlen, n_block, thr_query, ctidx, wg_idx)
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

    def mma_slices(self, ctidx, wg_idx, *tiled_mmas) -> list:
        """Each tiled MMA sliced twice: (by this thread, for its accumulator partitions; by its
        warpgroup's first thread, for the shared-memory operands, partition_A / partition_B, which
        are the same for every thread of a warpgroup). Sliced by the thread index, the operands'
        descriptors are not warp-uniform and ptxas rebuilds them before every HGMMA (R2UR and
        64-bit adds). A tiled MMA of one warpgroup (dQ's) is sliced within it."""
        one_wg = [t.size <= 128 for t in tiled_mmas]
        return [(t.get_slice(ctidx % 128 if one else ctidx), t.get_slice(0 if one else wg_idx * 128))
                for t, one in zip(tiled_mmas, one_wg)]

    @cute.jit
    def write_timeline(self, stamps, phases, mdK, seqlen: SeqlenInfo, batch, head_k, n_block, steps, ctidx, wg_idx):
        """`timeline`: this CTA's record over the first row of its dK tile, after the epilogue has
        stored it (see `Sm90BwdConfig.timeline` for the layout)."""
        cute.arch.barrier(barrier_id=BARRIER_BOTH, number_of_threads=self.num_consumer_threads)
        self.stamp(stamps, 5)
        row = cute.recast_tensor(seqlen.k_rows(mdK, batch, head_k)[n_block * self.cfg.tile_n, None], Int32)
        self.write_record(row, stamps, 6, phases, steps, ctidx, wg_idx)
