"""Where the sm_90 backward's time goes: the profiling build's per-CTA timeline, on an H100/H200.

    python benchmarks/bwd_timeline.py                          # hd 128, 2 x 8192 x 16, both masks
    python benchmarks/bwd_timeline.py --head-dims 128,192 --causal yes --set stats_early=1

The profiling build (`Sm90BwdConfig.timeline`) stamps each CTA with the global nanosecond timer
(start, K and V in, first query block in, third query block in, end of the walk, end of the
epilogue) and counts, in thread 0 of each consumer warpgroup, the SM clock cycles of each phase
of a step, summed over its steps. Its records overwrite the first row of each CTA's dK tile, so
its dK is not a gradient; nothing else changes. Per case this prints:

* the backward's milliseconds (do_bench median) of the shipped build and of the profiling
  build, so that the counters' own cost shows;
* the SM clock the CTAs ran at (cycles over nanoseconds: an H200 at its 700 W limit runs well
  below its 1980 MHz);
* per CTA, the mean microseconds before its first step can start, of its first two steps (the
  masked ones on a causal diagonal), of a later step, and of its epilogue;
* the share of the SMs' time spent inside CTAs, between them and idle at the end (the last
  wave), and how that busy time splits into the above;
* per consumer warpgroup, the cycles per step of each phase (`PHASES`).

`--set flag=value` overrides configuration flags (as `ab_sm90_bwd.py` flips them), e.g. to see
which phase a flag moves. Head dim 64's 128-row tile has no registers for the counters; its
calls are measured on the 64-row tile (`--set tile_m=64,dq_rows=0,dq_split=1`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timeline_lib import (  # noqa: E402
    apply_overrides, mean_us, parse_timeline_args, phase_means, sm_time, summary_text, timeline_parser,
    unwrap_rows,
)

PHASES = ("Q/dO wait", "S issue + wait", "P + dP wait", "dS + barrier", "dQ GEMM", "dQ hand-over", "dK wait + release")
RECORD_INTS = 24  # smid, steps, 6 stamps, 2 x (7 phases + steps)


@dataclass
class Summary:
    ctas: int
    sms: int
    span_us: float
    clock_ghz: float
    prologue_us: float  # start to the first query block's Q in
    first_two_us: float  # the first two steps (CTAs with more than two)
    step_us: float  # a later step (CTAs with more than four)
    epilogue_us: float
    busy: float  # shares of SM time (SMs x span)
    between: float
    idle_end: float
    phases: list  # per warpgroup: cycles per step of each phase
    outside: list  # per warpgroup: cycles per step of the walk that no phase counted


def summarize(records, clock_ghz: float) -> Summary:
    """The summary of one launch's records (rows of `RECORD_INTS` ints, as the kernel wrote
    them; unsigned 32-bit values). `clock_ghz`: the SM clock the phase cycles are converted at
    (from `clock_rate`)."""
    rows = unwrap_rows(records, 2, 6)
    sms, span, busy, between, idle_end = sm_time(rows, 2, 7)
    long2 = [r for r in rows if r[1] > 2]
    long4 = [r for r in rows if r[1] > 4]
    phases = phase_means(rows, 2, len(PHASES))
    walk_cycles = sum(r[6] - r[3] for r in rows) * clock_ghz
    outside = [walk_cycles / (sum(r[15 + 8 * wg] for r in rows) or 1) - sum(phases[wg]) for wg in range(2)]
    return Summary(
        ctas=len(rows), sms=sms, span_us=span / 1000, clock_ghz=clock_ghz,
        prologue_us=mean_us(r[4] - r[2] for r in rows),
        first_two_us=mean_us(r[5] - r[4] for r in long2),
        step_us=mean_us((r[6] - r[5]) / (r[1] - 2) for r in long4),
        epilogue_us=mean_us(r[7] - r[6] for r in rows),
        busy=busy, between=between, idle_end=idle_end, phases=phases, outside=outside,
    )


def clock_rate(records) -> float:
    """GHz: the cycles the longest CTA's warpgroups counted over its walk (every phase of every
    step; the larger of the two sums) over the walk's nanoseconds (K and V in to its end). A
    warpgroup may count less than the walk: `Summary.outside` says how much."""
    longest = max(records, key=lambda r: (r[6] - r[3]) % (1 << 32))
    cycles = max(sum(longest[8 + 8 * wg + i] for i in range(len(PHASES))) for wg in range(2))
    return cycles / ((longest[6] - longest[3]) % (1 << 32) or 1)


def format_summary(s: Summary) -> str:
    return summary_text(s, s.ctas, "CTA", [("to the first step", s.prologue_us), ("first two steps", s.first_two_us)],
                        "step", s.step_us, PHASES, s.outside)


def on_gpu(opts) -> None:
    import torch

    from ab_sm90_bwd import problem, run_backward
    from bench_lib import interleaved_rounds
    from cute_flash.kernels.sm90.bwd_config import make_config

    b, s = opts.batch, opts.seqlen
    for d in opts.head_dims:
        for causal in opts.causal:
            h = opts.hidden // d
            args, tensors, grads = problem(b, s, h, d, causal)
            shipped = apply_overrides(make_config("bfloat16", d, d, causal=causal), opts.overrides)
            if shipped.keys_n:
                raise SystemExit(f"head dim {d}: the 96-key tile (keys_n) has no profiling build; "
                                 "--set keys_n=0,single_dout=0 profiles the 64-key tile instead")
            profiled = replace(shipped, timeline=True)
            times = interleaved_rounds({"shipped": lambda: run_backward(shipped, *tensors, grads, args),
                                        "profiling": lambda: run_backward(profiled, *tensors, grads, args)},
                                       opts.rounds, rep_ms=80)
            run_backward(profiled, *tensors, grads, args)
            torch.cuda.synchronize()
            rows = grads[1].view(torch.int32)[:, ::profiled.tile_n, :, :RECORD_INTS]
            records = (rows.reshape(-1, RECORD_INTS).to(torch.int64) % (1 << 32)).tolist()
            if opts.save:
                mask = "causal" if causal else "full"
                torch.save({"config": profiled.name, "records": records}, f"{opts.save}-hd{d}-{mask}.pt")
            summary = summarize(records, clock_rate(records))
            label = f"hd{d} {'causal' if causal else 'full'} {b}x{s}x{h}"
            print(f"{label} ({profiled.name}): ms " + ", ".join(
                f"{k} {'/'.join(f'{t:.3f}' for t in v)}" for k, v in times.items()), flush=True)
            print(format_summary(summary), flush=True)


def main(argv=None) -> int:
    p = timeline_parser(__doc__.splitlines()[0], [128], "stats_early=1,dq_fence_late=0")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head dim")
    on_gpu(parse_timeline_args(p, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
