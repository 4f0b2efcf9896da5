"""What every kernel's configuration table shares: padding a head dim up to the next tile, and
the checks every attention kernel configuration starts with."""

from __future__ import annotations


# Static shared memory of every compiled sm_90 kernel (the audit's cuobjdump resource usage of
# every configuration), besides its dynamic `SharedStorage`: a CTA needs both within the limit.
SM90_STATIC_SMEM_BYTES = 1024


def align_up(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


def pad_headdim(d: int, tile_headdims: tuple, error: type = ValueError) -> int:
    """The smallest tile head dim that holds `d` (the columns past `d` are zero-filled on load
    and never stored); `error` is raised, naming `d`, when no tile is large enough."""
    for t in tile_headdims:
        if d <= t:
            return t
    raise error(f"head dim {d} exceeds the largest tile ({tile_headdims[-1]})")


def check_attention_config(config, dtypes: tuple, tile_headdims: tuple) -> None:
    """A kernel config's dtype and tile head dims are ones its table has, and causal and local
    are not both set (raises ValueError naming the field)."""
    if config.dtype not in dtypes:
        raise ValueError(f"dtype must be one of {dtypes}; got {config.dtype!r}")
    for name in ("head_dim", "head_dim_v"):
        if getattr(config, name) not in tile_headdims:
            raise ValueError(f"{name} must be one of {tile_headdims}; got {getattr(config, name)}")
    if config.causal and config.local:
        raise ValueError("causal and local exclude each other (causal is the window (-1, 0))")


# Every copy into or out of a shared-memory tile moves 128 bits per thread per instruction.
COPY_BITS = 128


def swizzle_atom_bytes(elem_bits: int, cols: int) -> int:
    """Bytes in a row of the swizzle atom of a tile whose rows hold `cols` elements: the widest of
    128, 64 and 32 that divides a row."""
    row_bytes = cols * elem_bits // 8
    for atom_bytes in (128, 64, 32):
        if row_bytes % atom_bytes == 0:
            return atom_bytes
    raise ValueError(f"a row of {cols} x {elem_bits}-bit elements is not a multiple of 32 bytes")


def check_row_copy_passes(elem_bits: int, widths: tuple, num_threads: int, rows: dict) -> None:
    """Raise ValueError unless each tile of `rows` ({name: row count}) is a whole number of the
    passes of a `num_threads` 128-bit row copy of rows of each width in `widths` (elements; one
    thread per chunk of an atom row): a tile with fewer rows than a pass, or not a multiple of
    them, would be copied past its end, into whatever shared memory follows it."""
    for cols in widths:
        per_pass = num_threads // (swizzle_atom_bytes(elem_bits, cols) * 8 // COPY_BITS)
        for name, n in rows.items():
            if n % per_pass:
                raise ValueError(f"{name} ({n} rows) is not a whole number of the {per_pass} rows that "
                                 f"{num_threads} threads copy per pass at {cols} columns")


# Lag allowed to a row's exp reference behind its maximum with a lazy rescale (`lazy_rescale` of
# the forward configurations), in log2 units: P <= 2^8 stays exact enough in fp16 / bf16 (as
# flash-attn-4's sm100 kernel does for 16-bit).
LAZY_RESCALE_LOG2 = 8.0
