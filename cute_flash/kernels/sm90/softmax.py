"""Online softmax whose O rescale is a separate step, for WGMMA pipelines.

`OnlineSoftmax.step` rescales acc_O as soon as the new row maxima are known. On sm_90 the
P·V GEMM of the previous key block may still be running on acc_O at that point (intra-
warpgroup overlap): the registers of an in-flight WGMMA must not be touched. So `probs` does the
row max, the exponentials and the row sums, and hands back the per-row correction factors;
`rescale_O` applies them once the GEMM has been waited for. The arithmetic (log2 space, the
-inf-safe reference of fully masked rows) is exactly `OnlineSoftmax`'s, and `finalize` is its.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.softmax import OnlineSoftmax, rescale_factor
from ..common.utils import acc_mn_view, exp2f, fmax, quad_allreduce


@dataclass(frozen=True)
class DeferredRescaleSoftmax(OnlineSoftmax):
    @staticmethod
    def create(scale_log2: Float32, num_rows: int) -> "DeferredRescaleSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return DeferredRescaleSoftmax(scale_log2, row_max, row_sum)

    @cute.jit
    def probs(self, acc_S: cute.Tensor, correction: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """acc_S (mma.sync form) -> probabilities in place; `correction[r]` rescales row r of O.

        On the first block O holds nothing yet and `correction` is left untouched.
        """
        acc_S_mn = acc_mn_view(acc_S)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            row = acc_S_mn[r, None].load()
            new_max = quad_allreduce(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), fmax)
            prev_max = self.row_max[r]
            if cutlass.const_expr(not is_first):
                new_max = fmax(prev_max, new_max)
            ref_max = 0.0 if new_max == -Float32.inf else new_max
            ref = ref_max * self.scale_log2
            row_sum = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                p = exp2f(acc_S_mn[r, c] * self.scale_log2 - ref)
                acc_S_mn[r, c] = p
                row_sum += p
            if cutlass.const_expr(is_first):
                self.row_sum[r] = row_sum
            else:
                factor = rescale_factor(prev_max, ref_max, self.scale_log2)
                self.row_sum[r] = self.row_sum[r] * factor + row_sum
                correction[r] = factor
            self.row_max[r] = new_max

    @staticmethod
    @cute.jit
    def rescale_O(acc_O: cute.Tensor, correction: cute.Tensor):
        """Multiply row r of acc_O (mma.sync form) by correction[r]."""
        acc_O_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * correction[r]
