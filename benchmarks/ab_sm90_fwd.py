"""A/B of the sm_90 forward's softmax schedule: the shipped kernels (lazy rescale, with the keep
vote at head dims 64, 96 and 128) against the eager rescale, next to flash-attn-4.

    python benchmarks/ab_sm90_fwd.py                      # GPU: check, then time every case
    python benchmarks/ab_sm90_fwd.py --head-dims 128 --causal-only
    python benchmarks/ab_sm90_fwd.py --compile-only       # CPU: registers and spills only

Cases: bf16, head dims 64 / 96 / 128 / 192 / 256, causal and not, batch x seqlen x heads =
2 x 8192 x 16 (32 heads at head dim 64, the same FLOPs per head dim squared; 8 at 192, as
1536 / 192). Variants of each case:

* first the shipped configuration (`make_config`), i.e. what `cute_flash.forward` runs, then the
  same with the other rescale; `lazy` (`lazy_rescale=True`, shipped at every head dim): a row
  keeps its exp reference while its max grows by at most 8 in log2 units, and a warp skips O's
  rescale when none of its rows changed reference; `eager` (`lazy_rescale=False`): every block
  moves the reference and rescales O;
* `keepvote` (`keep_vote`, with the lazy rescale; `no keepvote` where shipped, head dims 64, 96 and 128):
  each warp votes on whether all its rows keep their references, from its lanes' own maxima,
  and skips the max shuffles and the rescale's selects when they do;
* `pvwait0` / `8` / `12` / `16` / `20` / `24` / `32` (`keepvote pvwaitK` where the keep vote is not
  shipped; also on the K/V clusters, `cluster [grid] [keepvote] pvwaitK`; the shipped K left
  out): the keep vote with the P·V wait right after the vote's branches, which then hold only a
  thread's first K exponentials (`pv_wait_at`); `[cluster [grid]] pvwait end` where a K is
  shipped: the wait after the softmax, all exponentials in the branches;
* with the tile counter (persistent causal calls), `stride` (a fixed stride over the tiles
  instead) and `late take` / `early take` (`late_take` flipped: the add that takes the next tile
  issued after or before the current tile's loads);
* with a causal mask, `compares` (`mask_bits=False`): each masked element's column compared
  with its row's limit, instead of the limit turned into a bit mask of the row's elements;
* with a causal mask at head dim 64, `whole` (`masked_halves=False`): every masked key
  block's GEMMs over all of its keys, also for a warpgroup that sees half of them or none;
* at every head dim: the other GEMM-issue schedule, `no pingpong` where the ping-pong is shipped
  (the consumer warpgroups issuing their GEMMs freely; shipped at 192 before 2026-12-01) and
  `pingpong` at 256, and at 192 and 256, when causal, the same with the other mask as well
  (`pingpong, compares`); `s3` (three K/V stages) where it fits the shared memory (head
  dims 64 and 96; at 128 below);
* at head dim 256 only: `n80` (tile_n 80 instead of 64) and `late` (`rescale_o_before_pv=False`:
  O rescaled after P·V is waited for);
* at head dim 192: `n112` / `n128` (wider key blocks) where they fit the shared memory;
* at head dims 128 and 192 with a causal mask: `cluster grid`, K/V clusters of two CTAs on one
  CTA per tile (each CTA walks the key blocks of the cluster's later query block, letting those
  past its own go unread);
* at head dims 64 to 192 without a mask: `cluster`, the K/V clusters, which `cute_flash.forward`
  takes where a call has an even number of query blocks (at 64 to 128, in the persistent loop,
  or of (batch, head) pairs); both cluster variants also with the
  other `keep_vote` (`cluster [no] keepvote`, `cluster grid [no] keepvote`);
* at head dim 96: `128x128` (two consumer warpgroups on 128 x 128, its tile before the three
  warpgroups of 192 rows) and `n96` (96 keys per block);
* at head dim 128: `128x128` (its tile before 192 x 80, with its P·V wait, and when causal what
  calls of short sequences run, `short_sequence_variant`, half blocks included; also
  `128x128 cluster` without a mask and `128x128 cluster grid` with one), `192x64` (64 keys per
  block; `192x64 cluster` without a mask) and `s3` (three K/V stages; `cluster s3`);
* at head dims 64 and 96: `psmem` (`p_in_smem`: P·V reads P from shared memory) on the shipped
  tile and on wider key blocks (`n128`, `n144` at 96; `n192` at 64), with the half
  blocks where a causal call's blocks are 128 keys wide, on one CTA per tile (`grid`) where the
  persistent loop's shared memory does not fit;
* the other schedules where the tile table allows persistence (head dims 64 and 128): `grid`
  (`persistent=False`: one CTA per tile) where the shipped configuration is persistent,
  `persist` (`persistent=True`: one CTA per SM walking the tiles) where it is not, and, with a
  causal mask, `stride` (persistent CTAs taking the tiles by a fixed stride instead of from the
  tile counter);
* `fa4`: `flash_attn.cute.interface.flash_attn_func`, when importable (timed, not checked).

As in `tune_tiles.py`, a variant is first checked against the float32 reference (out by the
benchmark's tolerance rule, LSE to 1e-3 where finite and -inf where the row sees no key) on small
problems chosen to exercise the rescale: 2 x 701/1001 x 2 heads of random data (701 queries: an
even number of 128- and of 192-row query blocks, as the K/V clusters pair them, with a tail;
1001 for the causal case below too); 461 queries (three 192-row blocks, whose last ones unmasked
K/V clusters take two heads to a cluster); the same as the first with
a ramp that makes every row's max grow by ~5 (log2 units) per key block, so that some blocks keep
the reference and others move it; and, when causal, 1001 queries over 333 keys, whose first 668
rows see no key (out 0, LSE -inf). A wrong variant is reported and not timed. Then
`triton.testing.do_bench` (median of 100 ms after 25 ms of warm-up) times the big case, each
variant and flash-attn-4 once per round for `--rounds` rounds (default 1), taking turns in an
order reversed every other round.

One line per case: TFLOP/s of each variant (forward FLOPs 4·b·h·s²·d, halved when causal; the
median over the rounds and, with more than one, their range) and lazy's gain over eager.

    python benchmarks/ab_sm90_fwd.py --head-dims 192 --rounds 7 --batch 8 --seqlen 2048
    python benchmarks/ab_sm90_fwd.py --head-dims 256 --rounds 7 --variants "pingpong,compares"
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

HEADS = {64: 32, 96: 16, 128: 16, 192: 8, 256: 16}
# `pv_wait_at` of the `pvwait` variants: exponentials before the P·V wait
PV_WAITS = (0, 8, 12, 16, 20, 24, 32)


def variants(head_dim: int, causal: bool, only=None) -> list:
    """(label, config) of the cute variants of one case, the shipped one first; `only`: the labels
    to keep besides the shipped one (all where None)."""
    from bench_lib import fits
    from cute_flash.kernels.sm90.fwd_config import (
        NO_KEEP_VOTE, SHORT_CAUSAL_TILES, TILES, make_config, on_grid, short_sequence_variant,
    )

    shipped = make_config("bfloat16", head_dim, head_dim, causal=causal)
    rescale = ("lazy", "eager") if shipped.lazy_rescale else ("eager", "lazy")
    # (no `keep_vote` without the lazy rescale)
    other = replace(shipped, lazy_rescale=not shipped.lazy_rescale, **NO_KEEP_VOTE)
    out = [(rescale[0], shipped), (rescale[1], other)]
    # the lazy rescale with each warp's vote on whether its rows all keep their references
    if shipped.keep_vote:
        out += [("no keepvote", replace(shipped, **NO_KEEP_VOTE))]
    else:
        out += [("keepvote", replace(shipped, lazy_rescale=True, keep_vote=True))]
    # the keep vote with the P·V wait after the vote's branches, which hold the first K
    # exponentials of a thread (the rest after the wait)
    out += pv_waits("", shipped, shipped)
    if shipped.persistent:  # the one-tile-per-CTA grid
        out += [("grid", on_grid(shipped))]
    elif TILES[head_dim].persistent:  # persistent CTAs where the call does not ship them
        out += [("persist", replace(shipped, persistent=True))]
    if shipped.tile_counter:  # persistent CTAs taking the tiles by a fixed stride
        out += [("stride", replace(shipped, tile_counter=False, late_take=False))]
        # the counter's add issued before or after the tile's loads
        out += [("early take" if shipped.late_take else "late take", replace(shipped, late_take=not shipped.late_take))]
    if causal:  # the mask by a comparison per element instead of bit masks
        out += [("compares", replace(shipped, mask_bits=False))]
    if shipped.masked_halves:  # every masked block's GEMMs over all of its keys
        out += [("whole", replace(shipped, masked_halves=False))]
    # the other GEMM-issue schedule (ping-pong on or off)
    out += [("no pingpong" if shipped.pingpong else "pingpong", replace(shipped, pingpong=not shipped.pingpong))]
    if head_dim != 128 and fits(shipped, num_stages=3):  # a third K/V stage (128: below, with its clusters)
        out += [("s3", replace(shipped, num_stages=3))]
    if head_dim in (192, 256):
        if causal:  # ... with the other mask
            out += [("no pingpong, compares" if shipped.pingpong else "pingpong, compares",
                     replace(shipped, pingpong=not shipped.pingpong, mask_bits=not shipped.mask_bits))]
    if head_dim == 256:
        out += [("n80", replace(shipped, tile_n=80)), ("late", replace(shipped, rescale_o_before_pv=False))]
    if head_dim == 192:  # wider key blocks (fewer on the causal diagonal)
        out += [(f"n{n}", replace(shipped, tile_n=n)) for n in (112, 128) if fits(shipped, tile_n=n)]
    # the K/V clusters (on one CTA per tile when causal, as calls with 64 query blocks or more
    # take them), also with the other `keep_vote`
    kv_label = "no keepvote" if shipped.keep_vote else "keepvote"
    if head_dim in (128, 192) and causal:  # causal K/V clusters on the one-CTA-per-tile grid
        cluster = replace(on_grid(shipped), cluster_kv=True)
        out += [("cluster grid", cluster), (f"cluster grid {kv_label}", toggle_vote(cluster))]
        out += pv_waits("cluster grid ", cluster, shipped)
    if shipped.pairs_query_blocks and shipped.tile_n >= 80:
        # the K/V clusters that calls with an even number of query blocks take (`with_cluster_kv`)
        cluster = replace(shipped, cluster_kv=True)
        out += [("cluster", cluster), (f"cluster {kv_label}", toggle_vote(cluster))]
        out += pv_waits("cluster ", cluster, shipped)
    if head_dim == 128:  # its former tile (two warpgroups on 128 x 128), and 64 keys per block
        # causal: what calls of short sequences run; without a mask: that tile as it shipped
        short = SHORT_CAUSAL_TILES[128]
        former = short_sequence_variant(shipped) if causal else replace(
            shipped, tile_m=short.tile_m, tile_n=short.tile_n, num_consumer_wgs=short.num_consumer_wgs,
            pv_wait_at=short.pv_wait_at)
        out += [("128x128", former), ("192x64", replace(shipped, tile_n=64)), ("s3", replace(shipped, num_stages=3))]
        if not causal:
            out += [("128x128 cluster", replace(former, cluster_kv=True)),
                    ("192x64 cluster", replace(shipped, tile_n=64, cluster_kv=True)),
                    ("cluster s3", replace(shipped, num_stages=3, cluster_kv=True))]
        else:
            out += [("128x128 cluster grid", replace(on_grid(former), cluster_kv=True))]
    if head_dim == 96:  # the 128-row tile of two warpgroups, and 96 keys per block
        out += [("128x128", replace(shipped, tile_m=128, num_consumer_wgs=2, tile_n=128)),
                ("n96", replace(shipped, tile_n=96))]
    if head_dim in (64, 96):  # P from shared memory, on the same tile and on wider key blocks
        for n in (shipped.tile_n,) + ((128, 144) if head_dim == 96 else (192,)):
            if n != shipped.tile_n and n == 128 and causal and shipped.persistent:
                out += [("n128 psmem halves", replace(shipped, tile_n=128, p_in_smem=True, masked_halves=True))]
            elif fits(shipped, tile_n=n, p_in_smem=True, masked_halves=shipped.masked_halves and n == 128):
                label = "psmem" if n == shipped.tile_n else f"n{n} psmem"
                out += [(label, replace(shipped, tile_n=n, p_in_smem=True,
                                        masked_halves=shipped.masked_halves and n == 128))]
            elif fits(on_grid(shipped), tile_n=n, p_in_smem=True):
                out += [(f"n{n} psmem grid", replace(on_grid(shipped), tile_n=n, p_in_smem=True))]
    return out if only is None else out[:1] + [(label, c) for label, c in out[1:] if label in only]


def toggle_vote(config):
    """`config` with the other `keep_vote` (the P·V wait after the softmax without it)."""
    from cute_flash.kernels.sm90.fwd_config import NO_KEEP_VOTE

    if config.keep_vote:
        return replace(config, **NO_KEEP_VOTE)
    return replace(config, lazy_rescale=True, keep_vote=True)


def pv_waits(label: str, config, shipped) -> list:
    """The `pvwaitK` variants of `config` (labelled `label` [`keepvote `] `pvwaitK`): the keep
    vote with the P·V wait after its branches, which hold a thread's first K exponentials, for
    the K of `PV_WAITS` that fit, bar the one `shipped` takes; where it takes one, also the
    wait after the softmax (`pvwait end`)."""
    from bench_lib import fits

    voting = config if config.keep_vote else replace(config, lazy_rescale=True, keep_vote=True)
    label += "" if shipped.keep_vote else "keepvote "
    out = [(f"{label}pvwait{k}", replace(voting, pv_wait_at=k)) for k in PV_WAITS
           if k != shipped.pv_wait_at and fits(voting, pv_wait_at=k)]
    if shipped.pv_wait_at >= 0:  # the wait after the softmax, all exponentials in the branches
        out += [(f"{label}pvwait end", replace(voting, pv_wait_at=-1))]
    return out


def compile_only(cases, only=None) -> None:
    from cute_flash.audit import AuditTarget, audit_target
    from cute_flash.kernels.sm90.fwd_config import compile_fwd

    for d, causal in cases:
        cells = []
        for label, config in variants(d, causal, only):
            row = audit_target(AuditTarget(config.name, "sm_90a", lambda opts, c=config: compile_fwd(c, opts)))
            state = row.error or ("SPILLS" if row.spills else "ok")
            cells.append(f"{label} {row.registers} regs spill {row.spill_stores or 0}/{row.spill_loads or 0} {state}")
        print(f"hd{d:<3} {'causal' if causal else 'full  '}  " + " | ".join(cells), flush=True)


def _compile_variant(config) -> str:
    from cute_flash.backends import get_backend

    backend = get_backend("cute-sm90")
    return backend.cache.get(config, backend.arch())[1]


def check_problems(d: int, causal: bool, dtype):
    """(name, q, k, v) small problems on which every variant must match the reference."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float32, device="cuda", generator=g)

    out = []
    q, k, v = randn(2, 701, 2, d), randn(2, 1001, 2, d), randn(2, 1001, 2, d)
    out.append(("random 701/1001", q, k, v))
    # an odd number of 192-row query blocks (3), which unmasked K/V clusters cover two heads to a cluster
    out.append(("random 461/1001", randn(2, 461, 2, d), k, v))
    # Scores (in log2 units: q0 * k0 * scale * log2(e), q0 = 8) grow by 5 per 128-key block towards
    # key 0, as the kernels visit key blocks from the last one down.
    ramp = torch.linspace(5.0 * 1001 / 128, 0.0, 1001, device="cuda") / (8 * d ** -0.5 * math.log2(math.e))
    q2, k2 = q.clone(), k.clone()
    q2[..., 0] = 8.0
    k2[..., 0] = ramp[None, :, None]
    out.append(("growing max 701/1001", q2, k2, v))
    if causal:
        out.append(("empty rows 1001/333", randn(2, 1001, 2, d), randn(2, 333, 2, d), randn(2, 333, 2, d)))
    return [(name, *(t.to(dtype) for t in (q, k, v))) for name, q, k, v in out]


