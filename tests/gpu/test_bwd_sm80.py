"""The sm_80 backward kernels against the float64 oracle's gradients, on a GPU (`pytest -m gpu`).

The backend's `bwd` is called directly (and once through `cute_flash.attention` and autograd). Its
inputs `out` and `lse` come from the reference forward, so a forward bug cannot hide or cause a
backward failure; the oracle's gradients are computed from the same `out` and `lse`.
Tolerance (DESIGN.md), per gradient: max|g - ref| <= 2 * max|g_torch - ref| + atol, with g_torch
the reference backward in the input dtype (`tests/attention_oracle.py`). dq, dk and dv are
poisoned with NaN before the call; K and V sit inside NaN-filled buffers with different row
strides, so that a read outside them or an unwritten gradient shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_oracle import (
    backend_or_skip, check_backward, check_repeated_backward, inputs_beyond_4gib, nan_framed_kv,
    poisoned_backward_case, randn_in_nan, strided_qkv,
)
from cute_flash.backends.base import AttnArgs
from cute_flash.backends.reference import reference_attention

pytestmark = pytest.mark.gpu

SEQLEN_PAIRS = [(1, 1), (1, 300), (113, 203), (239, 1), (128, 128), (799, 3), (1023, 1024)]
DTYPES = [torch.float16, torch.bfloat16]


def _backend(cls=None):
    from cute_flash.backends.cute import CuteSm80Backend

    return backend_or_skip(cls or CuteSm80Backend)


def _transposed_dout(shape, dtype):
    """dO as a non-contiguous view: (b, s, h, d) from a (b, h, s, d) tensor, or (t, h, d) from (h, t, d)."""
    if len(shape) == 4:
        b, s, h, d = shape
        return torch.randn(b, h, s, d, dtype=dtype, device="cuda").transpose(1, 2)
    t, h, d = shape
    return torch.randn(h, t, d, dtype=dtype, device="cuda").transpose(0, 1)


def _check(q, k, v, args: AttnArgs, with_dlse=False, backend=None):
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out = ref_out.to(q.dtype)
    lse = ref_lse.float()
    dout = _transposed_dout(out.shape, q.dtype)
    dlse = torch.randn_like(lse) if with_dlse else None
    dq = torch.full_like(q, float("nan"))
    dk = torch.full(k.shape, float("nan"), dtype=k.dtype, device="cuda")
    dv = torch.full(v.shape, float("nan"), dtype=v.dtype, device="cuda")
    (backend or _backend()).bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, args, False)
    torch.cuda.synchronize()
    check_backward((dq, dk, dv), dout, dlse, q, k, v, out, lse, args)
    return dq, dk, dv


def _check_runs(q, k, v, args: AttnArgs, deterministic: bool, runs: int):
    """`runs` backward calls (NaN-poisoned gradients each time): the first against the oracle,
    and every other one bit-identical to it."""

    def backward(dout, out, lse):
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        _backend().bwd(dout, q, k, v, out, lse, None, dq, dk, dv, args, deterministic)
        torch.cuda.synchronize()
        return dq, dk, dv

    check_repeated_backward(backward, q, k, v, args, runs)


def _args(d, **kw):
    return AttnArgs(softmax_scale=kw.pop("softmax_scale", 1.0 / math.sqrt(d)), **kw)


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bwd_matches_oracle_for_headdims_and_seqlens(dtype, d, causal, seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q * 7 + seqlen_k + d)
    q = torch.randn(2, seqlen_q, 3, d, dtype=dtype, device="cuda")
    k, v = nan_framed_kv(2, seqlen_k, 3, d, d, dtype)
    _check(q, k, v, _args(d, causal=causal, window_right=0 if causal else -1))


@pytest.mark.parametrize("nheads,nheads_k", [(6, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bwd_gqa_and_mqa_sum_dk_dv_over_the_group(d, nheads, nheads_k, causal):
    torch.manual_seed(nheads * 10 + nheads_k + d)
    q = torch.randn(3, 257, nheads, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(3, 300, nheads_k, d, d, torch.bfloat16)
    _check(q, k, v, _args(d, causal=causal, window_right=0 if causal else -1))


@pytest.mark.parametrize("window", [(16, 0), (64, 64), (-1, 32), (100, -1), (0, 0)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (500, 130), (239, 1)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bwd_sliding_window(d, seqlen_q, seqlen_k, window):
    torch.manual_seed(sum(window) + seqlen_q + d)
    q = torch.randn(2, seqlen_q, 2, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, seqlen_k, 2, d, d, torch.bfloat16)
    _check(q, k, v, _args(d, window_left=window[0], window_right=window[1]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bwd_softcap_chain_rule(d, causal):
    torch.manual_seed(d + causal)
    q = torch.randn(2, 333, 3, d, dtype=torch.bfloat16, device="cuda") * 3
    k, v = nan_framed_kv(2, 517, 3, d, d, torch.bfloat16)
    _check(q, k, v, _args(d, causal=causal, window_right=0 if causal else -1, softcap=15.0))


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bwd_varlen_and_seqused_k(d, causal, seqused):
    torch.manual_seed(d + causal + 2 * seqused)
    seqlens_q = [1, 0, 113, 239, 300, 64, 7]
    seqlens_k = [1, 5, 203, 1, 333, 64, 300]
    cu_q = torch.tensor([0] + torch.tensor(seqlens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(seqlens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = randn_in_nan((int(cu_q[-1]), 4, d), torch.bfloat16, row_dim=0, pad_rows=5, pad_cols=0)
    k, v = nan_framed_kv(None, int(cu_k[-1]), 2, d, d, torch.bfloat16, varlen=True)
    used = torch.tensor([1, 0, 150, 1, 300, 17, 299], dtype=torch.int32, device="cuda") if seqused else None
    args = _args(d, causal=causal, window_right=0 if causal else -1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), seqused_k=used)
    _check(q, k, v, args)


@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128), (40, 96), (80, 80), (256, 128), (128, 192), (160, 200),
                                  (192, 128), (256, 64), (64, 256), (96, 128), (128, 96),
                                  (256, 192), (256, 96), (136, 72)])
def test_bwd_headdim_v_differs_and_padded_headdims(d, dv):
    torch.manual_seed(d + dv)
    q = randn_in_nan((2, 211, 4, d), torch.float16, row_dim=1, pad_rows=3, pad_cols=8)
    k, v = nan_framed_kv(2, 333, 4, d, dv, torch.float16)
    _check(q, k, v, _args(d, causal=True, window_right=0))


def test_bwd_honours_a_gradient_of_the_lse():
    torch.manual_seed(17)
    q = torch.randn(2, 150, 4, 64, dtype=torch.float16, device="cuda")
    k, v = nan_framed_kv(2, 190, 2, 64, 64, torch.float16)
    _check(q, k, v, _args(64, causal=True, window_right=0), with_dlse=True)


def test_bwd_no_nan_for_fully_masked_rows():
    """Causal with seqlen_q > seqlen_k: the first rows see no key; their dq is exactly 0."""
    torch.manual_seed(23)
    q = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, 100, 2, 64, 64, torch.bfloat16)
    dq, dk, dv = _check(q, k, v, _args(64, causal=True, window_right=0))
    assert (dq[:, :200] == 0).all()


def test_bwd_non_contiguous_q_from_packed_qkv():
    q, k, v = strided_qkv()
    assert len({q.stride(1), k.stride(1), v.stride(1)}) == 3
    _check(q, k, v, _args(64, causal=True, window_right=0))


def test_bwd_expanded_dout_is_accepted():
    """The gradient of out.sum() arrives as a stride-0 expanded view."""
    torch.manual_seed(29)
    q = torch.randn(1, 100, 2, 64, dtype=torch.float16, device="cuda")
    k, v = nan_framed_kv(1, 120, 2, 64, 64, torch.float16)
    args = _args(64)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.ones((), dtype=q.dtype, device="cuda").expand(out.shape)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    _backend().bwd(dout, q, k, v, out, lse, None, dq, dk, dv, args, False)
    torch.cuda.synchronize()
    check_backward((dq, dk, dv), dout, None, q, k, v, out, lse, args)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (1023, 1024)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_hd256_on_the_tile_of_a100_shared_memory(monkeypatch, causal, seqlen_q, seqlen_k):
    """On an H100 / H200 head dim 256 takes the 8-warp tile (`LARGE_SMEM_TILES`); the 4-warp tile
    that an A100 takes (163 KB per CTA) is checked here on the same GPU."""
    from cute_flash.backends import cute_bwd

    monkeypatch.setattr(cute_bwd, "_smem_optin", lambda device: 163 * 1024)
    torch.manual_seed(seqlen_q + causal)
    q = torch.randn(2, seqlen_q, 3, 256, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, seqlen_k, 3, 256, 256, torch.bfloat16)
    args = _args(256, causal=causal, window_right=0 if causal else -1)
    assert cute_bwd.configs(q, k, v, None, args)[1].num_warps == 4
    _check(q, k, v, args)


@pytest.mark.parametrize("d,dv,dtype,causal", [(256, 192, torch.bfloat16, False), (192, 256, torch.float16, True),
                                            (128, 256, torch.float16, True), (256, 128, torch.bfloat16, False)])
def test_bwd_unequal_head_dims_softcap_deterministic(d, dv, dtype, causal):
    """Soft-capped deterministic calls with unequal head dims up to 256 take the tiles that
    compile without spills (`make_config`): the oracle's gradients, the same bits every run."""
    torch.manual_seed(d + dv)
    q = torch.randn(2, 239, 3, d, dtype=dtype, device="cuda") * 3
    k, v = nan_framed_kv(2, 517, 3, d, dv, dtype)
    args = _args(d, softcap=15.0, causal=causal, window_right=0 if causal else -1)
    _check_runs(q, k, v, args, True, 3)


