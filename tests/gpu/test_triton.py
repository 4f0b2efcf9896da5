"""The Triton backend (the HIP fallback) on an NVIDIA GPU against the reference oracle.

Tolerance (DESIGN.md, `attention_oracle`): max|x - ref| <= 2 * max|x_torch - ref| + atol for the
output and each gradient, `ref` in float64, `x_torch` the reference code in the input dtype.
Every output is poisoned with NaN before the call, K/V sit inside NaN-filled buffers (rows
before and after, columns after) and q is a slice of a packed qkv tensor, so a read outside a
tensor or an unwritten element shows.
"""

from __future__ import annotations

import math

import pytest
import torch

import cute_flash
from attention_oracle import check_backward, check_forward, randn_in_nan
from cute_flash import api

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def backend():
    pytest.importorskip("triton")
    from cute_flash.backends.triton import TritonBackend

    return TritonBackend()


def _q_of_packed_qkv(rows_shape, nheads, nheads_k, d, dtype):
    """q as the first heads of a packed (..., nheads + 2 nheads_k, d) projection: non-contiguous."""
    qkv = torch.randn(*rows_shape, nheads + 2 * nheads_k, d, dtype=dtype, device="cuda")
    return qkv[..., :nheads, :]


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _problem(dtype=BF16, batch=2, seqlen_q=113, seqlen_k=203, nheads=4, nheads_k=2, d=64, dv=None,
             seqlens_q=None, seqlens_k=None, seqused_k=None, **kw):
    dv = d if dv is None else dv
    if seqlens_q is not None:
        cu_q, cu_k = _cu(seqlens_q), _cu(seqlens_k)
        q = _q_of_packed_qkv((int(cu_q[-1]),), nheads, nheads_k, d, dtype)
        k = randn_in_nan((int(cu_k[-1]), nheads_k, d), dtype, row_dim=0, pad_rows=37)
        v = randn_in_nan((int(cu_k[-1]), nheads_k, dv), dtype, row_dim=0, pad_rows=37, pad_cols=24)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k))
    else:
        q = _q_of_packed_qkv((batch, seqlen_q), nheads, nheads_k, d, dtype)
        k = randn_in_nan((batch, seqlen_k, nheads_k, d), dtype, row_dim=1, pad_rows=37)
        v = randn_in_nan((batch, seqlen_k, nheads_k, dv), dtype, row_dim=1, pad_rows=37, pad_cols=24)
    if seqused_k is not None:
        kw["seqused_k"] = torch.tensor(seqused_k, dtype=torch.int32, device="cuda")
    call = api.validate(q, k, v, backend="triton", check=True, **kw)
    return q, k, v, call


def _forward(backend, q, k, v, call):
    out = torch.full(call.out_shape, math.nan, dtype=q.dtype, device="cuda")
    lse = torch.full(call.lse_shape, math.nan, dtype=torch.float32, device="cuda")
    backend.fwd(q, k, v, out, lse, call.args)
    return out, lse


def _backward(backend, dout, q, k, v, out, lse, dlse, call, deterministic=False):
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    backend.bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, call.args, deterministic)
    return dq, dk, dv


def _check(backend, q, k, v, call, with_dlse=True):
    out, lse = _forward(backend, q, k, v, call)
    ref_out, ref_lse = check_forward(out, lse, q, k, v, call.args)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    grads = _backward(backend, dout, q, k, v, out, lse, dlse, call)
    check_backward(grads, dout, dlse, q, k, v, ref_out, ref_lse, call.args)


def _causal(causal):
    return dict(causal=True) if causal else {}


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 777), (113, 203), (239, 1), (799, 3), (1024, 1024)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_headdims_and_seqlens(backend, dtype, d, causal, seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q + seqlen_k + d)
    _check(backend, *_problem(dtype, seqlen_q=seqlen_q, seqlen_k=seqlen_k, d=d, **_causal(causal)))


