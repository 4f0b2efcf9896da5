"""Thread-value layouts of the MMA atoms, and why P can stay in registers.

An MMA's TV layout says which thread holds which value (register) of each operand tile. After
S = Q·Kᵀ, every thread holds its part of the S accumulator; the next MMA, O = P·V, wants P as
its A operand. If the thread that holds S[m, n] is also the thread that needs A[m, k = n], in the
same register order, P is converted to 16 bits in place and fed to the MMA with no shuffle and no
trip through shared memory. This script evaluates the DSL's own TV layouts and checks exactly that
for the two atoms the kernels use:

* mma.sync m16n8k16 (sm_80): the C fragments of two neighbouring n8 tiles are one k16 A fragment;
* WGMMA 64xNx16 (sm_90): the C fragment of columns 16j..16j+15 is the register-sourced A
  fragment of k-block j.

    python layouts/tv_layouts.py            # text to stdout, tv_layouts.png in layouts/out
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# WGMMA atoms can only be built while tracing for sm_90a; nothing here is compiled or run.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup  # noqa: E402


@dataclass(frozen=True)
class TvGrid:
    """Which (thread, value) holds each element of an operand tile (rows x cols)."""

    title: str
    layout: str  # the DSL's TV layout, as it prints
    owner: tuple  # owner[row][col] = (thread, value)

    @property
    def rows(self) -> int:
        return len(self.owner)

    @property
    def cols(self) -> int:
        return len(self.owner[0])


def _grid(title: str, tv, rows: int, cols: int) -> TvGrid:
    """Invert a TV layout ((thread, value) -> column-major index in the tile) into a grid."""
    owner = [[None] * cols for _ in range(rows)]
    threads, values = cute.size(tv, mode=[0]), cute.size(tv, mode=[1])
    for t in range(threads):
        for v in range(values):
            index = tv((t, v))
            owner[index % rows][index // rows] = (t, v)
    return TvGrid(title, str(tv), tuple(tuple(r) for r in owner))


def _record(sink: dict) -> None:
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    # One warp of the sm_80 kernel's MMA, N permuted to 16 so a C tile spans two n8 atoms.
    sm80 = cute.make_tiled_mma(warp.MmaF16BF16Op(bf16, f32, (16, 8, 16)), (1, 1, 1),
                               permutation_mnk=(16, 16, 16))
    sink["sm80_C"] = _grid("m16n8k16: S accumulator (16 x 16, two n8 tiles)",
                           sm80.tv_layout_C_tiled, 16, 16)
    sink["sm80_A"] = _grid("m16n8k16: A operand of P·V (16 x k16)", sm80.tv_layout_A_tiled, 16, 16)
    k_major = OperandMajorMode.K
    qk = sm90_utils.make_trivial_tiled_mma(bf16, bf16, k_major, k_major, f32, (1, 1, 1), (64, 16))
    pv = sm90_utils.make_trivial_tiled_mma(bf16, bf16, k_major, OperandMajorMode.MN, f32,
                                           (1, 1, 1), (64, 16),
                                           a_source=warpgroup.OperandSource.RMEM)
    sink["sm90_C"] = _grid("WGMMA 64x16x16: S accumulator (64 x 16)", qk.tv_layout_C_tiled, 64, 16)
    sink["sm90_A"] = _grid("WGMMA 64xNx16, A from registers (64 x k16)",
                           pv.tv_layout_A_tiled, 64, 16)


@cute.jit
def _trace(sink: cutlass.Constexpr):
    _record(sink)


def tv_grids() -> dict:
    """The four grids: sm80_C, sm80_A, sm90_C, sm90_A."""
    sink: dict = {}
    _trace(sink)
    return sink


def register_reuse(acc: TvGrid, operand: TvGrid) -> dict:
    """For every A value, the accumulator value at the same (row, col): {A value: C value}.

    Raises if any element of A lives in a different thread than the same element of C (then P
    would have to move between threads), or if the value correspondence differs between threads.
    """
    mapping: dict = {}
    for row in range(operand.rows):
        for col in range(operand.cols):
            (t_a, v_a), (t_c, v_c) = operand.owner[row][col], acc.owner[row][col]
            if t_a != t_c:
                raise ValueError(f"({row}, {col}): A in thread {t_a}, C in thread {t_c}")
            if mapping.setdefault(v_a, v_c) != v_c:
                raise ValueError(f"A value {v_a} maps to C values {mapping[v_a]} and {v_c}")
    return dict(sorted(mapping.items()))


def format_grid(grid: TvGrid, rows: int) -> str:
    """The first `rows` rows of the grid, each cell T<thread>:<value>."""
    cells = [[f"T{t}:{v}" for t, v in grid.owner[r]] for r in range(rows)]
    width = max(len(c) for line in cells for c in line)
    shown = "" if rows == grid.rows else f" (first {rows} of {grid.rows} rows)"
    lines = [f"{grid.title}{shown}\n  TV layout {grid.layout}"]
    lines += ["  " + " ".join(c.rjust(width) for c in line) for line in cells]
    return "\n".join(lines)


def report(grids: dict) -> str:
    out = []
    for arch, rows in (("sm80", 16), ("sm90", 8)):
        acc, operand = grids[f"{arch}_C"], grids[f"{arch}_A"]
        out.append(format_grid(acc, rows))
        out.append(format_grid(operand, rows))
        pairs = ", ".join(f"a{v_a}<-c{v_c}" for v_a, v_c in register_reuse(acc, operand).items())
        out.append(f"  same thread for every element; A register <- C register: {pairs}\n")
    return "\n\n".join(out)


def draw(grids: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("sm80_C", 16), ("sm80_A", 16), ("sm90_C", 16), ("sm90_A", 16)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 5.0))
    colours = plt.get_cmap("tab20")
    for ax, (key, rows) in zip(axes, panels):
        grid = grids[key]
        for r in range(rows):
            for c in range(grid.cols):
                t, v = grid.owner[r][c]
                ax.add_patch(plt.Rectangle((c, r), 1, 1, color=colours(t % 20), alpha=0.55))
                ax.text(c + 0.5, r + 0.5, f"T{t}\nv{v}", ha="center", va="center", fontsize=5)
        ax.set_xlim(0, grid.cols)
        ax.set_ylim(rows, 0)
        ax.set_xticks(range(0, grid.cols + 1, 8))
        ax.set_yticks(range(0, rows + 1, 8))
        ax.set_aspect("equal")
        suffix = "" if rows == grid.rows else f"\n(rows 0-{rows - 1} of {grid.rows}: warp 0)"
        ax.set_title(grid.title + suffix, fontsize=9)
    fig.suptitle("Same thread, same register order: the S accumulator is the A operand of P·V",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=64, pil_kwargs={"optimize": True})
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out",
                        help="output directory for tv_layouts.txt and tv_layouts.png "
                             "(default layouts/out)")
    parser.add_argument("--no-png", action="store_true", help="text only")
    args = parser.parse_args(argv)

    grids = tv_grids()
    text = report(grids)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tv_layouts.txt").write_text(text + "\n")
    if not args.no_png:
        draw(grids, args.out / "tv_layouts.png")
    print(f"wrote {args.out / 'tv_layouts.txt'}" + ("" if args.no_png else " and tv_layouts.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
