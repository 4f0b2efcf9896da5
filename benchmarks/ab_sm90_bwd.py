"""A/B of the sm_90 backward kernel's schedule flags: the shipped configuration against each flag
flipped, on an H100/H200.

    python benchmarks/ab_sm90_bwd.py                      # GPU: check, then time every case
    python benchmarks/ab_sm90_bwd.py --head-dims 64 --causal-only --rounds 3
    python benchmarks/ab_sm90_bwd.py --compile-only       # CPU: registers, spills, serialization

Cases: bf16, head dims 64, 96, 128, 192 and 256, causal and not, batch x seqlen = 2 x 4096 with
2048 / head dim heads (21 at 96, 10 at 192). Variants of each case (`kernels/sm90/bwd_config.py`
says what each flag does; at 192 and 256, the column-split tile, only those it takes):

* `shipped`: the configuration `cute_flash.attention`'s backward runs (`make_config`);
* one variant per schedule flag that the case can flip: `stats_early`, `dq_fence_late` (with the
  dQ writer warp), `overlap_dv`, `dk_after_dq` (where it is on: at head dim 128 turning it on
  serializes the WGMMAs) or else `dk_behind_dq`, `dq_writer` (off, with `dq_fence_late` off and one
  dQ tile), `dq_stages` (1 where 2 ship, else 2), `lpt` (off, causal), `dkv_staged`, `dq_split`
  (off), `dq_swap` (off), `rotate_queries` (`rotate` / `no rotate`), one more Q / dO stage where
  it fits (head dim 64), where the 96-key tile ships (`keys_n`), the 64-key column-split tile
  (`64 keys`), the row-major dQ tile in place of the flat one (`row-major dQ`, and with the
  swap where the tile's columns allow it, `row-major dQ swapped`), dQ written by the main kernel's
  conversion CTAs instead of the postprocess kernel (`in-kernel dQ`), with a causal mask the masked
  path's verdicts by a comparison per (key, query) pair instead of bit masks (`compares`), and
  `deterministic` (ordered dQ reduce-adds, without clusters or rotation), and below head dim 192
  the dQ GEMMs' two options flipped: at head dims 96 and 128, where both ship, dS read as the
  MN-major view of dS^T (`dS MN-major`, `ds_kmajor` off), each warpgroup's whole dQ GEMM after
  the barrier of both (`dQ after both`, `dq_own_first` off) and both off (`dQ after both + dS
  MN-major`, the kernel before them); at head dim 64 dS^T stored transposed so that the dQ GEMMs
  read dS K-major (`dS K-major`), and each warpgroup's dQ GEMM (its 64 rows of the 128-row tile)
  over its own keys first (`dQ own first`; also with `ds_kmajor`);
* `before`: `stats_early` and `dq_fence_late` both off, the schedule before either existed.

Every variant runs between the preprocess and postprocess kernels of its dQ accumulator
(`backward_sm90` with the main kernel swapped and `cute_bwd.pre_post`'s pair for it: the flat
accumulator's postprocess, or the row-major one's). A variant is first checked against the float32
reference backward (dq, dk and dv by the benchmark's tolerance rule) on 2 x 333 queries over 1001
keys (causal: 1001 over 333, so that rows see no key) with 4 heads; a wrong variant is reported
and not timed. Then each round times every variant once with `triton.testing.do_bench` (median of
80 ms), the order reversed every other round, so that slow drifts of the GPU's clock spread over
all of them. One line per case: the
milliseconds of each variant in every round and the backward's TFLOP/s (2.5 times the forward's
4·b·h·s²·d, halved when causal) at the shipped variant's best round.

The compile-only mode builds every variant for sm_90a and prints registers, spills and whether
ptxas serialized the WGMMAs (its C7512 / C7514 remarks), which a GPU timing would only show as a
slowdown.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

HEAD_DIMS = (64, 96, 128, 192, 256)


def variants(head_dim: int, causal: bool, only=None) -> list:
    """(label, main kernel config) of the backward variants of one case, the shipped one first;
    `only`: the labels to keep (all where None)."""
    from cute_flash.kernels.sm90.bwd_config import make_config

    shipped = make_config("bfloat16", head_dim, head_dim, causal=causal)
    flips = [("stats_early", {"stats_early": not shipped.stats_early})]
    if shipped.dq_writer:
        flips.append(("dq_fence_late", {"dq_fence_late": not shipped.dq_fence_late}))
        flips.append(("no dq_writer", {"dq_writer": False, "dq_fence_late": False, "dq_stages": 1, "dq_flat": False,
                                       "dq_convert": False}))
    if shipped.dq_stages > 1:
        flips.append(("one dQ tile", {"dq_stages": 1}))
    elif shipped.dq_writer:
        flips.append(("two dQ tiles", {"dq_stages": 2}))
    flips.append(("overlap_dv", {"overlap_dv": not shipped.overlap_dv}))
    if shipped.dk_after_dq:
        flips.append(("no dk_after_dq", {"dk_after_dq": False}))
    else:
        flips.append(("dk_behind_dq", {"dk_behind_dq": not shipped.dk_behind_dq}))
    if shipped.causal:
        flips.append(("no lpt", {"lpt": False}))
    flips.append(("no dkv_staged" if shipped.dkv_staged else "dkv_staged", {"dkv_staged": not shipped.dkv_staged}))
    if shipped.dq_split:
        flips.append(("no dq_split", {"dq_split": False}))
    flips.append(("before", {"stats_early": False, "dq_fence_late": False}))
    if not shipped.dv_after_ds and not shipped.softcap:
        # flash-attn-4's order: dV issued once dS^T is formed (no GEMM in flight meanwhile)
        flips.append(("dV after dS", {"dv_after_ds": True, "overlap_dv": False}))
    # The dQ GEMMs' two options, flipped where the tile takes them (`replace` refuses the others,
    # the column-split tile's): dS read K-major from a transposed dS^T store (flash-attn-4's) or
    # as the MN-major view of the dS^T tile; each warpgroup's dQ GEMM over its own keys before the
    # barrier of both, then the other's, or all of it after the barrier.
    flips.append(("dS MN-major" if shipped.ds_kmajor else "dS K-major", {"ds_kmajor": not shipped.ds_kmajor}))
    if shipped.dq_own_first:
        # alone, and with dS MN-major too (the kernel before the two options)
        flips.append(("dQ after both", {"dq_own_first": False}))
        flips.append(("dQ after both + dS MN-major", {"dq_own_first": False, "ds_kmajor": False}))
    else:
        flips.append(("dQ own first", {"dq_own_first": True}))
        flips.append(("dQ own first + dS K-major", {"dq_own_first": True, "ds_kmajor": True}))
    if shipped.dq_rows:
        # the 64-row step it replaced (dQ's columns split, two dQ tiles, dV overlapped, dK after dQ)
        flips.append(("64 rows", {"tile_m": 64, "dq_rows": False, "dq_split": True, "dq_stages": 2,
                                  "dv_after_ds": False, "overlap_dv": True, "dk_behind_dq": False,
                                  "dk_after_dq": True}))
    if shipped.keys_n:
        # the column-split tile's 64 keys per CTA shared by both warpgroups, keys on M
        flips.append(("64 keys", {"keys_n": False, "single_dout": False, "num_stages": 2}))
    if shipped.dq_swap:
        # the dQ tile's 64-bit stores in the accumulator's own column order (two rows per bank)
        flips.append(("no dq_swap", {"dq_swap": False}))
    if shipped.dq_flat and not shipped.deterministic:
        # dQ written by the main kernel's own conversion CTAs instead of the postprocess kernel
        flips.append(("in-kernel dQ", {"dq_convert": True}))
    if shipped.dq_flat:
        # the row-major dQ tile and its tensor-TMA reduce-add, with and without the swap
        flips.append(("row-major dQ", {"dq_flat": False, "dq_convert": False}))
        if shipped.dq_cols % 32 == 0:
            flips.append(("row-major dQ swapped", {"dq_flat": False, "dq_convert": False, "dq_swap": True}))
    if shipped.causal or shipped.local:
        # the masked path's (key, query) verdicts by a comparison each instead of bit masks
        flips.append(("compares", {"mask_bits": False}))
    # each CTA's walk over the query blocks from a start spread over the range, or from the first
    flips.append(("no rotate" if shipped.rotate_queries else "rotate", {"rotate_queries": not shipped.rotate_queries}))
    flips.append((f"{shipped.num_stages + 1} stages", {"num_stages": shipped.num_stages + 1}))
    # ordered dQ reduce-adds (`deterministic`: no cluster, no rotation, lpt's grid)
    flips.append(("deterministic", {"deterministic": True, "cluster_q": False, "rotate_queries": False, "lpt": True,
                                    "dq_convert": False}))
    if only is not None:
        flips = [(label, change) for label, change in flips if label in only]
    out, seen = [("shipped", shipped)], {shipped}
    for label, change in flips:
        try:
            config = replace(shipped, **change)
        except ValueError:  # e.g. another stage past the shared memory
            continue
        if config not in seen:  # e.g. `before` where neither flag ships
            out.append((label, config))
            seen.add(config)
    return out


def compile_only(cases, only=None) -> None:
    import tempfile

    from cute_flash.audit import AuditTarget, audit_target
    from cute_flash.kernels.sm90.bwd_config import compile_kernel

    for d, causal in cases:
        cells = []
        for label, config in variants(d, causal, only):
            with tempfile.TemporaryDirectory() as keep:
                target = AuditTarget(config.name, "sm_90a", lambda opts, c=config: compile_kernel(c, opts))
                row = audit_target(target, keep_dir=Path(keep))
                remarks = Path(keep, config.name, "remarks.yaml")
                serialized = remarks.exists() and "instructions are serialized" in remarks.read_text()
            state = row.error or ("SPILLS" if row.spills else "SERIALIZED" if serialized else "ok")
            cells.append(f"{label} {row.registers} regs spill {row.spill_stores or 0}/{row.spill_loads or 0} {state}")
        print(f"hd{d:<3} {'causal' if causal else 'full  '}  " + " | ".join(cells), flush=True)


def check(run, d: int, causal: bool, attn_args, dtype) -> str | None:
    """None if `run` (a backward of the given configuration) matches the float32 reference
    backward on a small problem, else what went wrong."""
    import torch

    from bench_lib import within_tolerance
    from cute_flash.backends.reference import reference_attention, reference_attention_backward

    g = torch.Generator(device="cuda").manual_seed(0)
    sq, sk = (1001, 333) if causal else (333, 1001)
    q = torch.randn(2, sq, 4, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, sk, 4, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    args = attn_args()
    out, lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out = out.to(dtype)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(dtype)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    run(dout, q, k, v, out, lse, grads, args)
    torch.cuda.synchronize()
    refs = reference_attention_backward(dout, q, k, v, out, lse, None, args, compute_dtype=torch.float32)
    # the same attention in plain torch in `dtype`, forward included, sets the tolerance
    out_t, lse_t = reference_attention(q, k, v, args, compute_dtype=dtype)
    refs_torch = reference_attention_backward(dout, q, k, v, out_t, lse_t, None, args, compute_dtype=dtype)
    for name, got, ref, ref_torch in zip(("dq", "dk", "dv"), grads, refs, refs_torch):
        passed, err, bound = within_tolerance(got, ref, ref_torch, dtype)
        if not passed:
            return f"{name} error {err:.3g} > {bound:.3g}"
    return None


def _compile_variant(config) -> str:
    from cute_flash.backends.cute_bwd import sm90_kernel_cache

    return sm90_kernel_cache().get(config, "sm_90a")[1]


def warm(cases, jobs: int, only=None) -> None:
    """Every variant's main kernel compiled into the disk cache by `jobs` processes at once."""
    from bench_lib import warm_in_processes

    warm_in_processes([config for d, causal in cases for _, config in variants(d, causal, only)], _compile_variant, jobs)


