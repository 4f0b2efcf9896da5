"""The CuTe DSL backends: pick a kernel configuration, compile it once, launch it.

`cute-sm80` (cp.async + ldmatrix + mma.sync; any NVIDIA GPU from sm_80 on, compiled for the
GPU's own arch) and `cute-sm90` (TMA + WGMMA, warp-specialized; compute capability 9.0) differ
only in their kernel package (`kernels/sm80`, `kernels/sm90`), each of which provides a frozen
config dataclass (`make_config`), `compile_fwd` and `shipped_configs`.

Compiled kernels are cached in memory and on disk, and launched through TVM-FFI or the DSL's
own path (`kernel_cache.py`); the sm_90 forward's grid and tile order are `sm90_schedule.py`'s.

Sequence lengths, batch, heads, strides, the scale and the window sizes are run-time
arguments, so one compiled kernel serves every shape of its configuration.
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import time
from typing import Iterable, Optional

import torch

from . import pack_gqa
from .base import AttnArgs, Backend
from .base import num_sms as _num_sms
from .base import query_sizes
from .kernel_cache import KernelArgs, KernelCache, cache_dir, device_arch
from .sm90_schedule import heads_per_section, persistent_schedule

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def kernel_flags(args: AttnArgs) -> dict:
    """The compile-time mask and sequence flags of a call, as every kernel config takes them:
    causal is the window (-1, 0); any other window is `local`."""
    causal = args.causal and args.window_left < 0
    return dict(
        causal=causal,
        local=args.has_window and not causal,
        softcap=args.softcap > 0,
        varlen_q=args.cu_seqlens_q is not None,
        varlen_k=args.cu_seqlens_k is not None,
        seqused_k=args.seqused_k is not None,
    )


@functools.lru_cache(maxsize=4096)
def _make_config(config_module: str, *args, **flags):
    """`make_config` of a kernel package, once per distinct call key (a decode step builds its
    split and unsplit configurations this way without the dataclass checks on every call)."""
    return importlib.import_module(config_module).make_config(*args, **flags)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, the current one for a device given without."""
    return device.index if device.index is not None else torch.cuda.current_device()


# `CuteBackend.tile_counter`: the counters kept, one per (device, stream) that launched last; a
# stream past them gets a new zeroed one when it comes back (a process that makes a stream per
# request would otherwise keep a counter for each).
MAX_TILE_COUNTERS = 64


def _stream_key(device: torch.device) -> tuple:
    """(device index, handle of the device's current stream); (device type, 0) off CUDA, where
    only the launch-argument tests build launches."""
    if device.type != "cuda":
        return device.type, 0
    index = cuda_index(device)
    return index, torch.cuda.current_stream(index).cuda_stream


