"""Every bad argument gets a ValueError/TypeError naming it, and nothing is computed."""

import math

import pytest
import torch

import cute_flash


def qkv(b=2, sq=5, sk=7, h=4, hk=2, d=16, dv=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, sk, hk, d, generator=g, dtype=dtype)
    v = torch.randn(b, sk, hk, dv or d, generator=g, dtype=dtype)
    return q, k, v


def varlen(lens_q=(3, 4), lens_k=(5, 2), h=4, hk=2, d=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), h, d, generator=g)
    k = torch.randn(sum(lens_k), hk, d, generator=g)
    v = torch.randn(sum(lens_k), hk, d, generator=g)
    cu = lambda lens: torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


def paged(batch=2, num_pages=6, page_size=4, hk=2, d=16, max_pages=3):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 3, 4, d, generator=g)
    k = torch.randn(num_pages, page_size, hk, d, generator=g)
    v = torch.randn(num_pages, page_size, hk, d, generator=g)
    table = torch.arange(batch * max_pages, dtype=torch.int32).view(batch, max_pages) % num_pages
    return q, k, v, table


def _bad(**over):
    """A call description: tensors plus keyword overrides."""
    return over


Q, K, V = qkv()
VQ, VK, VV, CU_Q, CU_K = varlen()
PQ, PK, PV, PT = paged()