@pytest.mark.parametrize("dtype,smem,mask,deterministic", [
    (torch.float16, 163 * 1024, {}, False),  # the A100 tile's fp16 soft-capped calls
    (torch.bfloat16, 163 * 1024, dict(window_left=60, window_right=20), True),
    (torch.bfloat16, None, dict(causal=True, window_right=0), True),  # the H100 / H200 tile's
])
def test_bwd_hd256_softcap_on_the_16_row_tile(monkeypatch, dtype, smem, mask, deterministic):
    """Head dim 256 with soft-capping takes 16-row query blocks where the 32-row tiles spill
    (`SOFTCAP_TILE_256`); deterministic runs agree bit for bit."""
    from cute_flash.backends import cute_bwd

    if smem is not None:
        monkeypatch.setattr(cute_bwd, "_smem_optin", lambda device: smem)
    torch.manual_seed(7)
    q = torch.randn(2, 239, 3, 256, dtype=dtype, device="cuda") * 3
    k, v = nan_framed_kv(2, 517, 3, 256, 256, dtype)
    args = _args(256, softcap=15.0, **mask)
    assert cute_bwd.configs(q, k, v, None, args, deterministic)[1].tile_m == 16
    _check_runs(q, k, v, args, deterministic, 3 if deterministic else 1)


