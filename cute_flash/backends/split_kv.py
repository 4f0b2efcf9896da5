"""Host side of split-KV for the CuTe backends: how many splits, the partial buffers, the combine.

Nothing here reads a device tensor, so a split-KV call can be captured in a CUDA graph: the
number of splits comes from `max_seqlen_k` (or the cache's capacity), never from `seqused_k`,
and the kernels work out per sequence which splits hold keys.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.combine_config import MAX_SPLITS, make_config, num_splits_heuristic
from .base import AttnArgs, num_sms, query_sizes

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
GRID_Z_LIMIT = 65535  # CUDA's limit on gridDim.z, which the forward kernel spends on (batch, split)


def max_keys(k: torch.Tensor, args: AttnArgs) -> int:
    """An upper bound of the key length of every sequence, known without a device sync."""
    if args.max_seqlen_k is not None:
        return args.max_seqlen_k
    if args.page_table is not None:
        return args.page_table.shape[1] * k.shape[1]
    return k.shape[1]  # fixed-length keys (varlen calls on a GPU always give max_seqlen_k)


def capacity(k: torch.Tensor, args: AttnArgs) -> int:
    """Keys of each sequence when neither seqused_k nor cu_seqlens_k says otherwise."""
    if args.page_table is not None:
        return args.page_table.shape[1] * k.shape[1]
    return 0 if args.cu_seqlens_k is not None else k.shape[1]


def num_splits(q: torch.Tensor, k: torch.Tensor, args: AttnArgs, config, heuristic: bool) -> int:
    """The splits this call runs with: the requested number (0 = the heuristic when `heuristic`,
    else 1), clamped to the key blocks of the longest sequence and to the grid's z extent
    (batch x splits CTAs)."""
    n_blocks = -(-max_keys(k, args) // config.tile_n)
    batch, seqlen_q = query_sizes(q, args)
    splits = args.num_splits
    if splits == 0:
        if not heuristic:
            return 1
        tiles = batch * q.shape[-2] * -(-seqlen_q // config.tile_m)
        sms = num_sms(q.device)
        splits = num_splits_heuristic(tiles, sms, n_blocks, MAX_SPLITS, paged=args.page_table is not None)
    return max(1, min(splits, n_blocks, GRID_Z_LIMIT // max(batch, 1)))


def partial_shapes(q: torch.Tensor, v: torch.Tensor, args: AttnArgs, splits: int) -> tuple:
    """Shapes of the float32 partial O and LSE: (splits, *out's shape), (splits, *LSE's shape)."""
    nheads = q.shape[-2]
    if args.cu_seqlens_q is not None:
        lse_shape = (nheads, q.shape[0])
    else:
        lse_shape = (q.shape[0], nheads, q.shape[1])
    return (splits, *q.shape[:-1], v.shape[-1]), (splits, *lse_shape)


def partials(q: torch.Tensor, v: torch.Tensor, args: AttnArgs, splits: int,
             workspace: Optional[tuple] = None) -> tuple:
    """(o_partial, lse_partial): the caller's `workspace` (checked) or new buffers."""
    o_shape, lse_shape = partial_shapes(q, v, args, splits)
    if workspace is None:
        return (torch.empty(o_shape, dtype=torch.float32, device=q.device),
                torch.empty(lse_shape, dtype=torch.float32, device=q.device))
    o_partial, lse_partial = workspace
    for name, t, shape in (("o_partial", o_partial, o_shape), ("lse_partial", lse_partial, lse_shape)):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"workspace {name} must be a contiguous float32 tensor of shape {shape} on "
                             f"{q.device}; got {tuple(t.shape)} {t.dtype} on {t.device}")
    return o_partial, lse_partial


def combine_config(out: torch.Tensor, lse: Optional[torch.Tensor], args: AttnArgs, fwd_config):
    return make_config(
        _DTYPE_NAMES[out.dtype], out.shape[-1], fwd_config.tile_n,
        varlen_q=args.cu_seqlens_q is not None, varlen_k=args.cu_seqlens_k is not None,
        seqused_k=args.seqused_k is not None, has_lse=lse is not None,
    )


def launch_combine(fn, o_partial, lse_partial, out, lse, k, args: AttnArgs, a) -> None:
    """Run a compiled combine on the current stream of out's device (`a`: the `KernelArgs` of its
    cache)."""
    num_batch, max_seqlen_q = query_sizes(out, args)
    with a.context(out.device):
        fn(
            a.tensor(o_partial, 16), a.tensor(lse_partial, 4), a.tensor(out, 16), a.tensor(lse, 4),
            a.tensor(args.cu_seqlens_q, 4), a.tensor(args.cu_seqlens_k, 4), a.tensor(args.seqused_k, 4),
            a.i32(capacity(k, args)), a.i32(num_batch), a.i32(max_seqlen_q), a.i32(o_partial.shape[0]), *a.stream(),
        )
