"""CPU tests of the benchmark's pure parts: FLOP and byte conventions, the sweep, the tolerance
rule, the table / JSON / plot writers on synthetic results, and the command line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_attention  # noqa: E402
import bench_lib as bl  # noqa: E402
import bench_oracle  # noqa: E402
import bench_report as report  # noqa: E402

pytest.importorskip("matplotlib")


def test_forward_flops_is_4_b_h_sq_sk_d():
    assert bl.attention_flops(2, 16, 4096, 4096, 128, causal=False) == 4 * 2 * 16 * 4096 * 4096 * 128


def test_causal_halves_flops_only_when_seqlens_are_equal():
    full = bl.attention_flops(2, 16, 4096, 4096, 128, causal=False)
    assert bl.attention_flops(2, 16, 4096, 4096, 128, causal=True) == full / 2
    assert bl.attention_flops(2, 16, 1024, 4096, 128, causal=True) == bl.attention_flops(2, 16, 1024, 4096, 128,
                                                                                        causal=False)


def test_flops_with_a_different_value_head_dim_count_each_gemm():
    assert bl.attention_flops(1, 1, 10, 20, 192, causal=False, headdim_v=128) == 2 * 10 * 20 * (192 + 128)


def test_forward_backward_flops_are_3_5_times_forward():
    fwd = bl.Case("fwd", 4, 2048, 2048, 16, 16, 128, True, "bf16")
    both = bl.Case("fwd_bwd", 4, 2048, 2048, 16, 16, 128, True, "bf16")
    assert bl.case_flops(both) == 3.5 * bl.case_flops(fwd) == 3.5 * 4 * 4 * 16 * 2048 * 2048 * 128 / 2


def test_decode_bytes_count_kv_per_kv_head():
    # q, o: 32 heads; k, v: 8 KV heads (GQA shares them, they are read once)
    got = bl.decode_bytes(batch=4, seqlen_q=1, seqlen_k=8192, nheads=32, nheads_k=8, headdim=128, headdim_v=None,
                          element_size=2)
    assert got == 2 * (4 * 8192 * 8 * 128 * 2 + 4 * 1 * 32 * 128 * 2)


def test_decode_bytes_are_the_same_paged_or_contiguous():
    contiguous = bl.Case("decode", 16, 1, 4096, 32, 8, 128, False, "bf16")
    paged = bl.Case("decode", 16, 1, 4096, 32, 8, 128, False, "bf16", page_size=64)
    assert bl.case_bytes(paged) == bl.case_bytes(contiguous) == bl.decode_bytes(16, 1, 4096, 32, 8, 128, None, 2)


def test_throughput_units_are_tflops_and_tbs():
    fwd = bl.Case("fwd", 1, 1024, 1024, 1, 1, 128, False, "bf16")
    assert bl.throughput(fwd, 1e-3) == pytest.approx(4 * 1024 * 1024 * 128 / 1e-3 / 1e12)
    dec = bl.Case("decode", 1, 1, 1024, 32, 8, 128, False, "fp16")
    assert bl.throughput(dec, 1e-3) == pytest.approx(bl.case_bytes(dec) / 1e-3 / 1e12)


def test_default_sweep_keeps_tokens_and_hidden_constant():
    cases = bl.build_cases(bl.Sweep(modes=("fwd",)))
    assert len(cases) == 3 * 2 * 5
    for c in cases:
        assert c.batch * c.seqlen_q == 16384 and c.nheads * c.headdim == 2048 and c.dtype == "bf16"


def test_sweep_with_a_head_dim_of_v_labels_every_forward_case(tmp_path):
    cases = bl.build_cases(bl.Sweep(modes=("fwd_bwd",), headdims=(192, 128), headdim_v=128, hidden=1536,
                                    seqlens=(8192,), causal=(False,)))
    assert [(c.headdim, c.dv, c.headdim_label) for c in cases] == [(192, 128, "192/128"), (128, 128, "128")]
    assert cases[0].describe().startswith("fwd_bwd d=192/128 non-causal")
    assert bl.case_flops(cases[0]) == pytest.approx(3.5 * 2 * 2 * 8 * 8192 * 8192 * (192 + 128))
    results = [bl.Result(c, "cute-sm90", bl.OK, ms=1.0, value=100.0) for c in cases]
    table = report.render_table(results, PROVIDERS, "fwd_bwd")
    assert any(line.startswith("| 192/128 | no | 8k") for line in table.splitlines())
    assert [p.name for p in report.write_plots(results, PROVIDERS, tmp_path / "run")] == ["run-fwd_bwd.png"]
    args = bench_attention.parse_args(["--headdims", "192", "--headdim-v", "128", "--hidden", "1536"])
    assert bench_attention.sweep_of(args).headdim_v == 128


def test_decode_sweep_shapes_and_layouts():
    cases = bl.build_cases(bl.Sweep(modes=("decode",)))
    assert {(c.nheads, c.nheads_k, c.headdim, c.seqlen_q) for c in cases} == {(32, 8, 128, 1)}
    assert {c.batch for c in cases} == {1, 4, 16, 64, 128}
    assert {c.seqlen_k for c in cases} == {1024 * 2**i for i in range(6)}
    assert {c.page_size for c in cases} == {0, 64}
    assert len(cases) == 2 * 5 * 6


def test_sizes_parse_with_k_suffix():
    assert bl.parse_sizes("1k,2048, 16k") == (1024, 2048, 16384)
    assert bl.format_size(16384) == "16k" and bl.format_size(1000) == "1000"


def test_resume_keeps_only_cases_every_provider_measured():
    a, b, c = _synthetic()[0].case, _synthetic()[4].case, _synthetic()[8].case
    kept = bl.complete_cases(_synthetic(), ["cute-sm90", "cute-sm80", "sdpa-flash", "fa4"])
    assert set(kept) == {a, b}  # c has a 'not run' cell: it runs again, whole
    assert [r.provider for r in kept[b]] == ["cute-sm90", "cute-sm80", "sdpa-flash", "fa4"]
    assert [r.status for r in kept[b]] == [bl.WRONG, bl.OK, bl.ERROR, bl.OK]
    assert set(bl.complete_cases(_synthetic(), ["cute-sm90", "sdpa-flash"])) == {a, b, c}
    assert bl.complete_cases(_synthetic(), ["cute-sm90", "fa3"]) == {}  # a provider new to this run


def test_tolerance_rule_passes_within_twice_torch_error_and_fails_beyond():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 8, generator=gen) * 0.1
    out_torch = ref.to(torch.bfloat16)
    torch_err = (out_torch.float() - ref).abs().max().item()
    close = ref + torch_err * 1.5
    passed, err, tol = bl.within_tolerance(close, ref, out_torch, torch.bfloat16)
    assert passed and tol >= 2 * torch_err and err == pytest.approx(1.5 * torch_err, rel=1e-3)
    far = ref.clone()
    far[3, 3] += 10 * tol
    assert not bl.within_tolerance(far, ref, out_torch, torch.bfloat16)[0]


def test_tolerance_rule_fails_on_nan():
    ref = torch.zeros(4, 4) + 0.25
    out = ref.clone()
    out[0, 0] = float("nan")
    assert not bl.within_tolerance(out, ref, ref.to(torch.float16), torch.float16)[0]


# ---- the oracle check (device-agnostic: runs on CPU tensors too) ------------------------------


def _qkv(case: bl.Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dtype = bl.DTYPES[case.dtype]
    shape_k = (case.batch, case.seqlen_k, case.nheads_k, case.headdim)
    return (torch.randn(case.batch, case.seqlen_q, case.nheads, case.headdim, generator=gen, dtype=dtype),
            torch.randn(shape_k, generator=gen, dtype=dtype), torch.randn(shape_k, generator=gen, dtype=dtype))


def test_oracle_accepts_plain_attention_and_rejects_a_perturbed_output():
    case = bl.Case("fwd", 2, 96, 96, 6, 6, 32, True, "bf16")
    q, k, v = _qkv(case)
    oracle = bench_oracle.Oracle(case, q, k, v)
    out = bench_oracle.torch_attention(q, k, v, True, 32 ** -0.5)
    assert oracle.check(out)[0]
    bad = out.clone()
    bad[0, 50, 1, 3] += 0.1  # inside the checked slice: first sequence, first 4 heads
    passed, err, tol, what = oracle.check(bad)
    assert not passed and what == "out" and err > tol
    unwritten = out.clone()
    unwritten[0, -1, 0, 0] = float("nan")
    assert not oracle.check(unwritten)[0]


def test_oracle_checks_every_gradient():
    case = bl.Case("fwd_bwd", 1, 64, 64, 2, 2, 32, False, "bf16")
    q, k, v = (t.requires_grad_(True) for t in _qkv(case))
    dout = torch.randn(1, 64, 2, 32, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    oracle = bench_oracle.Oracle(case, q, k, v, dout)
    out = bench_oracle.torch_attention(q, k, v, False, 32 ** -0.5)
    out.backward(dout)
    grads = [q.grad, k.grad, v.grad]
    assert oracle.check(out.detach(), grads)[0]
    wrong_dk = [grads[0], grads[1] * 1.1, grads[2]]
    passed, _, _, what = oracle.check(out.detach(), wrong_dk)
    assert not passed and what == "dk"


def test_oracle_checks_a_paged_gqa_decode_through_its_page_table():
    case = bl.Case("decode", 3, 1, 128, 8, 2, 32, False, "fp16", page_size=32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 8, 32, generator=gen, dtype=torch.float16)
    k, v = (torch.randn(12, 32, 2, 32, generator=gen, dtype=torch.float16) for _ in range(2))
    page_table = torch.randperm(12, generator=gen).to(torch.int32).view(3, 4)
    oracle = bench_oracle.Oracle(case, q, k, v, page_table=page_table)
    gathered_k, gathered_v = (t[page_table.long()].flatten(1, 2) for t in (k, v))
    out = bench_oracle.torch_attention(q, gathered_k, gathered_v, False, 32 ** -0.5)
    assert oracle.check(out)[0]
    in_pool_order = bench_oracle.torch_attention(q, k.view(3, 128, 2, 32), v.view(3, 128, 2, 32), False, 32 ** -0.5)
    assert not oracle.check(in_pool_order)[0]  # pages read without the page table are caught


# ---- writers on synthetic results ----------------------------------------------------------

PROVIDERS = [
    bl.Provider("cute-sm90", True, "sm_90 kernels"),
    bl.Provider("cute-sm80", True, "sm_80 kernels"),
    bl.Provider("sdpa-flash", False, "SDPA flash"),
    bl.Provider("fa4", False, "flash-attn-4"),
    bl.Provider("fa2", False, "FlashAttention-2", skipped="not installed"),
]


def _synthetic() -> list:
    """Made-up values (never shown anywhere): two forward rows, one decode row, every status."""
    a = bl.Case("fwd", 8, 2048, 2048, 16, 16, 128, False, "bf16")
    b = bl.Case("fwd", 2, 8192, 8192, 16, 16, 128, True, "bf16")
    d = bl.Case("decode", 16, 1, 8192, 32, 8, 128, False, "bf16", page_size=64)
    R = bl.Result
    return [
        R(a, "cute-sm90", bl.OK, 1.0, 300.0), R(a, "cute-sm80", bl.OK, 1.0, 200.0),
        R(a, "sdpa-flash", bl.OK, 1.0, 150.0), R(a, "fa4", bl.OK, 1.0, 250.0),
        R(b, "cute-sm90", bl.WRONG, message="out: max error 1 > tolerance 0.01"), R(b, "cute-sm80", bl.OK, 1.0, 100.0),
        R(b, "sdpa-flash", bl.ERROR, message="RuntimeError: boom"), R(b, "fa4", bl.OK, 1.0, 400.0),
        R(d, "cute-sm90", bl.OK, 1.0, 3.0), R(d, "cute-sm80", bl.OOM, message="OutOfMemoryError: CUDA out of memory"),
        R(d, "sdpa-flash", bl.NOT_APPLICABLE, message="no paged KV cache"), R(d, "fa4", bl.NOT_RUN, message="time"),
    ]


def test_ratio_is_best_cute_flash_over_best_peer():
    rows = report.group_rows(_synthetic(), "fwd")
    names = {p.name for p in PROVIDERS if p.cute_flash}
    assert bl.ratio(rows[0][1].values(), names) == pytest.approx(300 / 250)
    assert bl.ratio(rows[1][1].values(), names) == pytest.approx(100 / 400)  # the wrong cute-sm90 is not a result
    decode = report.group_rows(_synthetic(), "decode")
    assert bl.ratio(decode[0][1].values(), names) is None  # no correct peer


def test_markdown_table_has_a_row_per_shape_and_the_ratio():
    text = report.render_table(_synthetic(), PROVIDERS, "fwd")
    lines = text.splitlines()
    assert lines[0] == "### forward (TFLOP/s)"
    header = lines[2]
    assert "cute-sm90" in header and "fa4" in header and "fa2" not in header  # skipped: no column
    assert header.rstrip(" |").endswith("cute_flash / best peer")
    row_a = next(line for line in lines if line.startswith("| 128 | no | 2k"))
    assert "**300.0**" in row_a and "150.0" in row_a and row_a.rstrip(" |").endswith("1.20×")
    row_b = next(line for line in lines if line.startswith("| 128 | yes | 8k"))
    assert "wrong [" in row_b and "error [" in row_b and "**400.0**" in row_b and row_b.rstrip(" |").endswith("0.25×")
    assert any("RuntimeError: boom" in line for line in lines)  # footnote with the error


def test_markdown_decode_table_reports_tbs_and_no_ratio_without_peers():
    text = report.render_table(_synthetic(), PROVIDERS, "decode")
    assert text.splitlines()[0] == "### decode (seqlen_q = 1) (TB/s)"
    row = next(line for line in text.splitlines() if line.startswith("| 16 | 8k | paged 64"))
    assert "**3.00**" in row and "OOM [" in row and "n/a [" in row and "not run [" in row
    assert row.rstrip(" |").endswith("–")


def test_markdown_report_records_versions_command_and_skipped_providers():
    meta = {"gpu": "GPU X", "driver": "1.2", "torch": "2.x", "nvidia-cutlass-dsl": "4.8.1", "command": "python b.py"}
    text = report.render_markdown(meta, PROVIDERS, _synthetic(), ["run-fwd.png"])
    for needle in ("GPU X", "driver: 1.2", "nvidia-cutlass-dsl: 4.8.1", "`python b.py`", "`fa2`", "not installed",
                   "### forward (TFLOP/s)", "### decode", "![run-fwd](run-fwd.png)"):
        assert needle in text
    assert "forward + backward" not in text.split("## Providers")[1]  # no fwd_bwd results, no table


def test_json_round_trips(tmp_path):
    meta = {"gpu": "GPU X", "notes": ["a note"]}
    path = tmp_path / "r.json"
    report.write_json(path, meta, PROVIDERS, _synthetic())
    meta2, providers2, results2 = report.read_json(path)
    assert meta2 == meta and providers2 == PROVIDERS and results2 == _synthetic()


def test_plots_are_pngs_one_per_mode_with_results(tmp_path):
    written = report.write_plots(_synthetic(), PROVIDERS, tmp_path / "run")
    assert [p.name for p in written] == ["run-fwd.png", "run-decode.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


# ---- command line ---------------------------------------------------------------------------


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "bench_attention.py"), *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_help():
    r = _cli("--help")
    assert r.returncode == 0
    for option in ("--modes", "--headdims", "--seqlens", "--causal", "--providers", "--dtype", "--total-tokens",
                   "--hidden", "--warmup", "--rep", "--out-dir", "--dry-run", "--quick"):
        assert option in r.stdout


def test_cli_dry_run_lists_the_default_sweep(capsys):
    assert bench_attention.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("120 cases x 10 providers")
    assert "fwd d=64 non-causal seqlen=1k b=16 h=32" in out
    assert "decode b=128 kv=32k h=32/8 d=128 paged 64" in out


def test_cli_dry_run_filters_and_quick(capsys):
    argv = ["--dry-run", "--quick", "--modes", "fwd", "--causal", "yes", "--providers", "cute-sm90,fa4"]
    assert bench_attention.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 cases x 2 providers")
    assert "fwd d=128 causal seqlen=2k b=8 h=16" in out and "fwd d=128 causal seqlen=8k b=2 h=16" in out


def test_cli_quick_keeps_explicit_options():
    args = bench_attention.parse_args(["--quick", "--headdims", "64", "--page-sizes", "0"])
    assert args.headdims == (64,) and args.seqlens == (2048, 8192) and args.page_sizes == (0,)


def test_cli_rejects_an_unknown_provider(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.parse_args(["--providers", "nope"])
    assert exit_info.value.code == 2 and "unknown mode or provider: nope" in capsys.readouterr().err


def test_cli_rounds_must_be_positive(capsys):
    assert bench_attention.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_rounds_report_the_median_of_the_turns_after_the_checks_and_drop_a_provider_that_fails_later():
    case = bl.Case(mode="fwd", batch=2, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_k=16, headdim=128,
                   causal=False, dtype="bf16")
    results = [bl.Result(case, "a", bl.OK, ms=1.0, value=bl.throughput(case, 1e-3)),
               bl.Result(case, "b", bl.OK, ms=2.0, value=bl.throughput(case, 2e-3)),
               bl.Result(case, "c", bl.WRONG, max_err=1.0)]
    order, a_times = [], iter([3.0, 2.0, 4.0])

    def time_a():
        order.append("a")
        return next(a_times)

    def time_b():
        order.append("b")
        raise RuntimeError("lost")

    bench_attention.time_rounds(results, {"a": time_a, "b": time_b}, rounds=3)
    a, b, c = results
    # round 1 backwards: b, a; rounds 2 and 3 a alone once b has failed
    assert order == ["b", "a", "a", "a"]
    # the timing right after the check (1.0 ms) is not a round
    assert a.ms_rounds == [3.0, 2.0, 4.0] and a.ms == 3.0 and a.value == bl.throughput(case, 3e-3)
    assert b.status == bl.ERROR and b.value is None and "a later round" in b.message
    assert c.status == bl.WRONG and c.ms_rounds is None


def test_a_case_stopped_by_the_time_limit_still_gets_its_rounds_and_a_lost_context_says_so():
    case = bl.Case(mode="fwd", batch=2, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_k=16, headdim=128,
                   causal=False, dtype="bf16")

    def cells():
        return [bl.Result(case, "a", bl.OK, ms=1.0, value=bl.throughput(case, 1e-3)),
                bl.Result(case, "b", bl.NOT_RUN, message=bench_attention.TIME_LIMIT)]

    results = cells()
    bench_attention.finish_rounds(results, {"a": lambda: 2.0}, rounds=3, stopped=bench_attention.TIME_LIMIT)
    assert results[0].ms_rounds == [2.0, 2.0, 2.0] and results[0].ms == 2.0 and not results[0].message
    assert results[1].status == bl.NOT_RUN

    def must_not_run():
        raise AssertionError("timed after the CUDA context was lost")

    results = cells()
    bench_attention.finish_rounds(results, {"a": must_not_run}, rounds=3, stopped="the CUDA context was lost")
    assert results[0].ms == 1.0 and results[0].ms_rounds is None
    assert "one timing, right after its check" in results[0].message


def test_rounds_alternate_the_order_of_the_providers():
    names = ["a", "b", "c"]
    assert [bench_attention.round_order(names, i) for i in range(4)] == [names, names[::-1], names, names[::-1]]


def test_kernel_breakdown_rounds_take_turns_and_report_medians():
    import kernel_breakdown

    calls = []

    def run_one(provider):
        calls.append(provider)
        if provider == "x":
            raise RuntimeError("lost")
        us = {"a": [10.0, 30.0, 20.0], "b": [5.0, 7.0, 6.0]}[provider][sum(c == provider for c in calls) - 1]
        rows = {"fwd": (1.0, us)}
        if provider == "a" and len(calls) == 1:
            rows["memset"] = (2.0, 1.0)  # a kernel seen in one round only
        return rows, us + 100.0

    out = kernel_breakdown.breakdown_rounds(["a", "b", "x"], run_one, rounds=3)
    assert calls == ["a", "b", "x", "b", "a", "a", "b"]  # reversed every other round; x dropped once failed
    rows, per_steps = out["a"]
    assert per_steps == [110.0, 130.0, 120.0]
    assert rows["fwd"] == (1.0, 20.0) and rows["memset"] == (2.0, 1.0)
    assert out["b"][0]["fwd"] == (1.0, 6.0)
    assert isinstance(out["x"], RuntimeError)


def test_recorded_commit_can_be_given_by_the_environment(monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_COMMIT", "abc1234")
    assert bench_attention._commit() == "abc1234, as CUTE_FLASH_COMMIT says"
    monkeypatch.setenv("CUTE_FLASH_COMMIT", " ")
    assert "CUTE_FLASH_COMMIT" not in bench_attention._commit()


def test_recorded_command_leaves_out_where_files_go_and_come_from():
    argv = ["--quick", "--out-dir", "/some/where", "--modes=fwd", "--out-dir=/x", "--resume", "r.json"]
    assert bench_attention.command_line(argv) == "python benchmarks/bench_attention.py --quick --modes=fwd"


def test_cuda_graph_results_get_their_own_name():
    import datetime

    day = datetime.date(2026, 11, 29)
    assert bench_attention.result_stem("NVIDIA H200", day, graph=False) == "nvidia-h200-2026-11-29"
    assert bench_attention.result_stem("NVIDIA H200", day, graph=True) == "nvidia-h200-2026-11-29-graph"


def test_cli_accepts_cuda_graph_timing(capsys):
    bench_attention.main(["--cuda-graph", "--quick", "--dry-run"])
    assert "decode" in capsys.readouterr().out


def test_tile_candidates_parse_and_replace_only_the_tile():
    import argparse

    import tune_tiles  # noqa: E402  (benchmarks/ is on sys.path above)

    assert tune_tiles.parse_candidate("128x144w2s2", "sm_90a") == dict(
        tile_m=128, tile_n=144, num_stages=2, num_consumer_wgs=2, pingpong=True)
    assert tune_tiles.parse_candidate("128x128w2s2-nopp", "sm_90a")["pingpong"] is False
    assert tune_tiles.parse_candidate("128x64w8s2", "sm_80") == dict(
        tile_m=128, tile_n=64, num_stages=2, num_warps=8, pingpong=False)
    # sm_80's warp groups take turns only with -pp (whatever the shipped tile does)
    assert tune_tiles.parse_candidate("256x32w8s2-pp", "sm_80")["pingpong"] is True
    with pytest.raises(ValueError, match="sm_80 option"):
        tune_tiles.parse_candidate("128x128w2s2-pp", "sm_90a")
    assert tune_tiles.parse_candidate("128x64w4s2-lazy", "sm_80")["lazy_rescale"] is True
    assert tune_tiles.parse_candidate("128x128w2s2-nopp-eager", "sm_90a")["lazy_rescale"] is False
    grid = tune_tiles.parse_candidate("128x128w2s3-grid", "sm_90a")
    assert grid["persistent"] is False and grid["tile_counter"] is False and grid["num_stages"] == 3
    with pytest.raises(ValueError, match="sm_90a options"):
        tune_tiles.parse_candidate("128x64w4s2-grid", "sm_80")
    assert tune_tiles.parse_candidate("192x128w3s2-grid-psmem", "sm_90a")["p_in_smem"] is True
    assert "p_in_smem" not in tune_tiles.parse_candidate("192x128w3s2", "sm_90a")
    with pytest.raises(ValueError, match="sm_90a options"):
        tune_tiles.parse_candidate("128x64w4s2-psmem", "sm_80")
    with pytest.raises(ValueError, match="MxNwWsS"):
        tune_tiles.parse_candidate("128by64", "sm_80")
    # the keep vote on (with the lazy rescale) or off (with the sm_90 P·V wait placed after it)
    assert tune_tiles.parse_candidate("128x32w4s2-vote", "sm_80") == dict(
        tile_m=128, tile_n=32, num_stages=2, num_warps=4, pingpong=False, lazy_rescale=True, keep_vote=True)
    assert tune_tiles.parse_candidate("128x128w2s2-novote", "sm_90a")["pv_wait_at"] == -1
    assert tune_tiles.parse_candidate("128x64w4s2-eager", "sm_80")["keep_vote"] is False
    with pytest.raises(ValueError, match="not with -eager"):
        tune_tiles.parse_candidate("128x64w4s2-eager-vote", "sm_80")
    args = argparse.Namespace(
        arch="sm_90a", dtype="bfloat16", head_dim=128, causal=True,
        candidates=["128x144w2s2", "100x128w2s2", "128x128w2s2", "128x128w2s2-grid"])
    (label, shipped, _), (_, tuned, _), (_, bad, why), (_, square, _), (_, grid, _) = tune_tiles.candidates(args)
    assert label == "shipped" and tuned.causal and tuned.tile_n == 144
    # half blocks need 128 keys and the persistent loop
    assert not shipped.masked_halves and not tuned.masked_halves and square.masked_halves and not grid.masked_halves
    assert replace_tile(tuned, shipped) == shipped  # nothing but the tile differs
    assert bad is None and "64 per consumer warpgroup" in why


def test_bwd_tile_candidates_replace_only_the_tile_and_restore_the_table():
    import argparse

    import tune_bwd_tiles  # noqa: E402  (benchmarks/ is on sys.path above)
    from cute_flash.backends.base import AttnArgs
    from cute_flash.backends.cute_bwd import configs as call_configs
    from cute_flash.kernels.sm80 import bwd_config as bc

    shipped_tile = bc.TILES[256]
    assert tune_bwd_tiles.parse_candidate("32x128w8q2", shipped_tile) == shipped_tile._replace(
        tile_n=128, num_warps=8)
    with pytest.raises(ValueError, match="MxNwWqQ"):
        tune_bwd_tiles.parse_candidate("32x128w8", shipped_tile)
    assert tune_bwd_tiles.parse_candidate("32x64w4q2c4", shipped_tile) == shipped_tile._replace(col_tiles=4)
    args = argparse.Namespace(dtype="bfloat16", head_dim=256, causal=True, softcap=0.0, deterministic=False,
                              candidates=["32x128w8q2", "32x96w8q2"])
    (label, _, shipped, _), (_, tile, tuned, _), (_, _, bad, why) = tune_bwd_tiles.configs(args)
    assert label == "shipped" and shipped == bc.make_config("bfloat16", 256, 256, causal=True)
    assert (tuned.tile_n, tuned.num_warps, tuned.col_tiles, tuned.causal, tuned.check_hdim) == (128, 8, 2, True, False)
    assert bad is None and "16 per warp" in why
    # at 192 that tile's dQ MMA (4 warps along the head dim, 64 columns) does not tile 96 columns
    args.head_dim = 192
    assert "multiple of 64" in tune_bwd_tiles.configs(args)[1][3]
    # the backend's own host path sees the candidate inside with_tile, and the shipped tile after
    q = torch.empty(1, 8, 1, 256, dtype=torch.bfloat16)
    inside = tune_bwd_tiles.with_tile(256, tile, lambda: call_configs(q, q, q, None, AttnArgs(0.1))[1])
    assert inside.tile_n == 128 and bc.TILES[256] == shipped_tile
    assert call_configs(q, q, q, None, AttnArgs(0.1))[1].tile_n == shipped_tile.tile_n
    # soft-capped deterministic calls time the candidate too, not the tile their rule picks
    args = argparse.Namespace(dtype="bfloat16", head_dim=256, causal=True, softcap=50.0, deterministic=True,
                              candidates=["32x64w4q2c4"])
    (_, _, shipped, _), (_, _, tuned, _) = tune_bwd_tiles.configs(args)
    assert shipped.tile_m == shipped_tile.tile_m and shipped.softcap and shipped.deterministic
    assert (tuned.tile_m, tuned.col_tiles) == (32, 4) and bc.SOFTCAP_TILE_256.tile_m == 16


def replace_tile(config, like):
    from dataclasses import replace

    # (and the sm_90 forward's half blocks, which come with 128 keys per block)
    fields = ("tile_m", "tile_n", "num_stages", "num_consumer_wgs", "pingpong", "masked_halves")
    return replace(config, **{f: getattr(like, f) for f in fields if hasattr(like, f)})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_ab_sm90_fwd_times_distinct_schedules(head_dim, causal):
    """benchmarks/ab_sm90_fwd.py times the shipped forward and variants that differ from it: the
    other grid where the table is persistent, the fixed stride where causal tiles come from
    the counter, and at head dim 192 the other GEMM-issue order (ping-pong or not)."""
    import ab_sm90_fwd

    variants = ab_sm90_fwd.variants(head_dim, causal)
    labels = [label for label, _ in variants]
    configs = [config for _, config in variants]
    assert labels[:2] == (["lazy", "eager"] if configs[0].lazy_rescale else ["eager", "lazy"])
    assert len(set(labels)) == len(labels)
    assert len(set(configs)) == len(configs)
    assert ("grid" in labels) == configs[0].persistent
    assert ("stride" in labels) == configs[0].tile_counter
    if head_dim == 192:
        assert configs[0].pingpong and "no pingpong" in labels
    psmem = [config for label, config in variants if "psmem" in label]
    assert bool(psmem) == (head_dim in (64, 96)) and all(config.p_in_smem for config in psmem)
    assert not any(config.p_in_smem for label, config in variants if "psmem" not in label)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_ab_sm90_bwd_times_the_shipped_backward_and_distinct_flag_flips(head_dim, causal):
    """benchmarks/ab_sm90_bwd.py times what the backward ships first, then configurations that
    each differ from it and from one another (a flip that would repeat one is left out)."""
    import ab_sm90_bwd

    from cute_flash.kernels.sm90.bwd_config import make_config

    variants = ab_sm90_bwd.variants(head_dim, causal)
    labels = [label for label, _ in variants]
    configs = [config for _, config in variants]
    assert labels[0] == "shipped" and configs[0] == make_config("bfloat16", head_dim, head_dim, causal=causal)
    assert len(set(labels)) == len(labels) and len(set(configs)) == len(configs)
    assert all(c.head_dim == head_dim and c.causal == causal for c in configs)
    flipped = dict(variants)
    assert flipped["stats_early"].stats_early != configs[0].stats_early
    assert flipped["dq_fence_late"].dq_fence_late != configs[0].dq_fence_late
    # the schedule before the two flags existed is among them
    assert any(not c.stats_early and not c.dq_fence_late for c in configs)
    # the dQ GEMMs' options flipped: off where they ship (96, 128: the column split of 64 keys per
    # warpgroup), dS K-major where not (64's 128-row tile, whose warpgroups split dQ's rows)
    shipped = configs[0]
    if head_dim in (96, 128):
        assert shipped.ds_kmajor and shipped.dq_own_first and "dS K-major" not in flipped
        assert not flipped["dS MN-major"].ds_kmajor and flipped["dS MN-major"].dq_own_first
        assert not flipped["dQ after both"].dq_own_first and flipped["dQ after both"].ds_kmajor
        before = flipped["dQ after both + dS MN-major"]
        assert not before.ds_kmajor and not before.dq_own_first
    else:
        # the 128-row tile: its warpgroups split dQ's rows, each over both warpgroups' keys
        assert flipped["dS K-major"].ds_kmajor and not shipped.ds_kmajor and shipped.dq_rows
        assert flipped["dQ own first"].dq_own_first and not shipped.dq_own_first
        assert flipped["dQ own first + dS K-major"].ds_kmajor


@pytest.mark.parametrize("head_dim", [192, 256])
def test_ab_sm90_bwd_flips_only_what_the_column_split_tile_takes(head_dim):
    import ab_sm90_bwd

    variants = dict(ab_sm90_bwd.variants(head_dim, causal=True))
    shipped = variants["shipped"]
    assert shipped.dkv_split and "dq_fence_late" in variants and "no lpt" in variants
    assert "stats_early" not in variants and "overlap_dv" not in variants  # P^T / dS^T from shared memory
    assert not any("dS " in label or "dQ own" in label or "dQ after" in label for label in variants)
    assert all(c.dkv_split and c.head_dim == head_dim for c in variants.values())
    unmasked = dict(ab_sm90_bwd.variants(head_dim, causal=False))
    assert unmasked["shipped"].rotate_queries and not unmasked["no rotate"].rotate_queries
    assert variants["rotate"].rotate_queries and not shipped.rotate_queries


def test_ab_sm90_bwd_refuses_head_dims_it_has_no_tile_for():
    import ab_sm90_bwd

    with pytest.raises(SystemExit):
        ab_sm90_bwd.main(["--head-dims", "80", "--compile-only"])


def test_ab_scripts_share_their_case_options():
    import argparse

    p = argparse.ArgumentParser()
    bl.add_ab_case_arguments(p, (64, 128), 4096, "compile only")
    opts = p.parse_args([])
    assert (opts.head_dims, opts.batch, opts.seqlen, opts.compile_only) == ([64, 128], 2, 4096, False)
    assert bl.ab_cases(p, opts, (64, 128)) == [(64, False), (64, True), (128, False), (128, True)]
    assert bl.ab_cases(p, p.parse_args(["--head-dims", "128", "--causal-only"]), (64, 128)) == [(128, True)]
    assert bl.ab_cases(p, p.parse_args(["--full-only"]), (64, 128)) == [(64, False), (128, False)]
    with pytest.raises(SystemExit):
        bl.ab_cases(p, p.parse_args(["--head-dims", "96"]), (64, 128))


def test_warm_in_processes_reports_what_each_compile_returned(capsys):
    # a module-level callable, as the A/B scripts pass theirs (spawned processes import it)
    bl.warm_in_processes([[1], [2, 3], [4]], len, 2)
    assert capsys.readouterr().out.strip() == "warm-up: 3 variants (1, 2)"


def test_warm_in_processes_reports_a_failure_and_goes_on(capsys):
    bl.warm_in_processes([1], len, 1)  # len(1) raises TypeError in the worker
    assert capsys.readouterr().out.startswith("warm-up failed (TypeError")


def test_ab_sm90_fwd_takes_jobs():
    import ab_sm90_fwd

    with pytest.raises(SystemExit):  # --jobs is an int
        ab_sm90_fwd.main(["--jobs", "many"])


_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
.L_x_2:
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0030*/                   MUFU.EX2 R3, R3 ;
        /*0040*/               @P0 FMNMX.NAN R4, R4, R5, !PT ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   FADD R4, R4, R5 ;
        /*0070*/              @!P0 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_loop_sass_takes_the_smallest_loop_with_the_gemms():
    import loop_sass

    inner = loop_sass.key_block_loop(_SASS, 1)
    assert [x.split()[0] for x in inner] == ["HGMMA.64x128x16.F32.BF16", "MUFU.EX2", "@P0", "@P1"]
    outer = loop_sass.key_block_loop(_SASS, 2)
    assert len(outer) == 7
    assert loop_sass.mix(outer) == {"HGMMA.64x128x16": 2, "MUFU.EX2": 1, "FMNMX.NAN": 1, "BRA": 2, "FADD": 1}
    with pytest.raises(ValueError):
        loop_sass.key_block_loop(_SASS, 3)
    # the inner loop: one path; the outer one: around the inner loop once, or past its branch
    assert loop_sass.path_lengths(_SASS, 1) == [4]
    assert loop_sass.path_lengths(_SASS, 2) == [7]


_FORKED = """
.L_x_1:
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, gsb0 ;
        /*0010*/              @!P0 BRA `(.L_x_9) ;
        /*0020*/               @P1 BRA `(.L_x_2) ;
        /*0030*/                   FMUL R4, R4, R5 ;
        /*0040*/                   FMUL R6, R6, R5 ;
