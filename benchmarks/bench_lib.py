"""The pure parts of the benchmark: what a case is, the sweep, and how work is counted.

Conventions (DESIGN.md, "Benchmarks"):
- forward FLOPs = 4·b·h·sq·sk·d (2·b·h·sq·sk·(d + dv) when the value head dim differs), halved
  for causal only when sq == sk (with sq != sk the bottom-right aligned mask keeps more than
  half of the square, so halving would flatter the kernel);
- forward + backward FLOPs = 3.5 × the forward's (the backward recomputes S = Q·Kᵀ and runs
  four more GEMMs of the same size: 2.5 × the forward);
- decode is memory-bound and reported as achieved bandwidth: the bytes of Q, K, V and O that
  must cross HBM once, over the time. K and V are counted per KV head (GQA shares them
  between query heads), and the same for a paged cache: only the pages holding the
  sequence's keys are read, and the page table's few bytes are not counted.

Everything here but the timing helpers at the end (`capture_graph`, `make_timer`, which need a
GPU) runs on the CPU, and the CPU tests cover it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

import torch

MODES = ("fwd", "fwd_bwd", "decode")
MODE_TITLES = {"fwd": "forward", "fwd_bwd": "forward + backward", "decode": "decode (seqlen_q = 1)"}
FWD_BWD_FACTOR = 3.5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str) -> int:
    """'16k' -> 16384, '2048' -> 2048 (k = 1024)."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(text[:-1]) * 1024
    return int(text)


def parse_sizes(text: str) -> tuple:
    return tuple(parse_size(t) for t in text.split(",") if t.strip())


def add_ab_case_arguments(parser, head_dims: Sequence[int], seqlen: int, compile_help: str) -> None:
    """The case options the A/B scripts (`ab_sm90_fwd.py`, `ab_sm90_bwd.py`) share: head dims,
    causal or non-causal cases only, compile only, batch and sequence length."""
    parser.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=list(head_dims))
    parser.add_argument("--causal-only", action="store_true")
    parser.add_argument("--full-only", action="store_true", help="non-causal cases only")
    parser.add_argument("--compile-only", action="store_true", help=compile_help)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=seqlen)


def fits(config, **change) -> bool:
    """Whether `config` with `change` is a valid configuration (its checks raise ValueError)."""
    from dataclasses import replace

    try:
        replace(config, **change)
    except ValueError:
        return False
    return True


