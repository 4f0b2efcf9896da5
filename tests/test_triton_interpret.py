"""The Triton backend on the CPU: its kernels under the Triton interpreter against the
reference, the import-time choice on ROCm, and `import cute_flash` without Triton.

The kernels run in one worker process started with TRITON_INTERPRET=1 (see `Interpreter`);
this process's environment and imports stay as they were, so other test modules are unaffected.

bf16 runs too: the backend multiplies bf16 tiles in fp32 under the interpreter (whose bf16
`tl.dot` is wrong), which leaves the products exact. The interpreter's fp32 -> bf16
conversion truncates where the GPU rounds to nearest even, which the tolerance covers and the
rounding test skips.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import random
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from attention_oracle import check_backward, check_forward
from cute_flash import api, backends
from cute_flash.backends.base import FEATURES
from cute_flash.backends.triton import TritonBackend

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Interpreter:
    """A worker process whose Triton kernels are interpreted. `@triton.jit` (Triton's own
    library functions included) decides at import time whether it compiles or interprets, so
    TRITON_INTERPRET must be set before Triton is first imported: in a fresh process, never in
    this one, where other test modules may have imported Triton already or need it compiled."""

    def __init__(self):
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_interpret)

    def run(self, fn, *args):
        return self.pool.submit(fn, *args).result(timeout=300)


def _interpret():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def interpreter():
    pytest.importorskip("triton")
    worker = Interpreter()
    yield worker
    worker.pool.shutdown()


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def _problem(dtype, batch=2, seqlen_q=37, seqlen_k=53, nheads=4, nheads_k=2, d=32, dv=None, seqlens_q=None,
             seqlens_k=None, seqused_k=None, seed=0, **kw):
    """Inputs and the validated call; packed (varlen) when `seqlens_q` is given."""
    gen = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    if seqlens_q is not None:
        cu_q, cu_k = _cu(seqlens_q), _cu(seqlens_k)
        q = _randn(int(cu_q[-1]), nheads, d, dtype=dtype, gen=gen)
        k = _randn(int(cu_k[-1]), nheads_k, d, dtype=dtype, gen=gen)
        v = _randn(int(cu_k[-1]), nheads_k, dv, dtype=dtype, gen=gen)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q = _randn(batch, seqlen_q, nheads, d, dtype=dtype, gen=gen)
        k = _randn(batch, seqlen_k, nheads_k, d, dtype=dtype, gen=gen)
        v = _randn(batch, seqlen_k, nheads_k, dv, dtype=dtype, gen=gen)
    if seqused_k is not None:
        kw["seqused_k"] = torch.tensor(seqused_k, dtype=torch.int32)
    call = api.validate(q, k, v, **kw)
    return q, k, v, call


def _forward(q, k, v, call):
    out = torch.full(call.out_shape, math.nan, dtype=q.dtype)
    lse = torch.full(call.lse_shape, math.nan, dtype=torch.float32)
    TritonBackend().fwd(q, k, v, out, lse, call.args)
    return out, lse


def _backward(dout, q, k, v, out, lse, dlse, call):
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    TritonBackend().bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, call.args, deterministic=False)
    return dq, dk, dv


CASES = {
    "dense-f32": dict(dtype=F32),
    "dense-f16": dict(dtype=F16),
    "dense-bf16": dict(dtype=BF16),
    "causal-sq<sk-f16": dict(dtype=F16, causal=True, seqlen_q=19, seqlen_k=70),
    "causal-sq>sk-f32": dict(dtype=F32, causal=True, seqlen_q=70, seqlen_k=23),
    "causal-sq>sk-f16": dict(dtype=F16, causal=True, seqlen_q=70, seqlen_k=23),
    "causal-bf16": dict(dtype=BF16, causal=True, seqlen_q=45, seqlen_k=45),
    "window-both-f16": dict(dtype=F16, window_size=(7, 3), seqlen_q=50, seqlen_k=41),
    "window-left-f32": dict(dtype=F32, window_size=(5, -1), seqlen_q=33, seqlen_k=70),
    "window-right-f32": dict(dtype=F32, window_size=(-1, 4), seqlen_q=66, seqlen_k=29),
    "window-0-0-f16": dict(dtype=F16, window_size=(0, 0), seqlen_q=40, seqlen_k=20),
    "softcap-f32": dict(dtype=F32, softcap=3.0, softmax_scale=0.9),
    "softcap-causal-f16": dict(dtype=F16, softcap=10.0, causal=True, seqlen_q=48, seqlen_k=33),
    "mqa-f16": dict(dtype=F16, nheads=3, nheads_k=1),
    "gqa-window-bf16": dict(dtype=BF16, nheads=6, nheads_k=2, window_size=(9, 0), batch=1),
    "headdim-v-f16": dict(dtype=F16, d=40, dv=72, causal=True),
    "headdim-8-f32": dict(dtype=F32, d=8, dv=24, batch=1),
    "headdim-256-f16": dict(dtype=F16, d=256, dv=256, batch=1, nheads=2, nheads_k=1, seqlen_q=20, seqlen_k=35),
    "varlen-f16": dict(dtype=F16, seqlens_q=[5, 0, 40, 17], seqlens_k=[9, 12, 33, 0]),
    "varlen-causal-f32": dict(dtype=F32, causal=True, seqlens_q=[30, 1, 18], seqlens_k=[12, 50, 18]),
    "varlen-window-bf16": dict(dtype=BF16, window_size=(6, 2), seqlens_q=[21, 34], seqlens_k=[40, 34]),
    "varlen-seqused-f16": dict(dtype=F16, causal=True, seqlens_q=[20, 7, 3], seqlens_k=[40, 30, 25],
                               seqused_k=[33, 0, 25]),
    "seqused-f16": dict(dtype=F16, seqlen_q=24, seqlen_k=60, seqused_k=[41, 0]),
    "seqused-softcap-gqa-f32": dict(dtype=F32, nheads=4, nheads_k=2, softcap=5.0, seqused_k=[1, 53]),
    # Several query and key blocks (128 x 64 tiles for fp16): rescaling across key blocks,
    # windows that start mid-sequence, rows of later query blocks.
    "long-window-f16": dict(dtype=F16, batch=1, nheads=2, nheads_k=1, seqlen_q=300, seqlen_k=333,
                            window_size=(90, 20)),
    "long-causal-gqa-bf16": dict(dtype=BF16, batch=1, nheads=2, nheads_k=1, seqlen_q=260, seqlen_k=200,
                                 causal=True),
    "decode-f16": dict(dtype=F16, seqlen_q=1, seqlen_k=150, nheads=8, nheads_k=2, causal=True),
    "one-key-f32": dict(dtype=F32, seqlen_q=20, seqlen_k=1),
}


def _check_case(case):
    q, k, v, call = _problem(**CASES[case])
    out, lse = _forward(q, k, v, call)
    ref_out, ref_lse = check_forward(out, lse, q, k, v, call.args)
    gen = torch.Generator().manual_seed(1)
    dout = _randn(*out.shape, dtype=q.dtype, gen=gen)
    dlse = _randn(*lse.shape, dtype=torch.float32, gen=gen)
    grads = _backward(dout, q, k, v, out, lse, dlse, call)
    check_backward(grads, dout, dlse, q, k, v, ref_out, ref_lse, call.args)


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_the_reference(interpreter, case):
    interpreter.run(_check_case, case)


@functools.lru_cache(maxsize=None)
def _visible_pairs(seqlen_q, seqlen_k, left, right):
    shift = seqlen_k - seqlen_q
    return [(i, j) for i in range(seqlen_q) for j in range(seqlen_k)
            if (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)]


def _visible_span(lo, hi, seqlen_q, seqlen_k, left, right, rows_given):
    """Brute force: (first, last) key seen by rows [lo, hi), or (first, last) row that sees a
    key in [lo, hi) when `rows_given` is False; None when there is none."""
    pairs = _visible_pairs(seqlen_q, seqlen_k, left, right)
    hits = [j for i, j in pairs if lo <= i < hi] if rows_given else [i for i, j in pairs if lo <= j < hi]
    return (min(hits), max(hits)) if hits else None


def _check_block_ranges(block_m, block_n):
    import triton_probes

    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100]
    windows = [(-1, -1), (-1, 0), (0, 0), (3, -1), (-1, 5), (7, 2), (40, 0), (0, 40), (70, 70)]
    for left, right in windows:
        problems = [(m_lo, n_lo, sq, sk, left, right) for sq in lengths for sk in lengths
                    for m_lo in range(0, sq, block_m) for n_lo in range(0, sk, block_n)]
        ranges = torch.empty(len(problems), 4, dtype=torch.int32)
        triton_probes.block_ranges[(len(problems),)](torch.tensor(problems, dtype=torch.int32), ranges,
                                                     BLOCK_M=block_m, BLOCK_N=block_n,
                                                     HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0)
        for (m_lo, n_lo, sq, sk, _, _), (k_lo, k_hi, q_lo, q_hi) in zip(problems, ranges.tolist()):
            keys = _visible_span(m_lo, min(m_lo + block_m, sq), sq, sk, left, right, rows_given=True)
            rows = _visible_span(n_lo, n_lo + block_n, sq, sk, left, right, rows_given=False)
            for name, span, (lo, hi), block in (("keys", keys, (k_lo, k_hi), block_n),
                                                ("rows", rows, (q_lo, q_hi), block_m)):
                expected = "empty" if span is None else (span[0] // block * block, span[1] + 1)
                got = "empty" if lo >= hi else (lo, hi)
                assert got == expected, (f"{name} of block (m_lo={m_lo}, n_lo={n_lo}), seqlen_q={sq}, "
                                         f"seqlen_k={sk}, window=({left}, {right}): {got} != {expected}")


@pytest.mark.parametrize("block_m,block_n", [(128, 64), (64, 32), (32, 64)])
def test_block_ranges_are_exact(interpreter, block_m, block_n):
    """The key blocks a query block visits (and the query blocks a key block visits) are
    exactly those that hold a visible pair: none skipped, none wasted."""
    interpreter.run(_check_block_ranges, block_m, block_n)


def _check_random_windows(seed, trials):
    rng = random.Random(seed)
    for trial in range(trials):
        config = dict(
            dtype=rng.choice([F16, F32]),
            seqlen_q=rng.randint(1, 150),
            seqlen_k=rng.randint(1, 150),
            window_size=(rng.choice([-1, 0, rng.randint(0, 160)]), rng.choice([-1, 0, rng.randint(0, 160)])),
        )
        q, k, v, call = _problem(batch=1, nheads=1, nheads_k=1, d=16, seed=trial, **config)
        try:
            out, lse = _forward(q, k, v, call)
            ref_out, ref_lse = check_forward(out, lse, q, k, v, call.args)
            dout = _randn(*out.shape, dtype=q.dtype, gen=torch.Generator().manual_seed(trial))
            grads = _backward(dout, q, k, v, out, lse, None, call)
            check_backward(grads, dout, None, q, k, v, ref_out, ref_lse, call.args)
        except AssertionError as exc:
            raise AssertionError(f"{config}: {exc}") from None


def test_random_windows_and_lengths(interpreter):
    """Many small problems, so that window edges land on every position of the tiles: the block
    ranges (`key_range`, `query_range`) must never skip a block that holds a visible pair."""
    interpreter.run(_check_random_windows, 0, 30)


def _check_backward_without_lse_gradient():
    q, k, v, call = _problem(F16, causal=True, seqlen_q=30, seqlen_k=45)
    out, lse = _forward(q, k, v, call)
    ref_out, ref_lse = check_forward(out, lse, q, k, v, call.args)
    dout = _randn(*out.shape, dtype=q.dtype, gen=torch.Generator().manual_seed(2))
    grads = _backward(dout, q, k, v, out, lse, None, call)
    check_backward(grads, dout, None, q, k, v, ref_out, ref_lse, call.args)


def test_backward_without_lse_gradient(interpreter):
    interpreter.run(_check_backward_without_lse_gradient)


def _check_strided():
    gen = torch.Generator().manual_seed(3)
    qkv = _randn(2, 29, 3, 3, 25, dtype=F16, gen=gen)[..., 1:17]  # q: strides (2175, 225, 25, 1)
    q, k, v = qkv.unbind(2)
    call = api.validate(q, k, v, causal=True)
    out = torch.full((2, 29, 3, 40), math.nan, dtype=F16)[..., 5:21]
    lse = torch.full((2, 3, 31), math.nan)[..., 1:30]
    TritonBackend().fwd(q, k, v, out, lse, call.args)
    ref_out, ref_lse = check_forward(out, lse, q, k, v, call.args)
    dout = _randn(2, 29, 3, 16, dtype=F16, gen=gen)
    grads = [torch.full((2, 29, 3, 33), math.nan, dtype=F16)[..., 3:19] for _ in range(3)]
    TritonBackend().bwd(dout, q, k, v, out, lse, None, *grads, call.args, deterministic=True)
    check_backward(grads, dout, None, q, k, v, ref_out, ref_lse, call.args)


def test_strided_inputs_and_outputs(interpreter):
    """q, k, v as slices of one packed qkv tensor (odd strides, offset pointers), out, LSE and
    the gradients strided too: every tensor is addressed through its own strides."""
    interpreter.run(_check_strided)


def _check_rows_without_keys():
    # Causal with seqlen_q > seqlen_k hides every key from the first rows; sequence 1 uses no key.
    q, k, v, call = _problem(F16, causal=True, seqlen_q=40, seqlen_k=16, seqused_k=[16, 0])
    out, lse = _forward(q, k, v, call)
    dead = torch.zeros(2, 40, dtype=torch.bool)
    dead[0, :24] = True
    dead[1] = True
    assert torch.equal(torch.isneginf(lse), dead[:, None, :].expand(2, 4, 40))
    assert (out[dead] == 0).all() and not out.isnan().any()
    dout = _randn(*out.shape, dtype=F16, gen=torch.Generator().manual_seed(4))
    dq, dk, dv = _backward(dout, q, k, v, out, lse, None, call)
    assert (dq[dead] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert not any(t.isnan().any() for t in (dq, dk, dv))


def test_rows_without_keys_give_zero_output_and_minus_inf_lse(interpreter):
    interpreter.run(_check_rows_without_keys)


def _check_rounding(dtype):
    gen = torch.Generator().manual_seed(5)
    q = torch.zeros(1, 32, 2, 16, dtype=dtype)
    k = _randn(1, 64, 2, 16, dtype=dtype, gen=gen)
    v = (1 + torch.randint(0, 65, (1, 64, 2, 32), generator=gen) / 64).to(dtype)
    call = api.validate(q, k, v)
    out, _ = _forward(q, k, v, call)
    exact = v.double().mean(1, keepdim=True).expand(1, 32, 2, 32)
    assert torch.equal(out, exact.to(dtype))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_output_is_rounded_to_nearest_even(interpreter, dtype):
    """q = 0 makes every row the plain mean of 64 values of V from a 2^-6 grid in [1, 2]: exact
    in fp32, a multiple of 2^-12 near 1.5, so rounding to 16 bits has ties and near-ties and
    only round-to-nearest-even matches."""
    if dtype == BF16:
        pytest.skip("the Triton interpreter truncates fp32 -> bf16 (the GPU test covers bf16)")
    interpreter.run(_check_rounding, dtype)


def _kernel_kinds():
    from triton.runtime.interpreter import InterpretedFunction

    from cute_flash.kernels.triton import bwd, fwd

    kernels = (fwd.attn_fwd, bwd.attn_bwd_delta, bwd.attn_bwd_dkdv, bwd.attn_bwd_dq)
    interpreted = all(isinstance(kernel, InterpretedFunction) for kernel in kernels)
    return interpreted, [TritonBackend._dot_in_fp32(dtype, fwd.attn_fwd) for dtype in (F16, BF16, F32)]


def test_kernels_are_interpreted_and_bf16_multiplies_in_fp32(interpreter):
    assert interpreter.run(_kernel_kinds) == (True, [False, True, True])


def test_features_are_declared_and_paged_and_split_kv_refused(monkeypatch):
    backend = TritonBackend()
    assert backend.features <= set(FEATURES)
    assert {"paged_kv", "split_kv"}.isdisjoint(backend.features)
    monkeypatch.setattr(backends, "resolve", lambda name, device: backend)
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=F16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="triton.*split_kv"):
        api.validate(q, k, v, num_splits=2)
    pages = torch.randn(4, 8, 2, 16, dtype=F16)
    with pytest.raises(NotImplementedError, match="triton.*paged_kv"):
        api.validate(q, pages, pages, page_table=torch.zeros(1, 1, dtype=torch.int32))


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_rocm_import_selects_the_triton_kernels():
    """A fresh import on a ROCm build of PyTorch (simulated) binds the default to this backend."""
    res = _python(
        """
        import torch
        torch.version.hip = "6.2.0"
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_capability = lambda *a: (9, 4)
        torch.cuda.get_device_name = lambda *a: "AMD Instinct MI300X"
        import cute_flash
        from cute_flash import backends
        from cute_flash.backends.triton import TritonBackend
        assert backends.DEFAULT.name == "triton", backends.DEFAULT
        assert "ROCm" in backends.DEFAULT.reason, backends.DEFAULT.reason
        chosen = backends.resolve(None, torch.device("cuda"))
        assert isinstance(chosen, TritonBackend), type(chosen)
        assert cute_flash.backend_info()["features"]["triton"]["varlen"]
        print("ok")
        """
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_import_without_triton_works_and_names_what_is_missing():
    res = _python(
        """
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoTriton())
        import torch
        import cute_flash
        from cute_flash import api, backends
        from cute_flash.backends.triton import TritonBackend

        q = torch.randn(1, 8, 2, 16)
        assert cute_flash.forward(q, q, q).shape == q.shape
        backend = TritonBackend()
        print(backend.unavailable_reason())
        backends.resolve = lambda name, device: backend
        try:
            api.validate(q.half(), q.half(), q.half())
        except ValueError as exc:
            print(exc)
        assert "triton" not in sys.modules
        """
    )
    assert res.returncode == 0, res.stderr
    reason = "triton is not installed: pip install 'cute-flash[triton]'"
    assert res.stdout.splitlines() == [reason, f"backend 'triton' cannot run here: {reason}"]
