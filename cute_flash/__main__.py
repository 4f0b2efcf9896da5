"""The demo: `python -m cute_flash` runs `forward` on the best backend available on a realistic
shape and reports the backend, the error against a float64 reference and the speed."""

from __future__ import annotations

import argparse
import time

import torch

import cute_flash
from cute_flash.backends.base import AttnArgs
from cute_flash.backends.reference import reference_attention


def _time(fn, repeats: int, cuda: bool) -> float:
    fn()  # warm-up (compiles kernels on first use)
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4 if cuda else 1)
    parser.add_argument("--seqlen", type=int, default=4096 if cuda else 1024)
    parser.add_argument("--nheads", type=int, default=16 if cuda else 8)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--repeats", type=int, default=20 if cuda else 2)
    a = parser.parse_args(argv)

    info = cute_flash.backend_info()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (a.batch, a.seqlen, a.nheads, a.headdim)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(3))
    backend, reason = info["backend"], info["reason"]
    if not cuda:
        backend = "reference"
    elif backend in info["unavailable"]:
        reason = f"the default, {backend}, is unavailable: {info['unavailable'][backend]}"
        backend = "reference"
    print(f"cute_flash {cute_flash.__version__}: backend {backend} ({reason})")
    print(f"shape (batch, seqlen, nheads, headdim) = {shape}, {dtype}, causal={a.causal}")

    out = cute_flash.forward(q, k, v, causal=a.causal, backend=backend)
    # The float64 reference of the first sequence (the whole batch is costly on the CPU).
    ref, _ = reference_attention(q[:1], k[:1], v[:1], AttnArgs(softmax_scale=a.headdim**-0.5, causal=a.causal,
                                 window_right=0 if a.causal else -1), compute_dtype=torch.float64)
    err = (out[:1].double() - ref).abs().max().item()
    seconds = _time(lambda: cute_flash.forward(q, k, v, causal=a.causal, backend=backend), a.repeats, cuda)
    flops = 4 * a.batch * a.nheads * a.seqlen * a.seqlen * a.headdim / (2 if a.causal else 1)
    print(f"max |out - reference(float64)| = {err:.3e}")
    print(f"time {seconds * 1e3:.3f} ms, {flops / seconds / 1e12:.2f} TFLOP/s")


if __name__ == "__main__":
    main()
