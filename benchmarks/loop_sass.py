"""The sm_90 forward's key-block loop in SASS: its instruction count and mix, next to flash-attn-4's.

    python benchmarks/loop_sass.py --head-dim 128                 # cute_flash's shipped kernel (CPU)
    python benchmarks/loop_sass.py --head-dim 64 --causal --fa4   # and flash-attn-4's, compiled here too
    python benchmarks/loop_sass.py --head-dim 128 --kernel sm80   # the sm_80 forward's (mma.sync) loop
    python benchmarks/loop_sass.py --head-dim 128 --causal --kernel bwd --fa4   # the backward's step
    python benchmarks/loop_sass.py --head-dim 128 --kernel bwd --set ds_kmajor=1     # a configuration flag set

Both kernels are compiled for sm_90a on this machine (no GPU needed): cute_flash's shipped
configuration (`make_config`, without the K/V clusters), and with `--fa4` flash-attn-4's
`flash_attn_func` under torch's FakeTensorMode with its documented CPU-compile settings
(FLASH_ATTENTION_ARCH, CUTE_DSL_ARCH, FLASH_ATTENTION_NUM_SMS; set before the DSL is imported,
so run it as a script of its own). The key-block loop is the
smallest loop of the SASS (a branch back to an earlier label) that holds one key block's GEMMs,
S = Q K^T and O += P V: exactly head_dim / 16 + tile_n / 16 HGMMAs (the causal loop over the
diagonal's blocks with `masked_halves` holds the 64-key GEMMs as well, so it is not the one). Printed: the loop's instruction
count and opcode mix, and the instructions of one trip around it along each path through it
(a branch inside it, such as the lazy rescale's skip of O's FMULs, makes two): what one warp
issues per key block. The tiles are the same at head dim 64 (192 x 128); at 128 ours takes 192 x 80
against flash-attn-4's 128 x 128.

With `--kernel bwd` it prints the sm_90 backward main kernel's step instead: the loop over the
query blocks, which holds every HGMMA of the kernel (S^T, dP^T, dV, dK and dQ of one block), and
with `--fa4` flash-attn-4's backward (`_flash_attn_bwd`, 2 x 8192) beside it; the tiles are the
same at head dim 64 (128 x 128) and at 128 causal (64 x 128; without a mask flash-attn-4 takes 80
query rows). A branch with a second predicate (`@P0 BRA P1, ...`, the backward's masked-block
test) forks the path like any predicated one.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timeline_lib import apply_overrides, parse_overrides  # noqa: E402

_LABEL = re.compile(r"^(\.L_x_\d+):")
_INST = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;?\s*$")
_BRANCH = re.compile(r"BRA (?:!?U?P\w+, )?`\((\.L_x_\d+)\)")  # `BRA P1, ...`: a second predicate
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
# opcodes whose second part says what they are (the rest are counted by their first part)
_TWO_PART = ("FMNMX", "F2FP", "HGMMA", "MUFU")


def instructions(sass: str) -> tuple[list, dict]:
    """(instructions in order, label -> index of the instruction after it) of `nvdisasm -c` text."""
    insts, labels = [], {}
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = _INST.match(line)
        if m:
            insts.append(m.group(1))
    return insts, labels


def _loop_span(insts: list, labels: dict, gemm_instructions: int, gemm_op: str = "HGMMA") -> tuple[int, int]:
    """(first, last) instruction of the smallest loop holding exactly `gemm_instructions` HGMMAs (a
    loop with more holds other GEMM variants too, such as `masked_halves`' 64-key ones); `gemm_op`
    "HMMA" for the sm_80 kernels' mma.sync."""
    loops = []
    for end, inst in enumerate(insts):
        m = _BRANCH.search(inst)
        start = labels.get(m.group(1)) if m else None
        if start is not None and start <= end:
            if sum(gemm_op in x for x in insts[start:end + 1]) == gemm_instructions:
                loops.append((end - start, start, end))
    if not loops:
        raise ValueError(f"no loop with {gemm_instructions} {gemm_op}s in the SASS")
    _, start, end = min(loops)
    return start, end


def key_block_loop(sass: str, gemm_instructions: int) -> list:
    """The smallest loop holding exactly `gemm_instructions` HGMMAs: its instructions, every
    path through it included (see `path_lengths`)."""
    return analyse(sass, gemm_instructions)[0]


def path_lengths(sass: str, gemm_instructions: int, most: int = 64) -> list:
    """`analyse`'s instructions per trip along each path of the loop."""
    return analyse(sass, gemm_instructions, most)[1]


def analyse(sass: str, gemm_instructions: int, most: int = 64, gemm_op: str = "HGMMA") -> tuple[list, list]:
    """The smallest loop holding `gemm_instructions` HGMMAs (`gemm_op`: see `_loop_span`), and the
    instructions issued by one trip around it along each of its paths (sorted, distinct):
    a predicated branch forward inside the loop forks the path (ptxas may duplicate code on both
    sides, so the loop's length overstates a trip), a branch out of it or back inside it is taken
    as not taken (the slow paths of a barrier wait; a loop inside it runs once), and the loop's
    own branch back ends the trip. Returns (the loop's instructions, those lengths)."""
    insts, labels = instructions(sass)
    start, end = _loop_span(insts, labels, gemm_instructions, gemm_op)
    lengths, todo = set(), [(start, 0)]
    while todo and len(lengths) < most:
        pos, count = todo.pop()
        while True:
            count += 1
            if pos == end:
                lengths.add(count)
                break
            m = _BRANCH.search(insts[pos])
            target = labels.get(m.group(1)) if m else None
            if target is None or not pos < target <= end:
                # no branch, one out of the loop, or the branch back of a loop inside it: go on
                pos += 1
            elif _PREDICATE.match(insts[pos].strip()):
                todo.append((target, count))
                pos += 1
            else:
                pos = target
    return insts[start:end + 1], sorted(lengths)


def mix(body: list) -> collections.Counter:
    """Opcode counts (predicates dropped; FMNMX.NAN, F2FP.BF16, HGMMA.64x128x16, MUFU.EX2 kept apart)."""
    counts = collections.Counter()
    for inst in body:
        op = _PREDICATE.sub("", inst).split()[0]
        parts = op.split(".")
        counts[".".join(parts[:2]) if parts[0] in _TWO_PART else parts[0]] += 1
    return counts


def gemm_count(config, kernel: str = "sm90") -> int:
    """The GEMM instructions of one key block in `config`'s loop: HGMMAs (one per 16 of the head
    dim and of the key tile) for the sm_90 forward, a warp's m16n8k16 HMMAs (its rows of S = Q K^T
    and of O += P V) for the sm_80 one."""
    if kernel == "sm90":
        return config.head_dim // 16 + config.tile_n // 16
    rows = config.tile_m // config.num_warps
    return rows // 16 * (config.tile_n // 8 * config.head_dim // 16 + config.head_dim_v // 8 * config.tile_n // 16)


def _fwd_config(kernel: str):
    import importlib

    return importlib.import_module(f"cute_flash.kernels.{kernel}.fwd_config")


def shipped_config(head_dim: int, causal: bool, kernel: str = "sm90"):
    """The shipped bf16 configuration of the sm_90 (without the K/V clusters) or sm_80 forward."""
    return _fwd_config(kernel).make_config("bfloat16", head_dim, head_dim, causal=causal)


def _compiled_sass(name: str, compile_config) -> str:
    """The SASS of `compile_config(options)` compiled for sm_90a through the audit (`name`: the
    directory its files are kept in while read)."""
    from cute_flash.audit import AuditTarget, audit_target

    with tempfile.TemporaryDirectory() as tmp:
        row = audit_target(AuditTarget(name, "sm_90a", compile_config), keep_dir=Path(tmp))
        if row.error:
            raise RuntimeError(row.error)
        return (Path(tmp) / name / "kernel.sass").read_text()


def cute_flash_sass(head_dim: int, causal: bool, kernel: str = "sm90") -> tuple[str, str, int]:
    """(name, SASS, the GEMM instructions of one key block) of `shipped_config`, compiled for
    sm_90a (the sm_80 kernel as the H200 runs it)."""
    compile_fwd = _fwd_config(kernel).compile_fwd
    config = shipped_config(head_dim, causal, kernel)
    return config.name, _compiled_sass(config.name, lambda opts: compile_fwd(config, opts)), gemm_count(config, kernel)


def _fa4_sass(call) -> list:
    """The SASS of every kernel flash-attn-4 compiles while `call(fa4_interface, torch)` runs under
    torch's FakeTensorMode, compiled for sm_90a here (`FA4_CPU_ENV` set before the DSL is first
    imported). The fake call's launch fails once its kernels are compiled; a call that compiled
    none raises with that failure."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flash_attn.cute.interface as fa4
    from cute_flash.audit import _run

    compiled, failure = [], None
    with tempfile.TemporaryDirectory() as tmp:
        plain = fa4.cute.compile

        def keeping(*args, options="", **kwargs):
            out = plain(*args, options=f"{options} --gpu-arch sm_90a --keep-cubin --dump-dir {tmp}", **kwargs)
            compiled.append(out)
            return out

        fa4.cute.compile = keeping
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                try:
                    call(fa4, torch)
                except Exception as exc:  # the launch of a fake call; the kernels are compiled by then
                    failure = exc
        finally:
            fa4.cute.compile = plain
        if not compiled:
            raise RuntimeError(f"flash-attn-4 compiled no kernel ({type(failure).__name__}: {failure})")
        sass = []
        for i, kernel in enumerate(compiled):
            cubin = Path(tmp) / f"fa4_{i}.cubin"
            cubin.write_bytes(kernel.artifacts.CUBIN)
            sass.append(_run("nvdisasm", "-c", str(cubin)))
        return sass


def fa4_sass(head_dim: int, causal: bool) -> tuple[str, str, int]:
    """flash-attn-4's sm_90 forward for bf16 8 x 2048 x (2048 / head_dim) heads, compiled here,
    with the HGMMAs of one key block on its own tile (`_tile_size_fwd_sm90`'s)."""
    def call(fa4, torch):
        q = torch.empty(8, 2048, 2048 // head_dim, head_dim, dtype=torch.bfloat16, device="cuda")
        fa4.flash_attn_func(q, q, q, causal=causal)

    sass = _fa4_sass(call)[-1]  # imports flash_attn.cute once FA4_CPU_ENV is set
    from flash_attn.cute.interface import _tile_size_fwd_sm90

    tile_n = _tile_size_fwd_sm90(head_dim, head_dim, causal, False).n_block_size
    return "flash-attn-4 FlashAttentionForwardSm90", sass, head_dim // 16 + tile_n // 16


def cute_flash_bwd_sass(head_dim: int, causal: bool, overrides: dict) -> tuple[str, str, int]:
    """(name, SASS, its HGMMA count) of the shipped bf16 sm_90 backward main kernel (with
    `overrides` of its flags, as `bwd_timeline.py --set` takes them), for sm_90a."""
    from cute_flash.kernels.sm90 import bwd_config

    config = apply_overrides(bwd_config.make_config("bfloat16", head_dim, head_dim, causal=causal), overrides)
    sass = _compiled_sass(config.name, lambda opts: bwd_config.compile_kernel(config, opts))
    return config.name, sass, all_gemms(sass)


def fa4_bwd_sass(head_dim: int, causal: bool) -> tuple[str, str, int]:
    """flash-attn-4's sm_90 backward main kernel for bf16 2 x 8192 x (2048 / head_dim) heads,
    compiled here: of the kernels its `_flash_attn_bwd` compiles (preprocess, main,
    postprocess), the one with HGMMAs."""
    def call(fa4, torch):
        heads = 2048 // head_dim
        q = torch.empty(2, 8192, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(2, heads, 8192, dtype=torch.float32, device="cuda")
        fa4._flash_attn_bwd(q, q, q, q, q, lse, causal=causal)

    kernels = _fa4_sass(call)
    main = [sass for sass in kernels if "HGMMA" in sass]
    if not main:
        raise RuntimeError(f"flash-attn-4 compiled no backward main kernel ({len(kernels)} kernels)")
    return "flash-attn-4 FlashAttentionBackwardSm90", main[0], all_gemms(main[0])


def all_gemms(sass: str) -> int:
    """Every HGMMA of a kernel: the backward's step loop holds them all."""
    return sum("HGMMA" in inst for inst in instructions(sass)[0])


# flash-attn-4's settings for compiling without a GPU; the DSL reads CUTE_DSL_ARCH when first imported
FA4_CPU_ENV = {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 96, 128))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--fa4", action="store_true", help="flash-attn-4's loop too (needs flash_attn.cute and einops)")
    p.add_argument("--kernel", choices=("sm90", "sm80", "bwd"), default="sm90",
                   help="which cute_flash kernel: the sm_90 forward, the sm_80 one (the mma.sync kernel, compiled "
                        "for sm_90a as the H200 runs it), or the sm_90 backward's main kernel")
    p.add_argument("--set", dest="overrides", type=parse_overrides, default={},
                   help="configuration flags of the backward to override, e.g. ds_kmajor=1 (--kernel bwd)")
    args = p.parse_args(argv)
    if args.fa4 and args.kernel == "sm80":
        p.error("--fa4 compares against the sm_90 kernels (--kernel sm90 or bwd)")
    if args.overrides and args.kernel != "bwd":
        p.error("--set overrides the backward's configuration (--kernel bwd)")
    if args.fa4:
        for key, value in FA4_CPU_ENV.items():
            os.environ.setdefault(key, value)

    if args.kernel == "bwd":
        sources = [lambda hd, causal: cute_flash_bwd_sass(hd, causal, args.overrides)] + ([fa4_bwd_sass] if args.fa4 else [])
        gemm_op, loop = "HGMMA", "the step loop (one query block)"
    else:
        gemm_op = "HGMMA" if args.kernel == "sm90" else "HMMA"
        sources = [lambda hd, causal: cute_flash_sass(hd, causal, args.kernel)] + ([fa4_sass] if args.fa4 else [])
        loop = "the key-block loop"
    rows = []
    for source in sources:
        name, sass, gemms = source(args.head_dim, args.causal)
        body, paths = analyse(sass, gemms, gemm_op=gemm_op)
        rows.append((name, len(body), paths, mix(body)))
    ops = sorted({op for *_, m in rows for op in m}, key=lambda op: -max(m[op] for *_, m in rows))
    print(f"hd{args.head_dim} {'causal' if args.causal else 'no mask'}: {loop}'s instructions "
          "(all of them; per trip along each path) and its opcodes (all of them)")
    for i, (name, n, paths, _) in enumerate(rows):
        print(f"  [{i}] {n:5d}  per trip {'/'.join(map(str, paths))}  {name}")
    print(f"{'opcode':>16}" + "".join(f"{f'[{i}]':>8}" for i in range(len(rows))))
    for op in ops:
        print(f"{op:>16}" + "".join(f"{m[op]:>8}" for *_, m in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
