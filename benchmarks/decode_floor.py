"""The floor of a decode timing: what one CUDA-graph replay costs before any byte is read, and
how fast one kernel reads the bytes of a decode step, timed as the decode benchmark times them
(GPU only).

`bench_attention.py --cuda-graph` and `ab_paged_decode.py` time a decode step as
`triton.testing.do_bench(graph.replay)`: CUDA events around each replay, the L2 cache flushed
before it. A replay then costs a fixed time even for a kernel that does nothing, and a step that
reads B bytes cannot take less than that time plus B over the memory bandwidth. This script
measures both parts the same way:

* `tiny`: a graph of one kernel that adds 1 to 1024 floats (and of two such kernels);
* `read`: a graph of one `torch.sum` (float32 accumulation) over the K and V bytes of a decode
  step, for each batch and KV length asked for (32 query heads over 8 KV heads, head dim 128,
  bf16 as in the decode benchmark: 2 * batch * keys * 8 * 128 * 2 bytes);
* `bandwidth`: the same sum over a large buffer (`--bandwidth-mib`), the read bandwidth a
  decode kernel can at best approach.

It then prints, for each decode shape, the best TB/s a decode step could report if it read its
bytes at that bandwidth after the fixed cost of a one-kernel replay.

    python benchmarks/decode_floor.py
    python benchmarks/decode_floor.py --batches 1,16 --seqlens 8k,32k
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_lib import capture_graph, make_timer, parse_sizes


def replay_us(timer, fn) -> float:
    """us of one replay of a CUDA graph captured around `fn`, as `timer` measures it."""
    graph, _ = capture_graph(fn)
    us = timer(graph.replay) * 1e3
    del graph
    return us


def read_us(timer, numel: int) -> float:
    """us of one replayed float32 sum over `numel` bf16 elements."""
    kv = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    return replay_us(timer, lambda: kv.sum(dtype=torch.float32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,128")
    p.add_argument("--seqlens", default="8k,32k", help="keys per sequence")
    p.add_argument("--bandwidth-mib", type=int, default=8192, help="size of the buffer that gives the bandwidth")
    p.add_argument("--warmup", type=float, default=10, help="ms")
    p.add_argument("--rep", type=float, default=50, help="ms")
    args = p.parse_args(argv)

    timer_name, timer = make_timer(args.warmup, args.rep)
    print(f"# {torch.cuda.get_device_name()}; {timer_name} of CUDA-graph replays (L2 flushed before each)")
    x = torch.zeros(1024, device="cuda")
    tiny1 = replay_us(timer, lambda: x.add_(1))
    tiny2 = replay_us(timer, lambda: (x.add_(1), x.add_(1)))
    print(f"tiny: one kernel {tiny1:.2f} us, two kernels {tiny2:.2f} us")

    big = args.bandwidth_mib << 19
    big_us = read_us(timer, big)
    bandwidth = big * 2 / (big_us * 1e-6)
    print(f"bandwidth: sum over {args.bandwidth_mib} MiB in {big_us:.1f} us = {bandwidth / 1e12:.2f} TB/s")

    print(f"{'batch':>5} {'keys':>6} {'MB':>7} {'read us':>8} {'read TB/s':>9} {'bound us':>8} {'bound TB/s':>10}")
    for batch in parse_sizes(args.batches):
        for keys in parse_sizes(args.seqlens):
            numel = 2 * batch * keys * 8 * 128
            nbytes = numel * 2
            read = read_us(timer, numel)
            bound = tiny1 + nbytes / bandwidth * 1e6
            print(f"{batch:>5} {keys:>6} {nbytes / 1e6:>7.1f} {read:>8.1f} {nbytes / (read * 1e-6) / 1e12:>9.2f} "
                  f"{bound:>8.1f} {nbytes / (bound * 1e-6) / 1e12:>10.2f}", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
