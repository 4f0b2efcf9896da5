"""Compile-time configuration of the sm_90 forward kernel: the key of the compile cache.

`Sm90FwdConfig` holds every choice that changes the generated code; sequence lengths, batch,
heads, strides, the actual head dims inside a padded tile, the scale and the window sizes are
run-time arguments, so one compiled kernel serves every shape of its configuration.

Tile table (keyed by the padded max(head_dim, head_dim_v)). Each consumer warpgroup owns 64
query rows, so tile_m = 64 * consumer warpgroups. Register budget per consumer thread (fp32
unless noted): acc_O = 64 * dv / 128, acc_S = 64 * tile_n / 128, P = half of acc_S (packed
16-bit); with the intra-warpgroup overlap S of the next block and P of the current one are live
together. Shared memory: Q (reused for O; apart from it in a persistent configuration) + stages
* tile_n * (d + dv) elements, within the H100/H200's 227 KB. Head dims 64, 96 and 128 are
persistent (one CTA per SM walking the tiles, `fwd.py`); with a causal mask the CTAs take their
tiles from a counter (`tile_counter`), because tiles of unequal length taken by a fixed stride
leave some SMs with much more work than others. At 64, softcap with a causal mask or a window
spilled at 160 registers with that loop (with the lazy rescale; eager, only the window with
varlen still spills), and so does 96 with seqused_k (140 B): those take one CTA per tile.
192 / 256 are not persistent (Q and O apart do not fit at 256).

Causal schedules of the same kernel on an H200 (bf16, 16k tokens, hidden 2048, do_bench,
TFLOP/s in two rounds; `benchmarks/ab_sm90_fwd.py` times them as `lazy`, `stride` and `grid`): hd128 2k counter 521 / 513, fixed stride 460 /
449, one CTA per tile 500 / 486; hd64 2k 392 / 384, 369 / 371, 359 / 358; at 8k and 16k the
counter and the grid are level (hd128 8k 614 vs 620) and the fixed stride trails (518).

| hd  | tile_m x tile_n | consumer WGs | stages | regs (consumer / producer) | ping-pong |
| --- | --------------- | ------------ | ------ | -------------------------- | --------- |
| 64  | 192 x 128       | 3            | 2      | 160 / 32                   | yes       |
| 96  | 192 x 112       | 3            | 2      | 160 / 32                   | yes       |
| 128 | 192 x 80        | 3            | 2      | 160 / 32                   | yes       |
| 192 | 128 x 96        | 2            | 2      | 240 / 24                   | yes       |
| 256 | 128 x 64        | 2            | 2      | 240 / 24                   | no        |

Ping-pong (named barriers handing the GEMM-issue turn from one consumer warpgroup to the next)
pays when the softmax of a block is long next to its GEMMs; with tile_n 64 and head dim 256 the
GEMMs dominate and the warpgroups are left to run freely. At head dim 192 (tile_n 96) it pays:
on an H200 (bf16, 8 heads, seven interleaved rounds, medians, TFLOP/s; O bitwise equal) causal
2 x 8192 671.8 against 654.5, 8 x 2048 511.1 against 497.1 (510-519 against 482-506), without
a mask 8 x 2048 647.8 against 636.4, 2 x 8192 level (715.7 / 715.9). The intra-warpgroup
overlap is on everywhere. With dv > 128, O is rescaled while the next S = Q Kᵀ runs, before P·V
is issued (`rescale_o_before_pv`, as flash-attn-4's sm90 kernel does). At hd 256, tile_n 80
(226 KB of shared memory) measured below 64 on an H200: 716.5 vs 741.7 TFLOP/s without causal,
654.1 vs 677.6 causal (benchmarks/ab_sm90_fwd.py, 2 x 8192 x 16 heads, bf16).

Head dim 96 takes three consumer warpgroups on 192 x 112 (192 x 128 spills at 160 registers),
as flash-attn-4 takes 192 rows there: on an H200 (bf16, 21 heads, three interleaved rounds,
TFLOP/s) 2 x 8192 602-608 against 556-557 on the former 128 x 128 tile with K/V clusters
(flash-attn-4 591-629), 8 x 2048 540-569 against 515-521, causal 2 x 8192 510-537 against
508-525; 192 x 96 measured 592-595 / 509-536 / 532-533, three K/V stages 601-609.

Head dim 128 takes three consumer warpgroups on 192 x 80 too (192 x 96 spilled 48 B at 160
registers, 192 x 112 192 B, 192 x 128 336 B; 80 and 64 compile without). On an H200 (bf16, 16
heads, `benchmarks/ab_sm90_fwd.py --head-dims 128 --rounds 5 --variants 128x128,...`, medians,
TFLOP/s, the former 128 x 128 tile of two warpgroups / 192 x 80 / flash-attn-4, each with the
K/V clusters where the call takes them): 2 x 6144 666.8 / 714.3 / 661.5, 4 x 4096 653.6 / 674.4
/ 645.4, 1 x 12288 679.8 / 724.8 / 671.4, 1 x 16384 685.5 / 721.2 / 681.8, and where the odd
number of 192-row blocks leaves the call without clusters 8 x 2048 629.8 / 629.9 / 610.1, 2 x
8192 676.1 / 676.7 / 672.8; causal (the tile counter; 1 x 16384 on the causal clusters) 2 x 6144
611.5 / 651.5 / 572.0, 2 x 8192 630.4 / 658.6 / 614.2, 1 x 16384 673.2 / 689.9 / 624.8, but 8 x
2048 534.3 / 522.2 / 512.2. 192 x 64 measured 696.7 at 2 x 6144 with clusters, causal 644.9 /
526.5 / 656.2 / 682.7 at 2 x 6144, 8 x 2048, 2 x 8192, 1 x 16384. Causal calls of short
sequences keep 128 x 128 (`SHORT_CAUSAL_TILES`). (These numbers with the P·V wait after 16
exponentials, `pv_wait_at`, which 192 x 80 no longer takes.) Three K/V stages (223 KB) measured
level in one run of five rounds (`--variants s3,cluster s3`): 2 x 8192 674.3 against 675.7, 2 x
6144 with the clusters 707.5 against 710.3, causal 2 x 8192 653.2 against 635.4 (spread 600-666).

`lazy_rescale` (on in every configuration `make_config` builds; the eager variants are shipped
for A/B only): a row keeps its old maximum as the exp
reference while the new one exceeds it by at most `LAZY_RESCALE_LOG2` (P <= 2^8), and a warp
skips the rescale of its O rows when none of them changed reference (see `common/softmax.py`).
Measured on an H200 (2 x 8192, bf16, causal): +3.8 % at hd 128 (577 -> 600 TFLOP/s), +2.5 % at
hd 256. At hd 64 O is 32 registers per thread, and the selects and the vote that decide whether
to skip its 32 FMULs cost more than the FMULs (the loop is 421 SASS instructions per block
eager, 435 lazy): eager ran 0.1-2.5 % faster in 11 of 12 cells of two runs (32 heads, 2 x 8192,
8 x 2048 and 1 x 16384, causal and not, five interleaved rounds each), so hd 64 rescaled eagerly
until `keep_vote` took those selects off the common path (below).

`keep_vote` (head dims 64, 96 and 128): with the lazy rescale, each warp first tests every row of
its lanes against the row's kept reference, from the lane's own maximum, and votes; when all
keep (most blocks), the rows skip the quad's max shuffles, the factor's exponential and the
selects, and only when one moves its reference does the warp take the lazy rescale's full path.
The output is the lazy rescale's bit for bit. One trip around the key-block loop on the path
that keeps every reference (SASS, bf16, no mask): hd 64 382 instructions against 421 eager,
hd 96 362 against 385, hd 128 400 against 421, hd 192 343 against 362, hd 256 275 against 298.
On an H200 (`benchmarks/ab_sm90_fwd.py --variants keepvote --rounds 3`, bf16, medians, TFLOP/s,
the shipped kernel before first): hd 64 2 x 8192 524.0 / 534.1, causal 492.0 / 504.0, 1 x 16384
532.6 / 541.1, causal 507.6 / 520.0, 8 x 2048 475.3 / 477.4, causal 404.8 / 403.1; hd 96 2 x
8192 592.1 / 607.5, causal 574.9 / 579.9, 8 x 2048 537.2 / 552.0, causal 440.9 / 447.7. At hd
128 it was slower in every case (2 x 8192 644.1 / 635.1, with the K/V clusters that calls take
666.2 / 639.1, causal clusters 620.0 / 615.8; 1 x 16384 clusters 674.1 / 655.6) and at 192 and
256 within the rounds' spread (-1.3 % to +1.8 %), so it is off there.

`pv_wait_at` (16 on head dim 128's 128 x 128 tile, now that of short causal sequences; on 192 x
80, where a thread has 40 exponentials per block, the wait after the softmax measured level or
ahead: `--variants "pvwait end,pvwait24,pvwait32" --rounds 7`, 16 / end / 24 / 32, 2 x 8192 674.4
/ 687.1 / 678.0 / 697.8, causal 650.3 / 658.7 / 650.9 / 645.3, 2 x 6144 with the K/V clusters
698.4 / 700.1 / 707.3 / 700.3, causal 1 x 16384 on the causal clusters 672.4 / 677.2 / 671.0; in a
run of five rounds 2 x 8192 675.7 / 699.6, causal 635.4 / 664.9): with the vote's branches, ptxas
kept the wait for the P·V GEMM in flight below their merge, after all of a block's exponentials,
where the lazy rescale's single path had it after 17 of them; with all exponentials after the
branches it went before them. So at 128 the branches hold a thread's first 16 of its 64
exponentials, the wait follows their merge and the other 48 follow the wait, one code for both
paths (the row sums are then added in two blocks, which may round the LSE differently by an ulp or
two; the output matched bitwise in the tests' cases). On an H200 (`benchmarks/ab_sm90_fwd.py
--head-dims 128 --rounds 7 --variants "no keepvote,cluster,cluster no keepvote"`, bf16, 16 heads,
medians, TFLOP/s, against the lazy rescale without the vote): 2 x 8192 654.5 / 642.4, with the K/V
clusters 662.7 / 666.1; 8 x 2048 592.7 / 592.3, clusters 615.7 / 613.1; 1 x 16384 660.4 / 652.6,
clusters 678.2 / 665.3; causal 2 x 8192 619.7 / 614.9, causal clusters 626.1 / 617.3; in two
earlier runs (three and five rounds) 16 exponentials before the wait led 0, 8, 12, 20 and 24 at
128 in most cases. At 64 and 96 (0 to 16 before the wait) and at 192 and 256 (as `keepvote
pvwaitK`) no placement led the shipped kernels beyond the rounds' spread.

`masked_halves` (causal calls on 128-key blocks in the persistent loop: head dim 64, and 128 on
its 128 x 128 tile of short causal sequences, on which the numbers below were measured; but not
on one CTA per tile -- head dim 64 with softcap, the causal K/V clusters -- where ptxas
serialized the WGMMAs with it; a window's right edge can take it too, `local=True`, untimed): each
consumer warpgroup owns 64 query rows, so on the diagonal it may see only the first half of a key
block, or none of it, while the CTA's other rows see all of it. Such a warpgroup runs that block's
S = Q Kᵀ as a 64-key GEMM and its P·V over those 64 keys (k blocks 0-3 of 8), and when it sees no
key of the first block it skips the block's GEMMs and softmax. Of the warpgroup-blocks computed
at 2k keys that is 2.9% of the GEMM work at head dim 128 (128 x 128 tiles: the first half of each
query block's diagonal) and 7.6% at 64 (192 x 128: 5.0% of the blocks are not seen at all);
10% / 18.5% at 512. On an H200 (bf16, causal, `benchmarks/ab_sm90_fwd.py --variants whole
--rounds 3`, 16k tokens, medians, TFLOP/s, against the same kernel without it): hd64 32 x 512
217.2 against 202.4, 16 x 1024 298.4 against 280.5, 4 x 4096 450.8 against 438.8; hd128 321.2
against 317.6, 435.8 against 428.6, 582.6 against 577.3. An earlier form without the skip of
unseen first blocks measured level at 8 x 2048 (hd64 390.2 / 392.6, hd128 535.3 / 530.4) and
2 x 8192 (499.0 / 496.8, 624.2 / 624.8; hd128 there on the causal K/V clusters, which do not
take it now).
`p_in_smem` (P·V reading P from shared memory, as flash-attn-4 runs head dim 96) is an A/B option
that `make_config` does not set: on an H200 (bf16, `benchmarks/ab_sm90_fwd.py --rounds 3`) it
cost 2-8% on the shipped tiles, and the wider key blocks it makes room for at 160 registers
(192 x 128 at head dim 96, 192 x 192 at 64) won back at most that: hd96 2 x 8192 593.3 on
192 x 128 against 596.7, causal 518.4 (with the half blocks) against 526.5; 8 x 2048 549.2
against 543.3, causal 436.8 against 424.7; hd64 2 x 8192 508.6 on 192 x 192 against 527.7.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..common.tiles import SM90_STATIC_SMEM_BYTES, check_attention_config, pad_headdim

TILE_HEADDIMS = (64, 96, 128, 192, 256)
DTYPES = ("float16", "bfloat16")


class Tile(NamedTuple):
    tile_m: int
    tile_n: int
    num_consumer_wgs: int
    num_stages: int  # depth of the K and V rings in shared memory
    pingpong: bool
    persistent: bool = False  # one CTA per SM walking the tiles (Q and O apart in shared memory)
    lazy_rescale: bool = True  # see `Sm90FwdConfig.lazy_rescale` and the module docstring
    keep_vote: bool = False  # with the lazy rescale: see `Sm90FwdConfig.keep_vote`
    pv_wait_at: int = -1  # with the keep vote (and the overlap): see `Sm90FwdConfig.pv_wait_at`


TILES = {
    64: Tile(192, 128, 3, 2, True, persistent=True, keep_vote=True),
    96: Tile(192, 112, 3, 2, True, persistent=True, keep_vote=True),
    128: Tile(192, 80, 3, 2, True, persistent=True, keep_vote=True),
    192: Tile(128, 96, 2, 2, True),
    256: Tile(128, 64, 2, 2, False),
}

# Causal calls whose sequences have at most SHORT_SEQUENCE_ROWS query rows (`make_config`'s
# `short_sequences`, from the call's max_seqlen_q) take these tiles instead at their head dims:
# there the diagonal's share of the key blocks is large, and 128 x 128 with the half blocks led
# 192 x 80 on an H200 (bf16, 16 heads, causal, `benchmarks/ab_sm90_fwd.py --head-dims 128
# --causal-only --variants 128x128 --rounds 5`, medians, TFLOP/s, 128 x 128 / 192 x 80 /
# flash-attn-4): 16 x 1024 429.8 / 364.0 / 393.3, 8 x 2048 520.0 / 500.7 / 495.9 (an earlier
# run 534.3 / 522.2 / 512.2), 4 x 4096 586.5 / 577.4 / 555.1; at 2 x 6144 192 x 80 leads
# (651.5 against 611.5).
SHORT_SEQUENCE_ROWS = 4096
SHORT_CAUSAL_TILES = {128: Tile(128, 128, 2, 2, True, persistent=True, keep_vote=True, pv_wait_at=16)}

# setmaxnreg budgets (consumer, producer) per number of consumer warpgroups: the totals
# (128 * producer + 128 * wgs * consumer) stay within the 64K registers of an SM.
REGISTERS = {2: (240, 24), 3: (160, 32)}

SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class Sm90FwdConfig:
    dtype: str  # "float16" | "bfloat16"
    head_dim: int  # padded tile head dim of Q and K
    head_dim_v: int  # padded tile head dim of V and O
    tile_m: int
    tile_n: int
    num_consumer_wgs: int
    num_stages: int
    intra_wg_overlap: bool = True  # issue S(n-1) = Q K^T before the softmax of block n
    pingpong: bool = True  # named barriers order the GEMMs of the consumer warpgroups
    causal: bool = False
    local: bool = False  # sliding window (causal is not local)
    softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_k: bool = False
    has_lse: bool = True
    # keep a row's max unless it grows by > LAZY_RESCALE_LOG2 (make_config: per tile, `Tile`)
    lazy_rescale: bool = True
    # Rescale O while S = Q Kᵀ of the next block runs, before P·V is issued, instead of after
    # P·V is waited for: the FMULs of a wide O then overlap the QK GEMM (make_config: dv > 128)
    rescale_o_before_pv: bool = False
    # One CTA per SM walks the tiles (`FlashFwdSm90`'s tile order): the next tile's Q and K/V
    # loads overlap this tile's epilogue, whose O then has its own shared memory (not Q's).
    persistent: bool = False
    # A persistent CTA takes its tiles from a global counter, longest first, instead of a fixed
    # stride (make_config: causal): tiles of unequal length then end together.
    tile_counter: bool = False
    # With `tile_counter` (make_config: wherever it is on): the producer's atomic add that takes
    # the CTA's next tile is issued after the current tile's loads (the last of which waits for
    # the consumers to be about `num_stages` key blocks from its end) instead of before them.
    # Taken before, the next tile is decided when the current one starts: the CTAs that start a
    # section's longest tiles take the next longest at once as their second, instead of the
    # tiles going to the CTAs that come free first. On an H200 (bf16, causal,
    # `benchmarks/ab_sm90_fwd.py --causal-only --variants "late take" --rounds 3`, TFLOP/s,
    # medians, against the add before the loads): 8 x 2048 hd64 415.8 / 410.2, hd96 451.7 /
    # 449.5, hd128 537.1 / 527.8; 2 x 8192 499.8 / 495.2, 592.1 / 584.7, 639.1 / 629.1;
    # 1 x 16384 hd64 517.7 / 513.4, hd96 614.2 / 603.6.
    late_take: bool = False
    # A profiling build (`benchmarks/fwd_timeline.py`; `make_config` never sets it): each tile
    # writes a record over the LSE of its first 32 query rows (tiles with fewer rows in their
    # sequence write none), which is then no LSE; O is unchanged. As int32s: 0 the SM, 1 the key
    # blocks, 2-6 the low 32 bits of the global nanosecond timer when the tile starts, its Q is
    # in, its first key block is done, its last one is done and its epilogue is done; then per
    # consumer warpgroup (8 + 8w) the SM clock cycles of thread 0 of the warpgroup, summed over
    # the tile's later key blocks, in each of the `TIMELINE_PHASES` phases of a block -- waiting
    # for K, waiting for its GEMM-issue turn (ping-pong), issuing S and P·V (and waiting for V),
    # waiting for S, the softmax, waiting for P·V, and O's rescale with P's conversion -- and
    # their count.
    timeline: bool = False
    # Clusters of two CTAs on neighbouring query blocks of one (batch, head) share its K and V:
    # each CTA loads half of every K/V tile by TMA multicast into both, which halves the K/V
    # reads from L2 (`with_cluster_kv`: calls without a window, varlen or seqused_k, with an even
    # number of query blocks -- unmasked persistent ones an odd number too, for an even number of
    # (batch, head) pairs -- on tiles of 80 keys or more; causal ones on one CTA per tile).
    cluster_kv: bool = False
    # Causal, window and key-tail masks of a row through a bit mask of its elements, which ptxas
    # turns into predicates seven at a time (R2P; `AttentionMask.apply`), instead of one integer
    # comparison per element (False: for A/B; the sm_80 forward keeps the comparisons, see
    # `AttentionMask.by_bits`). At head dim 64 causal 2729 -> 2673 SASS
    # instructions (ISETP 211 -> 92). On the H200 (bf16, causal, interleaved rounds, TFLOP/s):
    # hd64 8 x 2048 median 386.5 against 381.4 (5 rounds), hd96 2 x 8192 532-542 against 528-533
    # (3 rounds), hd128 level (8 x 2048 519.1 / 519.8, 2 x 8192 598.2 / 604.2, 5 rounds).
    mask_bits: bool = True
    # With a causal mask (or a window): a consumer warpgroup whose 64 rows see none of the second
    # half of a key block's keys (the diagonal's, the window's right edge, the key tail) issues
    # that block's S = Q Kᵀ and P·V over its first 64 keys only, and nothing, softmax included,
    # for a first block they see no key of (`FlashFwdSm90.keys_seen`); the mask hides those
    # scores anyway. On 128-key blocks of the persistent loop with the intra-warpgroup overlap.
    masked_halves: bool = False
    # P·V with P from shared memory (an SS WGMMA) instead of registers (A/B only; `make_config`
    # never sets it, see the module docstring): each consumer warpgroup stores its P by stmatrix
    # into a 64 x tile_n slot of its own, fenced for the async proxy before the GEMM reads it.
    # P's registers then live from the conversion to the store only, not across the softmax of
    # the next block while P·V is in flight, which lets 192-row tiles (160 registers) take wider
    # key blocks.
    p_in_smem: bool = False
    # With `lazy_rescale`: each warp first votes on whether all its rows keep their references,
    # from its lanes' own maxima, and then skips the rows' max shuffles and the rescale's
    # selects (`OnlineSoftmax.keep_vote`; bitwise the same output)
    keep_vote: bool = False
    # With `keep_vote` and the intra-warpgroup overlap (make_config: per tile, `Tile`; 16 on head
    # dim 128's tile of short causal sequences, -1 elsewhere): the wait for the P·V GEMM in
    # flight issued after the thread's first `pv_wait_at` of its tile_n / 2 exponentials of each
    # key block, which the vote's branches then hold (the rest follow the wait, one code for both
    # paths), instead of after the softmax (-1, the branches holding all of them). ptxas moves
    # the wait up to the branches' merge, not across (module docstring).
    pv_wait_at: int = -1

    def __post_init__(self):
        check_attention_config(self, DTYPES, TILE_HEADDIMS)
        if self.timeline and (not self.has_lse or self.num_consumer_wgs > 3):
            raise ValueError("timeline writes its records over the LSE: it needs has_lse (and at most 3 warpgroups)")
        if self.cluster_kv and not (self.pairs_query_blocks or (self.pairs_causal_query_blocks and not self.persistent)):
            raise ValueError("cluster_kv groups query blocks that see the same keys: it takes no varlen, seqused_k, "
                             "window or tile_counter, and with a causal mask one CTA per tile")
        if self.tile_counter and not self.persistent:
            raise ValueError("tile_counter hands tiles to persistent CTAs; it needs persistent")
        if self.late_take and not self.tile_counter:
            raise ValueError("late_take times the tile counter's add; it needs tile_counter")
        if self.tile_m != 64 * self.num_consumer_wgs:
            raise ValueError(f"tile_m must be 64 per consumer warpgroup; got {self.tile_m} for {self.num_consumer_wgs}")
        if self.num_consumer_wgs not in REGISTERS:
            raise ValueError(f"num_consumer_wgs must be one of {tuple(REGISTERS)}; got {self.num_consumer_wgs}")
        if self.pingpong and not self.intra_wg_overlap:
            raise ValueError("pingpong orders the overlapped GEMM issue; it needs intra_wg_overlap")
        if self.rescale_o_before_pv and not self.intra_wg_overlap:
            raise ValueError("rescale_o_before_pv moves the rescale of the overlapped loop; it needs intra_wg_overlap")
        if self.masked_halves and not (self.tile_n == 128 and self.intra_wg_overlap and not self.rescale_o_before_pv
                                       and (self.causal or self.local) and self.persistent):
            raise ValueError("masked_halves splits masked 128-key blocks of the overlapped persistent loop: it needs "
                             "tile_n 128, persistent, intra_wg_overlap without rescale_o_before_pv, and a causal mask "
                             "or a window")
        if self.keep_vote and not self.lazy_rescale:
            raise ValueError("keep_vote votes on the lazy rescale's kept references: it needs lazy_rescale")
        if self.pv_wait_at >= 0 and not (self.keep_vote and self.intra_wg_overlap
                                         and self.pv_wait_at < self.tile_n // 2):
            raise ValueError(f"pv_wait_at places the overlapped loop's P·V wait after the keep vote's branches, among "
                             f"a thread's {self.tile_n // 2} exponentials: it needs keep_vote, intra_wg_overlap and "
                             f"0 <= pv_wait_at < {self.tile_n // 2}; got {self.pv_wait_at}")
        if self.tile_n % 16:
            raise ValueError(f"tile_n must be a multiple of 16 (the k of P·V); got {self.tile_n}")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.name} needs {self.smem_bytes} bytes of shared memory (> {SMEM_LIMIT})")

    @property
    def pairs_query_blocks(self) -> bool:
        """Whether two CTAs on neighbouring query blocks walk the same key blocks (`cluster_kv`):
        no mask, varlen or seqused_k, and no tile counter handing tiles out one by one."""
        return not (self.causal or self.local or self.varlen_q or self.varlen_k or self.seqused_k or self.tile_counter)

    @property
    def pairs_causal_query_blocks(self) -> bool:
        """Whether a causal call's neighbouring query blocks can share K/V (`cluster_kv`, on one
        CTA per tile): no varlen, seqused_k or window. The cluster's CTAs walk the key blocks of
        its last query block, each skipping those past its own."""
        return self.causal and not (self.local or self.varlen_q or self.varlen_k or self.seqused_k)

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_consumer_wgs + 1)

    @property
    def registers(self) -> tuple:
        """(consumer, producer) setmaxnreg budgets."""
        return REGISTERS[self.num_consumer_wgs]

    @property
    def smem_bytes(self) -> int:
        """Shared memory of a CTA: the kernel's `SharedStorage` and the static shared memory (the
        compile test checks both)."""
        if self.persistent:  # Q and O apart
            q_o = self.tile_m * (self.head_dim + self.head_dim_v)
        else:  # O over Q
            q_o = self.tile_m * max(self.head_dim, self.head_dim_v)
        kv = self.tile_n * (self.head_dim + self.head_dim_v) * self.num_stages
        p = self.tile_m * self.tile_n if self.p_in_smem else 0
        # the mbarriers (and the tile hand-over slot) padded to the 1024-aligned tiles
        return 1024 + 2 * (q_o + kv + p) + SM90_STATIC_SMEM_BYTES

    @property
    def name(self) -> str:
        flags = [f for f in ("causal", "local", "softcap", "varlen_q", "varlen_k", "seqused_k") if getattr(self, f)]
        if self.masked_halves:
            flags.append("halves")
        if not self.has_lse:
            flags.append("nolse")
        if not self.intra_wg_overlap:
            flags.append("nooverlap")
        if not self.pingpong:
            flags.append("nopingpong")
        if not self.lazy_rescale:
            flags.append("eagerrescale")
        if self.keep_vote:
            flags.append("keepvote")
        if self.pv_wait_at >= 0:
            flags.append(f"pvwait{self.pv_wait_at}")
        if self.rescale_o_before_pv:
            flags.append("early_rescale")
        if self.persistent:
            flags.append("persistent")
        if self.tile_counter:
            flags.append("counter")
        if self.late_take:
            flags.append("latetake")
        if self.timeline:
            flags.append("timeline")
        if self.cluster_kv:
            flags.append("cluster")
        if not self.mask_bits:
            flags.append("cmpmask")
        if self.p_in_smem:
            flags.append("psmem")
        hd = f"hd{self.head_dim}" + (f"x{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        tile = f"{self.tile_m}x{self.tile_n}wg{self.num_consumer_wgs}s{self.num_stages}"
        return "_".join(["fwd_sm90", self.dtype, hd, tile] + flags)


# `Sm90FwdConfig.timeline`: the phases of a key block whose clock cycles a profiling build counts
TIMELINE_PHASES = 7


def make_config(dtype: str, head_dim: int, head_dim_v: int, short_sequences: bool = False,
                **flags) -> Sm90FwdConfig:
    """The shipped configuration for actual head dims (multiples of 8 up to 256) and flags.

    `short_sequences`: every sequence of the call has at most SHORT_SEQUENCE_ROWS query rows;
    causal calls (not windowed ones) then take SHORT_CAUSAL_TILES where it has their head dim.
    Head dims below a tile's are not a separate configuration: TMA zero-fills the columns past
    the actual head dim on load and clips them on store.
    """
    hd, hdv = pad_headdim(head_dim, TILE_HEADDIMS), pad_headdim(head_dim_v, TILE_HEADDIMS)
    tile = TILES[max(hd, hdv)]
    if short_sequences and flags.get("causal", False) and not flags.get("local", False):
        tile = SHORT_CAUSAL_TILES.get(max(hd, hdv), tile)
    flags.setdefault("pingpong", tile.pingpong and flags.get("intra_wg_overlap", True))
    # only a wide O has enough FMULs to be worth hiding (flash-attn-4 draws the same line)
    flags.setdefault("rescale_o_before_pv", hdv > 128 and flags.get("intra_wg_overlap", True))
    # Causal tiles differ in length: a fixed stride over them balanced the SMs worse than the
    # hardware's grid scheduler (benchmarks/ab_sm90_fwd.py on an H200, b2 x 8192 x 16 heads, hd128,
    # bf16: causal grid 604 TFLOP/s, persistent CTAs 544); persistent causal CTAs therefore take
    # their tiles from a counter (`tile_counter`). Persistent loops that spill stay on the grid:
    # hd64 with softcap and a causal mask or a window (160 registers; causal with the counter
    # spilled with the lazy rescale, and local with varlen spilled 16 B eager; both stay on the
    # grid, not compiled persistent again since `keep_vote`) and hd96 with seqused_k (zeroing
    # the V rows past it; 140 B).
    causal = flags.get("causal", False)
    masked = causal or flags.get("local", False)
    spills_persistent = ((masked and hd == 64 and flags.get("softcap", False))
                         or (max(hd, hdv) == 96 and flags.get("seqused_k", False)))
    flags.setdefault("persistent", tile.persistent and not spills_persistent)
    flags.setdefault("lazy_rescale", tile.lazy_rescale)
    flags.setdefault("keep_vote", tile.keep_vote and flags["lazy_rescale"])
    flags.setdefault("pv_wait_at", tile.pv_wait_at if flags["keep_vote"] and flags.get("intra_wg_overlap", True) else -1)
    flags.setdefault("tile_counter", flags["persistent"] and causal)
    flags.setdefault("late_take", flags["tile_counter"])
    # half blocks on 128-key tiles (head dim 64, 128's of short causal sequences), in the
    # persistent loop: on one CTA per tile (head dim 64 with softcap, the causal K/V clusters,
    # the grid variant) ptxas serialized the WGMMAs with them.
    # Causal calls only: a window's right edge takes them too (and passes the GPU tests with
    # them), but windowed calls were not timed with them.
    flags.setdefault("masked_halves", causal and tile.tile_n == 128 and flags.get("intra_wg_overlap", True)
                     and flags["persistent"])
    return Sm90FwdConfig(
        dtype=dtype,
        head_dim=hd,
        head_dim_v=hdv,
        tile_m=tile.tile_m,
        tile_n=tile.tile_n,
        num_consumer_wgs=tile.num_consumer_wgs,
        num_stages=tile.num_stages,
        **flags,
    )


# Causal calls take the K/V clusters from this many query blocks per sequence on, at these
# (padded) head dims, on one CTA per tile. The cluster's two CTAs walk the key blocks of its
# later query block (`FlashFwdSm90.cluster_walk_end`), so the grid gives up the persistent CTAs'
# tile counter. On an H200 (bf16, `benchmarks/ab_sm90_fwd.py --causal-only --variants "grid,cluster
# grid" --rounds 5`, 2048 / head dim heads, medians, TFLOP/s): hd128 2 x 8192 633.5 against 620.9
# for the shipped counter (flash-attn-4 616.9), 1 x 16384 672.0 against 638.3 (647.2); hd192
# 2 x 8192 706.0 against 693.0 (673.5), 1 x 16384 743.0 against 715.9 (690.8); but at 8 x 2048
# (16 query blocks) the counter's balance is worth more than the halved K/V reads: hd128 496.0
# against 525.5, hd192 522.8 against 529.7. (hd128 there on its former 128 x 128 tile; on 192 x 80,
# `--variants "192x80 cluster grid"`, 5 rounds: 1 x 16384, 86 blocks, 689.9 against 672.6; 2 x 6144,
# 32 blocks, 637.5 against 651.5.)
CAUSAL_CLUSTER_MIN_BLOCKS = 64
CAUSAL_CLUSTER_HEADDIMS = (128, 192)


def with_cluster_kv(config: Sm90FwdConfig, num_m_blocks: int, num_pairs: int = 2) -> Sm90FwdConfig:
    """`config` with `cluster_kv` where a call with `num_m_blocks` query blocks per sequence and
    `num_pairs` (batch, head) pairs can take it: no window, no varlen or seqused_k, tiles of 80 keys
    or more, an even number of query blocks, so that both CTAs of a cluster walk the key blocks of
    the same (batch, head) -- or, without a mask in the persistent loop, an odd number and an even
    number of pairs, whose last query blocks go two heads to a cluster, each CTA loading its own
    K/V (`cluster_tile_coords`) -- and with a causal mask at least `CAUSAL_CLUSTER_MIN_BLOCKS` of
    them at `CAUSAL_CLUSTER_HEADDIMS` (one
    CTA per tile, above); and not on head dim 256's 128 x 64 tile, where it measured level (H200,
    bf16, 2 x 8192 x 8 heads, three rounds: 722-732 TFLOP/s against 730-731): one CTA per tile
    fills an SM, and a cluster waits for two free SMs. Elsewhere on an H200
    (`benchmarks/ab_clusters.py --rounds 5`, bf16, 2048 / head dim heads, medians, no mask): head
    dim 128 2 x 8192 666.4 against 646.9 TFLOP/s (SM clock 1674 against 1633 MHz at the 700 W
    cap), 8 x 2048 615.2 against 606.7; 96 (on its former 128 x 128 tile) 558.2 against 541.6; 192
    716.9 against 709.1; 64 at 1 x 16384 534.1 against 530.1 (head dim 128 on its former 128 x 128
    tile; on 192 x 80, the module docstring). The odd numbers of query blocks (`takes_lone_tiles`)
    measured level on an H100 80GB HBM3 (`benchmarks/ab_clusters.py --rounds 7`, bf16, no mask,
    medians, TFLOP/s, with the clusters / without; O and LSE bitwise equal): hd128 2 x 8192 (43
    blocks of 192 rows) 697.4 / 700.7, 8 x 2048 (11) 658.7 / 653.3, hd64 2 x 8192 552.8 / 548.6,
    hd96 622.8 / 630.8, at a 30-70 MHz higher SM clock at the same 690-700 W; untimed on an H200,
    where the clusters of even numbers paid through that clock."""
    if config.tile_n < 80 or (num_m_blocks % 2 and not takes_lone_tiles(config, num_pairs)):
        return config
    if config.pairs_query_blocks or (config.pairs_causal_query_blocks and num_m_blocks >= CAUSAL_CLUSTER_MIN_BLOCKS
                                     and max(config.head_dim, config.head_dim_v) in CAUSAL_CLUSTER_HEADDIMS):
        return _clustered(config)
    return config


def takes_lone_tiles(config: Sm90FwdConfig, num_pairs: int) -> bool:
    """Whether a K/V-cluster `config` covers an odd number of query blocks for `num_pairs` (batch,
    head) pairs: its last query blocks then go two heads to a cluster (`cluster_tile_coords`),
    which the persistent loop of unmasked calls takes, for an even number of pairs."""
    return config.persistent and config.pairs_query_blocks and num_pairs % 2 == 0


# The fields `on_grid` sets: one CTA per tile, so no persistent loop, tile counter (nor its take
# order) or half blocks
ON_GRID = dict(persistent=False, tile_counter=False, late_take=False, masked_halves=False)


# The fields that turn the keep vote off: the vote, and the P·V wait placed after its branches
NO_KEEP_VOTE = dict(keep_vote=False, pv_wait_at=-1)


def on_grid(config: Sm90FwdConfig) -> Sm90FwdConfig:
    """`config` on one CTA per tile: without the persistent loop, and so without its tile counter
    and its half blocks (`masked_halves`)."""
    return replace(config, **ON_GRID)


@functools.lru_cache(maxsize=256)
def _clustered(config: Sm90FwdConfig) -> Sm90FwdConfig:
    """`config` with `cluster_kv` (a causal one on one CTA per tile), built once per configuration
    (a call asks for it every time)."""
    if config.causal:
        return replace(on_grid(config), cluster_kv=True)
    return replace(config, cluster_kv=True)


def short_sequence_variant(config: Sm90FwdConfig) -> Sm90FwdConfig:
    """`config` on the tile `make_config` gives with `short_sequences` (the same flags, the half
    blocks and the P·V wait where that tile takes them), or `config` where that changes nothing."""
    tile = SHORT_CAUSAL_TILES.get(max(config.head_dim, config.head_dim_v))
    if tile is None or not config.causal or config.local:
        return config
    halves = config.persistent and tile.tile_n == 128 and config.intra_wg_overlap and not config.rescale_o_before_pv
    wait_at = tile.pv_wait_at if config.keep_vote and config.intra_wg_overlap else -1
    return replace(config, tile_m=tile.tile_m, tile_n=tile.tile_n, num_consumer_wgs=tile.num_consumer_wgs,
                   num_stages=tile.num_stages, masked_halves=halves, pv_wait_at=wait_at)


def shipped_configs() -> list:
    """Every tile of the table in both dtypes, causal and not, plus one of each feature variant.

    Feature variants change code paths but not the tile, so a few head dims per variant show
    that each path compiles without spills.
    """
    configs = [
        make_config(dtype, d, d, causal=causal)
        for d in TILE_HEADDIMS
        for dtype in DTYPES
        for causal in (False, True)
    ]
    for d in (64, 128, 256):
        base = make_config("bfloat16", d, d)
        configs += [
            replace(base, local=True),
            make_config("bfloat16", d, d, softcap=True, causal=True),
            make_config("bfloat16", d, d, varlen_q=True, varlen_k=True, causal=True),
            replace(base, varlen_q=True, varlen_k=True, seqused_k=True),
            replace(base, seqused_k=True),
            replace(base, has_lse=False),
        ]
    configs += [make_config("bfloat16", 192, 128, causal=True), make_config("float16", 128, 64),
                make_config("bfloat16", 96, 96, seqused_k=True, causal=True),
                make_config("bfloat16", 64, 64, local=True, softcap=True, varlen_q=True, varlen_k=True)]
    # the eager rescale (the table is lazy at every head dim), kept for benchmarks/ab_sm90_fwd.py
    configs += [make_config("bfloat16", d, d, causal=causal, lazy_rescale=not TILES[d].lazy_rescale)
                for d in (64, 128, 256) for causal in (False, True)]
    # the other schedules where the table is persistent, for A/B (selfcheck's variants): one CTA
    # per tile, and causal tiles by a fixed stride
    configs += [make_config("bfloat16", d, d, causal=causal, persistent=False)
                for d in (64, 128) for causal in (False, True)]
    configs += [make_config("bfloat16", d, d, causal=True, tile_counter=False) for d in (64, 128)]
    # causal masks by a comparison per element instead of bit masks, for A/B
    configs += [make_config("bfloat16", d, d, causal=True, mask_bits=False) for d in (64, 128)]
    # every masked block's GEMMs over all of its keys (`masked_halves` off), for A/B, and the half
    # blocks on a window's right edge (not taken by default: untimed)
    configs += [make_config("bfloat16", 64, 64, causal=True, masked_halves=False)]
    configs += [make_config("bfloat16", 64, 64, local=True, masked_halves=True)]
    # the K/V-sharing clusters of unmasked calls (an even number of query blocks, or of pairs)
    configs += [replace(make_config(dtype, d, d), cluster_kv=True) for d in (64, 96, 128, 192) for dtype in DTYPES]
    configs += [with_cluster_kv(make_config(dtype, d, d, causal=True), CAUSAL_CLUSTER_MIN_BLOCKS)
                for d in CAUSAL_CLUSTER_HEADDIMS for dtype in DTYPES]
    configs += [replace(make_config("bfloat16", 128, 128, softcap=True), cluster_kv=True),
                replace(make_config("bfloat16", 128, 128, has_lse=False), cluster_kv=True),
                replace(make_config("bfloat16", 192, 128), cluster_kv=True)]
    # and the causal ones on the tiles of short sequences (`short_sequences`)
    from cute_flash.audit import distinct

    return distinct(configs + [short_sequence_variant(c) for c in configs if not c.cluster_kv])


# ------------------------------------------------------------------------------------------------
# compiling a configuration (no GPU needed: fake tensors with symbolic sizes and 64-bit strides)
# ------------------------------------------------------------------------------------------------
def fake_arguments(config: Sm90FwdConfig) -> tuple:
    """Arguments of `FlashFwdSm90.__call__` (less the stream) for `cute.compile` (TMA needs the
    16-byte strides that `fake_tokens` promises)."""
    import cutlass

    from ..common.fake_tensors import fake_forward_arguments, fake_tensor

    # + the persistent grid's size, the tile order and the tile counter (`FlashFwdSm90.__call__`)
    counter = fake_tensor(cutlass.Int32, 1) if config.tile_counter else None
    return fake_forward_arguments(config) + (cutlass.Int32(1), cutlass.Int32(1), counter)


def compile_fwd(config: Sm90FwdConfig, options: str = "--gpu-arch sm_90a"):
    """cute.compile the kernel of `config` (with extra compiler `options`, e.g. the arch)."""
    import cutlass.cute as cute

    from ..common.fake_tensors import fake_stream

    from .fwd import FlashFwdSm90

    return cute.compile(FlashFwdSm90(config), *fake_arguments(config), fake_stream(options), options=options)


def sweep_configs() -> list:
    """The configurations `make_config` gives over a grid of calls (bf16 and fp16): every head dim
    with no mask / causal / window, softcap or not, seqused_k or not, varlen or not, and unequal
    head dims of Q and V. `python -m cute_flash.audit --sweep` compiles them (`--filter float16`
    for one dtype): the shipped sample covers each path once, this covers their combinations."""
    import itertools

    from cute_flash.audit import distinct

    equal = (
        make_config(dtype, d, d, softcap=softcap, seqused_k=seqused, varlen_q=varlen, varlen_k=varlen, **mask)
        for dtype, d, mask, softcap, seqused, varlen in itertools.product(
            DTYPES, TILE_HEADDIMS, ({}, {"causal": True}, {"local": True}), (False, True), (False, True),
            (False, True),
        )
    )
    unequal = (
        make_config(dtype, d, dv, causal=causal)
        for dtype, (d, dv), causal in itertools.product(
            DTYPES, ((128, 64), (64, 128), (192, 128), (256, 128), (128, 256)), (False, True),
        )
    )
    configs = list(itertools.chain(equal, unequal))
    configs += [short_sequence_variant(c) for c in configs]
    # and those calls with enough query blocks, in pairs, for the K/V clusters (`with_cluster_kv`)
    return distinct(configs + [with_cluster_kv(c, CAUSAL_CLUSTER_MIN_BLOCKS) for c in configs])


def sweep_targets(arch: str) -> list:
    """One audit target per `sweep_configs` entry; sm_90a only."""
    from cute_flash.audit import targets

    return targets(arch, sweep_configs(), compile_fwd) if arch == "sm_90a" else []


def audit_targets(arch: str) -> list:
    """One audit target per shipped configuration (see `cute_flash.audit`); sm_90a only."""
    from cute_flash.audit import targets

    return targets(arch, shipped_configs(), compile_fwd) if arch == "sm_90a" else []
