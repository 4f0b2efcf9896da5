"""Quick check of the sm_90 forward kernel on an H100/H200: errors against the oracle, then speed.

    python -m cute_flash.kernels.sm90.selfcheck            # errors for a few shapes + timings
    python -m cute_flash.kernels.sm90.selfcheck --no-bench

Each error line shows max|out - ref| next to max|out_torch - ref| (the same attention in plain
PyTorch at the input precision) and whether the DESIGN.md rule (<= 2x + atol) holds, for every
schedule variant of the configuration (ping-pong + intra-warpgroup overlap, overlap only,
neither, and the configuration's own schedule on a persistent grid, by a fixed stride and from
the tile counter, and on one CTA per tile),
so that a wrong result points at the part of the schedule that broke. Timings use
bf16, 16k total tokens, hidden 2048 (nheads = 2048 / head dim), FLOPs = 4 b h sq sk d (halved
for causal), median over CUDA-event timed groups of back-to-back calls.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch

from cute_flash.backends.cute import CuteSm90Backend
from cute_flash.backends.base import AttnArgs
from cute_flash.backends.reference import reference_attention
from cute_flash.kernels.sm90.fwd_config import ON_GRID

BACKEND = CuteSm90Backend()
VARIANTS = {
    "pingpong": dict(intra_wg_overlap=True, pingpong=True),
    "overlap": dict(intra_wg_overlap=True, pingpong=False),
    "serial": dict(intra_wg_overlap=False, pingpong=False, masked_halves=False, pv_wait_at=-1),
    # the configuration's own schedule on a persistent grid (where Q and O fit apart) with tiles
    # by a fixed stride and from the tile counter, and on one CTA per tile
    "persist": dict(persistent=True, tile_counter=False, late_take=False),
    "counter": dict(persistent=True, tile_counter=True, late_take=True),
    "grid": ON_GRID,
}

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dv, dtype, causal, window, softcap, varlen)
CASES = [
    (2, 1024, 1024, 4, 4, 128, 128, torch.bfloat16, False, None, 0.0, False),
    (2, 1024, 1024, 4, 4, 128, 128, torch.bfloat16, True, None, 0.0, False),
    (3, 113, 203, 3, 3, 128, 128, torch.float16, False, None, 0.0, False),
    (3, 239, 1, 3, 3, 128, 128, torch.float16, True, None, 0.0, False),
    (2, 799, 3, 2, 2, 64, 64, torch.bfloat16, False, None, 0.0, False),
    (2, 1, 4097, 2, 2, 256, 256, torch.bfloat16, True, None, 0.0, False),
    (2, 500, 700, 6, 2, 96, 96, torch.bfloat16, True, None, 0.0, False),
    (2, 333, 517, 2, 2, 192, 128, torch.bfloat16, False, None, 15.0, False),
    (2, 1023, 1024, 4, 4, 64, 64, torch.bfloat16, False, (64, 64), 0.0, False),
    (1, 300, 400, 4, 2, 128, 128, torch.bfloat16, True, None, 0.0, True),
    (2, 301, 257, 3, 3, 72, 72, torch.float16, True, None, 0.0, False),
]


def _inputs(batch, sq, sk, h, hk, d, dv, dtype, causal, window, softcap, varlen):
    q = torch.randn(batch, sq, h, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, sk, hk, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, sk, hk, dv, dtype=dtype, device="cuda")
    kw = dict(softmax_scale=1.0 / math.sqrt(d), causal=causal, softcap=softcap)
    if causal:
        kw["window_right"] = 0
    if window is not None:
        kw["window_left"], kw["window_right"] = window
    if varlen:
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
        cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * sq
        cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * sk
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk)
    return q, k, v, AttnArgs(**kw)


def _outputs(q, v, args):
    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype, device="cuda")
    lse_shape = (q.shape[1], q.shape[0]) if args.cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.full(lse_shape, float("nan"), dtype=torch.float32, device="cuda")


def _variant(base, flags):
    """`base` with a variant's flags, or None where they do not fit it (shared memory)."""
    try:
        return replace(base, **flags)
    except ValueError:
        return None


def _launch(config, q, k, v, out, lse, args) -> None:
    fn, _ = BACKEND.cache.get(config, BACKEND.arch())
    a = BACKEND.cache.args
    BACKEND.launch(fn, q, k, v, out, lse, args, a, extra=BACKEND.launch_extra(config, q, k, args, a))


def check_errors() -> bool:
    ok_all = True
    for case in CASES:
        q, k, v, args = _inputs(*case)
        ref, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
        ref_torch, _ = reference_attention(q, k, v, args, compute_dtype=q.dtype)
        err_torch = (ref_torch.float() - ref).abs().max().item()
        atol = 2**-10 if q.dtype == torch.float16 else 2**-7
        out, lse = _outputs(q, v, args)
        base = BACKEND.config(q, k, v, lse, args)
        for variant, flags in VARIANTS.items():
            out, lse = _outputs(q, v, args)
            config = _variant(base, flags)
            if config is None:
                continue
            _launch(config, q, k, v, out, lse, args)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            live = ~torch.isneginf(ref_lse)
            lse_err = (lse - ref_lse)[live].abs().max().item() if live.any() else 0.0
            lse_inf_ok = torch.equal(torch.isneginf(lse), ~live)
            ok = err <= 2 * err_torch + atol and lse_err < 1e-3 and lse_inf_ok and not out.isnan().any()
            ok_all &= ok
            print(f"{'ok  ' if ok else 'FAIL'} {base.name:60s} {variant:8s} shape={case[:7]} "
                  f"err={err:.3e} torch={err_torch:.3e} lse_err={lse_err:.2e} lse_inf_ok={lse_inf_ok}")
    return ok_all


def _time_ms(fn, iters=7, reps=10) -> float:
    """Median over `iters` of the mean time of `reps` back-to-back calls (host work overlapped)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def bench() -> None:
    total_tokens, hidden = 16384, 2048
    for d in (64, 128, 256):
        for seqlen in (2048, 8192):
            for causal in (False, True):
                batch, h = total_tokens // seqlen, hidden // d
                q, k, v, args = _inputs(batch, seqlen, seqlen, h, h, d, d, torch.bfloat16, causal, None, 0.0, False)
                out, lse = _outputs(q, v, args)
                base = BACKEND.config(q, k, v, lse, args)
                flops = 4 * batch * h * seqlen * seqlen * d / (2 if causal else 1)
                line = [f"hd{d} seqlen {seqlen} {'causal' if causal else 'non-causal'}:"]
                for variant, flags in VARIANTS.items():
                    config = _variant(base, flags)
                    if config is None:
                        continue
                    ms = _time_ms(lambda: _launch(config, q, k, v, out, lse, args))
                    line.append(f"{variant} {flops / ms / 1e9:6.1f} TFLOP/s")
                print("  ".join(line))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="errors only")
    opts = parser.parse_args(argv)
    reason = BACKEND.unavailable_reason()
    if reason is not None:
        print(f"cute-sm90 unavailable: {reason}")
        return 2
    torch.manual_seed(0)
    ok = check_errors()
    if not opts.no_bench:
        bench()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
