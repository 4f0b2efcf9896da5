"""Where one batch entry's queries and keys live, for fixed-length and variable-length batches.

Fixed-length tensors are (batch, seqlen, heads, d); varlen tensors are (total, heads, d) with
the sequence of batch b at rows [cu_seqlens[b], cu_seqlens[b+1]). `seqused_k` then caps the
number of keys actually used. Offsets are 32-bit token counts; every tensor stride is 64-bit,
so the address arithmetic (token * stride) is done in 64 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SeqlenInfo:
    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    varlen_q: cutlass.Constexpr[bool]
    varlen_k: cutlass.Constexpr[bool]

    @staticmethod
    def create(
        batch_idx: Int32,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
    ) -> "SeqlenInfo":
        varlen_q = mCuSeqlensQ is not None
        varlen_k = mCuSeqlensK is not None
        if cutlass.const_expr(varlen_q):
            offset_q = mCuSeqlensQ[batch_idx]
            seqlen_q = mCuSeqlensQ[batch_idx + 1] - offset_q
        else:
            offset_q = Int32(0)
            seqlen_q = Int32(mQ.shape[1])
        if cutlass.const_expr(varlen_k):
            offset_k = mCuSeqlensK[batch_idx]
            seqlen_k = mCuSeqlensK[batch_idx + 1] - offset_k
        else:
            offset_k = Int32(0)
            seqlen_k = Int32(mK.shape[1])
        if cutlass.const_expr(mSeqUsedK is not None):
            seqlen_k = mSeqUsedK[batch_idx]
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k, varlen_q, varlen_k)

    def q_rows(self, mX: cute.Tensor, batch_idx, head_idx) -> cute.Tensor:
        """(seqlen, d) view of Q or O for one (batch, head)."""
        if cutlass.const_expr(self.varlen_q):
            return cute.domain_offset((self.offset_q, 0), mX[None, head_idx, None])
        return mX[batch_idx, None, head_idx, None]

    def k_rows(self, mX: cute.Tensor, batch_idx, head_idx) -> cute.Tensor:
        """(seqlen, d) view of K or V for one (batch, kv head)."""
        if cutlass.const_expr(self.varlen_k):
            return cute.domain_offset((self.offset_k, 0), mX[None, head_idx, None])
        return mX[batch_idx, None, head_idx, None]

    def lse_row(self, mLSE: cute.Tensor, batch_idx, head_idx) -> cute.Tensor:
        """(seqlen,) view of the LSE: (batch, heads, seqlen) or varlen (heads, total)."""
        if cutlass.const_expr(self.varlen_q):
            return cute.domain_offset((self.offset_q,), mLSE[head_idx, None])
        return mLSE[batch_idx, head_idx, None]
