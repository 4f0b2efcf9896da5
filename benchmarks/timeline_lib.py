"""What the profiling builds' records have in common (`bwd_timeline.py`, `fwd_timeline.py`):
rows of int32s, each with the SM in column 0, low 32 bits of the global nanosecond timer in a
run of columns, and per consumer warpgroup w, from column 8 + 8w, the SM clock cycles of each
phase summed over the row's steps followed by their count. Pure Python; the CPU tests cover it."""

from __future__ import annotations

import argparse
from dataclasses import replace


def unwrap(stamps):
    """The low 32 bits of the nanosecond timer -> nanoseconds since the earliest stamp (a kernel
    runs for far less than the 4.3 s the 32 bits span)."""
    ref = stamps[0]
    signed = [(t - ref) % (1 << 32) for t in stamps]
    signed = [d - (1 << 32) if d >= 1 << 31 else d for d in signed]
    first = min(signed)
    return [d - first for d in signed]


def unwrap_rows(records, first: int, count: int) -> list:
    """Copies of the rows with their `count` stamps from column `first` unwrapped together."""
    rows = [list(r) for r in records]
    flat = unwrap([t for r in rows for t in r[first:first + count]])
    for i, r in enumerate(rows):
        r[first:first + count] = flat[count * i: count * i + count]
    return rows


def sm_time(rows, start: int, end: int) -> tuple:
    """(SMs, span ns, and the shares of the SMs' time (SMs x span) inside rows, between rows on
    the same SM and idle after an SM's last row) for rows that occupy their SM (column 0) from
    stamp column `start` to `end`."""
    first = min(r[start] for r in rows)
    last = max(r[end] for r in rows)
    by_sm = {}
    for r in rows:
        by_sm.setdefault(r[0], []).append(r)
    busy = sum(r[end] - r[start] for r in rows)
    between = idle_end = 0
    for on_sm in by_sm.values():
        on_sm.sort(key=lambda r: r[start])
        between += sum(max(0, b[start] - a[end]) for a, b in zip(on_sm, on_sm[1:]))
        idle_end += last - on_sm[-1][end]
    total = (last - first) * len(by_sm) or 1
    return len(by_sm), last - first, busy / total, between / total, idle_end / total


def phase_means(rows, warpgroups: int, phases: int) -> list:
    """Per warpgroup: the cycles per step of each phase, over all rows."""
    out = []
    for wg in range(warpgroups):
        base = 8 + 8 * wg
        steps = sum(r[base + 7] for r in rows) or 1
        out.append([sum(r[base + i] for r in rows) / steps for i in range(phases)])
    return out


def summary_text(s, count: int, unit: str, timings, step: str, step_us: float, phase_names,
                 outside=None) -> str:
    """The profiling tools' printout of a summary `s` (its sms, span_us, clock_ghz, epilogue_us,
    busy, between, idle_end and phases): `count` records, each a `unit` (CTA, tile); `timings`
    the (label, microseconds) of a record's time before its later steps; `step` what a step is
    called (step, key block) and `step_us` a later one's time; `outside` per warpgroup the
    cycles per step that no phase counted, where the tool has them."""
    lines = [
        f"  {count} {unit}s on {s.sms} SMs over {s.span_us:.0f} us, SM clock {s.clock_ghz:.2f} GHz",
        f"  per {unit} (us): " + ", ".join(f"{label} {us:.2f}" for label, us in timings)
        + f", a later {step} {step_us:.3f} ({step_us * s.clock_ghz * 1000:.0f} cycles), epilogue {s.epilogue_us:.2f}",
        f"  SM time: in {unit}s {s.busy:.3f}, between {unit}s {s.between:.4f}, idle at the end {s.idle_end:.4f}",
    ]
    for wg, ph in enumerate(s.phases):
        tail = f" | sum {sum(ph):.0f}" + (f", outside the phases {outside[wg]:.0f}" if outside is not None else "")
        lines.append(f"  warpgroup {wg} cycles per {step}: "
                     + ", ".join(f"{n} {c:.0f}" for n, c in zip(phase_names, ph)) + tail)
    return "\n".join(lines)


def mean_us(values) -> float:
    """The mean of nanosecond values, in microseconds (nan for none)."""
    values = list(values)
    return sum(values) / len(values) / 1000 if values else float("nan")


def parse_overrides(text: str) -> dict:
    """'stats_early=1,tile_m=64' -> {'stats_early': True, 'tile_m': 64} (0/1 are booleans for
    boolean flags, which `apply_overrides` checks)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value)
    return out


def apply_overrides(config, overrides: dict):
    values = {}
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise SystemExit(f"--set: the configuration has no flag {key!r}")
        values[key] = bool(value) if isinstance(getattr(config, key), bool) else value
    return replace(config, **values)


def timeline_parser(description: str, head_dims: list, set_example: str) -> argparse.ArgumentParser:
    """The arguments both profiling tools take."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--head-dims", type=lambda x: [int(v) for v in x.split(",")], default=head_dims)
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--save", default="", help="also save each case's records to SAVE-hd<d>-<mask>.pt")
    p.add_argument("--set", dest="overrides", type=parse_overrides, default={},
                   help=f"configuration flags to override, e.g. {set_example}")
    return p


def parse_timeline_args(p: argparse.ArgumentParser, argv):
    """`p`'s arguments, --causal as the list of masks to run."""
    opts = p.parse_args(argv)
    opts.causal = {"no": [False], "yes": [True], "both": [False, True]}[opts.causal]
    return opts
