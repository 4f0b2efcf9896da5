"""The sm_90 backward kernel on the CPU: configuration table, the choice of configurations for a
call, what it refuses, how the cute-sm90 backend reaches it, and compiles for sm_90a without
spills, with HGMMA, TMA loads and setmaxnreg, and without serialized WGMMAs. (`python -m
cute_flash.audit --arch sm_90a --module cute_flash.kernels.sm90.bwd_config` audits every shipped
configuration.)"""

from __future__ import annotations

import os
from dataclasses import fields, replace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

from cute_flash.backends.base import AttnArgs  # noqa: E402
from cute_flash.kernels.sm90 import bwd_config as bc  # noqa: E402
from kernel_flag_cases import FLAG_CASES, expected_flags, flags_of
from sass_loops import descriptors_moved_from_thread_registers, main_loop, sass_opcode_counts


@pytest.mark.parametrize("headdim", bc.TILE_HEADDIMS)
def test_sm90_bwd_tile_table_fits_shared_memory_and_registers(headdim):
    config = bc.make_config("bfloat16", headdim, headdim)
    assert config.smem_bytes <= bc.SMEM_LIMIT
    # 64 keys per consumer warpgroup, or 64 shared by both with dK / dV / dQ split over their columns
    # (48 per warpgroup with the keys on N: `keys_n`)
    assert config.tile_n == (96 if config.keys_n else 64 if config.dkv_split else 64 * bc.NUM_CONSUMER_WGS)
    assert config.dkv_split == (headdim in (192, 256))
    consumer, producer = config.registers
    assert 128 * producer + 128 * bc.NUM_CONSUMER_WGS * consumer <= 64 * 1024
    # the dQ GEMM takes the query block (or, with dq_rows, half of it) as its M: one m64 WGMMA per
    # consumer warpgroup
    assert config.dq_rows_per_wg == 64 and config.tile_m == (128 if config.dq_rows else 64)


def test_sm90_bwd_128_row_tile_at_head_dim_64_but_with_softcap_or_without_the_dq_writer():
    wide = bc.make_config("bfloat16", 64, 64, causal=True, varlen_q=True, varlen_k=True, seqused_k=True)
    assert (wide.tile_m, wide.dq_rows, wide.dv_after_ds, wide.dk_behind_dq, wide.dq_split) == (128, True, True, True,
                                                                                                False)
    assert wide.ds_stages == 2 and wide.dq_stages == 1
    for narrow in (bc.make_config("bfloat16", 64, 64, softcap=True), bc.make_config("bfloat16", 64, 64, dq_writer=False),
                   bc.make_config("bfloat16", 96, 96), bc.make_config("bfloat16", 128, 128)):
        assert narrow.tile_m == 64 and not narrow.dq_rows
    with pytest.raises(ValueError, match="dq_rows"):
        replace(wide, tile_m=64)
    with pytest.raises(ValueError, match="exclude"):
        replace(wide, overlap_dv=True)


@pytest.mark.parametrize("d,tile", [(8, 64), (64, 64), (72, 96), (96, 96), (120, 128), (128, 128)])
def test_sm90_bwd_headdims_pad_up_to_the_next_tile(d, tile):
    config = bc.make_config("float16", d, d)
    assert (config.head_dim, config.head_dim_v) == (tile, tile)


@pytest.mark.parametrize("d", [264, 320])
def test_sm90_bwd_headdims_above_256_are_refused_by_name(d):
    with pytest.raises(NotImplementedError, match=str(d)):
        bc.make_config("bfloat16", d, d)


@pytest.mark.parametrize("d,tile,stages", [(136, 192, 2), (192, 192, 2), (200, 256, 1), (248, 256, 1), (256, 256, 1)])
def test_sm90_bwd_headdims_above_128_take_the_column_split_tile(d, tile, stages):
    config = bc.make_config("bfloat16", d, d, causal=True)
    # 192: 96 keys, 48 per warpgroup (`keys_n`), with one dO stage and one dS^T buffer
    keys = 96 if tile == 192 else 64
    assert (config.head_dim, config.tile_m, config.tile_n, config.num_stages) == (tile, 64, keys, stages)
    assert config.dkv_split and config.dq_split and config.dq_cols == tile // 2
    assert (config.keys_n, config.single_dout) == (tile == 192, tile == 192)
    # K, V, the (Q, dO) stages, the dS^T and P^T buffers, the two warpgroups' fp32 dQ tiles
    assert config.smem_bytes <= bc.SMEM_LIMIT
    assert (config.ds_stages, config.p_stages) == ((1, 1) if tile == 192 else (2, 1))


def test_sm90_bwd_head_dim_192_keeps_two_q_stages_with_one_dout_stage_in_varlen_calls_too():
    fixed = bc.make_config("bfloat16", 192, 192, varlen_q=False)
    varlen = bc.make_config("bfloat16", 192, 192, varlen_q=True, varlen_k=True)
    for config in (fixed, varlen):
        assert (config.num_stages, config.dout_stages, config.single_dout) == (2, 1, True)
        assert config.smem_bytes <= bc.SMEM_LIMIT
    # two dO stages do not fit: the reason for the one
    assert bc._unchecked({**vars(fixed), "single_dout": False}).smem_bytes > bc.SMEM_LIMIT
    # the 64-key tile with two (Q, dO) stages fits without varlen boxes, with them only one
    assert bc.make_config("bfloat16", 192, 192, keys_n=False).num_stages == 2
    assert bc.make_config("bfloat16", 192, 192, keys_n=False, varlen_q=True).num_stages == 1


