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
