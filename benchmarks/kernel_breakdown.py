"""Per-kernel GPU time of forward + backward, cute_flash next to flash-attn-4, from the profiler.

    python benchmarks/kernel_breakdown.py                          # hd 128, 2 x 8192 x 16, bf16
    python benchmarks/kernel_breakdown.py --headdims 64,128 --causal both --iters 20

End-to-end timings (`bench_attention.py`) say how far apart two providers are; this says where:
the forward kernel, the backward's preprocess, main kernel and postprocess, and anything else
launched (copies, memsets). Each provider runs `iters` forward + backward steps under
`torch.profiler` (CUPTI's kernel records, so the time is the GPU's, without launch gaps) after
a warm-up; every kernel is listed with its launches per step and mean microseconds, and the sum
per step. Kernel names are cut to `--name-width` characters. With `--rounds N` the providers
take turns N times, the order reversed every round (the SM clock drifts with the card's power
and heat, and a fixed order hands the same provider the same place in that drift): each kernel's
time is then the median over the rounds, and every round's sum per step is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import round_order  # noqa: E402


def _step_fn(provider: str, q, k, v, dout, causal: bool):
    if provider == "fa4":
        from flash_attn.cute import flash_attn_func

        def step():
            out = flash_attn_func(q, k, v, causal=causal)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dout)
    else:
        import cute_flash

        def step():
            cute_flash.attention(q, k, v, causal=causal, backend=provider).backward(dout)
    return step


def breakdown(provider: str, b: int, s: int, h: int, d: int, causal: bool, iters: int, dtype=torch.bfloat16):
    """{kernel name: (launches per step, mean µs per launch)} and the GPU µs per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    step = _step_fn(provider, q, k, v, dout, causal)
    for _ in range(3):  # compile, then warm
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            q.grad = k.grad = v.grad = None
            step()
        torch.cuda.synchronize()
    totals: dict = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type.name != "CUDA":
            continue
        t = totals[evt.name]
        t[0] += 1
        t[1] += evt.time_range.elapsed_us()
    rows = {name: (n / iters, us / n) for name, (n, us) in totals.items()}
    per_step = sum(us for _, us in totals.values()) / iters
    return rows, per_step


def breakdown_rounds(providers: list, run_one, rounds: int) -> dict:
    """{provider: (rows, per-step µs of every round)} over `rounds` turns of `run_one(provider)`
    (which returns `breakdown`'s (rows, per_step)), the providers' order reversed every other
    round; rows hold each kernel's launches per step and mean µs per launch, each the median over
    the rounds in which that kernel ran. A provider that fails in a round is reported as failed: {provider: exception}."""
    runs: dict = {p: [] for p in providers}
    failed: dict = {}
    for r in range(rounds):
        for provider in round_order(providers, r):
            if provider in failed:
                continue
            try:
                runs[provider].append(run_one(provider))
            except Exception as exc:  # one provider's failure must not hide the others
                failed[provider] = exc
    out: dict = {}
    for provider in providers:
        if provider in failed:
            out[provider] = failed[provider]
            continue
        names = {name for rows, _ in runs[provider] for name in rows}
        rows = {}
        for name in names:
            seen = [rows_r[name] for rows_r, _ in runs[provider] if name in rows_r]
            rows[name] = (statistics.median(n for n, _ in seen), statistics.median(us for _, us in seen))
        out[provider] = (rows, [per_step for _, per_step in runs[provider]])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--providers", default="cute-sm90,fa4")
    p.add_argument("--headdims", default="128")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=0, help="default: 16k tokens / seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head dim")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="turns of every provider, the order reversed every round")
    p.add_argument("--name-width", type=int, default=90)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    b = args.batch or max(1, 16384 // args.seqlen)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    for d in (int(x) for x in args.headdims.split(",")):
        h = args.hidden // d
        flops = 4 * b * h * args.seqlen**2 * d * 3.5  # forward + backward (2.5x the forward)
        for causal in causals:
            f = flops / 2 if causal else flops
            print(f"\n## head dim {d}, {b} x {args.seqlen} x {h} heads, bf16, causal={causal}")
            results = breakdown_rounds(
                args.providers.split(","),
                lambda provider: breakdown(provider, b, args.seqlen, h, d, causal, args.iters),  # noqa: B023
                args.rounds)
            for provider, result in results.items():
                if isinstance(result, Exception):
                    print(f"{provider}: failed: {type(result).__name__}: {result}")
                    continue
                rows, per_steps = result
                per_step = statistics.median(per_steps)
                each = f"; rounds {' / '.join(f'{x:.1f}' for x in per_steps)}" if len(per_steps) > 1 else ""
                print(f"{provider}: {per_step:.1f} µs of kernels per step ({f / per_step / 1e6:.1f} TFLOP/s){each}")
                for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
                    print(f"  {n:5.1f} x {us:9.1f} µs  {name[:args.name_width]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
