"""The sm_80 backward kernels on the CPU: configuration table, the choice of configurations for a
call, what the backend refuses, and compiles for sm_80 / sm_90a without spills with the intended
instructions. (`python -m cute_flash.audit --module cute_flash.kernels.sm80.bwd_config` audits
every shipped configuration.)"""

from __future__ import annotations

import os
from dataclasses import fields, replace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

from cute_flash.backends.base import AttnArgs  # noqa: E402
from cute_flash.kernels.sm80 import bwd_config as bc  # noqa: E402
from kernel_flag_cases import FLAG_CASES, expected_flags, flags_of

SM86_SMEM = 99 * 1024
A100_SMEM = 163 * 1024


@pytest.mark.parametrize("headdim", bc.TILE_HEADDIMS)
def test_tile_table_fits_shared_memory_and_tiles_the_warps(headdim):
    config = bc.make_config("bfloat16", headdim, headdim)
    # head dims up to 128 run on every sm_80+ part; 256 (full Q, K, V, dO tiles) on the A100 and up
    assert config.smem_bytes <= (SM86_SMEM if headdim <= 128 else A100_SMEM)
    assert config.tile_n == 16 * config.num_warps
    assert config.tile_m % (16 * config.dq_warps_m) == 0
    assert config.dk_cols <= 128 and config.dv_cols <= 128  # the registers of head dim 128 at most


@pytest.mark.parametrize("d,tile", [(8, 64), (64, 64), (72, 96), (96, 96), (120, 128), (128, 128)])
def test_headdims_pad_up_to_the_next_tile(d, tile):
    config = bc.make_config("float16", d, d)
    assert (config.head_dim, config.check_hdim, config.check_hdim_v) == (tile, d != tile, d != tile)


@pytest.mark.parametrize("d,dv,cols", [(136, 136, (96, 96)), (192, 192, (96, 96)), (256, 256, (128, 128)),
                                        (256, 128, (128, 64)), (128, 192, (64, 96)), (192, 128, (96, 64)),
                                        (256, 64, (128, 32)), (64, 200, (32, 128))])
def test_headdims_above_128_split_dk_dv_and_dq_over_two_ctas(d, dv, cols):
    config = bc.make_config("bfloat16", d, dv)
    assert config.col_tiles == 2 and (config.dk_cols, config.dv_cols) == cols
    assert (config.check_hdim, config.check_hdim_v) == (d not in (64, 128, 192, 256), dv not in (64, 128, 192, 256))
    assert config.name.split("_")[4].endswith("c2")


@pytest.mark.parametrize("d,dv", [(264, 264), (64, 264), (96, 256), (96, 192)])
def test_head_dims_the_backward_cannot_tile_are_refused_by_name(d, dv):
    # above 256 there is no tile; 48 columns of dQ per CTA do not tile the dQ MMA's 32
    with pytest.raises(NotImplementedError, match=f"{max(d, dv)}"):
        bc.make_config("bfloat16", d, dv)


@pytest.mark.parametrize("d,dv", [(136, 72), (256, 96), (192, 96)])
def test_head_dims_whose_row_copies_overrun_the_4_warp_tile_take_2_warps(d, dv):
    # 48 columns of dV per CTA: 16-column thread rows, 64 rows per pass of 128 threads > 32 rows
    with pytest.raises(ValueError, match="rows that 128 threads copy per pass"):
        replace(bc.make_config("bfloat16", d, dv), tile_n=64, num_warps=4)
    config = bc.make_config("bfloat16", d, dv)
    assert (config.tile_m, config.tile_n, config.num_warps, config.col_tiles, config.dv_cols) == (32, 32, 2, 2, 48)


@pytest.mark.parametrize("d,dv", [(96, 128), (128, 96), (72, 104)])
def test_head_dims_96_with_128_take_the_4_warp_tile_whose_row_copies_fit(d, dv):
    # 96 columns copy as 32-column thread rows: 64 rows per pass of the 8-warp tile's 256 threads,
    # twice the 32 rows of its query block; the 4-warp tile copies 32
    config = bc.make_config("bfloat16", d, dv)
    assert (config.tile_m, config.tile_n, config.num_warps) == (32, 64, 4)