def test_sm90_bwd_dkv_split_excludes_the_register_operand_orders():
    config = bc.make_config("bfloat16", 256, 256)
    for flag in ("overlap_dv", "dk_after_dq", "dk_behind_dq", "stats_early"):
        with pytest.raises(ValueError, match=flag):
            replace(config, **{flag: True})
    with pytest.raises(ValueError, match="dkv_split"):
        replace(config, dkv_split=False)  # 64 keys per warpgroup at head dim 256: 256 registers of dK, dV
    with pytest.raises(ValueError, match="shared memory"):
        replace(config, num_stages=2)


def test_sm90_bwd_refuses_a_headdim_of_v_that_differs_by_name():
    with pytest.raises(NotImplementedError, match="64"):
        bc.make_config("bfloat16", 128, 64)
    with pytest.raises(NotImplementedError, match="96"):
        bc.make_config("bfloat16", 192, 96)  # 48 columns of V per warpgroup: not whole swizzle atoms


@pytest.mark.parametrize("d,dv", [(192, 128), (256, 128), (128, 256), (256, 64), (64, 256), (200, 120), (192, 64)])
def test_sm90_bwd_unequal_head_dims_above_128_take_the_column_split_tile(d, dv):
    config = bc.make_config("bfloat16", d, dv)
    assert config.dkv_split and config.smem_bytes <= bc.SMEM_LIMIT
    # head dim 192 with a narrower V: 96 keys, 48 per warpgroup (`keys_n`)
    assert config.tile_n == (96 if d == 192 else 64) and config.keys_n == (d == 192)
    assert config.dq_cols == config.head_dim // 2


@pytest.mark.parametrize("flags", [{}, {"varlen_q": True}, {"varlen_q": True, "varlen_k": True, "causal": True}])
def test_sm90_bwd_keys_n_tile_only_with_two_q_stages(flags):
    # two (Q, dO) stages of the 96-key tile fill shared memory to the limit at 192 / 128, the
    # varlen LSE / D boxes included (LSE in the mbarriers' padding, D after the dQ tiles); with V's
    # head dim 192 two Q stages fit next to one of dO (`single_dout`); one stage of both measured
    # 1.3x slower than the 64-key tile
    config = bc.make_config("bfloat16", 192, 128, **flags)
    assert config.keys_n and not config.single_dout and config.num_stages == 2
    assert config.smem_bytes <= bc.SMEM_LIMIT
    wide_v = bc.make_config("bfloat16", 192, 192, **flags)
    assert wide_v.keys_n and wide_v.single_dout and wide_v.num_stages == 2
    # asked for explicitly without single_dout, the 96-key tile is kept, in one stage
    asked = bc.make_config("bfloat16", 192, 192, keys_n=True, single_dout=False, **flags)
    assert asked.keys_n and asked.num_stages == 1 and asked.smem_bytes <= bc.SMEM_LIMIT
    # and the 64-key tile where single_dout is refused
    assert not bc.make_config("bfloat16", 192, 192, single_dout=False, **flags).keys_n


@pytest.mark.parametrize("dv", [192, 128])
def test_sm90_bwd_dq_swap_everywhere_but_on_rotated_walks_and_the_96_key_tile_without_a_mask(dv):
    # the dQ tile's stores conflict-free; with the walks rotated (unmasked calls on the column-split
    # tiles, head dims 192 and 256, not deterministic) and on the 96-key tile without a mask they
    # measured slower (head dim 96's 48-column dQ tiles have no pairs to swap: see
    # test_sm90_bwd_dq_split_is_the_default_of_the_64_row_tiles_up_to_hd128)
    # fixed-length calls store dQ flat (`dq_flat`), with nothing to swap; varlen ones keep the
    # row-major tile and the swap rule
    varlen = dict(varlen_q=True, varlen_k=True)
    for d in (64, 128):
        assert bc.make_config("bfloat16", d, d, **varlen).dq_swap
        assert bc.make_config("float16", d, d, causal=True, **varlen).dq_swap
        assert bc.make_config("bfloat16", d, d).dq_flat and not bc.make_config("bfloat16", d, d).dq_swap
    for d, d_v in ((192, dv), (256, 256), (256, dv), (dv, 256)):
        unmasked = bc.make_config("bfloat16", d, d_v)  # rotated from Q's head dim 192 on
        assert unmasked.rotate_queries == (d >= 192) and unmasked.dq_flat and not unmasked.dq_swap
        assert bc.make_config("bfloat16", d, d_v, causal=True, **varlen).dq_swap
        assert bc.make_config("bfloat16", d, d_v, local=True, softcap=True, **varlen).dq_swap
        deterministic = bc.make_config("bfloat16", d, d_v, deterministic=True)
        assert not deterministic.rotate_queries and deterministic.dq_flat and not deterministic.dq_swap
    # the 64-key tile a refused single_dout falls back to: the same rule
    fallback = bc.make_config("bfloat16", 192, 192, single_dout=False)
    assert not fallback.keys_n and not fallback.dq_swap and fallback.dq_flat
    assert bc.make_config("bfloat16", 192, 192, single_dout=False, deterministic=True, **varlen).dq_swap
    assert not bc.make_config("bfloat16", 192, 192, single_dout=False, dq_swap=False, causal=True).dq_swap
    asked = bc.make_config("bfloat16", 192, dv, dq_swap=True)  # the row-major tile, swapped
    assert asked.dq_swap and not asked.dq_flat