.L_x_2:
        /*0050*/                   FADD R4, R4, R6 ;
        /*0060*/               @P2 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
.L_x_9:
        /*0080*/                   BRA `(.L_x_1) ;
"""


def test_loop_sass_counts_each_path_of_a_trip():
    import loop_sass

    # a branch out of the loop (a wait's slow path) is not taken; the skip of the FMULs forks
    assert loop_sass.path_lengths(_FORKED, 1) == [5, 7]
    assert len(loop_sass.key_block_loop(_FORKED, 1)) == 7


def test_loop_sass_forks_at_a_branch_with_a_second_predicate():
    import loop_sass

    # `@P0 BRA P1, ...` (taken where both hold): the backward's masked-block test
    forked = _FORKED.replace("@P1 BRA `(.L_x_2)", "@P0 BRA P1, `(.L_x_2)")
    assert loop_sass.path_lengths(forked, 1) == [5, 7]
    # its --set is the profiling tools' (0 / 1 turned into booleans for boolean flags)
    assert loop_sass.parse_overrides("ds_kmajor=1, dq_stages=2,lpt=0") == {"ds_kmajor": 1, "dq_stages": 2, "lpt": 0}
    from cute_flash.kernels.sm90.bwd_config import make_config

    flagged = loop_sass.apply_overrides(make_config("bfloat16", 128, 128), {"ds_kmajor": 1, "lpt": 0})
    assert flagged.ds_kmajor is True and flagged.lpt is False


def test_loop_sass_finds_the_step_loop_of_the_shipped_backward(capsys):
    import loop_sass

    assert loop_sass.main(["--head-dim", "128", "--causal", "--kernel", "bwd"]) == 0
    out = capsys.readouterr().out
    trips = re.search(r"\[0\]\s+\d+\s+per trip ([\d/]+)\s+bwd_sm90_bfloat16_hd128_64x128s2_causal", out).group(1)
    # the unmasked and the masked block: 32 exponentials of P^T a thread more on the second
    assert len(trips.split("/")) == 2 and all(300 < int(count) < 600 for count in trips.split("/")), trips
    # S^T, dP^T and dQ (m64n64, 8 each) and dV, dK (m64n128 over 64 queries, 4 each)
    assert re.search(r"HGMMA\.64x64x16\s+24\b", out) and re.search(r"HGMMA\.64x128x16\s+8\b", out)
    with pytest.raises(SystemExit):
        loop_sass.main(["--set", "ds_kmajor=1"])  # the forward takes no backward flags


def test_loop_sass_finds_the_key_block_loop_of_the_shipped_kernel(capsys):
    import loop_sass

    assert loop_sass.main(["--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    trips = re.search(r"\[0\]\s+\d+\s+per trip ([\d/]+)\s+fwd_sm90_bfloat16_hd64", out).group(1)
    # one key block's softmax for 64 scores a thread, and its GEMMs, along each path (`keep_vote`:
    # the rows keep their references or not, and O's rescale is skipped or not)
    assert all(300 < int(count) < 600 for count in trips.split("/")), trips
    # the exponentials of 64 scores on each of the vote's two paths
    assert re.search(r"HGMMA\.64x128x16\s+4\b", out) and re.search(r"MUFU\.EX2\s+1[23]\d\b", out)


def _timeline_record(sm, steps, start, cycles_per_step, step_ns=1000, wrap=0):
    """A synthetic `Sm90BwdConfig.timeline` record: one CTA on SM `sm` starting at `start` ns,
    K/V in after 500 ns, the first Q in after 800, `steps` steps of `step_ns`, a 700 ns epilogue;
    both warpgroups count `cycles_per_step` per step, split 1:2:3:4:5:6:7 over the phases."""
    t = [start, start + 500, start + 800, start + 800 + 2 * step_ns, start + 800 + steps * step_ns,
         start + 800 + steps * step_ns + 700]
    t = [(x + wrap) % (1 << 32) for x in t]
    phases = [cycles_per_step * steps * (i + 1) // 28 for i in range(7)]
    return [sm, steps, *t, *phases, steps, *phases, steps]


def test_bwd_timeline_summary_splits_sm_time_and_phases():
    import bwd_timeline as tl

    # two SMs: SM 0 runs two CTAs back to back (100 ns apart), SM 1 one CTA that ends early;
    # the timer wraps around 2^32 in the middle of the launch
    wrap = (1 << 32) - 3000
    records = [_timeline_record(0, 10, 0, 2800, wrap=wrap), _timeline_record(0, 10, 11600, 2800, wrap=wrap),
               _timeline_record(1, 4, 0, 2800, wrap=wrap)]
    s = tl.summarize(records, clock_ghz=2.8)
    assert s.ctas == 3 and s.sms == 2
    assert s.span_us == pytest.approx(23.1)  # 11600 + 800 + 10000 + 700 ns
    assert s.prologue_us == pytest.approx(0.8) and s.epilogue_us == pytest.approx(0.7)
    assert s.first_two_us == pytest.approx(2.0) and s.step_us == pytest.approx(1.0)
    assert s.between == pytest.approx(100 / (2 * 23100))
    assert s.idle_end == pytest.approx((23100 - 5500) / (2 * 23100))
    assert s.busy + s.between + s.idle_end == pytest.approx(1.0)
    assert [round(c) for c in s.phases[0]] == [100 * (i + 1) for i in range(7)]
    assert tl.clock_rate(records) == pytest.approx(28000 / 10300)  # the longest walk's cycles over its ns


def test_bwd_timeline_overrides_are_checked_flags():
    import timeline_lib as tlib
    from cute_flash.kernels.sm90.bwd_config import make_config

    base = make_config("bfloat16", 128, 128, causal=True)
    flipped = tlib.apply_overrides(base, tlib.parse_overrides("stats_early=1, dq_fence_late=0"))
    assert flipped.stats_early is True and flipped.dq_fence_late is False
    wide = make_config("bfloat16", 64, 64)
    narrow = tlib.apply_overrides(wide, tlib.parse_overrides("tile_m=64,dq_rows=0,dq_split=1,dv_after_ds=0"))
    assert narrow.tile_m == 64 and not narrow.dq_rows
    with pytest.raises(SystemExit, match="no flag"):
        tlib.apply_overrides(base, {"no_such_flag": 1})


def test_fwd_timeline_summary_and_records_from_the_lse():
    import fwd_timeline as ft

    def record(sm, blocks, start, cycles_per_block, wgs=2):
        # Q in after 300 ns, the first block after 1000 more, later blocks of 500 ns, a 400 ns epilogue
        t = [start, start + 300, start + 1300, start + 1300 + (blocks - 1) * 500, start + 1700 + (blocks - 1) * 500]
        r = [sm, blocks, *t, 0]
        for _ in range(wgs):
            r += [cycles_per_block * (blocks - 1) // 7] * 7 + [blocks - 1]
        return r + [0] * (ft.RECORD_INTS - len(r))

    records = [record(0, 9, 0, 1400), record(0, 5, 5800, 1400), record(1, 3, 0, 1400),
               [1, 0] + [0] * (ft.RECORD_INTS - 2)]  # a tile that saw no key: left out
    s = ft.summarize(records, 2, clock_ghz=2.8)
    assert s.tiles == 3 and s.sms == 2 and s.span_us == pytest.approx(9.5)
    assert s.prologue_us == pytest.approx(0.3) and s.first_block_us == pytest.approx(1.0)
    assert s.block_us == pytest.approx(0.5) and s.epilogue_us == pytest.approx(0.4)
    assert s.between == pytest.approx(100 / (2 * 9500))
    assert [round(c) for c in s.phases[1]] == [200] * 7
    assert ft.clock_rate(records, 2) == pytest.approx(1400 * 8 // 7 * 7 / 4000)
    assert "later block 0.500" in ft.format_summary(s)

    lse = torch.zeros(1, 2, 300)  # tile_m 128: tiles at rows 0, 128 and 256 (44 rows: >= 32)
    ints = lse.view(torch.int32)
    for m in range(3):
        ints[:, :, m * 128] = 7 + m
    rows = ft.tile_records(lse, 128)
    assert len(rows) == 6 and sorted({r[0] for r in rows}) == [7, 8, 9]
    assert ft.tile_records(torch.zeros(1, 1, 140), 128) == [[0] * ft.RECORD_INTS]  # the 12-row tile has none


def test_mma_sync_peak_compiles_for_sm90a(capsys):
    """The mma.sync ceiling's kernel builds on the CPU (it times on a GPU only)."""
    import mma_sync_peak

    assert mma_sync_peak.main(["--compile-only", "--warps", "4", "--iters", "8"]) == 0
    assert "4 warps per CTA: compiled" in capsys.readouterr().out


def test_ab_clusters_parses_cases_and_compiles_each_variant(capsys):
    """benchmarks/ab_clusters.py: `head dim:seqlen:batch` cases; on the CPU it compiles both
    variants of every case (the cluster and single CTAs) and reports their spills."""
    import ab_clusters

    assert ab_clusters.parse_cases("128:8192:2,64:16384:1") == [(128, 8192, 2), (64, 16384, 1)]
    assert ab_clusters.parse_cases("") == []
    assert ab_clusters.main(["--compile-only", "--fwd", "128:2048:8", "--bwd", "64:2048:8"]) == 0
    out = capsys.readouterr().out
    for label in ("fwd hd128 cluster", "fwd hd128 single", "bwd hd64 cluster", "bwd hd64 single"):
        assert label in out
    assert "SPILLS" not in out


def test_interleaved_rounds_reverse_the_order_every_other_round(monkeypatch):
    import types

    calls, cleared = [], []

    def do_bench(fn, warmup, rep, grad_to_none, return_mode):
        assert (warmup, rep, return_mode) == (25, 80, "median")
        cleared.append(grad_to_none)
        return fn()

    testing = types.ModuleType("triton.testing")
    testing.do_bench = do_bench
    package = types.ModuleType("triton")
    package.testing = testing
    monkeypatch.setitem(sys.modules, "triton", package)
    monkeypatch.setitem(sys.modules, "triton.testing", testing)

    def run(label, ms):
        return lambda: calls.append(label) or ms

    times = bl.interleaved_rounds({"a": run("a", 1.0), "b": run("b", 2.0), "c": run("c", 3.0)}, 3, rep_ms=80)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert times == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3}
    assert cleared == [None] * 9
    # tensors whose gradients a timed backward would accumulate reach every do_bench call
    grads = [object()]
    assert bl.interleaved_rounds({"a": run("a", 1.0)}, 2, rep_ms=80, grad_to_none=grads) == {"a": [1.0, 1.0]}
    assert cleared[-2:] == [grads, grads]


def test_loop_sass_finds_the_key_block_loop_of_the_sm80_kernel(capsys):
    import loop_sass

    assert loop_sass.main(["--head-dim", "128", "--kernel", "sm80"]) == 0
    out = capsys.readouterr().out
    trips = re.search(r"\[0\]\s+\d+\s+per trip ([\d/]+)\s+fwd_sm80_bfloat16_hd128", out).group(1)
    # a warp's 128 HMMAs (32 rows of S over 32 keys, and of P V) and the softmax of its 32 scores a thread
    assert all(300 < int(count) < 600 for count in trips.split("/")), trips
    assert re.search(r"HMMA\s+128\b", out) and re.search(r"MUFU\.EX2\s+32\b", out)
    with pytest.raises(SystemExit):
        loop_sass.main(["--kernel", "sm80", "--fa4"])
