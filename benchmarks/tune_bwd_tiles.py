"""Try sm_80 backward tile shapes the tile table does not ship: spills on the CPU, speed on a GPU.

    python benchmarks/tune_bwd_tiles.py --head-dim 256 --compile-only          # CPU: registers, spills
    python benchmarks/tune_bwd_tiles.py --head-dim 256 --candidates 32x128w8q2  # GPU: check, then time

A candidate is `MxNwWqQ[cC]`: M query rows per step, N keys per CTA, W warps (N = 16 W), Q warps
along the rows of the dQ product and C CTAs per key block over the columns (default: the shipped
tile's), e.g. `32x128w8q2` or `32x64w4q2c4`. It replaces the tile of the head dim in
`bwd_config.TILES` (`LARGE_SMEM_TILES`, the tile taken where a GPU has
the shared memory for it, is set aside meanwhile), so it runs through the backend's own host path
(`cute_bwd.backward`: preprocess, main kernel, postprocess) and differs from the shipped kernel in
the tile alone. The shipped tile is always measured too, as the baseline.

`--compile-only` audits each candidate (no GPU needed): registers, spill bytes, shared memory. On
a GPU each candidate is first checked against the float32 reference backward on a small problem
with odd lengths (dq, dk and dv by the benchmark's tolerance rule; a wrong kernel is reported and
not timed), then its `bwd` (all three kernels) is timed with `triton.testing.do_bench` on
batch x seqlen x heads (default 2 x 4096 x 16) against the GPU's shared memory per CTA: a
candidate that needs more is reported, not run.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_SPEC = re.compile(r"^(\d+)x(\d+)w(\d+)q(\d+)(?:c(\d+))?$")


def parse_candidate(spec: str, shipped):
    """`32x128w8q2` (or `32x64w4q2c4`) -> the shipped tile with those fields."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"candidate {spec!r} is not MxNwWqQ[cC] (e.g. 32x128w8q2)")
    tile_m, tile_n, warps, dq_warps_m = (int(g) for g in m.groups()[:4])
    col_tiles = int(m.group(5)) if m.group(5) else shipped.col_tiles
    return shipped._replace(tile_m=tile_m, tile_n=tile_n, num_warps=warps, dq_warps_m=dq_warps_m,
                            col_tiles=col_tiles)


def configs(args) -> list:
    """(label, tile or None, config or None, why not): the shipped tile, then each candidate."""
    from cute_flash.kernels.sm80 import bwd_config as bc

    d = bc.pad_headdim(args.head_dim, bc.TILE_HEADDIMS, bc.UnsupportedHeadDim)
    shipped = bc.TILES[d]
    out = []
    for label, spec in [("shipped", None)] + [(c, c) for c in args.candidates]:
        try:
            tile = shipped if spec is None else parse_candidate(spec, shipped)
            out.append((label, tile, with_tile(d, tile, lambda: bc.make_config(
                args.dtype, args.head_dim, args.head_dim, causal=args.causal, softcap=args.softcap > 0,
                deterministic=args.deterministic)), None))
        except (ValueError, TypeError, NotImplementedError) as exc:
            out.append((label, None, None, str(exc)))
    return out


def with_tile(d: int, tile, fn):
    """fn() with `bwd_config.TILES[d]` set to `tile` and no `LARGE_SMEM_TILES` entry for `d` (so
    that the tile runs on any GPU it fits), the backend's config cache cleared. At head dim 256
    the soft-capped calls' tile (`SOFTCAP_TILE_256`) is `tile` too, so that a candidate is what
    runs for those calls as well."""
    from cute_flash.backends import cute_bwd
    from cute_flash.kernels.sm80 import bwd_config as bc

    saved, saved_large, saved_softcap = bc.TILES[d], bc.LARGE_SMEM_TILES.pop(d, None), bc.SOFTCAP_TILE_256
    bc.TILES[d] = tile
    if d == 256:
        bc.SOFTCAP_TILE_256 = tile
    cute_bwd._configs.cache_clear()
    try:
        return fn()
    finally:
        bc.TILES[d] = saved
        bc.SOFTCAP_TILE_256 = saved_softcap
        if saved_large is not None:
            bc.LARGE_SMEM_TILES[d] = saved_large
        cute_bwd._configs.cache_clear()


