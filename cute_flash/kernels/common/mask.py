"""Score masking: key-length tails, causal (bottom-right aligned) and sliding windows.

Masked scores are set (not added) to -inf before the row max, so garbage can never leak
through a masked score, and the softmax guards rows whose max is -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .utils import acc_mn_view


@dataclass(frozen=True)
class AttentionMask:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    seqlen_q: Int32
    seqlen_k: Int32
    window_left: Int32  # effective (>= 0), used only by local masks
    window_right: Int32

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
        once this thread's own offset has been moved into the (per-row) limit.
        """
        acc_S_mn = acc_mn_view(acc_S)
        thr_row, thr_col = tScS_mn[0, 0]
        col_base = n_block * self.tile_n + thr_col
        if cutlass.const_expr(not mask_causal and not mask_local):
            if cutlass.const_expr(mask_seqlen):
                col_end = self.seqlen_k - col_base
                for c in cutlass.range_constexpr(cute.size(tScS_mn, mode=[1])):
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
                for c in cutlass.range_constexpr(cute.size(tScS_mn, mode=[1])):
                    col = t0ScS_mn[0, c][1]
                    hidden = col >= col_end
                    if cutlass.const_expr(mask_local):
                        hidden = hidden | (col < col_begin)
                    acc_S_mn[r, c] = -Float32.inf if hidden else acc_S_mn[r, c]
