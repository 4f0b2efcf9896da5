"""Ring attention across the processes of a torchrun launch, checked against one process.

    torchrun --nproc-per-node 2 examples/ring_attention.py            # CPUs (gloo) or GPUs (nccl)
    torchrun --nproc-per-node 4 examples/ring_attention.py --seqlen 32768 --causal

Each rank builds the same full sequence (same seed), keeps its zig-zag shard, runs
`ring_attention` forward and backward, and compares its shard with attention of the whole
sequence on one device.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import cute_flash
from cute_flash.distributed import ring_attention, shard_sequence


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--nheads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    a = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, a.seqlen, a.nheads, a.headdim, generator=g, device=device, dtype=dtype) for _ in range(3))
    shard = lambda t: shard_sequence(t, rank, world, "zigzag").contiguous()  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))

    start = time.perf_counter()
    out = ring_attention(ql, kl, vl, causal=a.causal, layout="zigzag")
    out.float().square().sum().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    ref = cute_flash.attention(q, k, v, causal=a.causal)
    err = (out.detach().float() - shard(ref).float()).abs().max()
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{world} ranks, seqlen {a.seqlen}, causal={a.causal}: max |ring - single| = {err.item():.3e}, "
              f"forward+backward {seconds * 1e3:.1f} ms (first call, compile included)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
