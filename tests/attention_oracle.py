"""The tolerance rule of DESIGN.md, applied to a backend's forward outputs and gradients.

    max|x - ref| <= 2 * max|x_torch - ref| + atol

`ref` is the reference backend in float64 (the oracle) and `x_torch` the same computation by
the reference code in the input dtype: the error that plain PyTorch makes at that precision.
`atol` is fixed per dtype (2^-10 fp16, 2^-7 bf16: the values the H200 runs passed with; the
benchmark takes FlashAttention's tighter, data-measured one). The LSE is float32 from fp32 scores
whatever the input dtype, so it gets a fixed, tight bound.
Every check first rejects NaN, so an output that was poisoned and never written fails.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import torch

from cute_flash.backends.base import AttnArgs
from cute_flash.backends.reference import reference_attention, reference_attention_backward

ATOL = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 1e-5}

# (seqlen_q, seqlen_k) pairs every kernel is checked on: single rows, tails on both sides,
# seqlen_q above and below seqlen_k (bottom-right causal), and a long pair off the tile grid.
SEQLEN_PAIRS = [(1, 1), (1, 4097), (113, 203), (239, 1), (799, 3), (1023, 1024), (4224, 4224)]


def randn_in_nan(shape, dtype, row_dim=1, pad_rows=67, pad_cols=8, device="cuda"):
    """A random tensor viewed inside a larger NaN buffer (rows around it, columns after it), so
    that a read past its rows or head dim shows up as NaN in whatever consumed it."""
    full = list(shape)
    full[row_dim] += 2 * pad_rows
    full[-1] += pad_cols
    buf = torch.full(full, float("nan"), dtype=dtype, device=device)
    index = [slice(None)] * len(shape)
    index[row_dim] = slice(pad_rows, pad_rows + shape[row_dim])
    index[-1] = slice(0, shape[-1])
    view = buf[tuple(index)]
    view.copy_(torch.randn(shape, dtype=dtype, device=device))
    return view


def backend_or_skip(cls):
    """An instance of backend class `cls`, or a pytest skip saying why it cannot run here."""
    import pytest

    backend = cls()
    reason = backend.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return backend


def nan_framed_kv(batch, seqlen_k, nheads_k, d, dv, dtype, varlen=False):
    """k and v inside NaN (67 rows before and after) with different row strides (8 and 24
    padding columns), batched or packed (varlen)."""
    if varlen:
        shape_k, shape_v, row_dim = (seqlen_k, nheads_k, d), (seqlen_k, nheads_k, dv), 0
    else:
        shape_k, shape_v, row_dim = (batch, seqlen_k, nheads_k, d), (batch, seqlen_k, nheads_k, dv), 1
    k = randn_in_nan(shape_k, dtype, row_dim=row_dim, pad_rows=67, pad_cols=8)
    v = randn_in_nan(shape_v, dtype, row_dim=row_dim, pad_rows=67, pad_cols=24)
    return k, v


def poison_fresh_float_buffers(monkeypatch) -> None:
    """From here to the end of the test every float tensor from torch.empty / torch.empty_like is
    NaN-filled, so a kernel that reads a buffer its host code allocated before any kernel wrote it
    (a dQ accumulator not cleared, row statistics not computed) turns the result NaN."""
    def poisoned(make):
        def make_poisoned(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return make_poisoned

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


def small_backward_case(d: int, varlen: bool) -> tuple:
    """(q, k, v, AttnArgs keywords) of a small bf16 GQA backward case: 2 x 257 queries over 300
    NaN-framed keys, or five packed sequences (one empty) with a causal mask."""
    if varlen:
        seqlens_q, seqlens_k = [113, 0, 300, 64, 7], [203, 5, 333, 64, 300]
        cu_q = torch.tensor([0] + torch.tensor(seqlens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0] + torch.tensor(seqlens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q = torch.randn(int(cu_q[-1]), 4, d, dtype=torch.bfloat16, device="cuda")
        k, v = nan_framed_kv(None, int(cu_k[-1]), 2, d, d, torch.bfloat16, varlen=True)
        return q, k, v, dict(causal=True, window_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k))
    q = torch.randn(2, 257, 4, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, 300, 2, d, d, torch.bfloat16)
    return q, k, v, {}


def poisoned_backward_case(monkeypatch, d: int, varlen: bool) -> tuple:
    """`small_backward_case` (seeded by d and varlen), then every fresh float buffer NaN-filled
    (`poison_fresh_float_buffers`): the backward's dQ accumulator and row statistics come from
    torch.empty and its preprocess kernel must write them (it clears the accumulator), or the
    gradients turn NaN."""
    torch.manual_seed(d + varlen)
    case = small_backward_case(d, varlen)
    poison_fresh_float_buffers(monkeypatch)
    return case


def run_forward(backend, q, k, v, args: AttnArgs):
    """(out, lse) of `backend.fwd`, both poisoned with NaN before the call."""
    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse_shape = (q.shape[1], q.shape[0]) if args.cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(lse_shape, float("nan"), dtype=torch.float32, device=q.device)
    backend.fwd(q, k, v, out, lse, args)
    torch.cuda.synchronize()
    return out, lse


def grow_row_max(q: torch.Tensor, k: torch.Tensor, args: AttnArgs) -> None:
    """Add (in place) a ramp that raises every row's max by ~5 (log2 units) per 128 keys in the
    order the kernels visit them (last key block first); q and k in batch mode."""
    q[..., 0] = 8.0
    per_key = 5.0 / 128 / (8 * args.softmax_scale * math.log2(math.e))
    ramp = per_key * torch.arange(k.shape[1] - 1, -1, -1, device=k.device)
    k[..., 0] = ramp.to(k.dtype)[None, :, None]


def check_rescale_schedule(monkeypatch, backend, q, k, v, args: AttnArgs, growing_max: bool, lazy: bool) -> None:
    """The forward with `lazy_rescale` set to `lazy` on every configuration `backend` picks, against
    the oracle. `growing_max` adds a ramp that raises every row's max by ~5 (log2 units) per 128
    keys in the order the kernels visit them (last key block first), so that some blocks keep the
    reference and others move it."""
    plain = backend.config

    def config(*a, **kw):
        picked = plain(*a, **kw)
        # `keep_vote` votes on the lazy rescale's kept references: off with it (by the fields
        # the configuration's own module names)
        off = ({} if lazy or not getattr(picked, "keep_vote", False)
               else importlib.import_module(type(picked).__module__).NO_KEEP_VOTE)
        return replace(picked, lazy_rescale=lazy, **off)

    monkeypatch.setattr(backend, "config", config)
    if growing_max:
        grow_row_max(q, k, args)
    out, lse = run_forward(backend, q, k, v, args)
    assert backend.config(q, k, v, lse, args).lazy_rescale == lazy
    check_forward(out, lse, q, k, v, args)


def assert_within_rule(name: str, x: torch.Tensor, ref: torch.Tensor, ref_torch: torch.Tensor) -> None:
    assert not x.isnan().any(), f"{name}: {int(x.isnan().sum())} NaN (unwritten or read out of bounds)"
    err = (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0
    err_torch = (ref_torch.double() - ref.double()).abs().max().item() if x.numel() else 0.0
    bound = 2 * err_torch + ATOL[x.dtype]
    assert err <= bound, f"{name}: max|x - ref| = {err:.3e} > {bound:.3e} (torch in {x.dtype}: {err_torch:.3e})"


def _rows_of_lse(mask: torch.Tensor, args: AttnArgs) -> torch.Tensor:
    """An LSE-shaped boolean as a mask of q-shaped rows (without the head dim)."""
    return mask.transpose(0, 1) if args.cu_seqlens_q is not None else mask.transpose(1, 2)


def check_forward(out, lse, q, k, v, args: AttnArgs):
    """Check a kernel's (out, lse); returns the float64 oracle's (out, lse) for the backward."""
    ref, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float64)
    ref_torch, _ = reference_attention(q, k, v, args, compute_dtype=q.dtype)
    assert_within_rule("out", out, ref, ref_torch)
    dead = torch.isneginf(ref_lse)
    assert not lse.isnan().any(), "lse: NaN (unwritten or read out of bounds)"
    assert torch.equal(torch.isneginf(lse), dead), "lse must be -inf exactly on the rows that see no key"
    live_err = (lse.double() - ref_lse)[~dead].abs()
    bound = 1e-4 + 1e-5 * ref_lse[~dead].abs()
    assert (live_err <= bound).all(), f"lse: max error {live_err.max().item():.3e}"
    assert (out[_rows_of_lse(dead, args)] == 0).all(), "rows that see no key must have output 0"
    return ref, ref_lse


def strided_qkv(device="cuda") -> tuple:
    """Seeded bf16 q (2, 390, 4, 64) sliced out of a packed qkv tensor, k and v (2, 390, 4, 64)
    from separate buffers with other row strides (k with padded rows, v every other head)."""
    torch.manual_seed(11)
    qkv = torch.randn(2, 390, 3, 4, 64, dtype=torch.bfloat16, device=device)
    q = qkv[:, :, 0]
    k = torch.randn(2, 390, 4, 64 + 32, dtype=torch.bfloat16, device=device)[..., :64]
    v = torch.randn(2, 390, 8, 64, dtype=torch.bfloat16, device=device)[:, :, ::2]
    return q, k, v


def inputs_beyond_4gib() -> tuple:
    """q (2, 70, 8, 128) and k, v (2, 2^20 + 64, 8, 128), bf16 on the GPU, seeded: more than 2^31
    elements in k and in v, so batch 1 starts 4 GiB into each."""
    torch.manual_seed(5)
    seqlen_k = (1 << 20) + 64
    q = torch.randn(2, 70, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, seqlen_k, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(2, seqlen_k, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert k.numel() > 2**31
    return q, k, v


def check_offsets_beyond_4gib(backend) -> None:
    """K and V of more than 2^31 elements: batch 1 starts 4 GiB into each buffer.

    The output of 1M keys averages V down to ~1e-3, below bf16's absolute tolerance, so the
    oracle's LSE bound is what sees a wrong key (1.3e-3 for other random keys) or a drifting
    row sum; and batch 1 must be bit-identical to the same call on a copy of it alone, which a
    32-bit offset wrapping back into batch 0 would break.
    """
    q, k, v = inputs_beyond_4gib()
    args = AttnArgs(softmax_scale=128**-0.5, causal=True, window_right=0)
    out, lse = run_forward(backend, q, k, v, args)
    check_forward(out[1:], lse[1:], q[1:], k[1:], v[1:], args)
    alone_out, alone_lse = run_forward(backend, q[1:].clone(), k[1:].clone(), v[1:].clone(), args)
    assert torch.equal(out[1:], alone_out) and torch.equal(lse[1:], alone_lse)


def check_backward(grads, dout, dlse, q, k, v, ref_out, ref_lse, args: AttnArgs) -> None:
    """Check a kernel's (dq, dk, dv) given the oracle's forward results."""
    refs = reference_attention_backward(dout, q, k, v, ref_out, ref_lse, dlse, args, compute_dtype=torch.float64)
    out_t, lse_t = reference_attention(q, k, v, args, compute_dtype=q.dtype)
    torch_grads = reference_attention_backward(dout, q, k, v, out_t, lse_t, dlse, args, compute_dtype=q.dtype)
    for name, x, ref, ref_torch in zip(("dq", "dk", "dv"), grads, refs, torch_grads):
        assert_within_rule(name, x, ref, ref_torch)


def check_repeated_backward(backward, q, k, v, args: AttnArgs, runs: int) -> None:
    """`runs` calls of `backward(dout, out, lse)` -> (dq, dk, dv) on one set of inputs, out and LSE
    from the oracle: the first checked against it, every other one bit-identical to the first
    (a deterministic backward)."""
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.randn_like(out)
    first = backward(dout, out, lse)
    check_backward(first, dout, None, q, k, v, out, lse, args)
    for _ in range(runs - 1):
        again = backward(dout, out, lse)
        assert all(torch.equal(a, c) for a, c in zip(first, again)), "deterministic backward differs between runs"
