"""Everything the benchmark times: cute_flash's backends and the peers, behind one interface.

A runner says whether it can run here at all (`unavailable`), whether it can run a given case
(`not_applicable`), and builds, for a case and its inputs, a function that returns the output
as (batch, seqlen_q, nheads, headdim_v). Every runner gets the same tensors: q, k, v as
(batch, seqlen, heads, headdim), a paged cache as (num_pages, page_size, heads_k, headdim) with
its page table; peers whose layout is (batch, heads, seqlen, headdim) get transposed views of
them, not copies. The optional imports happen in `unavailable`, never at module import.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from bench_lib import Case, Provider


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    page_table: Optional[torch.Tensor] = None
    dout: Optional[torch.Tensor] = None


def _first(out):
    """Some interfaces return out, others (out, lse): take out."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _import_error(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as e:  # an installed but broken package is as unusable as a missing one
        return f"`import {module}` failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


class Runner:
    name = "?"
    cute_flash = False
    description = ""

    def unavailable(self) -> Optional[str]:
        return None

    def not_applicable(self, case: Case) -> Optional[str]:
        return None

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, case: Case, x: Inputs) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def provider(self, skipped: Optional[str] = None) -> Provider:
        return Provider(self.name, self.cute_flash, self.description, skipped)


class CuteFlash(Runner):
    """`cute_flash.forward` (`attention` for forward + backward) on one named backend."""

    cute_flash = True

    def __init__(self, backend: str):
        self.name = backend
        self.description = f"cute_flash.forward / attention with backend={backend!r}"

    def _backend(self):
        from cute_flash.backends import get_backend

        return get_backend(self.name)

    def unavailable(self):
        return self._backend().unavailable_reason()

    def not_applicable(self, case):
        b = self._backend()
        needs = {"causal": case.causal, "backward": case.mode == "fwd_bwd", "gqa": case.nheads != case.nheads_k,
                 "paged_kv": case.page_size > 0, "headdim_v": case.dv != case.headdim}
        missing = [f for f, needed in needs.items() if needed and f not in b.features]
        if missing:
            return f"backend lacks {', '.join(missing)}"
        if max(case.headdim, case.dv) > b.max_headdim:
            return f"head dim above the backend's maximum ({b.max_headdim})"
        return None

    def prepare(self, case, x):
        import cute_flash

        if case.mode == "fwd_bwd":
            return lambda: cute_flash.attention(x.q, x.k, x.v, causal=case.causal, backend=self.name)
        paged = x.page_table is not None  # a paged cache needs its longest sequence up front
        return lambda: cute_flash.forward(x.q, x.k, x.v, causal=case.causal, page_table=x.page_table,
                                          max_seqlen_k=case.seqlen_k if paged else None, backend=self.name)


