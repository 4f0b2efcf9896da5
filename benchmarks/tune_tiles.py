"""Try forward tile shapes that the tile tables do not ship: spills on the CPU, speed on a GPU.

    python benchmarks/tune_tiles.py --arch sm_90a --head-dim 128 --compile-only   # CPU: registers, spills
    python benchmarks/tune_tiles.py --arch sm_90a --head-dim 128 --causal         # GPU: check, then time

A candidate is `MxN` + `wW` (sm_90a: consumer warpgroups; sm_80: warps) + `sS` (K/V stages),
with `-nopp` to turn the sm_90 ping-pong off, `-lazy` / `-eager` to turn the lazy rescale
on / off, `-grid` to run an sm_90 tile as one CTA per tile instead of persistent (Q and O then
share shared memory, which leaves room for a third K/V stage at head dim 128), `-psmem` to
feed P·V its P from shared memory (`p_in_smem`) and `-vote` / `-novote` to turn the keep vote
on (with the lazy rescale) / off, e.g. `128x176w2s2`, `192x128w3s2-nopp`, `128x64w4s2-eager`,
`128x128w2s3-grid`, `192x128w3s2-psmem`, `128x32w4s2-lazy-vote`, and for sm_80 `-pp` for the
two warp groups taking turns (`pingpong`, 8 warps: `256x32w8s2-pp`; without it a candidate has
no turns). Every candidate is built
from the shipped configuration of the head dim, dtype and mask, with only its tile fields (and
those flags) replaced, so it differs from the shipped kernel in those alone. The shipped tile is
always measured too, as the baseline.

`--compile-only` runs the audit of `cute_flash.audit` on each candidate (no GPU needed) and
prints registers, spill bytes and shared memory: a candidate that spills is not worth timing.
Without it, on a GPU, each candidate is first checked against the float32 reference on a small
problem with odd lengths, by the benchmark's tolerance rule (a wrong kernel is reported and not timed), then timed with
`triton.testing.do_bench` on batch x seqlen x heads (default 2 x 8192 x 16, head dim from
--head-dim), next to flash-attn-4 when it is importable and, for sm_80, PyTorch SDPA's
FlashAttention-2; with `--rounds N` every one of them N times, taking turns in an order reversed
every other round, and the medians reported (default one round).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_SPEC = re.compile(r"^(\d+)x(\d+)w(\d+)s(\d+)(-nopp)?(-lazy|-eager)?(-grid)?(-psmem)?(-vote|-novote)?(-pp)?$")


def parse_candidate(spec: str, arch: str) -> dict:
    """`128x176w2s2[-nopp][-lazy|-eager][-grid][-psmem][-vote|-novote][-pp]` -> the config fields it sets."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"candidate {spec!r} is not MxNwWsS[-nopp][-lazy|-eager][-grid][-psmem][-vote|-novote][-pp] "
                         "(e.g. 128x176w2s2)")
    tile_m, tile_n, workers, stages = (int(g) for g in m.groups()[:4])
    fields = dict(tile_m=tile_m, tile_n=tile_n, num_stages=stages)
    if arch == "sm_90a":
        fields.update(num_consumer_wgs=workers, pingpong=not m.group(5))
        if m.group(7):
            fields.update(config_module(arch).ON_GRID)
        if m.group(8):
            fields.update(p_in_smem=True)
    else:
        if m.group(5) or m.group(7) or m.group(8):
            raise ValueError("-nopp, -grid and -psmem are sm_90a options")
        fields.update(num_warps=workers, pingpong=bool(m.group(10)))
    if m.group(6):
        fields.update(lazy_rescale=m.group(6) == "-lazy")
        if m.group(6) == "-eager":
            fields.update(config_module(arch).NO_KEEP_VOTE)  # it votes on the lazy rescale's kept references
    if m.group(9) == "-vote":
        if m.group(6) == "-eager":
            raise ValueError("-vote votes on the lazy rescale's kept references: not with -eager")
        fields.update(lazy_rescale=True, keep_vote=True)
    elif m.group(9):
        fields.update(config_module(arch).NO_KEEP_VOTE)
    if m.group(10) and arch == "sm_90a":
        raise ValueError("-pp is an sm_80 option (sm_90a's ping-pong is on unless -nopp)")
    return fields


def config_module(arch: str):
    if arch == "sm_90a":
        from cute_flash.kernels.sm90 import fwd_config
    else:
        from cute_flash.kernels.sm80 import fwd_config
    return fwd_config


def candidates(args) -> list:
    """(label, config or None, why not) for the shipped tile and every candidate."""
    from bench_lib import fits

    fc = config_module(args.arch)
    shipped = fc.make_config(args.dtype, args.head_dim, args.head_dim, causal=args.causal)
    out = [("shipped", shipped, None)]
    for spec in args.candidates:
        try:
            fields = parse_candidate(spec, args.arch)
            if getattr(shipped, "causal", False) and hasattr(shipped, "masked_halves"):
                # sm_90: the half blocks where a causal candidate can take them (128 keys per block)
                halves = fields.get("tile_n", shipped.tile_n) == 128 and fits(shipped, **{**fields, "masked_halves": True})
                fields.setdefault("masked_halves", halves)
            out.append((spec, replace(shipped, **fields), None))
        except (ValueError, TypeError) as exc:
            out.append((spec, None, str(exc)))
    return out


