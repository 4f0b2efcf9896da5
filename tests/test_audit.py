"""The compile audit reads what the compiler made, and fails a kernel that spills.

The spilling kernel is defined here, test-only: a register array indexed at run time, which ptxas
places in local memory while reporting zero spill bytes; the audit must still fail it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import pytest  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402

from cute_flash import audit  # noqa: E402
from cute_flash.kernels.common import probes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None,
    reason="needs nvidia-cuda-nvdisasm and nvidia-cuda-cuobjdump (the test extra)",
)


# ------------------------------------------------------------------------------------------------
# a deliberately spilling kernel, audited through `--module test_audit`
# ------------------------------------------------------------------------------------------------
TABLE = 256  # entries: large enough that ptxas cannot turn the lookup into a select chain


class RuntimeIndexedArray:
    """out[t] = table[index[t]] where the table is a per-thread register array."""

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mIn, mOut).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        table = cute.make_rmem_tensor((TABLE,), Float32)
        for i in cutlass.range_constexpr(TABLE):
            table[i] = mIn[i, tidx]
        mOut[tidx] = table[cutlass.Int32(mIn[TABLE, tidx]) % TABLE]


def _compile_runtime_indexed_array(options: str):
    table = make_fake_tensor(Float32, (TABLE + 1, 32), (32, 1), assumed_align=16)
    out = make_fake_tensor(Float32, (32,), (1,), assumed_align=16)
    return cute.compile(RuntimeIndexedArray(), table, out, cuda.CUstream(0), options=options)


def audit_targets(arch: str) -> list:
    return [audit.AuditTarget("test_runtime_indexed_array", arch, _compile_runtime_indexed_array)]


def _run_cli(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p))
    return subprocess.run([sys.executable, "-m", "cute_flash.audit", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT)


# ------------------------------------------------------------------------------------------------
# parsers, on text in the tools' formats
# ------------------------------------------------------------------------------------------------
def test_parse_ptxas_remarks_reads_spills_and_registers():
    text = (
        "ptxas info    : Function properties for k\n"
        "ptxas         .     48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 384 bytes cmem[0]\n"
    )
    assert audit.parse_ptxas_remarks(text) == {
        "stack_frame": 48, "spill_stores": 40, "spill_loads": 36, "registers": 255,
    }


def test_parse_resource_usage_reads_registers_and_static_smem():
    text = " Function k:\n  REG:168 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:384 TEXTURE:0\n"
    assert audit.parse_resource_usage(text) == {
        "registers": 168, "stack_frame": 0, "smem_static": 1024,
    }


def test_count_sass_strips_predicates_and_modifiers():
    text = (
        "        /*0040*/                   LDSM.16.M88.4 R4, [R2] ;\n"
        "        /*0050*/              @!P0 LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;\n"
        "        /*0060*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;\n"
        "        /*0070*/                   HMMA.16816.F32.BF16 R12, R4, R7, R12 ;\n"
    )
    assert audit.count_sass(text) == {"LDSM": 1, "LDGSTS": 1, "HMMA": 2}


# ------------------------------------------------------------------------------------------------
# auditing the probes
# ------------------------------------------------------------------------------------------------
def _probe_target(arch: str, name: str) -> audit.AuditTarget:
    return next(t for t in probes.audit_targets(arch) if t.name == name)


def test_sm80_probe_instruction_mix_matches_the_tile():
    row = audit.audit_target(_probe_target("sm_80", "probe_sm80_hd64_bf16"))
    assert row.error is None and not row.spills
    assert 0 < row.registers <= 255
    # 64x64x64 S and 64x64x64 O: 2 * 64*64*64 / (16*8*16) m16n8k16 MMAs.
    assert row.sass["HMMA"] == 64
    # Q: 4 x4-loads per warp; K and V: 16 each (every warp reads all of K and V).
    assert row.sass["LDSM"] == 4 + 16 + 16
    # Q, K, V: 3 tiles of 64x64 bf16 = 3 * 8192 bytes, 16 bytes per thread, 128 threads.
    assert row.sass["LDGSTS"] == 12
    assert row.smem_dynamic == 3 * 64 * 64 * 2
    assert row.sass["HGMMA"] == row.sass["UTMALDG"] == row.sass["STSM"] == 0
    assert not row.setmaxnreg


def test_sm90_probe_uses_tma_wgmma_stmatrix_and_setmaxnreg():
    row = audit.audit_target(_probe_target("sm_90a", "probe_sm90_hd64_bf16"))
    assert row.error is None and not row.spills
    # S: 64/16 k-blocks; O: 64/16 k-blocks.
    assert row.sass["HGMMA"] == 8
    assert row.sass["UTMALDG"] == 3 and row.sass["UTMASTG"] == 1
    assert row.sass["STSM"] == 4
    assert row.sass["HMMA"] == row.sass["LDGSTS"] == 0
    assert row.setmaxnreg


def test_sm90_probe_for_sm80_is_a_failed_row():
    target = _probe_target("sm_90a", "probe_sm90_hd64_bf16")
    row = audit.audit_target(audit.AuditTarget(target.name, "sm_80", target.compile))
    assert row.failed and "sm_90" in row.error


@pytest.mark.filterwarnings("ignore:This static loop")
def test_runtime_indexed_array_spills_without_spill_bytes():
    row = audit.audit_target(audit_targets("sm_80")[0])
    assert row.error is None
    assert row.spill_stores == row.spill_loads == 0
    assert row.sass["STL"] > 0 and row.stack_frame > 0
    assert row.spills and row.failed


def test_every_kernel_module_lists_its_targets_for_both_archs():
    for arch in audit.ARCHS:
        targets = audit.collect_targets(arch)
        names = [t.name for _, t in targets]
        assert len(names) == len(set(names)) > 0
        assert all(isinstance(t, audit.AuditTarget) and t.arch == arch for _, t in targets)


def test_sweeps_list_more_configurations_than_the_shipped_sample():
    for arch in audit.ARCHS:
        sweep = [t.name for _, t in audit.collect_targets(arch, sweep=True)]
        for kind in ("fwd_", "bwd_sm80_", "bwd_sm90_"):
            shipped = {t.name for _, t in audit.collect_targets(arch) if t.name.startswith(kind)}
            swept = [name for name in sweep if name.startswith(kind)]
            assert len(swept) == len(set(swept)) >= len(shipped)
        # the forward kernels and the backward main kernels (the sm_90 one for sm_90a only) sweep
        kinds = ("fwd_", "bwd_sm80_") + (("bwd_sm90_",) if arch == "sm_90a" else ())
        assert all(name.startswith(kinds) for name in sweep)
        assert len([n for n in sweep if n.startswith("fwd_")]) > len(
            {t.name for _, t in audit.collect_targets(arch) if t.name.startswith("fwd_")})
    # a module without a sweep contributes nothing to one
    assert audit.collect_targets("sm_80", ["cute_flash.kernels.common.probes"], sweep=True) == []


# ------------------------------------------------------------------------------------------------
# the CLI
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", audit.ARCHS)
def test_cli_audits_the_probes(arch, tmp_path):
    done = _run_cli("--arch", arch, "--module", "cute_flash.kernels.common.probes",
                    "--json", str(tmp_path / "rows.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["name"] for r in rows} == {t.name for t in probes.audit_targets(arch)}
    assert all(r["arch"] == arch and r["error"] is None for r in rows)
    assert "none spills" in done.stdout


def test_cli_fails_on_the_spilling_kernel():
    done = _run_cli("--arch", "sm_80", "--module", "test_audit", pythonpath=str(ROOT / "tests"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SPILLS" in done.stdout and "test_runtime_indexed_array" in done.stderr
