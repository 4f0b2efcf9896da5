"""K/V tiles gathered from a paged cache, with the page lookups done ahead of the copies.

A paged cache holds k/v as (num_pages, page_size, heads_k, d); the keys of sequence b are the
first `seqlen_k` rows of the pages page_table[b, 0], page_table[b, 1], ... in that order. A
key tile of `tile_n` rows may span several pages (page_size < tile_n), lie inside one page, or
start in the middle of one (page_size not a multiple of tile_n), so in general the copy looks
up the page of every row it loads: row r of key block n is token t = n * tile_n + r, held by
page page_table[b, t // page_size] at row t % page_size.

The lookup (`lookup`) and the copy (`load_tile`) are separate steps so that the kernel can
* look up a key block once for its K tile and its V tile (the two copies partition the tile
  the same way whenever K and V rows have the same swizzle atom width), and
* issue the table loads before the wait that precedes the K copy, so that their latency
  overlaps other work instead of stalling the warp right in front of its row's copies.
With `pow2` (page_size a power of two; `make_config` derives it from the page size) t // page_size and
t % page_size are a shift and a mask; otherwise they are an unsigned division.

When page_size is a multiple of tile_n (`make_config` derives that too) no tile crosses a page: key
block n is rows [r, r + tile_n) of one page, so one table entry per block (`lookup_page`, the
same for K and V and for every thread) and a plain tile copy (`load_page_tile`, the contiguous
cache's copy, tail rows zero-filled by count) do.

Invariants:
* only the table entries of tokens below `seqlen_k` are read, so a tile never uses a page the
  sequence does not own (entries past the sequence may be garbage or stale): a lookup clamps
  its tokens to [0, seqlen_k - 1], which also makes a look-ahead past the first block harmless;
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
from cutlass import Int32, Uint32

from .utils import cp_async_tile


@dataclass(frozen=True)
class PagedKV:
    page_table: cute.Tensor  # (max_pages,) int32: the page table row of this sequence
    page_size: Int32
    page_shift: Int32  # log2(page_size) with pow2, else unused
    seqlen_k: Int32
    tile_n: cutlass.Constexpr[int]
    pow2: cutlass.Constexpr[bool]

    @staticmethod
    def create(mPageTable: cute.Tensor, batch_idx, mK: cute.Tensor, seqlen_k, tile_n: int, pow2: bool) -> "PagedKV":
        page_size = Int32(mK.shape[1])
        shift = cute.arch.log2_of_pow2_int(page_size) if cutlass.const_expr(pow2) else Int32(0)
        return PagedKV(mPageTable[batch_idx, None], page_size, shift, seqlen_k, tile_n, pow2)

    @staticmethod
    def capacity(mPageTable: cute.Tensor, mK: cute.Tensor) -> Int32:
        """Keys a sequence holds when no `seqused_k` says otherwise: max_pages * page_size."""
        return Int32(mPageTable.shape[1]) * Int32(mK.shape[1])

    def page_of(self, token):
        """The table index of the page that holds `token` (>= 0)."""
        if cutlass.const_expr(self.pow2):
            return token >> self.page_shift
        # non-negative: unsigned division skips the sign fix-ups of a signed one
        return Int32(Uint32(token) // Uint32(self.page_size))

    def make_page(self) -> cute.Tensor:
        """Register slot for one key block's page, for pages that hold whole tiles."""
        return cute.make_rmem_tensor(1, Int32)

    @cute.jit
    def lookup_page(self, n_block, page: cute.Tensor):
        """For pages that hold whole tiles: the page of key block `n_block` into page[0] (that of
        its first token, clamped like `lookup`'s; nothing waits for the load here)."""
        token = cutlass.max(cutlass.min(n_block * self.tile_n, self.seqlen_k - 1), 0)
        page[0] = self.page_table[self.page_of(token)]

    @cute.jit
    def load_page_tile(
        self,
        tiled_copy: cute.TiledCopy,
        mX: cute.Tensor,  # (num_pages, page_size, heads_k, d)
        head_idx,
        n_block,
        page: cute.Tensor,  # `lookup_page(n_block, ...)`
        tXsX: cute.Tensor,
        tXcX: cute.Tensor,
        tXpD: Optional[cute.Tensor],
        tidx,
        tile_cols: cutlass.Constexpr[int],
        rows,  # rows of the block below seqlen_k, or None when the whole tile is
    ):
        """For pages that hold whole tiles: cp.async key block `n_block` as one tile of its page."""
        token = n_block * self.tile_n
        if cutlass.const_expr(self.pow2):
            row = token & (self.page_size - 1)
        else:
            row = token - self.page_of(token) * self.page_size
        gX = cute.local_tile(mX[page[0], None, head_idx, None], (self.tile_n, tile_cols), (row // self.tile_n, 0))
        cp_async_tile(tiled_copy, tiled_copy.get_slice(tidx).partition_S(gX), tXsX, tXcX, tXpD, rows)

    def make_rows(self, tXsX: cute.Tensor) -> cute.Tensor:
        """Register slots for one key block's page (and, without pow2, row in the page) of every
        row this thread copies; with pow2 the row in the page is a mask of the token, recomputed
        at the copy, which keeps the registers held between lookup and copy to one per row."""
        return cute.make_rmem_tensor((1 if cutlass.const_expr(self.pow2) else 2, cute.size(tXsX, mode=[1])), Int32)

    @cute.jit
    def lookup(self, n_block, tXcX: cute.Tensor, rows: cute.Tensor):
        """Page and row-in-page of this thread's rows of key block `n_block` into `rows`.

        The table loads are not predicated and nothing waits for them here: a row past the
        sequence (or a block before the first, when looking ahead) looks up a clamped token
        that the sequence owns; the kernel calls this only when seqlen_k > 0.
        """
        for m in cutlass.range_constexpr(cute.size(rows, mode=[1])):
            token = n_block * self.tile_n + tXcX[0, m, 0][0]
            token = cutlass.max(cutlass.min(token, self.seqlen_k - 1), 0)
            index = self.page_of(token)
            rows[0, m] = self.page_table[index]
            if cutlass.const_expr(not self.pow2):
                rows[1, m] = token - index * self.page_size

    @cute.jit
    def load_tile(
        self,
        tiled_copy: cute.TiledCopy,
        mX: cute.Tensor,  # (num_pages, page_size, heads_k, d)
        head_idx,
        n_block,
        rows: cute.Tensor,  # `lookup(n_block, ...)` of a copy partitioned like this one
        tXsX: cute.Tensor,  # this thread's part of the shared tile ((V, v), M, K)
        tXcX: cute.Tensor,  # its (row, col) coordinates in the tile
        tXpD: Optional[cute.Tensor],  # column predicates (head dim below the tile's), or None
        tidx,
        tile_cols: cutlass.Constexpr[int],  # the tile's (padded) head dim
    ):
        """cp.async key block `n_block` of head `head_idx` into tXsX from the pages in `rows`."""
        thr_copy = tiled_copy.get_slice(tidx)
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            token = n_block * self.tile_n + tXcX[0, m, 0][0]
            if token < self.seqlen_k:
                offset = token & (self.page_size - 1) if cutlass.const_expr(self.pow2) else rows[1, m]
                row = mX[rows[0, m], offset, head_idx, None]
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

    @cute.jit
    def gather_tile(self, tiled_copy: cute.TiledCopy, mX: cute.Tensor, head_idx, n_block, tXsX: cute.Tensor,
                    tXcX: cute.Tensor, tXpD: Optional[cute.Tensor], tidx, tile_cols: cutlass.Constexpr[int]):
        """`lookup` and `load_tile` back to back, for a copy whose rows nobody looked up ahead."""
        rows = self.make_rows(tXsX)
        self.lookup(n_block, tXcX, rows)
        self.load_tile(tiled_copy, mX, head_idx, n_block, rows, tXsX, tXcX, tXpD, tidx, tile_cols)
