"""Argument normalisation and validation (every user-facing error is raised here), and dispatch.

`validate` turns the user's keyword arguments into an `AttnArgs` plus the shapes of the
outputs, or raises a ValueError/TypeError naming the argument, what was expected and what was
received. Checks of tensor *values* (cu_seqlens monotonic, page indices in range, seqused_k
within the cache) read the tensors, which synchronizes a GPU stream and breaks CUDA-graph
capture: they always run for CPU tensors and for GPU tensors only in checked mode
(`CUTE_FLASH_CHECK=1` or `check=True`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import backends
from .backends.base import AttnArgs, Backend

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADDIM = 256
HEADDIM_MULTIPLE = 8


@dataclass
class Call:
    """A validated call: the normalised arguments and where the results go."""

    args: AttnArgs
    backend: Backend
    out_shape: tuple
    lse_shape: tuple
    batch: int


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return f"{type(x).__name__} {x!r}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_tensor(name: str, t, rank: Sequence[int] | int, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {_describe(t)}")
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if t.dim() not in ranks:
        raise ValueError(f"{name} must have {' or '.join(map(str, ranks))} dimensions; got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}; got {t.dtype}")


def _check_int(name: str, x, minimum: int) -> None:
    if not _is_int(x):
        raise TypeError(f"{name} must be an int; got {_describe(x)}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {x}")


def _check_headdim(name: str, d: int, backend: Backend) -> None:
    if d % HEADDIM_MULTIPLE or not HEADDIM_MULTIPLE <= d <= min(MAX_HEADDIM, backend.max_headdim):
        raise ValueError(
            f"{name} must be a multiple of {HEADDIM_MULTIPLE} in [{HEADDIM_MULTIPLE}, "
            f"{min(MAX_HEADDIM, backend.max_headdim)}] (backend {backend.name!r}); got {d}"
        )


def _check_layout(name: str, t: torch.Tensor, backend: Backend) -> None:
    """Last dimension contiguous; other strides and the data pointer as the backend needs."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1); got strides {t.stride()}")
    if t.numel() == 0:
        return
    bad = [s for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1 and s % backend.stride_multiple]
    if bad:
        raise ValueError(
            f"{name} strides must be multiples of {backend.stride_multiple} elements for backend "
            f"{backend.name!r} (16-byte vector loads); got strides {t.stride()}"
        )
    if t.data_ptr() % backend.alignment:
        raise ValueError(
            f"{name} must start at a {backend.alignment}-byte aligned address for backend {backend.name!r}; "
            f"got data_ptr % {backend.alignment} = {t.data_ptr() % backend.alignment}"
        )


def _check_cu_seqlens(name: str, cu: torch.Tensor) -> None:
    _check_tensor(name, cu, 1, (torch.int32,))
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must hold batch + 1 >= 2 offsets; got shape {tuple(cu.shape)}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous; got stride {cu.stride()}")


def _check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int, total_name: str) -> None:
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0; got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing; got {cu.tolist()}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] must equal {total_name} = {total}; got {int(cu[-1])}")


def checked_mode(check: Optional[bool]) -> bool:
    if check is not None:
        return bool(check)
    return os.environ.get("CUTE_FLASH_CHECK", "0") not in ("", "0")


