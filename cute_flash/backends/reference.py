"""Pure-PyTorch attention with every feature of the API: the oracle of every test.

The math is the kernels' math, in float32 (or float64 for the oracle): queries in blocks, keys
in chunks, an online softmax across chunks, so memory stays O(block_q x chunk x heads) whatever
the sequence length. Key chunks that the mask rules out for a whole query block are skipped, so
causal and windowed calls cost what the kernels cost, not the full square.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Optional

import torch

from .base import FEATURES, AttnArgs, Backend

# Upper bound on the elements of one block of scores (block_q x chunk x heads).
_SCORE_BUDGET = 1 << 22


class _Seq(NamedTuple):
    """Where one sequence of a batch lives in the caller's tensors."""

    q: object  # index of its rows in q-shaped tensors: an int (batch mode) or a slice (varlen)
    lse: tuple  # index of its (nheads, seqlen_q) block in the LSE
    pages: Optional[torch.Tensor]  # page numbers of its keys, for a paged cache
    kv: tuple  # index of its keys in k-shaped tensors (unpaged)
    seqlen_k: int

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        """Its (seqlen_k, nheads_k, d) keys or values: a view, or a gathered copy when paged."""
        if self.pages is not None:
            return t[self.pages].flatten(0, 1)[: self.seqlen_k]
        return t[self.kv]


def _key_length(args: AttnArgs, b: int, default: int) -> int:
    if args.seqused_k is not None:
        return int(args.seqused_k[b])
    if args.cu_seqlens_k is not None:
        return int(args.cu_seqlens_k[b + 1] - args.cu_seqlens_k[b])
    return default


