"""The sm_90 forward kernel (TMA + WGMMA) against the float64 oracle, on an H100/H200 (`pytest -m gpu`).

Tolerance (DESIGN.md, `attention_oracle.check_forward`): max|out - ref| <= 2 * max|out_torch -
ref| + atol. Outputs are poisoned with NaN before every call, and Q/K/V sit inside NaN-filled
buffers (rows before and after, head-dim columns after) so that a TMA box reading past a
tensor's bounds, or a tile that is never stored, shows up as NaN.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from attention_oracle import (
    SEQLEN_PAIRS, backend_or_skip, check_forward, check_offsets_beyond_4gib, check_rescale_schedule, grow_row_max,
    randn_in_nan, run_forward, strided_qkv,
)
from cute_flash.backends.base import AttnArgs
from cute_flash.kernels.common.tiles import pad_headdim
from cute_flash.kernels.sm90 import fwd_config
from cute_flash.kernels.sm90.fwd_config import NO_KEEP_VOTE, ON_GRID, on_grid

pytestmark = pytest.mark.gpu

HEADDIMS = [64, 96, 128, 192, 256]
DTYPES = [torch.float16, torch.bfloat16]


def _backend():
    from cute_flash.backends.cute import CuteSm90Backend

    return backend_or_skip(CuteSm90Backend)


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dv, dtype):
    q = randn_in_nan((batch, seqlen_q, nheads, d), dtype, row_dim=1, pad_rows=5)
    k = randn_in_nan((batch, seqlen_k, nheads_k, d), dtype, row_dim=1, pad_cols=8)
    v = randn_in_nan((batch, seqlen_k, nheads_k, dv), dtype, row_dim=1, pad_cols=24)
    return q, k, v


def _run(q, k, v, args: AttnArgs):
    return run_forward(_backend(), q, k, v, args)


def _check(q, k, v, args: AttnArgs):
    out, lse = _run(q, k, v, args)
    check_forward(out, lse, q, k, v, args)


def _launch_config(backend, config, q, k, v, out, lse, args: AttnArgs) -> None:
    """Run the forward of `config` (not necessarily the one the backend would pick) into out, lse."""
    fn, _ = backend.cache.get(config, backend.arch())
    a = backend.cache.args
    backend.launch(fn, q, k, v, out, lse, args, a, extra=backend.launch_extra(config, q, k, args, a))
    torch.cuda.synchronize()


@pytest.fixture(params=["short", "wide"])
def causal_tile(request, monkeypatch):
    """Causal calls at head dim 128 of at most SHORT_SEQUENCE_ROWS query rows per sequence run
    128 x 128 (`short_sequences`), longer ones the table's 192 x 80: "wide" lowers the bound to 0,
    so that a test's short causal calls run 192 x 80 too."""
    if request.param == "wide":
        monkeypatch.setattr(fwd_config, "SHORT_SEQUENCE_ROWS", 0)
    return request.param


def _one_tile(causal_tile, causal, *head_dims):
    """Skip the "wide" run of a call whose tile does not depend on the length of its sequences."""
    padded = max(pad_headdim(d, fwd_config.TILE_HEADDIMS) for d in head_dims)
    if causal_tile == "wide" and not (causal and padded in fwd_config.SHORT_CAUSAL_TILES):
        pytest.skip("one tile for every length")


def _args(d, causal=False, **kw):
    return AttnArgs(softmax_scale=kw.pop("softmax_scale", 1.0 / math.sqrt(d)), causal=causal,
                    window_right=0 if causal else kw.pop("window_right", -1), **kw)


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_fwd_matches_oracle_for_headdims_and_seqlens(causal_tile, dtype, d, causal, seqlen_q, seqlen_k):
    _one_tile(causal_tile, causal, d)
    if seqlen_q * seqlen_k > 10**7 and d not in (64, 128, 256):
        pytest.skip("the longest pair runs for head dims 64/128/256 only")
    torch.manual_seed(seqlen_q * 7 + seqlen_k + d)
    batch, nheads = (1, 2) if seqlen_q * seqlen_k > 10**6 else (3, 3)
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, nheads, d, d, dtype)
    _check(q, k, v, _args(d, causal))


