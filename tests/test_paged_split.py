"""Paged KV and split-KV on the CPU: configuration flags, the number-of-splits heuristic, the
partial buffers, the API gate for features not yet verified on a GPU, and compiles of the paged /
split forward kernel and of the combine kernel for sm_80 and sm_90a without spills."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

from cute_flash import api  # noqa: E402
from cute_flash.backends import split_kv  # noqa: E402
from cute_flash.backends.base import AttnArgs  # noqa: E402
from cute_flash.backends.cute import CuteSm80Backend  # noqa: E402
from cute_flash.kernels import combine_config as cc  # noqa: E402
from cute_flash.kernels.sm80 import fwd_config as fc  # noqa: E402


# ------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------
def test_call_with_page_table_selects_the_paged_kernel():
    q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(10, 16, 2, 128, dtype=torch.bfloat16)
    args = AttnArgs(0.1, page_table=torch.zeros(2, 4, dtype=torch.int32), seqused_k=torch.ones(2, dtype=torch.int32))
    config = CuteSm80Backend().config(q, k, k, None, args)
    assert config.paged_kv and config.seqused_k and not config.varlen_k and not config.split_kv


@pytest.mark.parametrize("page_size,pow2,whole_tiles", [
    (1, True, False), (16, True, False), (64, True, True), (256, True, True), (24, False, False),
    (100, False, False), (192, False, True),
])
def test_page_size_selects_shift_and_mask_and_one_lookup_per_tile(page_size, pow2, whole_tiles):
    q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16)  # decode: 64-key tiles
    k = torch.empty(10, page_size, 2, 128, dtype=torch.bfloat16)
    args = AttnArgs(0.1, page_table=torch.zeros(2, 4, dtype=torch.int32))
    config = CuteSm80Backend().config(q, k, k, None, args)
    assert config.tile_n == 64 and config.paged_kv
    assert (config.page_size_pow2, config.pages_hold_tiles) == (pow2, whole_tiles)
    assert ("page_size_pow2" in config.name, "pages_hold_tiles" in config.name) == (pow2, whole_tiles)


@pytest.mark.parametrize("head_dim,causal,short,per_row", [
    (64, True, False, True), (64, True, True, True), (64, False, False, False), (128, True, False, False),
    (128, False, False, False), (128, True, True, False), (96, True, False, True), (256, True, False, True), (256, False, False, False),
    (192, False, False, False),
])
def test_tiles_that_spill_with_one_page_lookup_per_tile_look_up_per_row(head_dim, causal, short, per_row):
    """One lookup per tile spilled on the 128x128 tiles (hd96, hd128 with a window), on hd64's causal
    tile and (fp16) on hd256's masked one; hd128's 128x32 tile (unmasked and causal calls) takes it."""
    config = fc.make_config("bfloat16", head_dim, head_dim, short_queries=short, page_size=256, causal=causal)
    assert config.paged_kv and config.page_size_pow2 and config.pages_hold_tiles == (not per_row)


def test_windowed_hd128_calls_keep_their_128x128_tile_and_look_up_pages_per_row():
    """A window keeps hd128 off the causal 128x32 tile, and the 128x128 tile spills with one lookup per tile."""
    config = fc.make_config("bfloat16", 128, 128, page_size=256, local=True)
    assert (config.tile_m, config.tile_n) == (128, 128) and config.paged_kv and not config.pages_hold_tiles


@pytest.mark.parametrize("head_dim,flags,per_row", [
    (192, {"seqused_k": True, "split_kv": True}, True), (192, {"causal": True}, True),
    (192, {"seqused_k": True}, False), (64, {"local": True, "seqused_k": True, "split_kv": True}, True),
    (64, {"seqused_k": True, "split_kv": True}, False),
])
def test_fp16_tiles_that_spilled_with_one_lookup_per_tile_look_up_per_row(head_dim, flags, per_row):
    """One lookup per tile spilled there in fp16 (`audit --sweep`: 8-36 B)."""
    config = fc.make_config("float16", head_dim, head_dim, page_size=256, **flags)
    assert config.paged_kv and config.pages_hold_tiles == (not per_row)


@pytest.mark.parametrize("flags,narrow", [
    ({"local": True, "split_kv": True}, True), ({"causal": True, "split_kv": True, "page_size": 256}, True),
    ({"softcap": True, "page_size": 16}, True), ({"split_kv": True}, False), ({"softcap": True}, False),
    ({"softcap": True, "local": True}, True), ({"softcap": True, "causal": True}, False),
    ({"local": True, "page_size": 64}, False), ({"softcap": True, "split_kv": True}, True),
    ({"softcap": True, "split_kv": True, "varlen_q": True, "seqused_k": True}, True),
])
def test_head_dim_256_takes_the_narrow_tile_where_the_wide_one_spilled(flags, narrow):
    config = fc.make_config("bfloat16", 256, 256, short_queries=True, **flags)
    assert (config.tile_m, config.tile_n, config.num_stages) == ((64, 32, 2) if narrow else (64, 64, 1))


@pytest.mark.parametrize("flag", ["page_size_pow2", "pages_hold_tiles"])
def test_page_flags_need_a_paged_cache(flag):
    with pytest.raises(ValueError, match=flag):
        fc.make_config("bfloat16", 128, 128, **{flag: True})


def test_split_kv_config_leaves_the_lse_to_the_combine():
    config = fc.make_config("bfloat16", 128, 128, split_kv=True)
    assert config.split_kv and not config.has_lse


def test_paged_kv_excludes_packed_keys():
    with pytest.raises(ValueError, match="paged_kv"):
        fc.make_config("bfloat16", 128, 128, paged_kv=True, varlen_k=True)


def test_at_most_ten_shipped_inference_configs_and_a_combine_for_each_split_one():
    inference = [c for c in fc.shipped_configs() if c.paged_kv or c.split_kv]
    assert 1 <= len(inference) <= 10
    splits = [c for c in inference if c.split_kv]
    combines = cc.shipped_configs()
    assert {(c.dtype, c.head_dim_v, c.tile_n, c.varlen_q) for c in splits} == {
        (c.dtype, c.head_dim_v, c.tile_n, c.varlen_q) for c in combines
    }
    assert len({c.name for c in combines}) == len(combines)


def test_combine_config_pads_the_head_dim_and_names_its_flags():
    config = cc.make_config("float16", 40, 64, varlen_q=True)
    assert (config.head_dim_v, config.check_hdim_v) == (64, True)
    assert "varlen_q" in config.name and "paddedv" in config.name
    assert cc.make_config("float16", 64, 64).name != cc.make_config("float16", 64, 128).name
    with pytest.raises(ValueError, match="tile_n"):
        cc.CombineConfig("float16", 64, 40)


# ------------------------------------------------------------------------------------------------
# the number of splits
# ------------------------------------------------------------------------------------------------
def test_heuristic_does_not_split_a_grid_that_fills_the_gpu():
    assert cc.num_splits_heuristic(num_tiles=132, num_sms=132, num_n_blocks=1000) == 1
    assert cc.num_splits_heuristic(num_tiles=106, num_sms=132, num_n_blocks=1000) == 1


def test_heuristic_splits_a_small_decode_grid():
    # batch 1, 32 heads, one query block, 8k keys in blocks of 64, on 132 SMs
    splits = cc.num_splits_heuristic(num_tiles=32, num_sms=132, num_n_blocks=128)
    assert splits > 1
    waves = 32 * splits / 132
    assert waves / -(-waves // 1) >= 0.85 * max(
        (32 * s / 132) / -(-(32 * s / 132) // 1) for s in range(1, 65)
    )


def test_heuristic_gives_every_split_the_same_key_blocks_in_one_wave():
    # batch 1 decode, 8 KV heads (packed GQA): 8 tiles, 8k keys in 128 blocks of 64; 16 splits
    # of 8 blocks fill 128 of 132 SMs, where 15 would leave a split of 2 blocks behind ones of 9
    assert cc.num_splits_heuristic(num_tiles=8, num_sms=132, num_n_blocks=128) == 16
    assert cc.num_splits_heuristic(num_tiles=8, num_sms=132, num_n_blocks=512) == 16
    # a second wave pays only where it shortens the longest split
    assert cc.num_splits_heuristic(num_tiles=32, num_sms=132, num_n_blocks=128) == 4
    assert cc.num_splits_heuristic(num_tiles=64, num_sms=132, num_n_blocks=128) == 2
    assert cc.num_splits_heuristic(num_tiles=8, num_sms=132, num_n_blocks=3) == 3


def test_heuristic_splits_a_paged_grid_of_one_cta_per_sm_in_two():
    # batch 16 decode, 8 KV heads (packed GQA): 128 tiles on 132 SMs, 8k keys in blocks of 64
    assert cc.num_splits_heuristic(num_tiles=128, num_sms=132, num_n_blocks=128) == 1
    assert cc.num_splits_heuristic(num_tiles=128, num_sms=132, num_n_blocks=128, paged=True) == 2
    # more tiles than SMs, a single key block, or a ceiling of 1: no floor
    assert cc.num_splits_heuristic(num_tiles=264, num_sms=132, num_n_blocks=128, paged=True) == 1
    assert cc.num_splits_heuristic(num_tiles=128, num_sms=132, num_n_blocks=1, paged=True) == 1
    assert cc.num_splits_heuristic(num_tiles=128, num_sms=132, num_n_blocks=128, max_splits=1, paged=True) == 1
    # a small grid keeps the modelled choice
    assert cc.num_splits_heuristic(num_tiles=8, num_sms=132, num_n_blocks=128, paged=True) == 16


def test_heuristic_never_exceeds_key_blocks_sms_or_the_ceiling():
    for tiles in (1, 3, 8, 50):
        for n_blocks in (0, 1, 2, 3, 7, 64, 5000):
            for sms in (4, 108, 132):
                s = cc.num_splits_heuristic(tiles, sms, n_blocks, max_splits=16)
                assert 1 <= s <= max(1, min(16, sms, n_blocks)), (tiles, n_blocks, sms, s)


def test_heuristic_skips_split_counts_that_leave_the_blocks_per_split_unchanged():
    # 10 key blocks: 4 splits give 3 blocks each, and so does 5 -> 2; a chosen count is always
    # one where ceil(10 / s) drops
    for tiles in range(1, 40):
        s = cc.num_splits_heuristic(tiles, 132, 10)
        assert s == 1 or -(-10 // s) != -(-10 // (s - 1))


def _decode(batch=2, nheads=8, d=64, page_size=16, max_pages=8, num_splits=0, max_seqlen_k=None):
    q = torch.empty(batch, 1, nheads, d, dtype=torch.bfloat16)
    k = torch.empty(batch * max_pages, page_size, 2, d, dtype=torch.bfloat16)
    args = AttnArgs(0.1, page_table=torch.zeros(batch, max_pages, dtype=torch.int32), num_splits=num_splits,
                    max_seqlen_k=max_seqlen_k)
    return q, k, args


def test_explicit_num_splits_is_clamped_to_the_key_blocks_of_the_longest_sequence():
    q, k, args = _decode(num_splits=16, max_seqlen_k=130)  # 130 keys: 3 blocks of 64
    config = fc.make_config("bfloat16", 64, 64, paged_kv=True)
    assert split_kv.num_splits(q, k, args, config, heuristic=False) == 3
    q, k, args = _decode(num_splits=2)  # capacity 8 * 16 = 128 keys: 2 blocks
    assert split_kv.num_splits(q, k, args, config, heuristic=False) == 2


def test_num_splits_keeps_batch_times_splits_within_the_grid():
    q, k, args = _decode(batch=5000, page_size=1, max_pages=1, num_splits=64, max_seqlen_k=1 << 20)
    config = fc.make_config("bfloat16", 64, 64, paged_kv=True)
    splits = split_kv.num_splits(q, k, args, config, heuristic=False)
    assert splits == 13 and 5000 * splits <= split_kv.GRID_Z_LIMIT


def test_heuristic_is_off_until_split_kv_is_verified():
    q, k, args = _decode(num_splits=0, max_seqlen_k=8192)
    config = fc.make_config("bfloat16", 64, 64, paged_kv=True)
    assert split_kv.num_splits(q, k, args, config, heuristic=False) == 1


def test_partial_buffers_have_a_leading_split_mode():
    q = torch.empty(3, 5, 8, 64)
    v = torch.empty(3, 100, 2, 96)
    o_shape, lse_shape = split_kv.partial_shapes(q, v, AttnArgs(0.1), 4)
    assert o_shape == (4, 3, 5, 8, 96) and lse_shape == (4, 3, 8, 5)
    qv = torch.empty(17, 8, 64)
    args = AttnArgs(0.1, cu_seqlens_q=torch.tensor([0, 10, 17], dtype=torch.int32))
    assert split_kv.partial_shapes(qv, v, args, 2) == ((2, 17, 8, 96), (2, 8, 17))


def test_a_workspace_of_the_wrong_shape_is_rejected():
    q = torch.empty(3, 5, 8, 64)
    v = torch.empty(3, 100, 2, 64)
    bad = (torch.empty(4, 3, 5, 8, 64), torch.empty(4, 3, 8, 6))
    with pytest.raises(ValueError, match="lse_partial"):
        split_kv.partials(q, v, AttnArgs(0.1), 4, bad)


# ------------------------------------------------------------------------------------------------
# the sm_80 backend offers them; the API's gate for features not yet verified on a GPU
# ------------------------------------------------------------------------------------------------
def test_sm80_backend_declares_paged_and_split_kv():
    backend = CuteSm80Backend()
    assert {"paged_kv", "split_kv"} <= backend.features
    assert not backend.unverified


@pytest.mark.parametrize("feature", ["paged_kv", "split_kv"])
def test_api_refuses_unverified_paged_and_split_kv_naming_them(feature, monkeypatch):
    backend = CuteSm80Backend()
    monkeypatch.setattr(backend, "unavailable_reason", lambda: None)
    monkeypatch.setattr(backend, "features", backend.features - {feature})
    monkeypatch.setattr(backend, "unverified", frozenset({feature}))
    q, k, args = _decode(num_splits=4 if feature == "split_kv" else 1)
    if feature == "split_kv":
        args.page_table = None
    with pytest.raises(NotImplementedError, match=f"{feature}.*not yet verified"):
        api._check_features(backend, args, q, k)


@pytest.mark.parametrize("call", ["paged", "split", "plain", "heuristic", "decode_routed"])
def test_the_sm90_backend_runs_paged_and_split_calls_on_the_sm80_kernels(call, monkeypatch):
    from cute_flash import backends
    from cute_flash.backends.cute import CuteSm90Backend

    ran = []
    monkeypatch.setattr(backends.get_backend("cute-sm80"), "fwd", lambda *a, **kw: ran.append("sm80"))
    sm90 = CuteSm90Backend()
    monkeypatch.setattr(sm90, "config", lambda *a, **kw: ran.append("sm90") or fc.make_config("bfloat16", 64, 64))
    monkeypatch.setattr(sm90, "arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(sm90.cache, "get", lambda config, arch: (None, None))
    monkeypatch.setattr(sm90, "launch", lambda *a, **kw: None)
    q, k, args = _decode(num_splits={"split": 4, "heuristic": 0}.get(call, 1))
    if call != "paged":
        args.page_table = None
    # one token, 8 query heads over 2 KV heads: on the sm_80 kernels by default (packed, split);
    # "plain" and "heuristic" turn that route off and run on the sm_90 kernel
    assert CuteSm90Backend.decode_on_sm80_kernels
    if call in ("plain", "heuristic"):
        monkeypatch.setattr(sm90, "decode_on_sm80_kernels", False)
    assert {"paged_kv", "split_kv"} <= sm90.features
    sm90.fwd(q, k, k, torch.empty(2, 1, 8, 64), None, args)
    assert ran == (["sm80"] if call in ("paged", "split", "decode_routed") else ["sm90"])


# ------------------------------------------------------------------------------------------------
# compiles (each several seconds on one core)
# ------------------------------------------------------------------------------------------------
# the gathers the shipped configurations do not all cover: per row with a division (any page
# size), per row by shift and mask (pages of 16 in decode)
FWD_COMPILED = [
    ("sm_80", fc.make_config("bfloat16", 128, 128, paged_kv=True, seqused_k=True, split_kv=True)),
    ("sm_90a", fc.make_config("bfloat16", 128, 128, paged_kv=True, seqused_k=True, split_kv=True)),
    ("sm_90a", fc.make_config("float16", 256, 256, paged_kv=True, causal=True)),
    ("sm_80", fc.make_config("bfloat16", 128, 128, short_queries=True, page_size=16, seqused_k=True, split_kv=True)),
    ("sm_90a", fc.make_config("bfloat16", 128, 128, short_queries=True, page_size=16, seqused_k=True, split_kv=True)),
    ("sm_80", fc.make_config("bfloat16", 256, 256, short_queries=True, page_size=16, seqused_k=True, split_kv=True)),
]
COMBINE_COMPILED = [
    ("sm_80", cc.make_config("bfloat16", 128, 64, seqused_k=True)),
    ("sm_90a", cc.make_config("float16", 40, 64, varlen_q=True, varlen_k=True, has_lse=False)),
    ("sm_90a", cc.make_config("bfloat16", 192, 128, seqused_k=True)),
]


def _audit(name, arch, compile_fn):
    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    row = audit.audit_target(audit.AuditTarget(name, arch, compile_fn))
    assert row.error is None, row.error
    assert not row.spills, f"{row.spill_stores}/{row.spill_loads} bytes spilled, SASS {row.sass}"
    return row


@pytest.mark.parametrize("arch,config", FWD_COMPILED, ids=[f"{a}-{c.name}" for a, c in FWD_COMPILED])
def test_paged_split_kernel_compiles_without_spills_gathering_with_ldgsts(arch, config):
    row = _audit(config.name, arch, lambda options: fc.compile_fwd(config, options))
    for op in ("HMMA", "LDSM", "LDGSTS"):
        assert row.sass[op] > 0, f"no {op} in the SASS: {row.sass}"


@pytest.mark.parametrize("arch,config", COMBINE_COMPILED, ids=[f"{a}-{c.name}" for a, c in COMBINE_COMPILED])
def test_combine_compiles_without_spills_or_local_memory(arch, config):
    row = _audit(config.name, arch, lambda options: cc.compile_fwd(config, options))
    assert row.sass["LDL"] == 0 and row.sass["STL"] == 0


def test_combine_reads_partials_with_128_bit_loads_and_rounds_to_nearest_even(tmp_path):
    config = cc.make_config("bfloat16", 128, 64)
    compiled = cc.compile_fwd(config, f"--gpu-arch sm_80 --keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.artifacts.PTX
    assert "ld.global.v4" in ptx, "partial O rows are not read as 128-bit vectors"
    assert "cvt.rn.bf16x2.f32" in ptx


def test_combine_audit_targets_cover_its_shipped_configs():
    targets = cc.audit_targets("sm_90a")
    assert [t.name for t in targets] == [c.name for c in cc.shipped_configs()]
