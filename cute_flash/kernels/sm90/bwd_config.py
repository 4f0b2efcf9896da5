"""Compile-time configuration of the sm_90 backward kernel: the key of its compile cache.

`Sm90BwdConfig` holds every choice that changes the generated code of `FlashBwdSm90`; sequence
lengths, batch, heads, strides, the actual head dims inside a padded tile, the scale and the
window sizes are run-time arguments. The preprocess is the sm_80 one (`kernels/sm80/bwd_pre.py`,
a row-wise pass with nothing to gain from TMA or WGMMA, which also clears the dQ accumulator);
the postprocess is the sm_80 row kernel for the row-major accumulator and `bwd_post.py`'s for
the flat one (`dq_flat`, `Sm90BwdPostConfig`).

Each of the two consumer warpgroups owns 64 of the CTA's `tile_n` = 128 keys and keeps their dK
and dV in fp32 registers for the whole kernel: 64 * (d + dv) / 128 registers per thread, 128 at
head dim 128. On top of that, per query block of `tile_m` rows: the S^T and dP^T tiles
(64 * tile_m / 128 each), P^T and dS^T in 16 bits (half that each) and the warpgroup's dQ
tile (tile_m * `dq_cols` / 128: all d columns, or half of them with `dq_split`). With 240
registers per consumer thread (`setmaxnreg`) that leaves room for 64-row query blocks at every
head dim up to 128; every entry compiles with zero spills for sm_90a with all feature flags on.
At head dims 192 and 256 that would be 192 and 256 registers for dK and dV alone, so there
(`dkv_split`) the CTA takes 64 keys, both warpgroups share them and each keeps half of the
columns of dK, dV and dQ (64 + 64 + 64 registers at 256), computing S^T and dP^T for half of the
query block's rows; P^T and dS^T go through shared memory to the dK / dV / dQ GEMMs of both.
At head dim 192 the CTA takes 96 keys instead, 48 per warpgroup, with the keys on the N side of
every GEMM (`keys_n`): fwd + bwd on an H200 (bf16, 2 x 8192 x 16 heads, two
runs of three rounds) 448-499 TFLOP/s against 420-437 for the 64-key tile at 192 / 128, causal
464-469 against 357-421. Two (Q, dO) stages of it fill shared memory to the limit; at 192 / 192
two Q stages fit next to one of dO with one dS^T buffer (`single_dout`): 433-519 (two rounds of
three above 512) against 466-482, causal 497-508 against 374-469 (one stage of both had measured
370-373 against 470-475).
Head dims of V and Q may differ only on these column-split tiles (the larger above 128, the smaller padding to
64, 128 or 192); other pairs and head dims above 256 are refused by name (`NotImplementedError`,
`UnsupportedHeadDim`).

Shared memory (`smem_bytes`): K and V of the CTA, `num_stages` buffers of (Q, dO, LSE, D),
`ds_stages` dS^T buffers and the two warpgroups' fp32 dQ tiles (`dq_stages` each): about 2 *
(tile_n * (d + dv) + stages * tile_m * (d + dv) + ds_stages * tile_n * tile_m) + 8 * stages *
`stat_stage_stride` + 2 * 4 * dq_stages * tile_m * dq_cols bytes and 2 KB of mbarriers and
alignment, 195 KB at head dim 128 with 2 stages and `dq_split` (211 KB without).

The LSE and D rows of a query block come by TMA too. In a fixed-length batch a block starts at a
multiple of `tile_m` rows, which is 16-byte aligned; in a varlen batch it starts at
cu_seqlens_q[b] + m * tile_m, any row, so there the box starts at the multiple of `STAT_ALIGN` at
or below and is `STAT_ALIGN` rows longer (`stat_box`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..common.tiles import SM90_STATIC_SMEM_BYTES, align_up, check_attention_config, pad_headdim

TILE_HEADDIMS = (64, 96, 128, 192, 256)
# Head dims that halve into whole swizzle atoms (`dkv_split`: each warpgroup's half of the columns)
SPLIT_HEADDIMS = (64, 128, 192, 256)
DTYPES = ("float16", "bfloat16")
SMEM_LIMIT = 227 * 1024
NUM_CONSUMER_WGS = 2
# `Sm90BwdConfig.dq_convert`: the warpgroups of a conversion CTA, each converting chunks of dQ on its own
NUM_CONVERT_GROUPS = NUM_CONSUMER_WGS + 1
# setmaxnreg budgets (consumer, producer): 128 * (24 + 2 * 240) <= 64K registers of an SM
REGISTERS = (240, 24)
# `Sm90BwdConfig.timeline`: the phases of a step whose clock cycles a profiling build counts
TIMELINE_PHASES = 7
# `Sm90BwdConfig.lpt`: CTAs per group of heads whose key blocks go longest first
LPT_GROUP_CTAS = 256
# `Sm90BwdConfig.rotate_queries`: unmasked calls from this head dim of Q on
ROTATE_FROM_HEADDIM = 192
# A TMA box must start at a 16-byte-aligned address of its innermost dimension (4 floats of the
# LSE / D rows); the hardware stops the kernel with an illegal instruction otherwise.
STAT_ALIGN = 4


class BwdTile(NamedTuple):
    tile_m: int  # query rows per inner step
    num_stages: int  # depth of the (Q, dO, LSE, D) ring
    dq_split: bool = False  # see `Sm90BwdConfig.dq_split`
    dq_writer: bool = False  # see `Sm90BwdConfig.dq_writer`
    overlap_dv: bool = False  # see `Sm90BwdConfig.overlap_dv`
    dk_after_dq: bool = False  # see `Sm90BwdConfig.dk_after_dq`
    # see `Sm90BwdConfig.stats_early` / `.dq_fence_late`: the calls that get them, "plain" (no
    # causal or window mask) and / or "masked"
    stats_early: tuple = ()
    dq_fence_late: tuple = ()
    dk_behind_dq: bool = False  # see `Sm90BwdConfig.dk_behind_dq`
    dq_stages: int = 1  # see `Sm90BwdConfig.dq_stages`
    dq_rows: bool = False  # see `Sm90BwdConfig.dq_rows`
    dv_after_ds: bool = False  # see `Sm90BwdConfig.dv_after_ds`
    dkv_split: bool = False  # see `Sm90BwdConfig.dkv_split`
    keys_n: bool = False  # see `Sm90BwdConfig.keys_n`
    ds_kmajor: bool = False  # see `Sm90BwdConfig.ds_kmajor`
    dq_own_first: bool = False  # see `Sm90BwdConfig.dq_own_first`


# keyed by the padded head dim
TILES = {
    64: BwdTile(64, 2, dq_split=True, dq_writer=True, overlap_dv=True, dk_after_dq=True,
                dq_fence_late=("plain", "masked"), dq_stages=2),
    96: BwdTile(64, 2, dq_split=True, dq_writer=True, overlap_dv=True, stats_early=("plain", "masked"), dq_stages=2,
                dk_behind_dq=True, ds_kmajor=True, dq_own_first=True),
    128: BwdTile(64, 2, dq_split=True, dq_writer=True, overlap_dv=True, stats_early=("plain", "masked"),
                 dk_behind_dq=True, ds_kmajor=True, dq_own_first=True),
    # 64 keys per CTA, dK / dV / dQ split over the warpgroups' columns (`dkv_split`); at 256 one
    # stage of (Q, dO): two do not fit next to K, V, P^T, dS^T and the dQ tiles
    # ... and at 192 96 keys per CTA (`keys_n`; with V's head dim 192 one dO stage, `single_dout`)
    192: BwdTile(64, 2, dq_split=True, dq_writer=True, dkv_split=True, keys_n=True),
    256: BwdTile(64, 1, dq_split=True, dq_writer=True, dkv_split=True),
}


# 128 query rows per step (half the steps -- barriers, waits, LSE / D loads -- per key block) in
# flash-attn-4's order: dV after dS^T, dK behind dQ, each warpgroup's dQ over 64 of the rows.
# Compiles without spills or WGMMA serialization at head dim 64 (128 rows with dV issued before
# dS^T serialize, and so does this tile with soft-capping, whose fp32 tanh tile is one more, or
# without the dQ writer warp): calls without either take it.
WIDE_TILES = {
    64: BwdTile(128, 2, dq_rows=True, dq_writer=True, dk_behind_dq=True, dv_after_ds=True,
                dq_fence_late=("plain", "masked")),
}


class UnsupportedHeadDim(NotImplementedError):
    pass


@dataclass(frozen=True)
class Sm90BwdConfig:
    dtype: str  # "float16" | "bfloat16"
    head_dim: int  # padded tile head dim of Q, K, dQ, dK
    head_dim_v: int  # padded tile head dim of V, O, dO, dV
    tile_m: int
    num_stages: int
    causal: bool = False
    local: bool = False  # sliding window (causal is not local)
    softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_k: bool = False
    # dQ of a query block over all the CTA's keys, each warpgroup taking half its columns, instead
    # of one partial per warpgroup over its own keys: half the reduce-add traffic and half the dQ
    # registers, for a barrier of both warpgroups and a second dS^T buffer per step. Head dims
    # 128 (a warpgroup's half of K is one 64-column swizzle atom) and 64 (half of one atom: the
    # dQ GEMM's K operand starts 64 bytes into the 128-byte swizzled rows); at 96, where a half
    # would be one and a half of the row's 32-column atoms, K takes 16-column (32-byte) atoms
    # (`FlashBwdSm90.split_atom`) and the dQ tiles are 48 columns wide, without `dq_swap`. On an
    # H200 (bf16, 21 heads, the backward's three kernels, `bwd_variant_ab`-style interleaved A/B,
    # 3 rounds, TFLOP/s), with `stats_early`: 2 x 8192 453-465 -> 499-507, causal 405-435 ->
    # 469-478; 8 x 2048 402-409 -> 434-451, causal 344-357 -> 351-385. (dq_split alone: 450-479,
    # 439-453, 411-428, 366-371.)
    dq_split: bool = False
    # The reduce-adds of dQ issued by a warp of their own (the producer warpgroup's second):
    # a consumer warpgroup writes its tile, arrives on a named barrier and goes on; it waits only
    # when it comes back to write the next tile before the last one has been read.
    dq_writer: bool = False
    # dV += P^T dO left in flight while dS^T is formed (only dP^T is waited for), P^T's registers
    # held until the dQ GEMM's wait; without it both are waited for before dS^T. On an H200
    # (b2 x 4096, bf16, the backend's bwd under do_bench) 1.387 -> 1.372 ms at head dim 128 (16
    # heads), causal 0.841 -> 0.833, and 1.809 -> 1.776 ms at 64 (32 heads), causal 1.042 -> 1.025
    # (two runs of each). Not with soft-capping, whose dP^T is issued after P^T.
    overlap_dv: bool = False
    # dK += dS^T Q issued after the dQ GEMM and left in flight into the next query block (its
    # Q stage released there, after the wait for S^T), so that it overlaps dQ's way to shared
    # memory and the next block's first GEMMs; without it dK is issued before dS^T is staged
    # and waited for with dQ. On an H200 (b2 x 4096 x 32 heads, hd64, bf16, the backend's bwd
    # under do_bench, two runs each): 1.775 -> 1.718 ms, causal 1.028 -> 0.999 ms. At head dim
    # 128 ptxas serializes the WGMMAs for lack of registers (the compile test refuses that), so
    # only 64 ships it; 96 compiles without serialization and passes the GPU tests with it, but
    # has not been timed.
    dk_after_dq: bool = False
    # The query block's LSE rows read from shared memory into registers before the S^T GEMM is
    # issued instead of next to their first use, so that P^T does not wait for the loads. On an
    # H200 (b2 x 4096, bf16, the backend's bwd under do_bench, best of 3) 1.306 -> 1.283 ms at
    # head dim 128 (16 heads), causal 0.811 -> 0.808; at 64 (32 heads) 1.722 -> 1.865 ms, causal
    # 0.994 -> 1.076, and with `dq_fence_late` slower than either alone. Shipped at head dims 96
    # (with `dq_split`, see there: causal 2 x 8192 439-453 -> 469-478 TFLOP/s; with
    # `dq_fence_late` too 434-446) and 128, with any mask. At 128 with a causal mask it replaced
    # `dq_fence_late` (H200, bf16, 16 heads, the backward's three kernels, interleaved A/B, 5
    # rounds, TFLOP/s): 2 x 8192 534-542 -> 560-573, 8 x 2048 419-428 -> 439-455, 1 x 16384
    # 542-562 -> 576-593 (at a lower clock: fewer cycles); dq_fence_late off alone 525-547,
    # 414-430, 554-560. A window of 1024 each side: 1.333-1.376 -> 1.322-1.326 ms; deterministic
    # calls level (causal 2.675-2.678 against 2.695-2.762 ms).
    stats_early: bool = False
    # With `dq_writer`: the fence and the arrival that hand a dQ tile to the writer warp come
    # after the next block's S^T and dP^T are issued (or after the loop), so that the tile's
    # stores drain meanwhile instead of holding up the warpgroup right after they are issued.
    # Same measurements: 1.722 -> 1.687 ms at head dim 64, causal 0.994 -> 0.971; at 128 1.306 ->
    # 1.328 ms, causal 0.811 -> 0.794. Shipped at 64; at 128 it was shipped with a causal or
    # window mask until `stats_early` measured faster there (see there).
    dq_fence_late: bool = False
    # Without `dk_after_dq`: dK += dS^T Q issued after the dQ GEMM instead of before dS^T goes to
    # shared memory, and waited for at the end of the block: the dQ GEMM's wait no longer waits
    # for dK too, and the dQ tile goes to shared memory while dK's GEMM runs. (The stmatrix of
    # dS^T then also comes before any GEMM that reads the same registers.) On the H200 (bf16,
    # 2 x 4096, `benchmarks/ab_sm90_bwd.py`, best of 3 rounds): head dim 128 1.332 -> 1.260 ms,
    # causal 0.821 -> 0.796; at 96 with one dQ tile 1.736 -> 1.709, but with two 1.658 -> 1.700
    # (causal 0.941 -> 0.956): shipped at head dim 128 only then. With the flat dQ store
    # (`dq_flat`) and the dQ column split at 96, head dim 96 gains too (same script, five
    # rounds, ms, medians): 2 x 4096 1.398 -> 1.339, causal 0.779 -> 0.773; 2 x 8192 5.238 ->
    # 5.056, causal 2.750 -> 2.622; 8 x 2048 1.468 -> 1.408, causal 0.863 -> 0.845: shipped there.
    dk_behind_dq: bool = False
    # dS^T stored transposed (stmatrix .trans) as dS, a (queries, keys) tile with the keys
    # contiguous, so that the dQ GEMMs read their A operand K-major instead of as the MN-major
    # view of dS^T (flash-attn-4's store of dS). Nothing else reads that tile on the tiles it
    # applies to (dK takes dS^T from registers). Shipped with `dq_own_first` at head dims 96 and
    # 128 (see there for the measurements); not at 64, whose 128-row tile measured level or
    # slower with it (H100, same run: 2 x 8192 x 32 heads, medians 5.284 -> 5.246 ms, causal
    # 2.732 -> 2.745), nor with `dkv_split`, which it excludes.
    ds_kmajor: bool = False
    # With `dq_split` (or `dq_rows`, for A/B): each warpgroup's dQ GEMM in two halves of the
    # keys, its own 64 first, issued once its own dS^T rows are in shared memory (a barrier of
    # the warpgroup), then the other warpgroup's after the barrier of both: a warpgroup that
    # forms dS^T first queues half its dQ GEMM instead of waiting for the other. Shipped with
    # `ds_kmajor` at head dims 96 and 128. On an H100 (bf16, 2 x 8192, 16 heads at 128 and 21 at
    # 96, the backward's three kernels, `benchmarks/ab_sm90_bwd.py --rounds 7`, medians in ms,
    # shipped before / ds_kmajor / dq_own_first / both): head dim 128 4.837 / 4.565 / 4.516 /
    # 4.431, causal 2.587 / 2.441 / 2.369 / 2.422; head dim 96 5.114 / 4.970 / 4.937 / 4.812,
    # causal 2.913 / 2.733 / 2.612 / 2.577. A second run on another H100 (5 rounds, shipped / both off): 128 4.426 / 4.457,
    # causal 2.330 / 2.415; 96 4.808 / 4.887, causal 2.573 / 2.622 (and 8 x 2048 causal at 128
    # 0.802 / 0.824): ahead or level in every case, by less than the first run said. Both flags
    # ship together: the pair was fastest in three of the first run's four cases (2% behind
    # `dq_own_first` alone at 128 causal, within the rounds' spread). On head dim 64's 128-row
    # tile (`dq_rows`) neither helps (second run: 5.238 shipped, 5.256 with `dq_own_first`,
    # 5.282 with both; causal 2.714, 2.729, 2.792).
    dq_own_first: bool = False
    # Shared-memory dQ tiles per warpgroup (with `dq_writer`): with 2 a warpgroup writes a
    # block's tile while the writer warp's reduce-add may still be reading the previous one, and
    # waits only for the one before that (a FULL and an EMPTY barrier per warpgroup and tile).
    # Not shipped at head dim 128, where the second tiles take shared memory to exactly its limit
    # (232448 bytes; it compiles without spills) and measured level there (2 x 4096, 3 rounds:
    # 1.256-1.273 ms against 1.234-1.304, causal 0.711-0.720 against 0.682-0.721). Same
    # measurements: head dim 96 1.740 -> 1.644 ms, causal 0.971 -> 0.934; at 64 level (1.697 ->
    # 1.694, causal 0.972 -> 0.967).
    dq_stages: int = 1
    # Causal: the key blocks of a group of heads in the order of their work, longest first (with
    # a bottom-right causal mask key block 0 meets every query block), instead of each head's
    # blocks in turn. A group holds about `LPT_GROUP_CTAS` CTAs, so that the heads whose Q and
    # dO the running CTAs read at one time stay few; the grid's last CTAs are then short ones.
    # On the H200 (bf16, causal, `benchmarks/ab_sm90_bwd.py`, 3 rounds): 2 x 4096 at head dim 128
    # 0.817-0.837 -> 0.772-0.788 ms, at 64 0.971-0.972 -> 0.937-0.997; 8 x 2048 at 128 level.
    # Deterministic calls take this order with any mask (reversed with one, `shortest_first`):
    # the key blocks of a head that start together (a section's first CTAs) hand each query
    # block's turn down a chain, and each later CTA starts about one hand-over after the one
    # before it. With each head's blocks in turn, the first wave held whole heads and every CTA
    # of a head waited for all the blocks before it (H200, bf16, no mask, a
    # `benchmarks/ab_sm90_bwd.py`-style A/B of the main kernel, 3 rounds, TFLOP/s: head dim 128,
    # 2 x 8192: 464-530 -> 529-542; 8 x 2048: 436-442 -> 466-470; head dim 64, 2 x 8192: 398-448
    # -> 471-488). Without determinism and without a mask it measured slower (head dim 128,
    # 2 x 8192: 588 -> 558-578).
    lpt: bool = False
    # dK and dV staged in the shared memory of Q and dO (free once the last block is done) by
    # stmatrix and stored from there 128 bits per thread and copy, instead of 32-bit stores
    # straight from the accumulators' layout (8 rows and 16 bytes of each per warp store).
    # On the H200 (bf16, `benchmarks/ab_sm90_bwd.py`, 3 rounds, ms): 2 x 4096 at head dim 128
    # 1.36-1.39 -> 1.23-1.30, causal 0.75-0.83 -> 0.68-0.72; at 64 1.69-1.70 -> 1.63-1.68, causal
    # 0.93-0.98 -> 0.88-0.91; 8 x 2048 at 128 1.57-1.58 -> 1.33-1.38, causal 0.92-1.04 -> 0.82-0.84.
    dkv_staged: bool = False
    # With 128-row query blocks (`tile_m` 128, `WIDE_TILES`: head dim 64): each warpgroup
    # computes dQ for 64 of the block's rows over all the CTA's keys (flash-attn-4's layout at
    # head dim 64), instead of half the columns (`dq_split`) or a partial over its own keys.
    dq_rows: bool = False
    # dV += P^T dO issued once dS^T is formed (flash-attn-4's order) instead of before: no GEMM
    # is in flight while dS^T is computed, P^T's 16-bit registers live across it instead. Shipped
    # with the 128-row tile (`WIDE_TILES`); at head dims 96 and 128 level or slower (A/B "dV after dS").
    # On the 96-key tile (`keys_n`, where P comes from shared memory) dV^T is issued after the
    # barrier of both warpgroups instead of after P's own: level at 192 (H200, 2 x 8192 x 10
    # heads, 3 rounds: 5.81/6.43/5.70 ms against 5.79-5.88, causal 2.83-2.91 against 2.81-2.94).
    dv_after_ds: bool = False
    # Head dims 192 and 256: the CTA's 64 keys are shared by both warpgroups, and dK, dV and dQ
    # split over their columns (128 each at 256: 64 + 64 + 64 accumulator registers per thread,
    # where 64 keys per warpgroup would need 256 for dK and dV alone). Each warpgroup computes
    # S^T and dP^T for half of the block's queries; P^T and dS^T go to shared memory, and dV += P^T dO,
    # dK += dS^T Q and dQ = dS K read them from there (A operands in shared memory).
    dkv_split: bool = False
    # With `dkv_split` at head dim 192: 96 keys per CTA instead of 64, 48 per warpgroup, with the
    # keys on the N side of every GEMM (flash-attn-4's tile there): S = Q K^T and dP = dO V^T
    # (64 queries x the warpgroup's 48 keys), P and dS to shared memory transposed (stmatrix
    # .trans), dV^T += dO^T P and dK^T += Q^T dS (the whole head dim x the warpgroup's keys, A
    # operands dO^T / Q^T in shared memory), and dQ = dS K over all 96 keys for the warpgroup's
    # half of the columns. The S and dP GEMMs are m64n48 over the head dim instead of m64n32,
    # and every Q / dO block is read for 96 keys instead of 64. dK and dV are staged in the
    # shared memory of K and V for their stores.
    keys_n: bool = False
    # With `keys_n`: dO (and D) in one stage, while Q and the LSE keep `num_stages`, and dS^T in
    # one buffer, which a warpgroup rewrites only once the other's dQ GEMM has read it (a named
    # barrier each way) -- the shared memory that two stages of the 96-key tile need at 192 / 192.
    # There `dq_fence_late` measured level (5.83-5.88 ms against 5.79-5.88, causal 2.78-2.84
    # against 2.81-2.94; `ab_sm90_bwd.py`, 2 x 8192 x 10 heads, 3 rounds): not shipped.
    single_dout: bool = False
    # The fp32 dQ tile into shared memory (the source of its TMA reduce-add) with the column groups
    # of odd rows swapped: in the 128-byte-swizzled tile the 64-bit stores of rows 2i and 2i + 1
    # (one half-warp's phase holds four consecutive rows of the accumulator) hit the same banks,
    # which made every dQ store take twice its wavefronts. A thread of an odd row stores its
    # columns c ^ 16 in the slot of c (the values swapped by selects, the addresses by an XOR
    # of the tile's element offsets), so that the four rows of a phase cover all 32 banks.
    # On the H200 (bf16, 2 x 8192, `benchmarks/ab_sm90_bwd.py --variants "no dq_swap"`, 3 rounds,
    # ms): head dim 64 5.50-5.57 -> 5.27-5.30, causal 2.90-2.91 -> 2.70-2.77; 128 4.75-4.77 ->
    # 4.49-4.63, causal 2.54-2.56 -> 2.49-2.52; 256 level (7.02-7.10 / 7.01-7.04, causal
    # 3.25-3.29 / 3.26-3.32); 192 (the 96-key tile, 5 rounds) causal 2.74-2.80 -> 2.66-2.76 but
    # without a mask 5.67-5.84 -> 5.79-5.88. Since unmasked calls on the column-split tiles walk
    # their query blocks rotated (`rotate_queries`), it costs there: head dim 256 without a mask
    # (H200, bf16, 8 heads, the backward's three kernels, interleaved A/B, 5 rounds, ms) 2 x 8192
    # 7.19-7.29 with it against 6.54-6.65 without (one outlier 7.74), 8 x 2048 1.96-1.99 against
    # 1.78-1.86, 1 x 16384 14.59-15.34 against 13.25-13.53; causal level (3.26-3.47 / 3.30-3.77,
    # 1.01-1.09 / 1.02-1.04); deterministic calls, whose walks are not rotated, level (2 x 8192,
    # 3 rounds: 7.78-7.98 with it, 7.94-7.98 without); 192 without a mask level (5.56-5.61
    # without it / 5.38-6.34 with it). So `make_config` turns it off on rotated walks (and on the
    # 96-key tile without a mask, as before). ncu at head dim 128: the
    # store bank conflicts of the main kernel 68.8 M -> 0.5 M, its shared-store wavefronts
    # 247 M -> 166 M. The other conflict-free layout, the tiles in 32-byte swizzle atoms (8
    # columns, so TMA boxes 8 columns wide: four times the reduce-adds), measured slower than
    # either (same A/B, ms: 128 4.97-5.08, causal 2.74-2.83; 192 6.05-6.11, causal 2.99-3.09;
    # 64 5.61-5.75, causal 2.94-3.07) and was not kept.
    dq_swap: bool = False
    # dQ in accumulator order (`dq_flat`): each warpgroup stores its fp32 dQ with 128-bit stores,
    # value group i of thread t at float 4 (128 i + t) of a flat shared tile, and adds the tile to
    # dQaccum with one 1-D bulk reduce-add. dQaccum is then (batch, head, padded seqlen, d) with
    # each query block's tile_m x d floats a run of `dq_chunks` such tiles (one per warpgroup
    # where they hold different rows or columns, one both add into otherwise), which the sm_90
    # postprocess (`bwd_post.py`) puts back in row order. Fixed-length calls with the dQ writer
    # (varlen ones keep the row-major tile). Against the row-major tile with and without
    # `dq_swap` (`ab_sm90_bwd.py --variants "row-major dQ,row-major dQ swapped"`, 2 x 4096, three
    # rounds, ms) it was the fastest at every head dim, causal and not: 1-5% (hd128 1.202-1.207
    # against 1.213-1.320 swapped; hd192 1.361-1.403 against 1.385-1.576; hd96, unswapped before,
    # 1.365-1.408 against 1.439-1.451).
    dq_flat: bool = False
    # The postprocess inside the main kernel (`dq_flat` only, not deterministic; an A/B option that
    # make_config does not set, below): the grid gets `num_convert_ctas` CTAs more, launched after every
    # key block's, which turn the query blocks of the flat accumulator into dQ once every key
    # block that sees one has added into it. At the end of its CTA the dQ writer warp counts its
    # added tiles into a counter per (batch, query head, query block) (release adds, once they are
    # performed); a conversion CTA waits (acquire) for the count `BlockInfo.n_block_range` gives
    # and rounds the block as the postprocess kernel would (`bwd_post.FlatDq`). They take only
    # SMs that no key block is left for, so the conversions of the finished heads fill the grid's
    # last wave instead of a launch of their own. Its first form, a count after every step (a proxy
    # fence and a release add on the writer warp's path each step) and polls back to back, passed
    # `tests/gpu/test_bwd_sm90.py` on an H200 with it on by default (424 tests) but ran slower than
    # the postprocess kernel (bf16, `benchmarks/ab_sm90_bwd.py --rounds 5`, ms, in kernel /
    # postprocess kernel, best rounds): 8 x 2048 hd128 causal 0.802 / 0.721, no mask 1.378 / 1.274,
    # hd64 causal 0.941 / 0.870, no mask 1.514 / 1.447; 2 x 4096 hd128 1.235 / 1.181, causal 0.656
    # / 0.639, hd64 1.381 / 1.364, causal 0.766 / 0.740. This form (one count per CTA at its end,
    # polls 500 ns apart) compiles without spills and is untimed and not yet run on a GPU.
    dq_convert: bool = False
    # A profiling build (`benchmarks/bwd_timeline.py`; `make_config` never sets it): each CTA
    # writes a record over the first row of its dK tile, which is then no gradient. As int32s:
    # 0 the SM, 1 the steps (query blocks), 2-7 the low 32 bits of the global nanosecond timer at
    # the start, K and V in, the first step's Q in, the third step's Q in (the end of the walk for
    # walks of two steps or less), the end of the walk and the end of the epilogue; then per
    # consumer warpgroup (8 + 8w) the SM clock cycles of thread 0 of the warpgroup spent, summed
    # over its steps, in each of the `TIMELINE_PHASES` phases of a step -- waiting for Q / dO,
    # issuing S^T (and dP^T) and waiting for S^T, forming P^T and waiting for dP^T, forming and
    # storing dS^T up to the barrier, the dQ GEMM and its wait, handing dQ over, and the rest
    # (dK's wait, the stage's release) -- and its step count.
    timeline: bool = False
    # Clusters of two CTAs on neighbouring key blocks of one (batch, KV head) share the query
    # blocks they both walk: each CTA loads half of every Q and dO tile by TMA multicast into both
    # (the LSE and D rows each its own), which halves those reads from L2 (`with_cluster_q`:
    # unmasked calls without varlen or seqused_k, with an even number of key blocks, on the
    # tiles of head dims 64 and 96; the kernel takes it up to 128).
    cluster_q: bool = False
    # The CTAs of a (batch, KV head) start their walks over the query blocks at offsets spread
    # over the range (and wrap around) instead of all at the first one, so that their dQ
    # reduce-adds do not all land on one query block at once (make_config: no mask, head dims of
    # Q from 192; see `bwd.py`).
    rotate_queries: bool = False
    # Bitwise-reproducible gradients: the key blocks that see a query block reduce-add their dQ
    # tiles into it one after the other, in key-block order (a turn counter per (batch, query
    # head, query block) in global memory, which the dQ writer warp waits on and advances). It
    # needs the writer warp and every CTA walking its query blocks in one order (no cluster, no
    # rotation; with a mask the turns go from the last key block down, `shortest_first`); dK and
    # dV are summed in registers, in a fixed order, already.
    deterministic: bool = False
    # The masked path's verdicts through a bit mask per accumulator row (`FlashBwdSm90.visible_bits`),
    # which ptxas tests bit by bit into predicates, instead of comparing every (key, query) pair
    # (False: for A/B). At head dim 64 causal 2060 -> 1964 SASS instructions (FSEL 192 -> 64).
    # On the H200 (bf16, causal, `ab_sm90_bwd.py --variants compares`, medians, ms): 2 x 4096
    # hd64 0.753 against 0.764, hd96 0.767 / 0.772, hd192 0.737 / 0.753 (5 rounds), hd128 0.653 /
    # 0.654 (7 rounds); 8 x 2048 hd64 0.880 / 0.885, hd128 0.772 / 0.769; 2 x 8192 hd128 2.387 / 2.393.
    mask_bits: bool = True

    num_threads = 128 * (NUM_CONSUMER_WGS + 1)
    registers = REGISTERS

    @property
    def tile_n(self) -> int:
        """Keys per CTA: 64 per consumer warpgroup, or 64 shared by both (`dkv_split`), or 48 per
        warpgroup (`keys_n`)."""
        if self.keys_n:
            return 48 * NUM_CONSUMER_WGS
        return 64 if self.dkv_split else 64 * NUM_CONSUMER_WGS

    def __post_init__(self):
        check_attention_config(self, DTYPES, TILE_HEADDIMS)
        if self.dkv_split:
            for flag in ("overlap_dv", "dk_after_dq", "dk_behind_dq", "dq_rows", "dv_after_ds", "stats_early"):
                if getattr(self, flag) and not (flag == "dv_after_ds" and self.keys_n):
                    raise ValueError(f"dkv_split reads P^T and dS^T from shared memory; it excludes {flag}")
            if not self.dq_split or max(self.head_dim, self.head_dim_v) not in (192, 256):
                raise ValueError(f"dkv_split needs dq_split and head dim 192 or 256; got {self.head_dim}")
            if self.head_dim_v not in SPLIT_HEADDIMS:
                # each warpgroup's half of V's columns is an MN-major operand: whole swizzle atoms
                raise ValueError(f"dkv_split needs head dim of V in {SPLIT_HEADDIMS}; got {self.head_dim_v}")
            if self.keys_n and (self.head_dim != 192 or self.head_dim_v > 192 or self.timeline):
                raise ValueError(f"keys_n is a tile of head dim 192 (V's up to 192) without the profiling build; "
                                 f"got {self.head_dim} / {self.head_dim_v}")
        elif self.keys_n:
            raise ValueError("keys_n needs dkv_split")
        elif max(self.head_dim, self.head_dim_v) > 128:
            raise ValueError(f"head dim {max(self.head_dim, self.head_dim_v)} needs dkv_split")
        elif self.head_dim != self.head_dim_v:
            raise ValueError("unequal head dims of Q and V need dkv_split")
        if self.single_dout and not self.keys_n:
            raise ValueError("single_dout needs keys_n")
        if self.keys_n and not self.dq_writer:
            # its consumers hand every dQ tile to the writer warp (`write_dq_tile`)
            raise ValueError("keys_n needs dq_writer")
        if self.tile_m != (128 if self.dq_rows else 64):
            # the M of the dQ GEMM: one m64 WGMMA per warpgroup, over 64 of 128 rows with `dq_rows`
            raise ValueError(f"tile_m must be 64, or 128 with dq_rows; got {self.tile_m}")
        if self.dv_after_ds and self.overlap_dv:
            raise ValueError("dv_after_ds and overlap_dv exclude each other")
        if self.dq_rows and self.dq_split:
            raise ValueError("dq_rows and dq_split exclude each other")
        if self.dk_behind_dq and self.dk_after_dq:
            raise ValueError("dk_behind_dq and dk_after_dq exclude each other")
        if self.ds_kmajor and self.dkv_split:
            # dV and dK read P^T and dS^T from that tile there, as (keys, queries) K-major
            raise ValueError("ds_kmajor excludes dkv_split (and keys_n), whose dK and dV read dS^T from shared memory")
        if self.dq_own_first and (not (self.dq_split or self.dq_rows) or self.dkv_split):
            # the halves are the two warpgroups' 64 keys each
            raise ValueError("dq_own_first needs dq_split or dq_rows with 64 keys per warpgroup (not dkv_split)")
        if self.dq_fence_late and not self.dq_writer:
            raise ValueError("dq_fence_late needs dq_writer")
        if self.dq_flat and (not self.dq_writer or self.varlen_q or self.dq_swap):
            raise ValueError("dq_flat needs dq_writer and takes no varlen_q or dq_swap")
        if self.dq_convert and (not self.dq_flat or self.deterministic):
            raise ValueError("dq_convert needs dq_flat and excludes deterministic")
        if self.dq_stages not in (1, 2) or (self.dq_stages == 2 and not self.dq_writer):
            raise ValueError(f"dq_stages must be 1, or 2 with dq_writer; got {self.dq_stages}")
        if self.cluster_q and not self.pairs_key_blocks:
            raise ValueError("cluster_q pairs key blocks that walk the same query blocks: it takes no mask, varlen, "
                             "seqused_k, column-split tile (dkv_split) or timeline")
        if self.deterministic and (not self.dq_writer or self.cluster_q or self.rotate_queries):
            # a CTA waits for the previous key block's turn, which must not wait for it in turn
            raise ValueError("deterministic needs dq_writer and excludes cluster_q and rotate_queries")
        if self.shortest_first and not self.lpt:
            # the turns go from the last key block down: those CTAs must be launched first
            raise ValueError("deterministic with a causal mask or a window needs lpt (shortest_first)")
        if self.lpt and self.cluster_q:
            # a cluster is two neighbouring CTAs of the grid, which this order gives to two heads
            raise ValueError("lpt excludes cluster_q")
        if self.timeline and self.dq_rows:
            # its counters spill registers there (11 B) and serialize the WGMMAs: nothing to measure
            raise ValueError("timeline: the 128-row tile (dq_rows) has no registers to spare for the counters")
        if self.dq_swap and self.dq_cols % 32:
            raise ValueError(f"dq_swap swaps the 16-column halves of 32-column (128-byte) swizzle atoms; "
                             f"got {self.dq_cols} columns")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.name} needs {self.smem_bytes} bytes of shared memory (> {SMEM_LIMIT})")

    @property
    def shortest_first(self) -> bool:
        """`deterministic` calls with a causal mask or a window: the grid launches each section's
        key blocks from the last (the fewest query blocks) down, and a query block's turns go from
        its last key block down (see `bwd.py`)."""
        return self.deterministic and (self.causal or self.local)

    @property
    def pairs_key_blocks(self) -> bool:
        """Whether two CTAs on neighbouring key blocks walk the same query blocks and the kernel
        can share them (`cluster_q`): no mask, varlen or seqused_k, and not the column-split tile
        or the profiling build."""
        return not (self.causal or self.local or self.varlen_q or self.varlen_k or self.seqused_k or self.dkv_split
                    or self.single_dout or self.timeline)

    @property
    def stat_box(self) -> int:
        """LSE / D rows per TMA box: `tile_m`, and `STAT_ALIGN` more where a box may start up to
        `STAT_ALIGN - 1` rows early (varlen)."""
        return self.tile_m + (STAT_ALIGN if self.varlen_q else 0)

    @property
    def stat_stage_stride(self) -> int:
        """Floats between two stages of the LSE / D buffers: TMA writes shared memory at
        128-byte-aligned addresses."""
        return align_up(self.stat_box, 32)

    @property
    def dq_cols(self) -> int:
        """Columns of the dQ tile one warpgroup computes and reduce-adds."""
        return self.head_dim // NUM_CONSUMER_WGS if self.dq_split else self.head_dim

    @property
    def dq_chunks(self) -> int:
        """`dq_flat`: flat dQ tiles per query block."""
        return dq_chunks(self.dq_split, self.dq_rows)

    @property
    def dq_rows_per_wg(self) -> int:
        """Rows of the dQ tile one warpgroup computes and reduce-adds."""
        return self.tile_m // NUM_CONSUMER_WGS if self.dq_rows else self.tile_m

    @property
    def ds_stages(self) -> int:
        """dS^T buffers: two when both warpgroups read the whole tile (`dq_split`, `dq_rows`),
        but one with `single_dout`."""
        return 2 if (self.dq_split or self.dq_rows) and not self.single_dout else 1

    @property
    def dout_stages(self) -> int:
        """Stages of dO and D: `num_stages`, or one with `single_dout`."""
        return 1 if self.single_dout else self.num_stages

    @property
    def p_stages(self) -> int:
        """P^T buffers in shared memory (`dkv_split`): one per dS^T buffer, so that a warpgroup
        a step ahead (with two (Q, dO) stages) never overwrites the P^T the other still reads;
        one with one stage, where no warpgroup gets a step ahead."""
        if not self.dkv_split:
            return 0
        if self.keys_n:  # a warpgroup reads only its own P, and waits for that before the next step
            return 1
        return self.ds_stages if self.num_stages > 1 else 1

    @property
    def smem_bytes(self) -> int:
        """Shared memory of a CTA: the kernel's `SharedStorage` field by field with their
        alignments, and the static shared memory (the compile tests check both)."""
        k_v = self.tile_n * (self.head_dim + self.head_dim_v)
        q_do = self.tile_m * (self.num_stages * self.head_dim + self.dout_stages * self.head_dim_v)
        ds = self.ds_stages * self.tile_n * self.tile_m
        ds += self.p_stages * self.tile_n * self.tile_m  # P^T (`dkv_split`)
        stat = 4 * (self.stat_stage_stride * (self.num_stages - 1) + self.stat_box)  # LSE, and D
        stat_d = 4 * (self.stat_stage_stride * (self.dout_stages - 1) + self.stat_box)
        dq = 4 * NUM_CONSUMER_WGS * self.dq_stages * self.dq_rows_per_wg * self.dq_cols  # fp32 dQ tiles
        size = 1024 + 2 * (k_v + q_do + ds)  # the mbarriers, padded to the 1024-aligned tiles
        if self.keys_n:
            # the LSE rows in that padding, D after the dQ tiles (`FlashBwdSm90.shared_storage`)
            assert 8 * (2 + 2 * self.num_stages + 2 * self.single_dout) <= 128 and 128 + stat <= 1024
            # (a struct's size is a multiple of its widest alignment, the tiles' 1024 bytes)
            return align_up(align_up(size, 1024) + dq + stat_d, 1024) + SM90_STATIC_SMEM_BYTES
        size = align_up(align_up(size, 128) + stat, 128) + stat
        return align_up(size, 1024) + dq + SM90_STATIC_SMEM_BYTES

    @property
    def name(self) -> str:
        flags = [f for f in ("causal", "local", "softcap", "varlen_q", "varlen_k", "seqused_k", "dq_split",
                             "dq_writer", "overlap_dv", "dk_after_dq", "stats_early", "dq_fence_late",
                             "dk_behind_dq", "lpt", "dkv_staged", "dq_rows", "dv_after_ds", "dkv_split",
                             "keys_n", "single_dout", "dq_swap", "dq_flat", "dq_convert", "ds_kmajor", "dq_own_first",
                             "timeline", "cluster_q", "rotate_queries", "deterministic") if getattr(self, f)]
        hd = f"hd{self.head_dim}" + (f"x{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        if self.dq_stages > 1:
            flags.append(f"dq{self.dq_stages}")
        if not self.mask_bits:
            flags.append("cmpmask")
        tile = f"{self.tile_m}x{self.tile_n}s{self.num_stages}"
        return "_".join(["bwd_sm90", self.dtype, hd, tile] + flags)


def with_cluster_q(config: Sm90BwdConfig, num_n_blocks: int) -> Sm90BwdConfig:
    """`config` with `cluster_q` where a call with `num_n_blocks` key blocks per sequence can take
    it: no mask, no varlen or seqused_k, an even number of key blocks (both CTAs of a cluster
    walk the same query blocks of the same heads), on the tiles of head dims 64 and 96.

    On an H200 (`benchmarks/ab_clusters.py --rounds 5`: bf16, 2 x 8192, 2048 / head dim heads, the
    backward's three kernels, medians): head dim 64 503.8 against 489.0 TFLOP/s, 96 456.1 against
    451.0; at 128 level (579.2 against 577.2: the SMs ran 2% faster, 1683 against 1654 MHz, but a
    cluster's CTAs wait for each other's release of a stage), so head dim 128 keeps single CTAs
    (re-measured with the flat dQ accumulator, 2 x 8192 in six runs: -0.3% to +1.4%)."""
    if (num_n_blocks % 2 or not config.pairs_key_blocks or max(config.head_dim, config.head_dim_v) > 96
            or config.deterministic):
        return config
    return _clustered(config)


@functools.lru_cache(maxsize=256)
def _clustered(config: Sm90BwdConfig) -> Sm90BwdConfig:
    """`config` with `cluster_q`, built once per configuration (a backward asks for it twice a call)."""
    return dataclasses.replace(config, cluster_q=True)


def make_config(dtype: str, head_dim: int, head_dim_v: int, **flags) -> Sm90BwdConfig:
    """The configuration for actual head dims (multiples of 8 up to 256) and feature flags. Head
    dims of Q and V may differ where the larger is above 128 (the column-split tile) and the
    smaller pads to 64, 128 or 192 (e.g. 192 with 128, 256 with 64)."""
    hd = pad_headdim(head_dim, TILE_HEADDIMS, UnsupportedHeadDim)
    hdv = pad_headdim(head_dim_v, TILE_HEADDIMS, UnsupportedHeadDim)
    if hd != hdv:
        if max(hd, hdv) <= 128 or min(hd, hdv) not in SPLIT_HEADDIMS:
            raise NotImplementedError(
                f"the sm_90 backward kernel takes unequal head dims of Q and V only where the larger "
                f"is above 128 and the smaller pads to {SPLIT_HEADDIMS[:-1]}; got {head_dim} and {head_dim_v}"
            )
        if hd not in SPLIT_HEADDIMS:
            raise NotImplementedError(f"the sm_90 backward kernel does not take head dim {head_dim} with {head_dim_v}")
    if flags.get("deterministic") and _deterministic_spills(hd, hdv, flags):
        raise NotImplementedError(
            f"deterministic backward with head dims {head_dim} / {head_dim_v}, a causal mask and varlen sequences: "
            f"the sm_90 kernel's tile spills registers there"
        )
    masked = flags.get("causal", False) or flags.get("local", False)
    wide = (hd in WIDE_TILES and hd == hdv and not flags.get("softcap", False) and flags.get("dq_writer", True)
            and not _spills_wide(flags, masked))
    tile = WIDE_TILES[hd] if wide else TILES[max(hd, hdv)]
    flags.setdefault("dq_split", tile.dq_split)
    flags.setdefault("dq_writer", tile.dq_writer)
    flags.setdefault("overlap_dv", tile.overlap_dv and not flags.get("softcap", False))
    flags.setdefault("dk_after_dq", tile.dk_after_dq)
    mode = "masked" if masked else "plain"
    flags.setdefault("stats_early", mode in tile.stats_early)
    flags.setdefault("dq_fence_late", mode in tile.dq_fence_late and flags["dq_writer"])
    flags.setdefault("dk_behind_dq", tile.dk_behind_dq and not flags["dk_after_dq"])
    flags.setdefault("dq_stages", tile.dq_stages if flags["dq_writer"] else 1)
    flags.setdefault("dq_rows", tile.dq_rows)
    flags.setdefault("dv_after_ds", tile.dv_after_ds)
    flags.setdefault("dkv_split", tile.dkv_split)
    flags.setdefault("ds_kmajor", tile.ds_kmajor and not flags["dkv_split"])
    flags.setdefault("dq_own_first", tile.dq_own_first and flags["dq_split"] and not flags["dkv_split"])
    keys_n_asked = "keys_n" in flags
    # Q's head dim 192, V's up to 192, with the dQ writer warp
    flags.setdefault("keys_n", tile.keys_n and hd == 192 and flags["dq_writer"])
    flags.setdefault("lpt", flags.get("causal", False) or flags.get("deterministic", False))
    # Q's head dim sets the width of the dQ tiles whose reduce-adds the rotation spreads out
    flags.setdefault("rotate_queries", not masked and hd >= ROTATE_FROM_HEADDIM and not flags.get("deterministic"))
    flags.setdefault("dkv_staged", True)
    swap_asked = "dq_swap" in flags
    fields = dict(dtype=dtype, head_dim=hd, head_dim_v=hdv, tile_m=tile.tile_m, num_stages=tile.num_stages, **flags)
    if fields["keys_n"] and not keys_n_asked and _unchecked(fields).smem_bytes > SMEM_LIMIT:
        # 96 keys need two Q stages: with one (Q, dO) stage the backward measured 1.3x slower
        # than the 64-key tile (192 / 192 on an H200). With V's head dim 192 two fit where dO
        # takes one (`single_dout`).
        fields.setdefault("single_dout", True)
        if _unchecked(fields).smem_bytes > SMEM_LIMIT:
            fields["keys_n"] = fields["single_dout"] = False
    # the flat dQ store where the writer warp issues the reduce-adds of a fixed-length call, unless
    # the row-major tile's swap is asked for
    flat = fields.setdefault("dq_flat", fields["dq_writer"] and not fields.get("varlen_q", False)
                             and not fields.get("dq_swap", False))
    fields.setdefault("dq_convert", False)
    if not swap_asked:
        # not where it measured slower, on rotated walks and on the 96-key tile without a mask
        # (`dq_swap`); its pairs of 16-column halves need 32-column dQ tiles: not head dim 96's 48
        # (`dq_split`)
        fields["dq_swap"] = ((masked or not (fields["rotate_queries"] or fields["keys_n"]))
                             and _unchecked(fields).dq_cols % 32 == 0 and not flat)
    if flags["dkv_split"] and _unchecked(fields).smem_bytes > SMEM_LIMIT:
        # head dim 192: a varlen call's longer LSE / D boxes take two stages 1 KB past the limit
        fields["num_stages"] = 1
    return Sm90BwdConfig(**fields)


def _deterministic_spills(hd: int, hdv: int, flags: dict) -> bool:
    """The deterministic calls whose sm_90 tile spills (8/12 B for sm_90a, with or without
    softcap): Q's head dim 128 with V's 192, causal, varlen. The backend runs them on the sm_80
    kernels (`sm90_configs` refuses them)."""
    return (hd, hdv) == (128, 192) and flags.get("causal", False) and flags.get("varlen_q", False)


def _spills_wide(flags: dict, masked: bool) -> bool:
    """The calls the 128-row tile spills for (4/8 B for sm_90a, both dtypes, whether dK / dV are
    staged or not, with or without the late dQ fence): varlen queries and keys without a mask.
    Varlen queries or keys alone, seqused_k alone, or a causal or window mask compile clean on
    it; these calls take the 64-row tile, which compiles clean for them."""
    return flags.get("varlen_q", False) and flags.get("varlen_k", False) and not masked


def _unchecked(fields: dict) -> Sm90BwdConfig:
    """A configuration of these fields without `__post_init__`'s checks, to size it."""
    config = object.__new__(Sm90BwdConfig)
    for f in dataclasses.fields(Sm90BwdConfig):
        object.__setattr__(config, f.name, fields.get(f.name, f.default))
    return config


def shipped_configs() -> list:
    """Every tile of the table in fp16 (no mask) and bf16 (causal), and each feature variant at
    head dim 128, whose registers are the tightest.

    Feature flags change code paths but not the tile, so one head dim per variant shows that the
    path compiles without spills.
    """
    configs = [make_config(dtype, d, d, causal=causal)
               for d in TILE_HEADDIMS for dtype, causal in (("float16", False), ("bfloat16", True))]
    configs += [
        make_config("bfloat16", 128, 128, local=True, softcap=True),
        make_config("bfloat16", 128, 128, causal=True, softcap=True),
        # the column-split tile (`dkv_split`) with every mask and sequence feature (at 192 with one
        # stage, as varlen calls take it)
        make_config("bfloat16", 256, 256, local=True, softcap=True, varlen_q=True, varlen_k=True, seqused_k=True),
        make_config("bfloat16", 192, 192, local=True, softcap=True, varlen_q=True, varlen_k=True, seqused_k=True),
        make_config("bfloat16", 192, 128, causal=True),  # unequal head dims (e.g. MLA's 192 / 128)
        # the 96-key tile (`keys_n`) with the mask and sequence features it takes
        make_config("float16", 192, 128, local=True, softcap=True, seqused_k=True),
        make_config("bfloat16", 128, 128, causal=True, varlen_q=True, varlen_k=True, seqused_k=True),
        make_config("bfloat16", 128, 128, local=True, varlen_q=True, varlen_k=True),
        make_config("float16", 64, 64, local=True, softcap=True, seqused_k=True),
        # the dQ paths without the writer warp / the column split, for A/B
        make_config("bfloat16", 128, 128, causal=True, dq_writer=False),
        make_config("bfloat16", 128, 128, causal=True, dq_split=False, dq_writer=False),
        make_config("bfloat16", 64, 64, causal=True, dq_writer=False),  # the 64-row tile
        make_config("bfloat16", 128, 128, causal=True, overlap_dv=False),
        make_config("float16", 64, 64, local=True, varlen_q=True, varlen_k=True, seqused_k=True),
        make_config("bfloat16", 128, 128, stats_early=False),
        # the causal schedule before `stats_early` replaced `dq_fence_late` there
        make_config("bfloat16", 128, 128, causal=True, stats_early=False, dq_fence_late=True),
    ]
    # ordered dQ reduce-adds (`deterministic`) on each kind of tile
    configs += [make_config("bfloat16", 128, 128, causal=True, deterministic=True),
                make_config("float16", 64, 64, deterministic=True),
                make_config("bfloat16", 192, 192, local=True, varlen_q=True, varlen_k=True, deterministic=True),
                make_config("bfloat16", 256, 256, deterministic=True)]
    # the Q/dO-sharing clusters of unmasked calls with an even number of key blocks
    configs += [dataclasses.replace(make_config(dtype, d, d), cluster_q=True) for d in (64, 96) for dtype in DTYPES]
    configs += [dataclasses.replace(make_config("bfloat16", 64, 64, softcap=True), cluster_q=True)]
    # the row-major dQ tile of fixed-length calls before `dq_flat`, for A/B
    configs += [make_config("bfloat16", d, d, dq_flat=False) for d in (64, 128, 192)]
    # the postprocess inside the main kernel (`dq_convert`), for A/B, on every tile, masked or not
    configs += [make_config("bfloat16", d, d, dq_convert=True, **mask) for d in TILE_HEADDIMS
                for mask in ({}, {"causal": True})]
    configs += [make_config("bfloat16", 128, 128, local=True, softcap=True, seqused_k=True, dq_convert=True)]
    # the masked path by a comparison per pair instead of bit masks, for A/B (at head dim 128,
    # whose registers are the tightest)
    configs += [make_config("bfloat16", 128, 128, causal=True, mask_bits=False)]
    # the dQ GEMMs' options off where they ship, for A/B: at head dim 128 `ds_kmajor` off,
    # `dq_own_first` off and both off (the kernel before them), at 96 both off
    off = ({"ds_kmajor": False}, {"dq_own_first": False}, {"ds_kmajor": False, "dq_own_first": False})
    configs += [make_config("bfloat16", 128, 128, **flags, **mask) for mask in ({}, {"causal": True}) for flags in off]
    configs += [make_config("bfloat16", 96, 96, causal=True, ds_kmajor=False, dq_own_first=False)]
    # and on where they do not (head dim 64): `dq_own_first` on the 128-row tile, alone and with
    # `ds_kmajor`, and both on the soft-capped 64-row tile
    configs += [make_config("bfloat16", 64, 64, dq_own_first=True),
                make_config("bfloat16", 64, 64, causal=True, dq_own_first=True, ds_kmajor=True),
                make_config("float16", 64, 64, local=True, softcap=True, seqused_k=True, ds_kmajor=True,
                            dq_own_first=True)]
    return configs


def shipped_post_configs(mains=None) -> list:
    """The flat-dQ postprocess of every `dq_flat` configuration of `mains` (default:
    `shipped_configs()`), and one for a padded head dim."""
    from cute_flash.audit import distinct

    flat = [c for c in (shipped_configs() if mains is None else mains) if c.dq_flat]
    return distinct([make_post_config(c, c.head_dim) for c in flat] + [make_post_config(flat[0], flat[0].head_dim - 8)])


# ------------------------------------------------------------------------------------------------
# compiling a configuration (no GPU needed: fake tensors with symbolic sizes and 64-bit strides)
# ------------------------------------------------------------------------------------------------
def fake_arguments(config: Sm90BwdConfig) -> tuple:
    """Arguments of `FlashBwdSm90.__call__` (less the stream) for `cute.compile`: every size
    symbolic, every stride but the last a 64-bit multiple of 16 bytes (TMA's rule; the host pads
    the row statistics so that theirs are)."""
    import cutlass

    from ..common.fake_tensors import element_type, fake_sequence_vectors, fake_tensor, fake_tokens

    dtype = element_type(config.dtype)
    rows = 2 if config.varlen_q else 3  # LSE / D: (batch, heads, seqlen) or (heads, total)
    return (
        fake_tokens(dtype, config.varlen_q, 8),  # q
        fake_tokens(dtype, config.varlen_k, 8),  # k
        fake_tokens(dtype, config.varlen_k, 8),  # v
        fake_tokens(dtype, config.varlen_q, 8),  # dout
        fake_tensor(cutlass.Float32, rows, 4, 16),  # lse_log2
        fake_tensor(cutlass.Float32, rows, 4, 16),  # delta
        fake_tokens(cutlass.Float32, config.varlen_q, 4),  # dq_accum
        fake_tokens(dtype, config.varlen_k, 8),  # dk
        fake_tokens(dtype, config.varlen_k, 8),  # dv
        *fake_sequence_vectors(config),
        fake_tensor(cutlass.Int32, 3) if config.deterministic or config.dq_convert else None,  # dq_semaphore / count
        fake_tokens(dtype, False, 8) if config.dq_convert else None,  # dq
        cutlass.Int32(1),  # num_batch
        cutlass.Int32(1),  # max_seqlen_k
        cutlass.Int32(2),  # num_convert_ctas
        cutlass.Float32(1.0),  # softmax_scale
        cutlass.Float32(1.0),  # softmax_scale_log2
        cutlass.Float32(1.0),  # softcap_prescale
        cutlass.Int32(-1),  # window_left
        cutlass.Int32(-1),  # window_right
    )


def dq_chunks(dq_split: bool, dq_rows: bool) -> int:
    """Flat dQ tiles per query block (`dq_flat`): one per warpgroup where they hold different
    columns (`dq_split`) or rows (`dq_rows`); one that both add into where each holds a partial
    sum of the whole tile."""
    return NUM_CONSUMER_WGS if dq_split or dq_rows else 1


@dataclass(frozen=True)
class Sm90BwdPostConfig:
    """The postprocess of a `dq_flat` main kernel (`bwd_post.py`): its dQ tiling, for putting the
    flat accumulator back in row order."""

    dtype: str
    head_dim: int  # the main kernel's padded head dim of Q
    check_hdim: bool
    tile_m: int
    dq_cols: int
    dq_rows_per_wg: int
    dq_split: bool
    dq_rows: bool

    @property
    def dq_chunks(self) -> int:
        return dq_chunks(self.dq_split, self.dq_rows)

    @property
    def varlen_q(self) -> bool:
        """Fixed-length calls only: a varlen one keeps the row-major accumulator."""
        return False

    @property
    def name(self) -> str:
        tiling = "split" if self.dq_split else "rows" if self.dq_rows else "whole"
        flags = ["padded"] if self.check_hdim else []
        return "_".join(["bwdpost_sm90", self.dtype, f"hd{self.head_dim}", f"{self.tile_m}x{self.dq_cols}", tiling]
                        + flags)


def make_post_config(main: Sm90BwdConfig, head_dim: Optional[int]) -> Sm90BwdPostConfig:
    """The postprocess of a `dq_flat` main configuration, for Q's actual head dim (None: any, checked
    at run time; `dq_convert`'s conversion CTAs)."""
    return Sm90BwdPostConfig(main.dtype, main.head_dim, head_dim != main.head_dim, main.tile_m, main.dq_cols,
                             main.dq_rows_per_wg, main.dq_split, main.dq_rows)


def compile_kernel(config, options: str = "--gpu-arch sm_90a"):
    """cute.compile the main backward kernel of an `Sm90BwdConfig`, or the flat-dQ postprocess of
    an `Sm90BwdPostConfig`, with extra compiler `options`."""
    import cutlass
    import cutlass.cute as cute

    from ..common.fake_tensors import element_type, fake_stream, fake_tensor

    if isinstance(config, Sm90BwdPostConfig):
        from .bwd_post import FlashBwdPostSm90

        args = (fake_tensor(cutlass.Float32, 4, 4, 16), fake_tensor(element_type(config.dtype), 4, 8, 16),
                cutlass.Int32(1), cutlass.Float32(1.0))
        return cute.compile(FlashBwdPostSm90(config), *args, fake_stream(options), options=options)
    from .bwd import FlashBwdSm90

    return cute.compile(FlashBwdSm90(config), *fake_arguments(config), fake_stream(options), options=options)


# `KernelCache` builds kernels through `<config module>.compile_fwd`; for this module that is the
# backward kernel.
compile_fwd = compile_kernel


def sweep_configs() -> list:
    """The configurations `make_config` gives over a grid of calls: every tile head dim and the
    unequal pairs the column-split tile takes, no mask / causal / window, softcap or not, fixed
    or varlen (with seqused_k) sequences, deterministic or not, in bf16; the equal head dims in
    fp16 too, without the sequence variants. `python -m cute_flash.audit --sweep` compiles them."""
    import itertools

    from cute_flash.audit import distinct

    pairs = [(d, d) for d in TILE_HEADDIMS] + [(192, 128), (256, 128), (128, 256), (256, 64), (64, 256),
                                                (128, 192), (256, 192), (192, 256), (192, 64)]
    masks = ({}, {"causal": True}, {"local": True})
    seqs = ({}, {"varlen_q": True, "varlen_k": True, "seqused_k": True})
    bf16 = (make_config("bfloat16", d, dv, softcap=softcap, deterministic=det, **mask, **seq)
            for (d, dv), mask, softcap, seq, det in itertools.product(pairs, masks, (False, True), seqs, (False, True))
            if not (det and _deterministic_spills(d, dv, {**mask, **seq})))
    fp16 = (make_config("float16", d, d, softcap=softcap, **mask)
            for d, mask, softcap in itertools.product(TILE_HEADDIMS, masks, (False, True)))
    configs = list(itertools.chain(bf16, fp16))
    # and those calls with an even number of key blocks (`with_cluster_q`)
    return distinct(configs + [with_cluster_q(c, 2) for c in configs])


def sweep_targets(arch: str) -> list:
    """One audit target per `sweep_configs` entry; sm_90a only."""
    from cute_flash.audit import targets

    return targets(arch, sweep_configs(), compile_kernel) if arch == "sm_90a" else []


def audit_targets(arch: str) -> list:
    """One audit target per shipped configuration and flat-dQ postprocess (see `cute_flash.audit`);
    sm_90a only."""
    from cute_flash.audit import targets

    if arch != "sm_90a":
        return []
    mains = shipped_configs()
    return targets(arch, mains + shipped_post_configs(mains), compile_kernel)
