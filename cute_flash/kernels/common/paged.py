"""K/V tiles gathered from a paged cache, one row at a time.

A paged cache holds k/v as (num_pages, page_size, heads_k, d); the keys of sequence b are the
first `seqlen_k` rows of the pages page_table[b, 0], page_table[b, 1], ... in that order. A
key tile of `tile_n` rows may span several pages (page_size < tile_n), lie inside one page, or
start in the middle of one (page_size not a multiple of tile_n), so the copy looks up the page
of every row it loads: row r of key block n is token t = n * tile_n + r, held by page
page_table[b, t // page_size] at row t % page_size.

Invariants:
* only the table entries of tokens below `seqlen_k` are read, so a tile never uses a page the
  sequence does not own (entries past the sequence may be garbage or stale);
* rows at or past `seqlen_k` are zero-filled in shared memory instead of copied, so nothing
  stale reaches an MMA (0 * NaN would survive P = 0);
* the address of a row is page * page_stride + offset * row_stride + head * head_stride with
  64-bit strides, so caches larger than 4 GiB are addressed correctly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class PagedKV:
    page_table: cute.Tensor  # (max_pages,) int32: the page table row of this sequence
    page_size: Int32
    seqlen_k: Int32
    tile_n: cutlass.Constexpr[int]

    @staticmethod
    def create(mPageTable: cute.Tensor, batch_idx, mK: cute.Tensor, seqlen_k, tile_n: int) -> "PagedKV":
        return PagedKV(mPageTable[batch_idx, None], Int32(mK.shape[1]), seqlen_k, tile_n)

    @staticmethod
    def capacity(mPageTable: cute.Tensor, mK: cute.Tensor) -> Int32:
        """Keys a sequence holds when no `seqused_k` says otherwise: max_pages * page_size."""
        return Int32(mPageTable.shape[1]) * Int32(mK.shape[1])

    @cute.jit
    def load_tile(
        self,
        tiled_copy: cute.TiledCopy,
        mX: cute.Tensor,  # (num_pages, page_size, heads_k, d)
        head_idx,
        n_block,
        tXsX: cute.Tensor,  # this thread's part of the shared tile ((V, v), M, K)
        tXcX: cute.Tensor,  # its (row, col) coordinates in the tile
        tXpD: Optional[cute.Tensor],  # column predicates (head dim below the tile's), or None
        tidx,
        tile_cols: cutlass.Constexpr[int],  # the tile's (padded) head dim
    ):
        """cp.async key block `n_block` of head `head_idx` into tXsX, gathering rows by page."""
        thr_copy = tiled_copy.get_slice(tidx)
        num_rows = cute.size(tXsX, mode=[1])
        # All table lookups first, unpredicated, so that their latencies overlap instead of each
        # sitting in front of its row's copies. A row past the sequence looks up the sequence's
        # last token instead (an entry it owns; the tile is only loaded when seqlen_k > 0).
        pages = cute.make_rmem_tensor(num_rows, Int32)
        offsets = cute.make_rmem_tensor(num_rows, Int32)
        for m in cutlass.range_constexpr(num_rows):
            token = cutlass.min(n_block * self.tile_n + tXcX[0, m, 0][0], self.seqlen_k - 1)
            pages[m] = self.page_table[token // self.page_size]
            offsets[m] = token % self.page_size
        for m in cutlass.range_constexpr(num_rows):
            if n_block * self.tile_n + tXcX[0, m, 0][0] < self.seqlen_k:
                row = mX[pages[m], offsets[m], head_idx, None]
                # The row seen as a tile whose rows all alias it: partitioning it like the shared
                # tile gives this thread's column vectors at the right offsets.
                gRow = cute.make_tensor(row.iterator, cute.make_layout((self.tile_n, tile_cols), stride=(0, 1)))
                tXgRow = thr_copy.partition_S(gRow)
                for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                    if cutlass.const_expr(tXpD is None):
                        cute.copy(tiled_copy, tXgRow[None, m, k], tXsX[None, m, k])
                    elif tXpD[0, 0, k]:
                        cute.copy(tiled_copy, tXgRow[None, m, k], tXsX[None, m, k])
                    else:
                        tXsX[None, m, k].fill(0)
            else:
                tXsX[None, m, None].fill(0)
