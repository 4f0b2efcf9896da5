"""Compile every shipped kernel configuration on the CPU and report what the compiler made of it.

    python -m cute_flash.audit --arch sm_80            # one row per configuration
    python -m cute_flash.audit --arch sm_90a --json audit.json

Each module in `KERNEL_MODULES` exposes `audit_targets(arch) -> list[AuditTarget]`. A target's
`compile(options)` runs `cute.compile` on fake tensors with the options string it is given; the
audit adds the arch, keeps the cubin and asks ptxas for its resource report, then reads:

* ptxas remarks: registers, stack frame, spill stores and loads (bytes);
* `cuobjdump --dump-resource-usage` on the cubin: registers, static shared memory, stack;
* the host code's launch: dynamic shared memory (the DSL allocates shared memory dynamically);
* `nvdisasm` SASS: counts of the instructions that show whether the layouts and atoms became
  what was meant (HMMA/HGMMA, LDSM/STSM, LDGSTS, UTMALDG/UTMASTG) and whether anything went to
  local memory (LDL/STL), plus the presence of USETMAXREG (setmaxnreg).

A configuration "spills" if ptxas reports spill bytes or the SASS touches local memory at all:
a register array indexed at run time lives in local memory without any spill being reported.
The exit status is 1 if any configuration spills or fails to compile.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Optional

ARCHS = ("sm_80", "sm_90a")

# Modules whose `audit_targets(arch)` list the configurations the package ships.
KERNEL_MODULES = [
    "cute_flash.kernels.common.probes",
    "cute_flash.kernels.sm80.fwd_config",
    "cute_flash.kernels.sm90.fwd_config",
    "cute_flash.kernels.sm80.bwd_config",
    "cute_flash.kernels.sm90.bwd_config",
    "cute_flash.kernels.combine_config",
]

# SASS opcodes counted per configuration (the part before the first '.').
COUNTED_SASS = ("HMMA", "HGMMA", "LDSM", "STSM", "LDGSTS", "UTMALDG", "UTMASTG", "LDL", "STL")
LOCAL_MEMORY_SASS = ("LDL", "STL")


@dataclass(frozen=True)
class AuditTarget:
    """One kernel configuration: a name, the arch it is built for, and how to build it."""

    name: str  # e.g. "sm80_fwd_hd128_bf16_causal"
    arch: str  # "sm_80" or "sm_90a"
    compile: Callable[[str], object]  # cute.compile options string -> compiled object


def distinct(configs) -> list:
    """The configurations in their order, each name once: a sweep's grid of calls maps many calls
    to one configuration."""
    out = {}
    for config in configs:
        out.setdefault(config.name, config)
    return list(out.values())


def targets(arch: str, configs, compile_config: Callable) -> list:
    """One `AuditTarget` per kernel configuration, built by `compile_config(config, options)`."""
    return [AuditTarget(config.name, arch, partial(compile_config, config)) for config in configs]


@dataclass
class AuditRow:
    """What the compiler made of one target (None where a tool could not tell)."""

    name: str
    arch: str
    registers: Optional[int] = None
    spill_stores: Optional[int] = None  # bytes
    spill_loads: Optional[int] = None  # bytes
    stack_frame: Optional[int] = None  # bytes
    smem_static: Optional[int] = None  # bytes
    smem_dynamic: Optional[int] = None  # bytes, requested by the launch
    sass: dict = field(default_factory=dict)
    setmaxnreg: bool = False
    compile_s: float = 0.0
    error: Optional[str] = None

    @property
    def spills(self) -> bool:
        """Spill bytes reported by ptxas, or any local-memory instruction in the SASS."""
        return bool(
            (self.spill_stores or 0)
            or (self.spill_loads or 0)
            or any(self.sass.get(op, 0) for op in LOCAL_MEMORY_SASS)
        )

    @property
    def failed(self) -> bool:
        return self.error is not None or self.spills


# ------------------------------------------------------------------------------------------------
# tools
# ------------------------------------------------------------------------------------------------
def find_tool(name: str) -> Optional[str]:
    """`nvdisasm` / `cuobjdump`: on PATH, else from the nvidia-cuda-* wheels."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob(f"*/bin/{name}")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def _run(tool: str, *args: str) -> str:
    path = find_tool(tool)
    if path is None:
        raise FileNotFoundError(f"{tool} not found: pip install nvidia-cuda-{tool}")
    return subprocess.run([path, *args], capture_output=True, text=True, check=True).stdout


