"""The HIP fallback: attention in Triton, the default on ROCm and selectable on NVIDIA.

The CuTe DSL emits NVIDIA code only; Triton compiles for AMD GPUs too, so ROCm builds of
PyTorch run these kernels (`cute_flash/kernels/triton`). They have the API's semantics, checked
against the reference backend: under `TRITON_INTERPRET=1` on the CPU, and on NVIDIA GPUs
(`backend="triton"`). They have not been run on an AMD GPU; the ROCm tile sizes below are
chosen to fit its 64 KiB of shared memory, not measured.

Triton is an optional dependency (`pip install 'cute-flash[triton]'`): this module imports it
only when a kernel runs, and `unavailable_reason` says when it is missing. Paged KV caches and
split-KV are not implemented here; the API names them when asked.

The backward pass never uses atomics, so it is deterministic whatever `deterministic` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .base import AttnArgs, Backend

_FEATURES = ("causal", "window", "softcap", "gqa", "varlen", "seqused_k", "headdim_v", "return_lse", "backward",
             "fp32")


@dataclass(frozen=True)
class Tiles:
    """Compile-time launch shape of one kernel: rows x keys per program, warps, pipeline depth."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def fwd_tiles(headdim: int, dtype: torch.dtype, hip: bool) -> Tiles:
    """Tiles of the forward (and of the dQ kernel, which walks keys the same way)."""
    if dtype == torch.float32:  # full-precision FMA products: registers, not shared memory, bound it
        return Tiles(64 if headdim <= 128 else 32, 32, 4, 1)
    if hip:
        return Tiles(64, 64 if headdim <= 128 else 32, 4, 1)
    if headdim <= 64:
        return Tiles(128, 64, 4, 3)
    if headdim <= 128:
        return Tiles(128, 64, 8, 3)
    return Tiles(64, 64, 4, 2)


def dkdv_tiles(headdim: int, dtype: torch.dtype, hip: bool) -> Tiles:
    """Tiles of the dK/dV kernel: block_n keys stay resident, block_m rows stream past them."""
    if dtype == torch.float32:
        return Tiles(32, 64 if headdim <= 128 else 32, 4, 1)
    if hip:
        return Tiles(32, 64 if headdim <= 128 else 32, 4, 1)
    if headdim <= 128:
        return Tiles(32, 64, 4, 2)
    return Tiles(32, 32, 4, 2)


def _triton_import_error() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        if exc.name == "triton":
            return "triton is not installed: pip install 'cute-flash[triton]'"
        return f"triton failed to import: {exc}"
    return None


def _row_strides(t: torch.Tensor) -> tuple:
    """(batch, row, head) strides of a (batch, seqlen, heads, d) or packed (total, heads, d) tensor."""
    if t.dim() == 4:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(0), t.stride(1)


def _lse_strides(t: torch.Tensor) -> tuple:
    """(batch, head, row) strides of a (batch, heads, seqlen) or packed (heads, total) tensor."""
    if t.dim() == 3:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(0), t.stride(1)


@dataclass
class _Problem:
    """The sizes of a call and the kernel arguments that every attention kernel shares."""

    batch: int
    nheads: int
    nheads_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    dtype: torch.dtype
    shared: dict

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: AttnArgs, dot_in_fp32: bool) -> "_Problem":
        # Triton 3.6 on Hopper reads shared memory out of bounds in wgmma with 32-wide head-dim
        # tiles (an illegal address at d = 256, dv = 32, also reported upstream for Triton
        # 3.7, triton-lang/triton#11366); NVIDIA GPUs get tiles at least 64 wide, the loads
        # stay masked to the real head dim.
        min_width = 64 if q.is_cuda and torch.version.hip is None else 16
        varlen = args.cu_seqlens_q is not None
        if varlen:
            batch = args.cu_seqlens_q.shape[0] - 1
            seqlen_q = seqlen_k = 0  # per sequence, from cu_seqlens
            max_q = args.max_seqlen_q if args.max_seqlen_q is not None else _longest(args.cu_seqlens_q)
            max_k = args.max_seqlen_k if args.max_seqlen_k is not None else _longest(args.cu_seqlens_k)
        else:
            batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            max_q, max_k = seqlen_q, seqlen_k
        d, dv = q.shape[-1], v.shape[-1]
        if args.softcap > 0:
            qk_pre, qk_post = args.softmax_scale / args.softcap, args.softcap * math.log2(math.e)
        else:
            qk_pre, qk_post = args.softmax_scale * math.log2(math.e), 1.0
        shared = dict(
            CU_SEQLENS_Q=args.cu_seqlens_q,
            CU_SEQLENS_K=args.cu_seqlens_k,
            SEQUSED_K=args.seqused_k,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            qk_pre=qk_pre,
            qk_post=qk_post,
            window_left=args.window_left,
            window_right=args.window_right,
            HEAD_DIM=d,
            HEAD_DIM_V=dv,
            BLOCK_D=_pow2(d, min_width),
            BLOCK_DV=_pow2(dv, min_width),
            IS_VARLEN=varlen,
            HAS_SEQUSED_K=args.seqused_k is not None,
            HAS_LEFT=args.window_left >= 0,
            HAS_RIGHT=args.window_right >= 0,
            HAS_SOFTCAP=args.softcap > 0,
            DOT_IN_FP32=dot_in_fp32,
        )
        return cls(batch, q.shape[-2], k.shape[-2], max_q, max_k, q.dtype, shared)

    @property
    def headdim(self) -> int:
        return max(self.shared["BLOCK_D"], self.shared["BLOCK_DV"])


