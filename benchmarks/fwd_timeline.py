"""Where the sm_90 forward's time goes: the profiling build's per-tile timeline, on an H100/H200.

    python benchmarks/fwd_timeline.py                          # hd 64/128/256, 2 x 8192, both masks
    python benchmarks/fwd_timeline.py --head-dims 128 --causal no --set lazy_rescale=0

The profiling build (`Sm90FwdConfig.timeline`) stamps each tile with the global nanosecond timer
(start, Q in, first key block done, last key block done, epilogue done) and counts, in thread 0
of each consumer warpgroup, the SM clock cycles of each phase of a later key block (`PHASES`),
summed over the tile's blocks. Its records overwrite the LSE of each tile's first 32 query rows;
O is unchanged. Per case this prints the forward's milliseconds (do_bench medians, the builds
timed in turns) with the shipped and the profiling build, the SM clock, per tile the mean
microseconds before its first block, of its first block, of a later block and of its epilogue,
the SMs' time inside tiles, between them and idle at the end, and per warpgroup the cycles per
block of each phase.
`--set flag=value` overrides configuration flags.
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

PHASES = ("K wait", "turn wait", "S + P·V issue", "S wait", "softmax", "P·V wait", "rescale + P")
RECORD_INTS = 32  # smid, blocks, 5 stamps, pad, up to 3 x (7 phases + blocks)
HEADS = {64: 32, 96: 21, 128: 16, 192: 10, 256: 8}


@dataclass
class Summary:
    tiles: int
    sms: int
    span_us: float
    clock_ghz: float
    prologue_us: float  # start to Q in
    first_block_us: float
    block_us: float  # a later key block (tiles with more than two)
    epilogue_us: float
    busy: float  # shares of SM time (SMs x span)
    between: float
    idle_end: float
    phases: list  # per warpgroup: cycles per later block of each phase


def clock_rate(records, warpgroups: int) -> float:
    """GHz: the cycles the tile with the most key blocks counted over its later blocks (the
    larger warpgroup sum) over their nanoseconds (first block done to last block done)."""
    longest = max(records, key=lambda r: (r[5] - r[4]) % (1 << 32))
    cycles = max(sum(longest[8 + 8 * wg + i] for i in range(len(PHASES))) for wg in range(warpgroups))
    return cycles / ((longest[5] - longest[4]) % (1 << 32) or 1)


def summarize(records, warpgroups: int, clock_ghz: float) -> Summary:
    """The summary of one launch's records (rows of `RECORD_INTS` ints; unsigned 32-bit values)."""
    rows = unwrap_rows([r for r in records if r[1] > 0], 2, 5)  # tiles that see no key record no stamps
    sms, span, busy, between, idle_end = sm_time(rows, 2, 6)
    later = [r for r in rows if r[1] > 2]
    return Summary(
        tiles=len(rows), sms=sms, span_us=span / 1000, clock_ghz=clock_ghz,
        prologue_us=mean_us(r[3] - r[2] for r in rows),
        first_block_us=mean_us(r[4] - r[3] for r in rows),
        block_us=mean_us((r[5] - r[4]) / (r[1] - 1) for r in later),
        epilogue_us=mean_us(r[6] - r[5] for r in rows),
        busy=busy, between=between, idle_end=idle_end,
        phases=phase_means(rows, warpgroups, len(PHASES)),
    )


def format_summary(s: Summary) -> str:
    return summary_text(s, s.tiles, "tile", [("to Q in", s.prologue_us), ("first key block", s.first_block_us)],
                        "block", s.block_us, PHASES)


def tile_records(lse, tile_m: int):
    """(tiles, RECORD_INTS) int64 records from a (b, h, s) float32 LSE: the first 32 rows of every
    tile with at least 32 rows in the sequence."""
    import torch

    s = lse.shape[-1]
    ints = lse.view(torch.int32)
    starts = [m * tile_m for m in range((s + tile_m - 1) // tile_m) if s - m * tile_m >= 32]
    rows = torch.stack([ints[..., m:m + RECORD_INTS] for m in starts], dim=-2)
    return (rows.reshape(-1, RECORD_INTS).to(torch.int64) % (1 << 32)).tolist()


def on_gpu(opts) -> None:
    import torch

    from bench_lib import interleaved_rounds
    from cute_flash.backends import get_backend
    from cute_flash.backends.base import AttnArgs

    backend = get_backend("cute-sm90")
    ka = backend.cache.args
    b, s = opts.batch, opts.seqlen
    for d in opts.head_dims:
        for causal in opts.causal:
            h = HEADS[d]
            args = AttnArgs(softmax_scale=d ** -0.5, causal=causal, window_right=0 if causal else -1)
            gen = torch.Generator(device="cuda").manual_seed(1)
            q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(3))
            out = torch.empty_like(q)
            lse = torch.empty(b, h, s, device="cuda")
            shipped = apply_overrides(backend.config(q, k, v, lse, args), opts.overrides)
            profiled = replace(shipped, timeline=True)

            def run(config):
                fn = backend.cache.get(config, backend.arch())[0]
                backend.launch(fn, q, k, v, out, lse, args, ka, extra=backend.launch_extra(config, q, k, args, ka))

            times = interleaved_rounds({"shipped": lambda: run(shipped), "profiling": lambda: run(profiled)},
                                       opts.rounds, rep_ms=80)
            run(profiled)
            torch.cuda.synchronize()
            records = tile_records(lse, profiled.tile_m)
            if opts.save:
                torch.save({"config": profiled.name, "records": records},
                           f"{opts.save}-hd{d}-{'causal' if causal else 'full'}.pt")
            wgs = profiled.num_consumer_wgs
            summary = summarize(records, wgs, clock_rate(records, wgs))
            print(f"hd{d} {'causal' if causal else 'full'} {b}x{s}x{h} ({profiled.name}): ms " + ", ".join(
                f"{k} {'/'.join(f'{t:.3f}' for t in v)}" for k, v in times.items()), flush=True)
            print(format_summary(summary), flush=True)


def main(argv=None) -> int:
    p = timeline_parser(__doc__.splitlines()[0], [64, 128, 256], "lazy_rescale=0,keep_vote=0,pv_wait_at=-1")
    on_gpu(parse_timeline_args(p, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