@pytest.mark.parametrize("nheads,nheads_k", [(6, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa(backend, nheads, nheads_k, causal):
    torch.manual_seed(nheads + nheads_k)
    _check(backend, *_problem(BF16, batch=3, seqlen_q=257, seqlen_k=300, nheads=nheads, nheads_k=nheads_k, d=128,
                              **_causal(causal)))


@pytest.mark.parametrize("window", [(16, 0), (64, 64), (-1, 32), (100, -1), (0, 0), (200, 7)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (500, 130), (1000, 1000)])
@pytest.mark.parametrize("d", [64, 128])
def test_sliding_window(backend, d, seqlen_q, seqlen_k, window):
    torch.manual_seed(sum(window) + seqlen_q + d)
    _check(backend, *_problem(F16, seqlen_q=seqlen_q, seqlen_k=seqlen_k, d=d, window_size=window))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap(backend, d, causal):
    torch.manual_seed(d)
    q, k, v, call = _problem(BF16, seqlen_q=333, seqlen_k=517, d=d, softcap=15.0, **_causal(causal))
    q.mul_(3)
    _check(backend, q, k, v, call)


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_and_seqused_k(backend, d, causal, seqused):
    torch.manual_seed(d + causal + 2 * seqused)
    seqlens_q, seqlens_k = [1, 300, 0, 77, 513], [180, 299, 64, 0, 700]
    used = [150, 299, 0, 0, 333] if seqused else None
    _check(backend, *_problem(F16, nheads=6, nheads_k=2, d=d, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                              seqused_k=used, **_causal(causal)))


def test_seqused_k_in_a_fixed_size_cache(backend):
    torch.manual_seed(7)
    _check(backend, *_problem(BF16, batch=4, seqlen_q=5, seqlen_k=1000, d=128, seqused_k=[1000, 0, 17, 640],
                              causal=True))


@pytest.mark.parametrize("d,dv", [(64, 128), (128, 64), (192, 128), (40, 72), (256, 32), (32, 32), (8, 16)])
def test_headdim_v_and_small_headdims(backend, d, dv):
    torch.manual_seed(d * dv)
    _check(backend, *_problem(F16, seqlen_q=200, seqlen_k=333, d=d, dv=dv, causal=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 128, 256])
def test_float32(backend, d, causal):
    torch.manual_seed(d)
    _check(backend, *_problem(F32, seqlen_q=150, seqlen_k=190, d=d, **_causal(causal)))


def test_backward_without_lse_gradient(backend):
    _check(backend, *_problem(F16, causal=True), with_dlse=False)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_output_is_rounded_to_nearest_even(backend, dtype):
    """q = 0 makes every row the plain mean of 64 values of V from a 2^-6 grid in [1, 2]: exact
    in fp32, a multiple of 2^-12 near 1.5, so rounding to 16 bits has ties and near-ties and
    only round-to-nearest-even matches."""
    q = torch.zeros(2, 300, 4, 64, dtype=dtype, device="cuda")
    k = torch.randn(2, 64, 4, 64, dtype=dtype, device="cuda")
    v = (1 + torch.randint(0, 65, (2, 64, 4, 128), device="cuda") / 64).to(dtype)
    call = api.validate(q, k, v, backend="triton")
    out, _ = _forward(backend, q, k, v, call)
    exact = v.double().mean(1, keepdim=True).expand_as(out)
    assert torch.equal(out, exact.to(dtype))


def test_backward_is_bitwise_reproducible(backend):
    torch.manual_seed(11)
    q, k, v, call = _problem(BF16, batch=2, seqlen_q=700, seqlen_k=900, nheads=8, nheads_k=1, d=128)
    out, lse = _forward(backend, q, k, v, call)
    dout = torch.randn_like(out)
    first = _backward(backend, dout, q, k, v, out, lse, None, call, deterministic=True)
    for _ in range(3):
        again = _backward(backend, dout, q, k, v, out, lse, None, call, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_unaligned_pointers_and_odd_strides(backend):
    """The backend asks for no alignment: q, k, v start 2 bytes into their buffers, with odd strides."""
    torch.manual_seed(13)
    qkv = torch.randn(2, 301, 3, 5, 129, dtype=F16, device="cuda")[..., 1:129]
    q, k, v = qkv.unbind(2)
    assert q.data_ptr() % 4 and q.stride(2) % 2
    call = api.validate(q, k, v, backend="triton", causal=True)
    _check(backend, q, k, v, call)


@pytest.mark.big_memory
def test_offsets_past_2_to_the_31_elements(backend):
    """Keys at element offsets >= 2^31 (4 GiB of fp16 per tensor): 64-bit address arithmetic.
    A window keeps the work at the end of the keys; the oracle sees only that tail, which
    under bottom-right alignment is the same problem."""
    nheads, d, seqlen_q, tail = 64, 128, 64, 512
    seqlen_k = 2**31 // (nheads * d) + 4096
    q = torch.randn(1, seqlen_q, nheads, d, dtype=BF16, device="cuda")
    k = torch.empty(1, seqlen_k, nheads, d, dtype=BF16, device="cuda")
    v = torch.empty_like(k)
    for t in (k, v):
        t[:, :-tail].fill_(math.nan)  # never read: outside every row's window
        t[:, -tail:].normal_()
    call = api.validate(q, k, v, backend="triton", window_size=(256, 0))
    out, lse = _forward(backend, q, k, v, call)
    k_tail, v_tail = k[:, -tail:], v[:, -tail:]
    tail_call = api.validate(q, k_tail, v_tail, backend="triton", window_size=(256, 0))
    ref_out, ref_lse = check_forward(out, lse, q, k_tail, v_tail, tail_call.args)
    dout = torch.randn_like(out)
    dq, dk, dv = _backward(backend, dout, q, k, v, out, lse, None, call)
    assert (dk[:, :-tail] == 0).all() and (dv[:, :-tail] == 0).all()
    check_backward((dq, dk[:, -tail:], dv[:, -tail:]), dout, None, q, k_tail, v_tail, ref_out, ref_lse,
                   tail_call.args)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_public_api_forward_and_autograd(dtype):
    """cute_flash.forward / attention with backend="triton": validation, custom ops, autograd,
    and a gradient flowing into the returned LSE."""
    pytest.importorskip("triton")
    torch.manual_seed(17)
    q, k, v = (torch.randn(2, 190, 4, 64, dtype=dtype, device="cuda", requires_grad=True) for _ in range(3))
    out, lse = cute_flash.attention(q, k, v, causal=True, return_lse=True, backend="triton")
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    call = api.validate(q, k, v, causal=True, backend="triton")
    ref_out, ref_lse = check_forward(out.detach(), lse.detach(), q.detach(), k.detach(), v.detach(), call.args)
    check_backward((q.grad, k.grad, v.grad), dout, dlse, q.detach(), k.detach(), v.detach(), ref_out, ref_lse,
                   call.args)
    with torch.no_grad():
        again = cute_flash.forward(q, k, v, causal=True, backend="triton")
    assert torch.equal(again, out)

