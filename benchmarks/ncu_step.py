"""One forward + backward step (or forward) of a provider inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off --kernel-name regex:'[Bb]ackward|[Bb]wd' --section SpeedOfLight \
        --section WarpStateStats python benchmarks/ncu_step.py --provider cute-sm90 --causal

The step runs twice first (compiles, warm-up) outside the range, then once inside it
(`torch.cuda.profiler.start()` / `stop()`), so that `--profile-from-start off` profiles the
kernels of that one step: run it once per provider with the same shape and the same ncu
options to put two kernels' counters side by side. The shapes are `kernel_breakdown.py`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_breakdown import _step_fn  # noqa: E402


def _forward_fn(provider: str, q, k, v, causal: bool):
    if provider == "fa4":
        from flash_attn.cute import flash_attn_func

        return lambda: flash_attn_func(q, k, v, causal=causal)
    import cute_flash

    return lambda: cute_flash.forward(q, k, v, causal=causal, backend=provider)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", default="cute-sm90", help="a cute_flash backend name or fa4")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=0, help="default: 16k tokens / seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head dim")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--forward-only", action="store_true", help="the forward alone (no autograd)")
    args = p.parse_args(argv)
    b = args.batch or max(1, 16384 // args.seqlen)
    h, d = args.hidden // args.head_dim, args.head_dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, args.seqlen, h, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=not args.forward_only) for _ in range(3))
    if args.forward_only:
        step = _forward_fn(args.provider, q, k, v, args.causal)
    else:
        step = _step_fn(args.provider, q, k, v, torch.randn_like(q), args.causal)
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        step()
    torch.cuda.synchronize()
    q.grad = k.grad = v.grad = None
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    what = "forward" if args.forward_only else "forward + backward step"
    print(f"{args.provider}: hd{d} {b} x {args.seqlen} x {h} heads, causal={args.causal}: one {what} profiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
