"""The custom ops under torch.library's checks, torch.compile and torch.export."""

import contextlib

import pytest
import torch

import cute_flash
from reference_math import naive_attention


def _qkv(b=2, sq=9, sk=11, h=4, hk=2, d=16, dv=24, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=g, requires_grad=requires_grad)
    k = torch.randn(b, sk, hk, d, generator=g, requires_grad=requires_grad)
    v = torch.randn(b, sk, hk, dv, generator=g, requires_grad=requires_grad)
    return q, k, v


def _fwd_args(q, k, v, causal=True, cu_q=None, cu_k=None):
    return (q, k, v, cu_q, cu_k, None, None, causal, None, [-1, 0 if causal else -1], 0.0, None, None, 0, False, None, None)


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_fwd(causal):
    q, k, v = _qkv(requires_grad=True)
    torch.library.opcheck(torch.ops.cute_flash.fwd.default, _fwd_args(q, k, v, causal))


def test_opcheck_fwd_varlen():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(10, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(10, 2, 16, generator=g, requires_grad=True)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 10], dtype=torch.int32)
    torch.library.opcheck(torch.ops.cute_flash.fwd.default, _fwd_args(q, k, v, True, cu_q, cu_k))


def test_opcheck_fwd_out():
    q, k, v = _qkv()
    out = torch.empty(2, 9, 4, 24)
    args = (q, k, v, out, None, None, None, None, False, 0.5, [-1, -1], 0.0, None, None, 0, None, None)
    torch.library.opcheck(torch.ops.cute_flash.fwd_out.default, args)


def test_opcheck_bwd():
    q, k, v = _qkv()
    out, lse = torch.ops.cute_flash.fwd(*_fwd_args(q, k, v))
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, None, None, None, None, True, None, [-1, 0], 0.0, None, None, False, None)
    torch.library.opcheck(torch.ops.cute_flash.bwd.default, args)


class TinyAttentionModel(torch.nn.Module):
    def __init__(self, hidden=32, nheads=4):
        super().__init__()
        self.nheads = nheads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.nheads, -1).unbind(2)
        return self.proj(cute_flash.attention(q, k, v, causal=True).flatten(2))


def test_compile_fullgraph_forward_and_backward_match_eager():
    torch.manual_seed(0)
    model = TinyAttentionModel()
    x = torch.randn(2, 13, 32)
    eager = model(x)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    got.square().sum().backward()
    torch.testing.assert_close(got, eager)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g)


def test_compile_inductor_fullgraph():
    torch.manual_seed(0)
    q, k, v = _qkv(requires_grad=True)
    fn = torch.compile(lambda q, k, v: cute_flash.attention(q, k, v, causal=True).sum(), fullgraph=True)
    fn(q, k, v).backward()
    ref, _ = naive_attention(q.detach(), k.detach(), v.detach(), 0.25, -1, 0)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive_attention(q2, k2, v2, 0.25, -1, 0)[0].sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)


def test_export_module_calling_attention():
    model = TinyAttentionModel().eval()
    x = torch.randn(2, 13, 32)
    exported = torch.export.export(model, (x,))
    assert any("cute_flash" in str(n.target) for n in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x), model(x))


def test_lse_gradient_flows():
    q, k, v = _qkv(requires_grad=True)
    _, lse = cute_flash.attention(q, k, v, return_lse=True)
    lse.sum().backward()
    # d lse / d v = 0 (lse does not depend on v); d lse / d q != 0.
    assert torch.all(v.grad == 0) and q.grad.abs().sum() > 0


class _ForwardModule(torch.nn.Module):
    def forward(self, q, k, v):
        return cute_flash.forward(q, k, v, causal=True)


def test_export_module_calling_forward_records_the_op():
    q, k, v = _qkv()
    exported = torch.export.export(_ForwardModule(), (q, k, v))
    assert any("cute_flash" in str(n.target) for n in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(q, k, v), cute_flash.forward(q, k, v, causal=True))


def test_forward_under_vmap_takes_the_op_not_the_direct_path():
    # vmap's batched tensors are plain torch.Tensors without storage: the direct path cannot
    # read them, the op (with the dispatcher's per-sample fallback) can
    q, k, v = _qkv()
    stacked = [torch.stack([t, t.flip(0)]) for t in (q, k, v)]
    got = torch.vmap(lambda q_, k_, v_: cute_flash.forward(q_, k_, v_, causal=True))(*stacked)
    for i in range(2):
        want = cute_flash.forward(*(t[i] for t in stacked), causal=True)
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)