@pytest.mark.big_memory
@pytest.mark.parametrize("d", [128, 256])
def test_bwd_offsets_beyond_4gib(d):
    """K, V, dK and dV of more than 2^31 elements: batch 1 starts 4 GiB into each buffer (at head
    dim 256 too, where two CTAs split each key block's columns). Its dk and dv must be
    bit-identical to the same call on a copy of batch 1 alone (their sums have a fixed order), and
    its dq equal up to the order of the atomic fp32 additions; a 32-bit offset wrapping back into
    batch 0 would give other numbers altogether."""
    if d == 128:
        q, k, v = inputs_beyond_4gib()
    else:  # half the keys of head dim 128's case, still more than 2^31 elements in k and in v
        torch.manual_seed(6)
        q = torch.randn(2, 70, 8, d, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(2, (1 << 19) + 64, 8, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    assert k.numel() > 2**31
    args = _args(d, causal=True, window_right=0)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.randn_like(out)

    def run(*tensors):
        q, k, v, out, lse, dout = tensors
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        _backend().bwd(dout, q, k, v, out, lse, None, *grads, args, False)
        torch.cuda.synchronize()
        return grads

    dq, dk, dv = run(q, k, v, out, lse, dout)
    alone_dq, alone_dk, alone_dv = run(*(t[1:].clone() for t in (q, k, v, out, lse, dout)))
    assert torch.equal(dk[1:], alone_dk) and torch.equal(dv[1:], alone_dv)
    scale = alone_dq.abs().max().item()
    assert scale > 0 and alone_dk.abs().max().item() > 0
    assert (dq[1:] - alone_dq).abs().max().item() <= 2**-6 * scale


DETERMINISTIC_CASES = {
    "causal_gqa_hd128": dict(d=128, nheads=8, nheads_k=2, seqlen_q=700, seqlen_k=1500, mask=dict(causal=True, window_right=0)),
    "plain_hd64": dict(d=64, nheads=4, nheads_k=4, seqlen_q=1024, seqlen_k=1024, mask={}),
    "local_hd96": dict(d=96, nheads=4, nheads_k=1, seqlen_q=900, seqlen_k=1300, mask=dict(window_left=100, window_right=30)),
    # two CTAs per key block (column tiles), each with its own turn counters
    "causal_gqa_hd256": dict(d=256, nheads=4, nheads_k=2, seqlen_q=500, seqlen_k=700, mask=dict(causal=True, window_right=0)),
}


@pytest.mark.parametrize("case", sorted(DETERMINISTIC_CASES))
def test_bwd_deterministic_is_the_oracle_and_the_same_every_run(case):
    """deterministic=True: key blocks add into dQ in order, so ten runs give identical bits (the
    atomic default need not), and the answer is the oracle's."""
    c = DETERMINISTIC_CASES[case]
    torch.manual_seed(41)
    q = torch.randn(2, c["seqlen_q"], c["nheads"], c["d"], dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, c["seqlen_k"], c["nheads_k"], c["d"], c["d"], torch.bfloat16)
    _check_runs(q, k, v, _args(c["d"], **c["mask"]), True, 10)


@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_the_sm90_backend_backward_directly_and_through_autograd(causal, d):
    """cute-sm90's backward (its own sm_90 kernel where that takes the call, these kernels
    otherwise): directly, and through autograd on `cute_flash.attention`."""
    import cute_flash
    from cute_flash.backends.cute import CuteSm90Backend

    sm90 = _backend(CuteSm90Backend)
    torch.manual_seed(11)
    q = torch.randn(2, 333, 8, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, 517, 2, d, d, torch.bfloat16)
    args = _args(d, causal=causal, window_right=0 if causal else -1)
    _check(q, k, v, args, backend=sm90)
    qa, ka, va = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = cute_flash.attention(qa, ka, va, causal=causal, backend="cute-sm90")
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    check_backward((qa.grad, ka.grad, va.grad), dout, None, q, k, v, ref_out.to(q.dtype), ref_lse.float(), args)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_bwd_buffers_it_allocates_may_hold_anything(monkeypatch, d, varlen):
    """Gradients match the oracle with every fresh float buffer NaN-filled (`poisoned_backward_case`)."""
    q, k, v, kw = poisoned_backward_case(monkeypatch, d, varlen)
    _check(q, k, v, _args(d, **kw))