def _pow2(n: int, minimum: int) -> int:
    """Tile width for a head dim: a power of two (Triton tiles), at least `minimum` (the MMA
    needs 16)."""
    return max(minimum, 1 << (n - 1).bit_length())


def _longest(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


class TritonBackend(Backend):
    """Triton kernels with the API's semantics: the ROCm default, `backend="triton"` elsewhere."""

    name = "triton"
    features = frozenset(_FEATURES)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    # Loads and stores are masked element-wise and Triton specializes on alignment itself, so
    # any element-aligned pointer and any stride work.
    alignment = 1
    stride_multiple = 1

    def unavailable_reason(self) -> Optional[str]:
        return _triton_import_error()

    @staticmethod
    def _dot_in_fp32(dtype: torch.dtype, kernel) -> bool:
        """fp32 inputs multiply in fp32; so does bf16 under the interpreter (its bf16 dot is wrong)."""
        from triton.runtime.interpreter import InterpretedFunction

        return dtype == torch.float32 or (dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction))

    def fwd(self, q, k, v, out, lse, args: AttnArgs) -> None:
        from ..kernels.triton.fwd import attn_fwd

        prob = _Problem.of(q, k, v, args, self._dot_in_fp32(q.dtype, attn_fwd))
        tiles = fwd_tiles(prob.headdim, prob.dtype, torch.version.hip is not None)
        num_m_blocks = _blocks(prob.max_seqlen_q, tiles.block_m)
        grid = num_m_blocks * prob.batch * prob.nheads
        if grid == 0:
            return
        attn_fwd[(grid,)](
            q, k, v, out, lse,
            *_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(out), *_lse_strides(lse),
            nheads=prob.nheads, group=prob.nheads // prob.nheads_k, num_m_blocks=num_m_blocks,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            **prob.shared,
        )

    def bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args: AttnArgs, deterministic: bool) -> None:
        from ..kernels.triton.bwd import attn_bwd_delta, attn_bwd_dkdv, attn_bwd_dq

        prob = _Problem.of(q, k, v, args, self._dot_in_fp32(q.dtype, attn_bwd_dq))
        hip = torch.version.hip is not None
        group = prob.nheads // prob.nheads_k

        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        rows = q.shape[-3]  # seqlen_q, or total_q for packed sequences (whose batch stride is 0)
        delta_batch = 1 if q.dim() == 3 else prob.batch
        delta_block = 64
        num_rows = _blocks(rows, delta_block)
        if num_rows * delta_batch * prob.nheads:
            attn_bwd_delta[(num_rows * delta_batch * prob.nheads,)](
                out, dout, dlse, delta,
                *_row_strides(out), *_row_strides(dout), *_lse_strides(dlse if dlse is not None else lse),
                *_lse_strides(delta),
                nheads=prob.nheads, num_m_blocks=num_rows, seqlen=rows,
                HEAD_DIM_V=prob.shared["HEAD_DIM_V"], BLOCK_M=delta_block, BLOCK_DV=prob.shared["BLOCK_DV"],
                HAS_DLSE=dlse is not None, num_warps=4,
            )

        strides = (*_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(dout), *_lse_strides(lse),
                   *_lse_strides(delta))
        if args.seqused_k is not None:
            # Keys past seqused_k are never visited; their gradient is zero.
            dk.zero_()
            dv.zero_()
        tiles = dkdv_tiles(prob.headdim, prob.dtype, hip)
        num_n_blocks = _blocks(prob.max_seqlen_k, tiles.block_n)
        grid = num_n_blocks * prob.batch * prob.nheads_k
        if grid:
            attn_bwd_dkdv[(grid,)](
                q, k, v, dout, lse, delta, dk, dv, *strides, *_row_strides(dk), *_row_strides(dv),
                nheads_k=prob.nheads_k, group=group, num_n_blocks=num_n_blocks, softmax_scale=args.softmax_scale,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                **prob.shared,
            )

        tiles = fwd_tiles(prob.headdim, prob.dtype, hip)
        num_m_blocks = _blocks(prob.max_seqlen_q, tiles.block_m)
        grid = num_m_blocks * prob.batch * prob.nheads
        if grid:
            attn_bwd_dq[(grid,)](
                q, k, v, dout, lse, delta, dq, *strides, *_row_strides(dq),
                nheads=prob.nheads, group=group, num_m_blocks=num_m_blocks, softmax_scale=args.softmax_scale,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                **prob.shared,
            )