def test_sm90_bwd_keys_n_is_a_head_dim_192_column_split_tile():
    config = bc.make_config("bfloat16", 192, 128)
    assert config.p_stages == 1 and config.ds_stages == 2
    with pytest.raises(ValueError, match="keys_n needs dkv_split"):
        replace(bc.make_config("bfloat16", 128, 128), keys_n=True)
    with pytest.raises(ValueError, match="head dim 192"):
        replace(bc.make_config("bfloat16", 256, 256), keys_n=True)
    with pytest.raises(ValueError, match="profiling"):
        replace(config, timeline=True)
    with pytest.raises(ValueError, match="keys_n needs dq_writer"):
        replace(config, dq_writer=False)
    with pytest.raises(ValueError, match="single_dout needs keys_n"):
        replace(bc.make_config("bfloat16", 256, 256), single_dout=True)


def test_sm90_bwd_shipped_configs_are_few_distinct_cache_keys():
    configs = bc.shipped_configs()
    # each one is compiled and audited (+ 3 row-major dQ tiles, 11 with the in-kernel dQ and a
    # comparison-masked tile, 7 with the dQ GEMMs' options off where they ship and 3 with them on
    # at head dim 64 (`dq_own_first`, `ds_kmajor`) for A/B)
    assert len(configs) <= 60
    assert len({c.name for c in configs}) == len(configs) == len(set(configs))


def test_sm90_bwd_config_names_tell_apart_every_flag():
    base = bc.make_config("bfloat16", 128, 128)  # every flag can flip at head dim 128
    for f in fields(base):
        if f.name in ("dkv_split", "keys_n", "single_dout"):
            continue  # head dims 192 / 256 only: below
        if isinstance(getattr(base, f.name), bool):
            flipped = {f.name: not getattr(base, f.name)}
            if f.name == "dq_writer":
                flipped["dq_fence_late"] = False  # which needs the writer (off here anyway)
                flipped["dq_flat"] = False  # and so does the flat dQ store
            if f.name in ("dq_swap", "varlen_q"):
                flipped["dq_flat"] = False  # a swap of the row-major tile's columns; varlen's tile
            if not flipped.get("dq_flat", True) or f.name == "deterministic":
                flipped["dq_convert"] = False  # the conversion CTAs read the flat accumulator, unordered
            if f.name == "dk_after_dq":
                flipped["dk_behind_dq"] = False  # the two exclude each other
            if f.name == "dq_split":
                flipped["dq_own_first"] = False  # which splits the column split's dQ GEMM
            if f.name in ("dq_rows", "dv_after_ds"):
                continue  # the 128-row tile of head dim 64: below
            assert replace(base, **flipped).name != base.name, f.name
    causal = bc.make_config("bfloat16", 128, 128, causal=True)
    assert causal.lpt and replace(causal, lpt=False).name != causal.name
    wide = bc.make_config("bfloat16", 64, 64)
    assert replace(wide, dv_after_ds=False).name != wide.name
    assert "dkv_split" in bc.make_config("bfloat16", 256, 256).name
    keys_n = bc.make_config("bfloat16", 192, 128)
    assert replace(keys_n, keys_n=False).name != keys_n.name
    assert replace(keys_n, single_dout=True).name != keys_n.name
    assert replace(wide, dq_rows=False, tile_m=64).name != wide.name


def test_sm90_bwd_conversion_ctas_take_flat_accumulators_of_unordered_calls_only():
    """`dq_convert` (an A/B option that make_config leaves off): the main kernel may write dQ itself
    wherever it stores it flat (fixed-length calls), with any mask, at every head dim; the config
    refuses it without the flat store (varlen queries) and for deterministic calls."""
    for d in bc.TILE_HEADDIMS:
        for mask in ({}, {"causal": True}, {"local": True}):
            assert not bc.make_config("bfloat16", d, d, **mask).dq_convert
            assert bc.make_config("bfloat16", d, d, dq_convert=True, **mask).dq_convert, (d, mask)
            with pytest.raises(ValueError, match="dq_convert"):
                bc.make_config("bfloat16", d, d, deterministic=True, dq_convert=True, **mask)
    with pytest.raises(ValueError, match="dq_convert"):
        bc.make_config("bfloat16", 128, 128, varlen_q=True, varlen_k=True, dq_convert=True)
    assert bc.make_config("bfloat16", 128, 128, seqused_k=True, dq_convert=True).dq_convert


def test_sm90_bwd_q_clusters_pair_key_blocks_of_unmasked_calls_up_to_head_dim_128():
    from cute_flash.backends.cute_bwd import sm90_configs

    even, odd = torch.empty(2, 1024, 4, 64, dtype=torch.bfloat16), torch.empty(2, 1100, 4, 64, dtype=torch.bfloat16)
    main = sm90_configs(even, even, even, None, AttnArgs(0.1))[1]
    assert main.cluster_q and main.name.endswith("_cluster_q")
    assert not sm90_configs(odd, odd, odd, None, AttnArgs(0.1))[1].cluster_q  # 9 key blocks
    short_q = torch.empty(2, 77, 4, 64, dtype=torch.bfloat16)  # the key blocks count, not the query blocks
    assert sm90_configs(short_q, even, even, None, AttnArgs(0.1))[1].cluster_q
    assert not sm90_configs(even, even, even, None, AttnArgs(0.1, causal=True, window_right=0))[1].cluster_q
    assert not sm90_configs(even, even, even, None, AttnArgs(0.1, window_left=64, window_right=64))[1].cluster_q
    x = torch.empty(2, 1024, 4, 80, dtype=torch.float16)  # padded to 96
    assert sm90_configs(x, x, x, None, AttnArgs(0.1))[1].cluster_q
    for d in (128, 192, 256):  # measured level at 128; the column-split tiles keep single CTAs
        x = torch.empty(2, 1024, 4, d, dtype=torch.bfloat16)
        assert not sm90_configs(x, x, x, None, AttnArgs(0.1))[1].cluster_q
    for flags in (dict(causal=True), dict(local=True), dict(varlen_q=True, varlen_k=True), dict(seqused_k=True)):
        with pytest.raises(ValueError, match="cluster_q"):
            bc.make_config("bfloat16", 128, 128, cluster_q=True, **flags)


