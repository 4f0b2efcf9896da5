"""Context parallelism: ring attention over torch.distributed.

Each rank of a process group holds one shard of the sequence of q, k and v. The K/V shards
travel around the ring (rank r sends to r + 1 and receives from r - 1) with
`batch_isend_irecv`, the transfer of the next shard overlapping the attention of the one in
hand. Every step yields a partial output and its log-sum-exp for the local queries; they are
merged exactly as a split-KV combine does:

    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward replays the ring: each step computes the gradient of the local queries against
the shard in hand from the *final* output and LSE (so P = exp(S - lse) is exact), and the
dK/dV accumulators travel with their K/V shard, arriving home after the last step; each hop of
them overlaps the next step's computation.

Causal attention with contiguous shards leaves the last rank with all the work; with
`layout="zigzag"` the sequence is cut into 2·world chunks and rank r holds chunks r and
2·world - 1 - r, which balances it: then every step but the first computes half a shard.
`shard_sequence` / `gather_sequence` convert between a full sequence and a rank's shard.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import api

LAYOUTS = ("contiguous", "zigzag")
# K/V shards and dK/dV accumulators may be in flight together. Tags keep them apart where the
# backend matches by tag (gloo); NCCL ignores tags and matches in issue order, which is the same
# on every rank.
_KV_TAG, _GRAD_TAG = 0, 1


def _resolve_group(group, mesh_dim):
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group"):  # a DeviceMesh
        return group.get_group(mesh_dim if mesh_dim is not None else 0)
    return group


def shard_sequence(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The shard of the full sequence `x` (along `dim`) that `rank` holds."""
    if layout == "contiguous":
        return x.chunk(world, dim=dim)[rank]
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def gather_sequence(shards: list, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (inverse of `shard_sequence`)."""
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))], dim=dim)


class _Ring:
    """Sends to the next rank and receives from the previous one, asynchronously."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, tensors, tag: int = 0):
        """Send `tensors` on; return (buffers that will hold the previous rank's, requests).
        Transfers of different kinds in flight together take different tags (`_KV_TAG`)."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests):
        for req in requests:
            req.wait()


def _blocks(layout: str, causal: bool, rank: int, src: int, seqlen: int):
    """The (q rows, k rows, causal) blocks of the local queries against rank `src`'s keys."""
    everything = slice(0, seqlen)
    if not causal:
        return [(everything, everything, False)]
    if src == rank:
        return [(everything, everything, True)]
    if layout == "contiguous":
        return [(everything, everything, False)] if src < rank else []
    half = seqlen // 2
    if src < rank:  # every local query sees the first chunk of src's keys, none of the second
        return [(everything, slice(0, half), False)]
    return [(slice(half, seqlen), everything, False)]  # only the second local chunk sees src


def _merge(out, lse, part_out, part_lse, rows):
    """Fold a partial (out, lse) for the query rows `rows` into the running float32 result."""
    o, l_ = out[:, rows], lse[:, :, rows]
    new = torch.logaddexp(l_, part_lse)
    safe = torch.where(new == -torch.inf, 0.0, new)
    w_old = torch.exp(l_ - safe).transpose(1, 2)[..., None]
    w_new = torch.exp(part_lse - safe).transpose(1, 2)[..., None]
    out[:, rows] = o * w_old + part_out.float() * w_new
    lse[:, :, rows] = new


def _ring_forward(q, k, v, ring: _Ring, layout, causal, scale, softcap, backend):
    seqlen = q.shape[1]
    out = lse = None  # the running float32 result; the first step (own shard, every row) sets it
    kv = (k, v)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming, requests = ring.start(kv) if step + 1 < ring.world else (None, [])
        for rows, keys, blk_causal in _blocks(layout, causal, ring.rank, src, seqlen):
            part_out, part_lse = torch.ops.cute_flash.fwd(
                q[:, rows], kv[0][:, keys], kv[1][:, keys], None, None, None, None, blk_causal, scale,
                [-1, 0 if blk_causal else -1], softcap, None, None, 0, False, backend, None,
            )
            if out is None:
                out, lse = part_out.float(), part_lse.float().contiguous()
            else:
                _merge(out, lse, part_out, part_lse, rows)
        ring.wait(requests)
        if incoming is not None:
            kv = tuple(incoming)
    return out.to(q.dtype), lse


def _ring_backward(dout, dlse, q, k, v, out, lse, ring: _Ring, layout, causal, scale, softcap, backend):
    seqlen = q.shape[1]
    dq = torch.zeros_like(q, dtype=torch.float32)
    # The dK/dV accumulators of the shard in hand travel with it: this rank's own (zeros) at the
    # first step, then the ones the previous rank sent on after its step, which arrive while this
    # step computes its part. After the last step one more hop brings them home (rank r then
    # holds the gradients of its own shard); alone, they are home already.
    acc = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
    acc_requests = []
    kv = (k, v)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming, requests = ring.start(kv, tag=_KV_TAG) if step + 1 < ring.world else (None, [])
        grads = []  # this step's (keys, dK, dV), computed before the accumulators are waited for
        for rows, keys, blk_causal in _blocks(layout, causal, ring.rank, src, seqlen):
            g_q, g_k, g_v = torch.ops.cute_flash.bwd(
                dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], lse[:, :, rows],
                None if dlse is None else dlse[:, :, rows].contiguous(), None, None, None, blk_causal, scale,
                [-1, 0 if blk_causal else -1], softcap, None, None, False, backend,
            )
            dq[:, rows] += g_q
            grads.append((keys, g_k, g_v))
        ring.wait(acc_requests)
        for keys, g_k, g_v in grads:
            acc[0][:, keys] += g_k
            acc[1][:, keys] += g_v
        if ring.world > 1:  # on to the next rank, in flight during its next step
            acc, acc_requests = ring.start(acc, tag=_GRAD_TAG)
        ring.wait(requests)
        if incoming is not None:
            kv = tuple(incoming)
    ring.wait(acc_requests)
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, scale, softcap, backend):
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, ring, layout, causal, scale, softcap, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (group, layout, causal, scale, softcap, backend)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal, scale, softcap, backend = ctx.config
        grads = _ring_backward(dout, dlse, q, k, v, out, lse, _Ring(group), layout, causal, scale, softcap, backend)
        return grads + (None,) * 6


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    mesh_dim: Optional[int] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    layout: str = "contiguous",
    return_lse: bool = False,
    backend: Optional[str] = None,
):
    """Attention over a sequence sharded across the ranks of `group` (differentiable).

    q (batch, seqlen_local, nheads, d) and k, v (batch, seqlen_local, nheads_k, d|dv) are this
    rank's shards, cut by `shard_sequence(x, rank, world, layout)`; the result is this rank's
    shard of the output (and of the LSE, (batch, nheads, seqlen_local), with `return_lse`).
    `group` is a process group (default: the world) or a DeviceMesh, with `mesh_dim` naming
    its dimension. Every rank must call it with shards of the same shape.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_attention needs an initialized torch.distributed process group")
    group = _resolve_group(group, mesh_dim)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__} {return_lse!r}")
    # The local shard must be a valid attention call in its own right.
    call = api.validate(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap, backend=backend)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local sequence length (two chunks); got {q.shape[1]}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q and k shards must have the same length; got {q.shape[1]} and {k.shape[1]}")
    out, lse = _RingAttention.apply(q, k, v, group, layout, causal, call.args.softmax_scale, float(softcap), backend)
    return (out, lse) if return_lse else out


__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "LAYOUTS"]
