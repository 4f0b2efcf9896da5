"""Shared-memory wavefronts per warp instruction, for every access the kernels make to a tile.

The layouts are the kernels' own (`cute_flash.kernels.common.smem_layouts`) or a swizzle given on
the command line; the thread-to-address maps are the DSL's own tiled copies (the ones the kernels
issue), partitioned over an identity tensor while a `@cute.jit` function is traced on the CPU.
Nothing here restates a swizzle formula: every byte address comes from evaluating a DSL layout.

Bank model: 32 banks of 4 bytes. A warp instruction is split into phases of 128 bytes of
requests (8 lanes for 128-bit accesses and for each 8x8 matrix of ldmatrix/stmatrix, 32 lanes for
32-bit accesses); a phase takes as many wavefronts as the largest number of distinct 4-byte words
that fall into one bank, and ideally one.

    python layouts/bank_conflicts.py                      # our layouts, every head dim, 16 and 8 bit
    python layouts/bank_conflicts.py --swizzle 0,3,3 --atom 8x64 --head-dims 64   # unswizzled
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from cute_flash.kernels.common import smem_layouts  # noqa: E402

BANKS = 32
BANK_BYTES = 4
PHASE_BYTES = BANKS * BANK_BYTES

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
ELEM_BITS = (16, 8)


@dataclass(frozen=True)
class Access:
    """One kind of warp instruction that touches a tile in shared memory."""

    key: str
    instruction: str
    tile: str
    elem_bits: tuple[int, ...]


# 8-bit tiles are only filled and drained by 128-bit row copies: the fp8 MMAs (WGMMA) read shared
# memory through descriptors, not through warp load instructions.
ACCESSES = (
    Access("g2s", "cp.async 128-bit write", "Q, K, V", (16, 8)),
    Access("ldsm_q", "ldmatrix.x4", "Q (A of Q·Kᵀ)", (16,)),
    Access("ldsm_k", "ldmatrix.x4", "K (B of Q·Kᵀ)", (16,)),
    Access("ldsm_vt", "ldmatrix.x4.trans", "V (B of P·V)", (16,)),
    Access("sts_o", "st.shared.b32 from the accumulator", "O (sm_80 epilogue)", (16,)),
    Access("stsm_o", "stmatrix.x4 from the accumulator", "O (sm_90 epilogue)", (16,)),
    Access("lds_o", "ld.shared 128-bit", "O (to global)", (16, 8)),
)


@dataclass(frozen=True)
class LayoutSpec:
    """A tile layout to analyse: the kernels' own (no swizzle given) or Swizzle<B,M,S> o atom."""

    elem_bits: int
    head_dim: int
    swizzle: Optional[tuple[int, int, int]] = None
    atom: Optional[tuple[int, int]] = None  # (rows, cols) of the swizzled atom; default (8, head_dim)
    threads_per_row: Optional[int] = None  # row copies' threads per row; default the kernels'

    @property
    def label(self) -> str:
        if self.swizzle is None:
            p = smem_layouts.swizzle_params(self.elem_bits, self.head_dim)
            name = f"ours S<{p.bits},{p.base},{p.shift}> {p.atom_rows}x{p.atom_cols}"
        else:
            rows, cols = self.atom or (8, self.head_dim)
            name = "S<{},{},{}> {}x{}".format(*self.swizzle, rows, cols)
        if self.threads_per_row is not None:
            name += f" tpr={self.threads_per_row}"
        return name

    def accesses(self) -> list[Access]:
        return [a for a in ACCESSES if self.elem_bits in a.elem_bits]


@dataclass(frozen=True)
class AccessResult:
    """Wavefronts of every warp instruction one access pattern issues over a whole tile."""

    elem_bits: int
    head_dim: int
    layout: str
    access: str
    instructions: int
    wavefronts: int
    ideal: int

    @property
    def conflicted(self) -> bool:
        return self.wavefronts > self.ideal


def _dtype(elem_bits: int):
    return {16: cutlass.BFloat16, 8: cutlass.Float8E4M3FN}[elem_bits]


