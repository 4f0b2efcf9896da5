"""Triage of the sm_90 backward kernel on an H100/H200: each case in its own process.

    python benchmarks/bwd_sm90_triage.py                 # every case below
    python benchmarks/bwd_sm90_triage.py varlen_d64 padded_d40   # chosen cases (--list names them)
    python benchmarks/bwd_sm90_triage.py --sanitize      # each case under compute-sanitizer
    python benchmarks/bwd_sm90_triage.py --pytest        # the GPU tests that failed in the first run,
                                                         # one pytest process each

A kernel fault (an illegal instruction, an illegal address) poisons the CUDA context of the process
that hit it, so every later call there fails too and hides which case was at fault. Here every case
runs in a fresh process with CUDA_LAUNCH_BLOCKING=1 (the error is raised by the launch that
faulted: the preprocess, the main kernel or the postprocess) and a time limit (a pipeline whose
producer and consumers disagree hangs instead). Each prints one line:

    PASS     case   max|g - ref| of dq, dk, dv against the float64 reference backward
    FAIL     case   the same, and which gradient broke the tests' tolerance rule (or had NaN)
    SKIP     test   (--pytest) skipped, e.g. no sm_90 GPU
    CRASH    case   a CUDA error: the last lines of the child's output (with --sanitize:
                    compute-sanitizer's report, which names the kernel and the instruction)
    ERROR    case   a Python error before or after the kernels
    TIMEOUT  case

The first GPU run of tests/gpu/test_bwd_sm90.py crashed with an illegal instruction on every varlen
case (the first failure of each pytest-xdist worker; the other failures came after a crash on the
same worker and say nothing). `varlen_one_sequence` (offset 0 only) and
`varlen_offsets_multiple_of_4` (16-byte-aligned LSE rows) tell whether the LSE / D boxes starting
at an unaligned row were the cause: both would have passed before that was changed. The cases
after them failed in that run only because their worker had already crashed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_TAG = "TRIAGE_RESULT "
TIME_LIMIT_S = 300

# Tests of tests/gpu/test_bwd_sm90.py that failed in the first GPU run (first failures and those
# that followed a crash on their worker).
FAILED_TESTS = [
    *(f"test_sm90_bwd_varlen_and_seqused_k[{d}-{c}-{s}]" for d in (64, 128) for c in (False, True)
      for s in (False, True)),
    *(f"test_sm90_bwd_padded_headdims[{d}]" for d in (8, 40, 72, 80, 120)),
    "test_sm90_bwd_ignores_a_stale_cache_past_seqused_k[128]",
    "test_sm90_bwd_honours_a_gradient_of_the_lse",
    "test_sm90_bwd_no_nan_for_fully_masked_rows",
    "test_sm90_bwd_key_blocks_no_query_sees_get_zero_dk_dv",
    "test_sm90_bwd_non_contiguous_q_from_packed_qkv",
    "test_sm90_bwd_expanded_dout_is_accepted",
    "test_sm90_bwd_offsets_beyond_4gib",
    "test_sm90_bwd_matches_the_sm80_kernels",
]

VARLEN_SEQLENS_Q = [1, 0, 113, 239, 300, 64, 7, 129]  # the GPU test's: offsets 1, 114, 353, ...
VARLEN_SEQLENS_K = [1, 5, 203, 1, 333, 64, 300, 128]
VARLEN_USED_K = [1, 0, 150, 1, 300, 17, 299, 127]


# ------------------------------------------------------------------------------------------------
# cases: name -> (q, k, v, args, with_dlse), built in the child process
# ------------------------------------------------------------------------------------------------
def _args(d, **kw):
    from cute_flash.backends.base import AttnArgs

    return AttnArgs(softmax_scale=1.0 / math.sqrt(d), **kw)


def _fixed(b, sq, sk, h, hk, d, dtype="bfloat16", pad_q=False, **mask):
    import torch
    from attention_oracle import nan_framed_kv, randn_in_nan

    dt = getattr(torch, dtype)
    q = (randn_in_nan((b, sq, h, d), dt, row_dim=1, pad_rows=3, pad_cols=8) if pad_q
         else torch.randn(b, sq, h, d, dtype=dt, device="cuda"))
    k, v = nan_framed_kv(b, sk, hk, d, d, dt)
    return q, k, v, _args(d, **mask), False


def _varlen(d, seqlens_q, seqlens_k, causal=False, used=None, with_dlse=False):
    import torch
    from attention_oracle import nan_framed_kv, randn_in_nan

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

    cu_q, cu_k = cu(seqlens_q), cu(seqlens_k)
    q = randn_in_nan((int(cu_q[-1]), 4, d), torch.bfloat16, row_dim=0, pad_rows=5, pad_cols=0)
    k, v = nan_framed_kv(None, int(cu_k[-1]), 2, d, d, torch.bfloat16, varlen=True)
    seqused_k = _int32(used) if used is not None else None
    args = _args(d, causal=causal, window_right=0 if causal else -1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), seqused_k=seqused_k)
    return q, k, v, args, with_dlse


CAUSAL = {"causal": True, "window_right": 0}
CASES = {
    # controls: passed in the first run
    "fixed_d128_causal_gqa": lambda: _fixed(3, 257, 300, 6, 2, 128, **CAUSAL),
    "fixed_d64_window": lambda: _fixed(2, 500, 130, 2, 2, 64, window_left=16, window_right=0),
    # varlen: every one crashed
    "varlen_one_sequence": lambda: _varlen(64, [300], [333]),
    "varlen_offsets_multiple_of_4": lambda: _varlen(64, [4, 0, 112, 240, 300, 64, 8, 128], VARLEN_SEQLENS_K),
    "varlen_d64": lambda: _varlen(64, VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K),
    "varlen_d64_causal_seqused": lambda: _varlen(64, VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K, True, VARLEN_USED_K),
    "varlen_d128_seqused": lambda: _varlen(128, VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K, False, VARLEN_USED_K),
    "varlen_d128_causal": lambda: _varlen(128, VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K, True),
    "varlen_d128_causal_dlse": lambda: _varlen(128, VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K, True, with_dlse=True),
    # failed only after a crash on their worker: never ran on a clean context
    **{f"padded_d{d}": (lambda d=d: _fixed(2, 211, 333, 4, 4, d, "float16", pad_q=True, **CAUSAL))
       for d in (8, 40, 72, 80, 120)},
    "fixed_d64_dlse": lambda: (*_fixed(2, 150, 190, 4, 2, 64, "float16", **CAUSAL)[:4], True),
    "fully_masked_rows": lambda: _fixed(2, 300, 100, 2, 2, 64, **CAUSAL),
    "key_blocks_no_query_sees": lambda: _fixed(1, 100, 700, 2, 2, 128, window_left=10, window_right=20),
    "seqused_d128_causal": lambda: _fixed(3, 190, 300, 4, 2, 128, seqused_k=_int32([100, 1, 257]), **CAUSAL),
}


def _int32(values):
    import torch

    return torch.tensor(values, dtype=torch.int32, device="cuda")


# ------------------------------------------------------------------------------------------------
# child: one case
# ------------------------------------------------------------------------------------------------
def run_case(name: str) -> dict:
    import torch
    from attention_oracle import assert_within_rule

    from cute_flash.backends.cute import CuteSm90Backend
    from cute_flash.backends.reference import reference_attention, reference_attention_backward

    torch.manual_seed(0)
    q, k, v, args, with_dlse = CASES[name]()
    backend = CuteSm90Backend()
    backend.native_backward = True
    if not backend.native_backward_takes(q, k, v, args, False):
        return {"status": "FAIL", "detail": "the sm_90 backward kernel does not take this call"}
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    grads = [torch.full(t.shape, float("nan"), dtype=t.dtype, device="cuda") for t in (q, k, v)]
    backend.bwd(dout, q, k, v, out, lse, dlse, *grads, args, False)
    torch.cuda.synchronize()

    refs = reference_attention_backward(dout, q, k, v, out, lse, dlse, args, compute_dtype=torch.float64)
    out_t, lse_t = reference_attention(q, k, v, args, compute_dtype=q.dtype)
    torch_grads = reference_attention_backward(dout, q, k, v, out_t, lse_t, dlse, args, compute_dtype=q.dtype)
    errors, broken = {}, []
    for g_name, g, ref, ref_torch in zip(("dq", "dk", "dv"), grads, refs, torch_grads):
        errors[g_name] = (g.double() - ref.double()).abs().nan_to_num(float("inf")).max().item() if g.numel() else 0.0
        try:
            assert_within_rule(g_name, g, ref, ref_torch)
        except AssertionError as e:
            broken.append(str(e))
    return {"status": "FAIL" if broken else "PASS", "errors": errors, "detail": "; ".join(broken)}


# ------------------------------------------------------------------------------------------------
# parent: one process per case
# ------------------------------------------------------------------------------------------------
def _child_env() -> dict:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def _last_error_lines(text: str, n: int = 4) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keys = ("error", "Error", "illegal", "Illegal", "=========")
    picked = [ln for ln in lines if any(key in ln for key in keys)]
    return " | ".join((picked or lines)[-n:])[:600]


def _crash_or_error(text: str) -> str:
    keys = ("cudaError", "CUDA error", "CUDA_ERROR", "illegal", "========= ")  # the last: compute-sanitizer
    return "CRASH" if any(key in text for key in keys) else "ERROR"


def run_in_child(cmd: list, sanitize: bool) -> tuple:
    """(exit status or None on timeout, output, seconds) of one child process."""
    if sanitize:
        tool = shutil.which("compute-sanitizer")
        if tool is None:
            sys.exit("compute-sanitizer is not on PATH")
        cmd = [tool, "--report-api-errors", "no", "--print-limit", "5"] + cmd
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT_S, env=_child_env(), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"no answer in {TIME_LIMIT_S} s (a pipeline waiting forever?)", time.time() - start
    return proc.returncode, proc.stdout + proc.stderr, time.time() - start


def triage_case(name: str, sanitize: bool) -> str:
    code, text, seconds = run_in_child([sys.executable, __file__, "--run-case", name], sanitize)
    if code is None:
        return f"{'TIMEOUT':8} {name:32} {text}"
    results = [ln[len(RESULT_TAG):] for ln in text.splitlines() if ln.startswith(RESULT_TAG)]
    if not results or (sanitize and "ERROR SUMMARY: 0 errors" not in text and "ERROR SUMMARY" in text):
        return f"{_crash_or_error(text):8} {name:32} ({seconds:.0f} s) {_last_error_lines(text)}"
    result = json.loads(results[-1])
    errs = " ".join(f"{g} {e:.2e}" for g, e in result.get("errors", {}).items())
    detail = f"  {result['detail']}" if result.get("detail") else ""
    return f"{result['status']:8} {name:32} {errs} ({seconds:.0f} s){detail}"


def triage_test(test: str, sanitize: bool) -> str:
    node = f"tests/gpu/test_bwd_sm90.py::{test}"
    code, text, seconds = run_in_child([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:xdist", node],
                                       sanitize)
    if code is None:
        return f"TIMEOUT  {test}"
    if code == 0:
        status = "PASS" if " passed" in text and " skipped" not in text else "SKIP"
        return f"{status:8} {test} ({seconds:.0f} s)"
    status = "CRASH" if _crash_or_error(text) == "CRASH" else "FAIL"
    return f"{status:8} {test} ({seconds:.0f} s) {_last_error_lines(text)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--pytest", action="store_true", help="run the failed GPU tests, one process each")
    parser.add_argument("--sanitize", action="store_true", help="run each child under compute-sanitizer")
    parser.add_argument("--run-case", help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.run_case:
        print(RESULT_TAG + json.dumps(run_case(opts.run_case)), flush=True)
        return 0
    if opts.list:
        print("\n".join(CASES))
        return 0
    unknown = [c for c in opts.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; --list names them")
    lines = ([triage_test(t, opts.sanitize) for t in FAILED_TESTS] if opts.pytest else [])
    for line in lines:
        print(line, flush=True)
    if not opts.pytest or opts.cases:
        for name in opts.cases or CASES:
            line = triage_case(name, opts.sanitize)
            lines.append(line)
            print(line, flush=True)
    return 0 if all(line.startswith("PASS") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
