"""Compiled kernels of the CuTe DSL backends (`cute.py`), and the arguments they are launched with.

Compiled kernels are cached twice:

* in memory, keyed by `(config, arch)`: a frozen dataclass, so every compile-time choice is
  part of the key and nothing else is;
* on disk, under `CUTE_FLASH_CACHE_DIR` (default: `$XDG_CACHE_HOME/cute_flash` or
  `~/.cache/cute_flash`), as the object file the DSL exports, named by the configuration, a
  hash of all its fields, the arch, the DSL version and a hash of the kernel sources, so that a
  new process loads instead of recompiling and an edited kernel never loads a stale binary.

Launch paths. When `apache-tvm-ffi` is importable (a dependency of the package), kernels are
compiled with `--enable-tvm-ffi`: torch tensors and Python scalars go straight to a C entry
point and the stream is the current torch stream (TVM-FFI's environment stream). On an H200 that
halves the host time of a call against the DSL's own Python path (about 300 -> 160 us for a
forward through `cute_flash.forward`), where every tensor is wrapped as a cute tensor
(`from_dlpack`) and the stream is passed explicitly. `CUTE_FLASH_TVM_FFI=0` selects the DSL's
path, `=1` requires TVM-FFI (`KernelArgs`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

_KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"


def cache_dir() -> Path:
    """Where compiled kernels are kept between processes."""
    env = os.environ.get("CUTE_FLASH_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cute_flash"


TVM_FFI_OPTION = "--enable-tvm-ffi"


def tvm_ffi_requested() -> bool:
    """Whether kernels compile and launch through TVM-FFI (see the module docstring): yes when
    `apache-tvm-ffi` is importable, unless `CUTE_FLASH_TVM_FFI=0`; `CUTE_FLASH_TVM_FFI=1`
    makes its absence an error."""
    setting = os.environ.get("CUTE_FLASH_TVM_FFI", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    try:
        import tvm_ffi  # noqa: F401
    except ImportError as exc:
        if setting in ("", "auto"):
            return False
        raise RuntimeError(f"CUTE_FLASH_TVM_FFI={setting} needs the apache-tvm-ffi package ({exc})") from exc
    return True


class KernelArgs:
    """Launch arguments for the kernels of one `KernelCache`, in the form its launch path takes:
    cute tensors, DSL scalars and an explicit stream (the DSL's call path), or torch tensors and
    Python scalars with the stream left to TVM-FFI's environment (kernels compiled with
    `--enable-tvm-ffi`). `None` stays `None` (an absent optional tensor) either way."""

    def __init__(self, tvm_ffi: bool):
        self.tvm_ffi = tvm_ffi

    def tensor(self, t: Optional[torch.Tensor], align: int):
        return t if self.tvm_ffi or t is None else _as_cute(t, align)

    def i32(self, x: int):
        if self.tvm_ffi:
            return int(x)
        from cutlass import Int32

        return Int32(x)

    def f32(self, x: float):
        if self.tvm_ffi:
            return float(x)
        from cutlass import Float32

        return Float32(x)

    def stream(self) -> tuple:
        """The trailing stream argument: none for TVM-FFI (the kernel takes its environment
        stream, which `context` sets), else the current torch stream of the current device."""
        if self.tvm_ffi:
            return ()
        import cuda.bindings.driver as cuda

        return (cuda.CUstream(torch.cuda.current_stream().cuda_stream),)

    @contextlib.contextmanager
    def context(self, device: torch.device):
        """Around a launch: `device` current, and for TVM-FFI its environment stream set to the
        current torch stream (graph capture and side streams included). The device is switched
        only when it is not already the current one (the common case costs no switch)."""
        current = torch.cuda.current_device()
        switch = device.index is not None and device.index != current
        with torch.cuda.device(device) if switch else contextlib.nullcontext():
            if not self.tvm_ffi:
                yield
                return
            import tvm_ffi

            index = device.index if switch else current
            with tvm_ffi.use_raw_stream(_tvm_ffi_device(index), torch.cuda.current_stream().cuda_stream):
                yield


@functools.lru_cache(maxsize=None)
def _tvm_ffi_device(index: int):
    import tvm_ffi

    return tvm_ffi.device(f"cuda:{index}")


def device_arch(device: Optional[torch.device] = None) -> str:
    """The DSL's name for the arch of `device` (sm_80, sm_86, sm_90a, sm_100a, ...)."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _arch_of(index)


