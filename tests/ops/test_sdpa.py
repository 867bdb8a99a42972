"""ioattn.sdpa against torch.nn.functional.scaled_dot_product_attention's semantics: (B, H, N, D),
top-left is_causal, dense bool/additive masks streamed with broadcast strides, enable_gqa."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ioattn
from ioattn.reference import TOLERANCE, rel_error, sdpa_ref
from ops_helpers import argument_error_test

BACKENDS = ["torch", "triton"]
MASK_SHAPES = {
    "full": lambda b, h, n_q, n_k: (b, h, n_q, n_k),
    "per-batch keys (padding)": lambda b, h, n_q, n_k: (b, 1, 1, n_k),
    "per-head rows": lambda b, h, n_q, n_k: (1, h, n_q, 1),
    "2-D": lambda b, h, n_q, n_k: (n_q, n_k),
    "3-D": lambda b, h, n_q, n_k: (h, n_q, n_k),
}


def bhnd(b, h_q, h_kv, n_q, n_k, d, dtype=torch.float32, device="cpu"):
    return (torch.randn(b, h_q, n_q, d, dtype=dtype, device=device),
            torch.randn(b, h_kv, n_k, d, dtype=dtype, device=device),
            torch.randn(b, h_kv, n_k, d, dtype=dtype, device=device))


def random_mask(kind, shape, dtype, device="cpu"):
    if kind == "bool":
        return torch.rand(shape, device=device) > 0.3
    return torch.randn(shape, device=device).to(dtype)


@settings(max_examples=20, deadline=None)
@given(backend=st.sampled_from(BACKENDS), n_q=st.integers(1, 30), n_k=st.integers(1, 30),
       heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]), mask=st.sampled_from([None, "bool", "additive"]),
       mask_shape=st.sampled_from(sorted(MASK_SHAPES)), is_causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]), scale=st.sampled_from([None, 0.1]))
def test_sdpa_matches_reference(backend, n_q, n_k, heads, mask, mask_shape, is_causal, dtype, scale):
    q, k, v = bhnd(2, *heads, n_q, n_k, 16, dtype)
    attn_mask = None if mask is None else random_mask(mask, MASK_SHAPES[mask_shape](2, heads[0], n_q, n_k), dtype)
    is_causal = is_causal and attn_mask is None
    gqa = heads[0] != heads[1]
    out = ioattn.sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    ref, _ = sdpa_ref(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    assert rel_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_numbers_as_pytorch(backend):
    """Top-left causal with Nq < Nk, and a float32 additive mask on float16 inputs, as PyTorch accepts."""
    q, k, v = bhnd(2, 4, 2, 6, 20, 32)
    ours = ioattn.sdpa(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_error(ours, theirs.double()) < 1e-5
    q, k, v = bhnd(2, 2, 2, 9, 11, 16, torch.float16)
    mask = torch.randn(2, 1, 9, 11)
    ours = ioattn.sdpa(q, k, v, attn_mask=mask, backend=backend)
    theirs = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert rel_error(ours, theirs.double()) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_return_zero_not_nan(backend):
    """Documented: a row whose mask allows no key gives 0 (some PyTorch backends and versions give NaN)."""
    q, k, v = bhnd(1, 2, 2, 5, 7, 16)
    additive = torch.zeros(5, 7)
    additive[2] = float("-inf")
    boolean = torch.ones(5, 7, dtype=torch.bool)
    boolean[4] = False
    for mask, row in ((additive, 2), (boolean, 4)):
        out = ioattn.sdpa(q, k, v, attn_mask=mask, backend=backend)
        assert torch.equal(out[:, :, row], torch.zeros_like(out[:, :, row]))
        assert rel_error(out, sdpa_ref(q, k, v, attn_mask=mask)[0]) < 1e-5


def test_mask_is_never_expanded():
    """The (B, H, Nq, Nk) mask the kernel receives is a stride-0 view of the user's storage."""
    from ioattn.ops import checks

    q, k, v = bhnd(2, 4, 4, 8, 9, 16)
    mask = torch.rand(1, 1, 8, 9) > 0.5
    inputs = checks.validate_sdpa(q, k, v, mask, False, None, False)
    assert inputs.attn_mask.data_ptr() == mask.data_ptr() and inputs.attn_mask.stride()[:2] == (0, 0)
    assert inputs.window_right == -1  # never rewritten into is_causal


def _bad_calls():
    q, k, v = bhnd(1, 4, 2, 5, 6, 16)
    q2, k2, v2 = bhnd(1, 2, 2, 5, 6, 16)
    return [
        ("enable_gqa=True", lambda: ioattn.sdpa(q, k, v)),
        ("mutually exclusive", lambda: ioattn.sdpa(q2, k2, v2, attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True)),
        ("attn_mask.dtype", lambda: ioattn.sdpa(q2, k2, v2, attn_mask=torch.ones(5, 6, dtype=torch.int32))),
        ("broadcastable", lambda: ioattn.sdpa(q2, k2, v2, attn_mask=torch.ones(5, 7, dtype=torch.bool))),
        ("broadcastable", lambda: ioattn.sdpa(q2, k2, v2, attn_mask=torch.ones(2, 1, 5, 6, dtype=torch.bool))),
        ("query must be 4-D", lambda: ioattn.sdpa(q2[0], k2[0], v2[0])),
        ("query head dim", lambda: ioattn.sdpa(*bhnd(1, 2, 2, 5, 6, 12))),
        ("value.dtype", lambda: ioattn.sdpa(q2, k2, v2.half())),
        ("scale", lambda: ioattn.sdpa(q2, k2, v2, scale=float("inf"))),
        ("is_causal must be True or False", lambda: ioattn.sdpa(q2, k2, v2, is_causal=None)),
        ("multiple of key/value heads", lambda: ioattn.sdpa(*bhnd(1, 3, 2, 5, 6, 16), enable_gqa=True)),
    ]


test_argument_errors = argument_error_test(_bad_calls)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_sdpa(dtype, mask, d):
    q, k, v = bhnd(2, 8, 2, 1000, 1300, d, dtype, "cuda")
    attn_mask = None if mask in (None, "causal") else random_mask(mask, (2, 1, 1000, 1300), dtype, "cuda")
    out = ioattn.sdpa(q, k, v, attn_mask=attn_mask, is_causal=mask == "causal", enable_gqa=True)
    ref, _ = sdpa_ref(q, k, v, attn_mask=attn_mask, is_causal=mask == "causal")
    assert rel_error(out, ref) < TOLERANCE[dtype]