def warm_in_processes(configs, compile_one, jobs: int) -> None:
    """`compile_one(config)` (a module-level function, which returns where the kernel came from)
    for every configuration in `jobs` processes at once, so that a timing loop that compiles one
    at a time then only loads them from the disk cache. A failure is reported, not raised: the
    loop compiles whatever is missing."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            sources = list(pool.map(compile_one, configs))
    except Exception as exc:
        print(f"warm-up failed ({type(exc).__name__}: {exc}); compiling in turn", flush=True)
        return
    print(f"warm-up: {len(configs)} variants ({', '.join(sorted(set(map(str, sources))))})", flush=True)


def ab_cases(parser, opts, head_dims: Sequence[int]) -> list:
    """(head dim, causal) of every case `add_ab_case_arguments`' options ask for; a head dim
    outside `head_dims` is a usage error."""
    for d in opts.head_dims:
        if d not in head_dims:
            parser.error(f"--head-dims: {d} is not one of {tuple(head_dims)}")
    masks = [True] if opts.causal_only else [False] if opts.full_only else [False, True]
    return [(d, causal) for d in opts.head_dims for causal in masks]


def tile_tuning_main(parser, argv, seqlen: int, default_candidates, rows_of, compile_only, on_gpu) -> int:
    """The tile tuners' command line (`tune_tiles.py`, `tune_bwd_tiles.py`): their own options
    already on `parser`, the shared ones added (`add_tile_tuning_arguments`); the candidates
    default to `default_candidates(args)`; then `compile_only(args, rows_of(args))`, or
    `on_gpu(...)` of the same."""
    add_tile_tuning_arguments(parser, seqlen)
    args = parser.parse_args(argv)
    if args.candidates is None:
        args.candidates = default_candidates(args)
    (compile_only if args.compile_only else on_gpu)(args, rows_of(args))
    return 0


def add_tile_tuning_arguments(parser, seqlen: int) -> None:
    """The options the tile tuners (`tune_tiles.py`, `tune_bwd_tiles.py`) share: candidates,
    compile only, and the timed problem's batch, sequence length and heads."""
    parser.add_argument("--candidates", type=lambda s: [c for c in s.split(",") if c], default=None,
                        help="comma list (default: a few around the shipped tile)")
    parser.add_argument("--compile-only", action="store_true", help="registers and spills only (no GPU needed)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=seqlen)
    parser.add_argument("--heads", type=int, default=16)


def print_tile_audit(arch: str, rows: Iterable[tuple]) -> None:
    """The tile tuners' `--compile-only` table: one line per (label, config or None, why not,
    compile(config, options)) with registers, spill bytes and shared memory, or why it was not
    compiled."""
    from cute_flash.audit import AuditTarget, audit_target

    blank = f"{'':>5} {'':>16} {'':>10}"
    print(f"{'candidate':<20} {'regs':>5} {'spill st/ld (B)':>16} {'smem (KB)':>10}  note")
    for label, config, why, compile_fn in rows:
        if config is None:
            print(f"{label:<20} {blank}  invalid: {why}")
            continue
        row = audit_target(AuditTarget(config.name, arch, lambda opts, c=config: compile_fn(c, opts)))
        if row.error:
            print(f"{label:<20} {blank}  does not compile: {row.error}")
            continue
        smem = (row.smem_dynamic or getattr(config, "smem_bytes", 0)) / 1024
        print(f"{label:<20} {row.registers or '?':>5} {f'{row.spill_stores or 0}/{row.spill_loads or 0}':>16} "
              f"{smem:>10.1f}  {'SPILLS' if row.spills else ''}", flush=True)


def format_size(n: int) -> str:
    """16384 -> '16k', 1000 -> '1000'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Case:
    """One shape of one mode. `page_size` 0 means a contiguous KV cache."""

    mode: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    dtype: str
    headdim_v: Optional[int] = None
    page_size: int = 0

    @property
    def dv(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def headdim_label(self) -> str:
        """'128', or '192/128' where V's head dim differs."""
        return str(self.headdim) if self.dv == self.headdim else f"{self.headdim}/{self.dv}"

    @property
    def layout(self) -> str:
        return f"paged {self.page_size}" if self.page_size else "contiguous"

    def describe(self) -> str:
        if self.mode == "decode":
            return (f"decode b={self.batch} kv={format_size(self.seqlen_k)} h={self.nheads}/{self.nheads_k} "
                    f"d={self.headdim} {self.layout}")
        return (f"{self.mode} d={self.headdim_label} {'causal' if self.causal else 'non-causal'} "
                f"seqlen={format_size(self.seqlen_q)} b={self.batch} h={self.nheads}")


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int, causal: bool,
                    headdim_v: Optional[int] = None) -> float:
    """Forward FLOPs: two GEMMs, Q·Kᵀ and P·V; causal halves them only when sq == sk."""
    dv = headdim if headdim_v is None else headdim_v
    flops = 2.0 * batch * nheads * seqlen_q * seqlen_k * (headdim + dv)
    return flops / 2 if causal and seqlen_q == seqlen_k else flops


def case_flops(case: Case) -> float:
    flops = attention_flops(case.batch, case.nheads, case.seqlen_q, case.seqlen_k, case.headdim, case.causal,
                            case.dv)
    return flops * FWD_BWD_FACTOR if case.mode == "fwd_bwd" else flops


def decode_bytes(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int, headdim: int,
                 headdim_v: Optional[int], element_size: int) -> float:
    """Bytes moved by one decode step: K and V once per KV head (paged or not), Q read, O written."""
    dv = headdim if headdim_v is None else headdim_v
    kv = batch * seqlen_k * nheads_k * (headdim + dv)
    qo = batch * seqlen_q * nheads * (headdim + dv)
    return float((kv + qo) * element_size)


