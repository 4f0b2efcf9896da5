"""The shared-memory layouts the kernels use are conflict-free, and the analyzer can tell.

Every number here comes from DSL layouts and tiled copies traced on the CPU (layouts/); the
known-bad layouts must come out conflicted, or a passing table would prove nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"
sys.path.insert(0, str(LAYOUTS))

import bank_conflicts  # noqa: E402
import swizzle_atlas  # noqa: E402
from bank_conflicts import LayoutSpec, analyze, wavefronts  # noqa: E402

from cute_flash.kernels.common import smem_layouts  # noqa: E402

KERNEL_SPECS = bank_conflicts.kernel_layout_specs()


def _by_access(results) -> dict:
    return {r.access: r for r in results}


# ------------------------------------------------------------------------------------------------
# the bank model itself, on hand-made lane addresses
# ------------------------------------------------------------------------------------------------
def test_wavefront_model_counts_words_per_bank():
    # 8 lanes x 16 bytes on one 128-byte line: one wavefront per quarter-warp phase.
    line = [(16 * i, 16) for i in range(8)] * 4
    assert wavefronts(line) == (4, 4)
    # 8 lanes reading 16 bytes at a 128-byte pitch: all in banks 0-3, eight wavefronts.
    column = [(128 * i, 16) for i in range(8)]
    assert wavefronts(column) == (8, 1)
    # 32 lanes x 4 bytes, same address: a broadcast, one wavefront.
    assert wavefronts([(64, 4)] * 32) == (1, 1)
    # 32 lanes x 4 bytes at an 8-byte pitch: 128 bytes asked for, two words per bank.
    assert wavefronts([(8 * i, 4) for i in range(32)]) == (2, 1)
    # 32 lanes x 4 bytes at a 128-byte pitch: 32 words in bank 0.
    assert wavefronts([(128 * i, 4) for i in range(32)]) == (32, 1)


def test_ldmatrix_lanes_address_the_rows_the_ptx_manual_assigns():
    # ldmatrix.x4 for the A operand: lanes 0-15 give rows 0-15 at k 0, lanes 16-31 at k 8.
    spec = LayoutSpec(16, 64)
    first = bank_conflicts.lane_addresses(spec)["ldsm_q"][0]
    offsets = bank_conflicts.byte_offsets(spec, 16)
    assert first == [(offsets[lane % 16][8 * (lane // 16)], 16) for lane in range(32)]


# ------------------------------------------------------------------------------------------------
# the layouts the kernels ship
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=lambda s: f"{s.elem_bits}bit_hd{s.head_dim}")
def test_kernel_layout_is_conflict_free_for_every_access(spec):
    results = analyze(spec)
    assert {r.access for r in results} == {a.key for a in spec.accesses()}
    for r in results:
        assert r.instructions > 0
        assert r.wavefronts == r.ideal, f"{r.access}: {r.wavefronts} wavefronts, ideal {r.ideal}"


def test_swizzle_choice_per_width_and_head_dim():
    chosen = {
        (bits, hd): (p.bits, p.base, p.shift, p.atom_cols)
        for bits in (16, 8)
        for hd in bank_conflicts.HEAD_DIMS
        for p in [smem_layouts.swizzle_params(bits, hd)]
    }
    assert chosen == {
        (16, 32): (2, 3, 3, 32), (16, 64): (3, 3, 3, 64), (16, 96): (2, 3, 3, 32),
        (16, 128): (3, 3, 3, 64), (16, 192): (3, 3, 3, 64), (16, 256): (3, 3, 3, 64),
        (8, 32): (1, 4, 3, 32), (8, 64): (2, 4, 3, 64), (8, 96): (1, 4, 3, 32),
        (8, 128): (3, 4, 3, 128), (8, 192): (2, 4, 3, 64), (8, 256): (3, 4, 3, 128),
    }
    assert [smem_layouts.row_copy_threads_per_row(16, hd) for hd in (32, 64, 96, 128)] == [4, 8, 4, 8]


# ------------------------------------------------------------------------------------------------
# known-bad layouts: the analyzer must fail them
# ------------------------------------------------------------------------------------------------
def test_unswizzled_hd64_is_reported_conflicted():
    # 128-byte rows: the 8 rows of every 8x8 matrix fall into the same four banks.
    results = _by_access(analyze(LayoutSpec(16, 64, swizzle=(0, 3, 3), atom=(8, 64))))
    for key in ("ldsm_q", "ldsm_k", "ldsm_vt", "sts_o", "stsm_o"):
        assert results[key].wavefronts == 8 * results[key].ideal, key
    # Row copies write whole lines, swizzled or not.
    assert not results["g2s"].conflicted and not results["lds_o"].conflicted


@pytest.mark.parametrize("swizzle", [(2, 3, 3), (3, 3, 4)], ids=["too_few_bits", "256B_line"])
def test_ill_fitted_swizzle_hd64_is_reported_conflicted(swizzle):
    # Swizzle<2,3,3> permutes only 4 chunk positions; Swizzle<3,3,4> XORs with the index of a
    # 256-byte line, fitted to 256-byte rows: either way two of eight rows share banks.
    results = _by_access(analyze(LayoutSpec(16, 64, swizzle=swizzle, atom=(8, 64))))
    for key in ("ldsm_q", "ldsm_k", "ldsm_vt", "sts_o", "stsm_o"):
        assert results[key].wavefronts == 2 * results[key].ideal, key


def test_hd64_swizzle_on_unpaneled_hd128_rows_is_reported_conflicted():
    # The hd-64 atom stretched over a 256-byte row: the XOR source skips every other row.
    results = _by_access(analyze(LayoutSpec(16, 128, swizzle=(3, 3, 3), atom=(8, 128))))
    assert results["ldsm_q"].wavefronts == 2 * results["ldsm_q"].ideal


def test_row_copy_across_hd96_panels_is_reported_conflicted():
    # One thread per chunk of a whole 192-byte row: a quarter-warp straddles two 64-byte
    # panels whose rows start in the same banks.
    spec = LayoutSpec(16, 96, threads_per_row=12)
    results = _by_access(analyze(spec, rows=48, num_warps=3))
    assert results["g2s"].conflicted and results["lds_o"].conflicted
    assert not _by_access(analyze(LayoutSpec(16, 96), rows=48, num_warps=3))["g2s"].conflicted


def test_check_option_fails_on_a_conflicted_layout(tmp_path, capsys):
    bad = ["--elem-bits", "16", "--head-dims", "64", "--swizzle", "0,3,3", "--atom", "8x64"]
    assert bank_conflicts.main(bad + ["--check", "--out", str(tmp_path)]) == 1
    assert "512/64!" in capsys.readouterr().out
    ours = ["--elem-bits", "16", "--head-dims", "64"]
    assert bank_conflicts.main(ours + ["--check", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bank_conflicts.json").exists()


# ------------------------------------------------------------------------------------------------
# one definition: views and sm_90 atoms place the same bytes
# ------------------------------------------------------------------------------------------------
def _byte_maps(sink: list, elem_bits: int, dtype, rows: int, cols: int) -> None:
    bytes_per = elem_bits // 8
    tile = smem_layouts.smem_layout_tile(elem_bits, rows, cols)
    transposed = smem_layouts.smem_layout_transposed(elem_bits, rows, cols)
    wgmma = smem_layouts.wgmma_smem_layout_tile(dtype, rows, cols)
    # The WGMMA atom's swizzle acts on byte addresses of the pointer, after the outer layout.
    byte_swizzle = cute.make_composed_layout(wgmma.inner, 0, cute.make_layout(rows * cols * 4))
    for r in range(rows):
        for c in range(cols):
            sink.append((
                tile((r, c)) * bytes_per,
                transposed((c, r)) * bytes_per,
                byte_swizzle(wgmma.outer((r, c)) * bytes_per),
            ))


@cute.jit
def _trace_byte_maps(sink: cutlass.Constexpr, elem_bits: cutlass.Constexpr, dtype: cutlass.Constexpr,
                     rows: cutlass.Constexpr, cols: cutlass.Constexpr):
    _byte_maps(sink, elem_bits, dtype, rows, cols)


@pytest.mark.parametrize("elem_bits,dtype", [(16, cutlass.BFloat16), (8, cutlass.Float8E4M3FN)],
                         ids=["16bit", "8bit"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_transposed_view_and_wgmma_atom_place_the_same_bytes(elem_bits, dtype, head_dim):
    sink: list = []
    _trace_byte_maps(sink, elem_bits, dtype, 16, head_dim)
    mismatched = [i for i, (tile, transposed, wgmma) in enumerate(sink)
                  if not tile == transposed == wgmma]
    assert not mismatched, f"{len(mismatched)} elements differ, first at {divmod(mismatched[0], head_dim)}"


# ------------------------------------------------------------------------------------------------
# the scripts
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [bank_conflicts, swizzle_atlas], ids=lambda m: m.__name__)
def test_script_has_help(script, capsys):
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_swizzle_atlas_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert swizzle_atlas.main(["--rows", "8", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "swizzle_atlas.png").read_bytes()[:4] == b"\x89PNG"


def test_tv_layouts_show_the_accumulator_is_the_next_a_operand(tmp_path):
    # A subprocess: the script traces WGMMA atoms, which needs the sm_90a arch set before import.
    help_text = subprocess.run([sys.executable, str(LAYOUTS / "tv_layouts.py"), "--help"],
                               capture_output=True, text=True)
    assert help_text.returncode == 0 and "--out" in help_text.stdout
    done = subprocess.run(
        [sys.executable, str(LAYOUTS / "tv_layouts.py"), "--no-png", "--out", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    identity = ", ".join(f"a{i}<-c{i}" for i in range(8))
    assert done.stdout.count(f"A register <- C register: {identity}") == 2
