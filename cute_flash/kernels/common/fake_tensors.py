"""Fake (memory-less) tensors to compile kernels with, on a machine with or without a GPU.

Every size is a symbolic int32 and every stride but the last a symbolic 64-bit multiple of a
given divisibility, so one compiled kernel serves every shape and all its offsets are 64-bit.
"""

from __future__ import annotations


def element_type(name: str):
    """The DSL's type for a config's dtype name ("float16" | "bfloat16")."""
    import cutlass

    return cutlass.Float16 if name == "float16" else cutlass.BFloat16


def fake_tensor(dtype, rank: int, divisibility: int = 1, align: int = 4):
    """A rank-`rank` tensor of `dtype`, unit stride last, aligned to `align` bytes."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int32() for _ in range(rank))
    stride = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, assumed_align=align)


def fake_tokens(dtype, varlen: bool, divisibility: int = 8):
    """(batch, seqlen, heads, d), or packed (total, heads, d): 16-byte aligned rows for
    cp.async and TMA (divisibility 8 for 16-bit elements, 4 for float32)."""
    return fake_tensor(dtype, 3 if varlen else 4, divisibility, 16)


def fake_int_vector():
    """cu_seqlens / seqused_k."""
    import cutlass

    return fake_tensor(cutlass.Int32, 1)


def fake_sequence_vectors(config) -> tuple:
    """cu_seqlens_q, cu_seqlens_k, seqused_k as a kernel with `config`'s varlen_q / varlen_k /
    seqused_k flags takes them: int32 vectors, or None where the flag is off."""
    return tuple(fake_int_vector() if flag else None for flag in (config.varlen_q, config.varlen_k, config.seqused_k))


def fake_forward_arguments(config) -> tuple:
    """The arguments every forward kernel's `__call__` starts with, for a config with the
    forward's fields (dtype, varlen_q/k, seqused_k, has_lse): q, k, v, out, lse, cu_seqlens_q/k,
    seqused_k, then the scalars."""
    import cutlass

    dtype = element_type(config.dtype)
    return (
        fake_tokens(dtype, config.varlen_q),  # q
        fake_tokens(dtype, config.varlen_k),  # k
        fake_tokens(dtype, config.varlen_k),  # v
        fake_tokens(dtype, config.varlen_q),  # out
        fake_tensor(cutlass.Float32, 2 if config.varlen_q else 3) if config.has_lse else None,
        *fake_sequence_vectors(config),
        cutlass.Int32(1),  # num_batch
        cutlass.Int32(1),  # max_seqlen_q
        cutlass.Float32(1.0),  # softmax_scale_log2
        cutlass.Float32(1.0),  # softcap_prescale
        cutlass.Int32(-1),  # window_left
        cutlass.Int32(-1),  # window_right
    )


def fake_stream(options: str):
    """The stream argument to compile with: a placeholder CUstream, or, for a kernel compiled with
    `--enable-tvm-ffi`, TVM-FFI's environment stream (the caller's current stream; the launch
    then passes none)."""
    if "--enable-tvm-ffi" in options.split():
        from cutlass.cute.runtime import make_fake_stream

        return make_fake_stream(use_tvm_ffi_env_stream=True)
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0)
