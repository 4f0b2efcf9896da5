"""Scaling of ring attention: tokens per second per GPU for 1, 2, 4 ... GPUs.

    torchrun --nproc-per-node 4 benchmarks/bench_ring.py --seqlens 32k,64k,128k --causal

Run under torchrun with as many processes as GPUs to measure (one process per GPU, NCCL). For
each total sequence length the sequence is split in zig-zag shards across the ranks and
`ring_attention` forward (and, with --backward, forward + backward) is timed with CUDA events
after warm-up; rank 0 prints one row per length: the world size, milliseconds per call,
tokens/s per GPU, and the achieved TFLOP/s per GPU (FLOPs of DESIGN.md: 4·b·h·s²·d, halved
for causal, times 3.5 with the backward). Launch it once per world size to fill a scaling table;
with one process it also times plain `cute_flash.attention` on the whole sequence (the "plain"
rows), the cost the ring's one-rank overhead is measured against.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Benchmark the checkout this file lives in, installed or not.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cute_flash  # noqa: E402
from cute_flash.distributed import ring_attention  # noqa: E402


def _tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def _time(step, iters: int) -> float:
    """Milliseconds per call of `step` on the slowest rank, after two warm-up calls."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor(start.elapsed_time(end) / iters, device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return ms.item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="32k,64k,128k", help="total sequence lengths, comma-separated")
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--backend", default=None, help="cute_flash backend (default: the GPU's)")
    parser.add_argument("--iters", type=int, default=10)
    a = parser.parse_args(argv)

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"# {torch.cuda.get_device_name()} x {world}, bf16, {a.nheads} heads x {a.headdim}, "
              f"causal={a.causal}, {'fwd+bwd' if a.backward else 'fwd'}")
        print("| GPUs | seqlen | ms | tokens/s per GPU | TFLOP/s per GPU |")
        print("| --- | --- | --- | --- | --- |")
    for seqlen in map(_tokens, a.seqlens.split(",")):
        shape = (1, seqlen // world, a.nheads, a.headdim)
        g = torch.Generator(device="cuda").manual_seed(rank)
        q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=a.backward)
                   for _ in range(3))

        def ring_step():
            out = ring_attention(q, k, v, causal=a.causal, layout="zigzag", backend=a.backend)
            if a.backward:
                out.backward(torch.ones_like(out))

        def plain_step():
            out = cute_flash.attention(q, k, v, causal=a.causal, backend=a.backend)
            if a.backward:
                out.backward(torch.ones_like(out))

        flops = 4 * a.nheads * seqlen * seqlen * a.headdim / (2 if a.causal else 1) * (3.5 if a.backward else 1)
        for label, step in [(str(world), ring_step)] + ([("1 (plain)", plain_step)] if world == 1 else []):
            ms = _time(step, a.iters)
            if rank == 0:
                t = ms / 1e3
                print(f"| {label} | {seqlen} | {ms:.2f} | {seqlen / t / world:,.0f} | {flops / t / world / 1e12:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
