"""Small device helpers shared by the sm80 and sm90 kernels (trace time only).

The transcendental helpers are inline PTX on purpose: `ex2.approx.ftz.f32` maps -inf to +0,
which is what masking relies on, and keeping them out of LLVM's fast-math world means the
compiler cannot assume "no infinities" and fold the -inf guards of the softmax away.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def _pure_asm(ptx: str, result_type, operands, constraints: str, loc=None, ip=None, operand_type=Float32):
    """One side-effect-free inline PTX instruction on `operands` (float32 unless `operand_type`)."""
    return llvm.inline_asm(
        result_type,
        [operand_type(x).ir_value(loc=loc, ip=ip) for x in operands],
        ptx,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _unary_asm(ptx: str, x, loc=None, ip=None) -> Float32:
    return Float32(_pure_asm(ptx, T.f32(), [x], "=f,f", loc, ip))


@dsl_user_op
def exp2f(x, *, loc=None, ip=None) -> Float32:
    """2**x with MUFU.EX2; exp2f(-inf) == 0."""
    return _unary_asm("ex2.approx.ftz.f32 $0, $1;", x, loc, ip)


@dsl_user_op
def bulk_reduce_add_f32(gmem_addr, smem_addr, nbytes: int, *, loc=None, ip=None):
    """cp.reduce.async.bulk (1-D, add.f32) of `nbytes` from shared to global memory (bulk group)."""
    llvm.inline_asm(
        None,
        [cutlass.Int64(gmem_addr).ir_value(loc=loc, ip=ip), cutlass.Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {nbytes};",
        "l,r,~{memory}",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def trap(*, loc=None, ip=None):
    """Stop the kernel with an error (PTX `trap`): the launch fails loudly instead of hanging or
    writing a wrong result."""
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None):
    """Suspend the warp for about `ns` nanoseconds (PTX `nanosleep`, at most 1 ms)."""
    llvm.inline_asm(None, [cutlass.Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def wait_for_count(count_ptr, count, max_polls: cutlass.Constexpr[int], pause_ns: cutlass.Constexpr[int]):
    """Spin until the int32 counter at `count_ptr` (global memory) reaches `count`, `pause_ns`
    between two loads; the acquire loads (GPU scope) order this thread's later accesses after the
    release adds that made it. A counter still short after `max_polls` loads means a count that
    can never come: `trap`."""
    polls = cutlass.Int32(0)
    while cute.arch.load(count_ptr, cutlass.Int32, sem="acquire", scope="gpu") < count:
        nanosleep(pause_ns)
        polls += 1
        if polls == max_polls:
            trap()


def _u32_asm(ptx: str, a, b, loc=None, ip=None) -> cutlass.Uint32:
    return cutlass.Uint32(_pure_asm(ptx, T.i32(), [a, b], "=r,r,r", loc, ip, operand_type=cutlass.Uint32))


@dsl_user_op
def low_bits(n, *, loc=None, ip=None) -> cutlass.Uint32:
    """The 32-bit word whose lowest `n` bits are set, for 0 <= n <= 32 (PTX clamps a shift by 32
    or more to an all-zero result, where a shift in C or LLVM would be undefined)."""
    return _u32_asm("shr.b32 $0, $1, $2;", 0xFFFFFFFF, cutlass.Uint32(32 - n), loc, ip)


@dsl_user_op
def high_bits_from(n, *, loc=None, ip=None) -> cutlass.Uint32:
    """The 32-bit word with bits n .. 31 set, for 0 <= n <= 32 (none for 32)."""
    return _u32_asm("shl.b32 $0, $1, $2;", 0xFFFFFFFF, cutlass.Uint32(n), loc, ip)


@dsl_user_op
def log2f(x, *, loc=None, ip=None) -> Float32:
    """log2(x) with MUFU.LG2; only used once per row, on a positive sum."""
    return _unary_asm("lg2.approx.ftz.f32 $0, $1;", x, loc, ip)


@dsl_user_op
def tanhf(x, *, loc=None, ip=None) -> Float32:
    """tanh with MUFU.TANH (sm_75+), for score soft-capping."""
    return _unary_asm("tanh.approx.f32 $0, $1;", x, loc, ip)


def quad_allreduce(val: Float32, op) -> Float32:
    """Reduce over the 4 lanes that hold one accumulator row of an m16n8 MMA tile.

    In the mma.sync C fragment a row is split over lanes 4g..4g+3, so two butterfly shuffles
    (xor 2, xor 1) leave every lane of the quad with the row's reduction.
    """
    for offset in (2, 1):
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=offset))
    return val


def fmax(a, b):
    return cute.arch.fmax(a, b)


def fadd(a, b):
    return a + b


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an mma.sync accumulator ((2, 2), MMA_M, MMA_N) as (rows, cols) of this thread.

    In the C fragment of m16n8k16 the inner mode (2, 2) is (column pair, row half): values 0,1
    sit in one row at adjacent columns, values 2,3 eight rows below. Grouping the row-half with
    MMA_M and the column pair with MMA_N gives ((2, MMA_M), (2, MMA_N)).
    """
    shape, stride = acc.layout.shape, acc.layout.stride
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[2])),
        stride=((stride[0][1], stride[1]), (stride[0][0], stride[2])),
    )
    return cute.make_tensor(acc.iterator, mn)


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """Reinterpret a C fragment ((2, 2), MMA_M, MMA_N) as an A fragment ((2, 2, 2), MMA_M, MMA_N/2).

    Two neighbouring n8 accumulator tiles hold exactly the 16 columns one k16 A fragment needs,
    in the same register order (a0..a3 from the first n8 tile, a4..a7 from the second), so P
    feeds the P·V MMA straight from registers.
    """
    div = cute.logical_divide(acc.layout, (None, None, 2))
    shape, stride = div.shape, div.stride
    frg_a = cute.make_layout(
        ((shape[0], shape[2][0]), shape[1], shape[2][1]),
        stride=((stride[0], stride[2][0]), stride[1], stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, frg_a)


def transposed(t: cute.Tensor) -> cute.Tensor:
    """The (cols, rows[, stages]) view of a (rows, cols[, stages]) shared-memory tile: the
    MN-major operand over the same bytes."""
    order = [1, 0, 2] if cutlass.const_expr(cute.rank(t) == 3) else [1, 0]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def elem_pointer(t: cute.Tensor, i):
    """Pointer to element `i` (flat index or coordinate) of `t`, for per-element atomics."""
    return t.iterator + cute.crd2idx(i, t.layout)


@cute.jit
def wait_for_turn(sem_ptr, turn):
    """Deterministic backward: spin until the int32 turn counter at `sem_ptr` (global memory)
    reaches `turn`; the acquire loads (GPU scope) order this thread's later accesses after the
    additions of the turns before. Called by one thread, which then meets the others."""
    while cute.arch.load(sem_ptr, cutlass.Int32, sem="acquire", scope="gpu") != turn:
        pass


def pass_turn(sem_ptr, turn):
    """Hand the turn counter at `sem_ptr` on to the turn after `turn` (release store, GPU scope),
    once this turn's additions are visible (the caller fences them first)."""
    cute.arch.store(sem_ptr, cutlass.Int32(turn + 1), sem="release", scope="gpu")


def make_g2s_copy(dtype, num_threads: int, atom_cols: int) -> cute.TiledCopy:
    """cp.async tiled copy, 128 bits per thread, rows of `atom_cols` elements per thread row.

    The thread rows match the swizzle atom's width so that one pass of the CTA writes whole
    128-byte swizzle lines.
    """
    vec = 128 // dtype.width
    atom = cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
        dtype,
        num_bits_per_copy=128,
    )
    threads_per_row = atom_cols // vec
    thr_layout = cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))