def test_sm90_bwd_rotated_query_walks_for_unmasked_calls_from_head_dim_192():
    from cute_flash.backends.cute_bwd import sm90_configs

    assert bc.ROTATE_FROM_HEADDIM == 192
    for d in (192, 256):
        x = torch.empty(2, 1024, 4, d, dtype=torch.bfloat16)
        main = sm90_configs(x, x, x, None, AttnArgs(0.1))[1]
        assert main.rotate_queries and "rotate_queries" in main.name
        assert not sm90_configs(x, x, x, None, AttnArgs(0.1, causal=True, window_right=0))[1].rotate_queries
        assert not bc.make_config("bfloat16", d, d, local=True).rotate_queries
    assert bc.make_config("bfloat16", 192, 128).rotate_queries  # Q's head dim sets the dQ tile
    for d in (64, 96, 128):  # the shared start measured faster there
        assert not bc.make_config("bfloat16", d, d).rotate_queries
        assert not bc.make_config("bfloat16", d, d, varlen_q=True, varlen_k=True).rotate_queries
    assert bc.make_config("bfloat16", 256, 256, varlen_q=True, varlen_k=True).rotate_queries
    base = bc.make_config("bfloat16", 128, 128)
    assert replace(base, rotate_queries=True).name != base.name


@pytest.mark.parametrize("m_steps,group", [(1, 1), (7, 1), (16, 3), (5, 4)])
def test_sm90_bwd_rotated_walk_visits_every_query_block_of_every_head_once(m_steps, group):
    """`QueryWalk` with a rotation: each head's blocks from the m_rot-th on, wrapping around,
    so a CTA still meets every (head, query block) of its group exactly once, head by head; without
    one, in order from the first block."""
    from cute_flash.kernels.sm90.bwd_sync import QueryWalk

    head_k, m_block_min = 2, 3
    everything = [(head_k * group + h, m_block_min + m) for h in range(group) for m in range(m_steps)]
    plain = QueryWalk(head_k, group, m_block_min, m_steps)
    assert [plain.coords(it) for it in range(plain.steps)] == everything
    for m_rot in range(m_steps):
        rotated = QueryWalk(head_k, group, m_block_min, m_steps, m_rot)
        walk = [rotated.coords(it) for it in range(rotated.steps)]
        assert sorted(walk) == everything
        assert [m for _, m in walk[:m_steps]] == [m_block_min + (m_rot + i) % m_steps for i in range(m_steps)]
        assert [h for h, _ in walk] == sorted(h for h, _ in walk)


def test_sm90_bwd_lpt_order_for_causal_and_deterministic_calls():
    assert bc.make_config("bfloat16", 64, 64, causal=True).lpt
    assert not bc.make_config("bfloat16", 64, 64).lpt
    assert not bc.make_config("bfloat16", 128, 128, local=True).lpt
    for mask in ({}, {"causal": True}, {"local": True}):
        assert bc.make_config("bfloat16", 128, 128, deterministic=True, **mask).lpt
    # a cluster's two CTAs are neighbours in the grid, which lpt's order gives to two heads
    with pytest.raises(ValueError, match="lpt excludes cluster_q"):
        bc.make_config("bfloat16", 64, 64, lpt=True, cluster_q=True)


def test_sm90_bwd_dk_behind_dq_where_dk_is_not_carried_after_dq():
    assert bc.make_config("bfloat16", 128, 128).dk_behind_dq
    # head dim 96 with its dQ column split, two dQ tiles and the flat dQ store, causal or not
    assert bc.make_config("bfloat16", 96, 96, causal=True).dk_behind_dq
    assert bc.make_config("bfloat16", 96, 96).dk_behind_dq
    assert not bc.make_config("bfloat16", 96, 96, dk_behind_dq=False).dk_behind_dq
    assert not bc.make_config("bfloat16", 64, 64, softcap=True).dk_behind_dq  # dk_after_dq on the 64-row tile
    with pytest.raises(ValueError, match="dk_behind_dq"):
        bc.make_config("bfloat16", 64, 64, softcap=True, dk_behind_dq=True)
    assert bc.make_config("bfloat16", 64, 64).dk_behind_dq  # the 128-row tile's order


@pytest.mark.parametrize("flag", ["ds_kmajor", "dq_own_first"])
def test_sm90_bwd_dq_gemm_options_ship_at_head_dims_96_and_128(flag):
    """The dQ GEMMs' options are on by default at head dims 96 and 128, with any mask, varlen,
    softcap or determinism, off at the others (at 64 measured level or slower), and named in the
    configuration's name where on."""
    for d in bc.TILE_HEADDIMS:
        for flags in ({}, {"causal": True}, {"local": True, "softcap": True, "varlen_q": True, "varlen_k": True},
                      {"deterministic": True}):
            config = bc.make_config("bfloat16", d, d, **flags)
            assert getattr(config, flag) == (d in (96, 128)), config.name
            assert (f"_{flag}" in config.name) == getattr(config, flag)


