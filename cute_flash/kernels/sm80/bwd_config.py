"""Compile-time configuration of the sm_80 backward kernel: the key of its compile cache.

`Sm80BwdConfig` holds every choice that changes the generated code of `FlashBwdSm80`; sequence
lengths, batch, heads, strides, the actual head dims inside a padded tile, the scale and the
window sizes are run-time arguments.

A CTA keeps dK and dV of `tile_n` keys in fp32 registers for the whole kernel, so each thread
holds tile_n * (d + dv) / threads accumulators; with one warp per 16 keys that is (d + dv) / 2
registers, on top of the score and dP tiles (tile_n * tile_m / threads each) and the dQ tile of
the current query block. That leaves room for 64-row query blocks at head dim 64 only; head dims
96 and 128 take 32-row query blocks (64 rows spill at 128, and at 96 with a window and
soft-capping), their dQ MMA then split 2 x 2 (4 x 2 with 8 warps) over the warps. Head dims 64
and 128 take 128 keys per CTA with 8 warps, which costs no registers per thread over 64 keys
with 4 warps and halves the loads of Q, dO, LSE and D and the dQ additions per key: on an H200
(bf16, 2 x 8192 x 16 heads, forward + backward through `cute_flash.attention`) hd128 went from
194.8 to 216.5 TFLOP/s. Every entry compiles with zero spills for sm_80 and sm_90a with all
feature flags on.

Head dims above 128 (192 and 256; others padded to those) split dK, dV and dQ over the columns
(`col_tiles`): the CTAs of a key block each take `head_dim / col_tiles` columns of dK and dQ and
`head_dim_v / col_tiles` of dV, so each keeps the registers of a head dim of 128 at most, and
each computes S^T and dP^T over all of d and dv (their share of those two products is done
`col_tiles` times). The shared-memory tiles of Q, K, V and dO are built from the swizzle atom of
a column tile's width (`smem_layout_tile(..., atom_cols_of=)`), so a column tile is the tile's
own bytes from an offset, with the same swizzle (at 192: 96-column tiles of 32-column panels).
Head dim 256 takes 100 KB of shared memory (the full K, V, Q and dO tiles), which fits the A100
and the H100 / H200, not the 99 KB of sm_86 / sm_89 parts, whose backward then goes to the
reference backend (`check_smem`); 192 takes 76 KB. Where a CTA may take 172 KB (H100 / H200),
head dim 256 takes 128 keys per CTA with 8 warps instead (`LARGE_SMEM_TILES`).

Q, K, V and dO come into shared memory by 128-bit row copies, one thread per 16-byte chunk of a
swizzle-atom row, so a pass of the CTA's threads covers fewer rows the wider the atom: every
tile must be a whole number of passes (`check_row_copy_passes`), or the copy runs past it into
the next buffer. Pairs of head dims whose columns per CTA have a narrow atom (96 with 128, 192
or 256 with 96) take the tile of `ROW_COPY_FALLBACKS` instead of the table's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

from ..common.fake_tensors import (element_type, fake_int_vector, fake_sequence_vectors, fake_stream, fake_tensor,
                                   fake_tokens)
from ..common.tiles import align_up, check_attention_config, check_row_copy_passes, pad_headdim

TILE_HEADDIMS = (64, 96, 128, 192, 256)
DTYPES = ("float16", "bfloat16")


class BwdTile(NamedTuple):
    tile_m: int  # query rows per inner step
    tile_n: int  # keys per CTA (16 per warp)
    num_warps: int
    dq_warps_m: int  # warps along the query rows of the dQ MMA (the rest split the head dim)
    col_tiles: int = 1  # CTAs per key block, each with its share of the columns of dK, dV and dQ


# keyed by the padded max(head_dim, head_dim_v)
TILES = {
    64: BwdTile(64, 128, 8, 4),
    96: BwdTile(32, 64, 4, 2),
    128: BwdTile(32, 128, 8, 2),
    192: BwdTile(32, 64, 4, 2, col_tiles=2),
    256: BwdTile(32, 64, 4, 2, col_tiles=2),
}
# Head dims whose row copies do not cover the table's tile in whole passes take the tile of
# their column-tile count here: up to 128 (96 with 128: a 96-column row copies 32 columns per
# thread row, 64 rows per pass of 256 threads, more than the 32 rows of a query block) the 4-warp
# tile of head dim 96; above (192 or 256 with 96: 48 columns of dV per CTA, 16 per thread row, 64
# rows per pass of 128 threads) 2 warps and 32 keys per CTA, whose 64 threads copy 32 rows a pass
# (a 4-warp tile with 64-row query blocks spills with a window or soft-capping on sm_90a).
ROW_COPY_FALLBACKS = {
    1: BwdTile(32, 64, 4, 2),
    2: BwdTile(32, 32, 2, 2, col_tiles=2),
}
# columns of the narrowest swizzle atom (32 bytes of 16-bit elements): a column tile's width
ATOM_COLS_MIN = 16
# Where a CTA may have more shared memory (H100 / H200: 227 KB): 128 keys per CTA with 8 warps,
# which halves the loads of Q, dO, LSE and D and the dQ additions per key as at head dim 128
# (172 KB; compiles without spills for sm_80 and sm_90a). Chosen by `make_config(smem_limit=)`.
LARGE_SMEM_TILES = {
    256: BwdTile(32, 128, 8, 2, col_tiles=2),
}

# Head dim 256 with soft-capping, where the 32-row tiles spill (the fp32 tanh tile is one more
# score-sized tile): 16-row query blocks, the dQ MMA on one warp row. On the 4-warp tile that is
# deterministic or fp16 calls (4-28 B for sm_80 and sm_90a), on the 8-warp one deterministic
# calls (8-20 B for sm_80; causal 36/32 B for sm_90a). This tile compiles clean for both archs
# with every mask, varlen and both dtypes. On an H200 (2 x 4096 x 16 heads, softcap 50, the
# sm_80 kernels' bwd, `benchmarks/tune_bwd_tiles.py`): bf16 causal deterministic 13.64 ms
# against 11.53 (the 4-warp tile) and 10.68 (the 8-warp one, spilling); fp16 12.02 against
# 10.99. 32x64 with 4 column tiles also compiles clean but recomputes S^T and dP^T twice as
# often: 15.09 and 15.44 ms.
SOFTCAP_TILE_256 = BwdTile(16, 64, 4, 1, col_tiles=2)


class UnsupportedHeadDim(NotImplementedError):
    pass


# The preprocess and postprocess kernels give each row 8 threads of 128-bit vectors, so their
# tiles are 64 columns wide (16-bit elements) or a multiple of that.
PRE_THREADS_PER_ROW = 8
ROW_KERNEL_COLS = 64


@dataclass(frozen=True)
class Sm80BwdConfig:
    dtype: str  # "float16" | "bfloat16"
    head_dim: int  # padded tile head dim of Q, K, dQ, dK
    head_dim_v: int  # padded tile head dim of V, O, dO, dV
    tile_m: int
    tile_n: int
    num_warps: int
    dq_warps_m: int
    check_hdim: bool = False  # the actual head dim is below the tile's: predicate columns
    check_hdim_v: bool = False
    causal: bool = False
    local: bool = False  # sliding window (causal is not local)
    softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_k: bool = False
    # dQ added in key-block order, one CTA at a time per query block (a semaphore per
    # (batch, head, query block, column tile)), so that its fp32 sums are the same on every run
    deterministic: bool = False
    col_tiles: int = 1  # see the module docstring

    def __post_init__(self):
        check_attention_config(self, DTYPES, TILE_HEADDIMS)
        if self.tile_n != 16 * self.num_warps:
            raise ValueError(f"tile_n must be 16 per warp; got {self.tile_n} for {self.num_warps} warps")
        if self.num_warps % self.dq_warps_m or self.tile_m % (16 * self.dq_warps_m):
            raise ValueError(
                f"dq_warps_m={self.dq_warps_m} does not tile {self.tile_m} rows with {self.num_warps} warps"
            )
        if self.head_dim % (ATOM_COLS_MIN * self.col_tiles) or self.head_dim_v % (ATOM_COLS_MIN * self.col_tiles):
            raise ValueError(f"col_tiles={self.col_tiles} must cut head dims {self.head_dim} and {self.head_dim_v} "
                             f"into column tiles of a multiple of {ATOM_COLS_MIN} columns")
        refusal = _tile_refusal(self, self.head_dim, self.head_dim_v)
        if refusal:
            raise ValueError(refusal)

    @property
    def dk_cols(self) -> int:
        """Columns of dK and dQ one CTA computes."""
        return self.head_dim // self.col_tiles

    @property
    def dv_cols(self) -> int:
        """Columns of dV one CTA computes."""
        return self.head_dim_v // self.col_tiles

    @property
    def smem_bytes(self) -> int:
        q_do = self.tile_m * (self.head_dim + self.head_dim_v)
        k_v = self.tile_n * (self.head_dim + self.head_dim_v)
        ds = self.tile_n * self.tile_m
        return 2 * (q_do + k_v + ds) + 2 * 4 * self.tile_m  # + LSE and D of the query block

    @property
    def name(self) -> str:
        flags = [f for f in ("causal", "local", "softcap", "varlen_q", "varlen_k", "seqused_k") if getattr(self, f)]
        if self.deterministic:
            flags.append("det")
        if self.check_hdim:
            flags.append("padded")
        if self.check_hdim_v:
            flags.append("paddedv")
        hd = f"hd{self.head_dim}" + (f"x{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        tile = f"{self.tile_m}x{self.tile_n}w{self.num_warps}q{self.dq_warps_m}"
        if self.col_tiles > 1:
            tile += f"c{self.col_tiles}"
        return "_".join(["bwd_sm80", self.dtype, hd, tile] + flags)


@dataclass(frozen=True)
class Sm80BwdPreConfig:
    """The preprocess kernel (`bwd_pre.py`): D and the log2-space LSE, and the fp32 dQ
    accumulator's rows cleared."""

    dtype: str
    head_dim_v: int  # tile columns: the head dim of O rounded up to ROW_KERNEL_COLS
    check_hdim_v: bool = False
    varlen_q: bool = False
    has_dlse: bool = False
    # columns of the dQ accumulator (the main kernel's padded head dim) to clear; 0: none
    dq_accum_cols: int = 0
    # the accumulator is the sm_90 kernel's flat one (`Sm90BwdConfig.dq_flat`): (batch, head,
    # padded seqlen, dq_accum_cols), its padded rows a multiple of `tile_m`, all cleared
    dq_flat: bool = False
    tile_m: int = 64
    num_threads: int = 128

    def __post_init__(self):
        if self.dq_accum_cols % 4 or (self.tile_m * self.dq_accum_cols // 4) % self.num_threads:
            raise ValueError(f"dq_accum_cols must be a multiple of 8 (whole 128-bit stores on every thread); "
                             f"got {self.dq_accum_cols}")
        if self.dq_flat and (not self.dq_accum_cols or self.varlen_q):
            raise ValueError("dq_flat clears a flat dQ accumulator of fixed-length calls: it needs dq_accum_cols "
                             "and takes no varlen_q")

    @property
    def name(self) -> str:
        flags = [f for f, on in (("paddedv", self.check_hdim_v), ("varlen_q", self.varlen_q),
                                 ("dlse", self.has_dlse)) if on]
        if self.dq_accum_cols:
            flags.append(f"dq{self.dq_accum_cols}" + ("flat" if self.dq_flat else ""))
        return "_".join(["bwdpre_sm80", self.dtype, f"hdv{self.head_dim_v}"] + flags)


@dataclass(frozen=True)
class Sm80BwdPostConfig:
    """The postprocess kernel (`bwd_post.py`): dQ from its fp32 accumulator."""

    dtype: str
    head_dim: int  # tile columns: the head dim of Q rounded up to ROW_KERNEL_COLS
    check_hdim: bool = False
    varlen_q: bool = False
    tile_m: int = 64
    num_threads: int = 128

    @property
    def name(self) -> str:
        flags = [f for f, on in (("padded", self.check_hdim), ("varlen_q", self.varlen_q)) if on]
        return "_".join(["bwdpost_sm80", self.dtype, f"hd{self.head_dim}"] + flags)


def _row_kernel_cols(d: int) -> int:
    return align_up(d, ROW_KERNEL_COLS)


def make_pre_config(dtype: str, head_dim_v: int, varlen_q: bool, has_dlse: bool,
                    dq_accum_cols: int = 0, dq_flat: bool = False) -> Sm80BwdPreConfig:
    cols = _row_kernel_cols(head_dim_v)
    return Sm80BwdPreConfig(dtype, cols, cols != head_dim_v, varlen_q, has_dlse, dq_accum_cols, dq_flat)


def make_post_config(dtype: str, head_dim: int, varlen_q: bool) -> Sm80BwdPostConfig:
    cols = _row_kernel_cols(head_dim)
    return Sm80BwdPostConfig(dtype, cols, cols != head_dim, varlen_q)


def make_config(dtype: str, head_dim: int, head_dim_v: int, smem_limit: Optional[int] = None,
                **flags) -> Sm80BwdConfig:
    """The configuration for actual head dims (multiples of 8 up to 256) and feature flags;
    `smem_limit` (a CTA's shared memory on the GPU, bytes) lets a larger tile of
    `LARGE_SMEM_TILES` be taken where it fits.

    A pair of head dims whose row copies do not cover the table's tile in whole passes
    (`check_row_copy_passes`: a column count with a narrow swizzle atom, on many threads) takes
    the `ROW_COPY_FALLBACKS` tile where that fits, else is refused by name."""
    hd, hdv = (pad_headdim(d, TILE_HEADDIMS, UnsupportedHeadDim) for d in (head_dim, head_dim_v))
    tile = TILES[max(hd, hdv)]
    refusal = _tile_refusal(tile, hd, hdv)
    if refusal and not _dq_refusal(tile, hd):  # the row copies alone
        fallback = ROW_COPY_FALLBACKS[tile.col_tiles]
        if not _tile_refusal(fallback, hd, hdv):
            tile, refusal = fallback, None
    if refusal:
        raise UnsupportedHeadDim(f"the sm_80 backward kernel does not take head dims {head_dim} (Q, K) and "
                                 f"{head_dim_v} (V): {refusal}")
    large = LARGE_SMEM_TILES.get(max(hd, hdv))
    if smem_limit is not None and large is not None and not _tile_refusal(large, hd, hdv):
        if _config_for_tile(large, dtype, head_dim, head_dim_v, hd, hdv, flags).smem_bytes <= smem_limit:
            tile = large
    if flags.get("softcap", False) and max(hd, hdv) == 256:
        tile = _softcap_tile(tile, dtype, hd, hdv, flags.get("deterministic", False))
    return _config_for_tile(tile, dtype, head_dim, head_dim_v, hd, hdv, flags)


def _softcap_tile(tile, dtype: str, hd: int, hdv: int, deterministic: bool):
    """The tile of a soft-capped call with a head dim of 256 in place of `tile` where `tile`
    spills (the fp32 tanh tile is one more score-sized tile; the sweep finds these):
    - 256 / 256 on the 8-warp tile (`LARGE_SMEM_TILES`) when deterministic, on the 4-warp one
      when deterministic or fp16: `SOFTCAP_TILE_256`;
    - unequal pairs, deterministic (8-32 B): 256 / 192 and 192 / 256 the 2-warp column tile;
      128 / 256 and the like on the 8-warp tile `SOFTCAP_TILE_256` where it takes them."""
    large = tile == LARGE_SMEM_TILES.get(256)
    if hd == hdv:
        return SOFTCAP_TILE_256 if deterministic or (dtype == "float16" and not large) else tile
    if not deterministic:
        return tile
    if min(hd, hdv) > 128:
        return ROW_COPY_FALLBACKS[2]
    if large and not _tile_refusal(SOFTCAP_TILE_256, hd, hdv):
        return SOFTCAP_TILE_256
    return tile


def _tile_refusal(tile, hd: int, hdv: int) -> Optional[str]:
    """Why `tile` (a `BwdTile`, or a config: the same fields) cannot take padded head dims
    (hd, hdv), or None: make_config's choice of tile and the config's own check."""
    return _dq_refusal(tile, hd) or _row_copy_refusal(tile, hd, hdv)


def _dq_refusal(tile, hd: int) -> Optional[str]:
    step = 16 * (tile.num_warps // tile.dq_warps_m)  # columns of one step of the dQ MMA: 16 per warp
    cols = hd // tile.col_tiles
    if tile.col_tiles > 1 and cols % step:
        return (f"each of its {tile.col_tiles} CTAs per key block would have {cols} columns of dQ, not a multiple "
                f"of {step} (the dQ MMA's columns per step)")
    return None


def _row_copy_refusal(tile, hd: int, hdv: int) -> Optional[str]:
    # Q, K and dO, V come by 128-bit row copies
    try:
        check_row_copy_passes(16, (hd // tile.col_tiles, hdv // tile.col_tiles), 32 * tile.num_warps,
                              {"tile_m": tile.tile_m, "tile_n": tile.tile_n})
    except ValueError as exc:
        return str(exc)
    return None


def _config_for_tile(tile: BwdTile, dtype: str, head_dim: int, head_dim_v: int, hd: int, hdv: int,
                     flags: dict) -> Sm80BwdConfig:
    return Sm80BwdConfig(
        dtype=dtype,
        head_dim=hd,
        head_dim_v=hdv,
        tile_m=tile.tile_m,
        tile_n=tile.tile_n,
        num_warps=tile.num_warps,
        dq_warps_m=tile.dq_warps_m,
        col_tiles=tile.col_tiles,
        check_hdim=hd != head_dim,
        check_hdim_v=hdv != head_dim_v,
        **flags,
    )


def shipped_configs() -> list:
    """Head dims 64, 128 and 256 in fp16 (no mask) and bf16 (causal), one of each feature
    variant, and the preprocess / postprocess kernels (whose tiles are 64 to 256 columns wide).

    Feature flags change code paths but not the tile, so one head dim per variant shows that the
    path compiles without spills; CI compiles every entry.
    """
    configs = [make_config("float16", d, d) for d in (64, 128, 256)]
    configs += [make_config("bfloat16", d, d, causal=True) for d in (64, 128, 256)]
    base = make_config("bfloat16", 128, 128)
    configs += [
        make_config("bfloat16", 96, 96, causal=True),
        replace(base, local=True, softcap=True),
        replace(base, causal=True, varlen_q=True, varlen_k=True, seqused_k=True),
        make_config("float16", 128, 64, causal=True),
        replace(base, causal=True, deterministic=True),
        make_config("float16", 64, 64, local=True, varlen_q=True, varlen_k=True, deterministic=True),
        make_pre_config("bfloat16", 128, varlen_q=False, has_dlse=False, dq_accum_cols=128),
        make_pre_config("float16", 96, varlen_q=True, has_dlse=True, dq_accum_cols=96),
        make_post_config("bfloat16", 128, varlen_q=False),
        make_post_config("float16", 96, varlen_q=True),
        make_config("bfloat16", 192, 128, local=True, softcap=True, deterministic=True),
        make_config("float16", 192, 192, causal=True, varlen_q=True, varlen_k=True),
        make_config("float16", 96, 128, causal=True),  # ROW_COPY_FALLBACKS
        make_config("bfloat16", 256, 96, local=True, softcap=True, deterministic=True),
        make_pre_config("bfloat16", 256, varlen_q=False, has_dlse=False, dq_accum_cols=256),
        # the sm_90 kernel's flat accumulator (`dq_flat`)
        make_pre_config("bfloat16", 128, varlen_q=False, has_dlse=True, dq_accum_cols=128, dq_flat=True),
        make_post_config("bfloat16", 256, varlen_q=False),
        make_config("bfloat16", 256, 256, causal=True, smem_limit=227 * 1024),  # LARGE_SMEM_TILES
    ]
    return configs


# ------------------------------------------------------------------------------------------------
# compiling a configuration (no GPU needed: fake tensors with symbolic sizes and 64-bit strides)
# ------------------------------------------------------------------------------------------------
def _fake_row_stats(varlen: bool):
    """LSE / D: (batch, heads, seqlen) float32, or (heads, total) for packed sequences."""
    import cutlass

    return fake_tensor(cutlass.Float32, 2 if varlen else 3)


def fake_arguments(config: Sm80BwdConfig) -> tuple:
    """Arguments of `FlashBwdSm80.__call__` (less the stream) for `cute.compile`: every size
    symbolic, every stride but the last a 64-bit multiple of 8 elements (4 for fp32)."""
    import cutlass

    dtype = element_type(config.dtype)
    return (
        fake_tokens(dtype, config.varlen_q, 8),  # q
        fake_tokens(dtype, config.varlen_k, 8),  # k
        fake_tokens(dtype, config.varlen_k, 8),  # v
        fake_tokens(dtype, config.varlen_q, 8),  # dout
        _fake_row_stats(config.varlen_q),  # lse_log2
        _fake_row_stats(config.varlen_q),  # delta
        fake_tokens(cutlass.Float32, config.varlen_q, 4),  # dq_accum
        fake_tokens(dtype, config.varlen_k, 8),  # dk
        fake_tokens(dtype, config.varlen_k, 8),  # dv
        *fake_sequence_vectors(config),
        fake_tensor(cutlass.Int32, 3) if config.deterministic else None,  # dq_semaphore
        cutlass.Int32(1),  # num_batch
        cutlass.Int32(1),  # max_seqlen_k
        cutlass.Float32(1.0),  # softmax_scale
        cutlass.Float32(1.0),  # softmax_scale_log2
        cutlass.Float32(1.0),  # softcap_prescale
        cutlass.Int32(-1),  # window_left
        cutlass.Int32(-1),  # window_right
    )


def compile_kernel(config, options: str = "--gpu-arch sm_80"):
    """cute.compile the kernel of a backward `config` (main, preprocess or postprocess) with
    extra compiler `options` (e.g. the arch)."""
    import cutlass
    import cutlass.cute as cute

    stream = fake_stream(options)
    if isinstance(config, Sm80BwdPreConfig):
        from .bwd_pre import FlashBwdPreSm80

        tokens = fake_tokens(element_type(config.dtype), config.varlen_q, 8)
        args = (
            tokens, fake_tokens(element_type(config.dtype), config.varlen_q, 8), _fake_row_stats(config.varlen_q),
            _fake_row_stats(config.varlen_q) if config.has_dlse else None,
            _fake_row_stats(config.varlen_q), _fake_row_stats(config.varlen_q),
            fake_tokens(cutlass.Float32, config.varlen_q, 4) if config.dq_accum_cols else None,  # dq_accum
            fake_int_vector() if config.varlen_q else None, cutlass.Int32(1), cutlass.Int32(1),
        )
        return cute.compile(FlashBwdPreSm80(config), *args, stream, options=options)
    if isinstance(config, Sm80BwdPostConfig):
        from .bwd_post import FlashBwdPostSm80

        args = (
            fake_tokens(cutlass.Float32, config.varlen_q, 4), fake_tokens(element_type(config.dtype), config.varlen_q, 8),
            fake_int_vector() if config.varlen_q else None, cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Float32(1.0),
        )
        return cute.compile(FlashBwdPostSm80(config), *args, stream, options=options)
    from .bwd import FlashBwdSm80

    return cute.compile(FlashBwdSm80(config), *fake_arguments(config), stream, options=options)


# `KernelCache` builds kernels through `<config module>.compile_fwd`; for this module that is the
# backward kernel.
compile_fwd = compile_kernel


def sweep_configs() -> list:
    """The main-kernel configurations `make_config` gives over a grid of calls: every tile head
    dim (and 256 on the tile of H100 / H200 shared memory), no mask / causal / window, softcap
    or not, fixed or varlen (with seqused_k) sequences, deterministic or not, in bf16; the equal
    head dims in fp16 too, without the sequence and deterministic variants; and unequal pairs
    with a head dim above 128 soft-capped and deterministic (no mask or causal, both dtypes).
    `python -m cute_flash.audit --sweep` compiles them."""
    import itertools

    from cute_flash.audit import distinct

    masks = ({}, {"causal": True}, {"local": True})
    seqs = ({}, {"varlen_q": True, "varlen_k": True, "seqused_k": True})
    dims = [(d, None) for d in TILE_HEADDIMS] + [(256, 227 * 1024)]
    bf16 = (make_config("bfloat16", d, d, smem_limit=smem, softcap=softcap, deterministic=det, **mask, **seq)
            for (d, smem), mask, softcap, seq, det in itertools.product(dims, masks, (False, True), seqs,
                                                                        (False, True)))
    fp16 = (make_config("float16", d, d, smem_limit=smem, softcap=softcap, **mask)
            for (d, smem), mask, softcap in itertools.product(dims, masks, (False, True)))
    pairs = [(256, 192), (192, 256), (256, 128), (128, 256), (256, 64), (64, 256), (192, 128), (128, 192)]
    unequal = (make_config(dtype, d, dv, smem_limit=smem, softcap=True, deterministic=True, **mask)
               for (d, dv), dtype, smem, mask in itertools.product(pairs, DTYPES, (None, 227 * 1024), masks[:2]))
    return distinct(itertools.chain(bf16, fp16, unequal))


def sweep_targets(arch: str) -> list:
    """One audit target per `sweep_configs` entry."""
    from cute_flash.audit import targets

    return targets(arch, sweep_configs(), compile_kernel)


def audit_targets(arch: str) -> list:
    """One audit target per shipped configuration (see `cute_flash.audit`)."""
    from cute_flash.audit import targets

    return targets(arch, shipped_configs(), compile_kernel)