class Sdpa(Runner):
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend (sdpa_kernel)."""

    _BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"sdpa-{kind}"
        self.description = f"PyTorch SDPA, {kind} backend"

    def unavailable(self):
        if not torch.cuda.is_available():
            return "no CUDA device"
        from torch.nn.attention import SDPBackend

        if not hasattr(SDPBackend, self._BACKENDS[self.kind]):
            return f"this torch has no SDPBackend.{self._BACKENDS[self.kind]}"
        return None

    def not_applicable(self, case):
        if case.page_size:
            return "no paged KV cache"
        if self.kind == "efficient" and case.nheads != case.nheads_k:
            return "the efficient kernel does not take enable_gqa (GQA)"
        return None

    def context(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self._BACKENDS[self.kind]))

    def prepare(self, case, x):
        import torch.nn.functional as F

        gqa = {"enable_gqa": True} if case.nheads != case.nheads_k else {}
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **gqa).transpose(1, 2)


_flex_compiled = None


def _flex():
    """One flex_attention compiled with dynamic shapes for the whole run: compiling it afresh for
    every shape costs seconds each, more than all of its measurements together."""
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # Past the recompile limit dynamo would silently run flex_attention eagerly: fail instead.
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
        if hasattr(dynamo_config, "recompile_limit"):
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
            dynamo_config.fail_on_recompile_limit_hit = True
        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Flex(Runner):
    name = "flex"
    description = "FlexAttention, compiled once with dynamic shapes; causal through a block mask"

    def unavailable(self):
        if not torch.cuda.is_available():
            return "no CUDA device"
        return _import_error("torch.nn.attention.flex_attention")

    def not_applicable(self, case):
        return "no paged KV cache" if case.page_size else None

    def prepare(self, case, x):
        from torch.nn.attention.flex_attention import create_block_mask

        mask = None
        if case.causal:
            if case.seqlen_q != case.seqlen_k:
                raise NotImplementedError("bottom-right causal with seqlen_q != seqlen_k")
            mask = create_block_mask(_causal, None, None, case.seqlen_q, case.seqlen_k, device=x.q.device)
        gqa = {"enable_gqa": True} if case.nheads != case.nheads_k else {}
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        flex = _flex()
        return lambda: flex(q, k, v, block_mask=mask, **gqa).transpose(1, 2)


class FlashAttn4(Runner):
    name = "fa4"
    description = "flash-attn-4 (flash_attn.cute); decode with its split-KV heuristic where it has split-KV (not sm_90)"

    def unavailable(self):
        if not torch.cuda.is_available():
            return "no CUDA device"
        return _import_error("flash_attn.cute")

    def prepare(self, case, x):
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        if case.mode == "decode":
            # num_splits=0 asks for its heuristic; its sm_90 kernels have no split-KV and assert.
            splits = 1 if torch.cuda.get_device_capability(x.q.device)[0] == 9 else 0
            if x.page_table is not None:
                return lambda: _first(flash_attn_varlen_func(x.q, x.k, x.v, page_table=x.page_table,
                                                             num_splits=splits))
            return lambda: _first(flash_attn_func(x.q, x.k, x.v, num_splits=splits))
        return lambda: _first(flash_attn_func(x.q, x.k, x.v, causal=case.causal))


class FlashAttn3(Runner):
    name = "fa3"
    description = "FlashAttention-3 (flash_attn_interface)"

    def unavailable(self):
        if not torch.cuda.is_available():
            return "no CUDA device"
        return _import_error("flash_attn_interface")

    def prepare(self, case, x):
        import flash_attn_interface as fa3

        if case.mode == "decode":
            return lambda: _first(fa3.flash_attn_with_kvcache(x.q, x.k, x.v, page_table=x.page_table, num_splits=0))
        return lambda: _first(fa3.flash_attn_func(x.q, x.k, x.v, causal=case.causal))


class FlashAttn2(Runner):
    name = "fa2"
    description = "FlashAttention-2 (flash_attn)"

    def unavailable(self):
        if not torch.cuda.is_available():
            return "no CUDA device"
        if importlib.util.find_spec("flash_attn") is None:
            return "`import flash_attn` failed (not installed)"
        try:
            from flash_attn import flash_attn_func  # noqa: F401
        except Exception as e:
            return f"flash_attn has no FlashAttention-2 build ({type(e).__name__}: {e})"
        return None

    def not_applicable(self, case):
        if case.page_size % 256:
            return "paged KV needs a page size that is a multiple of 256"
        return None

    def prepare(self, case, x):
        import flash_attn

        if case.mode == "decode":
            return lambda: flash_attn.flash_attn_with_kvcache(x.q, x.k, x.v, block_table=x.page_table, num_splits=0)
        return lambda: flash_attn.flash_attn_func(x.q, x.k, x.v, causal=case.causal)


CUTE_FLASH_BACKENDS = ("cute-sm90", "cute-sm80", "triton")
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "fa4", "fa3", "fa2")
ALL = CUTE_FLASH_BACKENDS + PEERS


def make_runner(name: str) -> Runner:
    if name in CUTE_FLASH_BACKENDS:
        return CuteFlash(name)
    if name.startswith("sdpa-"):
        return Sdpa(name[len("sdpa-"):])
    return {"flex": Flex, "fa4": FlashAttn4, "fa3": FlashAttn3, "fa2": FlashAttn2}[name]()