class _CuteBackend(Backend):
    """What the CuTe backends share: configuration, cache, launch. Subclasses name the kernels."""

    features = frozenset({"causal", "window", "softcap", "gqa", "varlen", "seqused_k", "headdim_v", "return_lse"})
    # Decode with GQA as one CTA per KV head (backends/pack_gqa.py); only where it has been
    # checked on a GPU.
    pack_gqa_decode: bool = False
    # The forward kernels take a page table and split-KV partials (backends/split_kv.py).
    inference_kernels: bool = False
    config_module: str = ""
    sources: tuple = ()

    def __init__(self):
        self.cache = KernelCache(self.config_module, self.sources)
        self._reasons: dict = {}  # device index -> `unavailable_reason`
        # (device index, stream handle) -> `tile_counter`'s tensor, the most recent last
        self._tile_counters: collections.OrderedDict = collections.OrderedDict()

    def _gpu_reason(self) -> Optional[str]:
        """Why this GPU cannot run the kernels, or None."""
        raise NotImplementedError

    def arch(self, device: Optional[torch.device] = None) -> str:
        return device_arch(device)

    def unavailable_reason(self) -> Optional[str]:
        """Found once per current device (every call is validated against it)."""
        if not torch.cuda.is_available() or torch.version.hip is not None:
            return "needs an NVIDIA GPU"
        index = torch.cuda.current_device()
        if index not in self._reasons:
            self._reasons[index] = self._find_unavailable_reason()
        return self._reasons[index]

    def _find_unavailable_reason(self) -> Optional[str]:
        reason = self._gpu_reason()
        if reason is not None:
            return reason
        try:
            import cutlass.cute  # noqa: F401
        except ImportError as exc:
            return f"nvidia-cutlass-dsl is not importable ({exc})"
        return None

    def config(self, q, k, v, lse, args: AttnArgs, **flags):
        """The frozen kernel configuration that runs this (validated) call; `flags`: more
        `make_config` flags (`split_kv=True` for the kernel that writes split-KV partials)."""
        return _make_config(
            self.config_module,
            _DTYPE_NAMES[q.dtype],
            q.shape[-1],
            v.shape[-1],
            **kernel_flags(args),
            **flags,
            has_lse=lse is not None,
            **({"page_size": k.shape[1]} if args.page_table is not None else {}),
            **self.tile_hints(q, args),
        )

    def shape_variants(self, config) -> list:
        """`config` and the configurations a call of its flags may take instead, depending on its
        shape (what `warmup` compiles for a dict of `make_config` arguments)."""
        return [config]

    def tile_hints(self, q, args: AttnArgs) -> dict:
        """Arguments of the kernel package's `make_config` that pick a tile from the call's shape."""
        return {}

    def launch_extra(self, config, q, k, args: AttnArgs, a: KernelArgs) -> tuple:
        """The (converted) arguments a plain forward kernel of this backend takes after the
        window sizes."""
        return ()

    def fwd(self, q, k, v, out, lse, args: AttnArgs, workspace: Optional[tuple] = None) -> None:
        """`workspace`: optional (o_partial, lse_partial) float32 buffers for split-KV, shaped as
        `split_kv.partial_shapes` says (e.g. kept by a CUDA graph); allocated when None."""
        # kernels built with paged/split KV take their extra arguments
        inference = self.inference_kernels
        if args.page_table is not None and not inference:
            raise NotImplementedError(f"backend {self.name!r} does not implement: paged_kv")
        if args.num_splits > 1 and not inference:
            raise NotImplementedError(f"backend {self.name!r} does not implement: split_kv")
        num_batch, max_seqlen_q = query_sizes(q, args)
        if num_batch == 0 or not max_seqlen_q or q.numel() == 0:
            return
        if (k.shape[0] if args.cu_seqlens_k is not None else k.shape[1]) == 0:
            # No key anywhere: every row is fully masked (and a TMA descriptor cannot
            # describe an empty tensor).
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
            return
        if self.pack_gqa_decode and pack_gqa.packable(q, k, args) and (lse is None or lse.is_contiguous()):
            q, out, lse, args, workspace = pack_gqa.pack(q, k, out, lse, args, workspace)
        config, arch = self.config(q, k, v, lse, args), self.arch(q.device)
        if not inference:
            fn, _ = self.cache.get(config, arch)
            a = self.cache.args
            self.launch(fn, q, k, v, out, lse, args, a, extra=self.launch_extra(config, q, k, args, a))
            return
        from . import split_kv

        page_table = args.page_table
        if page_table is not None and page_table.stride(-1) != 1:
            page_table = page_table.contiguous()
        # The split kernel's configuration comes from make_config too: its tile may differ from
        # the unsplit one's (hd256 with a mask), and the splits, the kernel and the combine
        # must all count key blocks of that tile. A call that asks for one split, or leaves it
        # to a heuristic this backend does not run, never splits (`split_kv.num_splits`).
        heuristic = "split_kv" in self.features
        splits = 1
        if args.num_splits > 1 or (args.num_splits == 0 and heuristic):
            split_config = self.config(q, k, v, None, args, split_kv=True)
            splits = split_kv.num_splits(q, k, args, split_config, heuristic=heuristic)
        a = self.cache.args
        if splits == 1:
            fn, _ = self.cache.get(config, arch)
            self.launch(fn, q, k, v, out, lse, args, a, extra=(a.tensor(page_table, 4), None, None, a.i32(1)))
            return
        o_partial, lse_partial = split_kv.partials(q, v, args, splits, workspace)
        fn, _ = self.cache.get(split_config, arch)
        self.launch(fn, q, k, v, out, None, args, a,
                    extra=(a.tensor(page_table, 4), a.tensor(o_partial, 16), a.tensor(lse_partial, 4), a.i32(splits)))
        combine, _ = self.combine_cache.get(split_kv.combine_config(out, lse, args, split_config), arch)
        split_kv.launch_combine(combine, o_partial, lse_partial, out, lse, k, args, self.combine_cache.args)

    def bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args: AttnArgs, deterministic: bool) -> None:
        if "backward" not in self.features | self.unverified:
            raise NotImplementedError(f"backend {self.name!r} has no backward kernel yet")
        from .cute_bwd import backward  # the sm_80 kernels (preprocess, main, postprocess)

        backward(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args, deterministic)

    def backward_refusal(self, q, k, v, args: AttnArgs, deterministic: bool) -> Optional[str]:
        from .cute_bwd import check_smem, configs

        try:
            check_smem(configs(q, k, v, None, args, deterministic)[1], q.device)
        except NotImplementedError as exc:
            return str(exc)
        return None

    @staticmethod
    def launch(fn, q, k, v, out, lse, args: AttnArgs, a: KernelArgs, extra: tuple = ()) -> None:
        """Run a compiled forward kernel on the current stream of q's device; `a` converts the
        arguments for the kernel's launch path, `extra` are the (converted) arguments the
        kernel takes after the window sizes: paged/split-KV ones (sm_80 inference kernels) or
        the grid size and tile-order section (sm_90, `launch_extra`)."""
        from ..kernels.common.softmax import softmax_constants

        num_batch, max_seqlen_q = query_sizes(q, args)
        scale_log2, softcap_prescale = softmax_constants(args.softmax_scale, args.softcap)
        with a.context(q.device):
            fn(
                a.tensor(q, 16), a.tensor(k, 16), a.tensor(v, 16), a.tensor(out, 16), a.tensor(lse, 4),
                a.tensor(args.cu_seqlens_q, 4), a.tensor(args.cu_seqlens_k, 4), a.tensor(args.seqused_k, 4),
                a.i32(num_batch), a.i32(max_seqlen_q), a.f32(scale_log2), a.f32(softcap_prescale),
                a.i32(args.window_left), a.i32(args.window_right), *extra, *a.stream(),
            )


