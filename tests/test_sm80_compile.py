"""The sm_80 forward kernel on the CPU: its configuration table, the choice of configuration for
a call, and compiles for sm_80 / sm_90a that must have no spills and the intended instructions.
(The full list of shipped configurations is audited by `python -m cute_flash.audit`.)"""

from __future__ import annotations

import os
from dataclasses import replace
import warnings

import pytest
import torch

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

from cute_flash.backends.base import AttnArgs  # noqa: E402
from cute_flash.kernels.sm80 import fwd_config as fc  # noqa: E402
from kernel_flag_cases import FLAG_CASES, expected_flags, flags_of

A100_SMEM = 163 * 1024
SM86_SMEM = 99 * 1024


@pytest.mark.parametrize("headdim", fc.TILE_HEADDIMS)
def test_tile_table_fits_shared_memory(headdim):
    config = fc.make_config("bfloat16", headdim, headdim)
    assert config.smem_bytes <= SM86_SMEM <= A100_SMEM
    # every warp owns whole m16 MMA rows, and the copy threads tile the K/V rows exactly
    assert config.tile_m % (16 * config.num_warps) == 0
    assert config.tile_n % 16 == 0


@pytest.mark.parametrize("d,tile", [(8, 32), (32, 32), (40, 64), (64, 64), (72, 96), (120, 128), (136, 192), (256, 256)])
def test_headdims_pad_up_to_the_next_tile(d, tile):
    config = fc.make_config("float16", d, d)
    assert (config.head_dim, config.check_hdim, config.check_hdim_v) == (tile, d != tile, d != tile)


def test_headdim_above_256_is_rejected():
    with pytest.raises(ValueError, match="264"):
        fc.make_config("float16", 264, 264)


def test_tiles_whose_row_copies_would_overrun_a_tile_are_refused():
    # 12 warps copy 128-column rows 48 at a time: 64 keys are not a whole number of passes (the
    # copy would write past the K and V tiles; measured on an H200 as an illegal address)
    with pytest.raises(ValueError, match="tile_n \\(64 rows\\).*48 rows"):
        replace(fc.make_config("bfloat16", 128, 128, few_query_tiles=True), tile_m=192, tile_n=64, num_warps=12)
    # every head dim pair builds (the check runs in the config's constructor)
    for short in (False, True):
        for d in range(8, 257, 8):
            for dv in range(8, 257, 8):
                fc.make_config("float16", d, dv, short_queries=short)


def test_headdim_v_tiles_apart_and_picks_the_larger_tile():
    config = fc.make_config("bfloat16", 192, 128)
    assert (config.head_dim, config.head_dim_v) == (192, 128)
    assert (config.tile_m, config.tile_n, config.num_warps) == tuple(fc.TILES[192][:3])


def test_config_is_a_hashable_cache_key_with_distinct_names():
    configs = fc.shipped_configs()
    assert len({c.name for c in configs}) == len(configs)
    assert len(set(configs)) == len(configs)
    assert fc.make_config("float16", 64, 64) == fc.make_config("float16", 64, 64)


def test_config_names_tell_apart_every_flag():
    from dataclasses import fields, replace

    plain = fc.make_config("bfloat16", 64, 64)
    for f in fields(plain):
        if isinstance(getattr(plain, f.name), bool):
            # the page flags exist only with paged_kv
            base = replace(plain, paged_kv=True) if f.name in ("page_size_pow2", "pages_hold_tiles") else plain
            if f.name == "pingpong":  # the turns need 8 warps
                base = fc.make_config("bfloat16", 128, 128)
            assert replace(base, **{f.name: not getattr(base, f.name)}).name != base.name, f.name


def test_causal_and_local_exclude_each_other():
    with pytest.raises(ValueError, match="causal"):
        fc.make_config("float16", 64, 64, causal=True, local=True)


def _q(d=64, dtype=torch.float16):
    return torch.empty(1, 1, 1, d, dtype=dtype)