def test_sm90_bwd_ds_kmajor_only_where_the_dq_gemms_alone_read_ds():
    """`ds_kmajor`: taken when asked at head dims 64 to 128, turned off when asked; refused by
    name on the column-split tiles (192, 256), whose dK and dV read dS^T from shared memory too."""
    for d in (64, 96, 128):
        config = bc.make_config("bfloat16", d, d, causal=True, ds_kmajor=True)
        assert config.ds_kmajor and "_ds_kmajor" in config.name and not config.dkv_split
        assert not bc.make_config("bfloat16", d, d, ds_kmajor=False).ds_kmajor
    for d in (192, 256):
        with pytest.raises(ValueError, match="ds_kmajor excludes dkv_split"):
            bc.make_config("bfloat16", d, d, ds_kmajor=True)


def test_sm90_bwd_dq_own_first_only_on_the_column_split_of_64_keys_per_warpgroup():
    """`dq_own_first`: where each warpgroup's dQ GEMM runs over both warpgroups' 64 keys
    (`dq_split` without `dkv_split`, where it ships); taken when asked at head dim 64, on its
    128-row tile (`dq_rows`: each warpgroup's dQ rows over both warpgroups' keys) and its 64-row
    one; left off where `dq_split` is asked off; refused by name elsewhere."""
    assert not bc.make_config("bfloat16", 128, 128, dq_split=False).dq_own_first
    for d, flags in ((96, {"ds_kmajor": False}), (128, {"causal": True}), (64, {"softcap": True}), (64, {})):
        config = bc.make_config("bfloat16", d, d, dq_own_first=True, **flags)
        assert config.dq_own_first and "_dq_own_first" in config.name
        assert config.dq_split or (config.dq_rows and config.tile_m == 128), config.name
    for d, flags in ((192, {}), (256, {}), (128, {"dq_split": False, "dq_writer": False})):
        with pytest.raises(ValueError, match="dq_own_first needs dq_split"):
            bc.make_config("bfloat16", d, d, dq_own_first=True, **flags)


def test_sm90_bwd_two_dq_tiles_at_head_dims_64_and_96_with_the_writer_warp():
    assert bc.make_config("bfloat16", 64, 64, softcap=True).dq_stages == 2  # the 64-row tile
    assert bc.make_config("bfloat16", 64, 64).dq_stages == 1  # the 128-row tile: smem at its limit with two
    assert bc.make_config("bfloat16", 96, 96, causal=True).dq_stages == 2
    assert bc.make_config("bfloat16", 128, 128).dq_stages == 1
    assert bc.make_config("bfloat16", 64, 64, dq_writer=False).dq_stages == 1
    with pytest.raises(ValueError, match="dq_stages"):
        bc.make_config("bfloat16", 64, 64, dq_writer=False, dq_stages=2)
    # the second pair of fp32 tiles: 2 warpgroups x 64 rows x 32 columns at head dim 64
    one, two = (bc.make_config("bfloat16", 64, 64, softcap=True, dq_stages=1),
                bc.make_config("bfloat16", 64, 64, softcap=True))
    assert two.smem_bytes - one.smem_bytes == 4 * 2 * 64 * 32


def test_sm90_bwd_dq_fence_late_needs_the_writer_warp():
    assert bc.make_config("bfloat16", 64, 64).dq_fence_late
    assert bc.make_config("bfloat16", 64, 64, causal=True).dq_fence_late
    # head dim 128 reads the LSE rows early instead, with any mask
    for flags in ({}, {"causal": True}, {"local": True}, {"causal": True, "deterministic": True}):
        config = bc.make_config("bfloat16", 128, 128, **flags)
        assert config.stats_early and not config.dq_fence_late, flags
    assert not bc.make_config("bfloat16", 64, 64, causal=True, dq_writer=False).dq_fence_late
    with pytest.raises(ValueError, match="dq_fence_late"):
        bc.make_config("bfloat16", 128, 128, dq_writer=False, dq_fence_late=True)


def test_sm90_bwd_dq_split_is_the_default_of_the_64_row_tiles_up_to_hd128():
    assert bc.make_config("bfloat16", 128, 128).dq_split
    assert bc.make_config("bfloat16", 120, 120).dq_split  # padded to 128
    assert bc.make_config("bfloat16", 64, 64, softcap=True).dq_split  # the 64-row tile
    assert not bc.make_config("bfloat16", 64, 64).dq_split  # the 128-row tile splits dQ's rows
    # head dim 96: 48-column dQ tiles, whose halves dq_swap cannot pair
    for flags in ({}, {"causal": True}, {"local": True, "softcap": True}, {"deterministic": True}):
        config = bc.make_config("bfloat16", 96, 96, **flags)
        assert config.dq_split and config.dq_cols == 48 and not config.dq_swap and config.stats_early, flags
    assert bc.make_config("bfloat16", 80, 80).dq_split  # padded to 96
    # 96-column partials (row-major tiles: varlen)
    assert bc.make_config("bfloat16", 96, 96, dq_split=False, varlen_q=True, varlen_k=True).dq_swap
    with pytest.raises(ValueError, match="dq_swap"):
        bc.make_config("bfloat16", 96, 96, dq_swap=True, dq_flat=False)
    assert bc.make_config("bfloat16", 64, 64).dq_writer and bc.make_config("bfloat16", 128, 128).dq_writer
    split, per_wg = bc.make_config("bfloat16", 128, 128), bc.make_config("bfloat16", 128, 128, dq_split=False)
    # half the fp32 dQ staging, one more dS^T buffer
    assert per_wg.smem_bytes - split.smem_bytes == 4 * 2 * 64 * 64 - 2 * 128 * 64


