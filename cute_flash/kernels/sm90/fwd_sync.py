"""How the roles and the CTAs of the sm_90 forward (`fwd.py`) meet: its named barriers, and the
order of the tiles, which the grid, a persistent CTA's walk (`fwd_persistent.py`) and the sm_90
backward's causal grid (`Sm90BwdConfig.lpt`) share."""

from __future__ import annotations

# Named barriers (0 is __syncthreads): the consumers' epilogue, one per consumer warpgroup (up to
# 3) for the ping-pong order of GEMM issue, then the hand-over of a `tile_counter` CTA's next
# tile index (full: written by the producer; empty: read by every consumer).
BARRIER_EPILOGUE = 1
BARRIER_PINGPONG = 2
BARRIER_TILE_FULL = 5
BARRIER_TILE_EMPTY = 6


def tile_coords(tile, num_m_blocks, num_heads, num_batch, heads_per_section, longest_first: bool, minimum=min):
    """(m_block, head, batch) of tile `tile` of a persistent grid (plain integer arithmetic: the
    kernel passes its Int32 values and `cutlass.min`, the tests Python ints).

    The (batch, head) pairs are cut into sections of `heads_per_section` consecutive ones (the
    query heads of one KV head are neighbours); a section's tiles come together, the query blocks
    of its heads side by side, so that the K/V they read is shared in L2 while it lasts. Inside a
    section the query blocks go from the first to the last, or, for causal and local attention
    (`longest_first`), from the last (the most keys) to the first. With one head per section this
    is the order of the non-persistent grid. The sm_90 backward's causal grid takes its key blocks
    in this order (`Sm90BwdConfig.lpt`: key block 0, the first, meets the most queries).
    """
    pairs = num_heads * num_batch
    section_tiles = num_m_blocks * heads_per_section
    section = tile // section_tiles
    r = tile - section * section_tiles
    heads_here = minimum(heads_per_section, pairs - section * heads_per_section)
    m_idx = r // heads_here
    pair = section * heads_per_section + r - m_idx * heads_here
    m_block = num_m_blocks - 1 - m_idx if longest_first else m_idx
    return m_block, pair % num_heads, pair // num_heads


def cluster_tile_coords(tile, num_m_blocks, rank, maximum=max):
    """(m_block, (batch, head) pair, lone) of tile `tile` of a persistent K/V-cluster grid for the
    CTA of cluster rank `rank` (plain integer arithmetic, as `tile_coords`).

    The pairs go two at a time, and pairs 2g and 2g + 1 have num_m_blocks tiles between them:
    num_m_blocks // 2 each of two neighbouring query blocks (lone 0: the CTAs share the pair's
    K/V, each loading half of every tile into both), and with an odd number of query blocks a
    last one of the last query block of both (lone 1: CTA r takes pair 2g + r's and loads its
    K/V alone), so that both CTAs of a cluster always walk the same number of key blocks. With
    an even number this is the order of `tile_coords` with one head per section. The caller
    takes an even number of pairs where num_m_blocks is odd (`with_cluster_kv`)."""
    half = num_m_blocks // 2
    group = tile // num_m_blocks
    r = tile - group * num_m_blocks
    lone = (num_m_blocks - 2 * half) * ((r + 1) // num_m_blocks)
    side = r // maximum(half, 1)
    pair = 2 * group + (1 - lone) * side + lone * rank
    m_block = (1 - lone) * (2 * (r - side * half) + rank) + lone * 2 * half
    return m_block, pair, lone