def test_forward_without_autograd_runs_the_ops_implementation_directly_with_the_same_result():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv()
    assert cute_flash._plain_eager(q, k, v, None)
    with FakeTensorMode() as mode:
        assert not cute_flash._plain_eager(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), None)

    with _Record() as rec:
        traced, traced_lse = cute_flash.forward(q, k, v, causal=True, return_lse=True)
    assert any("cute_flash" in name for name in rec.ops)  # under a dispatch mode the op is what runs

    direct, lse = cute_flash.forward(q, k, v, causal=True, return_lse=True)
    op_out, op_lse = torch.ops.cute_flash.fwd(*_fwd_args(q, k, v, True))
    for got in (direct, traced):
        torch.testing.assert_close(got, op_out, rtol=0, atol=0)
    for got in (lse, traced_lse):
        torch.testing.assert_close(got, op_lse, rtol=0, atol=0)
    into = torch.full_like(op_out, float("nan"))
    assert cute_flash.forward(q, k, v, causal=True, out=into) is into
    torch.testing.assert_close(into, op_out, rtol=0, atol=0)


def test_forward_with_autograd_is_differentiable():
    q, k, v = _qkv(requires_grad=True)
    out = cute_flash.forward(q, k, v, causal=True)
    assert out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    with torch.no_grad():
        assert cute_flash.forward(q, k, v, causal=True).grad_fn is None


# --- the direct autograd path (`ops.Attention`) against the op's


@contextlib.contextmanager
def _op_path(monkeypatch):
    """`attention` and `forward` take the op inside, as under a tracer."""
    with monkeypatch.context() as m:
        m.setattr(cute_flash, "_plain_eager", lambda *tensors: False)
        yield


def _takes_direct_path(t):
    return t.grad_fn is not None and type(t.grad_fn)._forward_cls is cute_flash.ops.Attention


def _takes_op_path(t):
    return t.grad_fn is not None and "cute_flash_fwd" in type(t.grad_fn).__name__


def _varlen_qkv():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(12, 4, 16, generator=g)
    k = torch.randn(13, 2, 16, generator=g)
    v = torch.randn(13, 2, 24, generator=g)
    cu = dict(cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0, 6, 13], dtype=torch.int32))
    return (q, k, v), cu