def _tile_layout(spec: LayoutSpec, rows: int):
    """(rows, head_dim) layout and its (head_dim, rows) transposed view (trace time)."""
    if spec.swizzle is None:
        return (
            smem_layouts.smem_layout_tile(spec.elem_bits, rows, spec.head_dim),
            smem_layouts.smem_layout_transposed(spec.elem_bits, rows, spec.head_dim),
        )
    atom_rows, atom_cols = spec.atom or (8, spec.head_dim)
    atom = cute.make_composed_layout(
        cute.make_swizzle(*spec.swizzle),
        0,
        cute.make_layout((atom_rows, atom_cols), stride=(atom_cols, 1)),
    )
    tile = cute.tile_to_shape(atom, (rows, spec.head_dim), (0, 1))
    transposed = cute.composition(
        tile, cute.make_layout((spec.head_dim, rows), stride=(rows, 1))
    )
    return tile, transposed


def _row_copy(op, spec: LayoutSpec, num_threads: int):
    return smem_layouts.make_row_tiled_copy(
        op, _dtype(spec.elem_bits), spec.head_dim, num_threads, spec.threads_per_row
    )


def _tiled_copy(key: str, spec: LayoutSpec, tiled_mma, num_threads: int):
    """The tiled copy of one access and whether it writes (partition_D) or reads (partition_S)."""
    dtype = _dtype(spec.elem_bits)
    if key == "g2s":
        return _row_copy(cpasync.CopyG2SOp(), spec, num_threads), True
    if key == "lds_o":
        return _row_copy(cute.nvgpu.CopyUniversalOp(), spec, num_threads), False
    if key == "ldsm_q":
        atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), dtype)
        return cute.make_tiled_copy_A(atom, tiled_mma), False
    if key == "ldsm_k":
        atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), dtype)
        return cute.make_tiled_copy_B(atom, tiled_mma), False
    if key == "ldsm_vt":
        atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), dtype)
        return cute.make_tiled_copy_B(atom, tiled_mma), False
    if key == "sts_o":
        atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=2 * spec.elem_bits
        )
        return cute.make_tiled_copy_C(atom, tiled_mma), True
    if key == "stsm_o":
        atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), dtype)
        return cute.make_tiled_copy_C(atom, tiled_mma), True
    raise ValueError(f"unknown access {key!r}")


class _ChunkAddresses:
    """Byte address of any element of a layout, the layout evaluated once per 16-byte chunk.

    `axis` is the coordinate along which the tile is contiguous in global memory (the head dim).
    For each chunk touched, the first and last elements are evaluated; unless they are 15 bytes
    apart the chunk is not contiguous in shared memory and no 128-bit access could read it.
    """

    def __init__(self, layout, axis: int, elem_bits: int):
        self.layout, self.axis = layout, axis
        self.elem_bytes = elem_bits // 8
        self.chunk = smem_layouts.COPY_BITS // elem_bits
        self.starts: dict = {}

    def __call__(self, coord: tuple) -> int:
        position = coord[self.axis] % self.chunk
        start = tuple(x - position if i == self.axis else x for i, x in enumerate(coord))
        if start not in self.starts:
            end = tuple(x + self.chunk - 1 if i == self.axis else x for i, x in enumerate(start))
            first, last = self.layout(start), self.layout(end)
            if last - first != self.chunk - 1:
                raise ValueError(f"16-byte chunk at {start} is not contiguous in shared memory")
            self.starts[start] = first * self.elem_bytes
        return self.starts[start] + position * self.elem_bytes

    def same_chunk(self, a: tuple, b: tuple) -> bool:
        return all(
            x // self.chunk == y // self.chunk if i == self.axis else x == y
            for i, (x, y) in enumerate(zip(a, b))
        )


