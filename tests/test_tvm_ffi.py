"""The TVM-FFI launch path (the default when apache-tvm-ffi is importable) on the CPU: every kernel
kind compiles with `--enable-tvm-ffi`, goes to the disk cache and comes back as a TVM-FFI
function; the launch arguments take their TVM-FFI form. Launching needs a GPU (tests/gpu run
on whichever path the environment selects)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

from cute_flash.backends import kernel_cache  # noqa: E402


def test_on_when_importable_unless_switched_off(monkeypatch):
    pytest.importorskip("tvm_ffi")
    monkeypatch.delenv("CUTE_FLASH_TVM_FFI", raising=False)
    assert kernel_cache.tvm_ffi_requested()
    monkeypatch.setenv("CUTE_FLASH_TVM_FFI", "1")
    assert kernel_cache.tvm_ffi_requested()
    for off in ("0", "false", "off"):
        monkeypatch.setenv("CUTE_FLASH_TVM_FFI", off)
        assert not kernel_cache.tvm_ffi_requested()


def _without_tvm_ffi(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tvm_ffi(name, *args, **kwargs):
        if name == "tvm_ffi":
            raise ImportError("No module named 'tvm_ffi'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tvm_ffi)


def test_without_the_package_the_dsl_path_is_used(monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_TVM_FFI", raising=False)
    _without_tvm_ffi(monkeypatch)
    assert not kernel_cache.tvm_ffi_requested()


def test_asking_without_the_package_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_TVM_FFI", "1")
    _without_tvm_ffi(monkeypatch)
    with pytest.raises(RuntimeError, match="apache-tvm-ffi"):
        kernel_cache.tvm_ffi_requested()


def test_launch_arguments_in_both_forms():
    t = torch.zeros(2, 8, 4, 16, dtype=torch.float16)
    ffi = kernel_cache.KernelArgs(tvm_ffi=True)
    assert ffi.tensor(t, 16) is t and ffi.tensor(None, 4) is None
    assert ffi.i32(3) == 3 and type(ffi.i32(3)) is int and type(ffi.f32(0.5)) is float
    assert ffi.stream() == ()
    dsl = kernel_cache.KernelArgs(tvm_ffi=False)
    assert dsl.tensor(None, 4) is None and dsl.tensor(t, 16) is not t  # a cute tensor
    from cutlass import Float32, Int32

    assert isinstance(dsl.i32(3), Int32) and isinstance(dsl.f32(0.5), Float32)


KINDS = {
    "sm80_fwd": ("cute_flash.kernels.sm80.fwd_config", "sm_80", lambda m: m.make_config("bfloat16", 64, 64)),
    "sm80_split": ("cute_flash.kernels.sm80.fwd_config", "sm_80",
                   lambda m: m.make_config("float16", 128, 128, causal=True, paged_kv=True, split_kv=True,
                                           has_lse=False)),
    "sm90_fwd": ("cute_flash.kernels.sm90.fwd_config", "sm_90a", lambda m: m.make_config("bfloat16", 128, 128)),
    "combine": ("cute_flash.kernels.combine_config", "sm_80", lambda m: m.make_config("bfloat16", 128, 64)),
    "sm80_bwd": ("cute_flash.kernels.sm80.bwd_config", "sm_80", lambda m: m.make_config("bfloat16", 64, 64)),
    "sm80_bwd_pre": ("cute_flash.kernels.sm80.bwd_config", "sm_80", lambda m: m.make_pre_config("bfloat16", 64, varlen_q=False, has_dlse=True)),
    "sm80_bwd_post": ("cute_flash.kernels.sm80.bwd_config", "sm_80", lambda m: m.make_post_config("bfloat16", 64, varlen_q=True)),
    "sm90_bwd": ("cute_flash.kernels.sm90.bwd_config", "sm_90a", lambda m: m.make_config("bfloat16", 128, 128, causal=True)),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kernel_kind_compiles_caches_on_disk_and_loads(kind, tmp_path, monkeypatch):
    pytest.importorskip("tvm_ffi")
    import importlib

    module, arch, make = KINDS[kind]
    monkeypatch.setenv("CUTE_FLASH_TVM_FFI", "1")
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    config = make(importlib.import_module(module))
    sources = ("common", "sm90") if "sm90" in kind else ("common", "sm80")
    first = kernel_cache.KernelCache(module, sources)
    assert first.tvm_ffi and first.args.tvm_ffi
    fn, source = first.get(config, arch)
    assert source == "compiled"
    files = list(tmp_path.glob("*.o"))
    assert len(files) == 1 and "-tvmffi-" in files[0].name
    fresh = kernel_cache.KernelCache(module, sources)  # a new process, as far as the cache knows
    loaded, source = fresh.get(config, arch)
    assert source == "disk"
    assert type(loaded).__module__.startswith("tvm_ffi")
