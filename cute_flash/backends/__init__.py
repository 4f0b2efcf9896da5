"""Backends, and the one choice of the default made when the package is imported.

| platform                                  | default backend                         |
| ----------------------------------------- | --------------------------------------- |
| NVIDIA, compute capability 9.0            | cute-sm90 (TMA + WGMMA)                 |
| NVIDIA, 8.x and newer parts w/o sm_90a    | cute-sm80 (cp.async + mma.sync)         |
| ROCm (torch.version.hip)                  | triton (the HIP fallback)               |
| no GPU                                    | reference (pure PyTorch)                |

`CUTE_FLASH_BACKEND` overrides the choice (`cute` picks the arch's cute backend). Tensors on
the CPU always run on `reference`.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .base import FEATURES, AttnArgs, Backend
from .reference import ReferenceBackend

# name -> (module, class). Imported on first use so that `import cute_flash` stays cheap.
_REGISTRY = {
    "reference": ("cute_flash.backends.reference", "ReferenceBackend"),
    "cute-sm80": ("cute_flash.backends.cute", "CuteSm80Backend"),
    "cute-sm90": ("cute_flash.backends.cute", "CuteSm90Backend"),
    "triton": ("cute_flash.backends.triton", "TritonBackend"),
}
BACKEND_NAMES = tuple(_REGISTRY) + ("cute",)

_instances: dict = {}


def get_backend(name: str) -> Backend:
    """The backend object registered under `name` (`cute` is resolved for the current GPU)."""
    if name == "cute":
        name = _cute_for_device()
    if name not in _instances:
        module, cls = _REGISTRY[name]
        _instances[name] = getattr(importlib.import_module(module), cls)()
    return _instances[name]


def _cute_for_device() -> str:
    if torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0):
        return "cute-sm90"
    return "cute-sm80"


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str


def _choose() -> Choice:
    env = os.environ.get("CUTE_FLASH_BACKEND", "").strip()
    if env:
        if env not in BACKEND_NAMES:
            raise ValueError(f"CUTE_FLASH_BACKEND must be one of {', '.join(BACKEND_NAMES)}; got {env!r}")
        name = _cute_for_device() if env == "cute" else env
        return Choice(name, f"CUTE_FLASH_BACKEND={env}")
    if torch.version.hip is not None:
        return Choice("triton", f"ROCm build of PyTorch (HIP {torch.version.hip}): the CuTe DSL targets NVIDIA only")
    if not torch.cuda.is_available():
        return Choice("reference", "no GPU visible to PyTorch")
    major, minor = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
    if (major, minor) == (9, 0):
        return Choice("cute-sm90", f"{gpu}: TMA + WGMMA kernels")
    if major >= 8:
        return Choice("cute-sm80", f"{gpu}: cp.async + mma.sync kernels")
    return Choice("reference", f"{gpu} is older than sm_80, which the kernels need")


DEFAULT = _choose()
# On ROCm the fallback is worth a visible line; elsewhere the choice is logged quietly.
logging.getLogger("cute_flash").log(
    logging.WARNING if DEFAULT.name == "triton" and torch.version.hip else logging.INFO,
    "cute_flash backend: %s (%s)", DEFAULT.name, DEFAULT.reason,
)


def resolve(name: Optional[str], device: torch.device) -> Backend:
    """The backend that runs a call on `device`, given the user's `backend=` (validated)."""
    if device.type != "cuda":
        return get_backend("reference")
    return get_backend(DEFAULT.name if name is None else name)


__all__ = ["AttnArgs", "Backend", "BACKEND_NAMES", "DEFAULT", "FEATURES", "ReferenceBackend", "get_backend", "resolve"]
