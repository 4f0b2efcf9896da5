"""What every backend receives and implements.

`api.py` validates and normalises the user's arguments into an `AttnArgs`, allocates the
outputs, and hands them to a backend. Backends assume validated input and write in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

# Feature names, used by backends to declare what they implement and by `api.py` to raise a
# NotImplementedError that names the missing piece instead of computing something else.
FEATURES = (
    "causal",
    "window",
    "softcap",
    "gqa",
    "varlen",
    "seqused_k",
    "paged_kv",
    "split_kv",
    "headdim_v",
    "return_lse",
    "backward",
    "fp32",
)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def query_sizes(q: torch.Tensor, args: "AttnArgs") -> tuple:
    """(num_batch, max_seqlen_q) of a validated call: from cu_seqlens_q and max_seqlen_q when the
    queries are packed, else q's (batch, seqlen) (or out's: they share those dimensions)."""
    if args.cu_seqlens_q is not None:
        return args.cu_seqlens_q.shape[0] - 1, args.max_seqlen_q
    return q.shape[0], q.shape[1]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA `device` (looked up once per device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass
class AttnArgs:
    """Normalised attention arguments (tensors are already validated).

    Windows follow FlashAttention-2: query i of a sequence (seqlen_q rows, seqlen_k keys) may
    attend key j iff  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right,
    with -1 meaning unbounded on that side; causal is exactly (left, right) = (-1, 0).
    """

    softmax_scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    seqused_k: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    num_splits: int = 1

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def is_varlen_q(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def is_paged(self) -> bool:
        return self.page_table is not None


class Backend:
    """A way to run attention. Subclasses set the class attributes and implement fwd/bwd.

    Tensor shapes handed to `fwd` (validated by `api.py`):
      q    (batch, seqlen_q, nheads, d)        or varlen (total_q, nheads, d)
      k, v (batch, seqlen_k, nheads_k, d|dv)   or varlen (total_k, nheads_k, d|dv)
                                               or paged  (num_pages, page_size, nheads_k, d|dv)
      out  like q with head dim dv (written in place)
      lse  float32 (batch, nheads, seqlen_q)   or varlen (nheads, total_q) (written in place)
    Every tensor has a unit stride in its last dimension; other strides are arbitrary
    multiples of `stride_multiple` elements, and data pointers are aligned to `alignment` bytes.
    """

    name: str = "?"
    features: frozenset = frozenset()
    # Written and compiled, but not yet checked on a GPU: refused (NotImplementedError saying
    # so) until the GPU tests pass, so that nothing untested runs by default.
    unverified: frozenset = frozenset()
    verified_headdims: Optional[frozenset] = None  # None: every head dim the API allows
    dtypes: tuple = (torch.float16, torch.bfloat16)
    max_headdim: int = 256
    headdim_multiple: int = 8
    alignment: int = 16  # bytes, for data pointers
    stride_multiple: int = 8  # elements, for every stride but the last

    def unavailable_reason(self) -> Optional[str]:
        """None when the backend can run here, else one line saying why not."""
        return None

    def fwd(self, q, k, v, out, lse, args: AttnArgs) -> None:
        raise NotImplementedError(f"backend {self.name!r} has no forward kernel yet")

    def bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args: AttnArgs, deterministic: bool) -> None:
        raise NotImplementedError(f"backend {self.name!r} has no backward kernel yet")

    def backward_refusal(self, q, k, v, args: AttnArgs, deterministic: bool) -> Optional[str]:
        """Why this backend's backward kernel cannot take a call it offers "backward" for, or None."""
        return None