def check_scalars(causal, softmax_scale, window_size, softcap, max_seqlen_q, max_seqlen_k, num_splits, backend):
    """Checks of the non-tensor arguments; returns (causal, left, right), normalised: causal
    sets right = 0, and a window of (-1, 0) is causal (the two spellings pick the same kernel)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {_describe(causal)}")
    if backend is not None and (not isinstance(backend, str) or backend not in backends.BACKEND_NAMES):
        raise ValueError(f"backend must be None or one of {', '.join(backends.BACKEND_NAMES)}; got {backend!r}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(map(_is_int, window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right); got {_describe(window_size)}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded); got {tuple(window_size)}")
    if causal:
        if right > 0:
            raise ValueError(f"causal=True means window_size right = 0; got window_size={tuple(window_size)}")
        right = 0
    causal = causal or (left < 0 and right == 0)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float; got {_describe(softcap)}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off); got {softcap}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None; got {_describe(softmax_scale)}")
        if not math.isfinite(softmax_scale) or softmax_scale == 0:
            raise ValueError(f"softmax_scale must be finite and nonzero; got {softmax_scale}")
    _check_int("num_splits", num_splits, 0)
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if x is not None:
            _check_int(name, x, 0)
    return causal, left, right


def check_tensor_types(q, k, v, **optional) -> None:
    """q, k, v are tensors; each optional tensor argument is a tensor or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {_describe(t)}")
    for name, t in optional.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None; got {_describe(t)}")


def validate(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_k=None,
    page_table=None,
    num_splits=0,
    out=None,
    backend=None,
    check=None,
) -> Call:
    """Check every argument and combination; return the normalised call or raise."""
    causal, left, right = check_scalars(causal, softmax_scale, window_size, softcap, max_seqlen_q, max_seqlen_k, num_splits, backend)
    check_tensor_types(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                       page_table=page_table, out=out)
    _check_tensor("q", q, (3, 4), _FLOAT_DTYPES)
    args = AttnArgs(
        softmax_scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=float(softcap),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        seqused_k=seqused_k,
        page_table=page_table,
        num_splits=num_splits,
    )
    chosen = _check_dtypes_and_devices(q, k, v, out, args, backend)
    batch, capacity = _check_shapes(q, k, v, out, args, chosen)
    if q.device.type != "cuda" or checked_mode(check):
        _check_values(q, k, args, batch, capacity)
    _check_features(chosen, args, q, v)
    varlen_q = cu_seqlens_q is not None
    lse_shape = (q.shape[-2], q.shape[0]) if varlen_q else (batch, q.shape[-2], q.shape[1])
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    return Call(args=args, backend=chosen, out_shape=out_shape, lse_shape=lse_shape, batch=batch)


def check_devices(q, **named) -> None:
    """Every named tensor (None skipped) is on q's device."""
    for name, t in named.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}); got {t.device}")


def _check_dtypes_and_devices(q, k, v, out, args: AttnArgs, backend: Optional[str]) -> Backend:
    """Dtypes and ranks of k/v, one device for every tensor; returns the backend to run."""
    kv_rank = 3 if (args.cu_seqlens_k is not None and args.page_table is None) else 4
    _check_tensor("k", k, kv_rank)
    _check_tensor("v", v, kv_rank)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}); got {t.dtype}")
    check_devices(q, k=k, v=v, out=out, cu_seqlens_q=args.cu_seqlens_q, cu_seqlens_k=args.cu_seqlens_k,
                  seqused_k=args.seqused_k, page_table=args.page_table)
    device = q.device
    if device.type != "cuda" and backend not in (None, "reference"):
        raise ValueError(f"backend {backend!r} needs CUDA tensors; q is on {device} (CPU tensors run on 'reference')")
    chosen = backends.resolve(backend, device)
    if q.dtype not in chosen.dtypes:
        raise TypeError(f"q dtype {q.dtype} is not supported by backend {chosen.name!r}; expected one of {chosen.dtypes}")
    return chosen


