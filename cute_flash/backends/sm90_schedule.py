"""The sm_90 forward's launch schedule (`cute.py`'s `CuteSm90Backend`): the persistent grid's CTAs,
as many cluster pairs as the GPU runs at once, and the sections of (batch, head) pairs of the
tile order (`kernels/sm90/fwd_sync.tile_coords`)."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .base import AttnArgs
from .base import num_sms as _num_sms
from .base import query_sizes


# K/V bytes a section of the sm_90 forward's tile order may keep in L2 (of 50 MB on an
# H100/H200), shared with everything else in flight; and whether causal / local grids take their
# tiles longest first across a section (False: one head at a time, for A/B).
PERSISTENT_L2_BYTES = 16 << 20
SECTIONED_TILE_ORDER = True


def heads_per_section(config, q, k, args: AttnArgs, num_ctas: Optional[int] = None) -> int:
    """The (batch, head) pairs of one section of the sm_90 forward's tile order
    (`kernels/sm90/fwd_sync.tile_coords`): for causal and local calls, whose tiles go longest first
    across a section, the most consecutive pairs whose K and V fit in `PERSISTENT_L2_BYTES`
    (with `SECTIONED_TILE_ORDER`); for a causal call of `num_ctas` persistent CTAs at least
    `least_causal_section`'s; raised to a size that divides the pairs where one up to twice that
    does (`even_sections`). Otherwise 1, one head at a time (tiles all alike, and neighbouring
    query blocks of a head share its K/V)."""
    if not (SECTIONED_TILE_ORDER and (config.causal or config.local)):
        return 1
    num_batch, max_seqlen_q = query_sizes(q, args)
    nheads = q.shape[-2]
    seqlen_k = args.max_seqlen_k if args.cu_seqlens_k is not None else k.shape[1]
    group = nheads // k.shape[-2]
    kv_bytes_per_head = max(1, seqlen_k * (config.head_dim + config.head_dim_v) * q.element_size() // group)
    pairs = nheads * num_batch
    fit = PERSISTENT_L2_BYTES // kv_bytes_per_head
    if config.causal and num_ctas is not None:
        fit = max(fit, least_causal_section(num_ctas, -(-max_seqlen_q // config.tile_m)))
    return even_sections(pairs, max(1, min(pairs, fit)))


def least_causal_section(num_ctas: int, num_m_blocks: int) -> int:
    """The fewest (batch, head) pairs of a causal section whose work per CTA is at least its
    longest tile: query block i of a head sees about i + 1 key blocks, so a section of p pairs
    holds p * M * (M + 1) / 2 blocks of work, M of them in its longest tiles. With fewer, the
    CTAs that take the last section's longest tiles finish well after the others. On an H200
    (bf16, causal, head dim 96: 192-row blocks, 6 MB of K/V per head at 16k keys, so 2 fit the L2
    budget; the section size set by hand, outputs bitwise equal, three rounds, medians, TFLOP/s):
    1 x 16384 x 16 heads 577.5 with sections of 2, 600.0 of 4 (this rule), 602.9 of 8
    (flash-attn-4 585.5); 21 heads 579.9 of 3, 599.5 of 7 (the rule's 4 raised to divide 21;
    582.1); 1 x 32768 x 16 601.1 of 1, 613.0 of 2 (the rule), 611.4 of 4 (600.1). Twice this many
    measured within the rounds' spread, up or down, at 2k-16k keys (head dim 64 8 x 2048 400.9
    against 392.5, 2 x 8192 485.6 against 475.3, 1 x 16384 498.6 against 500.0; 96 8 x 2048 420.0
    against 430.2; 128 8 x 2048 517.0 against 525.7; five rounds), so the rule stops at one."""
    return -(-2 * num_ctas // (num_m_blocks + 1))


@functools.lru_cache(maxsize=1024)
def even_sections(pairs: int, fit: int) -> int:
    """The smallest section size from `fit` up to 2 * `fit` that divides `pairs`, else `fit`.

    The tile order walks the sections one after the other, each longest first, so a last section
    of few pairs has too few long tiles to keep every SM busy at the end while its longest ones
    run. On an H200 (bf16, causal, head dim 96, 2 x 8192 x 16 heads: 32 pairs of 3 MB of K/V, so
    5 fit the budget, leaving a last section of 2) the SMs were active 87.7% of the kernel's
    cycles (Nsight Compute; flash-attn-4 99.1%), and sections of 8 ran 560.2 TFLOP/s against
    508.4 (three rounds, the outputs bitwise equal; flash-attn-4 about 556). The only other shape
    of those tried that this changes, head dim 96 at 8 x 2048 (sections of 32 instead of 21 of
    128 pairs), measured 409.1 against 418.6, within its rounds' spread (406.8-434.2). Sections
    of up to twice the budget still fit the 50 MB of L2; one section of every pair measured 5-11%
    slower at the other shapes tried (head dims 64, 96, 128 and 256 at 2k-8k;
    `benchmarks/results/nvidia-h200-2026-12-02-causal-sections.md`)."""
    for size in range(fit, min(pairs, 2 * fit) + 1):
        if pairs % size == 0:
            return size
    return fit


# An empty kernel for `max_active_clusters`: the driver JIT-compiles it in a few milliseconds.
_EMPTY_KERNEL_PTX = b""".version 7.8
.target sm_90
.address_size 64
.visible .entry cute_flash_empty() { ret; }
\0"""


@functools.lru_cache(maxsize=None)
def max_active_clusters(device_index: int, cluster_size: int, threads: int, smem_bytes: int) -> Optional[int]:
    """How many clusters of `cluster_size` CTAs, each of `threads` threads and `smem_bytes` of
    shared memory, the GPU runs at once (`cuOccupancyMaxActiveClusters` on an empty kernel of
    that shape: a cluster's CTAs share one GPC, so this can be less than SMs // cluster_size);
    None where the driver cannot say."""
    from cuda.bindings import driver

    def ok(result):
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(result[0]))
        return result[1] if len(result) > 1 else None

    try:
        ok(driver.cuInit(0))
        device = ok(driver.cuDeviceGet(device_index))
        # the device's primary context (torch's), current on this thread for the calls below
        ok(driver.cuCtxPushCurrent(ok(driver.cuDevicePrimaryCtxRetain(device))))
        try:
            module = ok(driver.cuModuleLoadData(_EMPTY_KERNEL_PTX))
            try:
                kernel = ok(driver.cuModuleGetFunction(module, b"cute_flash_empty"))
                ok(driver.cuFuncSetAttribute(
                    kernel, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes))
                config = driver.CUlaunchConfig()
                config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, 1, 1
                config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
                config.sharedMemBytes = smem_bytes
                attr = driver.CUlaunchAttribute()
                attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                value = driver.CUlaunchAttributeValue()
                value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = cluster_size, 1, 1
                attr.value = value
                config.attrs, config.numAttrs = [attr], 1
                clusters = ok(driver.cuOccupancyMaxActiveClusters(kernel, config))
            finally:
                driver.cuModuleUnload(module)
        finally:
            driver.cuCtxPopCurrent()
            driver.cuDevicePrimaryCtxRelease(device)
    except (RuntimeError, ImportError, AttributeError):
        return None
    return int(clusters) if clusters else None


def persistent_schedule(config, q, k, args: AttnArgs, num_sms: Optional[int] = None,
                        num_clusters: Optional[int] = None) -> tuple:
    """(CTAs, heads per section) of a persistent sm_90 forward call: one CTA per SM, never more
    than the tiles, and `heads_per_section`. With `cluster_kv` the CTAs come in pairs (a cluster
    takes two tiles at a time), as many pairs as the GPU runs at once (`num_clusters`; by default
    `max_active_clusters`, or num_sms // 2 where the driver cannot say): a pair that had to wait
    for a free one would walk its fixed share of the tiles after the others are done."""
    num_batch, max_seqlen_q = query_sizes(q, args)
    tiles = -(-max_seqlen_q // config.tile_m) * q.shape[-2] * num_batch
    clustered = getattr(config, "cluster_kv", False)
    if num_sms is None:
        num_sms = _num_sms(q.device)
        if clustered and num_clusters is None and q.is_cuda:
            index = q.device.index if q.device.index is not None else torch.cuda.current_device()
            num_clusters = max_active_clusters(index, 2, config.num_threads, config.smem_bytes)
    if clustered:
        pairs = min(num_sms // 2, num_clusters or num_sms // 2)
        ctas = 2 * max(1, min(tiles // 2, pairs))
    else:
        ctas = max(1, min(tiles, num_sms))
    return ctas, heads_per_section(config, q, k, args, ctas)
