"""The sm_90 forward's masked half blocks (`masked_halves`, `fwd.py`), a mixin of `FlashFwdSm90`:
a consumer warpgroup whose 64 rows see at most the first half of a masked key block runs its S
and P·V GEMMs over those keys only."""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from ..common.mask import AttentionMask
from ..common.softmax import OnlineSoftmax
from .fwd_config import TIMELINE_PHASES
from .wgmma import gemm


class MaskedHalves(NamedTuple):
    """`masked_halves`: a consumer warpgroup's S GEMM over the first half of a key block's keys,
    and one past the last key its rows see (`MaskedHalvesPath.keys_seen`)."""
    tiled_mma_qk: cute.TiledMma  # m64 n(tile_n / 2)
    tSrQ: cute.Tensor
    tSrK: cute.Tensor  # the first tile_n / 2 rows of each K slot
    acc_shape: tuple  # of the half accumulator: the first elements of the full one
    col_end: Int32


class MaskedHalvesPath:
    """Mixin of `FlashFwdSm90`: the half-block GEMMs and the block step that takes them."""

    @cute.jit
    def attend_block_halves(
        self, kv, n_block, mask_causal: cutlass.Constexpr, mask_local: cutlass.Constexpr, wg_idx,
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrP, tOrVt, acc_O, rP, pipeline_k, pipeline_v,
        softmax: OnlineSoftmax, correction, mask: AttentionMask, tScS_mn, t0ScS_mn, m_block,
        softcap_prescale, phases, halves: MaskedHalves,
    ):
        """`attend_block` (overlapped) with `masked_halves`: block n's S and block n + 1's P·V over
        the keys of theirs this warpgroup sees (`keys_seen`).

        A whole block's S stays in flight while P·V is issued. A block with at most half of its
        keys seen (or none: its first half is computed and masked) takes the half GEMM into
        registers of its own, waits for it and copies it over; block n + 1's P·V is then
        nothing (n + 1 lies past what block n's first half shows). Each path waits for its own S:
        ptxas keeps the WGMMA pipeline only when every path into a join defines the accumulators
        the same way (a path without any GEMM here, which would also skip the softmax of a block
        seen not at all, made it serialize every WGMMA of the kernel).
        """
        cfg = self.cfg
        kv_s, tick = self.take_turn(kv, pipeline_k, wg_idx, phases)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.get_slice(0).partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
        if self.keys_seen(halves, n_block) > cfg.tile_n // 2:
            gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_s.index], zero_init=True)
            pipeline_v.consumer_wait(kv)
            self.pv_gemm(halves, n_block + 1, tiled_mma_pv, acc_O, tOrP, tOrVt, kv.index)
            self.pass_turn(wg_idx)
            warpgroup.wait_group(1)
        else:
            self.s_half(halves, acc_S, kv_s.index)
            pipeline_v.consumer_wait(kv)
            self.pass_turn(wg_idx)
        tick = self.tick(phases, 2, tick)  # the issue and S's wait, together
        tick = self.tick(phases, 3, tick)
        pipeline_k.consumer_release(kv_s)
        self.scores_to_probs(acc_S, n_block, False, False, mask_causal, mask_local,
                             softmax, correction, mask, tScS_mn, t0ScS_mn, m_block, softcap_prescale,
                             self.pv_wait_midway())
        tick = self.tick(phases, 4, tick)
        if cutlass.const_expr(cfg.pv_wait_at < 0):
            warpgroup.wait_group(0)  # P·V is done with rP and acc_O
        pipeline_v.consumer_release(kv)
        tick = self.tick(phases, 5, tick)
        self.rescale_O_and_store_P(softmax, acc_O, correction, acc_S, rP)
        tick = self.tick(phases, 6, tick)
        if cutlass.const_expr(cfg.timeline):
            phases[TIMELINE_PHASES] = phases[TIMELINE_PHASES] + 1
        return kv_s

    @cute.jit
    def masked_halves(self, sQ, sK, wg_idx, mask: AttentionMask, m_block) -> MaskedHalves:
        """`masked_halves`: the half-block S GEMM of this warpgroup, and one past the last key its
        64th row sees (counted whether or not that row lies in the sequence, so that each of its
        rows, past the end too, masks every key the warpgroup skips)."""
        cfg = self.cfg
        half = cfg.tile_n // 2
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (cfg.num_consumer_wgs, 1, 1),
            (64, half),
        )
        wg_mma = tiled_mma.get_slice(wg_idx * 128)
        sK_half = cute.local_tile(sK, (half, cfg.head_dim, cfg.num_stages), (0, 0, 0))
        right = 0 if cutlass.const_expr(cfg.causal) else mask.window_right
        col_end = (m_block * cfg.tile_m + 64 * (wg_idx + 1)) + (mask.seqlen_k - mask.seqlen_q) + right
        return MaskedHalves(
            tiled_mma,
            tiled_mma.make_fragment_A(wg_mma.partition_A(sQ)),
            tiled_mma.make_fragment_B(wg_mma.partition_B(sK_half)),
            tiled_mma.get_slice(0).partition_shape_C((cfg.tile_m, half)),
            cutlass.min(col_end, mask.seqlen_k),
        )

    @cute.jit
    def keys_seen(self, halves: MaskedHalves, n_block):
        """How many keys of block n (from its first on) some row of this warpgroup sees: > tile_n /
        2 takes the whole block's GEMMs, 1 .. tile_n / 2 the first half's, <= 0 none."""
        return halves.col_end - n_block * self.cfg.tile_n

    @cute.jit
    def s_half(self, halves: MaskedHalves, acc_S, stage):
        """S = Q K(n)ᵀ into acc_S where this warpgroup sees only keys of the first half of block n:
        the first half's GEMM, waited for (with no other WGMMA group in flight), then -inf over
        the rest (which the mask hides anyway; acc_S is never left undefined)."""
        half = cute.size(halves.acc_shape)
        acc_half = cute.make_rmem_tensor(halves.acc_shape, Float32)
        gemm(halves.tiled_mma_qk, acc_half, halves.tSrQ, halves.tSrK[None, None, None, stage], zero_init=True)
        warpgroup.wait_group(0)
        # the first elements of a compact accumulator are the first columns (`MaskedHalves`)
        for i in cutlass.range_constexpr(half):
            acc_S[i] = acc_half[i]
        for i in cutlass.range_constexpr(half, cute.size(acc_S)):
            acc_S[i] = -Float32.inf

    @cute.jit
    def pv_gemm(self, halves: Optional[MaskedHalves], n_block, tiled_mma_pv, acc_O, tOrP, tOrVt, stage):
        """Issue O += P V(n) as one WGMMA group; with `halves`, over the keys of block n this
        warpgroup sees (P is 0 on the others), an empty group when it sees none."""
        if cutlass.const_expr(halves is None):
            gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, stage], zero_init=False)
        else:
            seen = self.keys_seen(halves, n_block)
            if seen > self.cfg.tile_n // 2:
                gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, stage], zero_init=False)
            else:
                if seen > 0:
                    gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, stage], zero_init=False,
                         k_blocks=cute.size(tOrP, mode=[2]) // 2)
                else:
                    warpgroup.commit_group()
