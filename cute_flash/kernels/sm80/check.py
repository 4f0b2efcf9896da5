"""Quick GPU check of the sm_80 forward kernel: a few calls against the reference, then timings.

    python -m cute_flash.kernels.sm80.check            # correctness smoke test + timings
    python -m cute_flash.kernels.sm80.check --no-bench

Timings compare with PyTorch SDPA's FlashAttention-2 backend on the same inputs (bf16, total
tokens 16k, hidden 2048, i.e. batch = 16k / seqlen and heads = 2048 / head dim).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from ...backends.base import AttnArgs
from ...backends.cute import CuteSm80Backend, warmup
from ...backends.kernel_cache import device_arch
from ...backends.reference import reference_attention

SMOKE = [
    # (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dv, args)
    (torch.float16, 2, 1000, 1000, 4, 4, 64, 64, {}),
    (torch.bfloat16, 2, 1000, 1000, 4, 4, 128, 128, {}),
    (torch.bfloat16, 3, 113, 203, 6, 2, 128, 128, {"causal": True, "window_right": 0}),
    (torch.float16, 1, 799, 3, 2, 1, 256, 256, {"causal": True, "window_right": 0}),
    (torch.bfloat16, 2, 500, 700, 2, 2, 64, 64, {"window_left": 40, "window_right": 8}),
    (torch.bfloat16, 2, 300, 333, 2, 2, 128, 128, {"softcap": 10.0, "causal": True, "window_right": 0}),
]


def smoke() -> bool:
    backend = CuteSm80Backend()
    ok = True
    for dtype, b, sq, sk, h, hk, d, dv, extra in SMOKE:
        q = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
        k = torch.randn(b, sk, hk, d, dtype=dtype, device="cuda")
        v = torch.randn(b, sk, hk, dv, dtype=dtype, device="cuda")
        args = AttnArgs(softmax_scale=1 / math.sqrt(d), **extra)
        out = torch.full((b, sq, h, dv), float("nan"), dtype=dtype, device="cuda")
        lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
        start = time.perf_counter()
        backend.fwd(q, k, v, out, lse, args)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - start
        ref, ref_lse = reference_attention(q, k, v, args)
        ref_torch, _ = reference_attention(q, k, v, args, compute_dtype=dtype)
        err = (out.float() - ref).abs().max().item()
        bound = 2 * (ref_torch.float() - ref).abs().max().item() + torch.finfo(dtype).eps
        finite = torch.isfinite(ref_lse)
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        good = err <= bound and lse_err < 1e-3 and torch.equal(torch.isneginf(lse), ~finite)
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {str(dtype)[6:]:8s} b{b} sq{sq} sk{sk} h{h}/{hk} d{d}/{dv} {extra}: "
              f"err {err:.2e} (bound {bound:.2e}), lse err {lse_err:.1e}, first call {first_call:.2f} s")
    return ok


def _time(fn, iters=20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def bench(seqlens=(1024, 2048, 4096, 8192, 16384), headdims=(64, 128, 256)) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = CuteSm80Backend()
    print(f"{'hd':>4} {'seqlen':>7} {'causal':>6} {'cute TFLOP/s':>13} {'FA2 TFLOP/s':>12} {'ratio':>6}")
    for d in headdims:
        for causal in (False, True):
            for s in seqlens:
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                out = torch.empty_like(q)
                lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
                args = AttnArgs(softmax_scale=1 / math.sqrt(d), causal=causal, window_right=0 if causal else -1)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                t_cute = _time(lambda: backend.fwd(q, k, v, out, lse, args))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    t_fa2 = _time(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                print(f"{d:4d} {s:7d} {str(causal):>6} {flops / t_cute / 1e12:13.1f} {flops / t_fa2 / 1e12:12.1f} "
                      f"{t_fa2 / t_cute:6.2f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true")
    opts = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} ({device_arch()})")
    start = time.perf_counter()
    report = warmup([dict(dtype="bfloat16", head_dim=128, head_dim_v=128)], backend="cute-sm80")
    print(f"warmup hd128 bf16: {report[0][1]} in {time.perf_counter() - start:.2f} s")
    ok = smoke()
    if not opts.no_bench:
        bench()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
