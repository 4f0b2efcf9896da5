"""What the profiling builds' records have in common (`bwd_timeline.py`, `fwd_timeline.py`):
rows of int32s, each with the SM in column 0, low 32 bits of the global nanosecond timer in a
run of columns, and per consumer warpgroup w, from column 8 + 8w, the SM clock cycles of each
phase summed over the row's steps followed by their count. Pure Python; the CPU tests cover it."""

from __future__ import annotations


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


def mean_us(values) -> float:
    """The mean of nanosecond values, in microseconds (nan for none)."""
    values = list(values)
    return sum(values) / len(values) / 1000 if values else float("nan")
