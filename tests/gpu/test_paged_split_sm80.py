"""Paged KV, split-KV and CUDA-graph decode of the sm_80 forward kernel, on a GPU (`pytest -m gpu`).

These call the backend directly (and switch on, per backend instance, what is not on by default
yet: decode with packed GQA, `backends/pack_gqa.py`). Every check is against the float64 oracle with the tolerance rule of DESIGN.md
(`tests/attention_oracle.py`); outputs are poisoned with NaN before each call.

The paged caches are built to catch wrong reads: pages are shuffled, every row sits between NaN
heads and NaN columns, the rows of a sequence's last page past its length are NaN, and the
table entries past a sequence point at a page that is NaN throughout. A kernel that reads a
row it should not (a tile assuming one page, a row past seqused_k fed to the MMA instead of
zero-filled) turns the output NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_oracle import backend_or_skip, check_forward
from cute_flash.backends import split_kv
from cute_flash.backends.base import AttnArgs

pytestmark = pytest.mark.gpu

PAGE_SIZES = [16, 32, 64, 128, 256]
NAN = float("nan")


def _backend(heuristic: bool = False):
    from cute_flash.backends.cute import CuteSm80Backend

    backend = backend_or_skip(CuteSm80Backend)
    if heuristic:
        # num_splits = 0 picks a split count only for a verified split_kv: declare it on this
        # instance to exercise the heuristic
        backend.features = backend.features | {"split_kv"}
    return backend


def _args(d, **kw):
    return AttnArgs(softmax_scale=kw.pop("softmax_scale", 1.0 / math.sqrt(d)), **kw)


def _run(q, k, v, args: AttnArgs, backend=None, with_lse=True, workspace=None):
    out = torch.full((*q.shape[:-1], v.shape[-1]), NAN, dtype=q.dtype, device="cuda")
    lse_shape = (q.shape[1], q.shape[0]) if args.cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(lse_shape, NAN, dtype=torch.float32, device="cuda") if with_lse else None
    (backend or _backend()).fwd(q, k, v, out, lse, args, workspace=workspace)
    torch.cuda.synchronize()
    return out, lse


def _check(q, k, v, args, **kw):
    out, lse = _run(q, k, v, args, **kw)
    check_forward(out, lse, q, k, v, args)
    return out, lse


def _paged_cache(k, v, seqlens, page_size, gen, spare_pages=3):
    """(k_cache, v_cache, page_table): k/v (b, sk, hk, d) scattered into shuffled NaN-framed pages."""
    batch, seqlen_k, hk, d = k.shape
    dv = v.shape[-1]
    max_pages = max(1, -(-seqlen_k // page_size))
    num_pages = batch * max_pages + spare_pages
    caches = []
    for x, width in ((k, d), (v, dv)):
        buf = torch.full((num_pages, page_size, hk + 1, width + 8), NAN, dtype=x.dtype, device="cuda")
        cache = buf[:, :, :hk, :width]
        rows = torch.full((batch, max_pages * page_size, hk, width), NAN, dtype=x.dtype, device="cuda")
        for b, n in enumerate(seqlens):
            rows[b, :n] = x[b, :n]
        caches.append((cache, rows.view(batch * max_pages, page_size, hk, width)))
    perm = torch.randperm(num_pages, generator=gen).to("cuda")
    table = perm[: batch * max_pages].view(batch, max_pages).to(torch.int32).contiguous()
    for cache, pages in caches:
        cache[table.flatten().long()] = pages
    # entries past each sequence: a page never written (NaN throughout)
    used = torch.tensor([-(-n // page_size) for n in seqlens], device="cuda")
    unused = torch.arange(max_pages, device="cuda")[None, :] >= used[:, None]
    table[unused] = int(perm[-1])
    return caches[0][0], caches[1][0], table


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dtype=torch.bfloat16, dv=None):
    dv = dv or d
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, seqlen_k, nheads_k, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, seqlen_k, nheads_k, dv, dtype=dtype, device="cuda")
    return q, k, v


# ------------------------------------------------------------------------------------------------
# paged equals contiguous
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("nheads,nheads_k", [(32, 8), (8, 8)])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_equals_contiguous_with_shuffled_pages(page_size, nheads, nheads_k, d):
    gen = torch.Generator().manual_seed(page_size + nheads + d)
    torch.manual_seed(page_size * 3 + d)
    seqlens = [1, 517, 1000]
    q, k, v = _qkv(3, 4, 1000, nheads, nheads_k, d)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out_c, lse_c = _check(q, k, v, _args(d, seqused_k=used))
    k_cache, v_cache, table = _paged_cache(k, v, seqlens, page_size, gen)
    args = _args(d, seqused_k=used, page_table=table, max_seqlen_k=max(seqlens), num_splits=1)
    out_p, lse_p = _check(q, k_cache, v_cache, args)
    # the same keys in the same order through the same arithmetic
    assert (out_p.float() - out_c.float()).abs().max().item() <= torch.finfo(q.dtype).eps
    assert (lse_p - lse_c).abs().max().item() <= 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_paged_split_prefill_at_head_dim_96(causal):
    """hd96's 128x128 tile looks pages of whole tiles up per row (one lookup per tile spilled with
    seqused_k and split-KV)."""
    gen = torch.Generator().manual_seed(96 + causal)
    torch.manual_seed(96 + causal)
    seqlens = [300, 1000]
    q, k, v = _qkv(2, 300, 1024, 4, 2, 96)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = _paged_cache(k, v, seqlens, 256, gen)
    _check(q, k_cache, v_cache, _args(96, causal=causal, window_right=0 if causal else -1, seqused_k=used,
                                      page_table=table, max_seqlen_k=1024, num_splits=3))


@pytest.mark.parametrize("page_size", [1, 8, 24, 48, 100, 384, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_page_sizes_off_the_tile(page_size, causal):
    """Pages smaller than, not dividing, and larger than the 128-row key tile (384: whole tiles
    per page without a power of two)."""
    gen = torch.Generator().manual_seed(page_size)
    torch.manual_seed(page_size + causal)
    seqlens = [333, 64, 700]
    q, k, v = _qkv(3, 77, 700, 8, 2, 128, dtype=torch.float16)
    k_cache, v_cache, table = _paged_cache(k, v, seqlens, page_size, gen)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    _check(q, k_cache, v_cache, _args(128, causal=causal, window_right=0 if causal else -1, seqused_k=used,
                                      page_table=table, max_seqlen_k=700))


def test_paged_without_seqused_k_uses_every_page_of_the_table():
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    q, k, v = _qkv(2, 130, 512, 4, 4, 64)
    k_cache, v_cache, table = _paged_cache(k, v, [512, 512], 64, gen)
    _check(q, k_cache, v_cache, _args(64, causal=True, window_right=0, page_table=table, max_seqlen_k=512))


def test_paged_with_packed_queries():
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    seqlens_q, seqlens = [3, 0, 40], [100, 5, 260]
    _, k, v = _qkv(3, 1, 260, 8, 2, 128)
    cu_q = torch.tensor([0, 3, 3, 43], dtype=torch.int32, device="cuda")
    q = torch.randn(43, 8, 128, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache, table = _paged_cache(k, v, seqlens, 32, gen)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    for causal in (False, True):
        args = _args(128, causal=causal, window_right=0 if causal else -1, cu_seqlens_q=cu_q,
                     max_seqlen_q=max(seqlens_q), seqused_k=used, page_table=table, max_seqlen_k=260)
        _check(q, k_cache, v_cache, args)


# ------------------------------------------------------------------------------------------------
# split-KV equals unsplit
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", list(range(1, 17)) + [0])
@pytest.mark.parametrize("paged", [False, True])
def test_split_kv_equals_unsplit(paged, num_splits):
    gen = torch.Generator().manual_seed(num_splits)
    torch.manual_seed(100 + num_splits)
    seqlens = [1, 0, 300, 1500]  # an empty sequence and one shorter than a key block
    # 4 x 8 heads x 1 query block: few enough CTAs for the heuristic to split on any large GPU
    q, k, v = _qkv(4, 1, 1500, 8, 2, 128)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    backend = _backend(heuristic=num_splits == 0)
    unsplit, lse_unsplit = _check(q, k, v, _args(128, seqused_k=used, num_splits=1), backend=backend)
    if paged:
        k, v, table = _paged_cache(k, v, seqlens, 64, gen)
        args = _args(128, seqused_k=used, page_table=table, max_seqlen_k=1500, num_splits=num_splits)
    else:
        args = _args(128, seqused_k=used, num_splits=num_splits)
    if num_splits == 0:
        config = backend.config(q, k, v, None, args)
        assert split_kv.num_splits(q, k, args, config, heuristic=True) > 1
    out, lse = _check(q, k, v, args, backend=backend)
    assert (out.float() - unsplit.float()).abs().max().item() <= 2 * torch.finfo(q.dtype).eps
    live = ~torch.isneginf(lse_unsplit)
    assert (lse[live] - lse_unsplit[live]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("num_splits", [40, 48, 64])
@pytest.mark.parametrize("paged", [False, True])
def test_split_kv_beyond_32_splits_equals_unsplit(paged, num_splits):
    # the combine reads the LSEs of 32 splits per load and lane: past 32 splits it takes a second
    # round. 128 blocks of 64 keys in 40 / 48 / 64 splits are 32 / 43 / 64 live splits of the
    # longest sequence; shorter ones (and an empty one) have fewer in the same call
    gen = torch.Generator().manual_seed(num_splits)
    torch.manual_seed(200 + num_splits)
    seqlens = [8192, 0, 1000, 4200, 8000]
    q, k, v = _qkv(5, 1, 8192, 8, 2, 128)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    unsplit, lse_unsplit = _check(q, k, v, _args(128, seqused_k=used, num_splits=1))
    if paged:
        k, v, table = _paged_cache(k, v, seqlens, 64, gen)
        args = _args(128, seqused_k=used, page_table=table, max_seqlen_k=8192, num_splits=num_splits)
    else:
        args = _args(128, seqused_k=used, num_splits=num_splits)
    out, lse = _check(q, k, v, args)
    assert (out.float() - unsplit.float()).abs().max().item() <= 2 * torch.finfo(q.dtype).eps
    live = ~torch.isneginf(lse_unsplit)
    assert (lse[live] - lse_unsplit[live]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("num_splits", [2, 5, 16])
@pytest.mark.parametrize("mask", ["causal", "local"])
@pytest.mark.parametrize("d", [64, 256])
def test_split_kv_with_masks_and_long_queries(d, mask, num_splits):
    """Splits whose keys a query block cannot see write LSE -inf and are skipped by the combine."""
    torch.manual_seed(d + num_splits)
    q, k, v = _qkv(2, 300, 1100, 4, 2, d, dtype=torch.float16)
    window = (-1, 0) if mask == "causal" else (100, 20)
    _check(q, k, v, _args(d, causal=mask == "causal", window_left=window[0], window_right=window[1],
                          num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [0, 4])
@pytest.mark.parametrize("page_size,softcap", [(256, 0.0), (16, 0.0), (16, 30.0)])
def test_head_dim_256_sliding_window_decode_on_a_paged_cache(page_size, softcap, num_splits):
    """A window makes a short-query call unpackable, so hd256 runs the masked split kernel, whose
    own tile (32 keys per block, `make_config(split_kv=True)`) the splits and the combine count."""
    gen = torch.Generator().manual_seed(page_size + num_splits)
    torch.manual_seed(page_size * 3 + num_splits)
    seqlens = [2000, 5, 4096]
    q, k, v = _qkv(len(seqlens), 2, 4096, 8, 4, 256)
    k_cache, v_cache, table = _paged_cache(k, v, seqlens, page_size, gen)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    args = _args(256, window_left=1000, window_right=0, softcap=softcap, seqused_k=used, page_table=table,
                 max_seqlen_k=4096, num_splits=num_splits)
    backend = _backend(heuristic=True)
    split_config = backend.config(q, k_cache, v_cache, None, args, split_kv=True)
    assert split_config.tile_n == 32 and split_kv.num_splits(q, k_cache, args, split_config, heuristic=True) > 1
    _check(q, k_cache, v_cache, args, backend=backend)


@pytest.mark.parametrize("num_splits", [3, 16])
def test_split_kv_varlen_without_lse_and_padded_head_dim(num_splits):
    torch.manual_seed(num_splits)
    seqlens_q, seqlens_k = [1, 7, 0, 120], [900, 7, 50, 333]
    cu_q = torch.tensor([0, 1, 8, 8, 128], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 900, 907, 957, 1290], dtype=torch.int32, device="cuda")
    q = torch.randn(128, 6, 40, dtype=torch.float16, device="cuda")
    k = torch.randn(1290, 2, 40, dtype=torch.float16, device="cuda")
    v = torch.randn(1290, 2, 40, dtype=torch.float16, device="cuda")
    args = _args(40, causal=True, window_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), num_splits=num_splits)
    with_lse, _ = _check(q, k, v, args)
    without_lse, lse = _run(q, k, v, args, with_lse=False)
    assert lse is None and torch.equal(with_lse, without_lse)


@pytest.mark.parametrize("seqlen_q", range(1, 9))
def test_decode_shapes_paged_split_heuristic(seqlen_q):
    gen = torch.Generator().manual_seed(seqlen_q)
    torch.manual_seed(seqlen_q)
    seqlens = [4000, 1, 8192]
    q, k, v = _qkv(3, seqlen_q, 8192, 32, 8, 128)
    k_cache, v_cache, table = _paged_cache(k, v, seqlens, 16 * seqlen_q, gen)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    args = _args(128, causal=True, window_right=0, seqused_k=used, page_table=table, max_seqlen_k=8192,
                 num_splits=0)
    backend = _backend(heuristic=True)
    config = backend.config(q, k_cache, v_cache, None, args)
    assert split_kv.num_splits(q, k_cache, args, config, heuristic=True) > 1
    _check(q, k_cache, v_cache, args, backend=backend)


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("page_size", [0, 16, 64, 192])  # rows gathered per row (16), per tile (64, 192)
@pytest.mark.parametrize("nheads,nheads_k", [(32, 8), (8, 1)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_with_packed_gqa(d, nheads, nheads_k, page_size, num_splits):
    """One query token per sequence, the query heads of each KV head as the rows of one tile:
    the oracle's answer, as the unpacked kernel gives it."""
    gen = torch.Generator().manual_seed(d + nheads + page_size)
    torch.manual_seed(d * 7 + page_size + num_splits)
    seqlens = [1, 777, 3000, 0]
    q, k, v = _qkv(len(seqlens), 1, 3000, nheads, nheads_k, d)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    kw = dict(causal=True, window_right=0, seqused_k=used, num_splits=num_splits)
    if page_size:
        k, v, table = _paged_cache(k, v, seqlens, page_size, gen)
        kw.update(page_table=table, max_seqlen_k=max(seqlens))
    args = _args(d, softcap=30.0 if d == 64 else 0.0, **kw)
    backend = _backend(heuristic=True)
    backend.pack_gqa_decode = True
    out, lse = _check(q, k, v, args, backend=backend)
    backend.pack_gqa_decode = False
    out_unpacked, lse_unpacked = _check(q, k, v, args, backend=backend)
    scale = max(1.0, out_unpacked.abs().max().item())
    assert (out.float() - out_unpacked.float()).abs().max().item() <= 2 * torch.finfo(q.dtype).eps * scale
    if not page_size and d != 256:
        # cute-sm90 handing one-token GQA decode to these kernels (packed, split)
        from cute_flash.backends import get_backend
        from cute_flash.backends.cute import CuteSm90Backend

        sm90 = backend_or_skip(CuteSm90Backend)
        sm90.decode_on_sm80_kernels = True
        sm80 = get_backend("cute-sm80")  # the instance cute-sm90 hands its calls to
        sm80.pack_gqa_decode = True
        try:
            _check(q, k, v, args, backend=sm90)
        finally:
            sm80.pack_gqa_decode = False