def test_every_head_dim_pair_gets_a_tile_its_row_copies_cover_or_a_refusal():
    from cute_flash.kernels.common.tiles import check_row_copy_passes

    for d in range(8, 257, 8):
        for dv in range(8, 257, 8):
            for limit in (None, A100_SMEM, 227 * 1024):
                try:
                    c = bc.make_config("float16", d, dv, smem_limit=limit)
                except NotImplementedError:
                    continue
                check_row_copy_passes(16, (c.dk_cols, c.dv_cols), 32 * c.num_warps,
                                      {"tile_m": c.tile_m, "tile_n": c.tile_n})


def test_row_copy_passes_must_cover_a_tile_whole():
    from cute_flash.kernels.common.tiles import check_row_copy_passes

    check_row_copy_passes(16, (128,), 256, {"tile_m": 32})  # 8 threads a row: 32 rows a pass
    with pytest.raises(ValueError, match="tile_m \\(32 rows\\).*64 rows"):
        check_row_copy_passes(16, (128, 96), 256, {"tile_m": 32})  # 64-byte atom: 4 threads a row
    with pytest.raises(ValueError, match="48 rows"):
        check_row_copy_passes(16, (128,), 384, {"tile_n": 64})
    with pytest.raises(ValueError, match="rows that 256 threads"):
        replace(bc.make_config("bfloat16", 128, 128), head_dim=96)


def test_column_tiles_must_tile_the_narrowest_swizzle_atom_and_the_dq_mma():
    with pytest.raises(ValueError, match="multiple of 16"):
        replace(bc.make_config("bfloat16", 256, 256), col_tiles=32)
    with pytest.raises(ValueError, match="dQ MMA"):
        replace(bc.make_config("bfloat16", 256, 256), head_dim=96)


def test_pre_and_post_tiles_round_up_to_64_columns():
    assert bc.make_pre_config("float16", 96, varlen_q=False, has_dlse=False).head_dim_v == 128
    assert bc.make_pre_config("float16", 96, varlen_q=False, has_dlse=False).check_hdim_v
    assert not bc.make_post_config("float16", 64, varlen_q=True).check_hdim
    assert bc.make_post_config("float16", 40, varlen_q=True).head_dim == 64


def test_shipped_configs_are_few_distinct_cache_keys():
    configs = bc.shipped_configs()
    assert len(configs) <= 24  # each one is compiled and audited in CI
    assert len({c.name for c in configs}) == len(configs) == len(set(configs))


def test_config_names_tell_apart_every_flag():
    for base in (bc.make_config("bfloat16", 64, 64), bc.make_pre_config("float16", 64, False, False, dq_accum_cols=64),
                 bc.make_post_config("float16", 64, False)):
        for f in fields(base):
            if isinstance(getattr(base, f.name), bool):
                assert replace(base, **{f.name: not getattr(base, f.name)}).name != base.name, f.name


def test_a_flat_dq_accumulator_is_cleared_only_whole_and_for_fixed_length_calls():
    """The preprocess clears the sm_90 kernel's flat accumulator (`dq_flat`) whole: it needs its
    columns, and a varlen call has no flat accumulator."""
    assert bc.make_pre_config("bfloat16", 128, False, False, dq_accum_cols=128, dq_flat=True).dq_flat
    with pytest.raises(ValueError, match="dq_flat"):
        bc.make_pre_config("bfloat16", 128, False, False, dq_flat=True)
    with pytest.raises(ValueError, match="dq_flat"):
        bc.make_pre_config("bfloat16", 128, True, False, dq_accum_cols=128, dq_flat=True)


def test_causal_and_local_exclude_each_other():
    with pytest.raises(ValueError, match="causal"):
        bc.make_config("float16", 64, 64, causal=True, local=True)