@pytest.mark.parametrize("args,expected", FLAG_CASES)
def test_call_selects_config_flags(args, expected):
    from cute_flash.backends.cute import CuteSm80Backend

    q = _q()
    config = CuteSm80Backend().config(q, q, q, torch.empty(1), args)
    assert flags_of(config) == expected_flags(expected)


def test_call_without_lse_compiles_a_kernel_without_it():
    from cute_flash.backends.cute import CuteSm80Backend

    q = _q(128, torch.bfloat16)
    assert not CuteSm80Backend().config(q, q, q, None, AttnArgs(0.1)).has_lse
    assert CuteSm80Backend().config(q, q, q, torch.empty(1), AttnArgs(0.1)).has_lse


def test_backend_declares_only_what_it_implements():
    from cute_flash.backends.base import FEATURES
    from cute_flash.backends.cute import CuteSm80Backend

    backend = CuteSm80Backend()
    assert backend.name == "cute-sm80"
    assert backend.features <= set(FEATURES)
    assert {"paged_kv", "split_kv", "backward"} <= backend.features
    assert "fp32" not in backend.features


# ------------------------------------------------------------------------------------------------
# compiles (each a few seconds on one core)
# ------------------------------------------------------------------------------------------------
COMPILED = [
    ("sm_80", fc.make_config("float16", 64, 64)),
    ("sm_80", fc.make_config("bfloat16", 128, 128, causal=True, varlen_q=True, varlen_k=True, seqused_k=True)),
    ("sm_80", fc.make_config("bfloat16", 40, 40, local=True, softcap=True)),
    ("sm_80", fc.make_config("float16", 256, 256, causal=True)),
    ("sm_90a", fc.make_config("bfloat16", 128, 128, causal=True)),
    # the lazy rescale with a mask (shipped without one)
    ("sm_80", fc.make_config("bfloat16", 64, 64, causal=True, lazy_rescale=True)),
    # hd128's unmasked tile, lazy, for the arch it runs on in an H200
    ("sm_90a", fc.make_config("bfloat16", 128, 128)),
]


@pytest.mark.parametrize("arch,config", COMPILED, ids=[f"{a}-{c.name}" for a, c in COMPILED])
def test_kernel_compiles_without_spills_using_ldgsts_ldsm_hmma(arch, config, tmp_path):
    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    target = audit.AuditTarget(config.name, arch, lambda options: fc.compile_fwd(config, options))
    row = audit.audit_target(target)
    assert row.error is None, row.error
    assert not row.spills, f"{row.spill_stores}/{row.spill_loads} bytes spilled, SASS {row.sass}"
    for op in ("HMMA", "LDSM", "LDGSTS"):
        assert row.sass[op] > 0, f"no {op} in the SASS: {row.sass}"
    assert row.smem_dynamic is None or row.smem_dynamic >= config.smem_bytes


def test_audit_targets_cover_every_shipped_config():
    targets = fc.audit_targets("sm_80")
    assert [t.name for t in targets] == [c.name for c in fc.shipped_configs()]
    assert {t.arch for t in targets} == {"sm_80"}


def test_warmup_compiles_once_then_serves_from_memory(tmp_path, monkeypatch):
    from cute_flash import backends
    from cute_flash.backends import cute

    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(backends._instances, "cute-sm80", cute.CuteSm80Backend())  # an empty cache
    entry = dict(dtype="float16", head_dim=32, head_dim_v=32)
    with warnings.catch_warnings():
        # without CUDA libraries the DSL cannot export an object file; memory caching still works
        warnings.simplefilter("ignore")
        first = cute.warmup([entry], backend="cute-sm80", arch="sm_80")
    second = cute.warmup([entry], backend="cute-sm80", arch="sm_80")
    assert [r[1] for r in first + second] == ["compiled", "memory"]
    assert first[0][0] == fc.make_config(**entry)


