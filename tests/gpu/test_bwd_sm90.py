"""The sm_90 backward kernel (TMA + WGMMA) against the float64 oracle's gradients, on an
H100/H200 (`pytest -m gpu`).

The cute-sm90 backend's `bwd` is called directly with `native_backward` set on the instance (the
class default, set here all the same), and every case first asserts that the sm_90 kernel takes
the call, so that a hand-off to the sm_80 kernels cannot pass for it. Its inputs `out` and `lse`
come from the reference forward, so a forward bug cannot hide or cause a backward failure; the
oracle's gradients are computed from the same `out` and `lse`.
Tolerance (DESIGN.md), per gradient: max|g - ref| <= 2 * max|g_torch - ref| + atol, with g_torch
the reference backward in the input dtype (`tests/attention_oracle.py`). dq, dk and dv are
poisoned with NaN before the call; K and V sit inside NaN-filled buffers with different row
strides, so that a TMA box reading outside them or an unwritten gradient shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_oracle import (
    backend_or_skip, check_backward, check_repeated_backward, inputs_beyond_4gib, nan_framed_kv,
    poisoned_backward_case, randn_in_nan, run_forward, strided_qkv,
)
from cute_flash.backends.base import AttnArgs
from cute_flash.backends.reference import reference_attention

pytestmark = pytest.mark.gpu

SEQLEN_PAIRS = [(1, 1), (1, 300), (113, 203), (239, 1), (128, 128), (799, 3), (1023, 1024), (2048, 2048)]
DTYPES = [torch.float16, torch.bfloat16]


def _backend():
    from cute_flash.backends.cute import CuteSm90Backend

    backend = backend_or_skip(CuteSm90Backend)
    backend.native_backward = True
    return backend


def _transposed_dout(shape, dtype):
    """dO as a non-contiguous view: (b, s, h, d) from a (b, h, s, d) tensor, or (t, h, d) from (h, t, d)."""
    if len(shape) == 4:
        b, s, h, d = shape
        return torch.randn(b, h, s, d, dtype=dtype, device="cuda").transpose(1, 2)
    t, h, d = shape
    return torch.randn(h, t, d, dtype=dtype, device="cuda").transpose(0, 1)


def _run(q, k, v, out, lse, dout, dlse, args: AttnArgs, deterministic=False):
    """(dq, dk, dv) of the sm_90 kernel, poisoned with NaN before the call."""
    backend = _backend()
    assert backend.native_backward_takes(q, k, v, args, deterministic), "the sm_90 backward kernel refuses this call"
    dq = torch.full_like(q, float("nan"))
    dk = torch.full(k.shape, float("nan"), dtype=k.dtype, device="cuda")
    dv = torch.full(v.shape, float("nan"), dtype=v.dtype, device="cuda")
    backend.bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, args, deterministic)
    torch.cuda.synchronize()
    return dq, dk, dv


def _run_main_kernels(configs, q, k, v, out, lse, dout, args: AttnArgs) -> list:
    """(dq, dk, dv) of the sm_90 backward with each main-kernel configuration of `configs`, between
    the call's own pre- and postprocess kernels, every gradient buffer NaN-filled before its run."""
    from cute_flash.backends.cute_bwd import backward_sm90, pre_post

    backend = _backend()
    runs = []
    for config in configs:
        pre, post = pre_post(config, q.shape[-1], v.shape[-1], False)
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        backward_sm90(backend, dout, q, k, v, out, lse, None, *grads, args, False, (pre, config, post))
        torch.cuda.synchronize()
        runs.append(grads)
    return runs


def _check(q, k, v, args: AttnArgs, with_dlse=False):
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out = ref_out.to(q.dtype)
    lse = ref_lse.float()
    dout = _transposed_dout(out.shape, q.dtype)
    dlse = torch.randn_like(lse) if with_dlse else None
    grads = _run(q, k, v, out, lse, dout, dlse, args)
    check_backward(grads, dout, dlse, q, k, v, out, lse, args)
    return grads


