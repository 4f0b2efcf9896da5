"""What every kernel's configuration table shares: padding a head dim up to the next tile."""

from __future__ import annotations


def pad_headdim(d: int, tile_headdims: tuple, error: type = ValueError) -> int:
    """The smallest tile head dim that holds `d` (the columns past `d` are zero-filled on load
    and never stored); `error` is raised, naming `d`, when no tile is large enough."""
    for t in tile_headdims:
        if d <= t:
            return t
    raise error(f"head dim {d} exceeds the largest tile ({tile_headdims[-1]})")