# ------------------------------------------------------------------------------------------------
# parsers (plain text in, numbers out; tested on the tools' real output)
# ------------------------------------------------------------------------------------------------
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_remarks(text: str) -> dict:
    """Registers, stack frame and spill bytes from ptxas's report (maxima over functions)."""
    out = {}
    frames = [tuple(map(int, m)) for m in _PTXAS_FRAME.findall(text)]
    if frames:
        out["stack_frame"] = max(f[0] for f in frames)
        out["spill_stores"] = sum(f[1] for f in frames)
        out["spill_loads"] = sum(f[2] for f in frames)
    regs = [int(r) for r in _PTXAS_REGS.findall(text)]
    if regs:
        out["registers"] = max(regs)
    return out


_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_resource_usage(text: str) -> dict:
    """`cuobjdump --dump-resource-usage`: registers, stack and static shared memory."""
    rows = [tuple(map(int, m)) for m in _RESOURCE.findall(text)]
    if not rows:
        return {}
    return {
        "registers": max(r[0] for r in rows),
        "stack_frame": max(r[1] for r in rows),
        "smem_static": max(r[2] for r in rows),
    }


_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)")


def count_sass(text: str) -> Counter:
    """Opcode counts (without modifiers) of `nvdisasm -c` output."""
    return Counter(_SASS_LINE.findall(text))


# The launch configuration the host code fills: (grid, block, dynamic smem bytes, stream, ...).
_LAUNCH_SMEM_SLOT = re.compile(
    r"(%\w+) = llvm\.getelementptr %\w+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, "
    r"!llvm\.struct<\(array<3 x i32>, array<3 x i32>, i64,"
)


def parse_launch_smem(host_ir: str) -> Optional[int]:
    """Dynamic shared memory bytes of the kernel launch(es) in the host code, if constant."""
    sizes = []
    for slot in _LAUNCH_SMEM_SLOT.findall(host_ir):
        store = re.search(rf"llvm\.store (%\w+), {re.escape(slot)} : i64", host_ir)
        if store is None:
            continue
        value = re.search(
            rf"{re.escape(store.group(1))} = llvm\.mlir\.constant\((\d+) : i64\)", host_ir
        )
        if value is not None:
            sizes.append(int(value.group(1)))
    return max(sizes) if sizes else None


# ------------------------------------------------------------------------------------------------
# auditing one target
# ------------------------------------------------------------------------------------------------
def compile_options(arch: str, dump_dir: Path) -> str:
    """The options string a target's `compile` receives."""
    return (
        f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir {dump_dir} "
        f"--remark-output {dump_dir / 'remarks.yaml'} remarks{{ptx}}"
    )