def compile_only(args, configs) -> None:
    from bench_lib import print_tile_audit

    compile_fn = config_module(args.arch).compile_fwd
    print_tile_audit(args.arch, [(label, config, why, compile_fn) for label, config, why in configs])


def on_gpu(args, configs) -> None:
    import statistics

    import torch

    from bench_lib import interleaved_rounds, within_tolerance
    from cute_flash.backends import get_backend
    from cute_flash.backends.base import AttnArgs
    from cute_flash.backends.reference import reference_attention

    backend = get_backend("cute-sm90" if args.arch == "sm_90a" else "cute-sm80")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    d = args.head_dim

    def attn_args(sq, sk):
        return AttnArgs(softmax_scale=d ** -0.5, causal=args.causal, window_right=0 if args.causal else -1)

    def launcher(fn, config):
        ka = backend.cache.args

        def run(q, k, v, out, lse, a):
            # the sm_80 kernels take page table / split-KV arguments, the sm_90 ones their grid's
            extra = ((None, None, None, ka.i32(1)) if backend.inference_kernels
                     else backend.launch_extra(config, q, k, a, ka))
            backend.launch(fn, q, k, v, out, lse, a, ka, extra=extra)

        return run

    def inputs(b, sq, sk, h):
        g = torch.Generator(device="cuda").manual_seed(0)
        return tuple(torch.randn(b, s, h, d, dtype=dtype, device="cuda", generator=g) for s in (sq, sk, sk))

    small = inputs(2, 333, 1001, 2)
    ref, _ = reference_attention(*small, attn_args(333, 1001))
    ref_torch, _ = reference_attention(*small, attn_args(333, 1001), compute_dtype=dtype)
    b, s, h = args.batch, args.seqlen, args.heads
    big = inputs(b, s, s, h)
    flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
    print(f"{args.arch} hd{d} {args.dtype} {'causal' if args.causal else 'non-causal'}: "
          f"check on 2 x 333/1001 x 2 heads, time on {b} x {s} x {h} heads"
          + (f", medians of {args.rounds} interleaved rounds (range)" if args.rounds > 1 else ""))
    o = torch.empty_like(big[0])
    lse_big = torch.empty(b, h, s, device="cuda")
    runs, notes = {}, {}
    for label, config, why in configs:
        if config is None:
            print(f"{label:<20} invalid: {why}")
            continue
        try:
            # built for this GPU's arch, as the backend builds it (the sm_80 kernels run on an
            # H200 compiled for sm_90a)
            run = launcher(backend.cache.get(config, backend.arch())[0], config)
            out = torch.full_like(small[0], math.nan)
            lse = torch.full((2, 2, 333), math.nan, device="cuda")
            run(*small, out, lse, attn_args(333, 1001))
            torch.cuda.synchronize()
            passed, err, bound = within_tolerance(out, ref, ref_torch, dtype)
            if not passed:
                print(f"{label:<20} WRONG: max error {err:.3g} > {bound:.3g}")
                continue
            runs[label] = lambda run=run: run(*big, o, lse_big, attn_args(s, s))
            notes[label] = f"({config.name}, error {err:.2e})"
        except Exception as exc:
            print(f"{label:<20} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    q, k, v = big
    try:
        from flash_attn.cute.interface import flash_attn_func

        runs["flash-attn-4"] = lambda: flash_attn_func(q, k, v, causal=args.causal)
    except ImportError:
        pass
    if args.arch == "sm_80":  # the sm_80 kernels' peer: PyTorch SDPA's FlashAttention-2
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in big)

        def sdpa_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)

        runs["sdpa-flash"] = sdpa_flash
    for label, times in interleaved_rounds(runs, args.rounds).items():
        rates = sorted(flops / ms * 1e-9 for ms in times)
        spread = f" ({rates[0]:.1f}-{rates[-1]:.1f})" if len(rates) > 1 else ""
        print(f"{label:<20} {statistics.median(rates):8.1f} TFLOP/s{spread}   {notes.get(label, '')}", flush=True)


def main(argv=None) -> int:
    from bench_lib import tile_tuning_main

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("sm_80", "sm_90a"), default="sm_90a")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every candidate (and the peers) this many times, taking turns, and report the medians")
    return tile_tuning_main(p, argv, 8192, default_candidates, candidates, compile_only, on_gpu)


def default_candidates(args) -> list:
    if args.arch == "sm_90a":
        return ["128x176w2s2", "128x160w2s2", "128x144w2s2", "192x128w3s2", "192x112w3s2", "128x128w2s2-nopp",
                "128x128w2s3"]
    return ["128x64w4s2", "128x128w8s1", "128x64w8s2", "64x128w4s2"]


if __name__ == "__main__":
    sys.exit(main())