def _check_shapes(q, k, v, out, args: AttnArgs, chosen: Backend):
    """Shapes, the combination of modes, strides; returns (batch, keys per sequence or None)."""
    varlen_q, varlen_k, paged = args.cu_seqlens_q is not None, args.cu_seqlens_k is not None, args.page_table is not None
    if varlen_k and not varlen_q:
        raise ValueError("cu_seqlens_k needs cu_seqlens_q (varlen keys with padded queries is not a mode)")
    if varlen_k and paged:
        raise ValueError("cu_seqlens_k and page_table exclude each other: a paged cache has per-sequence lengths in seqused_k")
    if varlen_q and not (varlen_k or paged):
        raise ValueError("cu_seqlens_q needs cu_seqlens_k (packed keys) or page_table (paged keys)")
    q_rank = 3 if varlen_q else 4
    if q.dim() != q_rank:
        layout = "(total_q, nheads, headdim) with cu_seqlens_q" if varlen_q else "(batch, seqlen_q, nheads, headdim)"
        raise ValueError(f"q must have {q_rank} dimensions {layout}; got shape {tuple(q.shape)}")
    nheads, d = q.shape[-2], q.shape[-1]
    nheads_k, dv = k.shape[-2], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k head dim must equal q's ({d}); got k shape {tuple(k.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"v must match k in every dimension but the last; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_k}) (GQA/MQA)")
    _check_headdim("headdim (q.shape[-1])", d, chosen)
    _check_headdim("headdim_v (v.shape[-1])", dv, chosen)

    if varlen_q:
        _check_cu_seqlens("cu_seqlens_q", args.cu_seqlens_q)
        batch = args.cu_seqlens_q.shape[0] - 1
    else:
        batch = q.shape[0]
    capacity = None  # keys a sequence can hold; per sequence (from cu_seqlens_k) when varlen
    if varlen_k:
        _check_cu_seqlens("cu_seqlens_k", args.cu_seqlens_k)
        if args.cu_seqlens_k.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_k must have batch + 1 = {batch + 1} entries like cu_seqlens_q; got {args.cu_seqlens_k.shape[0]}")
    elif paged:
        _check_tensor("page_table", args.page_table, 2, (torch.int32,))
        if args.page_table.shape[0] != batch:
            raise ValueError(f"page_table must have batch = {batch} rows; got shape {tuple(args.page_table.shape)}")
        if k.shape[1] < 1 or k.shape[0] < 1:
            raise ValueError(f"a paged k must be (num_pages >= 1, page_size >= 1, nheads_k, headdim); got {tuple(k.shape)}")
        capacity = args.page_table.shape[1] * k.shape[1]
    else:
        if k.shape[0] != batch:
            raise ValueError(f"k must have batch = {batch} (q.shape[0]) rows; got shape {tuple(k.shape)}")
        capacity = k.shape[1]
    if args.seqused_k is not None:
        _check_tensor("seqused_k", args.seqused_k, 1, (torch.int32,))
        if args.seqused_k.shape[0] != batch:
            raise ValueError(f"seqused_k must have batch = {batch} entries; got shape {tuple(args.seqused_k.shape)}")
    if (varlen_q or paged) and q.device.type == "cuda":
        # The grid is sized from these; computing them would synchronize the stream.
        if varlen_q and args.max_seqlen_q is None:
            raise ValueError("max_seqlen_q is required with cu_seqlens_q on a GPU (computing it would synchronize)")
        if args.max_seqlen_k is None:
            raise ValueError("max_seqlen_k is required with cu_seqlens_k or page_table on a GPU")

    out_shape = tuple(q.shape[:-1]) + (dv,)
    if out is not None and (tuple(out.shape) != out_shape or out.dtype != q.dtype):
        raise ValueError(f"out must have shape {out_shape} and dtype {q.dtype}; got {_describe(out)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t is not None:
            _check_layout(name, t, chosen)
    return batch, capacity


def _check_values(q, k, args: AttnArgs, batch: int, capacity: Optional[int]) -> None:
    """Checks that read index tensors (they synchronize a GPU stream)."""
    cu_q, cu_k, seqused_k, page_table = args.cu_seqlens_q, args.cu_seqlens_k, args.seqused_k, args.page_table
    if cu_q is not None:
        _check_cu_seqlens_values("cu_seqlens_q", cu_q, q.shape[0], "q.shape[0]")
        longest_q = int((cu_q[1:] - cu_q[:-1]).max())
        if args.max_seqlen_q is not None and longest_q > args.max_seqlen_q:
            raise ValueError(f"max_seqlen_q ({args.max_seqlen_q}) is below the longest query sequence ({longest_q})")
    if cu_k is not None:
        _check_cu_seqlens_values("cu_seqlens_k", cu_k, k.shape[0], "k.shape[0]")
        keys = cu_k[1:] - cu_k[:-1]
    else:
        keys = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    if seqused_k is not None:
        bad = (seqused_k < 0) | (seqused_k > keys)
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            raise ValueError(f"seqused_k[{b}] = {int(seqused_k[b])} is outside [0, {int(keys[b])}] (the keys of sequence {b})")
        keys = seqused_k
    if page_table is not None:
        pages_used = (keys + k.shape[1] - 1) // k.shape[1]
        needed = torch.arange(page_table.shape[1], device=q.device)[None, :] < pages_used[:, None]
        bad = needed & ((page_table < 0) | (page_table >= k.shape[0]))
        if bool(bad.any()):
            b, p = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"page_table[{b}, {p}] = {int(page_table[b, p])} is not a page of k (0 <= page < {k.shape[0]})")
    if args.max_seqlen_k is not None and batch:
        longest_k = int(keys.max())
        if longest_k > args.max_seqlen_k:
            raise ValueError(f"max_seqlen_k ({args.max_seqlen_k}) is below the longest key sequence ({longest_k})")