def compile_only(args, rows) -> None:
    from bench_lib import print_tile_audit
    from cute_flash.kernels.sm80 import bwd_config as bc

    print_tile_audit(args.arch, [(label, config, why, bc.compile_kernel) for label, _, config, why in rows])


def on_gpu(args, rows) -> None:
    import torch
    from triton.testing import do_bench

    from bench_lib import within_tolerance
    from cute_flash.backends import get_backend
    from cute_flash.backends.base import AttnArgs
    from cute_flash.backends.cute_bwd import check_smem
    from cute_flash.backends.reference import reference_attention, reference_attention_backward

    backend = get_backend("cute-sm80")
    dtype = getattr(torch, args.dtype)
    d = args.head_dim
    mask = dict(causal=True, window_right=0) if args.causal else {}

    def problem(b, sq, sk, h, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device="cuda", generator=g) for s in (sq, sk, sk))
        a = AttnArgs(softmax_scale=d ** -0.5, softcap=args.softcap, **mask)
        out, lse = reference_attention(q, k, v, a, compute_dtype=torch.float32)
        return q, k, v, out.to(dtype), lse.float(), torch.randn(out.shape, dtype=dtype, device="cuda", generator=g), a

    small = problem(2, 333, 517, 2, 0)
    q, k, v, out, lse, dout, a = small
    refs = reference_attention_backward(dout, q, k, v, out, lse, None, a, compute_dtype=torch.float32)
    refs_torch = reference_attention_backward(dout, q, k, v, out, lse, None, a, compute_dtype=dtype)
    big = problem(args.batch, args.seqlen, args.seqlen, args.heads, 1)
    flops = 2.5 * 4 * args.batch * args.heads * args.seqlen ** 2 * d / (2 if args.causal else 1)
    extra = (f" softcap {args.softcap}" if args.softcap else "") + (" deterministic" if args.deterministic else "")
    print(f"sm_80 backward hd{d} {args.dtype} {'causal' if args.causal else 'non-causal'}{extra}: check on 2 x 333/517 "
          f"x 2 heads, time on {args.batch} x {args.seqlen} x {args.heads} heads")

    def run(case, grads):
        q, k, v, out, lse, dout, a = case
        backend.bwd(dout, q, k, v, out, lse, None, *grads, a, args.deterministic)

    for label, tile, config, why in rows:
        if config is None:
            print(f"{label:<16} invalid: {why}")
            continue
        try:
            check_smem(config, torch.device("cuda"))
            grads = [torch.full_like(t, math.nan) for t in small[:3]]
            with_tile(config.head_dim, tile, lambda: run(small, grads))
            torch.cuda.synchronize()
            bad = [f"{n} {err:.3g} > {bound:.3g}" for n, g, r, rt in zip("dq dk dv".split(), grads, refs, refs_torch)
                   for passed, err, bound in [within_tolerance(g, r, rt, dtype)] if not passed]
            if bad:
                print(f"{label:<16} WRONG: {'; '.join(bad)}")
                continue
            grads = [torch.empty_like(t) for t in big[:3]]
            ms = with_tile(config.head_dim, tile,
                           lambda: do_bench(lambda: run(big, grads), warmup=25, rep=100, return_mode="median"))
            print(f"{label:<16} {ms:8.3f} ms {flops / ms * 1e-9:7.1f} TFLOP/s   ({config.name})", flush=True)
        except NotImplementedError as exc:
            print(f"{label:<16} not run: {exc}")
        except Exception as exc:
            print(f"{label:<16} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def main(argv=None) -> int:
    from bench_lib import tile_tuning_main

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("sm_80", "sm_90a"), default="sm_90a", help="for --compile-only")
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--softcap", type=float, default=0.0, help="soft-capping value (0: none)")
    p.add_argument("--deterministic", action="store_true")
    return tile_tuning_main(p, argv, 4096, lambda args: ["32x128w8q2", "64x64w4q4"], configs, compile_only, on_gpu)


if __name__ == "__main__":
    sys.exit(main())