def _record_addresses(spec: LayoutSpec, rows: int, num_warps: int, sink: dict) -> None:
    """Fill `sink[access]` with, per warp instruction, each lane's (byte address, bytes).

    Each thread's partition of an identity tensor gives the tile coordinates it touches, in the
    order the copy issues them: the first values of mode 0 are one copy-atom call (one warp
    instruction), the remaining values enumerate the further calls. Partitions of different
    threads share one layout and differ only by their origin, so that layout is evaluated once.
    The tile layout then maps each coordinate to its place in shared memory. Plain Python run
    while `_trace_addresses` is traced, so its loops and checks are ordinary Python.
    """
    num_threads = num_warps * 32
    elem_bytes = spec.elem_bits // 8
    tile, transposed = _tile_layout(spec, rows)
    tile_addresses = _ChunkAddresses(tile, 1, spec.elem_bits)
    transposed_addresses = _ChunkAddresses(transposed, 0, spec.elem_bits)
    tiled_mma = cute.make_tiled_mma(
        warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)),
        (num_warps, 1, 1),
        permutation_mnk=(num_warps * 16, 16, 16),
    )
    for access in spec.accesses():
        tiled_copy, writes = _tiled_copy(access.key, spec, tiled_mma, num_threads)
        if access.key == "ldsm_vt":
            address, shape = transposed_addresses, (spec.head_dim, rows)
        else:
            address, shape = tile_addresses, (rows, spec.head_dim)
        coords = cute.make_identity_tensor(shape)
        atom_tv = tiled_copy.layout_dst_tv if writes else tiled_copy.layout_src_tv
        values = cute.size(atom_tv, mode=[1])
        parts = []
        for tid in range(num_threads):
            thr_copy = tiled_copy.get_slice(tid)
            parts.append(thr_copy.partition_D(coords) if writes else thr_copy.partition_S(coords))
        part_layout = parts[0].layout
        if any(str(p.layout) != str(part_layout) for p in parts):
            raise ValueError(f"{access.key}: thread partitions differ in more than their origin")
        steps = [part_layout(i) for i in range(cute.size(part_layout))]

        per_thread = []
        for part in parts:
            addresses = []
            for i in range(0, len(steps), values):
                first, last = (
                    tuple(o + s for o, s in zip(part.iterator, steps[j]))
                    for j in (i, i + values - 1)
                )
                if not address.same_chunk(first, last):
                    raise ValueError(f"{access.key}: one access spans two 16-byte chunks")
                addresses.append((address(first), values * elem_bytes))
            per_thread.append(addresses)
        instructions = []
        for w in range(num_warps):
            lanes = per_thread[32 * w: 32 * w + 32]
            instructions.extend([lane[i] for lane in lanes] for i in range(len(lanes[0])))
        sink[access.key] = instructions


@cute.jit
def _trace_addresses(spec: cutlass.Constexpr, rows: cutlass.Constexpr,
                     num_warps: cutlass.Constexpr, sink: cutlass.Constexpr):
    """Layouts and tiled copies exist only while a `@cute.jit` function is traced."""
    _record_addresses(spec, rows, num_warps, sink)


def _record_offsets(spec: LayoutSpec, rows: int, sink: list) -> None:
    tile, _ = _tile_layout(spec, rows)
    elem_bytes = spec.elem_bits // 8
    sink.extend([tile((r, c)) * elem_bytes for c in range(spec.head_dim)] for r in range(rows))


@cute.jit
def _trace_offsets(spec: cutlass.Constexpr, rows: cutlass.Constexpr, sink: cutlass.Constexpr):
    _record_offsets(spec, rows, sink)


def byte_offsets(spec: LayoutSpec, rows: int) -> list[list[int]]:
    """Byte offset in shared memory of every (row, column) element of the first `rows` rows."""
    sink: list = []
    _trace_offsets(spec, rows, sink)
    return sink