class CuteSm80Backend(_CuteBackend):
    """cp.async + ldmatrix + mma.sync kernels: any NVIDIA GPU from sm_80 on."""

    name = "cute-sm80"
    config_module = "cute_flash.kernels.sm80.fwd_config"
    sources = ("common", "sm80")
    # Paged KV, split-KV, packed-GQA decode and the backward (deterministic too) are checked on an
    # H200 by tests/gpu/test_paged_split_sm80.py and tests/gpu/test_bwd_sm80.py.
    features = _CuteBackend.features | {"paged_kv", "split_kv", "backward"}
    inference_kernels = True
    pack_gqa_decode = True

    def __init__(self):
        super().__init__()
        # built with the backend, not at import: a cache reads CUTE_FLASH_TVM_FFI when it is made
        self.combine_cache = KernelCache("cute_flash.kernels.combine_config", (".", "common", "sm80"))

    def tile_hints(self, q, args: AttnArgs) -> dict:
        """`short_queries` (at most SHORT_QUERY_ROWS per sequence) and, on a GPU, `few_query_tiles`:
        fewer (sequence, head, 256-row block) tiles than SMs, so that a ping-pong tile
        (PINGPONG_TILES) would leave SMs idle where UNMASKED_TILES' 128 rows give each two CTAs."""
        from ..kernels.sm80.fwd_config import PINGPONG_TILES, SHORT_QUERY_ROWS

        num_batch, max_seqlen_q = query_sizes(q, args)
        hints = {"short_queries": max_seqlen_q is not None and max_seqlen_q <= SHORT_QUERY_ROWS}
        if q.is_cuda and max_seqlen_q:
            rows = max(t.tile_m for t in PINGPONG_TILES.values())
            tiles = num_batch * q.shape[-2] * -(-max_seqlen_q // rows)
            hints["few_query_tiles"] = tiles < _num_sms(q.device)
        return hints

    def shape_variants(self, config) -> list:
        """`config` and, for a ping-pong configuration, the tile its calls with few query tiles
        keep (`without_pingpong`)."""
        from ..kernels.sm80.fwd_config import without_pingpong

        return list(dict.fromkeys([config, without_pingpong(config)]))

    def _gpu_reason(self) -> Optional[str]:
        major, _ = torch.cuda.get_device_capability()
        if major < 8:
            return f"needs compute capability 8.0 or newer; this GPU is {major}.x"
        return None


class CuteSm90Backend(_CuteBackend):
    """TMA + WGMMA, warp-specialized kernels: NVIDIA Hopper (compute capability 9.0)."""

    name = "cute-sm90"
    config_module = "cute_flash.kernels.sm90.fwd_config"
    sources = ("common", "sm90")
    # The forward features, checked on an H200 by tests/gpu/test_fwd_sm90.py for the head dims
    # below. A paged cache or an explicit split-KV runs the sm_80 kernels (`fwd`), and so does a
    # backward the sm_90 backward kernel does not take (`bwd`): those kernels are valid sm_90
    # code, and tests/gpu/test_paged_split_sm80.py and tests/gpu/test_bwd_sm80.py check them, and
    # this route, on an H200.
    features = _CuteBackend.features | {"paged_kv", "split_kv", "backward"}
    verified_headdims = frozenset({64, 96, 128, 192, 256})

    # One-token GQA decode on the sm_80 kernels too, which split the keys and pack the query heads
    # of a KV group (the sm_90 kernel does neither). On an H200 (bf16, 32 query heads over 8 KV
    # heads, head dim 128, CUDA-graph replays) that takes batch 16 with 32k keys from 1.52 to
    # 4.30 TB/s and batch 1 with 8k keys from 0.36 to 1.28 TB/s.
    decode_on_sm80_kernels: bool = True

    def config(self, q, k, v, lse, args: AttnArgs, **flags):
        """As the base class's, with `cluster_kv` where the call's shape allows it (`with_cluster_kv`:
        no window, no varlen, an even number of query blocks or, unmasked, of (batch, head) pairs,
        with a causal mask enough query blocks)."""
        from ..kernels.sm90.fwd_config import with_cluster_kv

        config = super().config(q, k, v, lse, args, **flags)
        num_batch, max_seqlen_q = query_sizes(q, args)
        return with_cluster_kv(config, -(-max_seqlen_q // config.tile_m), num_batch * q.shape[-2])

    def tile_hints(self, q, args: AttnArgs) -> dict:
        """`short_sequences`: every sequence has at most SHORT_SEQUENCE_ROWS query rows (causal
        calls then take SHORT_CAUSAL_TILES where it has their head dim)."""
        from ..kernels.sm90.fwd_config import SHORT_SEQUENCE_ROWS

        _, max_seqlen_q = query_sizes(q, args)
        return {"short_sequences": max_seqlen_q is not None and max_seqlen_q <= SHORT_SEQUENCE_ROWS}

    def shape_variants(self, config) -> list:
        """`config`, its variant on the tile of short sequences (`short_sequence_variant`) and,
        where a call with enough query blocks in pairs takes it, its K/V-cluster variant
        (`with_cluster_kv`)."""
        from ..kernels.sm90.fwd_config import CAUSAL_CLUSTER_MIN_BLOCKS, short_sequence_variant, with_cluster_kv

        return list(dict.fromkeys([config, short_sequence_variant(config),
                                   with_cluster_kv(config, CAUSAL_CLUSTER_MIN_BLOCKS)]))

    def launch_extra(self, config, q, k, args: AttnArgs, a: KernelArgs) -> tuple:
        """The persistent grid's size (ignored by the one-CTA-per-tile kernels, which take it all
        the same), the tile order's section (`persistent_schedule`, `heads_per_section`) and,
        with `tile_counter`, a zeroed int32 tile counter (`tile_counter`; None otherwise).
        Refuses a K/V-cluster configuration for an odd number of query blocks where its CTA
        pairs do not cover them (`takes_lone_tiles`; `with_cluster_kv` never picks it)."""
        if getattr(config, "cluster_kv", False):
            from ..kernels.sm90.fwd_config import takes_lone_tiles

            num_batch, max_seqlen_q = query_sizes(q, args)
            pairs = num_batch * q.shape[-2]
            if -(-max_seqlen_q // config.tile_m) % 2 and not takes_lone_tiles(config, pairs):
                raise ValueError(f"config {config.name} pairs query blocks (cluster_kv), but seqlen_q "
                                 f"{max_seqlen_q} makes an odd number of {config.tile_m}-row blocks, which it "
                                 f"covers only unmasked in the persistent loop for an even number of (batch, "
                                 f"head) pairs (here {pairs})")
        if not getattr(config, "persistent", False):
            return (a.i32(1), a.i32(heads_per_section(config, q, k, args)), None)
        counter = self.tile_counter(q.device) if config.tile_counter else None
        return tuple(a.i32(x) for x in persistent_schedule(config, q, k, args)) + (a.tensor(counter, 4),)

    def tile_counter(self, device: torch.device) -> torch.Tensor:
        """The zeroed int32 tile counter of a `tile_counter` launch on the current stream.

        The kernel's last atomic add sets the counter back to 0, so one counter per (device,
        stream) serves every call queued on that stream, one after the other, with no fill
        before each; calls on other streams run at the same time and take counters of their
        own. While a CUDA graph is being captured a call takes a new one instead, zeroed by a
        node of the graph on every replay: graphs captured on one stream may be replayed on
        several at once. The `MAX_TILE_COUNTERS` streams that launched last keep theirs; an
        older one's memory goes back to the caching allocator, which gives it again only to
        work queued on that stream after its last launch."""
        if _capturing():
            return torch.zeros(1, dtype=torch.int32, device=device)
        key = _stream_key(device)
        counter = self._tile_counters.get(key)
        if counter is None:
            counter = self._tile_counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
            if len(self._tile_counters) > MAX_TILE_COUNTERS:
                self._tile_counters.popitem(last=False)
        else:
            self._tile_counters.move_to_end(key)
        return counter

    def fwd(self, q, k, v, out, lse, args: AttnArgs, workspace: Optional[tuple] = None) -> None:
        if (args.page_table is not None or args.num_splits > 1
                or (self.decode_on_sm80_kernels and pack_gqa.packable(q, k, args))):
            from . import get_backend

            return get_backend("cute-sm80").fwd(q, k, v, out, lse, args, workspace)
        return super().fwd(q, k, v, out, lse, args, workspace)

    # The sm_90 backward kernel (kernels/sm90/bwd.py: TMA, WGMMA, warp-specialized) for the calls
    # it takes (`native_backward_takes`: head dims up to 256, equal for Q and V or a column-split
    # pair, deterministic or not), the sm_80 kernels for the others. With its dQ partials added by TMA
    # reduce-adds it is the faster of the two on an H200 (b2 x 4096 x 16 heads, hd128, bf16:
    # 1.40 vs 4.17 ms, causal 0.86 vs 2.24 ms, with the dQ column split and the writer warp).
    # Set False on an instance to run every backward on the sm_80 kernels.
    native_backward: bool = True

    def native_backward_takes(self, q, k, v, args: AttnArgs, deterministic: bool) -> bool:
        """Whether `bwd` runs this call on the sm_90 backward kernel."""
        return self._native_configs(q, k, v, None, args, deterministic) is not None

    def _native_configs(self, q, k, v, dlse, args: AttnArgs, deterministic: bool) -> Optional[tuple]:
        """The sm_90 backward's (pre, main, post) configurations for this call, or None where
        `native_backward` is off or its kernel does not take the call."""
        if not self.native_backward:
            return None
        from .cute_bwd import sm90_configs

        try:
            return sm90_configs(q, k, v, dlse, args, deterministic)
        except NotImplementedError:
            return None

    def bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args: AttnArgs, deterministic: bool) -> None:
        configs = self._native_configs(q, k, v, dlse, args, deterministic)
        if configs is not None:
            from .cute_bwd import backward_sm90

            return backward_sm90(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args, deterministic, configs)
        from . import get_backend

        get_backend("cute-sm80").bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, args, deterministic)

    def backward_refusal(self, q, k, v, args: AttnArgs, deterministic: bool) -> Optional[str]:
        if self.native_backward_takes(q, k, v, args, deterministic):
            return None
        from . import get_backend

        return get_backend("cute-sm80").backward_refusal(q, k, v, args, deterministic)

    def _gpu_reason(self) -> Optional[str]:
        cc = torch.cuda.get_device_capability()
        if cc != (9, 0):
            return f"needs compute capability 9.0 (sm_90a); this GPU is {cc[0]}.{cc[1]}"
        return None

    def arch(self, device: Optional[torch.device] = None) -> str:
        return "sm_90a"


def warmup(configs: Iterable, backend: Optional[str] = None, arch: Optional[str] = None) -> list:
    """Compile (or load from the disk cache) kernel configurations ahead of the first call.

    `configs` holds config dataclasses of the backend's kernels, or dicts of `make_config`
    arguments, e.g. `{"dtype": "bfloat16", "head_dim": 128, "head_dim_v": 128, "causal": True}`.
    On cute-sm90 a dict also compiles the configuration's K/V-cluster variant where the call's
    shape may pick it (`with_cluster_kv`: calls with an even number of query blocks and no window,
    causal ones with enough of them), and a causal one's variant on the tile of short sequences
    (`short_sequence_variant`: calls of at most SHORT_SEQUENCE_ROWS query rows per sequence).
    `backend` is "cute-sm80" or "cute-sm90" (default: the current GPU's cute backend); `arch`
    defaults to the current GPU's. Returns one (config, source, seconds) per configuration,
    source being "memory", "disk" or "compiled".
    """
    from . import get_backend

    chosen = get_backend(backend or "cute")
    module = importlib.import_module(chosen.config_module)
    arch = arch or chosen.arch()
    report = []
    for entry in configs:
        todo = chosen.shape_variants(module.make_config(**entry)) if isinstance(entry, dict) else [entry]
        for config in todo:
            start = time.perf_counter()
            _, source = chosen.cache.get(config, arch)
            report.append((config, source, time.perf_counter() - start))
    return report


def _warm_one(backend: str, config, arch: str) -> tuple:
    from . import get_backend

    start = time.perf_counter()
    _, source = get_backend(backend).cache.get(config, arch)
    return source, time.perf_counter() - start


def main(argv=None) -> int:
    """`python -m cute_flash.backends.cute [--backend cute-sm80|cute-sm90] [--arch A] [--jobs N]`:
    fill the disk cache with every shipped forward configuration, compiling in parallel."""
    import argparse
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from . import get_backend

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--backend", default="cute", choices=["cute", "cute-sm80", "cute-sm90"])
    parser.add_argument("--arch", default=None, help="DSL arch name; default: the current GPU's")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    opts = parser.parse_args(argv)
    chosen = get_backend(opts.backend)
    arch = opts.arch or chosen.arch()
    configs = importlib.import_module(chosen.config_module).shipped_configs()
    start = time.perf_counter()
    with ProcessPoolExecutor(max(1, opts.jobs), mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_warm_one, [chosen.name] * len(configs), configs, [arch] * len(configs)))
    for config, (source, seconds) in zip(configs, results):
        print(f"{config.name:70s} {arch:8s} {source:9s} {seconds:6.1f} s")
    print(f"{len(configs)} configurations in {time.perf_counter() - start:.1f} s; cache: {cache_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