def test_sm90_bwd_varlen_calls_without_a_mask_take_the_64_row_tile_where_the_128_row_one_spilled():
    # head dim 64's 128-row tile with varlen queries and keys and no mask spilled 4/8 B for sm_90a
    # (the sweep), its dK / dV staged or not; the 64-row tile compiles clean there
    for dtype in ("bfloat16", "float16"):
        for seqused in (False, True):
            config = bc.make_config(dtype, 64, 64, varlen_q=True, varlen_k=True, seqused_k=seqused)
            assert config.tile_m == 64 and config.dq_split and config.dkv_staged
    for flags in ({}, {"varlen_q": True}, {"varlen_k": True, "seqused_k": True},
                  {"varlen_q": True, "varlen_k": True, "causal": True},
                  {"varlen_q": True, "varlen_k": True, "local": True}):
        assert bc.make_config("bfloat16", 64, 64, **flags).tile_m == 128, flags
    assert bc.make_config("bfloat16", 128, 128, varlen_q=True, varlen_k=True).tile_m == 64


def test_sm90_bwd_profiling_build_refuses_the_128_row_tile():
    wide = bc.make_config("bfloat16", 64, 64)
    assert wide.dq_rows
    with pytest.raises(ValueError, match="timeline"):
        replace(wide, timeline=True)
    assert "timeline" in replace(bc.make_config("bfloat16", 64, 64, causal=True, softcap=True), timeline=True).name


def test_sm90_bwd_causal_and_local_exclude_each_other():
    with pytest.raises(ValueError, match="causal"):
        bc.make_config("float16", 64, 64, causal=True, local=True)


@pytest.mark.parametrize("args,expected", FLAG_CASES)
def test_sm90_bwd_call_selects_config_flags(args, expected):
    from cute_flash.backends.cute_bwd import sm90_configs

    q = torch.empty(1, 1, 1, 64, dtype=torch.float16)
    pre, main, post = sm90_configs(q, q, q, None, args)
    assert flags_of(main) == expected_flags(expected)
    assert not pre.has_dlse and not pre.varlen_q and not post.varlen_q


