"""Score masking: key-length tails, causal (bottom-right aligned) and sliding windows.

Masked scores are set (not added) to -inf before the row max, so garbage can never leak
through a masked score, and the softmax guards rows whose max is -inf. With `by_bits`, where a
thread's columns of a row are an MMA accumulator's (`mma_columns`), a row's limits become bit
masks of its elements (`hide_by_bits`) instead of one comparison per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .utils import acc_mn_view, high_bits_from, low_bits


@dataclass(frozen=True)
class AttentionMask:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    seqlen_q: Int32
    seqlen_k: Int32
    window_left: Int32  # effective (>= 0), used only by local masks
    window_right: Int32
    # rows of MMA accumulator columns masked through bit masks (R2P) rather than a comparison per
    # column (see `apply`): the sm_90 forward's `mask_bits`. The sm_80 forward keeps the
    # comparisons: with bit masks two of its tiles spill when built for sm_90a (head dim 64's
    # 128 x 64 causal fp16, 28/44 bytes; head dim 256's 64 x 64 one-stage window, 32/32).
    by_bits: cutlass.Constexpr[bool] = False

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        tScS_mn: cute.Tensor,
        t0ScS_mn: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool],
    ):
        """Mask acc_S of tile (m_block, n_block).

        tScS_mn holds this thread's tile-relative (row, col) coordinates and t0ScS_mn thread 0's.
        The latter are compile-time constants, so each comparison below is against an immediate
        once this thread's own offset has been moved into the (per-row) limit. With `by_bits`,
        where a row's columns are those of an MMA accumulator (`mma_columns`), a row's limit becomes a count of
        its elements and a bit mask of them, which ptxas moves into predicates seven at a time
        (R2P) instead of comparing every column.
        """
        acc_S_mn = acc_mn_view(acc_S)
        thr_row, thr_col = tScS_mn[0, 0]
        col_base = n_block * self.tile_n + thr_col
        ncols = cute.size(tScS_mn, mode=[1])
        by_bits = self.by_bits and mma_columns(t0ScS_mn)
        if cutlass.const_expr(not mask_causal and not mask_local):
            if cutlass.const_expr(mask_seqlen):
                col_end = self.seqlen_k - col_base
                if cutlass.const_expr(by_bits):
                    keep_end = elements_left_of(col_end)  # the same for every row
                    for r in cutlass.range_constexpr(cute.size(tScS_mn, mode=[0])):
                        hide_by_bits(acc_S_mn, r, ncols, keep_end, None)
                else:
                    for c in cutlass.range_constexpr(ncols):
                        if t0ScS_mn[0, c][1] >= col_end:
                            for r in cutlass.range_constexpr(cute.size(tScS_mn, mode=[0])):
                                acc_S_mn[r, c] = -Float32.inf
        else:
            right = 0 if cutlass.const_expr(mask_causal) else self.window_right
            row_base = m_block * self.tile_m + thr_row
            # visible columns of row i, relative to this thread's first column:
            # [i + offset - window_left, i + offset + right + 1)
            offset = row_base + self.seqlen_k - self.seqlen_q - col_base
            for r in cutlass.range_constexpr(cute.size(tScS_mn, mode=[0])):
                row = t0ScS_mn[r, 0][0]
                col_end = row + offset + right + 1
                if cutlass.const_expr(mask_seqlen):
                    col_end = cutlass.min(col_end, self.seqlen_k - col_base)
                col_begin = row + offset - self.window_left
                if cutlass.const_expr(by_bits):
                    keep_end = elements_left_of(col_end)
                    keep_begin = elements_left_of(col_begin) if cutlass.const_expr(mask_local) else None
                    hide_by_bits(acc_S_mn, r, ncols, keep_end, keep_begin)
                else:
                    for c in cutlass.range_constexpr(ncols):
                        col = t0ScS_mn[0, c][1]
                        hidden = col >= col_end
                        if cutlass.const_expr(mask_local):
                            hidden = hidden | (col < col_begin)
                        acc_S_mn[r, c] = -Float32.inf if hidden else acc_S_mn[r, c]


def mma_columns(t0ScS_mn: cute.Tensor) -> bool:
    """Whether thread 0's columns of an accumulator row (`t0ScS_mn`'s mode 1, and so every
    thread's relative to its first) are those of the MMA accumulators of both arches (mma.sync's
    n8 tiles, WGMMA's rows): pairs 8 apart, 0, 1, 8, 9, 16, 17, ..., as compile-time integers.
    Element j then is left of a column limit L >= 0 exactly when j < 2 * (L // 8) + min(L % 8, 2)
    (`elements_left_of`)."""
    cols = [t0ScS_mn[0, c][1] for c in range(cute.size(t0ScS_mn, mode=[1]))]
    return all(isinstance(c, int) for c in cols) and cols == [j // 2 * 8 + j % 2 for j in range(len(cols))]


@cute.jit
def elements_left_of(col_limit: Int32) -> Int32:
    """How many of a thread's `mma_columns` elements of a row lie left of `col_limit` (relative to
    its first column; any value)."""
    lim = cutlass.max(col_limit, 0)
    return (lim >> 3) * 2 + cutlass.min(lim & 7, 2)


@cute.jit
def keep_left_of(col_limit, first: cutlass.Constexpr[int] = 0) -> cutlass.Uint32:
    """The bits, over a row's `mma_columns` elements first .. first + 31, of those left of
    `col_limit` (relative to the thread's first column; any value)."""
    return bits_below(elements_left_of(col_limit), first)


@cute.jit
def keep_from(col_limit, first: cutlass.Constexpr[int] = 0) -> cutlass.Uint32:
    """The bits, over a row's `mma_columns` elements first .. first + 31, of those at or right of
    `col_limit`."""
    return bits_from(elements_left_of(col_limit), first)


@cute.jit
def bits_below(count, first: cutlass.Constexpr[int] = 0) -> cutlass.Uint32:
    """The bits of elements first .. first + 31 that are among the first `count` (>= 0)."""
    return low_bits(cutlass.max(cutlass.min(count - first, 32), 0))


@cute.jit
def bits_from(count, first: cutlass.Constexpr[int] = 0) -> cutlass.Uint32:
    """The bits of elements first .. first + 31 that are not among the first `count` (>= 0)."""
    return high_bits_from(cutlass.max(cutlass.min(count - first, 32), 0))


@cute.jit
def hide_by_bits(acc_S_mn: cute.Tensor, r: cutlass.Constexpr[int], ncols: cutlass.Constexpr[int], keep_end: Int32,
                 keep_begin):
    """-inf into row r's elements from the `keep_end`-th on, and before the `keep_begin`-th unless
    None (element counts: `elements_left_of` the row's column limits), through a keep-mask of 32
    elements at a time whose bits ptxas turns into predicates (R2P)."""
    for chunk in cutlass.range_constexpr((ncols + 31) // 32):
        first = chunk * 32
        keep = bits_below(keep_end, first)
        if cutlass.const_expr(keep_begin is not None):
            keep = keep & bits_from(keep_begin, first)
        for i in cutlass.range_constexpr(min(32, ncols - first)):
            visible = cutlass.Boolean(keep & cutlass.Uint32(1 << i))
            acc_S_mn[r, first + i] = acc_S_mn[r, first + i] if visible else -Float32.inf