def _sequences(q: torch.Tensor, k: torch.Tensor, args: AttnArgs) -> Iterator[_Seq]:
    """The sequences of a (possibly varlen or paged) batch."""
    cu_q = args.cu_seqlens_q.tolist() if args.cu_seqlens_q is not None else None
    batch = len(cu_q) - 1 if cu_q is not None else q.shape[0]
    for b in range(batch):
        if cu_q is not None:
            rows = slice(cu_q[b], cu_q[b + 1])
            q_index, lse_index = rows, (slice(None), rows)
        else:
            q_index, lse_index = b, (b,)
        pages, kv_index = None, ()
        if args.page_table is not None:
            page_size = k.shape[1]
            seqlen_k = _key_length(args, b, args.page_table.shape[1] * page_size)
            pages = args.page_table[b, : -(-seqlen_k // page_size)].long()
        elif args.cu_seqlens_k is not None:
            start = int(args.cu_seqlens_k[b])
            seqlen_k = _key_length(args, b, 0)
            kv_index = (slice(start, start + seqlen_k),)
        else:
            seqlen_k = _key_length(args, b, k.shape[1])
            kv_index = (b, slice(0, seqlen_k))
        yield _Seq(q_index, lse_index, pages, kv_index, seqlen_k)


def _key_range(args: AttnArgs, q_lo: int, q_hi: int, seqlen_q: int, seqlen_k: int):
    """Keys [lo, hi) that any query row in [q_lo, q_hi) may attend (bottom-right aligned)."""
    shift = seqlen_k - seqlen_q
    lo = 0 if args.window_left < 0 else max(0, q_lo + shift - args.window_left)
    hi = seqlen_k if args.window_right < 0 else min(seqlen_k, q_hi - 1 + shift + args.window_right + 1)
    return lo, hi


def _mask(args: AttnArgs, q_lo, q_hi, k_lo, k_hi, seqlen_q, seqlen_k, device):
    """Boolean (q_hi-q_lo, k_hi-k_lo) mask of allowed scores, or None when all are allowed."""
    if args.window_left < 0 and args.window_right < 0:
        return None
    rows = torch.arange(q_lo, q_hi, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(k_lo, k_hi, device=device)[None, :]
    allowed = torch.ones(q_hi - q_lo, k_hi - k_lo, dtype=torch.bool, device=device)
    if args.window_left >= 0:
        allowed &= cols >= rows - args.window_left
    if args.window_right >= 0:
        allowed &= cols <= rows + args.window_right
    return allowed


def _scores(q_blk, k_chk, args: AttnArgs):
    """Scores (hk, g, bq, bk) after scaling and soft-capping, plus tanh for the backward."""
    s = torch.einsum("qhgd,khd->hgqk", q_blk, k_chk) * args.softmax_scale
    if args.softcap > 0:
        t = torch.tanh(s / args.softcap)
        return t * args.softcap, t
    return s, None


def _blocks(seqlen_q: int, nheads: int, seqlen_k: int):
    """Block sizes (rows, keys) whose product with the heads stays within the score budget."""
    block_k = max(16, min(1024, _SCORE_BUDGET // max(1, nheads * max(1, min(seqlen_q, 256)))))
    block_q = max(1, min(max(seqlen_q, 1), _SCORE_BUDGET // (nheads * block_k)))
    return block_q, min(block_k, max(seqlen_k, 1))


def _forward_seq(q, k, v, args: AttnArgs, dtype: torch.dtype):
    """(out, lse) of one sequence: q (seqlen_q, nheads, d), k/v (seqlen_k, nheads_k, d|dv)."""
    seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k, dv = v.shape
    g = nheads // nheads_k
    out = torch.zeros(seqlen_q, nheads, dv, dtype=dtype, device=q.device)
    lse = torch.full((nheads, seqlen_q), -math.inf, dtype=dtype, device=q.device)
    block_q, block_k = _blocks(seqlen_q, nheads, seqlen_k)
    for q_lo in range(0, seqlen_q, block_q):
        q_hi = min(seqlen_q, q_lo + block_q)
        k_lo, k_hi = _key_range(args, q_lo, q_hi, seqlen_q, seqlen_k)
        if k_lo >= k_hi:
            continue
        q_blk = q[q_lo:q_hi].to(dtype).unflatten(1, (nheads_k, g))
        row_max = torch.full((nheads_k, g, q_hi - q_lo), -math.inf, dtype=dtype, device=q_blk.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(nheads_k, g, q_hi - q_lo, dv, dtype=dtype, device=q_blk.device)
        for c_lo in range(k_lo, k_hi, block_k):
            c_hi = min(k_hi, c_lo + block_k)
            s, _ = _scores(q_blk, k[c_lo:c_hi].to(dtype), args)
            allowed = _mask(args, q_lo, q_hi, c_lo, c_hi, seqlen_q, seqlen_k, s.device)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            new_max = torch.maximum(row_max, s.amax(-1))
            # A row with no allowed key so far keeps max -inf; subtract 0 there, never -inf.
            safe_max = torch.where(new_max == -math.inf, 0.0, new_max)
            p = torch.exp(s - safe_max[..., None])
            rescale = torch.exp(row_max - safe_max)
            row_sum = row_sum * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + torch.einsum("hgqk,khd->hgqd", p, v[c_lo:c_hi].to(dtype))
            row_max = new_max
        live = row_sum > 0
        out[q_lo:q_hi] = torch.where(live[..., None], acc / torch.where(live, row_sum, 1.0)[..., None], 0.0).permute(
            2, 0, 1, 3
        ).flatten(1, 2)
        lse[:, q_lo:q_hi] = torch.where(live, row_max + torch.log(row_sum), -math.inf).flatten(0, 1)
    return out, lse


def reference_attention(q, k, v, args: AttnArgs, compute_dtype: torch.dtype = torch.float32):
    """Attention of validated inputs; returns (out, lse) in `compute_dtype`, shaped like the API's."""
    varlen = args.cu_seqlens_q is not None
    nheads, dv = q.shape[-2], v.shape[-1]
    out = torch.empty(*q.shape[:-1], dv, dtype=compute_dtype, device=q.device)
    lse_shape = (nheads, q.shape[0]) if varlen else (q.shape[0], nheads, q.shape[1])
    lse = torch.empty(lse_shape, dtype=compute_dtype, device=q.device)
    for seq in _sequences(q, k, args):
        out[seq.q], lse[seq.lse] = _forward_seq(q[seq.q], seq.keys(k), seq.keys(v), args, compute_dtype)
    return out, lse


def _backward_seq(q, k, v, out, lse, dout, dlse, args: AttnArgs, dtype):
    """(dq, dk, dv) of one sequence, recomputing P from the saved LSE chunk by chunk."""
    seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k, dv = v.shape
    g = nheads // nheads_k
    dq = torch.zeros(seqlen_q, nheads, d, dtype=dtype, device=q.device)
    dk = torch.zeros(seqlen_k, nheads_k, d, dtype=dtype, device=q.device)
    dvv = torch.zeros(seqlen_k, nheads_k, dv, dtype=dtype, device=q.device)
    # D = rowsum(dO * O); d lse / d s = P folds a gradient of the LSE into the same term.
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(0, 1)  # (nheads, seqlen_q)
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    block_q, block_k = _blocks(seqlen_q, nheads, seqlen_k)
    for q_lo in range(0, seqlen_q, block_q):
        q_hi = min(seqlen_q, q_lo + block_q)
        k_lo, k_hi = _key_range(args, q_lo, q_hi, seqlen_q, seqlen_k)
        if k_lo >= k_hi:
            continue
        q_blk = q[q_lo:q_hi].to(dtype).unflatten(1, (nheads_k, g))
        do_blk = dout[q_lo:q_hi].to(dtype).unflatten(1, (nheads_k, g))
        lse_blk = lse[:, q_lo:q_hi].to(dtype).unflatten(0, (nheads_k, g))
        lse_blk = torch.where(lse_blk == -math.inf, math.inf, lse_blk)  # dead rows: P = 0, not NaN
        delta_blk = delta[:, q_lo:q_hi].unflatten(0, (nheads_k, g))
        dq_blk = torch.zeros_like(q_blk)
        for c_lo in range(k_lo, k_hi, block_k):
            c_hi = min(k_hi, c_lo + block_k)
            k_chk = k[c_lo:c_hi].to(dtype)
            s, tanh = _scores(q_blk, k_chk, args)
            allowed = _mask(args, q_lo, q_hi, c_lo, c_hi, seqlen_q, seqlen_k, s.device)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            p = torch.exp(s - lse_blk[..., None])
            dvv[c_lo:c_hi] += torch.einsum("hgqk,qhgd->khd", p, do_blk)
            dp = torch.einsum("qhgd,khd->hgqk", do_blk, v[c_lo:c_hi].to(dtype))
            ds = p * (dp - delta_blk[..., None])
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)
            ds = ds * args.softmax_scale
            dq_blk += torch.einsum("hgqk,khd->qhgd", ds, k_chk)
            dk[c_lo:c_hi] += torch.einsum("hgqk,qhgd->khd", ds, q_blk)
        dq[q_lo:q_hi] = dq_blk.flatten(1, 2)
    return dq, dk, dvv


def reference_attention_backward(dout, q, k, v, out, lse, dlse, args: AttnArgs, compute_dtype=torch.float32):
    """(dq, dk, dv) in `compute_dtype` for validated, unpaged inputs; dlse may be None."""
    if args.page_table is not None:
        raise NotImplementedError("backward with a paged KV cache (page_table) is not implemented")
    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=q.device)
    for seq in _sequences(q, k, args):
        seq_dlse = dlse[seq.lse] if dlse is not None else None
        dq[seq.q], dk[seq.kv], dv[seq.kv] = _backward_seq(
            q[seq.q], k[seq.kv], v[seq.kv], out[seq.q], lse[seq.lse], dout[seq.q], seq_dlse, args, compute_dtype
        )
    return dq, dk, dv


class ReferenceBackend(Backend):
    """Always available; float32 math (float64 inputs stay float64)."""

    name = "reference"
    features = frozenset(FEATURES)
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    alignment = 1
    stride_multiple = 1

    def fwd(self, q, k, v, out, lse, args: AttnArgs) -> None:
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=dtype)
        out.copy_(ref_out)
        lse.copy_(ref_lse)

    def bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args: AttnArgs, deterministic: bool) -> None:
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        g_q, g_k, g_v = reference_attention_backward(dout, q, k, v, out, lse, dlse, args, compute_dtype=dtype)
        dq.copy_(g_q)
        dk.copy_(g_k)
        dv.copy_(g_v)