def case_bytes(case: Case) -> float:
    element_size = torch.empty((), dtype=DTYPES[case.dtype]).element_size()
    return decode_bytes(case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k, case.headdim,
                        case.dv, element_size)


def metric(case: Case) -> tuple:
    """(name, unit) of what the tables report for this case's mode."""
    return ("bandwidth", "TB/s") if case.mode == "decode" else ("throughput", "TFLOP/s")


def throughput(case: Case, seconds: float) -> float:
    """TB/s for decode, TFLOP/s otherwise."""
    work = case_bytes(case) if case.mode == "decode" else case_flops(case)
    return work / seconds / 1e12


@dataclass(frozen=True)
class Sweep:
    """What to run. Forward modes keep batch·seqlen = total_tokens and nheads·headdim = hidden;
    `headdim_v` (None: each head dim) is V's head dim in every forward case (e.g. 192 / 128)."""

    modes: Sequence[str] = MODES
    headdims: Sequence[int] = (64, 128, 256)
    headdim_v: Optional[int] = None
    seqlens: Sequence[int] = (1024, 2048, 4096, 8192, 16384)
    causal: Sequence[bool] = (False, True)
    dtype: str = "bf16"
    total_tokens: int = 16384
    hidden: int = 2048
    decode_batches: Sequence[int] = (1, 4, 16, 64, 128)
    decode_seqlens: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768)
    decode_nheads: int = 32
    decode_nheads_k: int = 8
    decode_headdim: int = 128
    page_sizes: Sequence[int] = (0, 64)


QUICK = dict(headdims=(128,), seqlens=(2048, 8192), decode_batches=(1, 16, 128), decode_seqlens=(2048, 8192))


