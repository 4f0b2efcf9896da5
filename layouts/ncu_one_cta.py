"""One CTA of the sm_80 forward kernel, for Nsight Compute's bank-conflict counters.

q (1, 64, 1, D), k = v (1, 4096, 1, D), bf16, non-causal, backend="cute-sm80": one query tile,
so the grid is a single CTA and the shared-memory counters see the layout alone. `--identity`
builds the same kernel with every swizzle replaced by the identity (Swizzle<0,3,3>), the
known-bad layout the analyzer must (and does) report as conflicted. Run it under ncu as
ncu_check.md shows; use a separate CUTE_FLASH_CACHE_DIR for the --identity build.
"""

from __future__ import annotations

import argparse
import dataclasses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head_dim", type=int, nargs="?", default=128)
    p.add_argument("--identity", action="store_true", help="unswizzled shared-memory layouts")
    a = p.parse_args()
    if a.identity:
        from cute_flash.kernels.common import smem_layouts

        ours = smem_layouts.swizzle_params
        smem_layouts.swizzle_params = lambda *args, **kw: dataclasses.replace(ours(*args, **kw), bits=0)
    import torch

    import cute_flash

    torch.manual_seed(0)
    q = torch.randn(1, 64, 1, a.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 1, a.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for _ in range(2):  # the first call compiles; profile the second (ncu --launch-skip 1)
        out = cute_flash.forward(q, k, v, backend="cute-sm80")
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
    err = (out.float() - ref.transpose(1, 2)).abs().max().item()
    print(f"{'identity' if a.identity else 'ours'} head_dim={a.head_dim}: max error vs SDPA in float32 {err:.2e}")


if __name__ == "__main__":
    main()
