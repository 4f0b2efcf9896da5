"""cute_flash: FlashAttention written in the CuTe Python DSL.

    out = cute_flash.forward(q, k, v, causal=True)            # (batch, seqlen, nheads, headdim)
    out, lse = cute_flash.forward(q, k, v, return_lse=True)
    out = cute_flash.attention(q, k, v, causal=True)           # differentiable
    torch.ops.cute_flash.fwd(...)                              # the custom op underneath

`cute_flash.backend_info()` (or `python -m cute_flash.info`) says which backend runs and why.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import api, ops  # noqa: F401  (ops registers torch.ops.cute_flash.*)

try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # a torch without it: `forward` always takes the op, which is always right
    _get_current_dispatch_mode = None

__version__ = "0.1.0"


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_k: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
    check: Optional[bool] = None,
):
    """Attention forward: softmax(q kᵀ · softmax_scale) v, per head, with the options of the README.

    q (batch, seqlen_q, nheads, headdim) and k, v (batch, seqlen_k, nheads_k, headdim[_v]), or
    packed (total, nheads, headdim) with `cu_seqlens_q/k`, or a paged cache
    (num_pages, page_size, nheads_k, headdim) with `page_table`. Returns out (like q, head dim
    of v), and with `return_lse` also the float32 log-sum-exp, (batch, nheads, seqlen_q) or
    (nheads, total_q). `check=True` (or CUTE_FLASH_CHECK=1) also checks the *values* of index
    tensors on the GPU, which synchronizes the stream.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__} {return_lse!r}")
    _check_check(check)
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if out is not None and needs_grad:
        raise ValueError("out= is for inference; use cute_flash.attention for gradients (or torch.no_grad())")
    if _plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, out):
        # one api.validate: every check the op path makes (eagerly, then in the op)
        call = api.validate(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, page_table=page_table, num_splits=num_splits, out=out,
            backend=backend, check=check,
        )
        o, lse = ops.Attention.apply(q, k, v, call, False) if needs_grad else ops.run_fwd(call, q, k, v, out)
        return (o, lse) if return_lse else o
    common = _common_args(q, k, v, causal, softmax_scale, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, seqused_k, page_table, num_splits, backend, check, out)
    if out is None:
        o, lse = torch.ops.cute_flash.fwd(q, k, v, *common[:11], False, backend, check)
    else:
        lse = torch.ops.cute_flash.fwd_out(q, k, v, out, *common[:11], backend, check)
        o = out
    return (o, lse) if return_lse else o


def _check_check(check) -> None:
    if check is not None and not isinstance(check, bool):
        raise TypeError(f"check must be a bool or None; got {type(check).__name__} {check!r}")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(*tensors) -> bool:
    """Whether nothing but this call would see the op: not compiling, exporting or tracing, no
    functorch transform (vmap's batched tensors are plain `torch.Tensor`s without storage), plain
    tensors (no fake or functional subclass; an `nn.Parameter` is plain), no Python dispatch
    mode. Then `forward` and `attention` run the op's implementation directly (`ops.run_fwd`, or
    `ops.Attention` when gradients are needed), saving the dispatcher's host time per call (and,
    with gradients, the backward's second validation)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._are_functorch_transforms_active():
        return False
    if _get_current_dispatch_mode is None or any(t is not None and type(t) not in _PLAIN for t in tensors):
        return False
    return _get_current_dispatch_mode() is None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_k: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: Optional[str] = None,
    check: Optional[bool] = None,
):
    """Differentiable attention (the arguments of `forward`, without the inference-only ones:
    `page_table`, `num_splits` and `out`). `deterministic=True` makes gradients bitwise
    reproducible. A gradient flowing into the returned LSE is honoured."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__} {return_lse!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__} {deterministic!r}")
    _check_check(check)
    if _plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k):
        call = api.validate(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, backend=backend, check=check,
        )
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        o, lse = ops.Attention.apply(q, k, v, call, deterministic) if needs_grad else ops.run_fwd(call, q, k, v)
        return (o, lse) if return_lse else o
    common = _common_args(q, k, v, causal, softmax_scale, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, seqused_k, None, 0, backend, check, None)
    o, lse = torch.ops.cute_flash.fwd(q, k, v, *common[:11], deterministic, backend, check)
    return (o, lse) if return_lse else o


def _common_args(q, k, v, causal, softmax_scale, window_size, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, seqused_k, page_table, num_splits, backend, check, out):
    """Check eagerly what the ops' schema would otherwise reject with a less useful message
    (argument types, scalars; the callers have checked `check`); the op itself runs the full
    `api.validate` exactly once."""
    if not torch.compiler.is_compiling():
        api.check_scalars(causal, softmax_scale, window_size, softcap, max_seqlen_q, max_seqlen_k, num_splits, backend)
        tensors = dict(k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                       page_table=page_table, out=out)
        api.check_tensor_types(q, **tensors)
        api.check_devices(q, **tensors)  # mixed devices could dispatch the op to another device's kernel
    return (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, causal,
            None if softmax_scale is None else float(softmax_scale), list(window_size), float(softcap),
            max_seqlen_q, max_seqlen_k, num_splits)


def backend_info() -> dict:
    """The default backend and why, versions, the GPU, and the per-backend feature matrix."""
    from .info import backend_info as _backend_info

    return _backend_info()


def warmup(*args, **kwargs):
    """Compile kernel configurations ahead of time (see `cute_flash.backends.cute.warmup`)."""
    from .backends.cute import warmup as _warmup

    return _warmup(*args, **kwargs)


__all__ = ["forward", "attention", "backend_info", "warmup", "__version__"]