def build_cases(sweep: Sweep) -> list:
    """Every case of the sweep, in the order it runs (and is tabulated)."""
    cases = []
    for mode in sweep.modes:
        if mode == "decode":
            for page_size in sweep.page_sizes:
                for batch in sweep.decode_batches:
                    for seqlen_k in sweep.decode_seqlens:
                        if page_size and seqlen_k % page_size:
                            continue
                        cases.append(Case("decode", batch, 1, seqlen_k, sweep.decode_nheads, sweep.decode_nheads_k,
                                          sweep.decode_headdim, False, sweep.dtype, page_size=page_size))
            continue
        for headdim in sweep.headdims:
            if sweep.hidden % headdim:
                raise ValueError(f"hidden ({sweep.hidden}) must be a multiple of every head dim; got {headdim}")
            for causal in sweep.causal:
                for seqlen in sweep.seqlens:
                    batch = max(1, sweep.total_tokens // seqlen)
                    nheads = sweep.hidden // headdim
                    dv = sweep.headdim_v if sweep.headdim_v not in (None, headdim) else None
                    cases.append(Case(mode, batch, seqlen, seqlen, nheads, nheads, headdim, causal, sweep.dtype,
                                      headdim_v=dv))
    return cases


# ---- results -------------------------------------------------------------------------------

OK, WRONG, ERROR, OOM, NOT_APPLICABLE, NOT_RUN = "ok", "wrong", "error", "oom", "n/a", "not run"


@dataclass
class Result:
    """One provider on one case. `value` (TFLOP/s or TB/s) is set only when status is ok."""

    case: Case
    provider: str
    status: str
    ms: Optional[float] = None
    value: Optional[float] = None
    max_err: Optional[float] = None
    tolerance: Optional[float] = None
    message: str = ""
    wall_s: Optional[float] = None  # the cell's wall time: check, compile and timing
    ms_rounds: Optional[list] = None  # with --rounds > 1: every round's time; `ms` is their median

    def to_json(self) -> dict:
        d = asdict(self)
        d["case"] = asdict(self.case)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Result":
        d = dict(d)
        d["case"] = Case(**d["case"])
        return cls(**d)


@dataclass
class Provider:
    """A way to run attention, as the report sees it: a name and whether it is cute_flash's."""

    name: str
    cute_flash: bool
    description: str = ""
    skipped: Optional[str] = None  # why it does not run here (None = it runs)


def complete_cases(results: Iterable[Result], providers: Sequence[str]) -> dict:
    """{case: its results for `providers`} of the cases that every one of them measured (any
    status but 'not run'): what a resumed run keeps, so that each row still comes from one process."""
    by_case: dict = {}
    for r in results:
        if r.status != NOT_RUN and r.provider in providers:
            by_case.setdefault(r.case, {})[r.provider] = r
    return {case: [cells[p] for p in providers] for case, cells in by_case.items() if set(providers) <= set(cells)}


def best(results: Iterable[Result], cute_flash_names: set, cute_flash: bool) -> Optional[Result]:
    """The fastest correct result among cute_flash's providers (or among the peers)."""
    ok = [r for r in results if r.status == OK and (r.provider in cute_flash_names) == cute_flash]
    return max(ok, key=lambda r: r.value, default=None)


def ratio(results: Iterable[Result], cute_flash_names: set) -> Optional[float]:
    """Best cute_flash backend over best peer, or None when either side has no correct result."""
    results = list(results)
    ours, theirs = best(results, cute_flash_names, True), best(results, cute_flash_names, False)
    if ours is None or theirs is None:
        return None
    return ours.value / theirs.value


# ---- correctness --------------------------------------------------------------------------


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the rounding error of `dtype` at magnitude 0.3, measured on the reference's values
    (FlashAttention's tests use the same slack): a floor for outputs whose torch error is ~0."""
    r = ref.to(dtype)
    return 2.0 * ((r + 0.3 - 0.3) - r).abs().max().item()


def within_tolerance(out: torch.Tensor, ref: torch.Tensor, out_torch: torch.Tensor, dtype: torch.dtype) -> tuple:
    """DESIGN.md's rule: max|out − ref| ≤ 2·max|out_torch − ref| + atol.

    `ref` is the float32 oracle, `out_torch` the same attention in plain torch in `dtype`.
    Returns (passed, max_err, tolerance); a NaN anywhere fails.
    """
    ref = ref.float()
    err = (out.float() - ref).abs().max().item()
    tol = 2.0 * (out_torch.float() - ref).abs().max().item() + rounding_atol(ref, dtype)
    return (not math.isnan(err)) and err <= tol, err, tol


# ---- CUDA graphs --------------------------------------------------------------------------


def capture_graph(fn):
    """A CUDA graph of one call of `fn` (warmed up on a side stream first, as capture requires);
    returns (the graph, what the captured call returned: the tensors each replay writes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# ---- timing -------------------------------------------------------------------------------


def round_order(names: list, round_index: int) -> list:
    """The providers (or variants) of round `round_index` (0 = the first): the given order,
    reversed in every odd-numbered round, so that none always runs first (or last) as the GPU's
    clock drifts."""
    return names[::-1] if round_index % 2 else names


def interleaved_rounds(runs: dict, rounds: int, warmup_ms: float = 25, rep_ms: float = 100,
                       grad_to_none=None) -> dict:
    """{label: [median ms of each round]}: every callable of `runs` timed once per round with
    `triton.testing.do_bench`, in the order of `runs` and reversed every other round, so that
    no variant always runs first (or last) as the GPU warms up. `grad_to_none`: tensors whose
    .grad do_bench clears before every call (a backward that would otherwise accumulate)."""
    from triton.testing import do_bench

    times = {label: [] for label in runs}
    for r in range(rounds):
        for label in round_order(list(runs), r):
            times[label].append(do_bench(runs[label], warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                         return_mode="median"))
    return times


def make_timer(warmup_ms: float, rep_ms: float):
    """(name, fn -> median ms): triton's do_bench, or CUDA events when Triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        def timer(fn, grad_to_none=None):
            return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")

        return "triton.testing.do_bench (median)", timer

    def events(fn, grad_to_none=None):
        def once():
            for t in grad_to_none or ():
                t.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

        first = once()
        for _ in range(max(1, int(warmup_ms / max(first, 1e-3)))):
            once()
        return statistics.median(once() for _ in range(max(5, int(rep_ms / max(first, 1e-3)))))

    return "CUDA events (median)", events