CASES = {
    # --- tensor types and dtypes
    "q_not_tensor": (TypeError, "q", lambda: cute_flash.forward(Q.numpy(), K, V)),
    "k_not_tensor": (TypeError, "k", lambda: cute_flash.forward(Q, [1, 2], V)),
    "v_not_tensor": (TypeError, "v", lambda: cute_flash.forward(Q, K, None)),
    "q_int_dtype": (TypeError, "q", lambda: cute_flash.forward(Q.int(), K.int(), V.int())),
    "k_dtype_differs": (TypeError, "k", lambda: cute_flash.forward(Q, K.double(), V)),
    "v_dtype_differs": (TypeError, "v", lambda: cute_flash.forward(Q, K, V.half())),
    # --- ranks and shapes
    "q_rank_2": (ValueError, "q", lambda: cute_flash.forward(Q[0, 0], K, V)),
    "q_rank_5": (ValueError, "q", lambda: cute_flash.forward(Q[None], K, V)),
    "k_rank_3_without_varlen": (ValueError, "k", lambda: cute_flash.forward(Q, K[0], V[0])),
    "k_headdim_differs": (ValueError, "k head dim", lambda: cute_flash.forward(Q, torch.randn(2, 7, 2, 24), torch.randn(2, 7, 2, 24))),
    "v_seqlen_differs": (ValueError, "v", lambda: cute_flash.forward(Q, K, V[:, :3])),
    "v_heads_differ": (ValueError, "v", lambda: cute_flash.forward(Q, K, torch.randn(2, 7, 1, 16))),
    "gqa_not_divisible": (ValueError, "nheads", lambda: cute_flash.forward(torch.randn(2, 5, 3, 16), K, V)),
    "batch_differs": (ValueError, "batch", lambda: cute_flash.forward(Q, K[:1], V[:1])),
    "headdim_not_multiple_of_8": (ValueError, "headdim", lambda: cute_flash.forward(*qkv(d=12))),
    "headdim_too_large": (ValueError, "headdim", lambda: cute_flash.forward(*qkv(d=264))),
    "headdim_v_not_multiple_of_8": (ValueError, "headdim_v", lambda: cute_flash.forward(*qkv(dv=20))),
    "headdim_v_too_large": (ValueError, "headdim_v", lambda: cute_flash.forward(*qkv(dv=512))),
    # --- strides
    "q_last_dim_strided": (ValueError, "q", lambda: cute_flash.forward(torch.randn(2, 5, 4, 32)[..., ::2], K, V)),
    "v_last_dim_strided": (ValueError, "v", lambda: cute_flash.forward(Q, K, torch.randn(2, 7, 2, 32)[..., ::2])),
    # --- scalars
    "causal_not_bool": (TypeError, "causal", lambda: cute_flash.forward(Q, K, V, causal=1)),
    "softmax_scale_str": (TypeError, "softmax_scale", lambda: cute_flash.forward(Q, K, V, softmax_scale="0.1")),
    "softmax_scale_nan": (ValueError, "softmax_scale", lambda: cute_flash.forward(Q, K, V, softmax_scale=math.nan)),
    "softmax_scale_inf": (ValueError, "softmax_scale", lambda: cute_flash.forward(Q, K, V, softmax_scale=math.inf)),
    "softmax_scale_zero": (ValueError, "softmax_scale", lambda: cute_flash.forward(Q, K, V, softmax_scale=0.0)),
    "softcap_negative": (ValueError, "softcap", lambda: cute_flash.forward(Q, K, V, softcap=-1.0)),
    "softcap_nan": (ValueError, "softcap", lambda: cute_flash.forward(Q, K, V, softcap=math.nan)),
    "softcap_bool": (TypeError, "softcap", lambda: cute_flash.forward(Q, K, V, softcap=True)),
    "window_not_pair": (TypeError, "window_size", lambda: cute_flash.forward(Q, K, V, window_size=(1, 2, 3))),
    "window_float": (TypeError, "window_size", lambda: cute_flash.forward(Q, K, V, window_size=(1.5, 0))),
    "window_below_minus_one": (ValueError, "window_size", lambda: cute_flash.forward(Q, K, V, window_size=(-2, 0))),
    "causal_with_right_window": (ValueError, "causal", lambda: cute_flash.forward(Q, K, V, causal=True, window_size=(4, 3))),
    "num_splits_negative": (ValueError, "num_splits", lambda: cute_flash.forward(Q, K, V, num_splits=-1)),
    "num_splits_float": (TypeError, "num_splits", lambda: cute_flash.forward(Q, K, V, num_splits=2.0)),
    "return_lse_not_bool": (TypeError, "return_lse", lambda: cute_flash.forward(Q, K, V, return_lse="yes")),
    "unknown_backend": (ValueError, "backend", lambda: cute_flash.forward(Q, K, V, backend="cudnn")),
    "cute_backend_on_cpu": (ValueError, "backend", lambda: cute_flash.forward(Q, K, V, backend="cute-sm80")),
    "max_seqlen_negative": (ValueError, "max_seqlen_q", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=-1)),
    "deterministic_not_bool": (TypeError, "deterministic", lambda: cute_flash.attention(Q, K, V, deterministic=None)),
    "check_not_bool": (TypeError, "check", lambda: cute_flash.forward(Q, K, V, check="on")),
    # --- out
    "out_wrong_shape": (ValueError, "out", lambda: cute_flash.forward(Q, K, V, out=torch.empty(2, 5, 4, 8))),
    "out_wrong_dtype": (ValueError, "out", lambda: cute_flash.forward(Q, K, V, out=torch.empty(2, 5, 4, 16, dtype=torch.float64))),
    "out_not_tensor": (TypeError, "out", lambda: cute_flash.forward(Q, K, V, out=[0.0])),
    "out_strided_last_dim": (ValueError, "out", lambda: cute_flash.forward(Q, K, V, out=torch.empty(2, 5, 4, 32)[..., ::2])),
    "out_with_grad": (ValueError, "out=", lambda: cute_flash.forward(Q.clone().requires_grad_(), K, V, out=torch.empty_like(Q))),
    # --- varlen
    "cu_seqlens_q_int64": (TypeError, "cu_seqlens_q", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q.long(), cu_seqlens_k=CU_K)),
    "cu_seqlens_k_float": (TypeError, "cu_seqlens_k", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K.float())),
    "cu_seqlens_q_2d": (ValueError, "cu_seqlens_q", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q[None], cu_seqlens_k=CU_K)),
    "cu_seqlens_q_too_short": (ValueError, "cu_seqlens_q", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q[:1], cu_seqlens_k=CU_K[:1])),
    "cu_seqlens_q_not_from_zero": (ValueError, "cu_seqlens_q[0]", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32), cu_seqlens_k=CU_K)),
    "cu_seqlens_q_decreasing": (ValueError, "non-decreasing", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=torch.tensor([0, 5, 3, 7], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 2, 4, 7], dtype=torch.int32))),
    "cu_seqlens_q_wrong_total": (ValueError, "cu_seqlens_q[-1]", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32), cu_seqlens_k=CU_K)),
    "cu_seqlens_k_wrong_total": (ValueError, "cu_seqlens_k[-1]", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=torch.tensor([0, 5, 6], dtype=torch.int32))),
    "cu_seqlens_k_batch_differs": (ValueError, "cu_seqlens_k", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32))),
    "cu_seqlens_k_without_q": (ValueError, "cu_seqlens_k", lambda: cute_flash.forward(Q, VK, VV, cu_seqlens_k=CU_K)),
    "cu_seqlens_q_without_k": (ValueError, "cu_seqlens_q", lambda: cute_flash.forward(VQ, K, V, cu_seqlens_q=CU_Q)),
    "varlen_q_rank_4": (ValueError, "q", lambda: cute_flash.forward(VQ[None], VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)),
    "max_seqlen_q_too_small": (ValueError, "max_seqlen_q", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=2)),
    "max_seqlen_k_too_small": (ValueError, "max_seqlen_k", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_k=3)),
    # --- seqused_k
    "seqused_k_int64": (TypeError, "seqused_k", lambda: cute_flash.forward(Q, K, V, seqused_k=torch.tensor([1, 2]))),
    "seqused_k_wrong_batch": (ValueError, "seqused_k", lambda: cute_flash.forward(Q, K, V, seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32))),
    "seqused_k_beyond_cache": (ValueError, "seqused_k[1]", lambda: cute_flash.forward(Q, K, V, seqused_k=torch.tensor([1, 8], dtype=torch.int32))),
    "seqused_k_negative": (ValueError, "seqused_k[0]", lambda: cute_flash.forward(Q, K, V, seqused_k=torch.tensor([-1, 2], dtype=torch.int32))),
    "seqused_k_beyond_varlen_sequence": (ValueError, "seqused_k[1]", lambda: cute_flash.forward(VQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, seqused_k=torch.tensor([5, 3], dtype=torch.int32))),
    # --- paged KV
    "page_table_int64": (TypeError, "page_table", lambda: cute_flash.forward(PQ, PK, PV, page_table=PT.long())),
    "page_table_1d": (ValueError, "page_table", lambda: cute_flash.forward(PQ, PK, PV, page_table=PT[0])),
    "page_table_wrong_batch": (ValueError, "page_table", lambda: cute_flash.forward(PQ, PK, PV, page_table=PT[:1])),
    "page_table_out_of_range": (ValueError, "page_table[1, 2]", lambda: cute_flash.forward(PQ, PK, PV, page_table=torch.tensor([[0, 1, 2], [3, 4, 6]], dtype=torch.int32))),
    "page_table_negative_used_entry": (ValueError, "page_table[0, 0]", lambda: cute_flash.forward(PQ, PK, PV, page_table=torch.tensor([[-1, 1, 2], [3, 4, 5]], dtype=torch.int32))),
    "paged_with_cu_seqlens_k": (ValueError, "page_table", lambda: cute_flash.forward(VQ, PK, PV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, page_table=PT)),
    "paged_seqused_beyond_table": (ValueError, "seqused_k[0]", lambda: cute_flash.forward(PQ, PK, PV, page_table=PT, seqused_k=torch.tensor([13, 1], dtype=torch.int32))),
    "page_table_device_differs": (ValueError, "page_table", lambda: cute_flash.forward(PQ, PK, PV, page_table=PT.to("meta"))),
    # --- devices
    "k_on_other_device": (ValueError, "k", lambda: cute_flash.forward(Q, K.to("meta"), V)),
    "out_on_other_device": (ValueError, "out", lambda: cute_flash.forward(Q, K, V, out=torch.empty(2, 5, 4, 16, device="meta"))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_naming_the_argument(case):
    exc, needle, call = CASES[case]
    with pytest.raises(exc) as info:
        call()
    assert needle in str(info.value), f"message does not name {needle!r}: {info.value}"


def test_unused_page_table_entries_may_hold_anything():
    table = torch.tensor([[0, 1, -1], [3, 99, -7]], dtype=torch.int32)
    out = cute_flash.forward(PQ, PK, PV, page_table=table, seqused_k=torch.tensor([5, 4], dtype=torch.int32))
    assert torch.isfinite(out).all()


def test_at_least_forty_bad_input_cases():
    assert len(CASES) >= 40


def test_attention_rejects_paged_and_split_arguments():
    with pytest.raises(TypeError):
        cute_flash.attention(PQ, PK, PV, page_table=PT)  # inference-only argument


GQ, GVQ, GPQ = (t.clone().requires_grad_() for t in (Q, VQ, PQ))

# Bad input to the differentiable calls (q requires grad).
GRAD_CASES = {
    "k_dtype_differs": lambda: cute_flash.attention(GQ, K.double(), V),
    "q_rank_2": lambda: cute_flash.attention(GQ[0, 0], K, V),
    "k_rank_3_without_varlen": lambda: cute_flash.attention(GQ, K[0], V[0]),
    "batch_differs": lambda: cute_flash.attention(GQ, K[:1], V[:1]),
    "headdim_not_multiple_of_8": lambda: cute_flash.attention(*(t.requires_grad_() for t in qkv(d=12))),
    "v_last_dim_strided": lambda: cute_flash.attention(GQ, K, torch.randn(2, 7, 2, 32)[..., ::2]),
    "causal_not_bool": lambda: cute_flash.attention(GQ, K, V, causal=1),
    "softmax_scale_nan": lambda: cute_flash.attention(GQ, K, V, softmax_scale=math.nan),
    "softcap_bool": lambda: cute_flash.attention(GQ, K, V, softcap=True),
    "window_float": lambda: cute_flash.attention(GQ, K, V, window_size=(1.5, 0)),
    "causal_with_right_window": lambda: cute_flash.attention(GQ, K, V, causal=True, window_size=(4, 3)),
    "unknown_backend": lambda: cute_flash.attention(GQ, K, V, backend="cudnn"),
    "cute_backend_on_cpu": lambda: cute_flash.attention(GQ, K, V, backend="cute-sm80"),
    "return_lse_not_bool": lambda: cute_flash.attention(GQ, K, V, return_lse=1),
    "deterministic_not_bool": lambda: cute_flash.attention(GQ, K, V, deterministic=None),
    "check_not_bool": lambda: cute_flash.attention(GQ, K, V, check="on"),
    "cu_seqlens_q_int64": lambda: cute_flash.attention(GVQ, VK, VV, cu_seqlens_q=CU_Q.long(), cu_seqlens_k=CU_K),
    "cu_seqlens_q_without_k": lambda: cute_flash.attention(GVQ, K, V, cu_seqlens_q=CU_Q),
    "max_seqlen_k_too_small": lambda: cute_flash.attention(GVQ, VK, VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_k=3),
    "seqused_k_beyond_cache": lambda: cute_flash.attention(GQ, K, V, seqused_k=torch.tensor([1, 8], dtype=torch.int32)),
    "k_on_other_device": lambda: cute_flash.attention(GQ, K.to("meta"), V),
    "forward_num_splits_float": lambda: cute_flash.forward(GQ, K, V, num_splits=2.0),
    "forward_page_table_out_of_range": lambda: cute_flash.forward(GPQ, PK, PV, page_table=torch.tensor([[0, 1, 2], [3, 4, 6]], dtype=torch.int32)),
}


def _raised(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - any exception is compared
        return type(e), str(e)
    return None


@pytest.mark.parametrize("case", sorted(CASES) + [f"grad:{c}" for c in sorted(GRAD_CASES)])
def test_the_direct_path_and_the_op_raise_the_same(monkeypatch, case):
    """`forward`/`attention` run `api.validate` themselves where nothing else would see the op
    (`cute_flash._plain_eager`), or go through the op: the same error either way."""
    call = GRAD_CASES[case[5:]] if case.startswith("grad:") else CASES[case][2]
    direct = _raised(call)
    monkeypatch.setattr(cute_flash, "_plain_eager", lambda *tensors: False)
    via_op = _raised(call)
    assert direct is not None and direct[0] in (TypeError, ValueError)
    assert direct == via_op