def _check_features(backend: Backend, args: AttnArgs, q, v) -> None:
    """The backend must implement every feature the call uses, or say which it lacks."""
    reason = backend.unavailable_reason()
    if reason is not None:
        raise ValueError(f"backend {backend.name!r} cannot run here: {reason}")
    wanted = {
        "causal": args.causal,
        "window": args.has_window and not (args.causal and args.window_left < 0),
        "softcap": args.softcap > 0,
        "gqa": q.shape[-2] != v.shape[-2],
        "varlen": args.cu_seqlens_q is not None,
        "seqused_k": args.seqused_k is not None,
        "paged_kv": args.page_table is not None,
        "split_kv": args.num_splits > 1,
        "headdim_v": q.shape[-1] != v.shape[-1],
        "fp32": q.dtype in (torch.float32, torch.float64),
    }
    missing = [f for f, on in wanted.items() if on and f not in backend.features]
    unverified = [f for f in missing if f in backend.unverified]
    if unverified:
        raise NotImplementedError(
            f"backend {backend.name!r}: {', '.join(unverified)} not yet verified on a GPU "
            f"(backend='reference' implements every feature; `python -m cute_flash.info` lists the others)"
        )
    if missing:
        raise NotImplementedError(f"backend {backend.name!r} does not implement: {', '.join(missing)}")
    dims = {q.shape[-1], v.shape[-1]}
    if backend.verified_headdims is not None and not dims <= backend.verified_headdims:
        raise NotImplementedError(
            f"backend {backend.name!r}: head dims {sorted(dims - backend.verified_headdims)} not yet verified on a GPU "
            f"(verified: {sorted(backend.verified_headdims)}; backend='cute-sm80' or 'reference' take them)"
        )


def backward_backend(call: Call, q, k, v, deterministic: bool) -> Backend:
    """The backend that runs the backward of a validated call.

    A backend without a GPU-verified backward kernel, or whose kernel cannot take this call
    (`Backend.backward_refusal`: the sm_80 kernels stop at head dim 256, refuse a few unequal
    pairs (96 with 192 or 256) and, at 256, need 100 KB of shared memory per CTA), hands its
    backward to the reference backend, on the same device: exact and memory-bounded, but
    PyTorch-speed. `backend_info()` and the README's feature matrix say which
    backends do so.
    """
    if call.args.page_table is not None:
        raise NotImplementedError("backward with a paged KV cache (page_table) is not implemented")
    if "backward" in call.backend.features and call.backend.backward_refusal(q, k, v, call.args, deterministic) is None:
        return call.backend
    return backends.get_backend("reference")
