"""The sm_90 forward kernel on the CPU: its configuration table, the choice of configuration for
a call, the WGMMA fragment identities the kernel relies on, and a compile of every shipped
configuration for sm_90a: no spills, HGMMA, UTMALDG and setmaxnreg present."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

from cute_flash.kernels.sm90 import fwd_config as fc  # noqa: E402
from kernel_flag_cases import FLAG_CASES, expected_flags, flags_of


def _clean_sass(config, tmp_path) -> str:
    """The SASS of `config` compiled for sm_90a, asserted free of spills and of serialized WGMMAs
    (skips where the disassembler is not installed)."""
    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    target = audit.AuditTarget(config.name, "sm_90a", lambda options: fc.compile_fwd(config, options))
    row = audit.audit_target(target, keep_dir=tmp_path)
    assert row.error is None and not row.spills, (row.error, row.spill_stores, row.spill_loads)
    assert "instructions are serialized" not in (tmp_path / config.name / "remarks.yaml").read_text()
    return (tmp_path / config.name / "kernel.sass").read_text()


@pytest.mark.parametrize("headdim", fc.TILE_HEADDIMS)
def test_sm90_tile_table_fits_h100_shared_memory_and_registers(headdim):
    config = fc.make_config("bfloat16", headdim, headdim)
    assert config.smem_bytes <= fc.SMEM_LIMIT
    assert config.tile_m == 64 * config.num_consumer_wgs
    consumer, producer = config.registers
    assert 128 * producer + 128 * config.num_consumer_wgs * consumer <= 64 * 1024


@pytest.mark.parametrize("d,tile", [(8, 64), (40, 64), (64, 64), (72, 96), (120, 128), (136, 192), (256, 256)])
def test_sm90_headdims_pad_up_to_the_next_tile(d, tile):
    assert fc.make_config("float16", d, d).head_dim == tile


def test_sm90_config_rejects_impossible_choices():
    with pytest.raises(ValueError, match="264"):
        fc.make_config("float16", 264, 264)
    with pytest.raises(ValueError, match="causal"):
        fc.make_config("float16", 64, 64, causal=True, local=True)
    with pytest.raises(ValueError, match="intra_wg_overlap"):
        fc.make_config("float16", 64, 64, intra_wg_overlap=False, pingpong=True)


@pytest.mark.parametrize("headdim", fc.TILE_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_shipped_tiles_rescale_lazily_and_keep_the_eager_variant_compiled(headdim, causal):
    config = fc.make_config("bfloat16", headdim, headdim, causal=causal)
    assert config.lazy_rescale
    assert config.keep_vote == (headdim in (64, 96, 128))
    # the P·V wait after 16 of a thread's exponentials on head dim 128's tile of short causal
    # sequences (`pv_wait_at`), after the softmax elsewhere
    assert config.pv_wait_at == -1
    short = dict(causal=True, short_sequences=True)
    assert fc.make_config("bfloat16", headdim, headdim, **short).pv_wait_at == (16 if headdim == 128 else -1)
    assert fc.make_config("bfloat16", 128, 128, keep_vote=False, **short).pv_wait_at == -1
    assert fc.make_config("bfloat16", 128, 128, intra_wg_overlap=False, **short).pv_wait_at == -1
    # a padded head dim takes its tile's rescale; an explicit choice wins, and the eager rescale
    # has no vote on kept references
    assert fc.make_config("bfloat16", 40, 40).keep_vote is True
    eager = fc.make_config("bfloat16", 64, 64, lazy_rescale=False)
    assert not eager.lazy_rescale and not eager.keep_vote
    other = replace(config, lazy_rescale=False, **fc.NO_KEEP_VOTE)
    if headdim in (64, 128, 256):
        assert other in fc.shipped_configs()
    eager = [c for c in fc.shipped_configs() if not c.lazy_rescale]
    assert eager and all("eagerrescale" in c.name.split("_") for c in eager)


def test_sm90_profiling_build_needs_the_lse_and_is_named():
    from dataclasses import replace

    base = fc.make_config("bfloat16", 128, 128, causal=True)
    assert replace(base, timeline=True).name.endswith("_timeline")
    with pytest.raises(ValueError, match="timeline"):
        replace(base, timeline=True, has_lse=False)


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_sm90_profiling_build_compiles_without_spills_or_wgmma_serialization(headdim, tmp_path):
    """`Sm90FwdConfig.timeline`: counters that spilled or serialized the WGMMAs would measure a
    different kernel."""
    _clean_sass(replace(fc.make_config("bfloat16", headdim, headdim, causal=True), timeline=True), tmp_path)


def test_sm90_masks_go_through_bit_masks_and_predicates(tmp_path):
    """`mask_bits`: a causal row's limit becomes a bit mask of its elements, which ptxas moves into
    predicates (R2P) instead of comparing every column; the comparisons variant has no R2P and
    more integer compares. Head dim 64 (192 x 128: 32 elements per row and thread)."""
    from sass_loops import sass_opcode_counts

    bits = fc.make_config("bfloat16", 64, 64, causal=True)
    compares = replace(bits, mask_bits=False)
    counts = sass_opcode_counts((bits, compares), fc.compile_fwd, tmp_path)
    assert bits.mask_bits and "cmpmask" in compares.name.split("_")
    assert counts[bits.name]["R2P"] and not counts[compares.name]["R2P"]
    assert counts[compares.name]["ISETP"] - counts[bits.name]["ISETP"] >= 64


def test_sm90_config_is_a_hashable_cache_key_with_distinct_names():
    configs = fc.shipped_configs()
    assert len({c.name for c in configs}) == len(configs) == len(set(configs))


@pytest.mark.parametrize("args,expected", FLAG_CASES)
def test_sm90_call_selects_config_flags(args, expected):
    from cute_flash.backends.cute import CuteSm90Backend

    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    config = CuteSm90Backend().config(q, q, q, torch.empty(1), args)
    assert flags_of(config) == expected_flags(expected)
    assert config.has_lse and not CuteSm90Backend().config(q, q, q, None, args).has_lse


def test_sm90_backend_declares_only_what_it_implements():
    from cute_flash.backends.base import FEATURES
    from cute_flash.backends.cute import CuteSm90Backend

    backend = CuteSm90Backend()
    assert backend.name == "cute-sm90"
    assert backend.features <= set(FEATURES)
    # paged KV, split-KV and the backward run on the sm_80 kernels (the backend's fwd/bwd hand
    # them over); fp32 has no kernel
    assert {"paged_kv", "split_kv", "backward"} <= backend.features and "fp32" not in backend.features


# ------------------------------------------------------------------------------------------------
# WGMMA fragment identities (trace time, no compile)
# ------------------------------------------------------------------------------------------------
def _fragment_mismatches(num_wgs: int, tile_n: int) -> int:
    """Coordinates where the kernel's views disagree with the WGMMA accumulator / A layouts."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from cute_flash.kernels.common.utils import acc_mn_view
    from cute_flash.kernels.sm90.wgmma import acc_as_mma_sync

    bad = []

    def body():
        bf16, K, MN = cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.MN
        wgs = (num_wgs, 1, 1)
        mma_qk = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K, K, Float32, wgs, (64, tile_n))
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, K, MN, Float32, wgs, (64, 128), a_source=warpgroup.OperandSource.RMEM
        )
        cS = cute.make_identity_tensor((64 * num_wgs, tile_n))
        for t in (0, 1, 6, 37, 70, 101, 127) + tuple(128 * w + 45 for w in range(1, num_wgs)):
            warp, lane, wg = t // 32 % 4, t % 32, t // 128
            tScS = mma_qk.get_slice(t).partition_C(cS)
            mn = acc_mn_view(acc_as_mma_sync(tScS))
            # the m64nNk16 accumulator: rows 16 * warp + lane / 4 (+8), column pairs 2 * (lane % 4)
            for r in range(cute.size(mn, mode=[0])):
                for c in range(cute.size(mn, mode=[1])):
                    want = (64 * wg + 16 * warp + lane // 4 + 8 * (r % 2), 8 * (c // 2) + 2 * (lane % 4) + c % 2)
                    if tuple(mn[r, c]) != want:
                        bad.append((t, r, c))
            # P as the register A operand: element i of the A fragment is element i of S
            tOcP = mma_pv.get_slice(t).partition_A(cS)
            for i in range(cute.size(tScS)):
                if tuple(tOcP[i]) != tuple(tScS[i]):
                    bad.append((t, i))

    @cute.jit
    def trace():
        body()

    # the WGMMA atoms check the target arch while tracing: trace through a compile for sm_90a
    cute.compile(trace, options="--gpu-arch sm_90a")
    return len(bad)


@pytest.mark.parametrize("num_wgs,tile_n", [(2, 128), (3, 128), (2, 96), (2, 64)])
def test_sm90_wgmma_accumulator_rows_and_probabilities_as_operand_a(num_wgs, tile_n):
    assert _fragment_mismatches(num_wgs, tile_n) == 0


# ------------------------------------------------------------------------------------------------
# compiles: every shipped configuration, in parallel processes
# ------------------------------------------------------------------------------------------------
def test_sm90_audit_targets_cover_every_shipped_config():
    targets = fc.audit_targets("sm_90a")
    assert [t.name for t in targets] == [c.name for c in fc.shipped_configs()]
    assert fc.audit_targets("sm_80") == []


def test_sm90_every_shipped_config_compiles_without_spills_with_hgmma_tma_and_setmaxnreg(tmp_path):
    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    rows = audit.audit("sm_90a", modules=["cute_flash.kernels.sm90.fwd_config"], keep_dir=tmp_path)
    assert len(rows) == len(fc.shipped_configs())
    problems = []
    for row, config in zip(rows, fc.shipped_configs()):
        if row.error is not None:
            problems.append(f"{row.name}: {row.error}")
            continue
        if row.spills:
            problems.append(f"{row.name}: spills {row.spill_stores}/{row.spill_loads} bytes, SASS {row.sass}")
        # ptxas serializes WGMMAs (a wait after each) when it cannot keep their registers apart
        if "instructions are serialized" in (tmp_path / config.name / "remarks.yaml").read_text():
            problems.append(f"{row.name}: WGMMAs serialized")
        if not (row.sass["HGMMA"] and row.sass["UTMALDG"] and row.setmaxnreg):
            problems.append(f"{row.name}: HGMMA/UTMALDG/setmaxnreg missing: {row.sass}, setmaxnreg={row.setmaxnreg}")
        # the TMA store epilogue, except for varlen batches (predicated stores there)
        if bool(row.sass["UTMASTG"]) == config.varlen_q:
            problems.append(f"{row.name}: UTMASTG count {row.sass['UTMASTG']} with varlen_q={config.varlen_q}")
        # the configuration counts what the CTA takes, so that its limit check refuses what would not launch
        smem = (row.smem_static or 0) + (row.smem_dynamic or 0)
        if row.smem_dynamic is not None and smem != config.smem_bytes:
            problems.append(f"{row.name}: takes {smem} bytes of shared memory, smem_bytes says {config.smem_bytes}")
    assert not problems, "\n".join(problems)


def test_sm90_warmup_of_a_call_compiles_its_k_v_cluster_variant_too(tmp_path, monkeypatch):
    """A dict entry compiles what a call with those flags may run: also the `cluster_kv` kernel
    of calls with an even number of query blocks (causal: enough of them, on one CTA per tile),
    and a causal call's kernel on the tile of short sequences."""
    import warnings

    from cute_flash import backends
    from cute_flash.backends import cute

    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(backends._instances, "cute-sm90", cute.CuteSm90Backend())  # an empty cache
    plain = dict(dtype="bfloat16", head_dim=128, head_dim_v=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA libraries no object file; memory caching works
        report = cute.warmup([plain, {**plain, "causal": True}], backend="cute-sm90", arch="sm_90a")
    configs = [r[0] for r in report]
    single = fc.make_config(**plain)
    causal = fc.make_config(**plain, causal=True)
    causal_cluster = fc.with_cluster_kv(causal, fc.CAUSAL_CLUSTER_MIN_BLOCKS)
    short = fc.make_config(**plain, causal=True, short_sequences=True)
    assert configs == [single, fc.with_cluster_kv(single, 2), causal, short, causal_cluster]
    assert configs[1].cluster_kv and causal_cluster.cluster_kv and not causal_cluster.persistent
    assert (short.tile_m, short.tile_n) == (128, 128) != (causal.tile_m, causal.tile_n)
    assert [r[1] for r in report] == ["compiled"] * 5


@pytest.mark.parametrize("headdim", fc.TILE_HEADDIMS + (40, 120))
def test_sm90_masked_halves_where_key_blocks_are_128_and_masked(headdim):
    """`masked_halves`: causal calls on 128-key blocks (head dims 64 and 128, and those padded to
    them); windows only when asked for; never without a mask, nor on other tiles, where it is
    refused; not on one CTA per tile (head dim 64 with softcap, the causal clusters), where ptxas
    serialized the WGMMAs with it."""
    for flags in ({}, {"causal": True}, {"local": True}):
        config = fc.make_config("bfloat16", headdim, headdim, **flags)
        assert config.masked_halves == (bool(flags.get("causal")) and config.tile_n == 128)
        assert ("halves" in config.name.split("_")) == config.masked_halves
        softcap = fc.make_config("bfloat16", headdim, headdim, softcap=True, **flags)
        assert softcap.masked_halves == (config.masked_halves and softcap.persistent)
    causal = fc.make_config("bfloat16", headdim, headdim, causal=True)
    clustered = fc.with_cluster_kv(causal, fc.CAUSAL_CLUSTER_MIN_BLOCKS)
    assert not (clustered.cluster_kv and clustered.masked_halves)
    assert not fc.make_config("bfloat16", headdim, headdim, causal=True, persistent=False).masked_halves
    causal = fc.make_config("bfloat16", headdim, headdim, causal=True)
    if causal.masked_halves:
        assert replace(causal, masked_halves=False) in fc.shipped_configs()  # the A/B variant
        window = fc.make_config("bfloat16", headdim, headdim, local=True, masked_halves=True)
        assert window in fc.shipped_configs()  # compiled without spills by the audit test
        with pytest.raises(ValueError, match="masked_halves"):
            replace(causal, intra_wg_overlap=False, pingpong=False)
        with pytest.raises(ValueError, match="masked_halves"):
            replace(causal, causal=False)
        with pytest.raises(ValueError, match="masked_halves"):
            replace(causal, persistent=False, tile_counter=False, late_take=False)
    else:
        with pytest.raises(ValueError, match="masked_halves"):
            replace(causal, masked_halves=True)


@pytest.mark.parametrize("headdim", [64, 128])
def test_sm90_masked_halves_issue_64_key_gemms_without_serializing(headdim, tmp_path):
    """The half blocks' S GEMM is an HGMMA of 64 keys next to the whole blocks' 128, and its
    branches leave ptxas's WGMMA pipeline intact (no serialization remark, no spills); without
    `masked_halves` every S GEMM takes 128 keys (at head dim 64, P·V's HGMMAs are 64 wide too).
    Head dim 128 on its tile of short sequences."""
    halves = fc.make_config("bfloat16", headdim, headdim, causal=True, short_sequences=True)
    whole = replace(halves, masked_halves=False)
    hgmma = {}
    for config in (halves, whole):
        sass = _clean_sass(config, tmp_path)
        hgmma[config.masked_halves] = {n: sass.count(f"HGMMA.64x{n}x16") for n in (64, 128)}
    assert hgmma[True][64] > hgmma[False][64] and hgmma[True][128] and hgmma[False][128], hgmma
    if headdim == 128:
        assert hgmma[False][64] == 0, hgmma


@pytest.mark.parametrize("headdim", fc.TILE_HEADDIMS + (120,))
def test_sm90_short_causal_sequences_take_their_own_tile(headdim):
    """`short_sequences`: causal calls (not windowed ones) at head dim 128, and those padded to
    it, take 128 x 128 with the half blocks, the same flags otherwise; every other call keeps its
    tile. `short_sequence_variant` gives the same configuration from the table's."""
    padded = fc.pad_headdim(headdim, fc.TILE_HEADDIMS)
    for flags in ({}, {"causal": True}, {"local": True}, {"causal": True, "softcap": True, "varlen_q": True,
                                                          "varlen_k": True}):
        long = fc.make_config("bfloat16", headdim, headdim, **flags)
        short = fc.make_config("bfloat16", headdim, headdim, short_sequences=True, **flags)
        assert fc.short_sequence_variant(long) == short
        if flags.get("causal") and padded == 128:
            assert (short.tile_m, short.tile_n, short.num_consumer_wgs) == (128, 128, 2) and short.masked_halves
            assert (long.tile_m, long.tile_n, long.num_consumer_wgs) == (192, 80, 3) and not long.masked_halves
            assert replace(short, tile_m=192, tile_n=80, num_consumer_wgs=3, masked_halves=False, pv_wait_at=-1) == long
            assert short.pv_wait_at == 16
            assert short in fc.shipped_configs() or flags.get("softcap")
        else:
            assert short == long
    # on one CTA per tile the half blocks stay off
    grid = fc.make_config("bfloat16", headdim, headdim, causal=True, persistent=False)
    assert not fc.short_sequence_variant(grid).masked_halves


def test_sm90_backend_hints_short_sequences_from_max_seqlen_q():
    """`CuteSm90Backend.tile_hints`: a causal call whose longest sequence has at most
    SHORT_SEQUENCE_ROWS query rows runs the tile of short sequences, packed (varlen) calls by
    their max_seqlen_q; longer ones and calls without a mask keep the table's."""
    import torch

    from cute_flash.backends.base import AttnArgs
    from cute_flash.backends.cute import CuteSm90Backend

    backend = CuteSm90Backend()
    rows = fc.SHORT_SEQUENCE_ROWS
    for seqlen, causal, tile in ((rows, True, (128, 128)), (rows + 1, True, (192, 80)), (rows, False, (192, 80))):
        q = torch.empty(1, seqlen, 4, 128, dtype=torch.bfloat16)
        config = backend.config(q, q, q, None, AttnArgs(0.1, causal=causal))
        assert (config.tile_m, config.tile_n) == tile, (seqlen, causal, config.name)
    q = torch.empty(3 * rows, 4, 128, dtype=torch.bfloat16)
    for longest, tile in ((rows, (128, 128)), (rows + 8, (192, 80))):
        cu = torch.tensor([0, longest, 2 * rows, 3 * rows], dtype=torch.int32)
        args = AttnArgs(0.1, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        config = backend.config(q, q, q, None, args)
        assert (config.tile_m, config.tile_n) == tile and config.varlen_q, config.name


def test_sm90_p_in_smem_is_opt_in_and_counts_its_shared_memory():
    """`p_in_smem` is an A/B option (`make_config` never sets it) whose P slot counts towards the
    227 KB: 192 x 128 fits at head dim 96 with Q and O apart, 192 x 144 only on one CTA per tile."""
    for headdim in fc.TILE_HEADDIMS:
        for causal in (False, True):
            assert not fc.make_config("bfloat16", headdim, headdim, causal=causal).p_in_smem
    base = fc.make_config("bfloat16", 96, 96, causal=True)
    wide = replace(base, tile_n=128, p_in_smem=True, masked_halves=True)
    assert wide.smem_bytes - replace(wide, p_in_smem=False).smem_bytes == 2 * 192 * 128
    assert wide.name.endswith("_psmem") and wide.smem_bytes <= fc.SMEM_LIMIT
    with pytest.raises(ValueError, match="shared memory"):
        replace(base, tile_n=144, p_in_smem=True)
    replace(fc.on_grid(base), tile_n=144, p_in_smem=True)


@pytest.mark.parametrize("headdim,tile_n,causal", [(96, 128, True), (64, 192, False)])
def test_sm90_p_in_smem_feeds_p_v_from_shared_memory_without_spills(headdim, tile_n, causal, tmp_path):
    """With `p_in_smem` every P·V HGMMA reads both operands through descriptors (the shipped
    kernel's take P from registers), P reaches shared memory by stmatrix, and the wider key
    blocks it makes room for on 160 registers compile without spills or serialized WGMMAs (head
    dim 96 with the half blocks; 192 x 128 with P in registers spills there)."""
    import re

    shipped = fc.make_config("bfloat16", headdim, headdim, causal=causal)
    psmem = replace(shipped, tile_n=tile_n, p_in_smem=True,
                    masked_halves=shipped.persistent and causal and tile_n == 128)
    a_operands = {}
    for config in (shipped, psmem):
        sass = _clean_sass(config, tmp_path)
        # P·V's N is the head dim; S = Q Kᵀ's is tile_n (never equal to it here)
        a_operands[config.p_in_smem] = re.findall(rf"HGMMA\.64x{headdim}x16\.F32\.BF16 R\d+, (\w+)", sass)
        if config.p_in_smem:
            assert sass.count("STSM") > (tmp_path / shipped.name / "kernel.sass").read_text().count("STSM")
    assert a_operands[False] and all(a.startswith("R") for a in a_operands[False]), a_operands[False]
    assert a_operands[True] and all(a == "gdesc" for a in a_operands[True]), a_operands[True]


def test_sm90_keep_vote_needs_the_lazy_rescale():
    """`keep_vote` votes on the lazy rescale's kept references: an A/B option on lazy configurations
    only, named in the kernel's name."""
    lazy = fc.make_config("bfloat16", 128, 128)
    assert lazy.lazy_rescale and "keepvote" in replace(lazy, keep_vote=True).name.split("_")
    with pytest.raises(ValueError, match="keep_vote"):
        replace(lazy, lazy_rescale=False, keep_vote=True)


def test_sm90_pv_wait_at_needs_the_keep_vote():
    """`pv_wait_at` places the P·V wait after the keep vote's branches: an A/B option of voting,
    overlapped configurations, within a thread's tile_n / 2 exponentials, named in the kernel's name."""
    voting = fc.make_config("bfloat16", 128, 128, keep_vote=True)
    assert "pvwait8" in replace(voting, pv_wait_at=8).name.split("_")
    for change in ({"keep_vote": False}, {"pv_wait_at": voting.tile_n // 2},
                   {"intra_wg_overlap": False, "pingpong": False}):
        with pytest.raises(ValueError, match="pv_wait_at"):
            replace(voting, **{"pv_wait_at": 8, **change})


@pytest.mark.parametrize("headdim,wait_at", [(128, 16), (96, 0)])
def test_sm90_pv_wait_at_splits_the_exponentials_at_the_wait(headdim, wait_at, tmp_path):
    """With `pv_wait_at` = K both branches of the vote hold a thread's first K exponentials (of
    tile_n / 2) and the row factors' (one per row, on the path that moves references), and one
    P·V wait follows them with the rest; without it the branches hold all of them. No spills.
    Head dim 128 ships K = 16 on its tile of short causal sequences."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import loop_sass

    voting = fc.make_config("bfloat16", headdim, headdim, keep_vote=True, pv_wait_at=-1)
    per_thread, rows = voting.tile_n // 2, 2
    if headdim == 128:  # shipped on the tile of short causal sequences
        assert fc.make_config("bfloat16", headdim, headdim, causal=True, short_sequences=True).pv_wait_at == wait_at
    for config, in_branches in ((voting, per_thread), (replace(voting, pv_wait_at=wait_at), wait_at)):
        body, _ = loop_sass.analyse(_clean_sass(config, tmp_path), headdim // 16 + config.tile_n // 16)
        exps = sum("MUFU.EX2" in inst for inst in body)
        assert exps == 2 * in_branches + (per_thread - in_branches) + rows, (config.name, exps)
        assert sum("WARPGROUP.DEPBAR.LE gsb0, 0x0" in inst for inst in body) == 1, config.name


@pytest.mark.parametrize("headdim,causal", [(64, False), (128, True)])
def test_sm90_keep_vote_shortens_the_key_block_loop_without_spills(headdim, causal, tmp_path):
    """With `keep_vote` a warp whose rows all keep their references runs fewer instructions per key
    block than the lazy rescale does (no max shuffles, selects or factor), through a VOTE.ALL; the
    other path (a row moves its reference) is the lazy rescale's. No spills, no serialized WGMMAs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import loop_sass

    lazy = fc.make_config("bfloat16", headdim, headdim, causal=causal, keep_vote=False)
    shortest = {}
    for config in (lazy, replace(lazy, keep_vote=True)):
        sass = _clean_sass(config, tmp_path)
        body, paths = loop_sass.analyse(sass, headdim // 16 + config.tile_n // 16)
        shortest[config.keep_vote] = min(paths)
        if config.keep_vote:
            assert any("VOTE.ALL" in inst for inst in body)
    assert shortest[True] < shortest[False], shortest
