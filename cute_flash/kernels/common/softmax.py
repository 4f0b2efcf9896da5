"""Online softmax over key blocks, in log2 space, for accumulators in mma.sync (C fragment) form.

Scores arrive unscaled; `scale_log2` = softmax_scale * log2(e) (or softcap * log2(e) when the
scores were already soft-capped), so p = 2^(s * scale_log2 - max * scale_log2) is one FFMA and
one MUFU.EX2 per element. A row whose max is still -inf (everything masked so far) uses 0 as
its reference instead, so no -inf - (-inf) is ever formed: such rows get p = 0, a rescale
factor 0, and at the end a sum of 0, which the epilogue turns into output 0 and LSE -inf.

Lazy rescale (`rescale_threshold` > 0, a compile-time choice): a row keeps its old maximum as
the reference while the new one exceeds it by at most `rescale_threshold` (log2 units, after
scaling), so P stays at most 2^threshold (256 for 8: well inside fp16 and bf16) and the row's
correction factor is exactly 1. The reference only ever moves up to a true running maximum, so
it never lags by more than the threshold; the row sum, O and the LSE (`row_max` holds the
reference) all use the same reference, so the result is the softmax's up to rounding. A row
that is still all -inf never keeps its reference (the test sees -inf), so a fully masked row
still ends with sum 0: output 0, LSE -inf.

Keep vote (`keep_vote`, with the lazy rescale; the sm_90 forward's `Sm90FwdConfig.keep_vote`):
a row keeps its reference iff each lane's part of it does, since (prev - m) * scale falls as m
grows, so a warp tests its lanes' own maxima and votes. When every row of the warp keeps, the
quad shuffles, the factor and the selects are skipped: the factors are 1 and the exponentials
use the kept reference, as the full path would (bitwise the same). Otherwise the warp takes the
full path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .utils import LN_2, acc_mn_view, exp2f, fadd, fmax, log2f, quad_allreduce


def rescale_factor(prev_max: Float32, ref_max: Float32, scale_log2: Float32) -> Float32:
    """2^((prev_max - ref_max) * scale_log2): exactly 1 while a row's max is unchanged.

    Not 2^(prev_max * scale_log2 - ref): the compiler contracts that into an FFMA whose result is
    the rounding error of the product, not 0, so every key block would scale the row sum by the
    same 1 + O(2^-24) and the LSE would drift with the number of blocks (2.7e-3 at 1M keys).
    """
    return exp2f((prev_max - ref_max) * scale_log2)


@dataclass(frozen=True)
class OnlineSoftmax:
    scale_log2: Float32
    row_max: cute.Tensor  # per thread row, already reduced over the quad: the exp reference
    row_sum: cute.Tensor  # per thread row, partial over this thread's columns
    rescale_threshold: cutlass.Constexpr[float] = 0.0  # > 0: lazy rescale (module docstring)
    # With the lazy rescale: a warp first votes on whether every row of it keeps its reference
    # (`probs`), and skips the rows' shuffles and selects when they all do
    keep_vote: cutlass.Constexpr[bool] = False

    @staticmethod
    def create(scale_log2: Float32, num_rows: int, rescale_threshold: float = 0.0,
               keep_vote: bool = False) -> "OnlineSoftmax":
        if keep_vote and not rescale_threshold > 0.0:
            raise ValueError("keep_vote skips the lazy rescale's bookkeeping: it needs a rescale_threshold")
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(scale_log2, row_max, row_sum, rescale_threshold, keep_vote)

    @cute.jit
    def step(self, acc_S: cute.Tensor, acc_O: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """Turn acc_S into probabilities (in place) and rescale acc_O for the new row maxima."""
        correction = cute.make_rmem_tensor(cute.size(self.row_max), Float32)
        if cutlass.const_expr(self.keep_vote and not is_first):
            # the factors are all 1 where the warp's rows all keep: O is rescaled on the other path only
            self.probs(acc_S, correction, is_first, moved=lambda: self.rescale(acc_O, correction))
        else:
            self.probs(acc_S, correction, is_first)
            if cutlass.const_expr(not is_first):
                self.rescale(acc_O, correction)

    @cute.jit
    def probs(self, acc_S: cute.Tensor, correction: cute.Tensor, is_first: cutlass.Constexpr[bool],
              midway=None, midway_at: cutlass.Constexpr[int] = 0, moved=None):
        """acc_S -> probabilities in place; `correction[r]` is the factor that rescales row r of
        O for the new maxima (left untouched on the first block, when O holds nothing yet).

        Split from the rescale for WGMMA pipelines: on sm_90 the P·V GEMM of the previous key
        block may still be running on acc_O when the new maxima are known, and the registers of
        an in-flight WGMMA must not be touched, so `rescale_O` runs once that GEMM is waited for.

        With the keep vote, `midway` (a Python callable, e.g. the wait for that GEMM) is traced
        once after the vote's branches, which hold the thread's first `midway_at` exponentials
        (row-major over its rows); the rest follow it, one code for both paths. ptxas moves
        neither across the branches' merge, so this places the wait among the exponentials.
        Without `midway` the branches hold all of them; without the vote `midway` follows the
        exponentials. `moved` (with the vote; a callable, e.g. O's rescale where no GEMM is in
        flight on it, as in `step`) is traced on the path where some row moves its reference,
        once the factors are known: on the other path they are all 1.
        """
        acc_S_mn = acc_mn_view(acc_S)
        if cutlass.const_expr(self.keep_vote and not is_first):
            # A row keeps its reference iff every lane's part of it does ((prev - m) * scale is
            # monotone in m, so the test of the quad's maximum is the AND of the lanes' tests),
            # so a warp whose lanes all keep all their rows needs no shuffle: each row's
            # reference, maximum and sum stay and its factor is 1, as in `quad_row` (bitwise the
            # same result). Otherwise the warp takes `quad_row`.
            num_rows = cute.size(acc_S_mn, mode=[0])
            num_exps = num_rows * cute.size(acc_S_mn, mode=[1])
            in_branches = num_exps if cutlass.const_expr(midway is None) else midway_at
            lane_max = cute.make_rmem_tensor(num_rows, Float32)
            keep = True
            for r in cutlass.range_constexpr(num_rows):
                lane_max[r] = acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                keep = keep & ((self.row_max[r] - lane_max[r]) * self.scale_log2 >= -self.rescale_threshold)
            refs = cute.make_rmem_tensor(num_rows, Float32)
            if cute.arch.vote_all_sync(keep):
                for r in cutlass.range_constexpr(num_rows):
                    correction[r] = Float32(1.0)
                    refs[r] = self.row_max[r] * self.scale_log2
                self.exp_span(acc_S_mn, refs, 0, in_branches)
            else:
                for r in cutlass.range_constexpr(num_rows):
                    refs[r], self.row_sum[r] = self.quad_row(r, lane_max[r], correction, is_first)
                if cutlass.const_expr(moved is not None):
                    moved()
                self.exp_span(acc_S_mn, refs, 0, in_branches)
            if cutlass.const_expr(midway is not None):
                midway()
                self.exp_span(acc_S_mn, refs, in_branches, num_exps)
        else:
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                lane_max = acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                ref, row_sum = self.quad_row(r, lane_max, correction, is_first)
                self.row_sum[r] = self.exp_row(acc_S_mn, r, ref, row_sum)
            if cutlass.const_expr(midway is not None):
                midway()

    @cute.jit
    def exp_row(self, acc_S_mn: cute.Tensor, r: cutlass.Constexpr[int], ref: Float32, row_sum: Float32) -> Float32:
        """Row r of the (rows, columns) view -> 2^(s * scale_log2 - ref) in place; returns
        `row_sum` plus them."""
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            p = exp2f(acc_S_mn[r, c] * self.scale_log2 - ref)
            acc_S_mn[r, c] = p
            row_sum += p
        return row_sum

    @cute.jit
    def exp_span(self, acc_S_mn: cute.Tensor, refs: cute.Tensor, start: cutlass.Constexpr[int],
                 stop: cutlass.Constexpr[int]):
        """`exp_row` over the thread's exponentials start..stop - 1 (row-major; row r by
        `refs[r]`), adding them to the rows' sums in `row_sum`."""
        num_cols = cute.size(acc_S_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            for c in cutlass.range_constexpr(num_cols):
                if cutlass.const_expr(start <= r * num_cols + c < stop):
                    p = exp2f(acc_S_mn[r, c] * self.scale_log2 - refs[r])
                    acc_S_mn[r, c] = p
                    self.row_sum[r] = self.row_sum[r] + p

    @cute.jit
    def quad_row(self, r: cutlass.Constexpr[int], lane_max: Float32, correction: cute.Tensor,
                 is_first: cutlass.Constexpr[bool]):
        """Row r's new maximum from its quad (`lane_max`: this lane's part of it), its factor in
        `correction[r]` (not on the first block); returns the row's exp reference and its sum
        rescaled, for `exp_row`."""
        new_max = quad_allreduce(lane_max, fmax)
        prev_max = self.row_max[r]
        if cutlass.const_expr(not is_first):
            new_max = fmax(prev_max, new_max)
        ref_max = 0.0 if new_max == -Float32.inf else new_max
        ref = ref_max * self.scale_log2
        row_sum = Float32(0.0)
        if cutlass.const_expr(not is_first):
            # The factor before the exponentials: O's rescale then depends only on the row
            # max, so it need not wait for the exp loop at the tail of the block.
            factor = rescale_factor(prev_max, ref_max, self.scale_log2)
            if cutlass.const_expr(self.rescale_threshold > 0.0):
                # false for a -inf prev_max (the product is -inf) and for NaN
                keep = (prev_max - ref_max) * self.scale_log2 >= -self.rescale_threshold
                ref_max = prev_max if keep else ref_max
                ref = ref_max * self.scale_log2
                new_max = prev_max if keep else new_max
                # A row with nothing accumulated yet (prev_max -inf: its O and sum are 0)
                # needs no rescale either, so that it does not force its warp's.
                unit = keep | (prev_max == -Float32.inf)
                factor = Float32(1.0) if unit else factor
            correction[r] = factor
            row_sum = self.row_sum[r] * factor
        self.row_max[r] = new_max
        return ref, row_sum

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, correction: cute.Tensor):
        """O *= the factors `probs` left in `correction`: `rescale_O`, or with the lazy rescale
        `rescale_O_unless_unit` (most blocks then keep every row's reference)."""
        if cutlass.const_expr(self.rescale_threshold > 0.0):
            OnlineSoftmax.rescale_O_unless_unit(acc_O, correction)
        else:
            OnlineSoftmax.rescale_O(acc_O, correction)

    @staticmethod
    @cute.jit
    def rescale_O(acc_O: cute.Tensor, correction: cute.Tensor):
        """Multiply row r of acc_O (mma.sync form) by correction[r]."""
        acc_O_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * correction[r]

    @staticmethod
    @cute.jit
    def rescale_O_unless_unit(acc_O: cute.Tensor, correction: cute.Tensor):
        """`rescale_O`, skipped by the whole warp when no row of it has a factor other than 1.

        Worth it with the lazy rescale, where most blocks keep every row's reference: the vote
        makes the branch warp-uniform, and each warp owns its rows of acc_O.
        """
        needed = correction[0] != 1.0
        for r in cutlass.range_constexpr(1, cute.size(correction)):
            needed = needed | (correction[r] != 1.0)
        if cute.arch.vote_any_sync(needed):
            OnlineSoftmax.rescale_O(acc_O, correction)

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor):
        """Normalise acc_O by the row sums and write the natural-log LSE of each row into `lse`."""
        acc_O_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            total = quad_allreduce(self.row_sum[r], fadd)
            empty = total == 0.0
            # NaN inputs give a NaN sum and stay NaN; only the all-masked row is special
            inv = 0.0 if empty else 1.0 / total
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * inv
            lse[r] = -Float32.inf if empty else (self.row_max[r] * self.scale_log2 + log2f(total)) * LN_2


def softmax_constants(softmax_scale: float, softcap: float) -> tuple:
    """(scale_log2, softcap_prescale) as the kernel takes them.

    With soft-capping the kernel computes tanh(s * scale / softcap) and the softmax then runs on
    softcap * tanh(...), i.e. with scale softcap in natural-log space.
    """
    if softcap > 0:
        return softcap * math.log2(math.e), softmax_scale / softcap
    return softmax_scale * math.log2(math.e), 1.0