@pytest.mark.parametrize("nheads,nheads_k", [(6, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_fwd_gqa_and_mqa_share_kv_heads(causal_tile, nheads, nheads_k, causal):
    _one_tile(causal_tile, causal, 128)
    torch.manual_seed(nheads * 10 + nheads_k)
    q, k, v = _qkv(5, 257, 300, nheads, nheads_k, 128, 128, torch.bfloat16)
    _check(q, k, v, _args(128, causal))


@pytest.mark.parametrize("window", [(16, 0), (64, 64), (-1, 32), (100, -1), (0, 0), (200, 7)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (1023, 1024), (239, 1), (500, 130)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_fwd_sliding_window(d, seqlen_q, seqlen_k, window):
    torch.manual_seed(sum(window) + seqlen_q + d)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 4, 4, d, d, torch.bfloat16)
    _check(q, k, v, _args(d, window_left=window[0], window_right=window[1]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_fwd_softcap(causal_tile, d, causal):
    _one_tile(causal_tile, causal, d)
    torch.manual_seed(d)
    q, k, v = _qkv(2, 333, 517, 3, 3, d, d, torch.bfloat16)
    _check(q * 3, k, v, _args(d, causal, softcap=15.0))


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_fwd_softcap_with_a_window(d, varlen):
    """Softcap with a sliding window (hd64 runs one CTA per tile there: its persistent loop spilled)."""
    torch.manual_seed(d + varlen)
    if varlen:
        seqlens_q, seqlens_k = [113, 1, 700], [203, 64, 700]
        q, k, v, cu_q, cu_k = _varlen_batch(seqlens_q, seqlens_k, 3, 3, d, d, torch.bfloat16)
        args = _args(d, softcap=15.0, window_left=50, window_right=20, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                     max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k))
    else:
        q, k, v = _qkv(2, 333, 517, 3, 3, d, d, torch.bfloat16)
        args = _args(d, softcap=15.0, window_left=50, window_right=20)
    _check(q * 3, k, v, args)


def _varlen_batch(seqlens_q, seqlens_k, nheads, nheads_k, d, dv, dtype):
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(seqlens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = randn_in_nan((int(cu_q[-1]), nheads, d), dtype, row_dim=0, pad_rows=5)
    k = randn_in_nan((int(cu_k[-1]), nheads_k, d), dtype, row_dim=0)
    v = randn_in_nan((int(cu_k[-1]), nheads_k, dv), dtype, row_dim=0, pad_cols=24)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_sm90_fwd_varlen_and_seqused_k(causal_tile, d, causal, seqused):
    _one_tile(causal_tile, causal, d)
    torch.manual_seed(d + causal)
    seqlens_q = [1, 0, 113, 239, 1023, 64, 7]
    seqlens_k = [1, 5, 203, 1, 1024, 64, 300]
    q, k, v, cu_q, cu_k = _varlen_batch(seqlens_q, seqlens_k, 4, 2, d, d, torch.bfloat16)
    used = torch.tensor([1, 0, 150, 1, 1000, 17, 299], dtype=torch.int32, device="cuda") if seqused else None
    args = _args(d, causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(seqlens_q),
                 max_seqlen_k=max(seqlens_k), seqused_k=used)
    _check(q, k, v, args)


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_fwd_seqused_k_in_batch_mode(causal_tile, causal):
    _one_tile(causal_tile, causal, 128)
    torch.manual_seed(3)
    q, k, v = _qkv(3, 200, 512, 2, 2, 128, 128, torch.float16)
    used = torch.tensor([512, 1, 333], dtype=torch.int32, device="cuda")
    _check(q, k, v, _args(128, causal, seqused_k=used))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_fwd_ignores_nan_keys_past_seqused_k(causal_tile, d, causal):
    """A cache holding NaN past seqused_k (stale or never written) must not reach the output."""
    _one_tile(causal_tile, causal, d)
    torch.manual_seed(d + 1)
    q, k, v = _qkv(3, 150, 512, 2, 2, d, d, torch.bfloat16)
    used = [512, 77, 300]
    for b, n in enumerate(used):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    used = torch.tensor(used, dtype=torch.int32, device="cuda")
    _check(q, k, v, _args(d, causal, seqused_k=used))


@pytest.mark.parametrize("d", [8, 40, 72, 120, 136, 200])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_fwd_padded_headdims_read_no_padding(dtype, d):
    torch.manual_seed(d)
    q, k, v = _qkv(2, 301, 257, 3, 3, d, d, dtype)
    _check(q, k, v, _args(d, True))


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (64, 128), (40, 96)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_fwd_headdim_v_differs(causal_tile, d, dv, causal):
    _one_tile(causal_tile, causal, d, dv)
    torch.manual_seed(d + dv)
    dtype = torch.bfloat16 if causal else torch.float16
    q, k, v = _qkv(2, 211, 333, 4, 4, d, dv, dtype)
    _check(q, k, v, _args(d, causal))


def test_sm90_fwd_non_contiguous_inputs():
    """q sliced out of a packed qkv tensor; k and v from separate buffers with other row strides."""
    q, k, v = strided_qkv()
    assert len({q.stride(1), k.stride(1), v.stride(1)}) == 3
    _check(q, k, v, _args(64, True))


@pytest.mark.big_memory
def test_sm90_fwd_offsets_beyond_4gib():
    check_offsets_beyond_4gib(_backend())


def test_sm90_fwd_writes_nothing_past_seqlen_q():
    """Varlen tiles past a sequence's end store nothing (the grid covers max_seqlen_q)."""
    q, k, v, cu_q, cu_k = _varlen_batch([3, 300], [50, 50], 2, 2, 64, 64, torch.float16)
    sentinel = torch.full((q.shape[0] + 64, 2, 64), 7.0, dtype=torch.float16, device="cuda")
    out = sentinel[32 : 32 + q.shape[0]]
    out.fill_(float("nan"))
    lse = torch.full((2, q.shape[0]), float("nan"), dtype=torch.float32, device="cuda")
    args = _args(64, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=50)
    _backend().fwd(q, k, v, out, lse, args)
    torch.cuda.synchronize()
    assert (sentinel[:32] == 7).all() and (sentinel[32 + q.shape[0] :] == 7).all()
    check_forward(out, lse, q, k, v, args)


def test_sm90_fwd_batch_tiles_store_only_their_rows():
    """A TMA store of a last, partial query block clips at seqlen_q: batch b+1's rows survive."""
    torch.manual_seed(2)
    q, k, v = _qkv(3, 200, 130, 2, 2, 128, 128, torch.bfloat16)
    buf = torch.full((3, 200 + 56, 2, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    out = buf[:, :200]
    out.fill_(float("nan"))
    lse = torch.full((3, 2, 200), float("nan"), dtype=torch.float32, device="cuda")
    args = _args(128)
    _backend().fwd(q, k, v, out, lse, args)
    torch.cuda.synchronize()
    assert (buf[:, 200:] == 7).all()
    check_forward(out, lse, q, k, v, args)


@pytest.mark.parametrize("overlap,pingpong", [(False, False), (True, False)])
def test_sm90_fwd_schedule_variants_agree(overlap, pingpong):
    """The simpler schedules (no ping-pong; no intra-warpgroup overlap) give the same results."""
    from dataclasses import replace

    from cute_flash.backends.cute import CuteSm90Backend

    torch.manual_seed(9)
    q, k, v = _qkv(2, 777, 901, 4, 4, 128, 128, torch.bfloat16)
    args = _args(128, True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, 777), float("nan"), dtype=torch.float32, device="cuda")
    backend = CuteSm90Backend()
    base = backend.config(q, k, v, lse, args)
    # (masked_halves splits the blocks of the overlapped loop only, and pv_wait_at places its wait)
    config = replace(base, intra_wg_overlap=overlap, pingpong=pingpong, masked_halves=base.masked_halves and overlap,
                     pv_wait_at=base.pv_wait_at if overlap else -1)
    _launch_config(backend, config, q, k, v, out, lse, args)
    check_forward(out, lse, q, k, v, args)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (1001, 333), (1023, 1024), (2304, 2048)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,tile_n,grid", [(64, 128, False), (64, 192, False), (96, 112, False), (96, 128, False),
                                           (96, 144, True), (128, 80, False)])
def test_sm90_fwd_p_in_smem_matches_oracle(d, tile_n, grid, causal, seqlen_q, seqlen_k):
    """`p_in_smem` (P·V reading P from shared memory, each warpgroup's slot reused every key
    block) on the shipped tiles and on the wider key blocks it makes room for, persistent or one
    CTA per tile, with the half blocks where a causal call's blocks are 128 keys wide; rows that
    see no key (1001 x 333 causal) and key tails included. Outputs start as NaN."""
    from cute_flash.backends.cute import CuteSm90Backend

    torch.manual_seed(d + tile_n + seqlen_q)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 4, 2, d, d, torch.bfloat16)
    args = _args(d, causal)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, seqlen_q), float("nan"), dtype=torch.float32, device="cuda")
    backend = backend_or_skip(CuteSm90Backend)
    base = backend.config(q, k, v, lse, args)
    if grid:
        # one CTA per tile pairs an even number of query blocks only (the persistent loop takes
        # odd ones too, `cluster_tile_coords`)
        base = on_grid(replace(base, cluster_kv=base.cluster_kv and -(-seqlen_q // base.tile_m) % 2 == 0))
    config = replace(base, tile_n=tile_n, p_in_smem=True, masked_halves=base.persistent and causal and tile_n == 128)
    _launch_config(backend, config, q, k, v, out, lse, args)
    check_forward(out, lse, q, k, v, args)


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("growing_max", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (1023, 1024), (1001, 333), (4224, 4224)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_fwd_rescale_schedules_match_oracle(
        causal_tile, monkeypatch, d, causal, seqlen_q, seqlen_k, growing_max, lazy):
    """Lazy (the row max kept while it grows by <= 8, log2; shipped) or eager (every block moves
    it): out and LSE are the softmax's either way.

    `growing_max` adds a ramp that raises every row's max by ~5 (log2 units) per 128 keys in the
    order the kernel visits them (last key block first), so some blocks keep the reference and
    others move it; causal 1001 x 333 has rows that see no key (out 0, LSE -inf).
    """
    _one_tile(causal_tile, causal, d)
    torch.manual_seed(d + seqlen_k + growing_max)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 2, 2, d, d, torch.bfloat16)
    check_rescale_schedule(monkeypatch, _backend(), q, k, v, _args(d, causal), growing_max, lazy)


@pytest.mark.parametrize("growing_max", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (1001, 333), (2304, 2048)])
@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.0), (True, 30.0)])
@pytest.mark.parametrize("d", HEADDIMS)
def test_sm90_fwd_keep_vote_is_the_lazy_rescale_bit_for_bit(
        causal_tile, d, causal, softcap, seqlen_q, seqlen_k, growing_max):
    """`keep_vote` (a warp whose rows all keep their references skips the shuffles and selects)
    gives the lazy rescale's out and LSE bit for bit, on the configuration each call picks (with
    or without the vote as shipped); both match the oracle. With the P·V wait after the vote's
    branches (`pv_wait_at`: 16 exponentials in them, as head dim 128 ships, and 0) the rows' sums
    are added in two basic blocks, which the compiler's reassociation may round differently, so
    there out and LSE match the oracle and the lazy rescale's to within rounding (1-2 ulps of the
    LSE seen). The ramp
    makes some blocks move a row's reference and others keep it; causal 1001 x 333 has rows that
    see no key."""
    _one_tile(causal_tile, causal, d)
    torch.manual_seed(d + seqlen_k + growing_max)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 4, 2, d, d, torch.bfloat16)
    args = _args(d, causal, softcap=softcap)
    if growing_max:
        grow_row_max(q, k, args)
    backend = _backend()
    lse = torch.empty((2, 4, seqlen_q), dtype=torch.float32, device="cuda")
    base = replace(backend.config(q, k, v, lse, args), lazy_rescale=True, **NO_KEEP_VOTE)
    results = []
    configs = [base, replace(base, keep_vote=True)]
    if base.intra_wg_overlap:
        configs += [replace(base, keep_vote=True, pv_wait_at=at) for at in (16, 0)]
    for config in configs:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((2, 4, seqlen_q), float("nan"), dtype=torch.float32, device="cuda")
        _launch_config(backend, config, q, k, v, out, lse, args)
        results.append((out, lse))
    for config, (out, lse) in zip(configs[1:], results[1:]):
        check_forward(out, lse, q, k, v, args)
        if config.pv_wait_at < 0:
            assert torch.equal(results[0][0], out) and torch.equal(results[0][1], lse)
        else:
            torch.testing.assert_close(out, results[0][0], rtol=2 ** -7, atol=2 ** -14)
            torch.testing.assert_close(lse, results[0][1], rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("schedule", ["counter", "other take", "stride", "grid"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1500, 1500), (1001, 333), (333, 1001)])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_sm90_fwd_causal_schedules_cover_every_tile(causal_tile, d, seqlen_q, seqlen_k, schedule):
    """Causal calls with several times more tiles than SMs: persistent CTAs taking their tiles
    from the tile counter (shipped; the add that takes the next tile before or after a tile's
    loads, `late_take`), by a fixed stride, and one CTA per tile all store every tile (outputs
    start as NaN), rows that see no key included (1001 x 333)."""
    _one_tile(causal_tile, True, d)
    backend = _backend()
    torch.manual_seed(d + seqlen_q)
    q, k, v = _qkv(3, seqlen_q, seqlen_k, 24, 8, d, d, torch.bfloat16)
    args = _args(d, True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((3, 24, seqlen_q), float("nan"), dtype=torch.float32, device="cuda")
    shipped = backend.config(q, k, v, lse, args)
    assert shipped.tile_counter
    flags = {"counter": {}, "other take": dict(late_take=not shipped.late_take),
             "stride": dict(tile_counter=False, late_take=False),
             "grid": ON_GRID}
    config = replace(shipped, **flags[schedule])
    _launch_config(backend, config, q, k, v, out, lse, args)
    check_forward(out, lse, q, k, v, args)


def _kv_clusters_match_single_ctas(dtype, d, dv, seqlen_q, seqlen_k, odd_blocks):
    """A call of 3 x 24 heads over 8 KV heads that takes `cluster_kv` (with an odd number of
    query blocks where `odd_blocks`) passes the oracle, and its O and LSE are bitwise those of
    the same kernel without clusters."""
    backend = _backend()
    torch.manual_seed(d + dv + seqlen_q + seqlen_k)
    q, k, v = _qkv(3, seqlen_q, seqlen_k, 24, 8, d, dv, dtype)
    args = _args(d)
    lse = torch.empty(3, 24, seqlen_q, dtype=torch.float32, device="cuda")
    shipped = backend.config(q, k, v, lse, args)
    assert shipped.cluster_kv and -(-seqlen_q // shipped.tile_m) % 2 == odd_blocks, shipped.name
    out, lse = _run(q, k, v, args)
    check_forward(out, lse, q, k, v, args)
    alone = replace(shipped, cluster_kv=False)
    fn, _ = backend.cache.get(alone, backend.arch())
    a = backend.cache.args
    out1, lse1 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    backend.launch(fn, q, k, v, out1, lse1, args, a, extra=backend.launch_extra(alone, q, k, args, a))
    torch.cuda.synchronize()
    assert torch.equal(out, out1) and torch.equal(lse, lse1)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(2304, 2048), (1000, 1001), (1000, 77), (256, 4097)])
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_fwd_kv_clusters_match_single_ctas_bit_for_bit(dtype, d, dv, seqlen_q, seqlen_k):
    """Unmasked calls with an even number of query blocks take `cluster_kv` (pairs of CTAs that
    load half of each K/V tile into both by TMA multicast): the oracle passes, and O and the LSE
    are bitwise those of the same kernel without clusters (the same arithmetic in the same
    order). Key tails are cut mid-tile, K/V sit in NaN-filled buffers, and 3 x 24 heads give
    the persistent grid several tiles per cluster."""
    _kv_clusters_match_single_ctas(dtype, d, dv, seqlen_q, seqlen_k, odd_blocks=0)


# odd numbers of 192-row query blocks: 5, 3, 1 and 11
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(900, 1001), (461, 333), (100, 1001), (2000, 2048)])
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_fwd_kv_clusters_of_an_odd_number_of_query_blocks_match_single_ctas(dtype, d, dv, seqlen_q, seqlen_k):
    """Unmasked persistent calls with an odd number of query blocks and an even number of (batch,
    head) pairs take `cluster_kv` too: the last query blocks of two neighbouring pairs share a
    cluster, each CTA loading both halves of its own K/V tiles (`cluster_tile_coords`). The oracle
    passes and O and the LSE are bitwise those of single CTAs, with GQA (24 query heads over 8)
    putting pairs of different KV heads in one cluster, NaN-filled K/V buffers and key tails."""
    _kv_clusters_match_single_ctas(dtype, d, dv, seqlen_q, seqlen_k, odd_blocks=1)


# even numbers of query blocks of 128 rows (head dim 192) and of 192 (64 and 128)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1001), (701, 1001), (1001, 333), (256, 4097), (2304, 2304)])
@pytest.mark.parametrize("d,dv,softcap", [(128, 128, 0.0), (192, 192, 0.0), (128, 128, 15.0), (192, 192, 15.0),
                                          (192, 128, 0.0), (64, 128, 0.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_fwd_causal_kv_clusters_match_single_ctas_bit_for_bit(
        causal_tile, dtype, d, dv, softcap, seqlen_q, seqlen_k):
    """Causal K/V clusters (one CTA per tile): both CTAs walk the key blocks of the later query
    block, the earlier one letting those past its own go unread; the oracle passes and O and the
    LSE are bitwise those of single CTAs, soft-capped and with unequal head dims too. 1001 x 333
    has tiles that see no key next to tiles that do (the CTA with none still waits for the
    cluster's loads)."""
    _one_tile(causal_tile, True, d, dv)
    backend = _backend()
    torch.manual_seed(d + dv + seqlen_q + seqlen_k)
    q, k, v = _qkv(3, seqlen_q, seqlen_k, 24, 8, d, dv, dtype)
    args = _args(d, True, softcap=softcap)
    lse = torch.empty(3, 24, seqlen_q, dtype=torch.float32, device="cuda")
    grid = on_grid(backend.config(q, k, v, lse, args))
    results = []
    for config in (replace(grid, cluster_kv=True), grid):
        fn, _ = backend.cache.get(config, backend.arch())
        a = backend.cache.args
        out = torch.full((*q.shape[:-1], dv), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full_like(lse, float("nan"))
        backend.launch(fn, q, k, v, out, lse, args, a, extra=backend.launch_extra(config, q, k, args, a))
        torch.cuda.synchronize()
        check_forward(out, lse, q, k, v, args)
        results.append((out, lse))
    (out2, lse2), (out1, lse1) = results
    assert torch.equal(out2, out1) and torch.equal(lse2, lse1)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(12288, 12288), (12500, 12433)])
@pytest.mark.parametrize("d", [128, 192])
def test_sm90_fwd_long_causal_calls_take_kv_clusters_and_match_oracle(d, seqlen_q, seqlen_k):
    """What a causal call of 64 query blocks or more runs (`with_cluster_kv`: K/V clusters on one
    CTA per tile; 64 and 66 blocks of 192 rows at head dim 128, 96 and 98 of 128 at 192) passes the
    oracle, a query tail and rows that see no key (12500 x 12433) too."""
    backend = _backend()
    torch.manual_seed(d + seqlen_q)
    q, k, v = _qkv(1, seqlen_q, seqlen_k, 2, 1, d, d, torch.bfloat16)
    args = _args(d, True)
    config = backend.config(q, k, v, None, args)
    assert config.cluster_kv and not config.persistent, config.name
    _check(q, k, v, args)


def test_sm90_fwd_kv_cluster_grid_is_as_many_pairs_as_the_gpu_runs_at_once():
    """The persistent cluster grid asks the driver how many clusters of two CTAs of the kernel's
    shape fit at once (`max_active_clusters`), at most one CTA per SM, and launches no more."""
    from cute_flash.backends.sm90_schedule import max_active_clusters, persistent_schedule

    backend = _backend()
    q = torch.empty(2, 6144, 16, 128, dtype=torch.bfloat16, device="cuda")  # 32 blocks of 192 rows
    args = _args(128)
    config = backend.config(q, q, q, None, args)
    assert config.cluster_kv and config.persistent
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clusters = max_active_clusters(torch.cuda.current_device(), 2, config.num_threads, config.smem_bytes)
    assert clusters is not None and 0 < clusters <= sms // 2, clusters
    # a CTA that takes more than half an SM's shared memory leaves no room for a second per SM
    assert max_active_clusters(torch.cuda.current_device(), 2, 128, 1 << 10) >= clusters
    ctas, _ = persistent_schedule(config, q, q, args)
    assert ctas == 2 * clusters


def test_sm90_fwd_kv_clusters_only_where_both_ctas_see_the_same_keys():
    """`cluster_kv` needs an even number of query blocks (or, unmasked, of (batch, head) pairs) and
    no mask or varlen; other calls keep single CTAs (and still pass the oracle): 5 blocks of 192
    rows over 7 pairs, and a causal call of 12."""
    backend = _backend()
    torch.manual_seed(3)
    for seqlen_q, causal in ((900, False), (2304, True)):
        q, k, v = _qkv(1, seqlen_q, 1024, 7, 7, 128, 128, torch.bfloat16)
        args = _args(128, causal)
        assert not backend.config(q, k, v, None, args).cluster_kv
        _check(q, k, v, args)


def test_sm90_fwd_tile_counters_of_concurrent_calls_are_their_own():
    """Causal calls queued back to back on two streams, each stream with its own tile counter,
    give the results of one call alone: no call takes or skips another's tiles."""
    backend = _backend()
    torch.manual_seed(5)
    q, k, v = _qkv(4, 1024, 1024, 16, 16, 128, 128, torch.bfloat16)
    args = _args(128, True)
    alone, _ = _run(q, k, v, args)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for i in range(8):
        with torch.cuda.stream(streams[i % 2]):
            out = torch.full_like(q, float("nan"))
            backend.fwd(q, k, v, out, None, args)
            outs.append(out)
    torch.cuda.synchronize()
    for out in outs:
        assert torch.equal(out, alone)


@pytest.mark.parametrize("d", [64, 96, 128])
def test_sm90_fwd_tile_counter_is_back_at_zero_after_every_call(d):
    """A stream's tile counter serves every causal call queued on it: the kernel's last add sets
    it back to 0, so calls of different sizes back to back each take every tile of their own."""
    backend = _backend()
    torch.manual_seed(d)
    shapes = [(2, 1500, 1500, 16, 8), (1, 333, 1001, 8, 8), (3, 1001, 1001, 24, 8), (2, 1500, 1500, 16, 8)]
    outs = []
    for b, sq, sk, h, hk in shapes:
        q, k, v = _qkv(b, sq, sk, h, hk, d, d, torch.bfloat16)
        args = _args(d, True)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
        assert backend.config(q, k, v, lse, args).tile_counter
        backend.fwd(q, k, v, out, lse, args)
        outs.append((out, lse, q, k, v, args))
    torch.cuda.synchronize()
    assert backend._tile_counters and all(c.item() == 0 for c in backend._tile_counters.values())
    for out, lse, q, k, v, args in outs:
        check_forward(out, lse, q, k, v, args)


@pytest.mark.parametrize("d", [64, 128])
def test_sm90_fwd_causal_cuda_graph_replays_take_every_tile(d):
    """A causal call captured in a CUDA graph and replayed with new inputs: each replay zeroes the
    tile counter it took at capture, so every replay stores every tile (outputs poisoned before
    each replay) and equals an eager call."""
    backend = _backend()
    torch.manual_seed(d)
    q, k, v = _qkv(2, 1500, 1500, 16, 8, d, d, torch.bfloat16)
    args = _args(d, True)
    out = torch.empty_like(q)
    lse = torch.empty(2, 16, 1500, dtype=torch.float32, device="cuda")
    assert backend.config(q, k, v, lse, args).tile_counter
    backend.fwd(q, k, v, out, lse, args)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.fwd(q, k, v, out, lse, args)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_forward(out, lse, q, k, v, args)
        eager_out, eager_lse = _run(q, k, v, args)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, False)])
def test_sm90_fwd_profiling_build_writes_sane_records_and_the_same_output(d, causal):
    """`Sm90FwdConfig.timeline` (benchmarks/fwd_timeline.py): O is the shipped build's, bit for
    bit; its records replace the LSE of each tile's first 32 rows and nothing else, and hold the
    tile's key-block count, stamps in order and every warpgroup's phase cycles."""
    from cute_flash.backends.cute import CuteSm90Backend

    torch.manual_seed(3)
    b, s, h = 2, 1000, 4
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    args = _args(d, causal)
    backend = CuteSm90Backend()
    a = backend.cache.args
    runs = {}
    shipped = backend.config(q, k, v, torch.empty(b, h, s, device="cuda"), args)
    for config in (shipped, replace(shipped, timeline=True)):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, s), float("nan"), dtype=torch.float32, device="cuda")
        fn, _ = backend.cache.get(config, backend.arch())
        backend.launch(fn, q, k, v, out, lse, args, a, extra=backend.launch_extra(config, q, k, args, a))
        torch.cuda.synchronize()
        runs[config.timeline] = (out, lse)
    (out0, lse0), (out1, lse1) = runs[False], runs[True]
    assert torch.equal(out0, out1)
    tile_m = shipped.tile_m
    record_rows = torch.zeros(s, dtype=torch.bool)
    for m in range(0, s, tile_m):
        if s - m >= 32:
            record_rows[m:m + 32] = True
    assert torch.equal(lse0[..., ~record_rows], lse1[..., ~record_rows])
    ints = lse1.view(torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_blocks = math.ceil(s / shipped.tile_n)
    for m in range(0, s, tile_m):
        if s - m < 32:
            continue
        last_row = min(m + tile_m, s) - 1
        expected = min(n_blocks, last_row // shipped.tile_n + 1) if causal else n_blocks
        for r in ints[..., m:m + 32].reshape(-1, 32).tolist():
            assert 0 <= r[0] < sms and r[1] == expected
            stamps = [(t - r[2]) % (1 << 32) for t in r[2:7]]
            assert stamps == sorted(stamps) and stamps[-1] < 10 ** 9
            for wg in range(shipped.num_consumer_wgs):
                phases = [x % (1 << 32) for x in r[8 + 8 * wg: 15 + 8 * wg]]
                assert r[15 + 8 * wg] == expected - 1 and (expected == 1 or sum(phases) > 0)