def wavefronts(lanes: list[tuple[int, int]]) -> tuple[int, int]:
    """(wavefronts, ideal) of one warp instruction given each lane's (byte address, bytes)."""
    per_lane = lanes[0][1]
    lanes_per_phase = max(1, PHASE_BYTES // per_lane)
    actual = ideal = 0
    for start in range(0, len(lanes), lanes_per_phase):
        words_in_bank = defaultdict(set)
        for address, size in lanes[start: start + lanes_per_phase]:
            for word in range(address // BANK_BYTES, (address + size - 1) // BANK_BYTES + 1):
                words_in_bank[word % BANKS].add(word)
        distinct_words = sum(len(w) for w in words_in_bank.values())
        actual += max(len(w) for w in words_in_bank.values())
        ideal += math.ceil(distinct_words * BANK_BYTES / PHASE_BYTES)
    return actual, ideal


def lane_addresses(spec: LayoutSpec, rows: int = 64, num_warps: int = 4) -> dict:
    """Per access key, the list of warp instructions, each a list of 32 (address, bytes)."""
    sink: dict = {}
    _trace_addresses(spec, rows, num_warps, sink)
    return sink


def analyze(spec: LayoutSpec, rows: int = 64, num_warps: int = 4) -> list[AccessResult]:
    """Wavefronts against the ideal for every access pattern of `spec`'s tile."""
    results = []
    for key, instructions in lane_addresses(spec, rows, num_warps).items():
        counts = [wavefronts(lanes) for lanes in instructions]
        results.append(AccessResult(
            elem_bits=spec.elem_bits,
            head_dim=spec.head_dim,
            layout=spec.label,
            access=key,
            instructions=len(instructions),
            wavefronts=sum(c[0] for c in counts),
            ideal=sum(c[1] for c in counts),
        ))
    return results


def kernel_layout_specs(elem_bits=ELEM_BITS, head_dims=HEAD_DIMS) -> list[LayoutSpec]:
    """Every tile layout the kernels ship."""
    return [LayoutSpec(bits, hd) for bits in elem_bits for hd in head_dims]


def format_table(results: list[AccessResult]) -> str:
    """One line per layout, one column per access: wavefronts/ideal, `!` marks a conflict."""
    keys = [a.key for a in ACCESSES if any(r.access == a.key for r in results)]
    by_layout: dict = defaultdict(dict)
    for r in results:
        by_layout[(r.elem_bits, r.head_dim, r.layout)][r.access] = r
    header = ["bits", "hdim", "layout"] + keys
    lines = []
    for (bits, hd, label), row in by_layout.items():
        cells = [str(bits), str(hd), label]
        for key in keys:
            r = row.get(key)
            cells.append("-" if r is None else f"{r.wavefronts}/{r.ideal}{'!' if r.conflicted else ''}")
        lines.append(cells)
    widths = [max(len(c) for c in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*cells) for cells in lines]
    return "\n".join(out)


def _parse_ints(text: str, sep: str = ",") -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(sep))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n".join(
            f"  {a.key:8} {a.instruction} ({a.tile})" for a in ACCESSES
        ) + "\n\nCells read wavefronts/ideal summed over the tile; '!' marks bank conflicts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--elem-bits", default="16,8", help="element widths (default 16,8)")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)),
                        help="head dims, i.e. tile columns (default all shipped)")
    parser.add_argument("--swizzle", help="B,M,S of a Swizzle<B,M,S> to study instead of ours")
    parser.add_argument("--atom", help="ROWSxCOLS of the swizzled atom (with --swizzle; "
                                       "default 8xHEAD_DIM)")
    parser.add_argument("--threads-per-row", type=int,
                        help="threads per tile row in the 128-bit row copies (default: ours)")
    parser.add_argument("--rows", type=int, default=64, help="tile rows (default 64)")
    parser.add_argument("--warps", type=int, default=4, help="warps in the CTA (default 4)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out",
                        help="directory for bank_conflicts.json (default layouts/out)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any access has more wavefronts than ideal")
    args = parser.parse_args(argv)

    swizzle = _parse_ints(args.swizzle) if args.swizzle else None
    atom = _parse_ints(args.atom, "x") if args.atom else None
    results = []
    for bits in _parse_ints(args.elem_bits):
        for hd in _parse_ints(args.head_dims):
            spec = LayoutSpec(bits, hd, swizzle, atom, args.threads_per_row)
            results += analyze(spec, args.rows, args.warps)
    print(format_table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bank_conflicts.json"
    path.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"\nwrote {path}")
    if args.check and any(r.conflicted for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
