"""Ring attention over NCCL (2 and 4 GPUs) equals one-GPU attention on the full sequence.

The same cases as the gloo test (tests/test_distributed.py): causal or not, contiguous and
zig-zag shards, GQA, a DeviceMesh as the group; here in bf16 on the GPU backend, checking the
output, the LSE and the three gradients.
"""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cute_flash
from cute_flash.distributed import gather_sequence, ring_attention, shard_sequence

pytestmark = pytest.mark.gpu

# (causal, layout, nheads_k, group is a DeviceMesh); the query has 8 heads.
CASES = [(False, "contiguous", 8, False), (True, "contiguous", 2, False), (True, "zigzag", 8, False),
         (False, "zigzag", 2, False), (True, "zigzag", 4, True)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_case(rank, world, causal, layout, nheads_k, use_mesh):
    g = torch.Generator(device="cuda").manual_seed(0)
    seqlen = 1024 * world
    q = torch.randn(2, seqlen, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen, nheads_k, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(2, seqlen, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = cute_flash.attention(qf, kf, vf, causal=causal, return_lse=True)
    (ref * dout).sum().backward()
    shard = lambda t, dim=1: shard_sequence(t, rank, world, layout, dim).contiguous()  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    group = None
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cuda", (world,))
    out, lse = ring_attention(ql, kl, vl, group=group, causal=causal, layout=layout, return_lse=True)
    (out * shard(dout)).sum().backward()
    where = f"rank {rank}, causal={causal}, {layout}, nheads_k={nheads_k}, mesh={use_mesh}"
    # bf16 partials are merged in float32: allow a few bf16 ulps of the output scale.
    for name, got, want in (("out", out, ref), ("dq", ql.grad, qf.grad), ("dk", kl.grad, kf.grad),
                            ("dv", vl.grad, vf.grad)):
        want = shard(want).float()
        err = (got.float() - want).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.abs().max().item()), f"{name} {where}: max error {err}"
    torch.testing.assert_close(lse, shard(ref_lse, 2), atol=1e-3, rtol=1e-4, msg=lambda m: f"lse {where}: {m}")
    shards = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(shards, out.detach().contiguous())
    assert torch.equal(shard(gather_sequence(shards, layout)), out.detach()), where


def _worker(rank, world, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        for case in CASES:
            _check_case(rank, world, *case)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_nccl_equals_one_gpu(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)
