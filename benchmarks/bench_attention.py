"""Side-by-side attention benchmark: cute_flash's backends against every peer importable here.

For each case of the sweep (forward, forward + backward, decode) every provider runs in this
process on the same inputs. Before it is timed, a provider's result (and, for forward +
backward, its gradients) is checked against cute_flash's float32 reference with DESIGN.md's
tolerance; a provider that fails is reported as `wrong`, never timed. Times are
`triton.testing.do_bench` medians after warm-up (CUDA events if Triton is missing); FLOPs and
bytes follow DESIGN.md (see bench_lib.py). Errors and out-of-memory are recorded per cell. With
`--rounds N` every provider of a case is timed N more times once all of them are checked, the
providers taking turns in an order that reverses every round (C B A, A B C, C B A, ...), and a
cell reports the median of those N: drifts of the GPU's clock then touch every provider alike
instead of whichever ran during them.

Writes <out-dir>/<gpu>-<date>.md (tables), .json (raw results) and -<mode>.png (plots); the
tables and JSON are rewritten after every case, so an interrupted run keeps what it measured.

    python benchmarks/bench_attention.py                     # the default sweep
    python benchmarks/bench_attention.py --quick             # head dim 128, seqlen 2k and 8k
    python benchmarks/bench_attention.py --dry-run           # list the sweep, run nothing
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
# Benchmark the checkout this file lives in, installed or not.
if str(HERE.parent) not in sys.path:
    sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402

from bench_lib import (DTYPES, ERROR, MODES, NOT_APPLICABLE, NOT_RUN, OK, OOM, QUICK, WRONG, Case, Result,  # noqa: E402
                       Sweep, build_cases, capture_graph, complete_cases, format_size, make_timer, parse_size,
                       parse_sizes, round_order, throughput)

DEFAULT_OUT = HERE / "results"


def _sizes(values) -> str:
    return ",".join(format_size(v) for v in values)


def parse_args(argv=None) -> argparse.Namespace:
    from bench_providers import ALL

    d = Sweep()
    p = argparse.ArgumentParser(
        prog="bench_attention.py",
        description="Benchmark cute_flash's backends side by side with PyTorch SDPA (flash, cuDNN, efficient), "
                    "FlexAttention and FlashAttention-2/3/4, with a correctness check before every timing.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    csv = lambda s: tuple(t.strip() for t in s.split(",") if t.strip())  # noqa: E731
    p.add_argument("--modes", type=csv, default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--headdims", type=parse_sizes, default=_sizes(d.headdims), help="head dims of the forward modes")
    p.add_argument("--headdim-v", type=int, default=None,
                   help="head dim of V in the forward modes (default: each head dim), e.g. 128 with --headdims 192")
    p.add_argument("--seqlens", type=parse_sizes, default=_sizes(d.seqlens), help="sequence lengths (1k = 1024)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--providers", type=csv, default=",".join(ALL), help=f"comma list of {', '.join(ALL)}")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype)
    p.add_argument("--total-tokens", type=parse_size, default=format_size(d.total_tokens),
                   help="batch = total_tokens // seqlen (forward modes)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="nheads = hidden // headdim (forward modes)")
    p.add_argument("--decode-batches", type=parse_sizes, default=_sizes(d.decode_batches), help="batch sizes of decode")
    p.add_argument("--decode-seqlens", type=parse_sizes, default=_sizes(d.decode_seqlens), help="KV lengths of decode")
    p.add_argument("--decode-heads", type=int, nargs=2, default=(d.decode_nheads, d.decode_nheads_k),
                   metavar=("NHEADS", "NHEADS_K"))
    p.add_argument("--decode-headdim", type=int, default=d.decode_headdim)
    p.add_argument("--page-sizes", type=parse_sizes, default=_sizes(d.page_sizes),
                   help="KV cache layouts of decode: 0 = contiguous, else a paged cache with this page size")
    p.add_argument("--quick", action="store_true",
                   help="a short sweep: head dim 128, seqlens 2k and 8k; decode batches 1/16/128 and KV lengths 2k "
                        "and 8k (explicit options still apply on top)")
    p.add_argument("--warmup", type=float, default=10, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=50, help="do_bench measuring time, ms")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each case's providers this many times, taking turns, and report the median")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time forward and decode as replays of a CUDA graph captured around one call: the "
                        "kernels without the host's per-call work, as an inference engine that captures its "
                        "steps sees them (forward + backward stays eager); results get a -graph suffix")
    p.add_argument("--max-minutes", type=float, default=8.0,
                   help="stop starting new cells after this long (they are marked 'not run'); 0 = no limit")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--resume", type=Path, metavar="JSON",
                   help="continue an interrupted run: keep the cases this earlier result file measured in full, "
                        "run the rest, and write under its name")
    p.add_argument("--dry-run", action="store_true", help="list the sweep and the providers, run nothing")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES] + [n for n in args.providers if n not in ALL]
    if bad:
        p.error(f"unknown mode or provider: {', '.join(bad)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.quick:
        given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        for key, value in QUICK.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    return args


def sweep_of(args) -> Sweep:
    return Sweep(modes=args.modes, headdims=args.headdims, headdim_v=args.headdim_v, seqlens=args.seqlens,
                 causal={"both": (False, True), "yes": (True,), "no": (False,)}[args.causal], dtype=args.dtype,
                 total_tokens=args.total_tokens, hidden=args.hidden, decode_batches=args.decode_batches,
                 decode_seqlens=args.decode_seqlens, decode_nheads=args.decode_heads[0],
                 decode_nheads_k=args.decode_heads[1], decode_headdim=args.decode_headdim,
                 page_sizes=args.page_sizes)


def command_line(argv) -> str:
    """The command that reproduces the results: without --out-dir and --resume, which say where
    files go and come from, not what is measured."""
    argv = list(sys.argv[1:] if argv is None else argv)
    dropped = ("--out-dir", "--resume")
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in dropped:
            skip = True
        elif not a.startswith(tuple(d + "=" for d in dropped)):
            kept.append(a)
    return shlex.join(["python", "benchmarks/bench_attention.py", *kept])


def dry_run(cases, runners) -> None:
    print(f"{len(cases)} cases x {len(runners)} providers = {len(cases) * len(runners)} cells")
    print("providers: " + ", ".join(f"{r.name}{' (cute_flash)' if r.cute_flash else ''}" for r in runners))
    print("(availability is decided on the GPU; unavailable providers are skipped with a note)")
    for case in cases:
        print("  " + case.describe())


# ---- measuring --------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _commit() -> str:
    """The checkout's commit, marked when cute_flash/ or benchmarks/ differ from it; where the
    environment sets CUTE_FLASH_COMMIT, that instead (for a copy of the tree whose git metadata is
    missing or not its own)."""
    given = os.environ.get("CUTE_FLASH_COMMIT", "").strip()
    if given:
        return f"{given}, as CUTE_FLASH_COMMIT says"
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE,
                             timeout=20)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/cute_flash", ":/benchmarks"],
                               capture_output=True, text=True, cwd=HERE, timeout=20)
        return out.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def collect_meta(args, argv, timer: str) -> dict:
    import cute_flash

    major, minor = torch.cuda.get_device_capability()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}, "
               f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
        "driver": _driver(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
        "flash-attn-4": _version("flash-attn-4"),
        "flash-attn": _version("flash-attn"),
        "flash-attn-3": _version("flash-attn-3"),
        "triton": _version("triton"),
        "cute_flash": f"{cute_flash.__version__} (commit {_commit()})",
        "dtype": args.dtype,
        "timing": f"{timer}, warm-up {args.warmup:g} ms, measured {args.rep:g} ms"
                  + (f"; median of {args.rounds} rounds once every provider is checked, the providers taking turns (order reversed every round)"
                     if args.rounds > 1 else ""),
        "correctness": "max|out - ref| <= 2 max|out_torch - ref| + atol against the float32 reference, on the first "
                       "sequence and 4 heads (decode: first 4 sequences); out, dq, dk, dv for forward + backward",
        "command": command_line(argv),
        "notes": [],
    }


def make_inputs(case: Case, seed: int = 0):
    from bench_providers import Inputs

    dtype, dev = DTYPES[case.dtype], "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=dtype)  # noqa: E731
    q = randn(case.batch, case.seqlen_q, case.nheads, case.headdim)
    page_table = None
    if case.page_size:
        pages_per_seq = case.seqlen_k // case.page_size
        num_pages = case.batch * pages_per_seq
        k = randn(num_pages, case.page_size, case.nheads_k, case.headdim)
        v = randn(num_pages, case.page_size, case.nheads_k, case.dv)
        # Pages in a random order, as a serving cache hands them out.
        page_table = torch.randperm(num_pages, generator=gen, device=dev).to(torch.int32).view(case.batch,
                                                                                                pages_per_seq)
    else:
        k = randn(case.batch, case.seqlen_k, case.nheads_k, case.headdim)
        v = randn(case.batch, case.seqlen_k, case.nheads_k, case.dv)
    dout = None
    if case.mode == "fwd_bwd":
        dout = randn(case.batch, case.seqlen_q, case.nheads, case.dv)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return Inputs(q, k, v, page_table, dout)


def _poison(case: Case, x, copies: int = 2) -> None:
    """Leave only NaN-filled blocks of the outputs' sizes in the allocator's cache, so that a
    provider that does not write all of its freshly allocated output (or gradient) fails the
    check rather than inherit the correct answer the provider before it left there."""
    torch.cuda.empty_cache()
    shapes = [(case.batch, case.seqlen_q, case.nheads, case.dv)]
    if case.mode == "fwd_bwd":
        shapes += [tuple(x.q.shape), tuple(x.k.shape), tuple(x.v.shape)]
    blocks = [torch.full(s, float("nan"), dtype=x.q.dtype, device=x.q.device) for s in shapes for _ in range(copies)]
    del blocks


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    return f"{type(e).__name__}: {first}"[:240]


def run_cell(runner, case: Case, x, oracle_of, timer, graph: bool = False, again: Optional[dict] = None) -> Result:
    """Check, then time, one provider on one case (`graph`: time forward and decode as CUDA-graph
    replays). `again`: where a cell that ran stores, under the provider's name, a function that
    times it once more (`time_rounds`)."""
    reason = runner.not_applicable(case)
    if reason:
        return Result(case, runner.name, NOT_APPLICABLE, message=reason)
    backward = case.mode == "fwd_bwd"
    leaves = (x.q, x.k, x.v) if backward else ()
    try:
        with runner.context():
            fn = runner.prepare(case, x)
            _poison(case, x)
            if backward:
                for t in leaves:
                    t.grad = None
                out = fn()
                out.backward(x.dout)
                grads = tuple(t.grad for t in leaves)
            else:
                with torch.no_grad():
                    out = fn()
                grads = None
            torch.cuda.synchronize()
            passed, err, tol, what = oracle_of().check(out.detach(), grads)
            del out, grads
            if not passed:
                return Result(case, runner.name, WRONG, max_err=err, tolerance=tol,
                              message=f"{what}: max error {err:.3g} > tolerance {tol:.3g}")
            if backward:
                step = lambda: fn().backward(x.dout)  # noqa: E731
                timed = lambda: timer(step, grad_to_none=list(leaves))  # noqa: E731
                ms = timed()
            else:
                with torch.no_grad():
                    if graph:
                        try:
                            captured, graph_out = capture_graph(fn)
                            replay = captured.replay
                        except Exception as e:
                            return Result(case, runner.name, ERROR, message=f"CUDA-graph capture: {_short(e)}")
                        graph_out.fill_(float("nan"))  # the replay must write the output again, and right
                        replay()
                        torch.cuda.synchronize()
                        passed, err, tol, what = oracle_of().check(graph_out, None)
                        if not passed:
                            return Result(case, runner.name, WRONG, max_err=err, tolerance=tol,
                                          message=f"CUDA-graph replay, {what}: max error {err:.3g} > tolerance {tol:.3g}")
                        timed = lambda: timer(replay)  # noqa: E731
                        ms = timed()
                    else:
                        timed = lambda: timer(fn)  # noqa: E731
                        ms = timed()
        if again is not None:
            again[runner.name] = lambda: _time_in_context(runner, timed, no_grad=not backward)
        return Result(case, runner.name, OK, ms=ms, value=throughput(case, ms * 1e-3), max_err=err, tolerance=tol)
    except torch.cuda.OutOfMemoryError as e:
        return Result(case, runner.name, OOM, message=_short(e))
    except Exception as e:  # a provider's failure is a result of the benchmark, not the end of it
        return Result(case, runner.name, ERROR, message=_short(e))
    finally:
        for t in leaves:
            t.grad = None


def _time_in_context(runner, timed, no_grad: bool) -> float:
    """`timed()` (one timing, ms) inside the provider's context, as its first timing ran."""
    with runner.context():
        if no_grad:
            with torch.no_grad():
                return timed()
        return timed()


