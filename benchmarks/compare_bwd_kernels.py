"""The sm_90 backward kernel next to the sm_80 one on the same calls, on an H100/H200.

    python benchmarks/compare_bwd_kernels.py            # a few shapes: differences and timings
    python benchmarks/compare_bwd_kernels.py --no-time  # differences only

For each shape both kernels (cute-sm90 with `native_backward` on, and cute-sm80) take the same
q, k, v, out, lse and dout; the script prints, per gradient, the largest difference between the
two and each one's largest difference to a float32 reference backward, then the median time of
each backward (`triton.testing.do_bench` when importable, CUDA events otherwise). Out and lse
come from the reference forward, so only the backward kernels differ. The pytest file
tests/gpu/test_bwd_sm90.py is the full check; this is the quick look.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_flash.backends.base import AttnArgs  # noqa: E402
from cute_flash.backends.cute import CuteSm80Backend, CuteSm90Backend  # noqa: E402
from cute_flash.backends.reference import reference_attention, reference_attention_backward  # noqa: E402

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head dim, mask)
SHAPES = [
    (2, 113, 203, 4, 4, 64, {}),
    (2, 1000, 1000, 8, 2, 128, {"causal": True, "window_right": 0}),
    (1, 777, 2049, 4, 1, 96, {"window_left": 100, "window_right": 30}),
    (2, 512, 640, 4, 4, 128, {"softcap": 20.0}),
    (2, 4096, 4096, 16, 16, 128, {}),
    (2, 4096, 4096, 16, 16, 128, {"causal": True, "window_right": 0}),
    (2, 4096, 4096, 32, 32, 64, {}),
    (2, 4096, 4096, 32, 32, 64, {"causal": True, "window_right": 0}),
]


def _time(fn) -> float:
    try:
        from triton.testing import do_bench

        return do_bench(fn)
    except ImportError:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 10


def compare(shape, dtype, timing: bool) -> None:
    b, sq, sk, h, hk, d, mask = shape
    q = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
    k = torch.randn(b, sk, hk, d, dtype=dtype, device="cuda")
    v = torch.randn(b, sk, hk, d, dtype=dtype, device="cuda")
    args = AttnArgs(softmax_scale=1 / math.sqrt(d), **mask)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(dtype), ref_lse.float()
    dout = torch.randn_like(out)
    sm90 = CuteSm90Backend()
    sm90.native_backward = True
    assert sm90.native_backward_takes(q, k, v, args, False), f"the sm_90 kernel refuses {shape}"
    backends = {"sm90": sm90, "sm80": CuteSm80Backend()}
    grads = {}
    for name, backend in backends.items():
        g = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        backend.bwd(dout, q, k, v, out, lse, None, *g, args, False)
        grads[name] = g
    torch.cuda.synchronize()
    refs = reference_attention_backward(dout, q, k, v, out, lse, None, args, compute_dtype=torch.float32)
    line = [f"b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {mask or 'full'} {str(dtype)[6:]}:"]
    for i, gname in enumerate(("dq", "dk", "dv")):
        a, c, r = grads["sm90"][i].float(), grads["sm80"][i].float(), refs[i].float()
        line.append(f"{gname} |90-80| {(a - c).abs().max():.2e} |90-ref| {(a - r).abs().max():.2e} "
                    f"|80-ref| {(c - r).abs().max():.2e} nan90 {int(a.isnan().sum())}")
    print("\n    ".join(line))
    if timing:
        for name, backend in backends.items():
            g = [torch.empty_like(t) for t in (q, k, v)]
            ms = _time(lambda: backend.bwd(dout, q, k, v, out, lse, None, *g, args, False))
            print(f"    {name}: {ms:.3f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-time", action="store_true", help="differences only")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    opts = parser.parse_args()
    torch.manual_seed(0)
    for shape in SHAPES:
        compare(shape, getattr(torch, opts.dtype), not opts.no_time)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
