"""Heat maps of the shared-memory bank of every (row, column) element, layouts side by side.

Each panel is one tile layout: rows down, head-dim columns across, colour = bank (0..31) of the
4-byte word holding the element. An 8x8 `ldmatrix` reads 8 consecutive rows of one 16-byte
column chunk; it is conflict-free when those 8 cells of a chunk column show 8 different colour
groups. Offsets come from evaluating the DSL layouts (`bank_conflicts.byte_offsets`).

    python layouts/swizzle_atlas.py                       # hd 64: unswizzled, ill-fitted, ours
    python layouts/swizzle_atlas.py --layouts ours:16:128 none:16:128 --rows 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import bank_conflicts
from bank_conflicts import BANK_BYTES, BANKS, LayoutSpec

DEFAULT_LAYOUTS = ("none:16:64", "2,3,3:16:64", "ours:16:64")


def parse_layout(text: str) -> LayoutSpec:
    """KIND:BITS:HEAD_DIM[:ATOM_COLS] with KIND = ours | none | B,M,S (a Swizzle<B,M,S>)."""
    kind, bits, head_dim, *atom = text.split(":")
    bits, head_dim = int(bits), int(head_dim)
    if kind == "ours":
        return LayoutSpec(bits, head_dim)
    swizzle = (0, 3, 3) if kind == "none" else tuple(int(x) for x in kind.split(","))
    cols = int(atom[0]) if atom else head_dim
    return LayoutSpec(bits, head_dim, swizzle, (8, cols))


def bank_map(spec: LayoutSpec, rows: int) -> list[list[int]]:
    """Bank of every element of the first `rows` rows."""
    return [[(b // BANK_BYTES) % BANKS for b in row] for row in bank_conflicts.byte_offsets(spec, rows)]


def draw(specs: list[LayoutSpec], rows: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(specs), figsize=(4.2 * len(specs), 0.28 * rows + 1.6),
                             squeeze=False)
    for ax, spec in zip(axes[0], specs):
        banks = bank_map(spec, rows)
        image = ax.imshow(banks, cmap="turbo", vmin=0, vmax=BANKS - 1, aspect="auto",
                          interpolation="nearest")
        chunk = 128 // spec.elem_bits
        for x in range(chunk, spec.head_dim, chunk):
            ax.axvline(x - 0.5, color="black", linewidth=0.4)
        for y in range(8, rows, 8):
            ax.axhline(y - 0.5, color="black", linewidth=1.2)
        name = "unswizzled" if spec.swizzle == (0, 3, 3) else spec.label
        ax.set_title(f"{name}\n{spec.elem_bits}-bit, head dim {spec.head_dim}", fontsize=9)
        ax.set_xlabel("column (element); lines = 16-byte chunks", fontsize=8)
        ax.set_ylabel("row", fontsize=8)
    fig.colorbar(image, ax=axes[0].tolist(), label="bank", fraction=0.02)
    fig.savefig(path, dpi=72, pil_kwargs={"optimize": True})
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="LAYOUT is KIND:BITS:HEAD_DIM[:ATOM_COLS], KIND = ours | none | B,M,S "
               "(Swizzle<B,M,S> over an 8 x ATOM_COLS atom, ATOM_COLS defaulting to HEAD_DIM).",
    )
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), metavar="LAYOUT",
                        help=f"panels, left to right (default: {' '.join(DEFAULT_LAYOUTS)})")
    parser.add_argument("--rows", type=int, default=16, help="rows to draw (default 16)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out",
                        help="output directory (default layouts/out)")
    parser.add_argument("--name", default="swizzle_atlas.png", help="file name of the PNG")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / args.name
    draw([parse_layout(t) for t in args.layouts], args.rows, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