def time_rounds(results: list, again: dict, rounds: int) -> None:
    """`rounds` rounds of one case, once every provider has been checked: each provider in
    `again` timed once per round, in turn, the order reversed every other round (the first round
    runs them backwards, the second in the given order, ...): the H200's clocks drift by several
    percent within seconds, and a fixed order would hand the same provider the same place in that
    drift every round. The timing each provider took right after its own check is not one of
    them: it ran alone, after a pause in the GPU's load (the case's set-up, compiles and checks),
    and favoured whichever provider came first (on an H100, 2026-12-07, 5 rounds of the forward at head dims
    64-256: cute-sm90, checked first, ran a median 4.6% and at most 14.5% faster there than in its
    later rounds, flash-attn-4 level). Each result then reports the median of its rounds
    (`ms_rounds` keeps them). A provider that fails in a round becomes an error cell."""
    times = {r.provider: [] for r in results if r.provider in again and r.status == OK}
    for round_index in range(1, rounds + 1):
        for name in round_order(list(times), round_index):
            try:
                times[name].append(again[name]())
            except Exception as e:
                del times[name]
                for r in results:
                    if r.provider == name:
                        r.status, r.ms, r.value, r.message = ERROR, None, None, f"a later round: {_short(e)}"
    for r in results:
        if r.provider in times:
            r.ms_rounds = [round(t, 5) for t in times[r.provider]]
            r.ms = statistics.median(times[r.provider])
            r.value = throughput(r.case, r.ms * 1e-3)