def test_sm90_bwd_call_with_dlse_and_varlen_selects_matching_pre_and_post():
    from cute_flash.backends.cute_bwd import sm90_configs

    q = torch.empty(10, 2, 80, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    pre, main, post = sm90_configs(q, q, q, torch.empty(2, 10), AttnArgs(0.1, cu_seqlens_q=cu, cu_seqlens_k=cu))
    assert (main.head_dim, main.varlen_q, main.varlen_k) == (96, True, True)
    assert (pre.head_dim_v, pre.check_hdim_v, pre.has_dlse, pre.varlen_q) == (128, True, True, True)
    assert (post.head_dim, post.check_hdim, post.varlen_q) == (128, True, True)


@pytest.mark.parametrize("d", bc.TILE_HEADDIMS)
def test_sm90_bwd_deterministic_calls_keep_their_tile_without_cluster_or_rotation(d):
    """deterministic=True: the call's tile with ordered dQ reduce-adds, issued by the writer warp,
    on walks that all start at the first query block (no Q/dO cluster, no rotation), in lpt's
    grid order; and with `dq_swap` where only the rotation had turned it off (head dim 256)."""
    from cute_flash.backends.cute_bwd import sm90_configs

    q = torch.empty(2, 8192, 2, d, dtype=torch.bfloat16)
    plain = sm90_configs(q, q, q, None, AttnArgs(0.1))[1]
    main = sm90_configs(q, q, q, None, AttnArgs(0.1), deterministic=True)[1]
    assert main.deterministic and main.dq_writer and not main.cluster_q and not main.rotate_queries
    assert "deterministic" in main.name
    assert main.dq_flat and plain.dq_flat and not main.dq_swap  # fixed length: dQ stored flat
    assert replace(plain, cluster_q=False, rotate_queries=False, lpt=True, dq_convert=False, deterministic=True) == main
    assert bc.with_cluster_q(main, 64) is main
    assert not main.shortest_first
    causal = AttnArgs(0.1, causal=True, window_right=0)
    assert sm90_configs(q, q, q, None, causal, deterministic=True)[1].shortest_first
    assert not sm90_configs(q, q, q, None, causal)[1].shortest_first


def test_sm90_bwd_deterministic_calls_whose_tile_spills_go_to_the_sm80_kernels():
    """Q's head dim 128 with V's 192, causal, varlen: that deterministic tile spills (8/12 B), so
    the sm_90 kernel refuses the call by name and the backend runs it on the sm_80 kernels."""
    from cute_flash.backends.cute import CuteSm90Backend
    from cute_flash.backends.cute_bwd import sm90_configs

    q = torch.empty(100, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(100, 2, 192, dtype=torch.bfloat16)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    args = AttnArgs(0.1, causal=True, window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=60,
                    max_seqlen_k=60)
    with pytest.raises(NotImplementedError, match="deterministic"):
        sm90_configs(q, q, v, None, args, deterministic=True)
    backend = CuteSm90Backend()
    assert not backend.native_backward_takes(q, q, v, args, True)
    assert backend.native_backward_takes(q, q, v, args, False)
    assert backend.backward_refusal(q, q, v, args, True) is None  # the sm_80 kernels take it


@pytest.mark.parametrize("flag", ["cluster_q", "rotate_queries", "dq_writer"])
def test_sm90_bwd_deterministic_refuses_what_could_wait_on_itself(flag):
    base = bc.make_config("bfloat16", 64 if flag == "cluster_q" else 256, 64 if flag == "cluster_q" else 256,
                          deterministic=True)
    with pytest.raises(ValueError, match="deterministic"):
        replace(base, **{flag: flag != "dq_writer"}, **({"dq_flat": False} if flag == "dq_writer" else {}))


def test_sm90_bwd_row_statistics_have_16_byte_row_pitch_for_tma():
    from cute_flash.backends.cute_bwd import _tma_row_stats

    for shape in [(2, 3, 113), (4, 1), (3, 8)]:
        t = _tma_row_stats(torch.empty(shape))
        assert t.shape == shape and t.dtype == torch.float32 and t.stride(-1) == 1
        assert all(s * 4 % 16 == 0 for s in t.stride()[:-1])


@pytest.mark.parametrize("varlen_q", [False, True])
def test_sm90_bwd_row_statistic_boxes_cover_a_query_block_from_a_16_byte_aligned_row(varlen_q):
    """A TMA box starting off a 16-byte boundary of its innermost dimension is an illegal
    instruction: a varlen block's LSE / D rows start at any row, so its box starts at the aligned
    row below (up to STAT_ALIGN - 1 early) and must still reach the block's last row; each stage
    of the buffer starts 128-byte aligned, as TMA writes shared memory."""
    config = bc.make_config("bfloat16", 64, 64, varlen_q=varlen_q, varlen_k=varlen_q)
    early = bc.STAT_ALIGN - 1 if varlen_q else 0
    assert bc.STAT_ALIGN * 4 == 16 and config.tile_m % bc.STAT_ALIGN == 0
    assert config.stat_box >= config.tile_m + early and config.stat_box * 4 % 16 == 0
    assert config.stat_stage_stride >= config.stat_box and config.stat_stage_stride * 4 % 128 == 0
    for offset_q in range(9) if varlen_q else [0]:  # a fixed-length batch's blocks start at row 0
        first = offset_q - offset_q % bc.STAT_ALIGN
        assert first * 4 % 16 == 0 and first + config.stat_box >= offset_q + config.tile_m


def _q(d=64):
    return torch.zeros(1, 8, 1, d, dtype=torch.float16)


def test_sm90_native_backward_is_the_default_and_takes_only_what_its_kernel_does():
    from cute_flash.backends.cute import CuteSm90Backend

    assert CuteSm90Backend.native_backward is True
    backend = CuteSm90Backend()
    q = _q()
    assert backend.native_backward_takes(q, q, q, AttnArgs(0.1), False)
    assert backend.native_backward_takes(q, q, q, AttnArgs(0.1, causal=True, window_right=0), False)
    assert backend.native_backward_takes(q, q, q, AttnArgs(0.1), True)  # deterministic
    assert backend.native_backward_takes(_q(256), _q(256), _q(256), AttnArgs(0.1), False)
    assert backend.native_backward_takes(_q(192), _q(192), _q(192), AttnArgs(0.1), False)
    assert not backend.native_backward_takes(_q(320), _q(320), _q(320), AttnArgs(0.1), False)
    assert not backend.native_backward_takes(q, q, _q(128), AttnArgs(0.1), False)  # head dim of V
    assert backend.native_backward_takes(_q(192), _q(192), _q(128), AttnArgs(0.1), False)
    backend.native_backward = False  # the sm_80 kernels for everything
    assert not backend.native_backward_takes(q, q, q, AttnArgs(0.1), False)


def test_sm90_bwd_audit_targets_cover_every_shipped_config():
    targets = bc.audit_targets("sm_90a")
    shipped = bc.shipped_configs() + bc.shipped_post_configs()
    assert [t.name for t in targets] == [c.name for c in shipped]
    # every flat-dQ main configuration's postprocess among them
    posts = {c.name for c in bc.shipped_post_configs()}
    assert all(bc.make_post_config(c, c.head_dim).name in posts for c in bc.shipped_configs() if c.dq_flat)
    assert bc.audit_targets("sm_80") == []


# ------------------------------------------------------------------------------------------------
# compiles (each 5 to 15 seconds on one core); the audit covers every shipped configuration
# ------------------------------------------------------------------------------------------------
COMPILED = [
    bc.make_config("bfloat16", 128, 128, causal=True),
    bc.make_config("bfloat16", 128, 128, local=True, softcap=True, varlen_q=True, varlen_k=True, seqused_k=True),
    bc.make_config("float16", 72, 72),
    bc.make_config("bfloat16", 256, 256, local=True, softcap=True, varlen_q=True, varlen_k=True, seqused_k=True),
    bc.make_config("float16", 192, 192, causal=True),
    # the 96-key tile (`keys_n`), whose shared memory is exactly the limit with the varlen boxes
    bc.make_config("bfloat16", 192, 128, local=True, softcap=True, varlen_q=True, varlen_k=True, seqused_k=True),
    # ... and with dO's ring of its own (`single_dout`)
    bc.make_config("bfloat16", 192, 192, local=True, softcap=True, varlen_q=True, varlen_k=True, seqused_k=True),
    # the profiling build (`timeline`): counters that spilled or serialized would measure nothing
    replace(bc.make_config("bfloat16", 128, 128, causal=True), timeline=True),
]


@pytest.mark.parametrize("config", COMPILED, ids=[c.name for c in COMPILED])
def test_sm90_bwd_compiles_without_spills_with_hgmma_tma_setmaxnreg_and_no_wgmma_serialization(config, tmp_path):
    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    target = audit.AuditTarget(config.name, "sm_90a", lambda options: bc.compile_kernel(config, options))
    row = audit.audit_target(target, keep_dir=tmp_path)
    assert row.error is None, row.error
    assert not row.spills, f"{row.spill_stores}/{row.spill_loads} bytes spilled, SASS {row.sass}"
    assert row.sass["HGMMA"] and row.sass["UTMALDG"] and row.setmaxnreg, row.sass
    # the configuration counts what the CTA takes, so that its limit check refuses what would not launch
    if row.smem_dynamic is not None:
        assert (row.smem_static or 0) + row.smem_dynamic == config.smem_bytes <= bc.SMEM_LIMIT
    # ptxas serializes WGMMAs (waits after each) when it cannot keep their registers apart
    remarks = (tmp_path / config.name / "remarks.yaml").read_text()
    assert "wgmma.mma_async instructions are serialized" not in remarks
    # the main loop's WGMMA descriptors stay in uniform registers: with the shared-memory operands
    # sliced by the thread index, ptxas rebuilt them per thread and moved them over (R2UR) before
    # 16 of the 32 HGMMAs at head dim 128 and 48 of 54 at 192 (the profiling build's clock reads
    # go through R2UR too)
    loop = main_loop((tmp_path / config.name / "kernel.sass").read_text())
    assert loop
    if not config.timeline:
        # (head dim 96 with dq_split: ptxas keeps one dO descriptor base of the dV GEMM in a
        # thread register and moves it over once per step, before 2 of its 4 HGMMAs, at 168
        # registers; the 48-column dQ GEMM's own descriptors stay uniform)
        allowed = 2 if config.head_dim == 96 and config.dq_split else 0
        assert descriptors_moved_from_thread_registers(loop) <= allowed


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (300, 1000), (1000, 300), (129, 129)])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_bwd_deterministic_turns_follow_the_launch_order(mask, seqlen_q, seqlen_k, d):
    """The key blocks that add into a query block take turns 0, 1, ... in an order in which the
    grid launches them (the CTA whose turn comes first is never launched after the one waiting
    for it), and with a mask (`shortest_first`: turns and launches from the last key block down,
    walks up from each CTA's first query block) the CTA whose turn comes first reaches the query
    block at the same step or earlier, so CTAs walking in lockstep never wait."""
    from cute_flash.kernels.common.block_info import BlockInfo
    from cute_flash.kernels.common.seqlen_info import SeqlenInfo
    from cute_flash.kernels.sm90.fwd_sync import tile_coords

    flags = {"none": {}, "causal": {"causal": True}, "local": {"local": True}}[mask]
    cfg = bc.make_config("bfloat16", d, d, deterministic=True, **flags)
    assert cfg.lpt and cfg.shortest_first == (mask != "none")
    left, right = {"none": (-1, -1), "causal": (-1, 0), "local": (200, 70)}[mask]
    info = BlockInfo(cfg.tile_m, cfg.tile_n, cfg.causal, cfg.local, left, right)
    seqlen = SeqlenInfo(0, 0, seqlen_q, seqlen_k, False, False)
    num_n = -(-seqlen_k // cfg.tile_n)
    # one (batch, head): the grid's order of its key blocks
    launch = {tile_coords(i, num_n, 1, 1, 4, cfg.shortest_first)[0]: i for i in range(num_n)}
    assert sorted(launch) == list(range(num_n))
    walks = {n: range(*map(int, info.m_block_range(seqlen, n))) for n in range(num_n)}
    checked = 0
    for m in range(-(-seqlen_q // cfg.tile_m)):
        visitors = [n for n in range(num_n) if m in walks[n]]
        n_min, n_max = map(int, info.n_block_range(seqlen, m))
        assert visitors == list(range(n_min, n_max))
        turns = {n: int(info.key_block_turn(seqlen, n, m, cfg.shortest_first)) for n in visitors}
        by_turn = sorted(visitors, key=turns.get)
        assert [turns[n] for n in by_turn] == list(range(len(by_turn)))
        for first, then in zip(by_turn, by_turn[1:]):
            assert launch[first] < launch[then]
            if cfg.shortest_first:  # the step at which each CTA's walk reaches m
                assert m - walks[first].start <= m - walks[then].start
            checked += 1
    assert checked > 0 or num_n == 1


def test_sm90_bwd_deterministic_with_a_mask_needs_the_shortest_first_grid():
    with pytest.raises(ValueError, match="shortest_first"):
        replace(bc.make_config("bfloat16", 128, 128, causal=True, deterministic=True), lpt=False)
    replace(bc.make_config("bfloat16", 128, 128, deterministic=True), lpt=False)  # no mask: any grid order


@pytest.mark.parametrize("d", [64, 128])
def test_sm90_bwd_masked_path_takes_bit_masks_with_fewer_instructions(d, tmp_path):
    """`mask_bits`: the masked path's (key, query) verdicts come from one bit mask per accumulator
    row instead of a comparison per pair: fewer compares and selects, and fewer instructions in
    all (at head dim 64, 32 queries per row and thread, one compare per pair saved)."""
    bits = bc.make_config("bfloat16", d, d, causal=True)
    compares = replace(bits, mask_bits=False)
    assert bits.mask_bits and compares.name.endswith("_cmpmask")
    counts = sass_opcode_counts((bits, compares), bc.compile_kernel, tmp_path)
    fewer = {op: counts[compares.name][op] - counts[bits.name][op] for op in ("ISETP", "FSEL")}
    assert fewer["ISETP"] > 0 and fewer["FSEL"] >= 32, fewer
    assert sum(counts[compares.name].values()) - sum(counts[bits.name].values()) >= 32
