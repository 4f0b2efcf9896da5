"""Decode with GQA packed into the query rows of one KV head (backends/pack_gqa.py), on the CPU.

The packed call must be the same attention written to the same memory: checked with the
reference backend, which takes any strides, against the unpacked call; and the CuTe backend's
wiring is checked by recording what it would launch.
"""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash.backends import pack_gqa
from cute_flash.backends.base import AttnArgs
from cute_flash.backends.reference import ReferenceBackend


def _decode_problem(batch=3, nheads=8, nheads_k=2, d=64, dv=None, seqlen_k=37, page_size=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    q = torch.randn(batch, 1, nheads, d, generator=g)
    if page_size:
        pages = -(-seqlen_k // page_size)
        k = torch.randn(batch * pages, page_size, nheads_k, d, generator=g)
        v = torch.randn(batch * pages, page_size, nheads_k, dv, generator=g)
        table = torch.randperm(batch * pages, generator=g).view(batch, pages).to(torch.int32)
        return q, k, v, dict(page_table=table)
    k = torch.randn(batch, seqlen_k, nheads_k, d, generator=g)
    v = torch.randn(batch, seqlen_k, nheads_k, dv, generator=g)
    return q, k, v, {}


def _run(q, k, v, args, pack):
    out = torch.full((*q.shape[:-1], v.shape[-1]), math.nan)
    lse = torch.full((q.shape[0], q.shape[2], 1), math.nan)
    if pack:
        pq, pout, plse, pargs, _ = pack_gqa.pack(q, k, out, lse, args)
        ReferenceBackend().fwd(pq, k, v, pout, plse, pargs)
    else:
        ReferenceBackend().fwd(q, k, v, out, lse, args)
    return out, lse


CASES = {
    "plain": dict(),
    "causal": dict(causal=True, window_right=0),
    "right_window": dict(window_right=5),
    "softcap": dict(softcap=3.0),
    "seqused_k": dict(seqused_k=torch.tensor([37, 5, 0], dtype=torch.int32)),
    "paged": dict(page_size=8),
    "paged_seqused_k": dict(page_size=8, seqused_k=torch.tensor([1, 40, 17], dtype=torch.int32)),
    "mqa": dict(nheads=6, nheads_k=1),
    "headdim_v": dict(dv=32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_decode_is_the_same_attention_in_the_same_memory(case):
    kw = dict(CASES[case])
    problem = {key: kw.pop(key) for key in ("page_size", "nheads", "nheads_k", "dv") if key in kw}
    q, k, v, extra = _decode_problem(**problem)
    args = AttnArgs(softmax_scale=0.125, **extra, **kw)
    if args.page_table is not None:
        args.max_seqlen_k = args.page_table.shape[1] * k.shape[1]
    assert pack_gqa.packable(q, k, args)
    out, lse = _run(q, k, v, args, pack=False)
    packed_out, packed_lse = _run(q, k, v, args, pack=True)
    assert not packed_out.isnan().any() and not packed_lse.isnan().any(), "the packed call left memory unwritten"
    torch.testing.assert_close(packed_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_lse, lse, rtol=1e-5, atol=1e-6)


def test_views_alias_the_original_memory():
    q, k, v, _ = _decode_problem(batch=2, nheads=8, nheads_k=2)
    out = torch.zeros(2, 1, 8, 64)
    lse = torch.zeros(2, 8, 1)
    o_partial, lse_partial = torch.zeros(3, 2, 1, 8, 64), torch.zeros(3, 2, 8, 1)
    pq, pout, plse, pargs, (po, pl) = pack_gqa.pack(q, k, out, lse, AttnArgs(0.1, causal=True, window_right=0),
                                                    (o_partial, lse_partial))
    assert pq.shape == (2, 4, 2, 64) and pout.shape == (2, 4, 2, 64) and plse.shape == (2, 2, 4)
    # query row j of KV head i is query head i * g + j
    assert torch.equal(pq[1, 3, 1], q[1, 0, 1 * 4 + 3])
    pout[1, 3, 1] = 7.0
    plse[1, 1, 3] = 5.0
    assert (out[1, 0, 7] == 7.0).all() and lse[1, 7, 0] == 5.0
    assert not pargs.causal and pargs.window_left == -1 and pargs.window_right == -1
    assert po.shape == (3, 2, 4, 2, 64) and po.data_ptr() == o_partial.data_ptr()
    assert pl.shape == (3, 2, 2, 4) and pl.data_ptr() == lse_partial.data_ptr()


@pytest.mark.parametrize("what", ["two_query_tokens", "mha", "left_window", "varlen_q"])
def test_calls_that_are_not_one_token_of_a_gqa_group_are_not_packed(what):
    q, k, v, _ = _decode_problem()
    args = AttnArgs(0.1)
    if what == "two_query_tokens":
        q = torch.randn(3, 2, 8, 64)
    elif what == "mha":
        q, k, v, _ = _decode_problem(nheads=2, nheads_k=2)
    elif what == "left_window":
        args = AttnArgs(0.1, window_left=8, window_right=0)
    else:
        q = q[:, 0]
        args = AttnArgs(0.1, cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32), max_seqlen_q=1)
    assert not pack_gqa.packable(q, k, args)


def test_cute_backend_launches_the_packed_call(monkeypatch):
    """Wiring: with pack_gqa_decode on, the kernel is configured and launched on the packed views."""
    from cute_flash.backends.cute import CuteSm80Backend

    backend = CuteSm80Backend()
    monkeypatch.setattr(backend, "pack_gqa_decode", True)
    seen = {}
    monkeypatch.setattr(backend, "config",
                        lambda q, k, v, lse, args, **flags: seen.setdefault("config", (q.shape, args)))
    monkeypatch.setattr(backend, "arch", lambda device=None: "sm_80")
    monkeypatch.setattr(backend.cache, "get", lambda config, arch: (None, None))
    monkeypatch.setattr("cute_flash.backends.split_kv.num_splits", lambda *a, **kw: 1)
    monkeypatch.setattr(backend, "launch", lambda fn, q, k, v, out, lse, args, a, extra=(): seen.update(
        launch=(q.shape, out.shape, lse.shape, args.causal)))
    q, k, v, _ = _decode_problem(batch=2, nheads=8, nheads_k=2)
    out, lse = torch.empty(2, 1, 8, 64), torch.empty(2, 8, 1)
    backend.fwd(q, k, v, out, lse, AttnArgs(0.1, causal=True, window_right=0))
    assert seen["launch"] == ((2, 4, 2, 64), (2, 4, 2, 64), (2, 2, 4), False)
    assert seen["config"][0] == (2, 4, 2, 64) and not seen["config"][1].causal