def check(run, problems, attn_args, dtype) -> str | None:
    """None if `run` matches the reference on every problem, else what went wrong."""
    import torch

    from bench_lib import within_tolerance
    from cute_flash.backends.reference import reference_attention

    for name, q, k, v in problems:
        b, sq, h, _ = q.shape
        args = attn_args()
        ref, ref_lse = reference_attention(q, k, v, args)
        ref_torch, _ = reference_attention(q, k, v, args, compute_dtype=dtype)
        out = torch.full_like(q, math.nan)
        lse = torch.full((b, h, sq), math.nan, device="cuda")
        run(q, k, v, out, lse, args)
        torch.cuda.synchronize()
        passed, err, bound = within_tolerance(out, ref, ref_torch, dtype)
        if not passed:
            return f"{name}: out error {err:.3g} > {bound:.3g}"
        finite = torch.isfinite(ref_lse)
        if not torch.equal(torch.isfinite(lse), finite) or (lse[~finite] != -math.inf).any():
            return f"{name}: LSE not -inf exactly where the row sees no key"
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
        if not lse_err <= 1e-3:
            return f"{name}: LSE error {lse_err:.3g} > 1e-3"
    return None


def on_gpu(cases, args) -> None:
    import statistics

    import torch

    from bench_lib import interleaved_rounds

    from cute_flash.backends import get_backend
    from cute_flash.backends.base import AttnArgs

    backend = get_backend("cute-sm90")
    ka = backend.cache.args
    dtype = torch.bfloat16
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError:
        flash_attn_func = None

    print(f"sm_90 forward A/B, bf16, batch {args.batch} x seqlen {args.seqlen}; TFLOP/s (median of do_bench)")
    for d, causal in cases:
        h = HEADS[d]
        b, s = args.batch, args.seqlen
        flops = 4 * b * h * s * s * d / (2 if causal else 1)

        def attn_args(d=d, causal=causal):
            return AttnArgs(softmax_scale=d ** -0.5, causal=causal, window_right=0 if causal else -1)

        problems = check_problems(d, causal, dtype)
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device="cuda", generator=g) for _ in range(3))
        o = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda")
        cells, runs = {}, {}
        for label, config in variants(d, causal, args.variants):
            cells[label] = label  # (in this order)
            try:
                fn = backend.cache.get(config, backend.arch())[0]

                def run(q_, k_, v_, out_, lse_, a_, fn=fn, config=config):
                    backend.launch(fn, q_, k_, v_, out_, lse_, a_, ka, extra=backend.launch_extra(config, q_, k_, a_, ka))

                wrong = check(run, problems, attn_args, dtype)
                if wrong:
                    cells[label] = f"{label} WRONG ({wrong})"
                    continue
                runs[label] = lambda run=run: run(q, k, v, o, lse, attn_args())
            except Exception as exc:  # one broken variant must not hide the others
                cells[label] = f"{label} FAILED ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        if flash_attn_func is not None:
            runs["fa4"] = lambda: flash_attn_func(q, k, v, causal=causal)
        speed = {}
        for label, times in interleaved_rounds(runs, args.rounds).items():
            rates = sorted(flops / ms * 1e-9 for ms in times)
            speed[label] = statistics.median(rates)
            spread = f" ({rates[0]:.1f}-{rates[-1]:.1f})" if len(rates) > 1 else ""
            cells[label] = f"{label} {speed[label]:6.1f}{spread}"
        line = list(cells.values())
        if "eager" in speed and "lazy" in speed:
            line.append(f"lazy/eager {100 * (speed['lazy'] / speed['eager'] - 1):+.1f}%")
        print(f"hd{d:<3} {'causal' if causal else 'full  '} h{h:<2} | " + " | ".join(line), flush=True)


def main(argv=None) -> int:
    from bench_lib import ab_cases, add_ab_case_arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ab_case_arguments(p, tuple(HEADS), 8192, "registers and spills only (no GPU needed)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant (and flash-attn-4) this many times, taking turns, and report the medians")
    p.add_argument("--variants", type=lambda x: [v.strip() for v in x.split(",")], default=None,
                   help="comma list of variant labels to run besides the shipped one (default: all)")
    p.add_argument("--jobs", type=int, default=0, help="compile the variants first in this many processes")
    args = p.parse_args(argv)
    cases = ab_cases(p, args, tuple(HEADS))
    if args.compile_only:
        compile_only(cases, args.variants)
        return 0
    if args.jobs > 0:
        from bench_lib import warm_in_processes

        warm_in_processes([c for d, causal in cases for _, c in variants(d, causal, args.variants)], _compile_variant,
                          args.jobs)
    on_gpu(cases, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