TIME_LIMIT = "time limit (--max-minutes) reached"


def finish_rounds(results: list, again: dict, rounds: int, stopped: Optional[str]) -> None:
    """The rounds of one case (`time_rounds`) once its providers have run, also where the time
    limit stopped the case between two providers: that limit stops new cells, and the cells that
    ran still get their rounds (a few seconds), so that every time in a table is a median of its
    rounds. Where the run stopped for another reason (the CUDA context lost) no further timing
    can run, and each cell that ran says its time is the single one after its check."""
    if stopped is None or stopped == TIME_LIMIT:
        time_rounds(results, again, rounds)
        return
    for r in results:
        if r.status == OK and r.provider in again:
            r.message = f"one timing, right after its check: no rounds ({stopped})"


def _context_alive() -> bool:
    """False once a kernel has faulted: every later CUDA call would fail and blame its caller."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


class _Lazy:
    """Built on first call, once: the oracle of a case costs nothing when no provider runs, and a
    failure to build it is raised again to every provider rather than retried."""

    def __init__(self, build):
        self.build, self.value, self.error = build, None, None

    def __call__(self):
        if self.error is not None:
            raise self.error
        if self.value is None:
            try:
                self.value = self.build()
            except Exception as e:
                self.error = e
                raise
        return self.value


def run(args, argv=None) -> int:
    from bench_oracle import Oracle
    from bench_providers import make_runner
    from bench_report import read_json, write_json, write_markdown, write_plots
    from tqdm import tqdm

    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU (use --dry-run to list the sweep here)", file=sys.stderr)
        return 2
    # Peers warn at length when a pinned SDPA kernel declines a shape; the cell records the error.
    warnings.filterwarnings("ignore", category=UserWarning)
    cases = build_cases(sweep_of(args))
    timer_name, timer = make_timer(args.warmup, args.rep)
    meta = collect_meta(args, argv, timer_name + ("; forward and decode as CUDA-graph replays (no host work per call)"
                                                   if args.cuda_graph else ""))
    runners, providers = [], []
    for name in args.providers:
        r = make_runner(name)
        try:
            reason = r.unavailable()
        except Exception as e:
            reason = _short(e)
        providers.append(r.provider(reason))
        if reason is None:
            runners.append(r)
        else:
            print(f"skipping {name}: {reason}", file=sys.stderr)
    stem = result_stem(torch.cuda.get_device_name(), datetime.date.today(), args.cuda_graph)
    earlier: dict = {}
    if args.resume:
        earlier_meta, _, earlier_results = read_json(args.resume)
        earlier = complete_cases(earlier_results, [r.name for r in runners])
        stem = args.resume.stem
        meta["notes"].append(f"{sum(c in earlier for c in cases)} of the {len(cases)} cases were measured by an "
                             f"earlier run of this command ({earlier_meta.get('date', '?')}), the rest by this one")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = args.out_dir / f"{stem}.md", args.out_dir / f"{stem}.json"
    results: list = []
    deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes > 0 else float("inf")
    bar = tqdm(total=len(cases) * len(runners), unit="cell", dynamic_ncols=True)
    stopped = None  # why no further cell is started
    for case in cases:
        bar.set_description(case.describe())
        if case in earlier:
            results += earlier[case]
            bar.update(len(runners))
            continue
        if stopped is None and time.monotonic() > deadline:
            stopped = TIME_LIMIT
        if stopped is not None:
            results += [Result(case, r.name, NOT_RUN, message=stopped) for r in runners]
            bar.update(len(runners))
            continue
        try:
            x = make_inputs(case)
        except torch.cuda.OutOfMemoryError as e:
            results += [Result(case, r.name, OOM, message=f"inputs: {_short(e)}") for r in runners]
            bar.update(len(runners))
            continue
        oracle = _Lazy(lambda: Oracle(case, x.q, x.k, x.v, x.dout, x.page_table))
        case_results, again = [], ({} if args.rounds > 1 else None)
        for r in runners:
            if stopped is None and time.monotonic() > deadline:
                stopped = TIME_LIMIT
            if stopped is not None:
                case_results.append(Result(case, r.name, NOT_RUN, message=stopped))
            else:
                start = time.perf_counter()
                case_results.append(run_cell(r, case, x, oracle, timer, graph=args.cuda_graph, again=again))
                case_results[-1].wall_s = round(time.perf_counter() - start, 2)
                if case_results[-1].status == ERROR and not _context_alive():
                    stopped = f"the CUDA context was lost after {r.name} on {case.describe()}"
                    meta["notes"].append(stopped)
            bar.update(1)
        if again:
            finish_rounds(case_results, again, args.rounds, stopped)
        results += case_results
        del x, oracle, again
        if stopped is None:
            torch.cuda.empty_cache()
        write_markdown(md_path, meta, providers, results)
        write_json(json_path, meta, providers, results)
    bar.close()
    if stopped == TIME_LIMIT:
        meta["notes"].append(f"stopped starting new cells after --max-minutes {args.max_minutes:g}; "
                             "cells marked 'not run' were not measured")
    plots = write_plots(results, providers, args.out_dir / stem)
    write_markdown(md_path, meta, providers, results, [p.name for p in plots])
    write_json(json_path, meta, providers, results)
    counts = {s: sum(r.status == s for r in results) for s in (OK, WRONG, ERROR, OOM, NOT_APPLICABLE, NOT_RUN)}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n), file=sys.stderr)
    for path in (md_path, json_path, *plots):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def result_stem(gpu_name: str, date: datetime.date, graph: bool) -> str:
    """The results' file name without suffix: <gpu>-<date>, and -graph for CUDA-graph timing."""
    return f"{_slug(gpu_name)}-{date.isoformat()}" + ("-graph" if graph else "")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        from bench_providers import make_runner

        dry_run(build_cases(sweep_of(args)), [make_runner(n) for n in args.providers])
        return 0
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