def _args(d, **kw):
    return AttnArgs(softmax_scale=kw.pop("softmax_scale", 1.0 / math.sqrt(d)), **kw)


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_bwd_matches_oracle_for_headdims_and_seqlens(dtype, d, causal, seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q * 7 + seqlen_k + d)
    q = torch.randn(2, seqlen_q, 3, d, dtype=dtype, device="cuda")
    k, v = nan_framed_kv(2, seqlen_k, 3, d, d, dtype)
    _check(q, k, v, _args(d, causal=causal, window_right=0 if causal else -1))


@pytest.mark.parametrize("nheads,nheads_k", [(6, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_sm90_bwd_gqa_and_mqa_sum_dk_dv_over_the_group(d, nheads, nheads_k, causal):
    torch.manual_seed(nheads * 10 + nheads_k + d)
    q = torch.randn(3, 257, nheads, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(3, 300, nheads_k, d, d, torch.bfloat16)
    _check(q, k, v, _args(d, causal=causal, window_right=0 if causal else -1))


@pytest.mark.parametrize("d", [64, 128])
def test_sm90_bwd_causal_grid_of_several_head_groups(d):
    """Causal CTAs take key blocks longest first within groups of heads (`lpt`): 32 key blocks
    give groups of 8 (batch, KV head) pairs, so 3 x 3 pairs make a full group and one of 1."""
    from cute_flash.kernels.sm90.bwd_config import LPT_GROUP_CTAS, make_config

    assert make_config("bfloat16", d, d, causal=True).lpt and LPT_GROUP_CTAS // 32 == 8
    torch.manual_seed(d)
    q = torch.randn(3, 4096, 6, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(3, 4096, 3, d, d, torch.bfloat16)
    _check(q, k, v, _args(d, causal=True, window_right=0))


@pytest.mark.parametrize("window", [(16, 0), (64, 64), (-1, 32), (100, -1), (0, 0), (200, 7)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (500, 130), (239, 1), (1000, 1000)])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_sm90_bwd_sliding_window(d, seqlen_q, seqlen_k, window):
    torch.manual_seed(sum(window) + seqlen_q + d)
    q = torch.randn(2, seqlen_q, 2, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, seqlen_k, 2, d, d, torch.bfloat16)
    _check(q, k, v, _args(d, window_left=window[0], window_right=window[1]))


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (50, 10)])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_sm90_bwd_softcap_chain_rule(d, window):
    torch.manual_seed(d + window[0])
    q = torch.randn(2, 333, 3, d, dtype=torch.bfloat16, device="cuda") * 3
    k, v = nan_framed_kv(2, 517, 3, d, d, torch.bfloat16)
    causal = window == (-1, 0)
    _check(q, k, v, _args(d, causal=causal, window_left=window[0], window_right=window[1], softcap=15.0))


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_sm90_bwd_varlen_and_seqused_k(d, causal, seqused):
    torch.manual_seed(d + causal + 2 * seqused)
    seqlens_q = [1, 0, 113, 239, 300, 64, 7, 129]
    seqlens_k = [1, 5, 203, 1, 333, 64, 300, 128]
    cu_q = torch.tensor([0] + torch.tensor(seqlens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(seqlens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = randn_in_nan((int(cu_q[-1]), 4, d), torch.bfloat16, row_dim=0, pad_rows=5, pad_cols=0)
    k, v = nan_framed_kv(None, int(cu_k[-1]), 2, d, d, torch.bfloat16, varlen=True)
    used = torch.tensor([1, 0, 150, 1, 300, 17, 299, 127], dtype=torch.int32, device="cuda") if seqused else None
    args = _args(d, causal=causal, window_right=0 if causal else -1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), seqused_k=used)
    _check(q, k, v, args)


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_sm90_bwd_ignores_a_stale_cache_past_seqused_k(d):
    """Keys past seqused_k are inside the tensor, so TMA loads them: NaN there must not reach any
    gradient (the kernel zeroes those rows in shared memory), and dk, dv there are 0."""
    torch.manual_seed(d)
    used = torch.tensor([100, 1, 257], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 190, 4, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(3, 300, 2, d, d, torch.bfloat16)
    for b, n in enumerate(used.tolist()):
        k[b, n:] = float("nan")
        v[b, n:] = float("inf")
    dq, dk, dv = _check(q, k, v, _args(d, causal=True, window_right=0, seqused_k=used))
    for b, n in enumerate(used.tolist()):
        assert (dk[b, n:] == 0).all() and (dv[b, n:] == 0).all()


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (1023, 1024)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dv", [(192, 128), (256, 128), (128, 256), (256, 64), (64, 256), (200, 120), (192, 64)])
def test_sm90_bwd_unequal_head_dims(d, dv, causal, seqlen_q, seqlen_k):
    """Head dims of Q and V that differ (above 128: the column-split tile), e.g. MLA's 192 / 128."""
    torch.manual_seed(d + dv + seqlen_q)
    q = torch.randn(2, seqlen_q, 4, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, seqlen_k, 2, d, dv, torch.bfloat16)
    _check(q, k, v, _args(d, causal=causal, window_right=0 if causal else -1))


def test_sm90_bwd_unequal_head_dims_varlen_softcap_window():
    torch.manual_seed(5)
    seqlens_q, seqlens_k = [1, 300, 77], [90, 333, 500]
    cu_q = torch.tensor([0, 1, 301, 378], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 423, 923], dtype=torch.int32, device="cuda")
    q = torch.randn(378, 4, 192, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(None, 923, 2, 192, 128, torch.bfloat16, varlen=True)
    _check(q, k, v, _args(192, window_left=64, window_right=16, softcap=20.0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                          max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k)))


@pytest.mark.parametrize("d", [8, 40, 72, 80, 120, 136, 176, 200, 248])
def test_sm90_bwd_padded_headdims(d):
    torch.manual_seed(d)
    q = randn_in_nan((2, 211, 4, d), torch.float16, row_dim=1, pad_rows=3, pad_cols=8)
    k, v = nan_framed_kv(2, 333, 4, d, d, torch.float16)
    _check(q, k, v, _args(d, causal=True, window_right=0))


def test_sm90_bwd_honours_a_gradient_of_the_lse():
    torch.manual_seed(17)
    q = torch.randn(2, 150, 4, 64, dtype=torch.float16, device="cuda")
    k, v = nan_framed_kv(2, 190, 2, 64, 64, torch.float16)
    _check(q, k, v, _args(64, causal=True, window_right=0), with_dlse=True)


def test_sm90_bwd_no_nan_for_fully_masked_rows():
    """Causal with seqlen_q > seqlen_k: the first rows see no key; their dq is exactly 0."""
    torch.manual_seed(23)
    q = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, 100, 2, 64, 64, torch.bfloat16)
    dq, dk, dv = _check(q, k, v, _args(64, causal=True, window_right=0))
    assert (dq[:, :200] == 0).all()


def test_sm90_bwd_key_blocks_no_query_sees_get_zero_dk_dv():
    """A window that leaves the last keys unseen: their CTAs load nothing and write dk = dv = 0."""
    torch.manual_seed(31)
    q = torch.randn(1, 100, 2, 128, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(1, 700, 2, 128, 128, torch.bfloat16)
    args = _args(128, window_left=10, window_right=20)  # query i sees keys [i + 590, i + 620]
    dq, dk, dv = _check(q, k, v, args)
    assert (dk[:, :512] == 0).all() and (dv[:, :512] == 0).all()


def test_sm90_bwd_non_contiguous_q_from_packed_qkv():
    q, k, v = strided_qkv()
    assert len({q.stride(1), k.stride(1), v.stride(1)}) == 3
    _check(q, k, v, _args(64, causal=True, window_right=0))


def test_sm90_bwd_expanded_dout_is_accepted():
    """The gradient of out.sum() arrives as a stride-0 expanded view."""
    torch.manual_seed(29)
    q = torch.randn(1, 100, 2, 64, dtype=torch.float16, device="cuda")
    k, v = nan_framed_kv(1, 120, 2, 64, 64, torch.float16)
    args = _args(64)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.ones((), dtype=q.dtype, device="cuda").expand(out.shape)
    grads = _run(q, k, v, out, lse, dout, None, args)
    check_backward(grads, dout, None, q, k, v, out, lse, args)


@pytest.mark.big_memory
def test_sm90_bwd_offsets_beyond_4gib():
    """K, V, dK and dV of more than 2^31 elements: batch 1 starts 4 GiB into each buffer. Its dk
    and dv must be bit-identical to the same call on a copy of batch 1 alone (their sums have a
    fixed order), and its dq equal up to the order of the atomic fp32 additions; a 32-bit offset
    wrapping back into batch 0 would give other numbers altogether."""
    q, k, v = inputs_beyond_4gib()
    args = _args(128, causal=True, window_right=0)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.randn_like(out)
    dq, dk, dv = _run(q, k, v, out, lse, dout, None, args)
    alone_dq, alone_dk, alone_dv = _run(*(t[1:].clone() for t in (q, k, v, out, lse, dout)), None, args)
    assert torch.equal(dk[1:], alone_dk) and torch.equal(dv[1:], alone_dv)
    scale = alone_dq.abs().max().item()
    assert scale > 0 and alone_dk.abs().max().item() > 0
    assert (dq[1:] - alone_dq).abs().max().item() <= 2**-6 * scale


@pytest.mark.big_memory
def test_sm90_bwd_dq_accumulator_beyond_4gib():
    """Q, dO and dQ of more than 2^31 elements (their last rows past it), and a flat dQ
    accumulator (`dq_flat`) of 8 GiB whose last head starts 7 GiB in. With 128 keys (one key
    block) every accumulator float takes a single reduce-add, so the last two heads' gradients
    must be bit-identical to the same call on a copy of those heads alone (32-bit offsets would
    send them elsewhere), and the last 300 query rows (the tail block among them) must match dQ
    computed from those rows in float32."""
    from cute_flash.backends.cute_bwd import sm90_configs

    torch.manual_seed(7)
    seqlen_q, h, d = (1 << 21) + 40, 8, 128
    q = torch.randn(1, seqlen_q, h, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(1, 128, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    assert q.numel() > 2**31
    args = _args(d)
    assert sm90_configs(q, k, v, None, args)[1].dq_flat
    out, lse = run_forward(_backend(), q, k, v, args)
    dout = torch.randn_like(out)
    dq, dk, dv = _run(q, k, v, out, lse, dout, None, args)
    last = slice(h - 2, h)
    alone = _run(*(t[:, :, last].clone() for t in (q, k, v, out)), lse[:, last].clone(),
                 dout[:, :, last].clone(), None, args)
    assert all(torch.equal(g[:, :, last], a) for g, a in zip((dq, dk, dv), alone))
    # dQ of the last 300 rows, every head, in float32 from the same out and lse
    rows = slice(seqlen_q - 300, seqlen_q)
    qr, o, do = (t[0, rows].float().transpose(0, 1) for t in (q, out, dout))  # (h, rows, d)
    kk, vv = (t[0].float().transpose(0, 1) for t in (k, v))
    p = torch.exp(qr @ kk.transpose(1, 2) * args.softmax_scale - lse[0, :, rows, None])
    ds = p * (do @ vv.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
    ref = (ds @ kk * args.softmax_scale).transpose(0, 1)
    got = dq[0, rows].float()
    assert (got - ref).abs().max().item() <= 2**-7 * ref.abs().max().item() + 1e-3
    del q, k, v, out, dout, dq, dk, dv, alone
    torch.cuda.empty_cache()


@pytest.mark.parametrize("d", [128, 192, 256])
def test_sm90_bwd_matches_the_sm80_kernels(d):
    """The two backward kernels on one call: the same gradients up to rounding (both are checked
    against the oracle above; this catches a difference the tolerance might let through)."""
    from cute_flash.backends.cute import CuteSm80Backend

    torch.manual_seed(3)
    q = torch.randn(2, 700, 8, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(2, 900, 2, d, d, torch.bfloat16)
    args = _args(d, causal=True, window_right=0)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.randn_like(out)
    grads90 = _run(q, k, v, out, lse, dout, None, args)
    grads80 = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    backend_or_skip(CuteSm80Backend).bwd(dout, q, k, v, out, lse, None, *grads80, args, False)
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), grads90, grads80):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (77, 768), (1, 256), (2049, 2048)])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_bwd_q_clusters_match_single_ctas(dtype, d, seqlen_q, seqlen_k):
    """Unmasked calls with an even number of key blocks take `cluster_q` (pairs of CTAs that load
    half of each Q and dO tile into both by TMA multicast): the oracle passes, with K/V in
    NaN-framed buffers and GQA (each CTA walks the query blocks of 3 heads); dK and dV are
    bitwise those of the same kernel without clusters, dQ (added by TMA reduce-adds in any
    order) equal up to its float32 rounding."""
    from dataclasses import replace

    from cute_flash.backends.cute_bwd import sm90_configs

    torch.manual_seed(d + seqlen_q + seqlen_k)
    q = randn_in_nan((2, seqlen_q, 6, d), dtype, row_dim=1, pad_rows=3)
    k, v = nan_framed_kv(2, seqlen_k, 2, d, d, dtype)
    args = _args(d)
    main = sm90_configs(q, k, v, None, args)[1]
    assert main.cluster_q == (d <= 96), main.name
    main = replace(main, cluster_q=True)  # head dim 128 ships single CTAs; its clusters are checked all the same
    dq, dk, dv = _check(q, k, v, args)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(dtype), ref_lse.float()
    torch.manual_seed(1)
    dout = torch.randn_like(out)
    (dq0, dk0, dv0), (dq1, dk1, dv1) = _run_main_kernels((main, replace(main, cluster_q=False)),
                                                         q, k, v, out, lse, dout, args)
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    torch.testing.assert_close(dq0, dq1, atol=1e-3, rtol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1001), (77, 768), (2049, 300)])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_sm90_bwd_rotated_query_walks_match_walks_from_the_first_block(d, seqlen_q, seqlen_k):
    """`rotate_queries` (shipped without a mask from head dim 192 on) only reorders each CTA's walk
    over the query blocks: the oracle passes with it, with GQA and NaN-framed buffers (the tail
    block comes anywhere in the walk), and dK / dV equal those of the unrotated kernel up to the
    order of their float32 sums, dQ up to its reduce-adds' order. At 64 (with its Q/dO clusters,
    rotated by pairs) and 128 the kernel takes it all the same."""
    from dataclasses import replace

    from cute_flash.backends.cute_bwd import sm90_configs

    torch.manual_seed(d + seqlen_q + seqlen_k)
    q = randn_in_nan((2, seqlen_q, 6, d), torch.bfloat16, row_dim=1, pad_rows=3)
    k, v = nan_framed_kv(2, seqlen_k, 2, d, d, torch.bfloat16)
    args = _args(d)
    main = sm90_configs(q, k, v, None, args)[1]
    assert main.rotate_queries == (d >= 192), main.name
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = _transposed_dout(out.shape, q.dtype)
    runs = _run_main_kernels((replace(main, rotate_queries=True), replace(main, rotate_queries=False)),
                             q, k, v, out, lse, dout, args)
    check_backward(runs[0], dout, None, q, k, v, out, lse, args)
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-2, msg=lambda m, name=name: f"{name}: {m}")


CONVERT_CASES = [
    # (d, seqlen_q, seqlen_k, heads, heads_k, mask): more query blocks than conversion CTAs, so
    # that each CTA converts several; rows no key is visible to (causal with seqlen_q > seqlen_k,
    # the window) get dQ = 0 from blocks that count no key block
    (64, 2048, 2048, 8, 8, {}),
    (64, 1000, 1537, 6, 2, {"causal": True}),
    (128, 1537, 1000, 4, 4, {"causal": True}),
    (128, 1111, 1111, 8, 2, {"window_left": 100, "window_right": 30}),
    (128, 2047, 2049, 9, 3, {}),
    (192, 777, 1024, 4, 2, {"causal": True}),
    (256, 1200, 800, 4, 4, {}),
]


@pytest.mark.parametrize("case", CONVERT_CASES)
def test_sm90_bwd_conversion_ctas_match_the_postprocess_kernel(case):
    """`dq_convert` (an A/B option, on fixed-length calls): the main kernel's own conversion CTAs
    write dQ from the flat accumulator once each query block's key blocks have added into it.
    Against the oracle, and against the postprocess kernel after the same main kernel without
    them (dQ up to its reduce-adds' float32 order; dK and dV bitwise), with every gradient
    NaN-poisoned first, so a block converted before its last add or never shows."""
    main = _flag_flip_matches_the_shipped_kernel(case, "dq_convert")
    assert main.dq_flat and not main.dq_convert, main.name


DQ_GEMM_CASES = [
    # (d, seqlen_q, seqlen_k, heads, heads_k, mask): each tile whose dQ GEMMs read dS from shared
    # memory -- 128 rows (64, `dq_rows`), 64 rows with the column split (96, 128), 64 rows with dK
    # after dQ (64 soft-capped) -- with odd tails, causal diagonals, a window and GQA
    (64, 2048, 2048, 8, 8, {}),
    (64, 1000, 1537, 6, 2, {"causal": True}),
    (64, 777, 1025, 4, 2, {"softcap": 20.0}),
    (96, 1000, 1537, 6, 2, {"causal": True}),
    (128, 40, 100, 2, 2, {}),
    (128, 1537, 1000, 4, 4, {"causal": True}),
    (128, 1111, 1111, 8, 2, {"window_left": 100, "window_right": 30}),
    (128, 2047, 2049, 9, 3, {}),
]
DQ_GEMM_FLAGS = [(flag, case) for flag in ("ds_kmajor", "dq_own_first") for case in DQ_GEMM_CASES]


@pytest.mark.parametrize("flag,case", DQ_GEMM_FLAGS)
def test_sm90_bwd_dq_gemm_options_either_way_match_the_oracle_and_each_other(flag, case):
    """The dQ GEMMs' options, shipped at head dims 96 and 128 and flipped here either way:
    `ds_kmajor` (dS^T stored transposed by stmatrix .trans, so that they read dS K-major) and
    `dq_own_first` (each warpgroup's dQ GEMM over its own 64 keys, issued before the barrier of
    both warpgroups, then over the other's). Both kernels against the oracle and against each
    other (dK and dV bitwise, dQ to float32 order), every gradient NaN-poisoned first."""
    main = _flag_flip_matches_the_shipped_kernel(case, flag)
    assert not main.dkv_split and (main.dq_split or main.dq_rows), main.name
    assert getattr(main, flag) == (case[0] in (96, 128)), main.name


def _flag_flip_matches_the_shipped_kernel(case, flag: str):
    """The call's shipped main kernel (returned) and the same with `flag` flipped, both against
    the oracle and against each other, every gradient NaN-poisoned first: dK and dV bitwise, dQ
    up to its reduce-adds' float32 order. `case`: (d, seqlen_q, seqlen_k, heads, heads_k, mask),
    bf16, GQA where heads_k < heads, NaN-framed buffers."""
    from dataclasses import replace

    from cute_flash.backends.cute_bwd import sm90_configs

    d, seqlen_q, seqlen_k, heads, heads_k, mask = case
    torch.manual_seed(d + seqlen_q + seqlen_k + heads)
    q = randn_in_nan((2, seqlen_q, heads, d), torch.bfloat16, row_dim=1, pad_rows=3)
    k, v = nan_framed_kv(2, seqlen_k, heads_k, d, d, torch.bfloat16)
    args = _args(d, **({"window_right": 0, **mask} if mask.get("causal") else mask))
    main = sm90_configs(q, k, v, None, args)[1]
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = _transposed_dout(out.shape, q.dtype)
    flipped, shipped = _run_main_kernels((replace(main, **{flag: not getattr(main, flag)}), main),
                                         q, k, v, out, lse, dout, args)
    for grads in (flipped, shipped):
        check_backward(grads, dout, None, q, k, v, out, lse, args)
    assert torch.equal(flipped[1], shipped[1]) and torch.equal(flipped[2], shipped[2])
    torch.testing.assert_close(flipped[0], shipped[0], atol=1e-3, rtol=1e-2)
    return main


def test_sm90_bwd_q_clusters_only_where_both_ctas_walk_the_same_queries():
    """`cluster_q` needs an even number of key blocks, no mask and a head dim up to 96; other
    calls keep single CTAs (and still pass the oracle)."""
    backend = _backend()
    from cute_flash.backends.cute_bwd import sm90_configs

    q = torch.randn(2, 1024, 4, 64, dtype=torch.bfloat16, device="cuda")
    assert sm90_configs(q, q, q, None, _args(64))[1].cluster_q
    odd = torch.randn(2, 1100, 4, 64, dtype=torch.bfloat16, device="cuda")  # 9 key blocks
    assert not sm90_configs(odd, odd, odd, None, _args(64))[1].cluster_q
    assert not sm90_configs(q, q, q, None, _args(64, causal=True, window_right=0))[1].cluster_q
    wide = torch.randn(2, 1024, 4, 256, dtype=torch.bfloat16, device="cuda")
    assert not sm90_configs(wide, wide, wide, None, _args(256))[1].cluster_q
    _check(odd, odd, odd, _args(64))
    assert backend.native_backward_takes(q, q, q, _args(64), False)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_sm90_bwd_buffers_it_allocates_may_hold_anything(monkeypatch, d, varlen):
    """Gradients match the oracle with every fresh float buffer NaN-filled (`poisoned_backward_case`)."""
    q, k, v, kw = poisoned_backward_case(monkeypatch, d, varlen)
    _check(q, k, v, _args(d, **kw))


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_bwd_profiling_build_writes_sane_records_and_the_same_gradients(causal):
    """`Sm90BwdConfig.timeline` (benchmarks/bwd_timeline.py): its records replace the first row
    of each CTA's dK tile and nothing else; they hold the CTA's step count, stamps in order and
    the phase cycles of both warpgroups."""
    from dataclasses import replace

    from cute_flash.kernels.sm90.bwd_config import make_config

    b, s, h, d = 2, 1000, 4, 128
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    args = _args(d, causal=causal, window_right=0 if causal else -1)
    ref_out, ref_lse = reference_attention(q, k, v, args, compute_dtype=torch.float32)
    out, lse = ref_out.to(q.dtype), ref_lse.float()
    dout = torch.randn_like(out)
    shipped = make_config("bfloat16", d, d, causal=causal)
    (dq0, dk0, dv0), (dq1, dk1, dv1) = _run_main_kernels((shipped, replace(shipped, timeline=True)),
                                                         q, k, v, out, lse, dout, args)
    assert torch.equal(dv0, dv1)
    assert (dq0.float() - dq1.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * dq0.float().abs().max()
    record_rows = torch.zeros(s, dtype=torch.bool)
    record_rows[::shipped.tile_n] = True
    assert torch.equal(dk0[:, ~record_rows], dk1[:, ~record_rows])

    records = dk1[:, ::shipped.tile_n].view(torch.int32)[..., :24]  # (b, n_blocks, h, 24)
    n_blocks, m_blocks = records.shape[1], math.ceil(s / shipped.tile_m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in range(n_blocks):
        expected = m_blocks - (n * shipped.tile_n) // shipped.tile_m if causal else m_blocks
        for r in records[:, n].reshape(-1, 24).tolist():
            assert 0 <= r[0] < sms and r[1] == expected
            stamps = [(t - r[2]) % (1 << 32) for t in r[2:8]]
            assert stamps == sorted(stamps) and stamps[-1] < 10 ** 9
            for wg in range(2):
                phases = [x % (1 << 32) for x in r[8 + 8 * wg: 15 + 8 * wg]]
                assert r[15 + 8 * wg] == expected and sum(phases) > 0


DETERMINISTIC_CASES = {
    # (batch, seqlen_q, seqlen_k, heads, KV heads, head dim, head dim of V, mask / features)
    "plain_hd64": (2, 1000, 1500, 4, 4, 64, 64, {}),
    "causal_hd64_gqa": (2, 700, 1500, 8, 2, 64, 64, dict(causal=True, window_right=0)),
    "plain_hd96": (2, 900, 1300, 3, 3, 96, 96, {}),
    "plain_hd128": (2, 1000, 1000, 4, 4, 128, 128, {}),
    "causal_hd128_gqa": (2, 700, 1500, 8, 2, 128, 128, dict(causal=True, window_right=0)),
    "local_hd128_softcap": (2, 900, 1300, 4, 1, 128, 128, dict(window_left=300, window_right=30, softcap=20.0)),
    "plain_hd192": (2, 600, 1100, 4, 2, 192, 192, {}),
    "causal_hd192x128": (2, 600, 1100, 4, 4, 192, 128, dict(causal=True, window_right=0)),
    "plain_hd256": (2, 500, 900, 4, 2, 256, 256, {}),
    # more CTAs than the GPU holds at once: a CTA may wait only for the turns of CTAs launched
    # before it (the sectioned grid), or the call hangs
    "many_ctas_hd128": (2, 2048, 2048, 16, 16, 128, 128, {}),
}


@pytest.mark.parametrize("case", sorted(DETERMINISTIC_CASES))
def test_sm90_bwd_deterministic_is_the_oracle_and_the_same_every_run(case):
    """deterministic=True on the sm_90 kernel: the key blocks add into each query block's dQ in
    order, so ten runs give the same bits (the default's reduce-adds need not), and the first is
    the oracle's."""
    b, sq, sk, h, hk, d, dv, extra = DETERMINISTIC_CASES[case]
    torch.manual_seed(43)
    q = torch.randn(b, sq, h, d, dtype=torch.bfloat16, device="cuda")
    k, v = nan_framed_kv(b, sk, hk, d, dv, torch.bfloat16)
    args = _args(d, **extra)
    from cute_flash.backends.cute_bwd import sm90_configs

    assert sm90_configs(q, k, v, None, args, True)[1].deterministic
    _check_deterministic_runs(q, k, v, args, 10)


def test_sm90_bwd_deterministic_varlen_with_seqused_k():
    """Varlen sequences with seqused_k: each sequence's query blocks have turn counters of their
    own, and key blocks past seqused_k (which add nothing) are not waited for."""
    torch.manual_seed(44)
    d, h = 128, 4
    lens_q, lens_k, used = [300, 1, 777, 129], [513, 640, 900, 64], [400, 1, 900, 20]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(sum(lens_k), h, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(sum(lens_k), h, d, dtype=torch.bfloat16, device="cuda")
    args = _args(d, causal=True, window_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                 max_seqlen_k=max(lens_k), seqused_k=torch.tensor(used, dtype=torch.int32, device="cuda"))
    _check_deterministic_runs(q, k, v, args, 5)


def _check_deterministic_runs(q, k, v, args: AttnArgs, runs: int):
    """`runs` deterministic backward calls (NaN-poisoned gradients each time): the first against
    the oracle, every other one bit-identical to it."""
    check_repeated_backward(lambda dout, out, lse: _run(q, k, v, out, lse, dout, None, args, deterministic=True),
                            q, k, v, args, runs)
