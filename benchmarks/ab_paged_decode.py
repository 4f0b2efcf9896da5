"""Paged vs contiguous one-token decode on the sm_80 kernels, as CUDA-graph replays (GPU only).

Checks each case against `cute_flash.backends.reference` (float64, on the first few sequences,
with the GPU tests' rule max|out - ref| <= 2 max|ref_in_dtype - ref| + atol), then times one
`cute_flash.forward(..., out=..., backend="cute-sm80")` call captured in a CUDA graph
(`triton.testing.do_bench` median of the replays, CUDA events without Triton) and prints the
bandwidth: K and V read once per KV head plus q and out, as in benchmarks/bench_lib.py.

The defaults are the decode shape of benchmarks/results/nvidia-h200-2026-11-29-decode-graph.md
(bf16, 32 query heads over 8 KV heads, head dim 128), whose cute-sm80 column this reproduces
for page sizes 0 and 64 (no seqused_k, max_seqlen_k given, pages in random order):

    python benchmarks/ab_paged_decode.py
    python benchmarks/ab_paged_decode.py --batches 1 --seqlens 8k --page-sizes 0,64 --num-splits 0,4,8,16,32
    python benchmarks/ab_paged_decode.py --seqused        # pass seqused_k, as a serving loop does

Only the public API is used, so the same file measures another checkout for an A/B:
`PYTHONPATH=/path/to/other/checkout python benchmarks/ab_paged_decode.py --label main`.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from bench_lib import capture_graph, decode_bytes, make_timer, parse_sizes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ATOL = {torch.float16: 2**-10, torch.bfloat16: 2**-7}


def paged_copy(k: torch.Tensor, v: torch.Tensor, page_size: int, gen: torch.Generator):
    """(k_cache, v_cache, page_table): k/v's sequences cut into pages stored in random order."""
    batch, seqlen_k = k.shape[:2]
    pages_per_seq = seqlen_k // page_size
    num_pages = batch * pages_per_seq
    perm = torch.randperm(num_pages, generator=gen, device=k.device)
    caches = []
    for x in (k, v):
        cache = torch.empty(num_pages, page_size, *x.shape[2:], dtype=x.dtype, device=x.device)
        cache[perm] = x.reshape(num_pages, page_size, *x.shape[2:])
        caches.append(cache)
    return caches[0], caches[1], perm.to(torch.int32).view(batch, pages_per_seq)


def check(out, q, k, v, page_table, seqused_k, scale, sequences: int) -> tuple:
    """(passed, max error, bound) of out's first `sequences` sequences against the reference."""
    from cute_flash.backends.base import AttnArgs
    from cute_flash.backends.reference import reference_attention

    n = min(sequences, q.shape[0])
    if page_table is None:
        k, v = k[:n], v[:n]
    args = AttnArgs(softmax_scale=scale, page_table=None if page_table is None else page_table[:n],
                    seqused_k=None if seqused_k is None else seqused_k[:n])
    ref, _ = reference_attention(q[:n], k, v, args, compute_dtype=torch.float64)
    ref_dtype, _ = reference_attention(q[:n], k, v, args, compute_dtype=q.dtype)
    if out[:n].isnan().any():
        return False, math.nan, math.nan
    err = (out[:n].double() - ref).abs().max().item()
    bound = 2 * (ref_dtype.double() - ref).abs().max().item() + ATOL[q.dtype]
    return err <= bound, err, bound


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,128")
    p.add_argument("--seqlens", default="8k,32k", help="keys per sequence")
    p.add_argument("--page-sizes", default="0,16,64,256", help="0 = contiguous cache")
    p.add_argument("--num-splits", default="0", help="0 = the backend's heuristic")
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--nheads-k", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--seqused", action="store_true", help="pass seqused_k (all keys used)")
    p.add_argument("--check-seqs", type=int, default=4, help="sequences checked against the reference")
    p.add_argument("--warmup", type=float, default=10, help="ms")
    p.add_argument("--rep", type=float, default=50, help="ms")
    p.add_argument("--label", default="", help="printed in front of every row (e.g. the checkout)")
    args = p.parse_args(argv)

    import cute_flash

    dtype, dev = DTYPES[args.dtype], "cuda"
    _, timer = make_timer(args.warmup, args.rep)
    scale = args.headdim**-0.5
    print(f"# cute_flash from {cute_flash.__file__}; {torch.cuda.get_device_name()}; {args.dtype}, "
          f"{args.nheads} heads over {args.nheads_k}, d {args.headdim}, seqused_k {args.seqused}")
    print(f"{'label':8} {'batch':>5} {'keys':>6} {'cache':>10} {'splits':>6} {'us':>9} {'TB/s':>6}  check")
    failures = 0
    for batch in parse_sizes(args.batches):
        for seqlen_k in parse_sizes(args.seqlens):
            gen = torch.Generator(device=dev).manual_seed(batch * 7 + seqlen_k)
            q = torch.randn(batch, 1, args.nheads, args.headdim, generator=gen, device=dev, dtype=dtype)
            k = torch.randn(batch, seqlen_k, args.nheads_k, args.headdim, generator=gen, device=dev, dtype=dtype)
            v = torch.randn(batch, seqlen_k, args.nheads_k, args.headdim, generator=gen, device=dev, dtype=dtype)
            seqused_k = torch.full((batch,), seqlen_k, dtype=torch.int32, device=dev) if args.seqused else None
            nbytes = decode_bytes(batch, 1, seqlen_k, args.nheads, args.nheads_k, args.headdim, None,
                                  q.element_size())
            for page_size in parse_sizes(args.page_sizes):
                if page_size and seqlen_k % page_size:
                    continue
                kc, vc, table = (k, v, None) if not page_size else paged_copy(k, v, page_size, gen)
                for splits in parse_sizes(args.num_splits):
                    out = torch.empty_like(q)
                    call = lambda: cute_flash.forward(  # noqa: E731
                        q, kc, vc, page_table=table, max_seqlen_k=seqlen_k if page_size else None,
                        seqused_k=seqused_k, num_splits=splits, out=out, backend="cute-sm80")
                    cache = f"paged {page_size}" if page_size else "contiguous"
                    try:
                        with torch.no_grad():
                            graph, _ = capture_graph(call)
                            out.fill_(float("nan"))  # the replay must write every row again
                            graph.replay()
                            torch.cuda.synchronize()
                            ok, err, bound = check(out, q, kc, vc, table, seqused_k, scale, args.check_seqs)
                            us = timer(graph.replay) * 1e3
                    except Exception as e:  # one failing case is a result, not the end of the run
                        failures += 1
                        print(f"{args.label:8} {batch:>5} {seqlen_k:>6} {cache:>10} {splits:>6}  ERROR "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        continue
                    failures += not ok
                    verdict = f"ok ({err:.2e} <= {bound:.2e})" if ok else f"WRONG ({err:.2e} > {bound:.2e})"
                    tbps = nbytes / (us * 1e-6) / 1e12
                    print(f"{args.label:8} {batch:>5} {seqlen_k:>6} {cache:>10} {splits:>6} {us:>9.1f} "
                          f"{tbps if ok else math.nan:>6.2f}  {verdict}", flush=True)
                    del graph
                del kc, vc, table
                torch.cuda.empty_cache()
            del q, k, v
            torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
