"""Compile-time configuration of the sm_80 forward kernel: the key of the compile cache.

`Sm80FwdConfig` holds every choice that changes the generated code; everything else (sequence
lengths, batch, heads, strides, the actual head dim inside a padded tile, scale, window sizes)
is a run-time argument, so one compiled kernel serves every shape of its configuration.

The tile table (per padded head dim) was chosen so that every entry compiles with zero register
spills for sm_80 and sm_90a and fits the 99 KB of shared memory of sm_86/sm_89 parts (A100:
163 KB), and, among those, by speed on an H200. A warp owns 32 query rows with 4 warps per 128
rows and 16 with 8 warps (or 4 warps per 64 rows). 32 rows per warp reads K and V from shared
memory half as often per MMA, which is what makes the small head dims fast, but 32 rows x 96+
columns of fp32 output accumulators leave too few registers for the score tile and the operand
fragments (hd128 at 128x64 with 4 warps spills), so the large head dims use 16 rows per warp
(hd96 and hd192 with a wider key tile and one K/V stage: with one stage K and V still have
buffers of their own, so the copy of V overlaps S = Q K^T and the copy of the next K overlaps
P V). hd128 takes 128x128 with 8 warps and one stage, with ptxas told one CTA per SM is enough
(without that hint it spills in fp16 with a causal mask): on an H200 (bf16, 2 x 8192 x 16 heads,
`benchmarks/tune_tiles.py --arch sm_80 --head-dim 128`) 349.2 TFLOP/s against 325.1 for 64x64
with 4 warps and two stages, 323.9 for 128x64 with 8 warps and 300.0 for 64x128 with 4 warps.
Without a mask hd96 and hd128 take 32 rows per warp after all, with the lazy rescale
(UNMASKED_TILES), and hd128's causal calls take that tile too, with the lazy rescale and the keep
vote (CAUSAL_TILES, KEEP_VOTE_HEADDIMS). hd128's unmasked calls with enough query rows take 256 rows
with 8 warps in two groups that take turns (PINGPONG_TILES, `pingpong`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

from ..common.tiles import check_attention_config, check_row_copy_passes, pad_headdim

# Head dims with a tile of their own; any other multiple of 8 runs in the next one up, its
# padding columns zero-filled on load and never stored.
TILE_HEADDIMS = (32, 64, 96, 128, 192, 256)
DTYPES = ("float16", "bfloat16")


class Tile(NamedTuple):
    tile_m: int
    tile_n: int
    num_warps: int
    num_stages: int  # depth of the K and V rings in shared memory
    # ptxas hint (.minnctapersm): 1 tells it one CTA per SM is enough, so it never trades
    # spills for occupancy; 0 leaves it free (its own choice spills less where 1 makes it
    # schedule more aggressively). Set per tile by what compiles without spills.
    min_ctas_per_sm: int = 0


# keyed by the padded max(head_dim, head_dim_v)
TILES = {
    32: Tile(128, 64, 4, 2),
    64: Tile(128, 64, 4, 2),
    96: Tile(128, 128, 8, 1),
    128: Tile(128, 128, 8, 1, min_ctas_per_sm=1),
    192: Tile(128, 64, 8, 1),
    256: Tile(64, 64, 4, 1),
}
# Calls without a causal mask or window (long queries): hd128 takes 32 rows per warp with 32 keys
# per block, which fits the registers without spills (64 keys spill: 68/52 B for sm_80 and
# 112/96 for sm_90a) and, with the lazy rescale (`UNMASKED_LAZY_HEADDIMS`), skips most of the
# rescales of its 128 output accumulators per thread that a 32-key block would otherwise pay. On an
# H200 (bf16, `benchmarks/tune_tiles.py --arch sm_80`, 2 x 8192 x 16 heads) 366.9-376.2 TFLOP/s
# over four runs against 352.9 for 128x128 with 8 warps in the first (349.1 there for 128x32
# without the lazy rescale; 8 x 2048: 352.4 against 331.3). With a causal mask it measured slower
# (321.4 against 334.2) until the keep vote (CAUSAL_TILES below); windowed calls keep TILES. hd96
# fits 64 keys per block with the lazy rescale (eager, that tile spilled 20/16 B): 374.4 TFLOP/s
# against 322.9 for its 8-warp 128x128
# (8 x 2048: 365.5 against 302.7; SDPA's FlashAttention-2 353.9 and 331.7).
UNMASKED_TILES = {**TILES, 96: Tile(128, 64, 4, 2), 128: Tile(128, 32, 4, 2, min_ctas_per_sm=1)}
# Unmasked prefill calls (not paged, not split-KV) at these head dims take a 256-row tile whose two
# groups of 4 warps take turns (`Sm80FwdConfig.pingpong`), unless their 256-row query tiles are
# too few to give every SM one (`few_query_tiles`: they keep UNMASKED_TILES, twice the CTAs). On an
# H200 (bf16, `benchmarks/tune_tiles.py --arch sm_80 --head-dim 128 --rounds 5`, medians) hd128
# 256x32 with the turns 408.4 TFLOP/s at 2 x 8192 x 16 heads against 387.1 for the 128x32 tile
# and 317.4 for 256x32 without the turns (SDPA's FlashAttention-2 347.7); 8 x 2048 381.5 against
# 372.4 (334.3).
PINGPONG_TILES = {128: Tile(256, 32, 8, 2, min_ctas_per_sm=1)}
# Head dims whose unmasked calls take the lazy rescale (`Sm80FwdConfig.lazy_rescale`): on an H200
# (as above) hd64 354.1 against 335.1 TFLOP/s; with a causal mask it gained nothing (hd64 299.0
# against 298.3; hd128 on 128x32 above), so masked calls stay eager, but for hd128's causal calls
# with the keep vote (CAUSAL_VOTE_HEADDIMS). hd256 measured 330.0 against
# 323.3 with it (one run each), and its varlen split-KV variants spill with it (12/8 B, bf16,
# sm_90a): not taken.
UNMASKED_LAZY_HEADDIMS = (64, 96, 128)
# Head dims whose prefill calls (without a mask, or causal) take the keep vote
# (`Sm80FwdConfig.keep_vote`) with the lazy rescale: hd128's 128x32 loop on the path that keeps
# every reference is 421 SASS instructions a trip against 595 (bf16, no mask: the lazy rescale's
# skip of O's 128 FMULs was predicated, not branched over, so every trip issued them). On an H200
# (bf16, `benchmarks/tune_tiles.py --arch sm_80 --rounds 7`, medians, TFLOP/s) 2 x 8192 x 16 heads
# 378.9 against 369.6, 8 x 2048 375.6 against 356.1 (SDPA's FlashAttention-2 347.8 and 336.5).
# hd64 measured slower with it (2 x 8192 x 32 heads 336.2 against 351.2) and level causal (317.1
# against 313.3); hd96's 128x64 spills with it.
KEEP_VOTE_HEADDIMS = (128,)
# Causal calls (not a window) at head dims where the 32-rows-per-warp tile with the keep vote
# beats TILES: hd128 128x32 with 4 warps, 354.0 TFLOP/s against 334.6 for 128x128 with 8 warps
# (eager), 320.3 for the 128x128 with the lazy rescale and 297.4 with the vote too (2 x 8192 x 16
# heads, as above; FlashAttention-2 313.9); 128x64 with 8 warps 256.9 and 128x32 with one K/V
# stage 352.8 against 351.0 in a second run
CAUSAL_TILES = {**TILES, 128: UNMASKED_TILES[128]}
CAUSAL_VOTE_HEADDIMS = (128,)
# Calls whose queries per (sequence, head) fit in 64 rows (decode, packed GQA decode): most rows
# of a 128-row tile would be empty, and the kernel streams keys; hd128 keeps the smaller tile
# with two K/V stages there (measured on an H200 as packed-GQA decode at 3.85-4.40 TB/s with
# batch 16-128; the other head dims use one tile for every call).
SHORT_QUERY_TILES = {**TILES, 128: Tile(64, 64, 4, 2, min_ctas_per_sm=1)}
SHORT_QUERY_ROWS = 64
# hd256 with a mask and split-KV, softcap over a paged cache, (fp16) softcap with a window, or
# softcap with split-KV (bf16, 8/8 B for sm_80 and, with varlen queries, 12/8 for both archs)
# spilled on the 64x64 tile (up to 40/32 B for sm_80, 32/24 for sm_90a; the window's 12/12 for
# sm_90a: `python -m cute_flash.audit --sweep`); 32 keys per block (two stages, 96 KB) compile
# without spills there
NARROW_TILES = {256: Tile(64, 32, 4, 2)}


@dataclass(frozen=True)
class Sm80FwdConfig:
    dtype: str  # "float16" | "bfloat16"
    head_dim: int  # padded tile head dim of Q and K
    head_dim_v: int  # padded tile head dim of V and O
    tile_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    check_hdim: bool = False  # the actual head dim is below the tile's: predicate columns
    check_hdim_v: bool = False
    causal: bool = False
    local: bool = False  # sliding window (causal is not local)
    softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_k: bool = False
    paged_kv: bool = False  # k/v are (num_pages, page_size, hk, d) and rows are gathered per page
    page_size_pow2: bool = False  # with paged_kv: page_size is a power of two (shift and mask, no division)
    pages_hold_tiles: bool = False  # with paged_kv: page_size is a multiple of tile_n (one lookup per tile)
    split_kv: bool = False  # each split of the keys writes float32 partial O and LSE (mO/mLSE unused)
    has_lse: bool = True
    min_ctas_per_sm: int = 0
    # Keep a row's max as the exp reference unless it grows by > LAZY_RESCALE_LOG2, and skip a
    # warp's O rescale when none of its rows changed reference (as the sm_90 kernel does). On in
    # the unmasked prefill calls of UNMASKED_LAZY_HEADDIMS (`make_config`); `tune_tiles.py
    # -lazy` / `-eager` for A/B.
    lazy_rescale: bool = False
    # With the lazy rescale: each warp votes on whether all its rows keep their references and,
    # when they do, skips the quad's max shuffles, the factors and O's rescale (as the sm_90
    # kernel's `keep_vote`; `common/softmax.py`)
    keep_vote: bool = False
    # Two groups of four warps take turns, one running its MMAs while the other runs its softmax
    # (`FlashFwdSm80.attend_pingpong`): 8 warps, two K/V stages, no mask but the key-length tail
    pingpong: bool = False

    def __post_init__(self):
        check_attention_config(self, DTYPES, TILE_HEADDIMS)
        if self.keep_vote and not self.lazy_rescale:
            raise ValueError("keep_vote votes on the lazy rescale's kept references: it needs lazy_rescale")
        if self.paged_kv and self.varlen_k:
            raise ValueError("paged_kv and varlen_k exclude each other (a paged cache has no cu_seqlens_k)")
        for flag in ("page_size_pow2", "pages_hold_tiles"):
            if getattr(self, flag) and not self.paged_kv:
                raise ValueError(f"{flag} needs paged_kv")
        if self.pingpong:
            if self.num_warps != 8 or self.num_stages != 2:
                raise ValueError("pingpong takes turns between two groups of 4 warps over 2 K/V stages: "
                                 f"num_warps 8 and num_stages 2, got {self.num_warps} and {self.num_stages}")
            for flag in ("causal", "local", "paged_kv", "split_kv"):
                if getattr(self, flag):
                    raise NotImplementedError(f"pingpong with {flag}")
        if self.num_stages not in (1, 2):
            raise ValueError(f"num_stages must be 1 or 2; got {self.num_stages}")
        # Q, K and V, O come by 128-bit row copies
        check_row_copy_passes(16, (self.head_dim, self.head_dim_v), 32 * self.num_warps,
                              {"tile_m": self.tile_m, "tile_n": self.tile_n})

    @property
    def smem_bytes(self) -> int:
        q_or_o = self.tile_m * max(self.head_dim, self.head_dim_v)
        kv = self.tile_n * (self.head_dim + self.head_dim_v) * self.num_stages
        return 2 * (q_or_o + kv)

    @property
    def name(self) -> str:
        flags = [f for f in ("causal", "local", "softcap", "varlen_q", "varlen_k", "seqused_k", "paged_kv",
                             "page_size_pow2", "pages_hold_tiles", "split_kv")
                 if getattr(self, f)]
        if self.check_hdim:
            flags.append("padded")
        if self.check_hdim_v:
            flags.append("paddedv")
        if not self.has_lse:
            flags.append("nolse")
        if self.lazy_rescale:
            flags.append("lazy")
        if self.keep_vote:
            flags.append("keepvote")
        if self.pingpong:
            flags.append("pp")
        hd = f"hd{self.head_dim}" + (f"x{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        tile = f"{self.tile_m}x{self.tile_n}w{self.num_warps}s{self.num_stages}"
        return "_".join(["fwd_sm80", self.dtype, hd, tile] + flags)


# The fields that turn the keep vote off (the sm_90 module's has its P·V wait too)
NO_KEEP_VOTE = dict(keep_vote=False)


def make_config(dtype: str, head_dim: int, head_dim_v: int, short_queries: bool = False,
                page_size: Optional[int] = None, few_query_tiles: bool = False, **flags) -> Sm80FwdConfig:
    """The shipped configuration for actual head dims (any multiples of 8 up to 256) and flags.

    `short_queries`: every (sequence, head) has at most SHORT_QUERY_ROWS query rows, as in
    decode (the tile then comes from SHORT_QUERY_TILES). `few_query_tiles`: the call has fewer
    PINGPONG_TILES query tiles than the GPU has SMs (it then keeps UNMASKED_TILES). `page_size`: a paged cache's (sets
    paged_kv and, from it and the tile, page_size_pow2 and pages_hold_tiles). With split_kv the
    kernel writes partial LSEs and the combine the final one, so has_lse is off: one forward
    kernel serves calls with and without return_lse.
    """
    if flags.get("split_kv"):
        flags["has_lse"] = False
    hd, hdv = pad_headdim(head_dim, TILE_HEADDIMS), pad_headdim(head_dim_v, TILE_HEADDIMS)
    key = max(hd, hdv)
    unmasked_prefill = not short_queries and not _masked(flags)
    causal_prefill = not short_queries and flags.get("causal", False) and not flags.get("local", False)
    tiles = (SHORT_QUERY_TILES if short_queries else UNMASKED_TILES if unmasked_prefill
             else CAUSAL_TILES if causal_prefill else TILES)
    tile = tiles[key]
    voting = ((unmasked_prefill and key in KEEP_VOTE_HEADDIMS) or (causal_prefill and key in CAUSAL_VOTE_HEADDIMS))
    flags.setdefault("lazy_rescale", (unmasked_prefill and key in UNMASKED_LAZY_HEADDIMS) or voting)
    flags.setdefault("keep_vote", voting and flags["lazy_rescale"])
    if key in NARROW_TILES and _takes_narrow_tile(flags, page_size):
        tile = NARROW_TILES[key]
    if page_size is not None:
        # one page-table lookup per key block where pages hold whole tiles, except where the
        # tile spills with it (`_looks_up_pages_per_row`)
        per_row = _looks_up_pages_per_row(tile, key, flags)
        flags.update(paged_kv=True, page_size_pow2=page_size & (page_size - 1) == 0,
                     pages_hold_tiles=page_size % tile.tile_n == 0 and not per_row)
    config = Sm80FwdConfig(
        dtype=dtype,
        head_dim=hd,
        head_dim_v=hdv,
        tile_m=tile.tile_m,
        tile_n=tile.tile_n,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        min_ctas_per_sm=tile.min_ctas_per_sm,
        check_hdim=hd != head_dim,
        check_hdim_v=hdv != head_dim_v,
        **flags,
    )
    if unmasked_prefill and not few_query_tiles:
        return with_pingpong(config)
    return config


def _on_tile(config: Sm80FwdConfig, tile: Tile, **fields) -> Sm80FwdConfig:
    return replace(config, tile_m=tile.tile_m, tile_n=tile.tile_n, num_warps=tile.num_warps,
                   num_stages=tile.num_stages, min_ctas_per_sm=tile.min_ctas_per_sm, **fields)


def with_pingpong(config: Sm80FwdConfig) -> Sm80FwdConfig:
    """An unmasked prefill configuration on UNMASKED_TILES moved to its head dim's PINGPONG_TILES
    tile with the turns; any other configuration (paged, split-KV, another tile, or a narrow V
    whose 256-thread row copies would overrun the 32-key tile) unchanged."""
    key = max(config.head_dim, config.head_dim_v)
    if (key not in PINGPONG_TILES or config.pingpong or _masked(vars(config)) or config.paged_kv
            or config.split_kv or config.tile_m != UNMASKED_TILES[key].tile_m
            or config.tile_n != UNMASKED_TILES[key].tile_n or config.num_warps != UNMASKED_TILES[key].num_warps):
        return config
    try:
        return _on_tile(config, PINGPONG_TILES[key], pingpong=True)
    except ValueError:  # check_row_copy_passes
        return config


def without_pingpong(config: Sm80FwdConfig) -> Sm80FwdConfig:
    """A ping-pong configuration back on its UNMASKED_TILES tile (what `make_config` gives with
    `few_query_tiles`); any other configuration unchanged."""
    if not config.pingpong:
        return config
    return _on_tile(config, UNMASKED_TILES[max(config.head_dim, config.head_dim_v)], pingpong=False)


def _masked(flags: dict) -> bool:
    return flags.get("causal", False) or flags.get("local", False)


def _takes_narrow_tile(flags: dict, page_size: Optional[int]) -> bool:
    """hd256 calls whose 64x64 tile spilled (`NARROW_TILES`): a mask with split-KV, softcap over a
    paged cache, with a window or with split-KV."""
    softcap, split_kv = flags.get("softcap", False), flags.get("split_kv", False)
    return ((_masked(flags) and split_kv)
            or (softcap and (page_size is not None or flags.get("local", False) or split_kv)))


def _looks_up_pages_per_row(tile: Tile, key: int, flags: dict) -> bool:
    """Whether a paged call looks its pages up per row although its pages hold whole tiles, as
    for smaller pages, because one lookup per tile spilled: the 128x128 tiles (hd128 8/8 B for
    sm_90a; hd96 with seqused_k and split-KV 28/28), hd64's with a mask (causal 136/144 B for
    sm_90a, 84/84 for sm_80; fp16 with a window, seqused_k and split-KV 36/32 for sm_90a), and in
    fp16 hd192 with a mask or with seqused_k and split-KV (8/16 for sm_90a, 8/8 for sm_80) and
    hd256 with a mask (8/8 for sm_80); the sweep's bf16 half compiles either way, and looks up
    per row too."""
    seqused_split = flags.get("seqused_k", False) and flags.get("split_kv", False)
    return ((tile.tile_m, tile.tile_n) == (128, 128) or (key in (64, 256) and _masked(flags))
            or (key == 192 and (_masked(flags) or seqused_split)))


def shipped_configs() -> list:
    """Every tile of the table in both dtypes, causal and not, plus one of each feature variant.

    The feature variants change code paths but not the tile, so one head dim per variant is
    enough to show that the path compiles without spills; the audit covers them all.
    """
    configs = [
        make_config(dtype, d, d, causal=causal)
        for d in TILE_HEADDIMS
        for dtype in DTYPES
        for causal in (False, True)
    ]
    for d in (64, 128, 256):
        base = without_pingpong(make_config("bfloat16", d, d))
        configs += [
            replace(base, local=True),
            replace(base, softcap=True, causal=True),
            replace(base, varlen_q=True, varlen_k=True, seqused_k=True, causal=True),
            replace(base, check_hdim=True, check_hdim_v=True),
        ]
    # the ping-pong tile with each unmasked feature, and the tile its calls keep when their query
    # tiles are few
    for d in PINGPONG_TILES:
        base = make_config("bfloat16", d, d)
        configs += [
            replace(base, softcap=True),
            replace(base, varlen_q=True, varlen_k=True, seqused_k=True),
            replace(base, check_hdim=True, check_hdim_v=True),
            make_config("float16", d, d, few_query_tiles=True),
        ]
    configs += [make_config("bfloat16", 192, 128, causal=True), make_config("float16", 128, 64),
                make_config("bfloat16", 64, 128)]
    # inference: the paged split-KV decode kernel per large head dim, paged alone (the table's
    # full capacity as the key length), and split-KV over packed keys; pages of 64 tokens (one
    # tile each) for decode, of 16 (4 per tile, looked up per row) for the prefill tile, of 24
    # (per row, with a division) for the last one
    for d in (64, 128, 256):
        configs.append(make_config("bfloat16", d, d, short_queries=True, page_size=64, seqused_k=True,
                                   split_kv=True))
    configs += [
        make_config("bfloat16", 128, 128, short_queries=True),
        make_config("float16", 128, 128, short_queries=True, causal=True, seqused_k=True),
        make_config("float16", 128, 128, page_size=16, causal=True),
        # prefill tiles over pages that hold whole tiles (looked up per row; see make_config)
        make_config("bfloat16", 64, 64, page_size=256, causal=True, softcap=True),
        make_config("bfloat16", 128, 128, page_size=256, causal=True),
        make_config("bfloat16", 256, 256, short_queries=True, page_size=256, seqused_k=True, split_kv=True,
                    local=True),  # NARROW_TILES
        make_config("bfloat16", 256, 256, softcap=True, varlen_q=True, seqused_k=True, split_kv=True),  # NARROW_TILES
        make_config("bfloat16", 128, 128, split_kv=True, causal=True, varlen_q=True, varlen_k=True, seqused_k=True),
        make_config("float16", 40, 40, page_size=24, varlen_q=True, split_kv=True, local=True),
    ]
    return configs


# ------------------------------------------------------------------------------------------------
# compiling a configuration (no GPU needed: fake tensors with symbolic sizes and 64-bit strides)
# ------------------------------------------------------------------------------------------------
def fake_arguments(config: Sm80FwdConfig) -> tuple:
    """Arguments of `FlashFwdSm80.__call__` (less the stream) for `cute.compile`: the forward's
    common ones, then the paged / split-KV ones."""
    import cutlass

    from ..common.fake_tensors import fake_forward_arguments, fake_tensor

    lse_rank = 2 if config.varlen_q else 3
    page_table = fake_tensor(cutlass.Int32, 2) if config.paged_kv else None
    # split-KV partials: out-shaped and LSE-shaped with a leading split mode; rows of O are
    # whole float32 vectors of 4
    o_partial = fake_tensor(cutlass.Float32, 5 - config.varlen_q, 4, 16) if config.split_kv else None
    lse_partial = fake_tensor(cutlass.Float32, lse_rank + 1) if config.split_kv else None
    return fake_forward_arguments(config) + (page_table, o_partial, lse_partial, cutlass.Int32(1))  # num_splits


def compile_fwd(config: Sm80FwdConfig, options: str = "--gpu-arch sm_80"):
    """cute.compile the kernel of `config` (with extra compiler `options`, e.g. the arch)."""
    import cutlass.cute as cute

    from ..common.fake_tensors import fake_stream

    from .fwd import FlashFwdSm80

    return cute.compile(FlashFwdSm80(config), *fake_arguments(config), fake_stream(options), options=options)


def sweep_configs() -> list:
    """The configurations `make_config` gives over a grid of calls (bf16 and fp16): every head dim,
    long and short queries, contiguous keys or pages of 16 / 256 tokens, no mask / causal /
    window, and plain, softcap, seqused_k with split-KV, or all three (the decode of a soft-capped
    model). `python -m cute_flash.audit --sweep`
    compiles them (`--filter float16` for one dtype): the shipped sample covers each path once,
    this covers their combinations."""
    import itertools

    from cute_flash.audit import distinct

    return distinct(
        make_config(dtype, d, d, short_queries=short, page_size=page, **mask, **extra)
        for dtype, d, short, page, mask, extra in itertools.product(
            DTYPES, TILE_HEADDIMS, (False, True), (None, 16, 256), ({}, {"causal": True}, {"local": True}),
            ({}, {"softcap": True}, {"seqused_k": True, "split_kv": True},
             {"softcap": True, "seqused_k": True, "split_kv": True}),
        )
    )


def sweep_targets(arch: str) -> list:
    """One audit target per `sweep_configs` entry."""
    from cute_flash.audit import targets

    return targets(arch, sweep_configs(), compile_fwd)


def audit_targets(arch: str) -> list:
    """One audit target per shipped configuration (see `cute_flash.audit`)."""
    from cute_flash.audit import targets

    return targets(arch, shipped_configs(), compile_fwd)
