"""The clock reads of the sm_90 kernels' profiling builds (`timeline` in `Sm90FwdConfig` and
`Sm90BwdConfig`): compiled out unless the configuration asks for them."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class TimelineCounters:
    """Mixin of a kernel class whose `cfg` has a `timeline` flag."""

    @cute.jit
    def stamp(self, stamps, i: cutlass.Constexpr):
        """`timeline`: the low 32 bits of the global nanosecond timer into `stamps[i]`."""
        if cutlass.const_expr(self.cfg.timeline):
            stamps[i] = cute.arch.globaltimer_lo()

    @cute.jit
    def tick(self, phases, i: cutlass.Constexpr, last):
        """`timeline`: the SM clock now; the cycles since `last` are added to phase `i` (none for
        `i` = -1). Without `timeline` nothing is read."""
        now = last
        if cutlass.const_expr(self.cfg.timeline):
            now = Int32(cute.arch.clock64())
            if cutlass.const_expr(i >= 0):
                phases[i] = phases[i] + (now - last)
        return now

    @cute.jit
    def write_record(self, row, stamps, num_stamps: cutlass.Constexpr, phases, count, ctidx, wg_idx):
        """A profiling record into `row` (int32s): the SM, `count` (the steps or key blocks) and
        the `num_stamps` stamps from thread 0, and from thread 0 of each consumer warpgroup w
        its phase cycles and step count from column 8 + 8w."""
        if ctidx == 0:
            row[0] = cute.arch.smid()
            row[1] = count
            for i in cutlass.range_constexpr(num_stamps):
                row[2 + i] = stamps[i]
        if ctidx % 128 == 0:
            for i in cutlass.range_constexpr(cute.size(phases)):
                row[8 + wg_idx * 8 + i] = phases[i]
