"""Host side of the sm_80 backward: buffers, configuration choice and the three launches.

1. preprocess (`kernels/sm80/bwd_pre.py`): D = rowsum(dO * O) - dlse and LSE * log2(e) (+inf
   where the LSE is -inf), both float32 and shaped like the LSE, and the dQ accumulator cleared;
2. main kernel (`kernels/sm80/bwd.py`): one CTA per (key block, KV head, batch) writes dK and dV
   (summed over the query heads of its GQA group in registers) and adds dQ into a float32
   accumulator (shaped like q with the kernel's padded head dim) with atomics;
3. postprocess (`kernels/sm80/bwd_post.py`): dQ = scale * accumulator, rounded to the dtype.

GQA therefore needs no dK/dV buffers and no reduction pass. The atomic dQ accumulation makes the
order of the fp32 additions, and so the last bits of dQ, vary from run to run; with
`deterministic=True` the key blocks that see a query block add into it one at a time, in order,
through a turn counter per (batch, head, query block), so dQ is the same on every run.

`backward_sm90` is the same three steps with the sm_90 main kernel (`kernels/sm90/bwd.py`: TMA,
WGMMA, warp-specialized). Where that kernel stores dQ flat, in its accumulator's order
(`dq_flat`: fixed-length calls with the dQ writer warp), the accumulator is (batch, head,
padded seqlen, d), which the preprocess clears whole, and the sm_90 postprocess
(`kernels/sm90/bwd_post.py`) puts dQ back in row order (or, with the A/B option `dq_convert`,
the main kernel's own CTAs launched after the key blocks', each query block once the key blocks
that see it have added into it); otherwise the postprocess is the sm_80 one too. Its kernel loads
the LSE and D rows by TMA, whose global strides must be multiples of 16 bytes, so their buffers
here have a row pitch padded to 4 floats (a box must also start 16-byte aligned: the kernel
starts a varlen sequence's up to 3 rows early). With `deterministic=True` its dQ writer warp
takes the same turns, one counter per (batch, head, query block).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .base import AttnArgs, query_sizes
from .cute import _DTYPE_NAMES, cuda_index, kernel_flags
from .kernel_cache import KernelCache

CONFIG_MODULE = "cute_flash.kernels.sm80.bwd_config"
SM90_CONFIG_MODULE = "cute_flash.kernels.sm90.bwd_config"
_cache = None
_sm90_cache = None


def kernel_cache() -> KernelCache:
    """The compile cache of the backward kernels (all three configuration kinds share it)."""
    global _cache
    if _cache is None:
        _cache = KernelCache(config_module=CONFIG_MODULE, sources=("common", "sm80"))
    return _cache


def sm90_kernel_cache() -> KernelCache:
    """The compile cache of the sm_90 main backward kernel and of its flat-dQ postprocess (the
    preprocess, and the postprocess of a row-major dQ accumulator, are the sm_80 ones, in
    `kernel_cache`)."""
    global _sm90_cache
    if _sm90_cache is None:
        _sm90_cache = KernelCache(config_module=SM90_CONFIG_MODULE, sources=("common", "sm90"))
    return _sm90_cache


def configs(q, k, v, dlse, args: AttnArgs, deterministic: bool = False) -> tuple:
    """(preprocess, main, postprocess) configurations for a validated call (the main kernel's tile
    may depend on the shared memory of q's GPU)."""
    return _configs("sm80", _DTYPE_NAMES[q.dtype], q.shape[-1], v.shape[-1], dlse is not None,
                    tuple(kernel_flags(args).items()), deterministic, _smem_optin(q.device))


def sm90_configs(q, k, v, dlse, args: AttnArgs, deterministic: bool = False) -> tuple:
    """(preprocess, main, postprocess) configurations of `backward_sm90` for a validated call;
    NotImplementedError, saying why, for a call its main kernel does not take."""
    if args.page_table is not None:
        raise NotImplementedError("backward with a paged KV cache (page_table) is not implemented")
    from ..kernels.sm90.bwd_config import with_cluster_q

    pre, main, post = _configs("sm90", _DTYPE_NAMES[q.dtype], q.shape[-1], v.shape[-1], dlse is not None,
                               tuple(kernel_flags(args).items()), deterministic)
    # `cluster_q` where the call's key blocks pair up (unmasked calls without varlen: k is (b, s, h, d))
    return pre, with_cluster_q(main, -(-k.shape[1] // main.tile_n) if k.dim() == 4 else 1), post


@functools.lru_cache(maxsize=256)
def _configs(arch: str, dtype: str, head_dim: int, head_dim_v: int, has_dlse: bool, flags: tuple,
             deterministic: bool, smem_limit: Optional[int] = None) -> tuple:
    """(preprocess, main, postprocess) for the call's dtype, head dims and kernel flags, built once
    per such key: a backward asks for them twice (whether the kernel takes the call, then to run
    it). A call the main kernel refuses raises every time (exceptions are not cached)."""
    from ..kernels.sm80 import bwd_config
    from ..kernels.sm90 import bwd_config as sm90_bwd_config

    flags = dict(flags)
    if arch == "sm90":
        main = sm90_bwd_config.make_config(dtype, head_dim, head_dim_v, deterministic=deterministic, **flags)
    else:
        main = bwd_config.make_config(dtype, head_dim, head_dim_v, smem_limit=smem_limit, deterministic=deterministic,
                                      **flags)
    pre, post = pre_post(main, head_dim, head_dim_v, has_dlse)
    return pre, main, post


def pre_post(main, head_dim: int, head_dim_v: int, has_dlse: bool) -> tuple:
    """(preprocess, postprocess) configurations that go with a main backward configuration: the
    preprocess also clears the dQ accumulator, as wide as the main kernel's tile (a flat one,
    `dq_flat`, whole, padded rows included), and the postprocess of a flat one is the sm_90
    kernel's, which puts it back in row order."""
    from ..kernels.sm80 import bwd_config
    from ..kernels.sm90 import bwd_config as sm90_bwd_config

    flat = getattr(main, "dq_flat", False)
    pre = bwd_config.make_pre_config(main.dtype, head_dim_v, varlen_q=main.varlen_q, has_dlse=has_dlse,
                                     dq_accum_cols=main.head_dim, dq_flat=flat)
    post = (sm90_bwd_config.make_post_config(main, head_dim) if flat
            else bwd_config.make_post_config(main.dtype, head_dim, varlen_q=main.varlen_q))
    return pre, post


def _smem_optin(device: torch.device) -> Optional[int]:
    """Shared memory one CTA may opt into on `device`; None off CUDA."""
    if device.type != "cuda":
        return None
    return _smem_optin_of(cuda_index(device))


@functools.lru_cache(maxsize=None)
def _smem_optin_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def check_smem(main, device: torch.device) -> None:
    """NotImplementedError, saying so, when the main kernel's CTA needs more shared memory than
    `device` gives one (the sm_80 kernel above head dim 128 on an sm_86 / sm_89 part)."""
    limit = _smem_optin(device)
    if limit is not None and main.smem_bytes > limit:
        raise NotImplementedError(
            f"the backward kernel {main.name} needs {main.smem_bytes} bytes of shared memory per CTA; "
            f"this GPU gives at most {limit}"
        )


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can read it (unit last stride, 16-byte aligned rows and base),
    else a contiguous copy; an incoming gradient may be an expanded (stride-0) view."""
    elem = t.element_size()
    aligned = t.data_ptr() % 16 == 0 and all(s * elem % 16 == 0 for s in t.stride()[:-1])
    return t if t.stride(-1) == 1 and aligned else t.contiguous()


def _sizes(q, k, args: AttnArgs) -> tuple:
    """(num_batch, max_seqlen_q, max_seqlen_k) of a validated call."""
    num_batch, max_seqlen_q = query_sizes(q, args)
    max_seqlen_k = args.max_seqlen_k if args.cu_seqlens_k is not None else k.shape[1]
    return num_batch, max_seqlen_q, max_seqlen_k


def _without_launch(q, k, dq, dk, dv, args: AttnArgs) -> bool:
    """Zero the gradients no CTA writes; True when that is all there is to do (no query, or no key)."""
    num_batch, max_seqlen_q, max_seqlen_k = _sizes(q, k, args)
    if args.seqused_k is not None or num_batch == 0 or not max_seqlen_q or q.numel() == 0:
        # keys no CTA visits (past seqused_k, or every key when there is no query) get 0
        dk.zero_()
        dv.zero_()
    if num_batch == 0 or not max_seqlen_q or q.numel() == 0:
        return True
    if not max_seqlen_k or k.shape[-3] == 0:
        dq.zero_()  # no key anywhere: every row is fully masked
        return True
    return False


def _run(backend, pre, launch_main, launch_post, q, out, dout, lse, dlse, lse_log2, delta, dq_accum,
         args: AttnArgs, num_batch: int, max_seqlen_q: int) -> None:
    """Preprocess, main kernel, postprocess (`launch_main()`, `launch_post()`, called with q's
    device current), in that order on the current stream of q's device."""
    fn_pre, _ = kernel_cache().get(pre, backend.arch(q.device))
    a = kernel_cache().args
    with a.context(q.device):
        fn_pre(
            a.tensor(out, 16), a.tensor(dout, 16), a.tensor(lse, 4), a.tensor(dlse, 4), a.tensor(lse_log2, 4),
            a.tensor(delta, 4), a.tensor(dq_accum, 16),
            a.tensor(args.cu_seqlens_q, 4), a.i32(num_batch), a.i32(max_seqlen_q), *a.stream(),
        )
        launch_main()
        launch_post()


def _row_post_launcher(backend, post, q, dq_accum, dq, args: AttnArgs, num_batch: int, max_seqlen_q: int):
    """`launch_post` for the sm_80 postprocess (the row-major accumulator's)."""
    fn_post, _ = kernel_cache().get(post, backend.arch(q.device))
    a = kernel_cache().args

    def launch_post():
        fn_post(a.tensor(dq_accum, 16), a.tensor(dq, 16), a.tensor(args.cu_seqlens_q, 4), a.i32(num_batch),
                a.i32(max_seqlen_q), a.f32(args.softmax_scale), *a.stream())

    return launch_post


def _flat_post_launcher(backend, post, q, dq_accum, dq, args: AttnArgs, max_seqlen_q: int):
    """`launch_post` for the sm_90 postprocess of a flat accumulator (`dq_flat`)."""
    fn_post, _ = sm90_kernel_cache().get(post, backend.arch(q.device))
    a = sm90_kernel_cache().args

    def launch_post():
        fn_post(a.tensor(dq_accum, 16), a.tensor(dq, 16), a.i32(max_seqlen_q), a.f32(args.softmax_scale),
                *a.stream())

    return launch_post


def backward(backend, dout, q, k, v, out, lse, dlse, dq, dk, dv, args: AttnArgs, deterministic: bool) -> None:
    """Write dq, dk, dv in place (see the module docstring)."""
    from ..kernels.common.softmax import softmax_constants

    if args.page_table is not None:
        raise NotImplementedError("backward with a paged KV cache (page_table) is not implemented")
    pre, main, post = configs(q, k, v, dlse, args, deterministic)  # raises for head dims the kernel lacks
    check_smem(main, q.device)
    if _without_launch(q, k, dq, dk, dv, args):
        return
    num_batch, max_seqlen_q, max_seqlen_k = _sizes(q, k, args)

    dout = _kernel_ready(dout)
    lse = lse.contiguous()
    dlse = dlse.contiguous() if dlse is not None else None
    lse_log2 = torch.empty_like(lse)
    delta = torch.empty_like(lse)
    dq_accum = torch.empty(*q.shape[:-1], main.head_dim, dtype=torch.float32, device=q.device)  # cleared by `pre`
    # deterministic: one turn counter per (batch, head, query block, column tile)
    dq_sem = (torch.zeros(num_batch, q.shape[-2], -(-max_seqlen_q // main.tile_m) * main.col_tiles,
                          dtype=torch.int32, device=q.device)
              if deterministic else None)

    fn_main, _ = kernel_cache().get(main, backend.arch(q.device))
    scale_log2, softcap_prescale = softmax_constants(args.softmax_scale, args.softcap)
    a = kernel_cache().args

    def launch_main():
        fn_main(
            a.tensor(q, 16), a.tensor(k, 16), a.tensor(v, 16), a.tensor(dout, 16), a.tensor(lse_log2, 4),
            a.tensor(delta, 4), a.tensor(dq_accum, 16), a.tensor(dk, 16), a.tensor(dv, 16),
            a.tensor(args.cu_seqlens_q, 4), a.tensor(args.cu_seqlens_k, 4), a.tensor(args.seqused_k, 4),
            a.tensor(dq_sem, 4), a.i32(num_batch), a.i32(max_seqlen_k), a.f32(args.softmax_scale), a.f32(scale_log2),
            a.f32(softcap_prescale), a.i32(args.window_left), a.i32(args.window_right), *a.stream(),
        )

    launch_post = _row_post_launcher(backend, post, q, dq_accum, dq, args, num_batch, max_seqlen_q)
    _run(backend, pre, launch_main, launch_post, q, out, dout, lse, dlse, lse_log2, delta, dq_accum, args,
         num_batch, max_seqlen_q)


def convert_ctas(device: torch.device, chunks: int) -> int:
    """`dq_convert`: the main kernel's conversion CTAs for `chunks` chunks of dQ to convert (each of
    a CTA's warpgroups takes one at a time, `NUM_CONVERT_GROUPS`): one per SM, or fewer where
    there are fewer chunks than their warpgroups; an even number, for the grid's clusters of two."""
    from ..kernels.sm90.bwd_config import NUM_CONVERT_GROUPS

    wanted = -(-chunks // NUM_CONVERT_GROUPS)
    return max(2, min(_sm_count(cuda_index(device)) // 2 * 2, -(-wanted // 2) * 2))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_row_stats(lse: torch.Tensor) -> torch.Tensor:
    """An uninitialised float32 tensor shaped like `lse` whose rows start 16 bytes apart (the row
    pitch padded to 4 floats), as TMA needs; only the preprocess kernel writes it."""
    n = lse.shape[-1]
    return torch.empty(*lse.shape[:-1], -(-n // 4) * 4, dtype=torch.float32, device=lse.device)[..., :n]


def backward_sm90(backend, dout, q, k, v, out, lse, dlse, dq, dk, dv, args: AttnArgs, deterministic: bool,
                  configs: Optional[tuple] = None) -> None:
    """Write dq, dk, dv in place with the sm_90 main kernel (see the module docstring).
    `configs`: this call's `sm90_configs`, when the caller has them already."""
    from ..kernels.common.softmax import softmax_constants

    # raises for what the kernel lacks
    pre, main, post = configs if configs is not None else sm90_configs(q, k, v, dlse, args, deterministic)
    if pre.dq_flat != main.dq_flat or pre.dq_accum_cols != main.head_dim:
        raise ValueError("configs: the preprocess must clear the main kernel's dQ accumulator, flat or row-major "
                         "(`pre_post` pairs them)")
    if _without_launch(q, k, dq, dk, dv, args):
        return
    num_batch, max_seqlen_q, max_seqlen_k = _sizes(q, k, args)

    # TMA reads dO: a zero (expanded) stride is copied out too
    dout = _kernel_ready(dout if all(dout.stride()[:-1]) else dout.contiguous())
    lse = lse.contiguous()
    dlse = dlse.contiguous() if dlse is not None else None
    lse_log2 = _tma_row_stats(lse)
    delta = _tma_row_stats(lse)
    if main.dq_flat:
        # (batch, head, padded seqlen, d), each query block's floats in accumulator order; its rows
        # a multiple of both kernels' query blocks, all cleared by `pre`
        block = max(main.tile_m, pre.tile_m)
        rows = -(-max_seqlen_q // block) * block
        dq_accum = torch.empty(num_batch, q.shape[-2], rows, main.head_dim, dtype=torch.float32, device=q.device)
    else:
        dq_accum = torch.empty(*q.shape[:-1], main.head_dim, dtype=torch.float32, device=q.device)  # cleared by `pre`
    # deterministic: one turn counter per (batch, head, query block); dq_convert: one count of the
    # key blocks that have added into it
    dq_sem = (torch.zeros(num_batch, q.shape[-2], -(-max_seqlen_q // main.tile_m), dtype=torch.int32, device=q.device)
              if main.deterministic or main.dq_convert else None)
    num_convert_ctas = convert_ctas(q.device, dq_sem.numel() * main.dq_chunks) if main.dq_convert else 0

    fn_main, _ = sm90_kernel_cache().get(main, backend.arch(q.device))
    scale_log2, softcap_prescale = softmax_constants(args.softmax_scale, args.softcap)
    m = sm90_kernel_cache().args

    def launch_main():
        fn_main(
            m.tensor(q, 16), m.tensor(k, 16), m.tensor(v, 16), m.tensor(dout, 16), m.tensor(lse_log2, 16),
            m.tensor(delta, 16), m.tensor(dq_accum, 16), m.tensor(dk, 16), m.tensor(dv, 16),
            m.tensor(args.cu_seqlens_q, 4), m.tensor(args.cu_seqlens_k, 4), m.tensor(args.seqused_k, 4),
            m.tensor(dq_sem, 4), m.tensor(dq if main.dq_convert else None, 16), m.i32(num_batch), m.i32(max_seqlen_k),
            m.i32(num_convert_ctas), m.f32(args.softmax_scale), m.f32(scale_log2), m.f32(softcap_prescale),
            m.i32(args.window_left), m.i32(args.window_right), *m.stream(),
        )

    if main.dq_convert:  # the main kernel's conversion CTAs write dq
        def launch_post():
            pass
    elif main.dq_flat:
        launch_post = _flat_post_launcher(backend, post, q, dq_accum, dq, args, max_seqlen_q)
    else:
        launch_post = _row_post_launcher(backend, post, q, dq_accum, dq, args, num_batch, max_seqlen_q)
    _run(backend, pre, launch_main, launch_post, q, out, dout, lse, dlse, lse_log2, delta, dq_accum, args,
         num_batch, max_seqlen_q)
