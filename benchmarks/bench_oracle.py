"""The check a provider passes before it is timed: its result on a slice of the case against
cute_flash's reference in float32, with DESIGN.md's tolerance.

The slice (the first sequence and at most four heads for the forward modes, the first four
sequences for decode) keeps the oracle cheap on large shapes; the provider still runs on the
whole batch. `out_torch`, the yardstick of the tolerance, is the same attention in plain torch
in the input dtype (matmul, softmax, matmul; queries in chunks to bound memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from bench_lib import Case, within_tolerance
from cute_flash.backends.base import AttnArgs
from cute_flash.backends.reference import reference_attention, reference_attention_backward

CHECK_HEADS = 4
CHECK_DECODE_BATCH = 4
_QUERY_CHUNK = 1024


def attn_args(case: Case, page_table: Optional[torch.Tensor] = None) -> AttnArgs:
    return AttnArgs(softmax_scale=case.headdim ** -0.5, causal=case.causal, window_right=0 if case.causal else -1,
                    page_table=page_table)


@dataclass
class Slice:
    """Which part of the outputs is checked: batch rows [:batch], heads [:heads] (KV heads [:heads_k])."""

    batch: int
    heads: int
    heads_k: int

    @classmethod
    def of(cls, case: Case) -> "Slice":
        if case.mode == "decode":
            return cls(min(case.batch, CHECK_DECODE_BATCH), case.nheads, case.nheads_k)
        heads = min(case.nheads, CHECK_HEADS)
        assert case.nheads == case.nheads_k, "forward modes are benchmarked without GQA"
        return cls(1, heads, heads)

    def q(self, t: torch.Tensor) -> torch.Tensor:
        return t[: self.batch, :, : self.heads]

    def kv(self, t: torch.Tensor) -> torch.Tensor:
        return t[: self.batch, :, : self.heads_k]


def torch_attention(q, k, v, causal: bool, softmax_scale: float) -> torch.Tensor:
    """Plain attention in the inputs' dtype, (b, s, h, d) in and out; differentiable."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    sq, sk = q.shape[1], k.shape[1]
    chunks = []
    for lo in range(0, sq, _QUERY_CHUNK):
        hi = min(sq, lo + _QUERY_CHUNK)
        s = torch.matmul(qt[:, :, lo:hi], kt.transpose(-1, -2)) * softmax_scale
        if causal:
            rows = torch.arange(lo, hi, device=q.device)[:, None] + (sk - sq)
            s = s.masked_fill(torch.arange(sk, device=q.device)[None, :] > rows, -math.inf)
        chunks.append(torch.matmul(torch.softmax(s, dim=-1), vt))
    return torch.cat(chunks, dim=2).transpose(1, 2)


class Oracle:
    """Reference results of one case's slice, computed once and shared by every provider."""

    def __init__(self, case: Case, q, k, v, dout=None, page_table=None):
        self.case, self.slice = case, Slice.of(case)
        self.dtype = q.dtype
        sl = self.slice
        if page_table is not None:
            # A paged cache is checked through its first sequences' pages.
            pt = page_table[: sl.batch]
            args = attn_args(case, pt)
            q_s = sl.q(q)
            self.ref_out, _ = reference_attention(q_s, k, v, args, torch.float32)
            k_c = k[pt.long()].flatten(1, 2)[:, : case.seqlen_k]
            v_c = v[pt.long()].flatten(1, 2)[:, : case.seqlen_k]
            self.torch_out = torch_attention(q_s, k_c, v_c, case.causal, args.softmax_scale)
            self.grads = None
            return
        q_s, k_s, v_s = sl.q(q).detach(), sl.kv(k).detach(), sl.kv(v).detach()
        args = attn_args(case)
        ref_out, ref_lse = reference_attention(q_s, k_s, v_s, args, torch.float32)
        self.ref_out = ref_out
        self.grads = None
        if dout is None:
            with torch.no_grad():
                self.torch_out = torch_attention(q_s, k_s, v_s, case.causal, args.softmax_scale)
            return
        dout_s = sl.q(dout)
        self.ref_grads = reference_attention_backward(dout_s, q_s, k_s, v_s, ref_out, ref_lse, None, args,
                                                      torch.float32)
        leaves = [t.clone().requires_grad_(True) for t in (q_s, k_s, v_s)]
        out_t = torch_attention(*leaves, case.causal, args.softmax_scale)
        out_t.backward(dout_s)
        self.torch_out = out_t.detach()
        self.torch_grads = [t.grad for t in leaves]
        self.grads = True

    def check(self, out: torch.Tensor, grads=None) -> tuple:
        """(passed, max_err, tolerance, what failed) for a provider's full-batch out (and grads)."""
        sl = self.slice
        passed, err, tol = within_tolerance(sl.q(out), self.ref_out, self.torch_out, self.dtype)
        if not passed:
            return False, err, tol, "out"
        if self.grads is None or grads is None:
            return True, err, tol, ""
        worst = (err, tol)
        for name, g, ref, g_torch, take in zip(("dq", "dk", "dv"), grads, self.ref_grads, self.torch_grads,
                                               (sl.q, sl.kv, sl.kv)):
            if g is None:
                return False, math.nan, math.nan, f"{name} missing"
            ok, e, t = within_tolerance(take(g), ref, g_torch, self.dtype)
            if not ok:
                return False, e, t, name
            if e / max(t, 1e-30) > worst[0] / max(worst[1], 1e-30):
                worst = (e, t)
        return True, worst[0], worst[1], ""
