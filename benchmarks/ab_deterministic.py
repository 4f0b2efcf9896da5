"""What `deterministic=True` costs on an H100/H200, in two tables (bf16, batch x seqlen x heads,
default 2 x 8192 x 16 at head dim 128, causal and not; `triton.testing.do_bench` medians of
`--rounds` rounds, the labels of a table taking turns in an order reversed every other round
(`bench_lib.interleaved_rounds`), each cell the median and the range over the rounds):

* backward: cute-sm90's `bwd` (preprocess, main, postprocess kernels) on its own sm_90 kernel,
  deterministic or not, and deterministic on the sm_80 kernels (`native_backward = False`, the
  path deterministic calls took before the sm_90 kernel had the mode); TFLOP/s = 2.5 x 4·b·h·s²·d;
* forward + backward through autograd: `cute_flash.attention` and flash-attn-4's
  `flash_attn_func` (when importable), deterministic or not; TFLOP/s = 3.5 x 4·b·h·s²·d.

Both halved when causal.

    python benchmarks/ab_deterministic.py                       # GPU, three rounds
    python benchmarks/ab_deterministic.py --head-dim 64 --heads 32 --rounds 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def summary(flops: float, times_ms: list) -> str:
    """'median (min-max)' TFLOP/s of the rounds' median times."""
    rates = sorted(flops / ms * 1e-9 for ms in times_ms)
    return f"{rates[len(rates) // 2]:.1f} ({rates[0]:.1f}-{rates[-1]:.1f})"


def backward_table(b: int, s: int, h: int, d: int, causal: bool, rounds: int) -> dict:
    import torch
    from bench_lib import interleaved_rounds

    import cute_flash
    from cute_flash.backends import get_backend
    from cute_flash.backends.base import AttnArgs

    backend = get_backend("cute-sm90")
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    args = AttnArgs(softmax_scale=d ** -0.5, causal=causal, window_right=0 if causal else -1)
    out, lse = cute_flash.attention(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

    def runner(native: bool, det: bool):
        def run():
            backend.native_backward = native  # the path is chosen per call, so each run sets it
            backend.bwd(dout, q, k, v, out, lse, None, dq, dk, dv, args, det)
        return run

    runs = {label: runner(native, det)
            for label, native, det in (("sm90", True, False), ("sm90 det", True, True), ("sm80 det", False, True))}
    try:
        for run in runs.values():  # compile before any timing
            run()
        torch.cuda.synchronize()
        times = interleaved_rounds(runs, rounds)
    finally:
        backend.native_backward = True
    return {label: summary(flops, times[label]) for label in runs}


def fwd_bwd_table(b: int, s: int, h: int, d: int, causal: bool, rounds: int) -> dict:
    import torch
    from bench_lib import interleaved_rounds

    import cute_flash

    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError:
        flash_attn_func = None
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    do = torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda")
    flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    res, runs = {}, {}
    for label, det in (("cute", False), ("cute det", True), ("fa4", False), ("fa4 det", True)):
        if label.startswith("fa4"):
            if flash_attn_func is None:
                continue
            attend = lambda det=det: flash_attn_func(q, k, v, causal=causal, deterministic=det)  # noqa: E731
        else:
            attend = lambda det=det: cute_flash.attention(q, k, v, causal=causal, deterministic=det,  # noqa: E731
                                                          backend="cute-sm90")

        def step(attend=attend):
            out = attend()
            (out[0] if isinstance(out, tuple) else out).backward(do)

        try:
            step()  # compile, and find out whether the provider takes the call at all
            runs[label] = step
        except Exception as exc:  # a peer that refuses the call must not hide the others
            res[label] = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
    torch.cuda.synchronize()
    times = interleaved_rounds(runs, rounds, grad_to_none=[q, k, v])
    return {**{label: summary(flops, times[label]) for label in runs}, **res}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    opts = p.parse_args(argv)
    shape = (opts.batch, opts.seqlen, opts.heads, opts.head_dim)
    for causal in (False, True):
        mask = "causal" if causal else "full"
        name = f"hd{opts.head_dim} {opts.batch}x{opts.seqlen}x{opts.heads} {mask}"
        print(f"backward {name} TFLOP/s:", backward_table(*shape, causal, opts.rounds), flush=True)
        print(f"forward + backward {name} TFLOP/s:", fwd_bwd_table(*shape, causal, opts.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