def _error_line(exc: Exception) -> str:
    """The first line of a compile error, without the DSL's terminal colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}"[:300]


def audit_target(target: AuditTarget, keep_dir: Optional[Path] = None) -> AuditRow:
    """Compile `target` and read registers, spills, shared memory and the SASS mix.

    With `keep_dir`, the cubin, PTX, SASS and ptxas report stay in `keep_dir/<name>/`.
    """
    row = AuditRow(target.name, target.arch)
    with tempfile.TemporaryDirectory(prefix="cute_flash_audit_") as tmp:
        work = Path(keep_dir) / target.name if keep_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            compiled = target.compile(compile_options(target.arch, work))
        except Exception as exc:  # a configuration that does not compile is a finding
            row.error = _error_line(exc)
            return row
        finally:
            row.compile_s = round(time.perf_counter() - start, 2)
        cubin = work / "kernel.cubin"
        cubin.write_bytes(compiled.artifacts.CUBIN)
        remarks = work / "remarks.yaml"
        if remarks.exists():
            for key, value in parse_ptxas_remarks(remarks.read_text()).items():
                setattr(row, key, value)
        usage = parse_resource_usage(_run("cuobjdump", "--dump-resource-usage", str(cubin)))
        row.smem_static = usage.get("smem_static")
        for key in ("registers", "stack_frame"):
            if getattr(row, key) is None:
                setattr(row, key, usage.get(key))
        row.smem_dynamic = parse_launch_smem(str(compiled.ir_module))
        sass = _run("nvdisasm", "-c", str(cubin))
        if keep_dir:
            (work / "kernel.sass").write_text(sass)
        counts = count_sass(sass)
        row.sass = {op: counts.get(op, 0) for op in COUNTED_SASS}
        row.setmaxnreg = counts.get("USETMAXREG", 0) > 0
    return row


# ------------------------------------------------------------------------------------------------
# auditing many (a process pool: compiles are CPU-bound and independent)
# ------------------------------------------------------------------------------------------------
def _module_targets(module: str, arch: str, sweep: bool) -> list:
    """A module's `audit_targets(arch)`, or with `sweep` its `sweep_targets(arch)` (none where it
    has no sweep)."""
    mod = importlib.import_module(module)
    if sweep:
        return mod.sweep_targets(arch) if hasattr(mod, "sweep_targets") else []
    return mod.audit_targets(arch)


def collect_targets(arch: str, modules=None, sweep: bool = False) -> list[tuple[str, AuditTarget]]:
    """(module name, target) for every target the modules list for `arch` (`sweep`: the flag
    combinations of their sweeps instead of the shipped sample)."""
    out = []
    for module in modules or KERNEL_MODULES:
        for target in _module_targets(module, arch, sweep):
            out.append((module, target))
    return out


def _source_digest() -> str:
    """Hash of the package sources and the DSL version: the key under which rows are cached."""
    import cutlass

    digest = hashlib.sha256(getattr(cutlass, "__version__", "").encode())
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _audit_by_name(module: str, name: str, arch: str, keep_dir: Optional[str],
                   cache_dir: Optional[str], sweep: bool = False) -> dict:
    """Worker: find the target again by name (targets hold closures, which do not pickle)."""
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    cache_file = None
    if cache_dir:
        cache_file = Path(cache_dir) / f"{arch}-{name}-{_source_digest()}.json"
        if cache_file.exists():
            return json.loads(cache_file.read_text())
    target = next(t for t in _module_targets(module, arch, sweep) if t.name == name)
    row = asdict(audit_target(target, Path(keep_dir) if keep_dir else None))
    if cache_file is not None and row["error"] is None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(row))
    return row


def audit(arch: str, modules=None, jobs: Optional[int] = None, name_filter: str = "",
          keep_dir: Optional[Path] = None, cache_dir: Optional[Path] = None, sweep: bool = False) -> list[AuditRow]:
    """Audit every target of `modules` (default `KERNEL_MODULES`) for `arch`, in parallel
    (`sweep`: their sweeps' flag combinations instead)."""
    targets = [(m, t) for m, t in collect_targets(arch, modules, sweep) if name_filter in t.name]
    args = [(m, t.name, arch, str(keep_dir) if keep_dir else None,
             str(cache_dir) if cache_dir else None, sweep) for m, t in targets]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(args)))
    if jobs == 1:
        rows = [_audit_by_name(*a) for a in args]
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            rows = list(pool.map(_audit_by_name, *zip(*args)))
    return [AuditRow(**r) for r in rows]


def format_rows(rows: list[AuditRow]) -> str:
    """A fixed-width table, one line per configuration."""
    header = ["config", "arch", "regs", "spill st/ld", "stack", "smem", *COUNTED_SASS,
              "setmaxnreg", "s", "status"]

    def cells(r: AuditRow) -> list[str]:
        if r.error:
            return [r.name, r.arch] + [""] * (len(header) - 4) + [f"{r.compile_s}", r.error]
        smem = (r.smem_static or 0) + (r.smem_dynamic or 0)
        return [
            r.name, r.arch, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
            str(r.stack_frame), str(smem), *(str(r.sass.get(op, 0)) for op in COUNTED_SASS),
            "yes" if r.setmaxnreg else "no", f"{r.compile_s}", "SPILLS" if r.spills else "ok",
        ]

    table = [header] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in table
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cute_flash.audit",
        description="Compile every shipped kernel configuration for an arch on the CPU and report "
                    "registers, spills, shared memory and the SASS instruction mix. Exit status 1 "
                    "if any configuration spills (or touches local memory) or fails to compile.",
    )
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--jobs", type=int, help="parallel compiles (default: CPU count)")
    parser.add_argument("--filter", default="", help="only configurations whose name contains this")
    parser.add_argument("--module", action="append",
                        help="audit this module's audit_targets instead of KERNEL_MODULES "
                             "(repeatable)")
    parser.add_argument("--keep", type=Path, help="keep cubin, PTX, SASS and ptxas report here")
    parser.add_argument("--cache", type=Path,
                        help="reuse rows cached here for unchanged sources and DSL version")
    parser.add_argument("--sweep", action="store_true",
                        help="compile the configurations make_config gives over a grid of call flags "
                             "(the forward and backward kernels' `sweep_targets`: several hundred, "
                             "slow) instead of the shipped sample")
    args = parser.parse_args(argv)

    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    rows = audit(args.arch, args.module, args.jobs, args.filter, args.keep, args.cache, args.sweep)
    if not rows:
        print(f"no configuration to audit for {args.arch}", file=sys.stderr)
        return 1
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    failed = [r.name for r in rows if r.failed]
    if failed:
        print(f"\n{len(failed)} of {len(rows)} configurations spill or fail: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    print(f"\n{len(rows)} configurations, none spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
