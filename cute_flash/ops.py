"""torch.library custom ops: `cute_flash::fwd`, `cute_flash::fwd_out`, `cute_flash::bwd`.

The ops are what `torch.compile` and `torch.export` see: opaque calls with fake (shape-only)
implementations. Their real implementations validate the arguments (`api.validate`) and run the
chosen backend, so a call through `torch.ops.cute_flash.*` is checked exactly like one through
`cute_flash.forward`. `fwd` carries its autograd formula, which calls `bwd`.

`Attention` is the same forward and backward as an autograd.Function, for eager calls that
nothing but the caller would see (`cute_flash._plain_eager`): no dispatcher, one validation.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import api


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, causal, softmax_scale, window_size,
              softcap, max_seqlen_q, max_seqlen_k, num_splits, backend, check, out=None) -> api.Call:
    return api.validate(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size), softcap=softcap,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        seqused_k=seqused_k, page_table=page_table, num_splits=num_splits, out=out, backend=backend, check=check,
    )


def run_fwd(call: api.Call, q, k, v, out: Optional[torch.Tensor] = None) -> tuple:
    """What `fwd` and `fwd_out` run after validation: the backend's forward; returns (out, lse).

    `cute_flash.forward` calls this directly, on its own `api.validate`, when neither autograd nor
    a tracer (torch.compile, torch.export, a fake or dispatch mode) needs the op: the same checks
    and kernels, without the dispatcher's host time."""
    if out is None:
        out = torch.empty(call.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(call.lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    call.backend.fwd(q, k, v, out, lse, call.args)
    return out, lse


def run_bwd(call: api.Call, dout, q, k, v, out, lse, dlse, deterministic: bool) -> tuple:
    """What `bwd` runs after validation, and `Attention`'s backward: the backward backend of the
    call (`api.backward_backend`, which refuses a paged cache); returns (dq, dk, dv)."""
    backend = api.backward_backend(call, q, k, v, deterministic)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backend.bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, call.args, deterministic)
    return dq, dk, dv


def _lse_shape(q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]):
    if cu_seqlens_q is not None:
        return (q.shape[-2], q.shape[0])
    return (q.shape[0], q.shape[-2], q.shape[1])


@torch.library.custom_op("cute_flash::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    page_table: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    window_size: list[int],
    softcap: float,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    num_splits: int,
    deterministic: bool,
    backend: Optional[str],
    check: Optional[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward; returns (out, lse). `deterministic` is kept for the backward."""
    call = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, causal, softmax_scale, window_size,
                     softcap, max_seqlen_q, max_seqlen_k, num_splits, backend, check)
    return run_fwd(call, q, k, v)


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, causal, softmax_scale, window_size, softcap,
      max_seqlen_q, max_seqlen_k, num_splits, deterministic, backend, check):
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    return out, q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.custom_op("cute_flash::fwd_out", mutates_args=("out",))
def fwd_out(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    page_table: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    window_size: list[int],
    softcap: float,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    num_splits: int,
    backend: Optional[str],
    check: Optional[bool],
) -> torch.Tensor:
    """Attention forward into a caller-provided `out` (inference, CUDA graphs); returns lse."""
    call = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, causal, softmax_scale, window_size,
                     softcap, max_seqlen_q, max_seqlen_k, num_splits, backend, check, out=out)
    return run_fwd(call, q, k, v, out)[1]


@fwd_out.register_fake
def _(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, causal, softmax_scale, window_size, softcap,
      max_seqlen_q, max_seqlen_k, num_splits, backend, check):
    return q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.custom_op("cute_flash::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    window_size: list[int],
    softcap: float,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    deterministic: bool,
    backend: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward; returns (dq, dk, dv). A gradient of the LSE (dlse) is honoured."""
    call = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, None, causal, softmax_scale, window_size,
                     softcap, max_seqlen_q, max_seqlen_k, 1, backend, False)
    return run_bwd(call, dout, q, k, v, out, lse, dlse, deterministic)


@bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, causal, softmax_scale, window_size,
      softcap, max_seqlen_q, max_seqlen_k, deterministic, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FWD_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "causal", "softmax_scale", "window_size",
             "softcap", "max_seqlen_q", "max_seqlen_k", "num_splits", "deterministic", "backend", "check")


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.params = dict(zip(_FWD_ARGS, inputs[3:]))
    if ctx.params["page_table"] is not None:
        ctx.params["paged"] = True
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, ctx.params["cu_seqlens_q"], ctx.params["cu_seqlens_k"],
                          ctx.params["seqused_k"])


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k = ctx.saved_tensors
    p = ctx.params
    if p.get("paged"):
        raise NotImplementedError("backward with a paged KV cache (page_table) is not implemented")
    dq, dk, dv = torch.ops.cute_flash.bwd(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, p["causal"], p["softmax_scale"],
        p["window_size"], p["softcap"], p["max_seqlen_q"], p["max_seqlen_k"], p["deterministic"], p["backend"],
    )
    return (dq, dk, dv) + (None,) * len(_FWD_ARGS)


fwd.register_autograd(_backward, setup_context=_setup_context)


class Attention(torch.autograd.Function):
    """`fwd` with its autograd formula, without the dispatcher: `cute_flash.attention` and
    `cute_flash.forward` apply it when gradients are needed and nothing but this call would see the
    op (`cute_flash._plain_eager`); tracers, fake tensors and dispatch modes get the op instead.

    `call` is the caller's `api.validate` of the forward's arguments, kept for the backward, which
    therefore does not validate again. Unlike the op's, its backward gets None for an unused LSE's
    gradient (dout is zero-filled when only the LSE is used), and it is not itself differentiable: under
    `create_graph=True` its gradients carry a grad_fn that raises when differentiated, where the
    op's have `bwd`'s, which has no autograd formula.
    """

    @staticmethod
    def forward(ctx, q, k, v, call: api.Call, deterministic: bool):
        # An unused LSE's gradient stays None: the backward then skips the zero fill and the
        # backends their dlse pass (bitwise the same gradients as with zeros)
        ctx.set_materialize_grads(False)
        out, lse = run_fwd(call, q, k, v)
        a = call.args
        ctx.save_for_backward(q, k, v, out, lse, a.cu_seqlens_q, a.cu_seqlens_k, a.seqused_k)
        ctx.call, ctx.deterministic = call, deterministic
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors[:5]  # unpacking all of them checks none was modified in place
        call = ctx.call
        if call.args.num_splits != 1:  # what `bwd` validates: the backward has no split-KV
            call = dataclasses.replace(call, args=dataclasses.replace(call.args, num_splits=1))
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        with torch.no_grad():
            grads = run_bwd(call, dout, q, k, v, out, lse, dlse, ctx.deterministic)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dout, dlse, q, k, v)):
            # create_graph=True: what `once_differentiable` does, but for the saved inputs too
            # (the gradients depend on q, k, v, not only on dout and dlse)
            fail = torch._C._functions.DelayedError(b"cute_flash attention has no double backward", len(grads))
            grads = fail(*(g.detach().requires_grad_() for g in grads))
        return tuple(grads) + (None, None)
