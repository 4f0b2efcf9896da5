"""The one definition of every swizzled shared-memory layout the kernels use.

Q, K, V and O tiles are row-major (rows = tokens, columns = head dim) in global memory and are
copied into shared memory 128 bits per thread. A row-major tile read by `ldmatrix` (8 rows of 16
bytes per 8x8 matrix) would put all 8 rows in the same 4 banks whenever the row pitch is a
multiple of 128 bytes; the swizzle XORs the 16-byte chunk index with the row index inside an
atom of 8 rows so that those 8 reads land in 8 different chunk positions of the 128-byte bank
window.

The atom is as wide as the largest of 128, 64 or 32 bytes that divides a row, and a tile is the
atom repeated down the rows first, then across the columns: a head dim of 96 (192-byte rows) is
three 64-byte-wide panels, each rows x 64 bytes. Copies that fill or drain a tile 128 bits per
thread must therefore put one thread on each 16-byte chunk of an atom row
(`row_copy_threads_per_row`): a quarter-warp then writes 128 contiguous bytes of one panel. With
one thread per chunk of a whole 192-byte row, a quarter-warp would straddle two panels whose rows
start at the same bank and take two wavefronts (see `layouts/bank_conflicts.py`).

On sm_90 the WGMMA and TMA units read the same bytes through their canonical layout atoms, whose
swizzle acts on byte addresses (`wgmma_smem_layout_atom`); for every width the byte placement is
identical to `smem_layout_atom`'s, which a test checks.

`swizzle_params` and `row_copy_threads_per_row` are plain Python (usable anywhere); the other
functions build DSL objects and must be called while a `@cute.jit` function is being traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from .tiles import COPY_BITS, swizzle_atom_bytes


@dataclass(frozen=True)
class SwizzleParams:
    """Swizzle<bits, base, shift> over an atom of (8, atom_cols) elements."""

    bits: int
    base: int
    shift: int
    atom_rows: int
    atom_cols: int


def swizzle_params(elem_bits: int, cols: int) -> SwizzleParams:
    """Swizzle atom for a tile whose rows hold `cols` elements of `elem_bits` bits."""
    if elem_bits not in (8, 16, 32):
        raise ValueError(f"elem_bits must be 8, 16 or 32, got {elem_bits}")
    elems_per_chunk = COPY_BITS // elem_bits  # elements in one 16-byte chunk
    base = elems_per_chunk.bit_length() - 1  # log2(elements per chunk)
    atom_bytes = swizzle_atom_bytes(elem_bits, cols)
    bits = {128: 3, 64: 2, 32: 1}[atom_bytes]
    atom_cols = atom_bytes * 8 // elem_bits
    # The XOR source is the index of the 128-byte line (8 chunks of 16 bytes): shift 3 above
    # the chunk bits, whatever the atom width, so that rows sharing a line index never collide.
    return SwizzleParams(bits=bits, base=base, shift=3, atom_rows=8, atom_cols=atom_cols)


def row_copy_threads_per_row(elem_bits: int, cols: int) -> int:
    """Threads along a row in a 128-bit-per-thread copy of a tile: one per chunk of an atom row."""
    p = swizzle_params(elem_bits, cols)
    return p.atom_cols * elem_bits // COPY_BITS


def smem_layout_atom(elem_bits: int, cols: int):
    """The swizzled (8, atom_cols) atom for rows of `cols` elements (trace time only)."""
    p = swizzle_params(elem_bits, cols)
    return cute.make_composed_layout(
        cute.make_swizzle(p.bits, p.base, p.shift),
        0,
        cute.make_layout((p.atom_rows, p.atom_cols), stride=(p.atom_cols, 1)),
    )


def smem_layout_tile(elem_bits: int, rows: int, cols: int, stages: int = 1, atom_cols_of: Optional[int] = None):
    """A (rows, cols) tile, or (rows, cols, stages) for a multi-buffered ring (trace time only).

    `atom_cols_of`: take the atom of rows of that many elements instead of `cols`, for a tile
    made of column tiles of that width (a divisor of `cols`): each is then `rows * atom_cols_of`
    consecutive elements laid out as `smem_layout_tile(elem_bits, rows, atom_cols_of)`.
    """
    atom = smem_layout_atom(elem_bits, atom_cols_of or cols)
    if stages == 1:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def smem_layout_transposed(elem_bits: int, rows: int, cols: int, stages: int = 1):
    """The (cols, rows[, stages]) view of `smem_layout_tile`: Vᵀ, the B operand of P·V.

    Same bytes as the tile; `ldmatrix.trans` reads it 16 contiguous bytes of a V row per thread.
    """
    tile = smem_layout_tile(elem_bits, rows, cols, stages)
    if stages == 1:
        return cute.composition(tile, cute.make_layout((cols, rows), stride=(rows, 1)))
    return cute.composition(
        tile, cute.make_layout((cols, rows, stages), stride=(rows, 1, rows * cols))
    )


def make_row_tiled_copy(op, dtype: Type[cutlass.Numeric], cols: int, num_threads: int,
                        threads_per_row: Optional[int] = None):
    """A 128-bit-per-thread copy of a (rows, cols) tile, threads laid along rows.

    `op` is `cpasync.CopyG2SOp()` to fill a tile from global memory, or
    `cute.nvgpu.CopyUniversalOp()` for the epilogue's shared-to-global pass; both touch shared
    memory with the thread arrangement that keeps each quarter-warp on one 128-byte line.
    `threads_per_row` overrides that arrangement, for experiments (`layouts/bank_conflicts.py`).
    """
    per_row = threads_per_row or row_copy_threads_per_row(dtype.width, cols)
    if num_threads % per_row:
        raise ValueError(f"{num_threads} threads do not tile rows of {per_row} chunks")
    threads = cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1))
    values = cute.make_layout((1, COPY_BITS // dtype.width))
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=COPY_BITS)
    return cute.make_tiled_copy_tv(atom, threads, values)


_WGMMA_ATOM_KIND = {
    128: warpgroup.SmemLayoutAtomKind.K_SW128,
    64: warpgroup.SmemLayoutAtomKind.K_SW64,
    32: warpgroup.SmemLayoutAtomKind.K_SW32,
}


def wgmma_smem_layout_atom(dtype: Type[cutlass.Numeric], cols: int):
    """The K-major WGMMA/TMA atom for rows of `cols` elements (trace time only).

    Its swizzle acts on byte addresses: allocate with the layout's `outer` and pass its `inner`
    as the pointer swizzle. The atom kind follows `swizzle_params`, so the bytes are the same.
    """
    atom_bytes = swizzle_params(dtype.width, cols).atom_cols * dtype.width // 8
    return warpgroup.make_smem_layout_atom(_WGMMA_ATOM_KIND[atom_bytes], dtype)


def wgmma_smem_layout_tile(dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: int = 1):
    """`wgmma_smem_layout_atom` tiled like `smem_layout_tile` (trace time only)."""
    atom = wgmma_smem_layout_atom(dtype, cols)
    if stages == 1:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))
