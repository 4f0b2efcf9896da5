"""The backend chosen at import, the override, the placeholders, info and the demo."""

import subprocess
import sys

import pytest
import torch

import cute_flash
from cute_flash import backends


@pytest.fixture
def platform(monkeypatch):
    """Pretend to be on another platform: (hip version, cuda available, capability)."""

    def set_platform(hip=None, cuda=False, capability=(0, 0)):
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
        monkeypatch.delenv("CUTE_FLASH_BACKEND", raising=False)

    return set_platform


def test_no_gpu_chooses_reference(platform):
    platform()
    assert backends._choose().name == "reference"


def test_rocm_chooses_triton(platform):
    platform(hip="6.2.0", cuda=True)
    choice = backends._choose()
    assert choice.name == "triton" and "ROCm" in choice.reason


def test_sm80_chooses_cute_sm80(platform):
    platform(cuda=True, capability=(8, 0))
    assert backends._choose().name == "cute-sm80"


def test_sm86_chooses_cute_sm80(platform):
    platform(cuda=True, capability=(8, 6))
    assert backends._choose().name == "cute-sm80"


def test_sm90_chooses_cute_sm90(platform):
    platform(cuda=True, capability=(9, 0))
    assert backends._choose().name == "cute-sm90"


def test_newer_arch_without_sm90a_path_chooses_cute_sm80(platform):
    platform(cuda=True, capability=(10, 0))
    assert backends._choose().name == "cute-sm80"


def test_pre_ampere_gpu_falls_back_to_reference(platform):
    platform(cuda=True, capability=(7, 5))
    choice = backends._choose()
    assert choice.name == "reference" and "older than sm_80" in choice.reason


def test_environment_override(platform, monkeypatch):
    platform(cuda=True, capability=(8, 0))
    monkeypatch.setenv("CUTE_FLASH_BACKEND", "reference")
    choice = backends._choose()
    assert choice.name == "reference" and "CUTE_FLASH_BACKEND" in choice.reason


def test_environment_override_rejects_unknown_names(platform, monkeypatch):
    platform()
    monkeypatch.setenv("CUTE_FLASH_BACKEND", "flash2")
    with pytest.raises(ValueError, match="CUTE_FLASH_BACKEND"):
        backends._choose()


def test_cpu_tensors_always_run_on_reference():
    assert backends.resolve(None, torch.device("cpu")).name == "reference"
    assert backends.resolve("triton", torch.device("cpu")).name == "reference"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
@pytest.mark.parametrize("name", ["cute-sm80", "cute-sm90"])
def test_cute_backends_say_why_they_cannot_run_without_a_gpu(name):
    assert "NVIDIA GPU" in backends.get_backend(name).unavailable_reason()


def test_backend_info_reports_choice_versions_and_features():
    info = cute_flash.backend_info()
    assert info["backend"] in backends.BACKEND_NAMES and info["reason"]
    assert info["versions"]["torch"] == torch.__version__
    assert all(info["features"]["reference"].values())
    for name, features in info["features"].items():
        assert {f for f, on in features.items() if on} == set(backends.get_backend(name).features)


def test_info_module_prints_the_matrix():
    res = subprocess.run([sys.executable, "-m", "cute_flash.info"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "backend:" in res.stdout and "paged_kv" in res.stdout and "reference" in res.stdout


def test_demo_runs_on_the_cpu():
    res = subprocess.run(
        [sys.executable, "-m", "cute_flash", "--seqlen", "256", "--nheads", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "backend reference" in res.stdout and "TFLOP/s" in res.stdout
    err = float(res.stdout.split("reference(float64)| = ")[1].split()[0])
    assert err < 1e-2


def test_backward_without_a_kernel_for_the_call_runs_on_the_reference():
    from cute_flash import api
    from cute_flash.backends.base import AttnArgs

    def call(name, **args):
        return api.Call(args=AttnArgs(0.1, **args), backend=backends.get_backend(name), out_shape=(), lse_shape=(), batch=1)

    def chosen(name, d=64, deterministic=False, **args):
        q = torch.empty(1, 4, 2, d, dtype=torch.float16)
        return api.backward_backend(call(name, **args), q, q, q, deterministic).name

    for name in ("cute-sm80", "cute-sm90"):  # cute-sm90 runs its backward on the sm_80 kernels
        assert chosen(name) == name and chosen(name, d=128) == name
        assert chosen(name, d=128, causal=True, deterministic=True) == name
        assert chosen(name, d=256) == name  # the sm_80 backward kernel's column tiles
        assert chosen(name, d=264) == "reference"  # no tile that wide
    assert chosen("triton") == "triton" and chosen("triton", deterministic=True) == "triton"
    with pytest.raises(NotImplementedError, match="paged"):
        chosen("reference", page_table=torch.zeros(1, 1, dtype=torch.int32))


def test_tile_counters_are_kept_for_the_most_recent_streams_only(monkeypatch):
    """One zeroed counter per (device, stream), reused on that stream; past `MAX_TILE_COUNTERS`
    streams the one that launched longest ago gives its counter up and gets a new one later."""
    from cute_flash.backends import cute as cb

    backend = cb.CuteSm90Backend()
    stream = {"handle": 0}
    monkeypatch.setattr(cb, "_stream_key", lambda device: ("cpu", stream["handle"]))
    first = backend.tile_counter(torch.device("cpu"))
    assert first.tolist() == [0] and first.dtype == torch.int32
    assert backend.tile_counter(torch.device("cpu")) is first  # same stream: same counter
    for handle in range(1, cb.MAX_TILE_COUNTERS):
        stream["handle"] = handle
        backend.tile_counter(torch.device("cpu"))
    stream["handle"] = 0
    assert backend.tile_counter(torch.device("cpu")) is first  # used again: now the most recent
    stream["handle"] = cb.MAX_TILE_COUNTERS  # one stream more: stream 1, the oldest, gives its up
    backend.tile_counter(torch.device("cpu"))
    assert len(backend._tile_counters) == cb.MAX_TILE_COUNTERS
    assert ("cpu", 1) not in backend._tile_counters and ("cpu", 0) in backend._tile_counters
