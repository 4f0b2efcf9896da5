"""Forward + backward above head dim 128 with equal and unequal head dims of Q and V (192 / 192,
192 / 128 as in MLA): cute-sm90 with its own backward kernel (`sm90`) and with the backward on
the sm_80 kernels (`sm80`, `CuteSm90Backend.native_backward = False`), next to flash-attn-4 when
importable. bf16, 2 x 8192 x 16 heads, three rounds, the order reversed every other round;
TFLOP/s counts 2 * b * h * s^2 * (d + dv) * 3.5 (halved when causal).

    python benchmarks/ab_bwd_wide_headdims.py      # GPU
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import cute_flash  # noqa: E402
from cute_flash.backends import get_backend  # noqa: E402

be = get_backend("cute-sm90")
try:
    from flash_attn.cute.interface import flash_attn_func
except ImportError:
    flash_attn_func = None
b, s, h = 2, 8192, 16
for d, dv in ((192, 128), (192, 192)):
    for causal in (False, True):
        q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
        flops = 2 * b * h * s * s * (d + dv) * 3.5 / (2 if causal else 1)

        def step():
            q.grad = k.grad = v.grad = None
            cute_flash.attention(q, k, v, causal=causal, backend="cute-sm90").backward(do)

        def fa4():
            q.grad = k.grad = v.grad = None
            out = flash_attn_func(q, k, v, causal=causal)
            (out[0] if isinstance(out, tuple) else out).backward(do)

        res = {"sm90": [], "sm80": [], "fa4": []}
        for r in range(3):
            for name in (["sm90", "sm80", "fa4"] if r % 2 == 0 else ["fa4", "sm80", "sm90"]):
                if name == "fa4":
                    if flash_attn_func is None:
                        continue
                    try:
                        fn = fa4
                        fn()
                    except Exception as exc:
                        res["fa4"].append(str(exc)[:60])
                        continue
                else:
                    be.native_backward = name == "sm90"
                    fn = step
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                res[name].append(f"{flops / ms * 1e-9:.1f}")
        be.native_backward = True
        print(f"d={d} dv={dv} causal={causal} fwd+bwd TFLOP/s (3 rounds):", res, flush=True)
