"""The torch backend's SDPA path (`ioattn.ops.torch_backend.sdpa_forward`, torch's own CPU kernel): every case the
plan routes to it, against the float64 reference (out and LSE), with the route asserted, and the tiled forward on
the same inputs (it stays the path for windows, and must agree wherever both run)."""

from __future__ import annotations

import pytest
import torch

import ioattn
from ioattn.ops import checks, dispatch, torch_backend
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LSE_TOL = 1e-4


def qkv(b, n_q, n_k, h_q, h_kv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=gen).to(dtype) for n, h in ((n_q, h_q), (n_k, h_kv), (n_k, h_kv)))


def tiled(inputs):
    """The tiled forward on the same validated inputs: (out, lse)."""
    out = torch.empty(inputs.q.shape, dtype=inputs.q.dtype)
    rows = (inputs.q.shape[1], inputs.q.shape[0]) if inputs.varlen else \
        (inputs.q.shape[0], inputs.q.shape[2], inputs.q.shape[1])
    lse = torch.empty(rows, dtype=torch.float32)
    torch_backend.attention_forward(inputs, out, lse)
    return out, lse


# (B, Nq, Nk, Hq, Hkv, D, causal): square, Nq > Nk, Nq < Nk (two merged calls), decode, GQA and MQA.
DENSE_CASES = [
    (2, 33, 33, 4, 4, 32, False), (2, 33, 33, 4, 4, 32, True), (1, 40, 17, 6, 2, 64, True),
    (1, 17, 70, 6, 2, 64, True), (3, 1, 50, 8, 1, 16, True), (1, 24, 61, 4, 2, 40, False),
]


@pytest.mark.parametrize("case", DENSE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attn_func_on_sdpa(case, dtype):
    b, n_q, n_k, h_q, h_kv, d, causal = case
    q, k, v = qkv(b, n_q, n_k, h_q, h_kv, d, dtype)
    assert ioattn.explain(q, k, v, causal=causal).kernel == dispatch.TORCH_SDPA_KERNEL
    out, lse = ioattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (b, h_q, n_q)
    assert rel_error(out, ref_out) < TOLERANCE[dtype] and lse_error(lse, ref_lse) < LSE_TOL
    if causal and n_q > n_k:  # bottom-right: the first Nq - Nk queries see no key
        assert out[:, :n_q - n_k].abs().max() == 0 and torch.isneginf(lse[:, :, :n_q - n_k]).all()
    tiled_out, tiled_lse = tiled(checks.validate_dense(q, k, v, causal, (-1, -1), None))
    assert rel_error(out, tiled_out) < 2 * TOLERANCE[dtype] and lse_error(lse, tiled_lse) < LSE_TOL


def test_zero_length_and_strided_inputs():
    q, k, v = qkv(2, 5, 0, 4, 2, 16, torch.float32)
    out, lse = ioattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.abs().max() == 0 and torch.isneginf(lse).all()
    out, lse = ioattn.flash_attn_func(q[:, :0], k, v, return_lse=True)
    assert out.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)
    wide = torch.randn(1, 12, 2, 32)[..., ::2]  # last stride 2: copied for the kernel, which needs stride 1
    _, k, v = qkv(1, 12, 12, 2, 2, 16, torch.float32)
    assert "q copied (last stride != 1)" in ioattn.explain(wide, k, v, causal=True).reason
    out = ioattn.flash_attn_func(wide, k, v, causal=True)
    assert rel_error(out, attention_ref(wide, k, v, causal=True)[0]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_on_sdpa(dtype):
    lens_q, lens_k = [5, 0, 30, 1, 12], [5, 7, 18, 40, 0]  # square, no queries, Nq > Nk, decode, no keys
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens_q), 6, 32, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lens_k), 3, 32, generator=gen).to(dtype) for _ in range(2))
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    assert ioattn.explain(*args[:3], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                          max_seqlen_k=max(lens_k), causal=True).kernel == dispatch.TORCH_SDPA_KERNEL
    out, lse = ioattn.flash_attn_varlen_func(*args, causal=True, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert rel_error(out, ref_out) < TOLERANCE[dtype] and lse_error(lse, ref_lse) < LSE_TOL


SDPA_MASKS = [  # (mask shape or None, mask dtype, is_causal, Nq, Nk)
    (None, None, True, 20, 9), (None, None, True, 9, 20), ((1, 1, 9, 20), torch.bool, False, 9, 20),
    ((2, 1, 1, 20), torch.bool, False, 9, 20), ((9, 20), "float32", False, 9, 20), ((4, 9, 20), "same", False, 9, 20),
]


@pytest.mark.parametrize("case", SDPA_MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_masks_and_top_left_causal(case, dtype):
    shape, mask_dtype, causal, n_q, n_k = case
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, n_q, 32, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, n_k, 32, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if mask_dtype is torch.bool:
        mask = torch.rand(shape, generator=gen) > 0.3
        mask[..., 0, :] = False  # a row that sees no key: 0, never NaN
    elif mask_dtype is not None:
        mask = torch.randn(shape, generator=gen).to(torch.float32 if mask_dtype == "float32" else dtype)
        mask[..., 1, :] = float("-inf")
    assert ioattn.explain(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True).kernel == \
        dispatch.TORCH_SDPA_KERNEL
    out = ioattn.sdpa(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                           causal_align="top_left", attn_mask=mask)
    assert torch.isfinite(out).all() and rel_error(out, ref.transpose(1, 2)) < TOLERANCE[dtype]
    if mask is not None:
        assert out[:, :, 0 if mask_dtype is torch.bool else 1].abs().max() == 0


def test_gradients_through_the_sdpa_lse():
    # The backward recomputes from the SDPA path's out and LSE: rows that see no key need LSE -inf (grad 0).
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 12, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 7, 16, generator=gen, requires_grad=True) for _ in range(2))
    mask = torch.rand(1, 1, 12, 7, generator=gen) > 0.4
    mask[..., 3, :] = False
    grad = torch.randn(1, 4, 12, 16, generator=gen)
    ioattn.sdpa(q, k, v, attn_mask=mask, enable_gqa=True).backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*(t.transpose(1, 2) for t in leaves), attn_mask=mask, differentiable=True)
    ref.transpose(1, 2).backward(grad.double())
    for got, want in zip((q, k, v), leaves):
        assert rel_error(got.grad, want.grad) < 1e-5
    assert q.grad[:, :, 3].abs().max() == 0


def test_windows_stay_on_the_tiled_forward():
    q, k, v = qkv(1, 30, 30, 4, 2, 16, torch.float32)
    for window in ((4, 0), (-1, 3), (5, 5)):
        plan = ioattn.explain(q, k, v, window_size=window)
        assert plan.kernel == dispatch.TORCH_KERNEL and "sliding window" in plan.reason
    unbounded = ioattn.explain(q, k, v, causal=True, window_size=(60, -1))  # wider than any distance
    assert unbounded.kernel == dispatch.TORCH_SDPA_KERNEL
