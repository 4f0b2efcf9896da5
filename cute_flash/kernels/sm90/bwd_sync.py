"""How the roles of the sm_90 backward (`bwd.py`) meet: its named barriers, and the walk over
(query head, query block) that the producer, the consumers and the dQ writer warp take in the
same order.

Rotated walks (`rotate_queries`: unmasked calls at head dims 192 and 256): CTA (or cluster) j of
a (KV head, batch)'s p starts its walk at query block j * m_steps / p of its range and wraps
around, instead of every CTA starting at the first. The CTAs of one KV head run side by side, so
without it they all reduce-add their dQ tiles into the same query block at the same time, and at
those head dims (a 64 x 256 fp32 tile is 64 KB) the atomics on the same lines serialise: the
backward ran at 1980 MHz and 629 W, well below the power cap (H200, hd 256, 2 x 8192 x 8 heads:
321 TFLOP/s; rotated 378). At 64 and 128 the shared start measured faster (its Q / dO reads meet
in L2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cutlass import Int32

from .bwd_config import NUM_CONSUMER_WGS

# Named barrier (0 is __syncthreads) of one consumer warpgroup, + its index: its own dS^T rows
# (and K/V tail rows) are written before its WGMMAs read them.
BARRIER_WG = 1
# Named barrier of both consumer warpgroups (`dq_split`): every row of dS^T is written.
BARRIER_BOTH = BARRIER_WG + NUM_CONSUMER_WGS
# Named barriers between a consumer warpgroup (+ its index) and the dQ writer warp (`dq_writer`):
# its dQ tile is written (consumers arrive, the writer waits) / read by the last reduce-add (the
# writer arrives, consumers wait). With `dq_stages` = 2, one of each per warpgroup and tile, the
# EMPTY ones after the four FULL ones (`DqPath.dq_barrier`).
BARRIER_DQ_FULL = BARRIER_BOTH + 1


@dataclass(frozen=True)
class QueryWalk:
    """The steps of a CTA's walk over (query head, query block), which the producer, the consumers
    and the dQ writer take in the same order: query blocks [m_block_min, m_block_min + m_steps) of
    the first query head of the KV head's group, then of the next head; with `m_rot`
    (`rotate_queries`) each head's blocks from the `m_rot`-th on, wrapping around."""

    head_k: Int32  # the CTA's KV head
    group: Int32  # query heads per KV head
    m_block_min: Int32
    m_steps: Int32  # query blocks per head
    m_rot: Optional[Int32] = None  # None: every head's walk from its first block

    @property
    def steps(self):
        return self.m_steps * self.group

    def coords(self, it):
        """(query head, query block) of step `it`."""
        head = self.head_k * self.group + it // self.m_steps
        if self.m_rot is None:
            return head, self.m_block_min + it % self.m_steps
        return head, self.m_block_min + (it % self.m_steps + self.m_rot) % self.m_steps
