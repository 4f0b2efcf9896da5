"""Decode with GQA as attention of one KV head over its group of query heads, by strided views.

A decode step (one query token per sequence) with `g = nheads // nheads_k > 1` launches one CTA
per query head, so every KV head is read `g` times. Its `g` query heads can instead be the `g`
query *rows* of one (sequence, KV head) tile: q (batch, 1, nheads_k * g, d) viewed as
(batch, g, nheads_k, d) with strides (batch, head, g * head, 1) is the same memory, and so are
out, the LSE and the split-KV partials. The kernels then run plain multi-head attention with
seqlen_q = g and read each KV head once.

The views are only the same attention when every query row sees the same keys: one query token
sees all keys of its sequence under a causal mask (bottom-right aligned) or a right window, but a
left window would start at a different key for each of the `g` rows. So a packable call has one
query token per sequence (not varlen in q), more query heads than KV heads, no left window; the
packed call is non-causal with no window. Everything else (softcap, seqused_k, varlen keys, a
paged cache, split-KV) carries over unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from .base import AttnArgs


def packable(q: torch.Tensor, k: torch.Tensor, args: AttnArgs) -> bool:
    return (args.cu_seqlens_q is None and q.dim() == 4 and q.shape[1] == 1 and q.shape[2] > k.shape[-2]
            and args.window_left < 0)


def _rows_of_group(t: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """(batch, 1, nheads_k * g, d) -> (batch, g, nheads_k, d), the same memory."""
    b, _, h, d = t.shape
    g = h // nheads_k
    return t.as_strided((b, g, nheads_k, d), (t.stride(0), t.stride(2), g * t.stride(2), t.stride(3)),
                        t.storage_offset())


def pack(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor], args: AttnArgs,
         workspace: Optional[tuple] = None):
    """(q, out, lse, args, workspace) of the packed call; see the module docstring.

    `lse` must be contiguous (batch, nheads, 1); a `workspace` (o_partial, lse_partial) is private
    scratch of the split-KV kernels, so it is reshaped, not re-strided.
    """
    nheads_k = k.shape[-2]
    b, _, h, _ = q.shape
    g = h // nheads_k
    packed_lse = None if lse is None else lse.view(b, nheads_k, g)
    if workspace is not None and all(t.is_contiguous() for t in workspace):  # else partials() refuses it
        o_partial, lse_partial = workspace
        splits = o_partial.shape[0]
        workspace = (o_partial.view(splits, b, g, nheads_k, o_partial.shape[-1]),
                     lse_partial.view(splits, b, nheads_k, g))
    packed_args = replace(args, causal=False, window_left=-1, window_right=-1)
    return _rows_of_group(q, nheads_k), _rows_of_group(out, nheads_k), packed_lse, packed_args, workspace