@pytest.mark.parametrize("args,expected", FLAG_CASES)
def test_call_selects_config_flags(args, expected):
    from cute_flash.backends.cute_bwd import configs

    q = torch.empty(1, 1, 1, 64, dtype=torch.float16)
    pre, main, post = configs(q, q, q, None, args)
    assert flags_of(main) == expected_flags(expected)
    assert not pre.has_dlse and not pre.varlen_q and not post.varlen_q


def test_call_with_dlse_and_varlen_selects_matching_pre_and_post():
    from cute_flash.backends.cute_bwd import configs

    q = torch.empty(10, 2, 80, dtype=torch.bfloat16)
    v = torch.empty(10, 2, 48, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    pre, main, post = configs(q, q, v, torch.empty(2, 10), AttnArgs(0.1, cu_seqlens_q=cu, cu_seqlens_k=cu))
    assert (main.head_dim, main.head_dim_v, main.varlen_q, main.varlen_k) == (96, 64, True, True)
    assert (pre.head_dim_v, pre.check_hdim_v, pre.has_dlse, pre.varlen_q) == (64, True, True, True)
    assert (post.head_dim, post.check_hdim, post.varlen_q) == (128, True, True)


def _q(d=64):
    return torch.zeros(1, 8, 1, d, dtype=torch.float16)


def test_deterministic_mode_has_its_own_kernel():
    from cute_flash.backends.cute import CuteSm80Backend
    from cute_flash.backends.cute_bwd import configs

    q = _q()
    _, main, _ = configs(q, q, q, None, AttnArgs(0.1), deterministic=True)
    assert main.deterministic and main.name.endswith("_det")
    assert not configs(q, q, q, None, AttnArgs(0.1))[1].deterministic
    # checked on a GPU (tests/gpu/test_bwd_sm80.py), so the backend takes it
    assert CuteSm80Backend().backward_refusal(q, q, q, AttnArgs(0.1), True) is None


def test_backward_refuses_head_dims_it_cannot_tile_by_name():
    from cute_flash.backends.cute import CuteSm80Backend
    from cute_flash.backends.cute_bwd import backward

    q, v = _q(96), _q(256)
    with pytest.raises(NotImplementedError, match="256"):
        backward(CuteSm80Backend(), q, q, v, v, v, torch.zeros(1, 1, 8), None, q, q, v, AttnArgs(0.1), False)


def test_backward_refuses_a_gpu_without_the_shared_memory_of_its_tile(monkeypatch):
    """Head dim 256 needs 100 KB per CTA: an sm_86 / sm_89 part (99 KB) gets a refusal saying so,
    and its backward goes to the reference backend; head dim 128 still fits. (cute-sm90 runs
    head dim 256 on its own backward kernel, which only an sm_90 part runs; with that off it
    hands the call to these kernels, with their limits.)"""
    from cute_flash.backends import cute_bwd
    from cute_flash.backends.cute import CuteSm80Backend, CuteSm90Backend

    monkeypatch.setattr(cute_bwd, "_smem_optin", lambda device: SM86_SMEM)
    q256, q128 = _q(256), _q(128)
    assert CuteSm90Backend().backward_refusal(q256, q256, q256, AttnArgs(0.1), False) is None
    on_sm80_kernels = CuteSm90Backend()
    on_sm80_kernels.native_backward = False
    for backend in (CuteSm80Backend(), on_sm80_kernels):
        assert "shared memory" in backend.backward_refusal(q256, q256, q256, AttnArgs(0.1), False)
        assert backend.backward_refusal(q128, q128, q128, AttnArgs(0.1), False) is None
    monkeypatch.setattr(cute_bwd, "_smem_optin", lambda device: A100_SMEM)
    assert CuteSm80Backend().backward_refusal(q256, q256, q256, AttnArgs(0.1), False) is None


def test_head_dim_256_takes_the_8_warp_tile_where_the_gpu_has_the_shared_memory(monkeypatch):
    from cute_flash.backends import cute_bwd
    from cute_flash.backends.cute_bwd import configs

    h100 = bc.make_config("bfloat16", 256, 256, smem_limit=227 * 1024)
    assert (h100.tile_n, h100.num_warps, h100.col_tiles) == (128, 8, 2) and h100.smem_bytes <= 227 * 1024
    for limit in (None, A100_SMEM):
        small = bc.make_config("bfloat16", 256, 256, smem_limit=limit)
        assert (small.tile_n, small.num_warps) == (64, 4)
    assert bc.make_config("bfloat16", 128, 128, smem_limit=227 * 1024) == bc.make_config("bfloat16", 128, 128)
    # where the 8-warp tile's row copies would overrun a 32-row query block (32 or 96 columns
    # per CTA on one side), the 4-warp tile
    for d, dv in ((256, 64), (64, 256), (256, 192), (192, 256)):
        assert bc.make_config("bfloat16", d, dv, smem_limit=227 * 1024).num_warps == 4
    # the host path asks the GPU of q
    q = _q(256)
    monkeypatch.setattr(cute_bwd, "_smem_optin", lambda device: 227 * 1024)
    assert configs(q, q, q, None, AttnArgs(0.1))[1] == bc.make_config("float16", 256, 256, smem_limit=227 * 1024)
    monkeypatch.setattr(cute_bwd, "_smem_optin", lambda device: A100_SMEM)
    assert configs(q, q, q, None, AttnArgs(0.1))[1].num_warps == 4


def test_backward_is_offered_on_sm80_and_on_sm90_through_the_sm80_kernels():
    from cute_flash.backends.cute import CuteSm80Backend, CuteSm90Backend

    for cls in (CuteSm80Backend, CuteSm90Backend):
        assert "backward" in cls.features and "backward" not in cls.unverified
    q = _q()
    # cute-sm90 asks the sm_80 kernels, which take the call or say why not
    assert CuteSm90Backend().backward_refusal(q, q, q, AttnArgs(0.1), False) is None
    q256, q96 = torch.zeros(1, 8, 2, 256, dtype=torch.float16), torch.zeros(1, 8, 2, 96, dtype=torch.float16)
    assert CuteSm90Backend().backward_refusal(q256, q256, q256, AttnArgs(0.1), False) is None
    assert "256" in CuteSm90Backend().backward_refusal(q96, q96, q256, AttnArgs(0.1), False)


def test_kernel_cache_builds_backward_configs_through_the_config_module(tmp_path, monkeypatch):
    import warnings

    from cute_flash.backends.kernel_cache import KernelCache
    from cute_flash.backends.cute_bwd import CONFIG_MODULE

    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    cache = KernelCache(CONFIG_MODULE, ("common", "sm80"))
    config = bc.make_post_config("float16", 64, varlen_q=False)
    with warnings.catch_warnings():
        # without CUDA libraries the DSL cannot export an object file; memory caching still works
        warnings.simplefilter("ignore")
        assert cache.get(config, "sm_80")[1] == "compiled"
    assert cache.get(config, "sm_80")[1] == "memory"


def test_audit_targets_cover_every_shipped_config():
    targets = bc.audit_targets("sm_90a")
    assert [t.name for t in targets] == [c.name for c in bc.shipped_configs()]
    assert {t.arch for t in targets} == {"sm_90a"}


# ------------------------------------------------------------------------------------------------
# compiles (each a few seconds on one core)
# ------------------------------------------------------------------------------------------------
MAIN_COMPILED = [
    ("sm_80", bc.make_config("float16", 64, 64)),
    ("sm_80", bc.make_config("bfloat16", 128, 128, causal=True, varlen_q=True, varlen_k=True, seqused_k=True)),
    ("sm_80", bc.make_config("bfloat16", 72, 72, local=True, softcap=True)),
    ("sm_90a", bc.make_config("bfloat16", 128, 128, causal=True)),
    # column tiles (two CTAs per key block) above head dim 128
    ("sm_80", bc.make_config("bfloat16", 192, 128, causal=True, deterministic=True)),
    ("sm_90a", bc.make_config("bfloat16", 256, 64, causal=True)),
    ("sm_90a", bc.make_config("float16", 256, 256, local=True, softcap=True, varlen_q=True, varlen_k=True)),
]
ROW_KERNELS_COMPILED = [
    ("sm_80", bc.make_pre_config("bfloat16", 80, varlen_q=True, has_dlse=True)),
    ("sm_90a", bc.make_post_config("float16", 128, varlen_q=False)),
]


def _audit(arch, config):
    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    row = audit.audit_target(audit.AuditTarget(config.name, arch, lambda options: bc.compile_kernel(config, options)))
    assert row.error is None, row.error
    assert not row.spills, f"{row.spill_stores}/{row.spill_loads} bytes spilled, SASS {row.sass}"
    return row


@pytest.mark.parametrize("arch,config", MAIN_COMPILED, ids=[f"{a}-{c.name}" for a, c in MAIN_COMPILED])
def test_main_kernel_compiles_without_spills_using_ldgsts_ldsm_hmma(arch, config):
    row = _audit(arch, config)
    for op in ("HMMA", "LDSM", "LDGSTS"):
        assert row.sass[op] > 0, f"no {op} in the SASS: {row.sass}"
    assert row.smem_dynamic is None or row.smem_dynamic >= config.smem_bytes


@pytest.mark.parametrize("arch,config", ROW_KERNELS_COMPILED, ids=[f"{a}-{c.name}" for a, c in ROW_KERNELS_COMPILED])
def test_pre_and_post_kernels_compile_without_spills(arch, config):
    _audit(arch, config)


H200_SMEM = 227 * 1024


@pytest.mark.parametrize("dtype,smem,flags,softcap_tile", [
    ("bfloat16", None, {}, False),
    ("bfloat16", None, {"deterministic": True}, True),  # the 4-warp tile spilled
    ("bfloat16", None, {"causal": True, "deterministic": True}, True),
    ("float16", None, {}, True),
    ("float16", None, {"local": True}, True),
    ("bfloat16", H200_SMEM, {}, False),
    ("bfloat16", H200_SMEM, {"deterministic": True}, True),  # the 8-warp tile spilled
    ("bfloat16", H200_SMEM, {"causal": True, "deterministic": True}, True),
    ("float16", H200_SMEM, {"causal": True}, False),
])
def test_head_dim_256_with_softcap_takes_the_16_row_tile_where_the_others_spilled(dtype, smem, flags, softcap_tile):
    config = bc.make_config(dtype, 256, 256, smem_limit=smem, softcap=True, **flags)
    tile = (config.tile_m, config.tile_n, config.num_warps, config.dq_warps_m, config.col_tiles)
    assert (tile == tuple(bc.SOFTCAP_TILE_256)) == softcap_tile, config.name
    without = bc.make_config(dtype, 256, 256, smem_limit=smem, **flags)
    assert without.tile_m == 32  # never without soft-capping
    # unequal head dims keep their tile
    assert bc.make_config(dtype, 256, 128, softcap=True, **flags).tile_m == 32


@pytest.mark.parametrize("d,dv,dtype,smem,causal,rows", [
    (256, 192, "bfloat16", None, False, 32), (192, 256, "float16", H200_SMEM, True, 32),
    (128, 256, "float16", H200_SMEM, True, 16), (256, 128, "bfloat16", H200_SMEM, False, 16),
])
def test_unequal_head_dims_with_softcap_deterministic_take_the_tiles_that_do_not_spill(d, dv, dtype, smem, causal, rows):
    config = bc.make_config(dtype, d, dv, smem_limit=smem, softcap=True, deterministic=True, causal=causal)
    assert config.tile_m == rows and config.num_warps == (2 if min(d, dv) > 128 else 4), config.name
    # not deterministic: the table's tile
    assert bc.make_config(dtype, d, dv, smem_limit=smem, softcap=True, causal=causal).tile_m == 32