def make_s2g_copy(dtype, num_threads: int, atom_cols: int) -> cute.TiledCopy:
    """128-bit register -> global tiled copy with the same thread arrangement as `make_g2s_copy`."""
    vec = 128 // dtype.width
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    threads_per_row = atom_cols // vec
    thr_layout = cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))


def col_predicate(tXcX: cute.Tensor, limit) -> cute.Tensor:
    """Per-(vector, k-chunk) column predicates of a copy partition ((V, v), M, K), shared by all rows."""
    pred = cute.make_rmem_tensor(
        cute.make_layout(
            (tXcX.shape[0][1], cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
            stride=(cute.size(tXcX, mode=[2]), 0, 1),
        ),
        cutlass.Boolean,
    )
    for v in range(pred.shape[0]):
        for k in range(pred.shape[2]):
            pred[v, 0, k] = cute.elem_less(tXcX[(0, v), 0, k][1], limit)
    return pred


@cute.jit
def store_staged_rows(gmem_copy: cute.TiledCopy, sX: cute.Tensor, gX: cute.Tensor, tidx, rows, cols):
    """Copy a tile staged in shared memory (`sX`) to its place in global memory (`gX`, the same
    static shape) with `gmem_copy` (`make_s2g_copy`): rows from `rows` on are not written, nor
    columns from `cols` on (`cols` None: every column is inside)."""
    thr_copy = gmem_copy.get_slice(tidx)
    tXsX = thr_copy.partition_S(sX)
    tXgX = thr_copy.partition_D(gX)
    tXcX = thr_copy.partition_D(cute.make_identity_tensor(gX.shape))
    tXrX = cute.make_fragment_like(tXsX, sX.element_type)
    cute.autovec_copy(tXsX, tXrX)
    tXpD = col_predicate(tXcX, cols) if cutlass.const_expr(cols is not None) else None
    for m in cutlass.range_constexpr(cute.size(tXrX, mode=[1])):
        if tXcX[0, m, 0][0] < rows:
            cute.copy(gmem_copy, tXrX[None, m, None], tXgX[None, m, None],
                      pred=tXpD[None, m, None] if cutlass.const_expr(cols is not None) else None)


@cute.jit
def cp_async_tile(tiled_copy: cute.TiledCopy, tXgX: cute.Tensor, tXsX: cute.Tensor, tXcX: cute.Tensor,
                  tXpD, rows):
    """cp.async one tile; rows past `rows` and columns the predicate `tXpD` rules out are
    zero-filled. `rows` None: the tile is full; `tXpD` None: every column is valid.

    Zero-filling (instead of skipping) keeps stale shared memory from ever reaching an MMA:
    a NaN left in a V row would survive P = 0 as 0 * NaN.
    """
    if cutlass.const_expr(rows is None and tXpD is None):
        cute.copy(tiled_copy, tXgX, tXsX)
    else:
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                if cutlass.const_expr(rows is None):
                    ok = tXpD[0, 0, k]
                elif cutlass.const_expr(tXpD is None):
                    ok = tXcX[0, m, 0][0] < rows
                else:
                    ok = (tXcX[0, m, 0][0] < rows) & tXpD[0, 0, k]
                if ok:
                    cute.copy(tiled_copy, tXgX[None, m, k], tXsX[None, m, k])
                else:
                    tXsX[None, m, k].fill(0)


@dsl_user_op
def pack_f32x2(lo, hi, dtype, *, loc=None, ip=None) -> cutlass.Int32:
    """(lo, hi) rounded to nearest even into one 32-bit word of two 16-bit `dtype` values, lo in
    the low half: one `cvt.rn.{bf16x2,f16x2}.f32` (the PTX takes the high operand first)."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return cutlass.Int32(_pure_asm(f"cvt.rn.{kind}.f32 $0, $1, $2;", T.i32(), [hi, lo], "=r,f,f", loc, ip))


@cute.jit
def store_pairs_16bit(src: cute.Tensor, dst: cute.Tensor):
    """dst (16-bit, compact) = src (float32), two neighbouring elements per conversion.

    `dst.store(src.load().to(dtype))` packs pairs only for some tile widths (128 and 64 columns of
    a WGMMA accumulator); at 96 or 80 it converted one element at a time and then needed PRMTs to
    pack them, twice the F2FP count plus the PRMTs.
    """
    dst_words = cute.recast_tensor(dst, cutlass.Int32)
    for i in cutlass.range_constexpr(cute.size(dst_words)):
        dst_words[i] = pack_f32x2(src[2 * i], src[2 * i + 1], dst.element_type)