@functools.lru_cache(maxsize=None)  # read once per device, not per call
def _arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    # Arch-specific features ("a" targets) exist from sm_90 on; an sm_80 kernel compiled for the
    # local "a" target is still plain cp.async + mma.sync code.
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


@dataclass(frozen=True)
class _CacheKey:
    config: object  # a frozen kernel config dataclass
    arch: str


class KernelCache:
    """Compiled kernels by (config, arch): memory first, then disk, then the compiler.

    `config_module` names the kernel package's config module (its `compile_fwd` builds a
    kernel); `sources` are the folders under `kernels/` whose code the kernels are made of.
    """

    def __init__(self, config_module: str, sources: tuple):
        self.config_module = config_module
        self.sources = sources
        self.tvm_ffi = tvm_ffi_requested()  # fixed for the cache's life: compile and launch agree
        self.args = KernelArgs(self.tvm_ffi)
        self._compiled: dict = {}
        self._lock = threading.Lock()
        self._digest: Optional[str] = None
        self._disk_ok = True

    def _source_digest(self) -> str:
        import cutlass

        digest = hashlib.sha256(str(getattr(cutlass, "__version__", "")).encode())
        for sub in self.sources:
            for path in sorted((_KERNEL_DIR / sub).glob("*.py")):
                digest.update(path.name.encode())
                digest.update(path.read_bytes())
        return digest.hexdigest()[:16]

    def _path(self, key: _CacheKey) -> Path:
        if self._digest is None:
            self._digest = self._source_digest()
        # the name is for people; the hash of every field is what keeps two configs apart
        fields = hashlib.sha256(repr(key.config).encode()).hexdigest()[:12]
        ffi = "-tvmffi" if self.tvm_ffi else ""
        return cache_dir() / f"{key.config.name}-{key.arch}{ffi}-{fields}-{self._digest}.o"

    def get(self, config, arch: str):
        """(compiled function, where it came from: "memory" | "disk" | "compiled")."""
        key = _CacheKey(config, arch)
        with self._lock:
            fn = self._compiled.get(key)
            if fn is not None:
                return fn, "memory"
            fn, source = self._load(key), "disk"
            if fn is None:
                fn, source = self._compile(key), "compiled"
            self._compiled[key] = fn
            return fn, source

    def _load(self, key: _CacheKey):
        path = self._path(key)
        if not path.exists():
            return None
        import cutlass.runtime

        try:
            return getattr(cutlass.runtime.load_module(str(path), enable_tvm_ffi=self.tvm_ffi), "kernel")
        except Exception as exc:  # a corrupt or foreign file: recompile and overwrite it
            warnings.warn(f"cute_flash: ignoring unreadable cached kernel {path}: {exc}", stacklevel=3)
            return None

    def _compile(self, key: _CacheKey):
        options = f"--gpu-arch {key.arch}" + (f" {TVM_FFI_OPTION}" if self.tvm_ffi else "")
        fn = importlib.import_module(self.config_module).compile_fwd(key.config, options)
        if self._disk_ok:
            path = self._path(key)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.mkdir(exist_ok=True)
                if self.tvm_ffi:
                    fn.export_to_c(str(tmp / "kernel.o"), "kernel")
                else:
                    fn.export_to_c(str(tmp), "kernel", "kernel")
                os.replace(tmp / "kernel.o", path)  # atomic: readers never see half a file
                for leftover in tmp.iterdir():
                    leftover.unlink()
                tmp.rmdir()
            except Exception as exc:  # e.g. a read-only cache dir: memory caching still works
                self._disk_ok = False
                warnings.warn(f"cute_flash: not caching kernels on disk ({exc})", stacklevel=3)
        return fn


def _as_cute(t: Optional[torch.Tensor], align: int):
    if t is None:
        return None
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)
