"""What backend runs here and why, the versions in play, and each backend's feature matrix.

`python -m cute_flash.info` prints it.
"""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from . import backends
from .backends.base import FEATURES


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def feature_matrix() -> dict:
    """{backend: {feature: bool}}: True only where the backend implements (and tests) it,
    whether or not the backend can run on this machine (`unavailable` says that)."""
    return {
        name: {f: f in backends.get_backend(name).features for f in FEATURES}
        for name in backends.BACKEND_NAMES
        if name != "cute"
    }


def backend_info() -> dict:
    """The default backend, the reason for it, versions, the GPU, and the feature matrix."""
    gpu = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
    return {
        "backend": backends.DEFAULT.name,
        "reason": backends.DEFAULT.reason,
        "gpu": gpu,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda (torch)": torch.version.cuda,
            "hip (torch)": torch.version.hip,
            "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
            "triton": _version("triton"),
        },
        "unavailable": {
            name: backends.get_backend(name).unavailable_reason()
            for name in backends.BACKEND_NAMES
            if name != "cute" and backends.get_backend(name).unavailable_reason()
        },
        "features": feature_matrix(),
    }


def _cell(backend: str, feature: str, supported: bool) -> str:
    if supported:
        return "yes"
    if feature == "backward":  # see api.backward_backend
        return "reference"
    return "unverified" if feature in backends.get_backend(backend).unverified else "-"


def format_info(info: dict) -> str:
    lines = [f"backend: {info['backend']}  ({info['reason']})", f"gpu: {info['gpu'] or 'none'}"]
    lines += [f"{k}: {v}" for k, v in info["versions"].items()]
    for name, why in info["unavailable"].items():
        lines.append(f"unavailable: {name}: {why}")
    names = list(info["features"])
    width = max(map(len, FEATURES))
    names_padded = [n.center(len("unverified")) for n in names]
    lines.append("")
    lines.append(" " * width + " | " + " | ".join(names_padded))
    for f in FEATURES:
        cells = [_cell(n, f, info["features"][n][f]).center(len(p)) for n, p in zip(names, names_padded)]
        lines.append(f.ljust(width) + " | " + " | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    print(format_info(backend_info()))


if __name__ == "__main__":
    main()