def test_every_shipped_config_compiles_for_sm80_without_spills_with_hmma_ldsm_ldgsts():
    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    rows = audit.audit("sm_80", modules=["cute_flash.kernels.sm80.fwd_config"])
    assert len(rows) == len(fc.shipped_configs())
    problems = [f"{row.name}: {row.error}" for row in rows if row.error is not None]
    problems += [f"{row.name}: spills {row.spill_stores}/{row.spill_loads} bytes, SASS {row.sass}"
                 for row in rows if row.error is None and row.spills]
    problems += [f"{row.name}: {op} missing from the SASS" for row in rows if row.error is None
                 for op in ("HMMA", "LDSM", "LDGSTS") if not row.sass[op]]
    assert not problems, "\n".join(problems)


def test_calls_with_at_most_64_query_rows_take_the_short_query_tile():
    """Decode-shaped calls (after GQA packing too) get SHORT_QUERY_TILES, the others (here
    unmasked, and on the CPU, with no SM count, counted as many query tiles) PINGPONG_TILES."""
    from cute_flash.backends.base import AttnArgs
    from cute_flash.backends.cute import CuteSm80Backend
    from cute_flash.kernels.sm80 import fwd_config

    backend = CuteSm80Backend()
    k = torch.empty(2, 300, 2, 128, dtype=torch.bfloat16)
    for seqlen_q, tiles in ((1, fwd_config.SHORT_QUERY_TILES), (64, fwd_config.SHORT_QUERY_TILES),
                             (65, fwd_config.PINGPONG_TILES)):
        q = torch.empty(2, seqlen_q, 8, 128, dtype=torch.bfloat16)
        config = backend.config(q, k, k, None, AttnArgs(0.1))
        assert (config.tile_m, config.tile_n, config.num_warps, config.num_stages) == tiles[128][:4]
    assert fwd_config.SHORT_QUERY_TILES[128] != fwd_config.PINGPONG_TILES[128]
    # varlen: the longest query sequence decides
    q = torch.empty(70, 8, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 35, 70], dtype=torch.int32)
    args = AttnArgs(0.1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=35, max_seqlen_k=35)
    assert backend.config(q, q, q, None, args).tile_m == fwd_config.SHORT_QUERY_TILES[128].tile_m


@pytest.mark.parametrize("d", fc.TILE_HEADDIMS)
def test_unmasked_prefill_takes_its_tile_and_the_lazy_rescale(d):
    """Without a mask (softcap and varlen included) long-query calls take PINGPONG_TILES where
    there is one (with the turns; UNMASKED_TILES with few query tiles), else UNMASKED_TILES and, at
    UNMASKED_LAZY_HEADDIMS, the lazy rescale, with the keep vote at KEEP_VOTE_HEADDIMS; causal
    calls take CAUSAL_TILES, with the lazy rescale and the vote at CAUSAL_VOTE_HEADDIMS (eager
    elsewhere); windowed calls take TILES, eager; decode tiles stay eager."""
    lazy = d in fc.UNMASKED_LAZY_HEADDIMS
    for flags in ({}, {"softcap": True}, {"varlen_q": True, "varlen_k": True}):
        config = fc.make_config("bfloat16", d, d, **flags)
        assert (config.tile_m, config.tile_n, config.num_warps, config.num_stages) == \
            fc.PINGPONG_TILES.get(d, fc.UNMASKED_TILES[d])[:4]
        assert config.pingpong == (d in fc.PINGPONG_TILES)
        assert config.lazy_rescale == lazy, flags
        assert config.keep_vote == (d in fc.KEEP_VOTE_HEADDIMS), flags
        few = fc.make_config("bfloat16", d, d, few_query_tiles=True, **flags)
        assert (few.tile_m, few.tile_n, few.num_warps, few.num_stages) == fc.UNMASKED_TILES[d][:4]
        assert not few.pingpong and fc.without_pingpong(config) == few and fc.with_pingpong(few) == config
        # paged and split-KV calls keep the tile without the turns
        if "varlen_k" not in flags:  # a paged cache has no cu_seqlens_k
            assert not fc.make_config("bfloat16", d, d, page_size=256, **flags).pingpong
        assert not fc.make_config("bfloat16", d, d, split_kv=True, **flags).pingpong
    causal_vote = d in fc.CAUSAL_VOTE_HEADDIMS
    for mask, tiles, voting in (({"causal": True}, fc.CAUSAL_TILES, causal_vote),
                                ({"causal": True, "softcap": True}, fc.CAUSAL_TILES, causal_vote),
                                ({"local": True}, fc.TILES, False)):
        config = fc.make_config("bfloat16", d, d, **mask)
        assert (config.tile_m, config.tile_n, config.num_warps, config.num_stages) == tiles[d][:4]
        assert config.lazy_rescale == config.keep_vote == voting, mask
    short = fc.make_config("bfloat16", d, d, short_queries=True)
    assert not short.lazy_rescale and not short.keep_vote
    assert not fc.make_config("bfloat16", d, d, short_queries=True, causal=True).keep_vote
    # asked for explicitly, either way wins (the vote goes with the lazy rescale)
    assert fc.make_config("bfloat16", d, d, lazy_rescale=not lazy).lazy_rescale == (not lazy)
    assert not fc.make_config("bfloat16", d, d, lazy_rescale=False).keep_vote
    assert fc.UNMASKED_TILES[128] != fc.TILES[128]
    assert fc.CAUSAL_TILES[128] == fc.UNMASKED_TILES[128]


