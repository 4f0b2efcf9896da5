"""What every kernel's configuration table shares: padding a head dim up to the next tile, and
the checks every attention kernel configuration starts with."""

from __future__ import annotations


# Static shared memory of every compiled sm_90 kernel (the audit's cuobjdump resource usage of
# every configuration), besides its dynamic `SharedStorage`: a CTA needs both within the limit.
SM90_STATIC_SMEM_BYTES = 1024


def align_up(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


def pad_headdim(d: int, tile_headdims: tuple, error: type = ValueError) -> int:
    """The smallest tile head dim that holds `d` (the columns past `d` are zero-filled on load
    and never stored); `error` is raised, naming `d`, when no tile is large enough."""
    for t in tile_headdims:
        if d <= t:
            return t
    raise error(f"head dim {d} exceeds the largest tile ({tile_headdims[-1]})")


def check_attention_config(config, dtypes: tuple, tile_headdims: tuple) -> None:
    """A kernel config's dtype and tile head dims are ones its table has, and causal and local
    are not both set (raises ValueError naming the field)."""
    if config.dtype not in dtypes:
        raise ValueError(f"dtype must be one of {dtypes}; got {config.dtype!r}")
    for name in ("head_dim", "head_dim_v"):
        if getattr(config, name) not in tile_headdims:
            raise ValueError(f"{name} must be one of {tile_headdims}; got {getattr(config, name)}")
    if config.causal and config.local:
        raise ValueError("causal and local exclude each other (causal is the window (-1, 0))")
