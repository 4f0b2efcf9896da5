"""Host time per call of `cute_flash.forward`, `cute_flash.attention` and a forward + backward
step, eager, through the direct path and through the torch.library op, on a CUDA GPU.

    python benchmarks/host_time.py                       # b2 x 256 x 16 heads, hd128, causal
    python benchmarks/host_time.py --batch 8 --seqlen 2048 --no-causal

Host time is what the Python call takes to return while the GPU is kept busy (a sleep kernel
queued first), so no launch waits for the device, in two ways: the mean over `--calls` calls made
back to back (the steady state of a training or serving loop), and the median of single calls,
each made right after the host waited for the GPU (a cold call: caches and the launch path
after an idle spell). The op path
is taken by telling `forward` / `attention` a tracer is active (`cute_flash._plain_eager`
patched to False), which is where torch.compile, torch.export and dispatch modes send them.
With a kernel shorter than its host time, do_bench-style timings measure this instead of the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cute_flash  # noqa: E402


# GPU clock cycles of sleep queued ahead of each call (a few ms at H100/H200 clocks: longer than
# any call's host time here)
SLEEP_CYCLES_PER_CALL = 8_000_000


def host_us(fn, calls: int) -> tuple:
    """(mean µs of `calls` back-to-back calls, median µs of `calls` single calls)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * calls)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    back_to_back = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    single = []
    for _ in range(calls):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES_PER_CALL)
        start = time.perf_counter()
        fn()
        single.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return back_to_back * 1e6, statistics.median(single) * 1e6


@contextlib.contextmanager
def op_path(on: bool):
    if not on:
        yield
        return
    plain = cute_flash._plain_eager
    cute_flash._plain_eager = lambda *tensors: False
    try:
        yield
    finally:
        cute_flash._plain_eager = plain


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    causal = not args.no_causal
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, dtype=torch.bfloat16, device="cuda")

    def forward():
        with torch.no_grad():
            cute_flash.forward(q, k, v, causal=causal)

    def attention():
        cute_flash.attention(q, k, v, causal=causal)

    def step():
        q.grad = k.grad = v.grad = None
        cute_flash.attention(q, k, v, causal=causal).backward(dout)

    print(f"{torch.cuda.get_device_name()}, bf16, q/k/v {shape}, causal={causal}, "
          f"backend {cute_flash.backend_info()['backend']}")
    print("host µs per call: back-to-back mean / single-call median")
    for name, fn in (("forward", forward), ("attention", attention), ("forward + backward", step)):
        row = []
        for through_op in (False, True):
            with op_path(through_op):
                row.append("{:6.0f} / {:6.0f}".format(*host_us(fn, args.calls)))
        print(f"{name:20s} direct {row[0]}   through the op {row[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
