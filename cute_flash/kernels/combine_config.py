"""Compile-time configuration of the split-KV combine kernel (`combine.py`), its compile helper,
the number-of-splits heuristic, and the audit targets.

The combine's key is small: output dtype, padded head dim of V, how rows and key lengths are
found (varlen / seqused_k), whether an LSE is written, and `tile_n` of the forward kernel whose
partition of the key blocks it has to reproduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .common.tiles import pad_headdim
from .sm80.fwd_config import DTYPES, TILE_HEADDIMS

# A split-KV CTA's fixed time in key blocks, for `num_splits_heuristic`: fitted to the H200
# decode timings quoted there (at 128 blocks x 8 tiles it puts 16 splits first and 32 before
# 48 and 64, as measured, though 24 measured better than it models), and it keeps a grid of 64
# tiles at 2 splits rather than 43 splits in 21 waves of 3 blocks.
CTA_COST_IN_BLOCKS = 2
MAX_SPLITS = 64  # the heuristic's ceiling; an explicit num_splits is clamped to the key blocks only


@dataclass(frozen=True)
class CombineConfig:
    dtype: str  # output dtype, "float16" | "bfloat16"
    head_dim_v: int  # padded, one of TILE_HEADDIMS
    tile_n: int  # key-block size of the forward kernel that wrote the partials
    check_hdim_v: bool = False  # the actual head dim is below head_dim_v
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_k: bool = False
    has_lse: bool = True
    rows_per_cta: int = 4  # one warp per (row, head)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}; got {self.dtype!r}")
        if self.head_dim_v not in TILE_HEADDIMS:
            raise ValueError(f"head_dim_v must be one of {TILE_HEADDIMS}; got {self.head_dim_v}")
        if self.tile_n <= 0 or self.tile_n % 16:
            raise ValueError(f"tile_n must be a positive multiple of 16; got {self.tile_n}")

    @property
    def name(self) -> str:
        flags = [f for f in ("varlen_q", "varlen_k", "seqused_k") if getattr(self, f)]
        if self.check_hdim_v:
            flags.append("paddedv")
        if not self.has_lse:
            flags.append("nolse")
        return "_".join(["combine", self.dtype, f"hd{self.head_dim_v}", f"n{self.tile_n}", f"r{self.rows_per_cta}"]
                        + flags)


def make_config(dtype: str, head_dim_v: int, tile_n: int, **flags) -> CombineConfig:
    """The combine for an actual V head dim (a multiple of 8 up to 256) and the forward's tile_n."""
    hdv = pad_headdim(head_dim_v, TILE_HEADDIMS)
    return CombineConfig(dtype=dtype, head_dim_v=hdv, tile_n=tile_n, check_hdim_v=hdv != head_dim_v, **flags)


@functools.lru_cache(maxsize=1024)  # per decode call on the host; pure in four integers
def num_splits_heuristic(num_tiles: int, num_sms: int, num_n_blocks: int, max_splits: int = MAX_SPLITS,
                         paged: bool = False) -> int:
    """Splits for `num_tiles` = batch x heads x query blocks CTAs over `num_n_blocks` key blocks.

    Split only when the unsplit grid leaves SMs idle (fewer tiles than 80% of the SMs). Then
    take the split count with the shortest modelled time, waves x (key blocks per split + a
    CTA's fixed cost), with waves = ceil(tiles * s / SMs) (one CTA per SM), ceil(n / s) blocks
    per split and the fixed cost (start-up, Q, the partial's write) counted as
    CTA_COST_IN_BLOCKS; among equal times the fewest splits (less combine work). On an H200
    (one-token decode, 32 query heads over 8 KV heads, hd128, 128 blocks of 64 keys, CUDA-graph
    replays) 16 splits of 8 blocks ran 1.48-1.54 TB/s, where the earlier rule's 15 splits of up
    to 9 blocks ran 1.37-1.46, 24 or 32 splits 1.29-1.39 and 64 splits 1.0-1.1; with 32k keys 16
    splits ran 2.67-2.72 TB/s against 2.47-2.61 for 15.

    A `paged` cache whose grid holds at most one CTA per SM runs at least 2 splits: a second CTA
    per SM covers the page-table lookups each K tile waits for. On the H200 (batch 16, pages of
    64, CUDA-graph replays) 2 splits took 8k keys from 3.58 to 3.83 TB/s and 32k keys from 3.74
    to 4.21; the contiguous cache at 8k went the other way (3.90 to 3.76), so it is not split.
    """
    if paged and 0 < num_tiles <= num_sms and num_n_blocks >= 2 and max_splits >= 2:
        floor = 2
    else:
        floor = 1
    if num_tiles <= 0 or num_n_blocks <= 1 or num_tiles >= 0.8 * num_sms:
        return floor
    limit = min(max_splits, num_sms, num_n_blocks)

    def modelled_time(s: int) -> int:
        return -(-num_tiles * s // num_sms) * (-(-num_n_blocks // s) + CTA_COST_IN_BLOCKS)

    return max(floor, min(range(1, limit + 1), key=lambda s: (modelled_time(s), s)))


def shipped_configs() -> list:
    """The combines of the shipped split-KV forward configurations (`sm80.fwd_config`)."""
    from .sm80 import fwd_config

    configs = []
    for fwd in fwd_config.shipped_configs():
        if fwd.split_kv:
            config = CombineConfig(
                dtype=fwd.dtype, head_dim_v=fwd.head_dim_v, tile_n=fwd.tile_n, check_hdim_v=fwd.check_hdim_v,
                varlen_q=fwd.varlen_q, varlen_k=fwd.varlen_k, seqused_k=fwd.seqused_k,
            )
            if config not in configs:
                configs.append(config)
    return configs


def fake_arguments(config: CombineConfig) -> tuple:
    """Arguments of `FlashCombine.__call__` (less the stream) for `cute.compile`."""
    import cutlass

    from .common.fake_tensors import element_type, fake_sequence_vectors, fake_tensor, fake_tokens

    o_rank = 3 if config.varlen_q else 4
    lse_rank = 2 if config.varlen_q else 3
    return (
        fake_tensor(cutlass.Float32, o_rank + 1, 4, 16),  # o_partial
        fake_tensor(cutlass.Float32, lse_rank + 1),  # lse_partial
        fake_tokens(element_type(config.dtype), config.varlen_q),  # out
        fake_tensor(cutlass.Float32, lse_rank) if config.has_lse else None,
        *fake_sequence_vectors(config),
        cutlass.Int32(1),  # seqlen_k
        cutlass.Int32(1),  # num_batch
        cutlass.Int32(1),  # max_seqlen_q
        cutlass.Int32(1),  # num_splits
    )


def compile_fwd(config: CombineConfig, options: str = "--gpu-arch sm_80"):
    """cute.compile the combine of `config` (named for `backends.kernel_cache.KernelCache`, which
    compiles every kernel of the forward pass through its config module's `compile_fwd`)."""
    import cutlass.cute as cute

    from .common.fake_tensors import fake_stream

    from .combine import FlashCombine

    return cute.compile(FlashCombine(config), *fake_arguments(config), fake_stream(options), options=options)


def audit_targets(arch: str) -> list:
    """One audit target per shipped combine configuration (see `cute_flash.audit`)."""
    from cute_flash.audit import targets

    return targets(arch, shipped_configs(), compile_fwd)
