"""Which key blocks a query block has to visit, and which of them need a mask.

Convention (FlashAttention-2): query row i of a sequence may see key j iff
    i + (seqlen_k - seqlen_q) - window_left <= j <= i + (seqlen_k - seqlen_q) + window_right,
causal being window (unbounded, 0). Windows arrive here already "effective": an unbounded side
is replaced by seqlen_q + seqlen_k, which is wider than any sequence, so no -1 special case is
left in the index arithmetic. All divisions are done on non-negative values (clamped first),
so truncating division equals floor division.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .seqlen_info import SeqlenInfo


@cute.jit
def effective_window(seqlen: SeqlenInfo, window_left, window_right, local: cutlass.Constexpr[bool]):
    """The window sizes as BlockInfo and the masks take them: with a sliding window (`local`) an
    unbounded side (-1) becomes seqlen_q + seqlen_k; otherwise they pass through unchanged."""
    left, right = window_left, window_right
    if cutlass.const_expr(local):
        unbounded = seqlen.seqlen_q + seqlen.seqlen_k
        left = window_left if window_left >= 0 else unbounded
        right = window_right if window_right >= 0 else unbounded
    return left, right


@dataclass(frozen=True)
class BlockInfo:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    is_causal: cutlass.Constexpr[bool]
    is_local: cutlass.Constexpr[bool]
    window_left: Int32
    window_right: Int32

    def n_block_range(self, seqlen: SeqlenInfo, m_block: Int32):
        """[n_block_min, n_block_max): the key blocks holding at least one visible key."""
        n_block_max = (seqlen.seqlen_k + self.tile_n - 1) // self.tile_n
        n_block_min = Int32(0)
        if cutlass.const_expr(self.is_causal or self.is_local):
            offset = seqlen.seqlen_k - seqlen.seqlen_q
            last_row = cutlass.min((m_block + 1) * self.tile_m, seqlen.seqlen_q) - 1
            right = 0 if cutlass.const_expr(self.is_causal) else self.window_right
            # one past the right-most visible key of the tile's last row
            col_end = cutlass.max(last_row + offset + right + 1, 0)
            n_block_max = cutlass.min(n_block_max, (col_end + self.tile_n - 1) // self.tile_n)
        if cutlass.const_expr(self.is_local):
            offset = seqlen.seqlen_k - seqlen.seqlen_q
            col_begin = cutlass.max(m_block * self.tile_m + offset - self.window_left, 0)
            n_block_min = col_begin // self.tile_n
        return n_block_min, n_block_max

    def key_block_turn(self, seqlen: SeqlenInfo, n_block: Int32, m_block: Int32, last_first: bool = False):
        """Deterministic backward: the place of key block `n_block` among the key blocks that add
        into query block `m_block`, which are consecutive (`n_block_range`): counted from the
        first of them, or from the last with `last_first`. The kernels add in this order, and
        launch the key block whose turn comes before n's before n (`Sm90BwdConfig.shortest_first`
        launches the last key blocks first), so waiting for it never waits on a later CTA."""
        n_block_min, n_block_max = self.n_block_range(seqlen, m_block)
        if last_first:  # a Python bool: the kernel's configuration
            return n_block_max - 1 - n_block
        return n_block - n_block_min

    def m_block_range(self, seqlen: SeqlenInfo, n_block: Int32):
        """[m_block_min, m_block_max): the query blocks with a row that sees at least one key of
        key block `n_block` (the backward's loop); m_block_max may fall below m_block_min."""
        offset = seqlen.seqlen_k - seqlen.seqlen_q  # query i is aligned with key i + offset
        num_m_blocks = (seqlen.seqlen_q + self.tile_m - 1) // self.tile_m
        m_block_min = Int32(0)
        m_block_max = num_m_blocks
        n_lo = n_block * self.tile_n
        if cutlass.const_expr(self.is_causal or self.is_local):
            # key j is seen by queries i >= j - offset - right
            right = Int32(0) if cutlass.const_expr(self.is_causal) else self.window_right
            m_block_min = cutlass.max(n_lo - offset - right, 0) // self.tile_m
        if cutlass.const_expr(self.is_local):
            # ... and i <= j - offset + left
            last_row = cutlass.min(n_lo + self.tile_n, seqlen.seqlen_k) - 1 - offset + self.window_left
            m_block_max = cutlass.min(num_m_blocks, (cutlass.max(last_row, -1) + self.tile_m) // self.tile_m)
        return m_block_min, m_block_max

    def n_block_right_masked(self, seqlen: SeqlenInfo, m_block: Int32) -> Int32:
        """First key block that some row of the tile sees only partly on its right edge."""
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        right = 0 if cutlass.const_expr(self.is_causal) else self.window_right
        # row m_block * tile_m sees keys [.., limit]; block n is whole iff (n + 1) * tile_n <= limit + 1
        return cutlass.max(m_block * self.tile_m + offset + right + 1, 0) // self.tile_n
