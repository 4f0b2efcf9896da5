"""The reference backend against a naive float64 softmax(QKᵀ)V, through the public API."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cute_flash
from reference_math import naive_attention

F64 = torch.float64


def _rand(*shape, dtype=F64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@st.composite
def problems(draw):
    hk = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([1, 2, 4, 8, 3]))
    d = draw(st.integers(1, 32)) * 8
    dv = draw(st.sampled_from([d, draw(st.integers(1, 32)) * 8]))
    causal = draw(st.booleans())
    left = draw(st.sampled_from([-1, 0, 1, 7, 33]))
    right = 0 if causal else draw(st.sampled_from([-1, 0, 3, 40]))
    return dict(
        batch=draw(st.integers(1, 3)),
        seqlen_q=draw(st.integers(1, 70)),
        seqlen_k=draw(st.integers(1, 70)),
        nheads_k=hk,
        nheads=hk * ratio,
        d=d,
        dv=dv,
        causal=causal,
        window=(left, right),
        softcap=draw(st.sampled_from([0.0, 0.0, 2.5, 30.0])),
        scale=draw(st.sampled_from([None, 0.07, 1.3])),
    )


def _inputs(p, seed=0):
    q = _rand(p["batch"], p["seqlen_q"], p["nheads"], p["d"], seed=seed)
    k = _rand(p["batch"], p["seqlen_k"], p["nheads_k"], p["d"], seed=seed + 1)
    v = _rand(p["batch"], p["seqlen_k"], p["nheads_k"], p["dv"], seed=seed + 2)
    return q, k, v


def _kwargs(p):
    return dict(causal=p["causal"], window_size=p["window"], softcap=p["softcap"], softmax_scale=p["scale"])


def _naive(p, q, k, v):
    scale = p["scale"] if p["scale"] is not None else p["d"] ** -0.5
    return naive_attention(q, k, v, scale, p["window"][0], p["window"][1], p["softcap"])


@given(problems())
def test_forward_matches_naive_float64(p):
    q, k, v = _inputs(p)
    out, lse = cute_flash.forward(q, k, v, return_lse=True, **_kwargs(p))
    ref_out, ref_lse = _naive(p, q, k, v)
    assert out.dtype == F64 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # fully masked rows: -inf
    torch.testing.assert_close(lse.double().nan_to_num(0, neginf=0), ref_lse.nan_to_num(0, neginf=0), atol=1e-5, rtol=1e-6)


@given(problems())
def test_float32_and_half_inputs_within_rounding(p):
    q, k, v = _inputs(p)
    ref_out, _ = _naive(p, q, k, v)
    out32 = cute_flash.forward(q.float(), k.float(), v.float(), **_kwargs(p))
    torch.testing.assert_close(out32.double(), ref_out, atol=2e-5, rtol=1e-4)
    out16 = cute_flash.forward(q.half(), k.half(), v.half(), **_kwargs(p))
    assert out16.dtype == torch.float16
    # One fp16 rounding of the inputs and one of the output (fp32 math in between).
    ref16, _ = _naive(p, q.half(), k.half(), v.half())
    torch.testing.assert_close(out16.double(), ref16, atol=2e-3, rtol=2e-3)


def test_fully_masked_rows_give_zero_and_minus_inf():
    # seqlen_q > seqlen_k with causal: the first seqlen_q - seqlen_k rows see no key.
    q, k, v = _rand(2, 9, 2, 16), _rand(2, 4, 2, 16, seed=1), _rand(2, 4, 2, 16, seed=2)
    out, lse = cute_flash.forward(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :5] == 0) and torch.all(lse[:, :, :5] == -math.inf)
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 5:]).all()
    assert (out[:, 5:] != 0).any()


def _pack(tensors):
    return torch.cat(tensors, dim=0), torch.tensor([0] + [t.shape[0] for t in tensors], dtype=torch.int32).cumsum(0, dtype=torch.int32)


@given(problems(), st.lists(st.integers(0, 40), min_size=1, max_size=4), st.lists(st.integers(0, 40), min_size=4, max_size=4))
def test_varlen_equals_each_sequence_alone(p, lens_q, lens_k):
    lens_k = lens_k[: len(lens_q)]
    qs = [_rand(n, p["nheads"], p["d"], seed=i) for i, n in enumerate(lens_q)]
    ks = [_rand(n, p["nheads_k"], p["d"], seed=10 + i) for i, n in enumerate(lens_k)]
    vs = [_rand(n, p["nheads_k"], p["dv"], seed=20 + i) for i, n in enumerate(lens_k)]
    (q, cu_q), (k, cu_k), (v, _) = _pack(qs), _pack(ks), _pack(vs)
    out, lse = cute_flash.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **_kwargs(p))
    assert lse.shape == (p["nheads"], q.shape[0])
    for b in range(len(lens_q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref_out, ref_lse = _naive(p, qs[b][None], ks[b][None], vs[b][None])
        torch.testing.assert_close(out[rows], ref_out[0], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse[:, rows].double(), ref_lse[0].float().double(), atol=1e-5, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_kv_equals_contiguous(page_size, causal):
    batch, seqlen_q, nheads, nheads_k, d = 3, 5, 4, 2, 32
    seqused = torch.tensor([130, 1, 77], dtype=torch.int32)
    max_pages = -(-int(seqused.max()) // page_size)
    k_full = _rand(batch, max_pages * page_size, nheads_k, d, seed=1)
    v_full = _rand(batch, max_pages * page_size, nheads_k, d, seed=2)
    # Scatter every sequence's pages to shuffled places of a larger pool filled with NaN.
    num_pages = batch * max_pages + 5
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3))[: batch * max_pages]
    page_table = perm.view(batch, max_pages).to(torch.int32)
    k_cache = torch.full((num_pages, page_size, nheads_k, d), math.nan, dtype=F64)
    v_cache = torch.full_like(k_cache, math.nan)
    for b in range(batch):
        used = -(-int(seqused[b]) // page_size)
        for p in range(used):
            k_cache[page_table[b, p]] = k_full[b, p * page_size : (p + 1) * page_size]
            v_cache[page_table[b, p]] = v_full[b, p * page_size : (p + 1) * page_size]
        page_table[b, used:] = -1  # unused entries may hold anything
    q = _rand(batch, seqlen_q, nheads, d)
    out = cute_flash.forward(q, k_cache, v_cache, page_table=page_table, seqused_k=seqused, causal=causal)
    ref = cute_flash.forward(q, k_full, v_full, seqused_k=seqused, causal=causal)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert not out.isnan().any()


@given(problems(), st.data())
def test_seqused_k_equals_truncated_keys(p, data):
    q, k, v = _inputs(p)
    used = [data.draw(st.integers(0, p["seqlen_k"])) for _ in range(p["batch"])]
    out = cute_flash.forward(q, k, v, seqused_k=torch.tensor(used, dtype=torch.int32), **_kwargs(p))
    for b, n in enumerate(used):
        ref, _ = _naive(p, q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n])
        torch.testing.assert_close(out[b : b + 1], ref, atol=1e-10, rtol=1e-10)


@given(problems())
def test_backward_matches_autograd_of_naive(p):
    q, k, v = (t.requires_grad_() for t in _inputs(p))
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **_kwargs(p))
    dout = _rand(*out.shape, seed=7)
    dlse = _rand(*lse.shape, seed=8).float()
    live = torch.isfinite(lse)
    grads = torch.autograd.grad((out * dout).sum() + (lse.masked_fill(~live, 0) * dlse).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _naive(p, q2, k2, v2)
    ref_loss = (ref_out * dout).sum() + (ref_lse.masked_fill(~live, 0) * dlse.double()).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q2, k2, v2))
    # P is recomputed from the float32 LSE: an error of |lse| * 2^-24 in the exponent, so the
    # gradients carry float32-level error relative to their own scale.
    for g, r in zip(grads, ref_grads):
        r = r.nan_to_num(0)
        torch.testing.assert_close(g, r, atol=2e-5 * max(1.0, r.abs().max().item()), rtol=1e-4)


def test_varlen_backward_equals_each_sequence_alone():
    lens_q, lens_k = [3, 0, 17], [5, 9, 1]
    qs = [_rand(n, 4, 16, seed=i).requires_grad_() for i, n in enumerate(lens_q)]
    ks = [_rand(n, 2, 16, seed=10 + i).requires_grad_() for i, n in enumerate(lens_k)]
    vs = [_rand(n, 2, 24, seed=20 + i).requires_grad_() for i, n in enumerate(lens_k)]
    (q, cu_q), (k, cu_k), (v, _) = _pack(qs), _pack(ks), _pack(vs)
    out = cute_flash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    dout = _rand(*out.shape, seed=5)
    (out * dout).sum().backward()
    for b in range(3):
        ref, _ = naive_attention(qs[b][None], ks[b][None], vs[b][None], 0.25, -1, 0)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        gq, gk, gv = torch.autograd.grad((ref[0] * dout[rows]).sum(), (qs[b], ks[b], vs[b]), allow_unused=True)
        for got, want in ((qs[b].grad, gq), (ks[b].grad, gk), (vs[b].grad, gv)):
            torch.testing.assert_close(got, want if want is not None else torch.zeros_like(got), atol=1e-5, rtol=1e-5)


def test_long_causal_runs_in_bounded_memory():
    """1 x 16384 x 8 x 64 causal: the full score matrix alone would need 8 GiB of float32."""
    code = (
        "import torch, resource, cute_flash\n"
        "torch.manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 16384, 8, 64, dtype=torch.bfloat16) for _ in range(3))\n"
        "out = cute_flash.forward(q, k, v, causal=True)\n"
        "assert torch.isfinite(out).all()\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    peak_kib = int(res.stdout.split()[-1])
    assert peak_kib < 2 * 1024 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"


def test_window_minus_one_zero_is_causal():
    from cute_flash import api

    q = _rand(1, 5, 2, 16)
    call = api.validate(q, q, q, window_size=(-1, 0))
    assert call.args.causal and (call.args.window_left, call.args.window_right) == (-1, 0)
    torch.testing.assert_close(cute_flash.forward(q, q, q, window_size=(-1, 0)), cute_flash.forward(q, q, q, causal=True))
