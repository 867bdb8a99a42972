"""flash_attn_func / flash_attn_varlen_func through both backends, the torch backend's own tiling, edge
shapes, strided inputs, and every argument error."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ioattn
from ioattn.ops import checks, torch_backend
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error
from ops_helpers import argument_error_test

BACKENDS = ["torch", "triton"]


def qkv(b, n_q, n_k, h_q, h_kv, d, dtype=torch.float32, device="cpu"):
    return (torch.randn(b, n_q, h_q, d, dtype=dtype, device=device),
            torch.randn(b, n_k, h_kv, d, dtype=dtype, device=device),
            torch.randn(b, n_k, h_kv, d, dtype=dtype, device=device))


def packed(lens_q, lens_k, h_q, h_kv, d, dtype=torch.float32, device="cpu"):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), h_q, d, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lens_k), h_kv, d, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, cu_q, cu_k


def assert_close(out, lse, ref_out, ref_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_error(out, ref_out) < TOLERANCE[dtype]
    assert lse_error(lse, ref_lse) < (1e-4 if dtype == torch.float32 else 1e-3)


window_st = st.tuples(st.integers(-1, 30), st.integers(-1, 30))


@settings(max_examples=15, deadline=None)
@given(backend=st.sampled_from(BACKENDS), b=st.integers(1, 2), n_q=st.integers(1, 40), n_k=st.integers(1, 40),
       heads=st.sampled_from([(2, 2), (4, 1), (4, 2)]), d=st.sampled_from([8, 32, 48]), causal=st.booleans(),
       window=window_st, dtype=st.sampled_from([torch.float32, torch.float16]))
def test_flash_attn_func_matches_reference(backend, b, n_q, n_k, heads, d, causal, window, dtype):
    q, k, v = qkv(b, n_q, n_k, *heads, d, dtype)
    out, lse = ioattn.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, backend=backend)
    assert out.shape == q.shape and lse.shape == (b, heads[0], n_q)
    assert_close(out, lse, *attention_ref(q, k, v, causal=causal, window_size=window), dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_backend_bfloat16(causal):
    """bf16 runs on the CPU through the torch backend only (the interpreter's bf16 tl.dot is broken)."""
    q, k, v = qkv(2, 33, 47, 4, 2, 64, torch.bfloat16)
    out, lse = ioattn.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="torch")
    assert_close(out, lse, *attention_ref(q, k, v, causal=causal), torch.bfloat16)


@settings(max_examples=15, deadline=None)
@given(n_q=st.integers(1, 50), n_k=st.integers(1, 50), causal=st.booleans(), window=window_st,
       mask=st.sampled_from([None, "bool", "additive"]), bottom_right=st.booleans())
def test_torch_backend_tiles_match_reference(n_q, n_k, causal, window, mask, bottom_right):
    """The CPU backend with 8x16 tiles, so boundary tiles and skipped tiles are exercised; outputs poisoned."""
    q, k, v = qkv(2, n_q, n_k, 4, 2, 16)
    dense = None
    if mask is not None:
        dense = torch.rand(2, 1, n_q, n_k) > 0.3 if mask == "bool" else torch.randn(2, 1, n_q, n_k)
    left, right = checks.normalized_window(window, causal)
    inputs = checks.AttentionInputs(q, k, v, 0.3, left, right, bottom_right,
                                    attn_mask=None if dense is None else dense.expand(2, 4, n_q, n_k))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, n_q), float("nan"))
    torch_backend.attention_forward(inputs, out, lse, block_m=8, block_n=16)
    ref = attention_ref(q, k, v, causal=causal, window_size=window, attn_mask=dense, softmax_scale=0.3,
                        causal_align="bottom_right" if bottom_right else "top_left")
    assert_close(out, lse, *ref, torch.float32)


@settings(max_examples=8, deadline=None)
@given(backend=st.sampled_from(BACKENDS), lens=st.lists(st.tuples(st.integers(0, 25), st.integers(0, 25)), min_size=1, max_size=4),
       causal=st.booleans(), window=window_st)