def problem(b: int, s: int, h: int, d: int, causal: bool) -> tuple:
    """A bf16 backward case on the GPU: (its `AttnArgs`, (dout, q, k, v, out, lse), the three
    gradient buffers), with out and LSE from cute_flash's forward."""
    import torch

    import cute_flash
    from cute_flash.backends.base import AttnArgs

    args = AttnArgs(softmax_scale=d ** -0.5, causal=causal, window_right=0 if causal else -1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(3))
    out, lse = cute_flash.attention(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn(out.shape, dtype=torch.bfloat16, device="cuda", generator=gen)
    return args, (dout, q, k, v, out, lse), [torch.empty_like(t) for t in (q, k, v)]


def run_backward(config, dout, q, k, v, out, lse, grads, args) -> None:
    """The sm_90 backward of a call with its main kernel built from `config`, between the call's
    own preprocess and postprocess kernels."""
    from cute_flash.backends import get_backend
    from cute_flash.backends.cute_bwd import backward_sm90, pre_post

    # the preprocess and postprocess that go with this main kernel's dQ accumulator (`dq_flat`)
    pre, post = pre_post(config, q.shape[-1], v.shape[-1], False)
    backward_sm90(get_backend("cute-sm90"), dout, q, k, v, out, lse, None, *grads, args, False, (pre, config, post))


def on_gpu(cases, opts) -> None:
    import torch

    from bench_lib import interleaved_rounds
    from cute_flash.backends.base import AttnArgs

    dtype = torch.bfloat16
    b, s = opts.batch, opts.seqlen
    print(f"sm_90 backward A/B, bf16, batch {b} x seqlen {s}; ms of each round (do_bench median)")
    for d, causal in cases:
        h = 2048 // d
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

        def attn_args(d=d, causal=causal):
            return AttnArgs(softmax_scale=d ** -0.5, causal=causal, window_right=0 if causal else -1)

        _, (dout, q, k, v, out, lse), grads = problem(b, s, h, d, causal)
        runs, cells = {}, {}
        for label, config in variants(d, causal, opts.variants):

            def run(dout_, q_, k_, v_, out_, lse_, g_, a_, config=config):
                run_backward(config, dout_, q_, k_, v_, out_, lse_, g_, a_)

            try:
                wrong = check(run, d, causal, attn_args, dtype)
            except Exception as exc:  # one broken variant must not hide the others
                wrong = f"FAILED ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
            if wrong:
                cells[label] = f"WRONG ({wrong})"
            else:
                runs[label] = run
        times = interleaved_rounds({label: (lambda run=run: run(dout, q, k, v, out, lse, grads, attn_args()))
                                    for label, run in runs.items()}, opts.rounds, rep_ms=80)
        for label, ms in times.items():
            cells[label] = "/".join(f"{t:.3f}" for t in ms)
        line = " | ".join(f"{label} {cell}" for label, cell in cells.items())
        if "shipped" in times:
            line += f" | shipped {flops / min(times['shipped']) * 1e-9:.0f} TFLOP/s"
        print(f"hd{d:<3} {'causal' if causal else 'full  '} h{h:<2} | {line}", flush=True)


def main(argv=None) -> int:
    from bench_lib import ab_cases, add_ab_case_arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ab_case_arguments(p, HEAD_DIMS, 4096, "registers, spills and serialization only (no GPU)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--jobs", type=int, default=0, help="compile the variants first in this many processes")
    p.add_argument("--variants", type=lambda x: [v.strip() for v in x.split(",")], default=None,
                   help="comma list of variant labels to run besides the shipped one (default: all)")
    opts = p.parse_args(argv)
    cases = ab_cases(p, opts, HEAD_DIMS)
    if opts.rounds < 1:
        p.error("--rounds must be at least 1")
    if opts.compile_only:
        compile_only(cases, opts.variants)
        return 0
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (H100/H200); --compile-only runs anywhere", file=sys.stderr)
        return 2
    if opts.jobs > 0:
        warm(cases, opts.jobs, opts.variants)
    on_gpu(cases, opts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