@pytest.mark.parametrize("num_splits", [0, 1, 4])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_the_sm90_backend_takes_paged_and_split_calls(seqlen_q, num_splits):
    """cute-sm90 runs a paged cache or an explicit split-KV on these (sm_80) kernels."""
    from cute_flash.backends.cute import CuteSm90Backend

    backend = backend_or_skip(CuteSm90Backend)
    gen = torch.Generator().manual_seed(seqlen_q + num_splits)
    torch.manual_seed(seqlen_q * 5 + num_splits)
    seqlens = [4000, 1, 8192]
    q, k, v = _qkv(3, seqlen_q, 8192, 32, 8, 128)
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = _paged_cache(k, v, seqlens, 64, gen)
    paged = _args(128, causal=True, window_right=0, seqused_k=used, page_table=table, max_seqlen_k=8192,
                  num_splits=num_splits)
    _check(q, k_cache, v_cache, paged, backend=backend)
    if num_splits > 1:
        _check(q, k, v, _args(128, causal=True, window_right=0, seqused_k=used, num_splits=num_splits),
               backend=backend)


# ------------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------------
SENTINEL = 12345.0


def _live_splits(seqlen_k: int, tile_n: int, splits: int) -> int:
    n_blocks = -(-seqlen_k // tile_n)
    return 0 if n_blocks == 0 else -(-n_blocks // -(-n_blocks // splits))


@pytest.mark.parametrize("seqlen_q,packed_gqa", [(2, False), (1, True)])
@pytest.mark.parametrize("page_size", [16, 256])
def test_cuda_graph_captured_at_maximum_sizes_replays_shorter_sequences(page_size, seqlen_q, packed_gqa):
    """A decode step captured once at the longest length, replayed with shorter seqused_k and new
    page tables: equal to eager and to the oracle, and the partial slots of splits past each
    sequence keep the sentinel they were filled with (the surplus CTAs write nothing)."""
    gen = torch.Generator().manual_seed(page_size)
    torch.manual_seed(page_size)
    batch, nheads, nheads_k, d, max_keys, splits = 4, 32, 8, 128, 4096, 16
    backend = _backend()
    backend.pack_gqa_decode = packed_gqa
    q, k, v = _qkv(batch, seqlen_q, max_keys, nheads, nheads_k, d)
    k_cache, v_cache, table = _paged_cache(k, v, [max_keys] * batch, page_size, gen, spare_pages=64)
    used = torch.full((batch,), max_keys, dtype=torch.int32, device="cuda")
    args = _args(d, causal=True, window_right=0, seqused_k=used, page_table=table, max_seqlen_k=max_keys,
                 num_splits=splits)
    config = backend.config(q, k_cache, v_cache, None, args)
    o_shape, lse_shape = split_kv.partial_shapes(q, v_cache, args, splits)
    workspace = (torch.empty(o_shape, device="cuda"), torch.empty(lse_shape, device="cuda"))
    out = torch.empty(batch, seqlen_q, nheads, d, dtype=q.dtype, device="cuda")
    lse = torch.empty(batch, nheads, seqlen_q, device="cuda")

    backend.fwd(q, k_cache, v_cache, out, lse, args, workspace=workspace)  # compile before capturing
    check_forward(out, lse, q, k_cache, v_cache, args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.fwd(q, k_cache, v_cache, out, lse, args, workspace=workspace)

    for step, seqlens in enumerate(([4096, 1, 0, 2500], [63, 64, 65, 4000], [1, 1, 1, 1])):
        # new sequences: new keys in freshly shuffled pages, new lengths, new queries
        _, k_new, v_new = _qkv(batch, 1, max_keys, nheads, nheads_k, d)
        k_next, v_next, table_next = _paged_cache(k_new, v_new, seqlens, page_size, gen, spare_pages=64)
        k_cache.copy_(k_next)
        v_cache.copy_(v_next)
        table.copy_(table_next)
        used.copy_(torch.tensor(seqlens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        for t in workspace:
            t.fill_(SENTINEL)
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_forward(out, lse, q, k_cache, v_cache, args)
        for b, n in enumerate(seqlens):
            live = _live_splits(n, config.tile_n, splits)
            assert (workspace[0][live:, b] == SENTINEL).all(), f"step {step}: surplus split wrote partial O of batch {b}"
            assert (workspace[1][live:, b] == SENTINEL).all(), f"step {step}: surplus split wrote partial LSE of batch {b}"
            assert not (workspace[1][:live, b] == SENTINEL).any(), f"step {step}: a live split left LSE unwritten"
        graph_out, graph_lse = out.clone(), lse.clone()
        eager_out, eager_lse = _run(q, k_cache, v_cache, args, backend=backend)
        assert torch.equal(graph_out, eager_out) and torch.equal(graph_lse, eager_lse), f"step {step}: graph != eager"


# ------------------------------------------------------------------------------------------------
# caches beyond 4 GiB
# ------------------------------------------------------------------------------------------------
@pytest.mark.big_memory
def test_paged_cache_beyond_4gib_reads_its_last_pages():
    """k and v of 6 GiB each; the sequences live in the last pages, whose byte offsets need more
    than 32 bits. Every other page is NaN, so a wrapped address shows."""
    torch.manual_seed(7)
    page_size, nheads_k, d = 256, 8, 128
    page_bytes = page_size * nheads_k * d * 2
    num_pages = (6 << 30) // page_bytes
    seqlens = [3000, 4096, 1]
    per_seq = 4096 // page_size
    k_cache = torch.full((num_pages, page_size, nheads_k, d), NAN, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.full_like(k_cache, NAN)
    # the last 3 * 16 pages, shuffled
    last = torch.randperm(3 * per_seq, generator=torch.Generator().manual_seed(7)) + num_pages - 3 * per_seq
    table = last.view(3, per_seq).to(torch.int32).cuda()
    assert int(table.min()) * page_bytes >= 1 << 32
    for b, n in enumerate(seqlens):
        for p in range(-(-n // page_size)):
            rows = min(page_size, n - p * page_size)
            k_cache[int(table[b, p]), :rows].normal_()
            v_cache[int(table[b, p]), :rows].normal_()
    q = torch.randn(3, 1, 32, d, dtype=torch.bfloat16, device="cuda")
    used = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    for splits in (1, 7):
        args = _args(d, seqused_k=used, page_table=table, max_seqlen_k=4096, num_splits=splits)
        _check(q, k_cache, v_cache, args)
