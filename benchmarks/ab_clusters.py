"""A/B of the sm_90 kernels' clusters: pairs of CTAs that share operand tiles by TMA multicast.

    python benchmarks/ab_clusters.py                                  # GPU: both kernels, the default cases
    python benchmarks/ab_clusters.py --fwd 128:8192:2,192:8192:2 --bwd 64:8192:2 --rounds 5
    python benchmarks/ab_clusters.py --compile-only                   # CPU: registers and spills

* forward (`Sm90FwdConfig.cluster_kv`): two CTAs on neighbouring query blocks of one (batch,
  head) each load half of every K and V tile into both;
* backward (`Sm90BwdConfig.cluster_q`): two CTAs on neighbouring key blocks each load half of
  every Q and dO tile into both.

Each case (`head dim:seqlen:batch`, bf16, no mask, 2048 / head dim heads) runs the shipped
configuration with the cluster and the same configuration without it, and flash-attn-4's forward
when it is importable. The forward's two outputs are compared bit for bit first (the cluster
changes where the tiles come from, not the arithmetic). Every round times each variant once with
`triton.testing.do_bench` (median), the order reversed every other round; then each variant runs
in a loop for about two seconds while NVML samples the SM clock and the board power, because on
the H200 these kernels run at the 700 W cap, where fewer bytes from L2 show as a higher clock.
The backward is timed as the backend runs it (preprocess, main kernel, postprocess).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import interleaved_rounds  # noqa: E402

HIDDEN = 2048


def parse_cases(text: str) -> list:
    """'128:8192:2,64:16384:1' -> [(128, 8192, 2), (64, 16384, 1)]"""
    cases = []
    for item in filter(None, text.split(",")):
        d, s, b = (int(x) for x in item.split(":"))
        cases.append((d, s, b))
    return cases


def compile_only(fwd_cases, bwd_cases) -> None:
    from bench_lib import print_tile_audit

    from cute_flash.kernels.sm90 import bwd_config, fwd_config

    rows = []
    for d in sorted({d for d, _, _ in fwd_cases}):
        on = fwd_config.with_cluster_kv(fwd_config.make_config("bfloat16", d, d), 2)
        rows += [(f"fwd hd{d} {label}", c, None, fwd_config.compile_fwd)
                 for label, c in (("cluster", on), ("single", replace(on, cluster_kv=False)))]
    for d in sorted({d for d, _, _ in bwd_cases}):
        on = replace(bwd_config.make_config("bfloat16", d, d), cluster_q=True)
        rows += [(f"bwd hd{d} {label}", c, None, bwd_config.compile_kernel)
                 for label, c in (("cluster", on), ("single", replace(on, cluster_q=False)))]
    print_tile_audit("sm_90a", rows)


def clock_and_power(fn, seconds: float = 2.0) -> str:
    """Mean SM clock and board power (NVML, every 50 ms, the first quarter dropped) while `fn`
    runs back to back for `seconds`."""
    import torch

    try:
        import pynvml
    except ImportError:
        return "(no pynvml)"
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    clocks, watts, done = [], [], threading.Event()

    def poll():
        while not done.is_set():
            clocks.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
            watts.append(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    start, n = time.time(), 0
    while time.time() - start < seconds:
        fn()
        n += 1
        if n % 10 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    done.set()
    poller.join()
    k = len(clocks) // 4
    return f"{sum(clocks[k:]) / len(clocks[k:]):.0f} MHz, {sum(watts[k:]) / len(watts[k:]):.0f} W"


def report(title: str, times: dict, runs: dict, work: float, unit: str) -> None:
    import statistics

    cells = " | ".join(f"{label} " + "/".join(f"{work / ms * 1e-9:.1f}" for ms in t)
                       + f" (median {work / statistics.median(t) * 1e-9:.1f})" for label, t in times.items())
    print(f"{title} {unit}: {cells}", flush=True)
    for label, fn in runs.items():
        print(f"    {label}: {clock_and_power(fn)}", flush=True)


def forward_case(d: int, s: int, b: int, rounds: int) -> None:
    import torch

    from cute_flash.backends import get_backend
    from cute_flash.backends.base import AttnArgs

    backend = get_backend("cute-sm90")
    ka = backend.cache.args
    h = HIDDEN // d
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
    args = AttnArgs(softmax_scale=d ** -0.5)
    shipped = backend.config(q, k, v, lse, args)
    if not shipped.cluster_kv:
        print(f"forward hd{d} {b} x {s}: {shipped.name} takes no cluster here; skipped", flush=True)
        return
    runs, outs = {}, {}
    for label, config in (("cluster", shipped), ("single", replace(shipped, cluster_kv=False))):
        fn = backend.cache.get(config, backend.arch())[0]

        def run(fn=fn, config=config):
            backend.launch(fn, q, k, v, out, lse, args, ka, extra=backend.launch_extra(config, q, k, args, ka))

        run()
        torch.cuda.synchronize()
        outs[label] = (out.clone(), lse.clone())
        runs[label] = run
    same = all(torch.equal(a, c) for a, c in zip(outs["cluster"], outs["single"]))
    try:
        from flash_attn.cute.interface import flash_attn_func

        runs["fa4"] = lambda: flash_attn_func(q, k, v)
    except ImportError:
        pass
    title = f"forward hd{d} {b} x {s} x {h} heads ({shipped.name}; O and LSE bitwise equal: {same})"
    report(title, interleaved_rounds(runs, rounds), runs, 4 * b * h * s * s * d, "TFLOP/s")


def backward_case(d: int, s: int, b: int, rounds: int) -> None:
    from ab_sm90_bwd import problem, run_backward

    from cute_flash.backends.cute_bwd import sm90_configs

    h = HIDDEN // d
    args, (dout, q, k, v, out, lse), grads = problem(b, s, h, d, False)
    _, main, _ = sm90_configs(q, k, v, None, args)
    on = replace(main, cluster_q=True)
    runs = {label: (lambda config=config: run_backward(config, dout, q, k, v, out, lse, grads, args))
            for label, config in (("cluster", on), ("single", replace(on, cluster_q=False)))}
    title = f"backward hd{d} {b} x {s} x {h} heads ({on.name}; shipped: {'cluster' if main.cluster_q else 'single'})"
    report(title, interleaved_rounds(runs, rounds), runs, 2.5 * 4 * b * h * s * s * d, "TFLOP/s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fwd", default="128:8192:2,128:2048:8,96:8192:2,192:8192:2,64:16384:1",
                   help="forward cases, head dim:seqlen:batch, comma-separated ('' for none)")
    p.add_argument("--bwd", default="64:8192:2,96:8192:2,128:8192:2",
                   help="backward cases, head dim:seqlen:batch ('' for none)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compile-only", action="store_true", help="registers and spills only (no GPU needed)")
    opts = p.parse_args(argv)
    fwd_cases, bwd_cases = parse_cases(opts.fwd), parse_cases(opts.bwd)
    if opts.compile_only:
        compile_only(fwd_cases, bwd_cases)
        return 0
    print(f"sm_90 clusters A/B, bf16, no mask, {HIDDEN} / head dim heads; each round's do_bench median", flush=True)
    for d, s, b in fwd_cases:
        forward_case(d, s, b, opts.rounds)
    for d, s, b in bwd_cases:
        backward_case(d, s, b, opts.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
