"""Ring attention over NCCL on every GPU of the machine equals one-GPU attention."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cute_flash
from cute_flash.distributed import ring_attention, shard_sequence

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, causal, layout):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (2, 1024 * world, 8, 128)
        q, k, v, dout = (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref = cute_flash.attention(qf, kf, vf, causal=causal)
        (ref * dout).sum().backward()
        shard = lambda t: shard_sequence(t, rank, world, layout).contiguous()  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, causal=causal, layout=layout)
        (out * shard(dout)).sum().backward()
        # bf16 partials are merged in float32: allow a few bf16 ulps of the output scale.
        for got, want in ((out, ref), (ql.grad, qf.grad), (kl.grad, kf.grad), (vl.grad, vf.grad)):
            want = shard(want).float()
            err = (got.float() - want).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.abs().max().item()), err
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag")])
def test_ring_attention_nccl_equals_one_gpu(causal, layout):
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, _free_port(), causal, layout), nprocs=world, join=True)
