"""Backends whose kernels do not exist yet: they say so, and never compute anything."""

from __future__ import annotations

from .base import Backend


class _Unimplemented(Backend):
    missing: str = "?"

    def unavailable_reason(self):
        return f"{self.missing} not implemented yet"

    def fwd(self, *args, **kwargs):
        raise NotImplementedError(f"backend {self.name!r}: {self.unavailable_reason()}")

    def bwd(self, *args, **kwargs):
        raise NotImplementedError(f"backend {self.name!r}: {self.unavailable_reason()}")


class CuteSm90Backend(_Unimplemented):
    name = "cute-sm90"
    missing = "the sm_90 (TMA + WGMMA) kernels are"


class TritonBackend(_Unimplemented):
    name = "triton"
    missing = "the Triton kernels of the HIP fallback are"


class CuteSm80Backend(_Unimplemented):
    name = "cute-sm80"
    missing = "the sm_80 (cp.async + mma.sync) kernels are"