def test_pingpong_needs_8_warps_2_stages_and_no_mask():
    pp = fc.make_config("bfloat16", 128, 128)
    assert pp.pingpong and pp.name.endswith("_pp")
    with pytest.raises(ValueError, match="num_warps 8 and num_stages 2"):
        replace(pp, num_warps=4, tile_m=128)
    for flag in ("causal", "local", "paged_kv", "split_kv"):
        with pytest.raises(NotImplementedError, match=f"pingpong with {flag}"):
            replace(pp, **{flag: True})
    # masked calls never take it
    assert not fc.make_config("bfloat16", 128, 128, causal=True).pingpong


def test_keep_vote_needs_the_lazy_rescale():
    with pytest.raises(ValueError, match="keep_vote.*lazy_rescale"):
        fc.make_config("bfloat16", 128, 128, lazy_rescale=False, keep_vote=True)


def test_keep_vote_takes_os_rescale_off_the_key_block_loop(tmp_path):
    """hd128's unmasked 128x32 loop: with the lazy rescale alone the skip of O's 128 FMULs (per
    thread, 32 rows x 128 columns a warp) is predicated, so every trip issues them; with the keep
    vote the trip of a warp whose rows all keep their references has no rescale and no max
    shuffle, and is shorter. No spills (sm_80)."""
    import sys
    from pathlib import Path

    from cute_flash import audit

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import loop_sass

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    voting = fc.make_config("bfloat16", 128, 128, few_query_tiles=True)
    assert voting.keep_vote and (voting.tile_m, voting.tile_n, voting.num_warps) == (128, 32, 4)
    rows = voting.tile_m // voting.num_warps
    gemms = loop_sass.gemm_count(voting, "sm80")
    assert gemms == 128  # a warp's 32 rows: S in 2 x 4 x 8 HMMAs, P V in 2 x 16 x 2
    trips, fmuls = {}, {}
    for config in (voting, replace(voting, keep_vote=False)):
        row = audit.audit_target(audit.AuditTarget(config.name, "sm_80", lambda o, c=config: fc.compile_fwd(c, o)),
                                 keep_dir=tmp_path)
        assert row.error is None and not row.spills, (row.error, row.spill_stores, row.spill_loads)
        body, paths = loop_sass.analyse((tmp_path / config.name / "kernel.sass").read_text(), gemms, gemm_op="HMMA")
        trips[config.keep_vote], fmuls[config.keep_vote] = min(paths), loop_sass.mix(body)["FMUL"]
        assert loop_sass.mix(body)["MUFU.EX2"] >= rows * voting.tile_n // 32  # a thread's exponentials
        if config.keep_vote:
            assert any("VOTE.ALL" in inst for inst in body) and not any("SHFL" in inst for inst in body)
    assert fmuls[False] >= 128 > 16 >= fmuls[True], fmuls
    assert trips[True] < trips[False] * 0.8, trips
