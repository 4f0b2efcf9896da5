"""A naive float64 attention used to check the reference backend: the full score matrix,
torch.softmax, explicit masks. Deliberately nothing in common with the chunked code."""

import math

import torch


def naive_attention(q, k, v, scale, left=-1, right=-1, softcap=0.0):
    """q (b, sq, h, d), k/v (b, sk, hk, d|dv) -> out (b, sq, h, dv), lse (b, h, sq), float64."""
    q, k, v = q.double(), k.double(), v.double()
    sq, h, sk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows: NaN -> 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse
