"""The persistent sm_90 forward's tile order and grid (host side; the kernel is checked on a GPU
by tests/gpu/test_fwd_sm90.py, whose head dims 64 to 128 run it)."""

from itertools import product

import pytest
import torch

from cute_flash.backends.base import AttnArgs
from cute_flash.backends.cute import CuteSm90Backend
from cute_flash.backends.sm90_schedule import PERSISTENT_L2_BYTES, heads_per_section, persistent_schedule
from cute_flash.kernels.sm90 import fwd_config as fc
from cute_flash.kernels.sm90.fwd_sync import cluster_tile_coords, tile_coords


@pytest.mark.parametrize("m_blocks,heads,batch,per_section", [(1, 1, 1, 1), (5, 3, 2, 1), (5, 3, 2, 4), (7, 4, 3, 5),
                                                              (3, 8, 1, 8), (4, 2, 2, 100)])
@pytest.mark.parametrize("longest_first", [False, True])
def test_tile_coords_visit_every_tile_once_in_section_order(m_blocks, heads, batch, per_section, longest_first):
    total = m_blocks * heads * batch
    coords = [tile_coords(t, m_blocks, heads, batch, per_section, longest_first) for t in range(total)]
    assert sorted(coords) == sorted(product(range(m_blocks), range(heads), range(batch)))
    pairs = [b * heads + h for _, h, b in coords]
    # a section's (batch, head) pairs are consecutive and its tiles come together
    for t, pair in enumerate(pairs):
        assert pair // per_section == t // (m_blocks * per_section)
    # inside a section the query blocks go in order, longest (last) first when asked
    for section in range(-(-heads * batch // per_section)):
        ms = [m for (m, h, b), p in zip(coords, pairs) if p // per_section == section]
        assert ms == sorted(ms, reverse=longest_first)


def test_tile_coords_with_one_head_per_section_is_the_grid_order():
    coords = [tile_coords(t, 4, 3, 2, 1, False) for t in range(24)]
    assert coords == [(m, h, b) for b in range(2) for h in range(3) for m in range(4)]
    causal = [tile_coords(t, 4, 3, 2, 1, True) for t in range(24)]
    assert causal == [(3 - m, h, b) for b in range(2) for h in range(3) for m in range(4)]


@pytest.mark.parametrize("m_blocks,pairs", [(1, 2), (1, 6), (2, 1), (3, 4), (5, 2), (6, 3), (11, 8), (43, 32)])
def test_cluster_tile_coords_cover_every_query_block_once(m_blocks, pairs):
    """Each tile of a persistent K/V-cluster grid gives its two CTAs neighbouring query blocks of
    one (batch, head) pair (lone 0), or, with an odd number of query blocks, the last query block
    of two neighbouring pairs (lone 1, one per two pairs); together they cover every block once."""
    seen = []
    lone_tiles = 0
    for tile in range(m_blocks * pairs // 2):
        (m0, p0, lone0), (m1, p1, lone1) = (cluster_tile_coords(tile, m_blocks, rank) for rank in (0, 1))
        assert lone0 == lone1 in (0, 1)
        if lone0:
            assert m0 == m1 == m_blocks - 1 and p1 == p0 + 1 and p0 % 2 == 0
            lone_tiles += 1
        else:
            assert p0 == p1 and m1 == m0 + 1 and m0 % 2 == 0
        seen += [(m0, p0), (m1, p1)]
    assert sorted(seen) == sorted(product(range(m_blocks), range(pairs)))
    assert lone_tiles == (pairs // 2 if m_blocks % 2 else 0)
    if m_blocks % 2 == 0:  # the order of tile_coords' pairs of query blocks, one head per section
        for tile in range(m_blocks * pairs // 2):
            m_pair, head, batch = tile_coords(tile, m_blocks // 2, pairs, 1, 1, False)
            assert cluster_tile_coords(tile, m_blocks, 0)[:2] == (2 * m_pair, head)


def _q(batch, seqlen, heads, d=128):
    return torch.empty(batch, seqlen, heads, d, dtype=torch.bfloat16)


def test_persistent_schedule_one_cta_per_sm_at_most_one_per_tile():
    config = fc.make_config("bfloat16", 128, 128)
    assert config.persistent
    q = _q(2, 8192, 16)
    assert persistent_schedule(config, q, q, AttnArgs(0.1), num_sms=132) == (132, 1)
    small = _q(1, 200, 2)  # 2 query blocks of 192 rows x 2 heads
    assert persistent_schedule(config, small, small, AttnArgs(0.1), num_sms=132) == (4, 1)


def test_persistent_schedule_sections_fit_the_l2_budget_for_causal_calls():
    config = fc.make_config("bfloat16", 128, 128, causal=True)
    q, k = _q(2, 8192, 16), _q(2, 8192, 4)  # GQA: 4 query heads share one KV head
    ctas, per_section = persistent_schedule(config, q, k, AttnArgs(0.1, causal=True, window_right=0), num_sms=132)
    per_head = 8192 * 256 * 2 // 4
    assert ctas == 132 and per_section == PERSISTENT_L2_BYTES // per_head
    causal = AttnArgs(0.1, causal=True, window_right=0)
    short = _q(64, 256, 16)  # 128 KB of K/V per head
    assert persistent_schedule(config, short, short, causal, num_sms=132)[1] == PERSISTENT_L2_BYTES // (128 << 10)
    few = _q(4, 256, 16)
    assert persistent_schedule(config, few, few, causal, num_sms=132)[1] == 4 * 16  # every pair fits


def test_persistent_flag_names_smem_and_table():
    base = fc.make_config("bfloat16", 128, 128, persistent=False)
    persistent = fc.make_config("bfloat16", 128, 128)
    assert persistent.name == base.name + "_persistent"
    assert persistent.smem_bytes - base.smem_bytes == 2 * persistent.tile_m * 128  # O apart from Q
    assert fc.make_config("bfloat16", 64, 64).persistent
    # causal tiles come from the tile counter (a fixed stride balances them badly), except where
    # that loop spills (hd64 with softcap)
    causal = fc.make_config("bfloat16", 64, 64, causal=True)
    assert causal.persistent and causal.tile_counter and causal.name.endswith("_persistent_counter_latetake")
    assert causal.late_take  # the add that takes the next tile after this one's loads
    assert not fc.make_config("bfloat16", 128, 128).tile_counter
    assert not fc.make_config("bfloat16", 64, 64, causal=True, softcap=True).persistent
    assert not fc.make_config("bfloat16", 64, 64, local=True, softcap=True, varlen_q=True, varlen_k=True).persistent
    assert fc.make_config("bfloat16", 64, 64, softcap=True).persistent
    assert fc.make_config("bfloat16", 96, 96, causal=True, softcap=True).tile_counter
    # and hd96 with seqused_k (80-88 B spilled in the persistent loop)
    for flags in ({}, {"causal": True}, {"varlen_q": True, "varlen_k": True}):
        assert not fc.make_config("bfloat16", 96, 96, seqused_k=True, **flags).persistent
    assert fc.make_config("bfloat16", 64, 64, seqused_k=True).persistent
    assert not fc.make_config("bfloat16", 64, 64, causal=True, persistent=False).tile_counter  # (for A/B)
    with pytest.raises(ValueError, match="tile_counter"):
        fc.make_config("bfloat16", 256, 256, causal=True, tile_counter=True)
    with pytest.raises(ValueError, match="late_take"):
        fc.make_config("bfloat16", 128, 128, late_take=True)  # no counter to take from
    assert not fc.make_config("bfloat16", 256, 256).persistent  # Q and O apart do not fit
    with pytest.raises(ValueError, match="shared memory"):
        fc.make_config("bfloat16", 256, 256, persistent=True)


def test_launch_extra_gives_every_sm90_kernel_its_scheduling_arguments(monkeypatch):
    import cute_flash.backends.cute as cute_backend
    from cute_flash.backends import sm90_schedule

    monkeypatch.setattr(sm90_schedule, "_num_sms", lambda device: 132)

    class Args:
        @staticmethod
        def i32(x):
            return ("i32", x)

        @staticmethod
        def tensor(t, align):
            return t

    backend = CuteSm90Backend()
    q = _q(1, 1000, 4)
    grid = fc.make_config("bfloat16", 64, 64, persistent=False)
    assert backend.launch_extra(grid, q, q, AttnArgs(0.1), Args()) == (("i32", 1),) * 2 + (None,)
    # a causal grid takes its section of the tile order all the same
    causal_grid = fc.make_config("bfloat16", 64, 64, causal=True, persistent=False)
    causal = AttnArgs(0.1, causal=True, window_right=0)
    assert backend.launch_extra(causal_grid, q, q, causal, Args()) == (
        ("i32", 1), ("i32", heads_per_section(causal_grid, q, q, causal)), None)
    monkeypatch.setattr(sm90_schedule, "SECTIONED_TILE_ORDER", False)
    assert backend.launch_extra(causal_grid, q, q, causal, Args()) == (("i32", 1),) * 2 + (None,)
    config = fc.make_config("bfloat16", 128, 128)
    extra = backend.launch_extra(config, q, q, AttnArgs(0.1), Args())
    assert extra == tuple(("i32", x) for x in persistent_schedule(config, q, q, AttnArgs(0.1), num_sms=132)) + (None,)
    # a causal persistent call gets its stream's zeroed counter (the kernel zeroes it again)
    counted = fc.make_config("bfloat16", 128, 128, causal=True)
    stream = {"handle": 1}
    monkeypatch.setattr(cute_backend, "_capturing", lambda: False)
    monkeypatch.setattr(cute_backend, "_stream_key", lambda device: (0, stream["handle"]))
    first = backend.launch_extra(counted, q, q, causal, Args())
    second = backend.launch_extra(counted, q, q, causal, Args())
    assert first[:2] == tuple(("i32", x) for x in persistent_schedule(counted, q, q, causal, num_sms=132))
    assert first[2].dtype == torch.int32 and first[2].tolist() == [0]
    assert first[2] is second[2]  # one stream, one counter
    stream["handle"] = 2
    other = backend.launch_extra(counted, q, q, causal, Args())[2]
    assert other is not first[2] and other.tolist() == [0]  # another stream, its own
    # while a graph is captured every call takes a new counter, zeroed by the graph on replay
    monkeypatch.setattr(cute_backend, "_capturing", lambda: True)
    captured = [backend.launch_extra(counted, q, q, causal, Args())[2] for _ in range(2)]
    assert captured[0] is not captured[1] and all(c is not first[2] and c.tolist() == [0] for c in captured)


def _recording_backend(backend, monkeypatch):
    """`backend` with every compiled kernel replaced by a recorder of its launch arguments (as
    TVM-FFI takes them: tensors and Python scalars), and no device context entered."""
    import contextlib

    from cute_flash.backends import cute as cute_backend, sm90_schedule, split_kv
    from cute_flash.backends.kernel_cache import KernelArgs

    calls = []
    monkeypatch.setattr(KernelArgs, "context", lambda self, device: contextlib.nullcontext())
    monkeypatch.setattr(cute_backend, "_num_sms", lambda device: 132)
    monkeypatch.setattr(sm90_schedule, "_num_sms", lambda device: 132)
    monkeypatch.setattr(split_kv, "num_sms", lambda device: 132)
    monkeypatch.setattr(backend, "arch", lambda device=None: "sm_90a")
    for cache in (backend.cache, getattr(backend, "combine_cache", None)):
        if cache is not None:
            monkeypatch.setattr(cache, "args", KernelArgs(tvm_ffi=True))
            monkeypatch.setattr(cache, "get", lambda config, arch: ((lambda *a: calls.append((config, a))), None))
    return calls


@pytest.mark.parametrize("varlen", [False, True])
def test_the_forward_launch_passes_batch_longest_queries_and_scheduling(monkeypatch, varlen):
    backend = CuteSm90Backend()
    calls = _recording_backend(backend, monkeypatch)
    if varlen:
        q = torch.zeros(700, 4, 64, dtype=torch.bfloat16)
        cu = torch.tensor([0, 300, 300, 700], dtype=torch.int32)
        args = AttnArgs(0.1, causal=True, window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=400,
                        max_seqlen_k=400)
        batch, longest = 3, 400
    else:
        q = torch.zeros(2, 1000, 4, 64, dtype=torch.bfloat16)
        args = AttnArgs(0.1)
        batch, longest = 2, 1000
    backend.fwd(q, q, q, torch.empty_like(q), None, args)
    (config, launched), = calls
    assert launched[8:10] == (batch, longest)  # num_batch, max_seqlen_q after the 8 tensors
    assert launched[12:14] == (args.window_left, args.window_right)
    if config.persistent:
        assert launched[14:16] == persistent_schedule(config, q, q, args, num_sms=132)
    else:
        assert launched[14:16] == (1, heads_per_section(config, q, q, args))
    counter = launched[16]
    assert (counter.tolist() == [0]) if config.tile_counter else counter is None


def test_split_kv_forward_and_combine_launch_with_the_same_batch_and_query_rows(monkeypatch):
    from cute_flash.backends.cute import CuteSm80Backend

    backend = CuteSm80Backend()
    calls = _recording_backend(backend, monkeypatch)
    q = torch.zeros(3, 1, 8, 64, dtype=torch.bfloat16)  # one token, 4 query heads per KV head: packed
    k = torch.zeros(3, 500, 2, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    backend.fwd(q, k, k, out, torch.empty(3, 8, 1), AttnArgs(0.1, num_splits=4))
    (fwd_config, fwd), (combine_config, combine) = calls
    assert fwd_config.split_kv and fwd[-1] == 4
    assert combine[8:11] == (3, fwd[9], 4)  # num_batch, max_seqlen_q, splits: the forward's
    assert fwd[8] == 3 and fwd[9] == 4  # the 4 query heads of a group packed as 4 rows


def test_kv_clusters_pair_query_blocks_that_see_the_same_keys():
    backend = CuteSm90Backend()
    args = AttnArgs(0.1)
    even, odd = _q(2, 1024, 16), _q(2, 900, 16)  # 6 and 5 query blocks of 192
    config = backend.config(even, even, even, None, args)
    assert config.cluster_kv and config.name.endswith("_persistent_cluster")
    # an odd number of query blocks: the last ones go two heads to a cluster, for an even number
    # of (batch, head) pairs (32 here, 3 and 15 below)
    assert backend.config(odd, odd, odd, None, args) == config
    assert not backend.config(*[_q(1, 900, 3)] * 3, None, args).cluster_kv
    assert not backend.config(*[_q(3, 900, 5)] * 3, None, args).cluster_kv
    assert backend.config(*[_q(3, 1024, 5)] * 3, None, args).cluster_kv
    causal = AttnArgs(0.1, causal=True, window_right=0)
    assert not backend.config(even, even, even, None, causal).cluster_kv
    local = AttnArgs(0.1, window_left=64, window_right=0)
    assert not backend.config(even, even, even, None, local).cluster_kv
    # causal calls from 64 query blocks on, at head dims 128 (192 rows) and 192 (128 rows), on
    # one CTA per tile
    long = _q(2, 64 * 192, 16)
    config = backend.config(long, long, long, None, causal)
    assert config.cluster_kv and not config.persistent and not config.tile_counter
    assert not backend.config(_q(2, 62 * 192, 16), long, long, None, causal).cluster_kv
    assert backend.config(*[_q(2, 64 * 128, 8, 192)] * 3, None, causal).cluster_kv
    assert not backend.config(*[_q(2, 64 * 192, 32, 64)] * 3, None, causal).cluster_kv
    assert not backend.config(*[_q(2, 64 * 128, 8, 256)] * 3, None, causal).cluster_kv
    assert not backend.config(long, long, long, None, local).cluster_kv
    # hd64's 192-row tiles: 1152 rows are 6 query blocks, 1200 are 7
    hd64 = [_q(2, s, 32, 64) for s in (1152, 1200)]
    assert backend.config(*[hd64[0]] * 3, None, args).cluster_kv
    assert backend.config(*[hd64[1]] * 3, None, args).cluster_kv
    assert not backend.config(*[_q(1, 1200, 7, 64)] * 3, None, args).cluster_kv
    # head dim 192's one CTA per tile pairs an even number of query blocks only
    assert not backend.config(*[_q(2, 800, 8, 192)] * 3, None, args).cluster_kv  # 7 blocks of 128
    # head dim 192's one CTA per tile takes clusters too, 256's 128 x 64 tile does not
    assert backend.config(*[_q(2, 1024, 8, 192)] * 3, None, args).cluster_kv
    assert not backend.config(*[_q(2, 1024, 8, 256)] * 3, None, args).cluster_kv
    for flags in (dict(causal=True), dict(local=True), dict(varlen_q=True, varlen_k=True), dict(seqused_k=True)):
        with pytest.raises(ValueError, match="cluster_kv"):
            fc.Sm90FwdConfig(**{**fc.make_config("bfloat16", 128, 128).__dict__, "tile_counter": False,
                                "cluster_kv": True, **flags})


def test_kv_cluster_grid_is_pairs_of_ctas():
    config = fc.with_cluster_kv(fc.make_config("bfloat16", 128, 128), 64)
    assert config.cluster_kv
    q = _q(2, 8192, 16)
    assert persistent_schedule(config, q, q, AttnArgs(0.1), num_sms=132) == (132, 1)
    assert persistent_schedule(config, q, q, AttnArgs(0.1), num_sms=133) == (132, 1)
    small = _q(1, 256, 3)  # 2 query blocks x 3 heads: 3 pairs
    assert persistent_schedule(config, small, small, AttnArgs(0.1), num_sms=132) == (6, 1)
    # as many pairs as the GPU runs at once: a pair that waited for a free one would walk its
    # share of the tiles after the others are done
    assert persistent_schedule(config, q, q, AttnArgs(0.1), num_sms=132, num_clusters=60) == (120, 1)
    assert persistent_schedule(config, q, q, AttnArgs(0.1), num_sms=132, num_clusters=80) == (132, 1)
    assert persistent_schedule(config, small, small, AttnArgs(0.1), num_sms=132, num_clusters=2) == (4, 1)


def test_kv_cluster_launch_refuses_an_odd_number_of_query_blocks():
    """A cluster's two CTAs take neighbouring query blocks, or the last ones of two heads: a
    configuration with `cluster_kv` is refused for a call whose last block would have no partner
    (`with_cluster_kv` never picks it, but the A/B scripts build such configurations by hand)."""
    backend = CuteSm90Backend()
    config = fc.with_cluster_kv(fc.make_config("bfloat16", 64, 64), 6)
    assert config.cluster_kv and config.tile_m == 192
    assert fc.takes_lone_tiles(config, 8) and not fc.takes_lone_tiles(config, 3)
    odd = _q(1, 461, 3, 64)  # 3 query blocks of 192, 3 (batch, head) pairs
    with pytest.raises(ValueError, match=r"cluster_kv.*461.*odd number of 192-row blocks.*\(here 3\)"):
        backend.launch_extra(config, odd, odd, AttnArgs(0.1), backend.cache.args)
    grid = fc.with_cluster_kv(fc.make_config("bfloat16", 192, 192), 6)
    assert grid.cluster_kv and not grid.persistent and not fc.takes_lone_tiles(grid, 8)
    with pytest.raises(ValueError, match="odd number of 128-row blocks"):
        backend.launch_extra(grid, *[_q(2, 300, 4, 192)] * 2, AttnArgs(0.1), backend.cache.args)
    causal = fc.with_cluster_kv(fc.make_config("bfloat16", 128, 128, causal=True), 64)
    assert causal.cluster_kv and not causal.persistent
    with pytest.raises(ValueError, match="odd number of 192-row blocks"):
        backend.launch_extra(causal, *[_q(1, 64 * 192 + 10, 2)] * 2, AttnArgs(0.1, causal=True), backend.cache.args)


def test_max_active_clusters_is_none_where_the_driver_cannot_say():
    from cute_flash.backends.sm90_schedule import max_active_clusters

    if torch.cuda.is_available():
        pytest.skip("a GPU answers (tests/gpu/test_fwd_sm90.py checks it)")
    assert max_active_clusters(0, 2, 384, 200 << 10) is None


def test_causal_sections_divide_the_pairs_where_a_size_up_to_twice_the_budget_does():
    """A last section of few pairs leaves SMs idle at the end (`even_sections`): 32 pairs of 3 MB
    (head dim 96, 2 x 8192 x 16 heads) fit 5 to the budget and take sections of 8; sizes that
    divide the pairs already, or with no divisor up to twice the budget, stay as they are."""
    from cute_flash.backends.sm90_schedule import even_sections

    config = fc.make_config("bfloat16", 96, 96, causal=True)
    causal = AttnArgs(0.1, causal=True, window_right=0)
    q = _q(2, 8192, 16, d=96)
    assert PERSISTENT_L2_BYTES // (8192 * 192 * 2) == 5
    assert heads_per_section(config, q, q, causal) == 8
    unmasked = fc.make_config("bfloat16", 96, 96)
    assert heads_per_section(unmasked, q, q, AttnArgs(0.1)) == 1  # one head at a time
    assert even_sections(32, 5) == 8 and even_sections(32, 16) == 16 and even_sections(64, 8) == 8
    assert even_sections(31, 5) == 5  # prime: no divisor from 5 to 10
    assert even_sections(7, 5) == 7 and even_sections(3, 3) == 3
    for pairs in range(1, 200):
        for fit in range(1, pairs + 1):
            size = even_sections(pairs, fit)
            assert fit <= size <= 2 * fit and (size == fit or pairs % size == 0)


def test_causal_sections_hold_at_least_their_longest_tile_of_work_per_cta():
    """A persistent causal section's work per CTA is at least its longest tile
    (`least_causal_section`): head dim 96 at 1 x 16384 x 16 heads (86 query blocks of 192 rows,
    2 heads' K/V in the L2 budget) takes sections of 4 from 132 CTAs; the grid (no CTA count)
    keeps the budget's 2, and so do calls whose budget is the larger."""
    from cute_flash.backends.sm90_schedule import least_causal_section

    config = fc.make_config("bfloat16", 96, 96, causal=True)
    causal = AttnArgs(0.1, causal=True, window_right=0)
    q = _q(1, 16384, 16, d=96)
    assert PERSISTENT_L2_BYTES // (16384 * 192 * 2) == 2
    assert least_causal_section(132, 86) == 4
    assert heads_per_section(config, q, q, causal, 132) == 4
    assert heads_per_section(config, q, q, causal) == 2
    assert persistent_schedule(config, q, q, causal, num_sms=132) == (132, 4)
    # 21 heads: 4 raised to 7, which divides them
    assert heads_per_section(config, _q(1, 16384, 21, d=96), _q(1, 16384, 21, d=96), causal, 132) == 7
    # 2 x 8192 x 16 (43 blocks): the rule asks for 6, the budget's 5 divide up to 8 already
    q8 = _q(2, 8192, 16, d=96)
    assert least_causal_section(132, 43) == 6 and heads_per_section(config, q8, q8, causal, 132) == 8
    # a window keeps the budget's sections
    local = fc.make_config("bfloat16", 96, 96, local=True)
    assert heads_per_section(local, q, q, AttnArgs(0.1, window_left=512, window_right=0), 132) == 2
    for ctas in (1, 66, 132):
        for blocks in range(1, 300):
            least = least_causal_section(ctas, blocks)
            assert least * blocks * (blocks + 1) / 2 >= ctas * blocks > (least - 1) * blocks * (blocks + 1) / 2