def test_varlen_matches_reference(backend, lens, causal, window):
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, 16)
    out, lse = ioattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                             window_size=window, return_lse=True, backend=backend)
    assert lse.shape == (4, sum(lens_q))
    ref = attention_ref(q, k, v, causal=causal, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_close(out, lse, *ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_q,n_k", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(backend, n_q, n_k):
    q, k, v = qkv(2, n_q, n_k, 2, 1, 16)
    out, lse = ioattn.flash_attn_func(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.shape == q.shape and lse.shape == (2, 2, n_q)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_is_bottom_right(backend):
    """Nq < Nk: the last query sees every key (flash-attn), unlike PyTorch's top-left is_causal."""
    q, k, v = qkv(1, 3, 7, 1, 1, 16)
    out = ioattn.flash_attn_func(q, k, v, causal=True, backend=backend)
    full = ioattn.flash_attn_func(q[:, -1:], k, v, backend=backend)
    assert rel_error(out[:, -1:], full.double()) < 1e-5


def strided_variants(b, n, h, d):
    """(label, tensor) views of one shape whose strides do or do not meet the descriptor rules."""
    return [
        ("transposed storage", torch.randn(b, h, n, d).transpose(1, 2)),
        ("odd row stride", torch.randn(b, n, h, d + 1)[..., :d]),
        ("non-unit last stride", torch.randn(b, n, h, 2 * d)[..., ::2]),
        ("misaligned base", torch.randn(b * n * h * d + 1)[1:].view(b, n, h, d)),
    ]


@pytest.mark.parametrize("index", range(4))
def test_strided_inputs(index):
    label, q = strided_variants(2, 12, 2, 16)[index]
    k, v = torch.randn(2, 2, 12, 16).transpose(1, 2), torch.randn(2, 12, 2, 16)
    plan = ioattn.explain(q, k, v, backend="triton")
    assert (plan.copies == ()) == (label == "transposed storage"), str(plan)
    assert all(name == "q" for name, _ in plan.copies)
    for backend in BACKENDS:
        out = ioattn.flash_attn_func(q, k, v, causal=True, backend=backend)
        assert rel_error(out, attention_ref(q, k, v, causal=True)[0]) < 1e-5


def _bad_calls():
    q, k, v = qkv(1, 4, 4, 2, 2, 16)
    i = torch.randn(6, 2, 16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return [
        ("q must be 4-D", lambda: ioattn.flash_attn_func(q[0], k, v)),
        ("dtype", lambda: ioattn.flash_attn_func(q.long(), k.long(), v.long())),
        ("k.dtype", lambda: ioattn.flash_attn_func(q, k.half(), v)),
        ("v.shape", lambda: ioattn.flash_attn_func(q, k, v[:, :3])),
        ("batch and head dim", lambda: ioattn.flash_attn_func(q, k[..., :8], v[..., :8])),
        ("multiple of key/value heads", lambda: ioattn.flash_attn_func(qkv(1, 4, 4, 3, 2, 16)[0], k, v)),
        ("head dim must be a multiple of 8", lambda: ioattn.flash_attn_func(*qkv(1, 4, 4, 1, 1, 7))),
        ("head dim must be a multiple of 8", lambda: ioattn.flash_attn_func(*qkv(1, 4, 4, 1, 1, 264))),
        ("window_size", lambda: ioattn.flash_attn_func(q, k, v, window_size=(-2, 0))),
        ("window_size", lambda: ioattn.flash_attn_func(q, k, v, window_size=(3,))),
        ("causal", lambda: ioattn.flash_attn_func(q, k, v, causal="yes")),
        ("softmax_scale", lambda: ioattn.flash_attn_func(q, k, v, softmax_scale=float("nan"))),
        ("backend", lambda: ioattn.flash_attn_func(q, k, v, backend="cuda")),
        ("q must be 3-D", lambda: ioattn.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4)),
        ("cu_seqlens_q must be a 1-D torch.int32", lambda: ioattn.flash_attn_varlen_func(i, i, i, cu.long(), cu, 4, 4)),
        ("cu_seqlens_k must have batch", lambda: ioattn.flash_attn_varlen_func(i, i, i, cu, cu[:2], 4, 4)),
        ("cu_seqlens_q must start at 0", lambda: ioattn.flash_attn_varlen_func(i, i, i, cu.flip(0), cu, 6, 4)),
        ("max_seqlen_q", lambda: ioattn.flash_attn_varlen_func(i, i, i, cu, cu, 3, 4)),
        ("max_seqlen_k must be a non-negative int", lambda: ioattn.flash_attn_varlen_func(i, i, i, cu, cu, 4, None)),
    ]


test_argument_errors = argument_error_test(_bad_calls)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256, 72])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dense(dtype, d, causal):
    q, k, v = qkv(2, 1000, 2048, 8, 2, d, dtype, "cuda")
    out, lse = ioattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_close(out, lse, *attention_ref(q, k, v, causal=causal), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (8, 1)])
def test_gpu_decode_like_gqa(dtype, heads):
    """Short queries over a long cache: the GQA-packed path."""
    q, k, v = qkv(4, 3, 1500, *heads, 128, dtype, "cuda")
    out, lse = ioattn.flash_attn_func(q, k, v, causal=True, window_size=(700, -1), return_lse=True)
    assert_close(out, lse, *attention_ref(q, k, v, causal=True, window_size=(700, -1)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_varlen(dtype):
    q, k, v, cu_q, cu_k = packed([1000, 0, 37, 2048], [1200, 5, 0, 2048], 8, 2, 128, dtype, "cuda")
    out, lse = ioattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2048, 2048, causal=True, return_lse=True)
    ref = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_close(out, lse, *ref, dtype)


@pytest.mark.gpu
def test_gpu_strided_and_unaligned_inputs():
    k, v = (torch.randn(2, 8, 1024, 72, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    q = torch.randn(2 * 1024 * 8 * 72 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(2, 1024, 8, 72)
    plan = ioattn.explain(q, k, v)
    assert [name for name, _ in plan.copies] == ["q"]
    out = ioattn.flash_attn_func(q, k, v)
    assert rel_error(out, attention_ref(q, k, v)[0]) < TOLERANCE[torch.bfloat16]