def _step(inputs, loss, **kwargs):
    """out, lse, dq, dk, dv of one forward + backward, and out (for its grad_fn)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    if loss == "out":
        out = cute_flash.attention(q, k, v, **kwargs)
        lse = None
    else:
        out, lse = cute_flash.attention(q, k, v, return_lse=True, **kwargs)
    g = torch.Generator().manual_seed(3)
    total = 0
    if loss in ("out", "out+lse"):
        total = total + (out * torch.randn(out.shape, generator=g)).sum()
    if loss in ("lse", "out+lse"):  # a gradient flows into the LSE
        total = total + (lse * torch.randn(lse.shape, generator=g)).sum()
    total.backward()
    return out, [out, lse, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("loss", ["out", "out+lse", "lse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["gqa", "mha", "varlen"])
def test_attention_direct_path_matches_the_op_bitwise(monkeypatch, layout, causal, loss):
    if layout == "varlen":
        inputs, kwargs = _varlen_qkv()
    else:
        inputs, kwargs = _qkv(hk=2 if layout == "gqa" else 4), {}
    direct_out, direct = _step(inputs, loss, causal=causal, **kwargs)
    assert _takes_direct_path(direct_out)
    with _op_path(monkeypatch):
        op_out, via_op = _step(inputs, loss, causal=causal, **kwargs)
    assert _takes_op_path(op_out)
    for got, want in zip(direct, via_op):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    if loss == "lse":  # d lse / d v = 0: the LSE's gradient reached the backward alone
        assert torch.all(direct[4] == 0) and direct[2].abs().sum() > 0


def test_forward_with_autograd_takes_the_direct_path_with_the_ops_gradients(monkeypatch):
    q, k, v = _qkv(requires_grad=True)
    out = cute_flash.forward(q, k, v, causal=True)
    assert _takes_direct_path(out)
    out.sum().backward()
    grads = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with _op_path(monkeypatch):
        out2 = cute_flash.forward(q2, k2, v2, causal=True)
    assert _takes_op_path(out2)
    out2.sum().backward()
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Record(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_attention_with_autograd_under_a_dispatch_mode_runs_the_ops():
    q, k, v = _qkv(requires_grad=True)
    with _Record() as rec:
        out = cute_flash.attention(q, k, v, causal=True)
        out.sum().backward()
    assert _takes_op_path(out)
    assert "cute_flash.fwd.default" in rec.ops and "cute_flash.bwd.default" in rec.ops


def test_attention_under_compile_records_the_ops_in_both_graphs():
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = {}

    def record(name):
        def compiler(gm, example_inputs):
            graphs[name] = [str(n.target) for n in gm.graph.nodes]
            return make_boxed_func(gm.forward)
        return compiler

    q, k, v = _qkv(requires_grad=True)
    backend = aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"))
    fn = torch.compile(lambda q, k, v: cute_flash.attention(q, k, v, causal=True).sum(), backend=backend,
                       fullgraph=True)
    fn(q, k, v).backward()
    assert any("cute_flash.fwd" in t for t in graphs["fw"])
    assert any("cute_flash.bwd" in t for t in graphs["bw"])


def test_paged_forward_with_autograd_has_no_backward_on_either_path(monkeypatch):
    q = torch.randn(2, 3, 4, 16, requires_grad=True)
    k, v = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    out = cute_flash.forward(q, k, v, page_table=table)
    assert _takes_direct_path(out)
    with pytest.raises(NotImplementedError, match="paged KV cache"):
        out.sum().backward()
    with _op_path(monkeypatch):
        out = cute_flash.forward(q, k, v, page_table=table)
    assert _takes_op_path(out)
    with pytest.raises(NotImplementedError, match="paged KV cache"):
        out.sum().backward()


def test_the_backward_backend_gets_the_same_arguments_on_both_paths(monkeypatch):
    """deterministic passed through, one split (as `bwd` validates); an unused LSE's gradient is
    zeros on the op path and None on the direct path (which skips the fill)."""
    from cute_flash.backends.reference import ReferenceBackend

    seen = []
    real_bwd = ReferenceBackend.bwd

    def bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args, deterministic):
        seen.append((deterministic, args.num_splits, dlse is None or bool(dlse.eq(0).all())))
        return real_bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, args, deterministic)

    monkeypatch.setattr(ReferenceBackend, "bwd", bwd)

    def steps():
        q, k, v = _qkv(requires_grad=True)
        for det in (True, False):
            out = cute_flash.attention(q, k, v, deterministic=det)
            out.sum().backward()
        out = cute_flash.forward(q, k, v, num_splits=3)
        out.sum().backward()
        return out

    assert _takes_direct_path(steps())
    direct, seen[:] = list(seen), []
    assert direct == [(True, 1, True), (False, 1, True), (False, 1, True)]
    with _op_path(monkeypatch):
        assert _takes_op_path(steps())
    assert seen == direct


def test_attention_has_no_double_backward_on_either_path(monkeypatch):
    for path in ("direct", "op"):
        q, k, v = _qkv(requires_grad=True)
        with _op_path(monkeypatch) if path == "op" else contextlib.nullcontext():
            out = cute_flash.attention(q, k, v, causal=True)
        dq, = torch.autograd.grad(out.sum(), q, create_graph=True)
        assert dq.requires_grad, path  # a gradient penalty cannot silently treat dq as a constant
        with pytest.raises(RuntimeError):
            dq.square().sum().backward()


def test_attention_inputs_modified_in_place_before_backward_raise_on_either_path(monkeypatch):
    for path in ("direct", "op"):
        q, k, v = (t.detach().clone().requires_grad_() for t in _qkv())
        k_in = k * 1
        with _op_path(monkeypatch) if path == "op" else contextlib.nullcontext():
            out = cute_flash.attention(q, k_in, v)
        k_in.add_(1)
        with pytest.raises(RuntimeError, match="inplace"):
            out.sum().backward()


def test_attention_without_autograd_has_no_grad_fn():
    q, k, v = _qkv(requires_grad=True)
    with torch.no_grad():
        out = cute_flash.attention(q, k, v, causal=True)
    assert out.grad_fn is None
    torch.testing.assert_close(out, cute_flash.forward(q.detach(), k.detach(), v.detach(), causal=True), rtol=0, atol=0)


def test_parameters_as_inputs_take_the_direct_path_with_the_ops_gradients(monkeypatch):
    q, k, v = (torch.nn.Parameter(t) for t in _qkv())
    out = cute_flash.attention(q, k, v, causal=True)
    assert _takes_direct_path(out)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with _op_path(monkeypatch):
        out2 = cute_flash.attention(q, k, v, causal=True)
    assert _takes_op_path(out2)
    out2.sum().backward()
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=0, atol=0)
