"""Ring attention over gloo (2 and 4 CPU processes) equals single-process attention."""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cute_flash
from cute_flash.distributed import gather_sequence, ring_attention, shard_sequence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_problem(seqlen, nheads, nheads_k, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, seqlen, nheads, 16, generator=g, dtype=dtype)
    k = torch.randn(2, seqlen, nheads_k, 16, generator=g, dtype=dtype)
    v = torch.randn(2, seqlen, nheads_k, 24, generator=g, dtype=dtype)
    dout = torch.randn(2, seqlen, nheads, 24, generator=g, dtype=dtype)
    return q, k, v, dout


CASES = [(False, "contiguous", 4, False), (True, "contiguous", 4, False), (True, "zigzag", 2, False),
         (False, "zigzag", 1, False), (True, "zigzag", 2, True)]


def _worker(rank, world, port):
    """Every case in one process group (process start-up dominates the cost)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for causal, layout, nheads_k, use_mesh in CASES:
            _check_case(rank, world, causal, layout, nheads_k, use_mesh)
        # Every rank done with every group before any leaves.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: its teardown, racing with a peer's, aborts a process
    # now and then ("terminate called without an active exception") after the test has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_case(rank, world, causal, layout, nheads_k, use_mesh):
    seqlen = 8 * world  # 4 tokens per zigzag chunk
    q, k, v, dout = _full_problem(seqlen, 4, nheads_k, torch.float64)
    # Single process, whole sequence.
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = cute_flash.attention(qf, kf, vf, causal=causal, return_lse=True)
    (ref_out * dout).sum().backward()
    # This rank's shard through the ring.
    shard = lambda t, dim=1: shard_sequence(t, rank, world, layout, dim)  # noqa: E731
    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
    group = None
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (world,))
    out, lse = ring_attention(ql, kl, vl, group=group, causal=causal, layout=layout, return_lse=True)
    (out * shard(dout)).sum().backward()
    torch.testing.assert_close(out, shard(ref_out), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, shard(ref_lse, 2), atol=1e-5, rtol=1e-6)
    for got, full in ((ql.grad, qf.grad), (kl.grad, kf.grad), (vl.grad, vf.grad)):
        torch.testing.assert_close(got, shard(full), atol=1e-5, rtol=1e-5)
    # And the shards put back together give the whole output.
    shards = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(shards, out.detach().contiguous())
    torch.testing.assert_close(gather_sequence(shards, layout), ref_out.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_equals_single_process_causal_or_not_gqa_and_mesh(world):
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


def test_shard_and_gather_are_inverse():
    x = torch.arange(2 * 24).view(2, 24)
    for layout in ("contiguous", "zigzag"):
        shards = [shard_sequence(x, r, 3, layout) for r in range(3)]
        assert torch.equal(gather_sequence(shards, layout), x)
    assert shard_sequence(x, 0, 3, "zigzag")[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]


def test_ring_attention_needs_a_process_group():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="process group"):
        ring_attention(q, q, q)


def test_ring_attention_rejects_unknown_layouts():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, layout="striped")
