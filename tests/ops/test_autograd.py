"""torch.autograd through the public ops (flash_attn_func, flash_attn_varlen_func, sdpa) on both backends,
against float64 autograd through `attention_ref(..., differentiable=True)`; determinism; the plan's backward.

CPU: backend="torch" and backend="triton" (Triton interpreter), fp32 and fp16. GPU (`gpu`): bf16.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ioattn
from attention_grad_ref import attention_grads_ref
from ioattn.ops import backward
from ioattn.ops.capability import HOPPER
from ioattn.reference import TOLERANCE, rel_error

BACKENDS = ["torch", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # hypothesis tests cannot take fixtures


@pytest.fixture
def poisoned(monkeypatch):
    """Every float buffer the forward and backward allocate uninitialised starts as NaN: an unwritten element
    fails. (Integer buffers, such as Triton's descriptor scratch, are left alone.)"""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poison(empty_like(t, **kw)))


def leaves(*shapes, dtype=torch.float32, device=DEVICE):
    return [torch.randn(s, dtype=dtype, device=device, requires_grad=True) for s in shapes]


def assert_grads_match(got, want, dtype, names=("dq", "dk", "dv", "dmask")):
    for name, g, w in zip(names, got, want):
        assert g is not None and g.shape == w.shape, name
        err = rel_error(g, w)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"


def run_dense(backend, dtype, *, batch=2, n_q=19, n_k=23, hq=4, hkv=2, head_dim=16, causal=False,
              window_size=(-1, -1), deterministic=None):
    q, k, v = leaves((batch, n_q, hq, head_dim), (batch, n_k, hkv, head_dim), (batch, n_k, hkv, head_dim),
                     dtype=dtype)
    out = ioattn.flash_attn_func(q, k, v, causal=causal, window_size=window_size, deterministic=deterministic,
                                 backend=backend)
    do = torch.randn_like(out)
    out.backward(do)
    want = attention_grads_ref(q.cpu(), k.cpu(), v.cpu(), do.cpu(), scale=head_dim**-0.5, causal=causal,
                               window_size=window_size)
    return (q.grad, k.grad, v.grad), want


DENSE_CASES = {
    "gqa_causal_bottom_right": dict(causal=True),
    "more_queries_than_keys_causal": dict(n_q=30, n_k=12, hq=2, hkv=2, causal=True),  # first rows see nothing
    "window_mqa": dict(n_q=33, n_k=33, hq=3, hkv=1, head_dim=24, window_size=(5, 7)),
    "causal_window": dict(n_q=20, n_k=41, causal=True, window_size=(9, -1)),
}


@pytest.mark.parametrize("case", DENSE_CASES, ids=list(DENSE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_func_grads(backend, case, poisoned):
    got, want = run_dense(backend, torch.float32, **DENSE_CASES[case])
    assert_grads_match(got, want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_func_grads_fp16(backend, poisoned):
    got, want = run_dense(backend, torch.float16, causal=True, head_dim=32)
    assert all(g.dtype == torch.float16 for g in got)
    assert_grads_match(got, want, torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_get_zero_gradient(backend, poisoned):
    """Bottom-right causal with Nq > Nk: the first Nq - Nk query rows see nothing."""
    (dq, dk, dv), _ = run_dense(backend, torch.float32, n_q=20, n_k=8, hq=2, hkv=1, causal=True)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:, :12], torch.zeros_like(dq[:, :12]))


def varlen_problem(seqlens, hq, hkv, head_dim, dtype, device=DEVICE):
    cu_q = torch.tensor([0] + [n for n, _ in seqlens], dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [n for _, n in seqlens], dtype=torch.int32).cumsum(0).to(torch.int32)
    q, k, v = leaves((int(cu_q[-1]), hq, head_dim), (int(cu_k[-1]), hkv, head_dim), (int(cu_k[-1]), hkv, head_dim),
                     dtype=dtype, device=device)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_grads_with_empty_sequences(backend, dtype, poisoned):
    seqlens = [(5, 9), (0, 7), (17, 3), (6, 0), (0, 0), (20, 20)]
    q, k, v, cu_q, cu_k = varlen_problem(seqlens, 4, 2, 16, dtype)
    out = ioattn.flash_attn_varlen_func(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 20, 20, causal=True,
                                        window_size=(6, -1), backend=backend)
    do = torch.randn_like(out)
    out.backward(do)
    want = attention_grads_ref(q.cpu(), k.cpu(), v.cpu(), do.cpu(), scale=0.25, causal=True, window_size=(6, -1),
                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_grads_match((q.grad, k.grad, v.grad), want, dtype)


def run_sdpa(backend, dtype, *, batch=2, hq=4, hkv=2, n_q=19, n_k=23, head_dim=16, is_causal=False,
             attn_mask=None):
    q, k, v = leaves((batch, hq, n_q, head_dim), (batch, hkv, n_k, head_dim), (batch, hkv, n_k, head_dim),
                     dtype=dtype)
    out = ioattn.sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=hq != hkv, backend=backend)
    assert out.is_contiguous()
    do = torch.randn_like(out)
    out.backward(do)
    mask_grad = attn_mask is not None and attn_mask.requires_grad
    want = attention_grads_ref(*(t.cpu().transpose(1, 2) for t in (q, k, v, do)), scale=head_dim**-0.5,
                               causal=is_causal, bottom_right=False,
                               attn_mask=None if attn_mask is None else attn_mask.cpu(), mask_grad=mask_grad)
    got = [q.grad, k.grad, v.grad] + ([attn_mask.grad] if mask_grad else [])
    want = [w.transpose(1, 2) for w in want[:3]] + ([want[3]] if mask_grad else [])
    return got, want


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_causal_top_left_grads(backend, poisoned):
    got, want = run_sdpa(backend, torch.float32, n_q=23, n_k=19, is_causal=True)
    assert_grads_match(got, want, torch.float32)


MASK_SHAPES = {"full": (2, 4, 19, 23), "broadcast_2d": (19, 23), "per_batch": (2, 1, 19, 23),
               "per_head_key": (4, 1, 23)}


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=list(MASK_SHAPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_additive_mask_gradient(backend, shape, poisoned):
    mask = torch.randn(MASK_SHAPES[shape])
    mask.masked_fill_(torch.rand(mask.shape) < 0.2, -math.inf)
    if mask.shape[-2] > 1:
        mask[..., 3, :] = -math.inf  # a row that sees nothing: zero gradient everywhere, never NaN
    mask = mask.to(DEVICE).requires_grad_()
    got, want = run_sdpa(backend, torch.float32, attn_mask=mask)
    assert got[3].shape == mask.shape and got[3].dtype == mask.dtype
    assert_grads_match(got, want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_mask_without_grad_and_bool_mask(backend, poisoned):
    additive = torch.randn(19, 23, device=DEVICE)
    got, want = run_sdpa(backend, torch.float32, attn_mask=additive)
    assert_grads_match(got, want, torch.float32)
    allowed = torch.rand(2, 1, 19, 23, device=DEVICE) > 0.3
    allowed[:, :, 5] = False  # a row that sees nothing: zero gradient, never NaN
    got, want = run_sdpa(backend, torch.float32, attn_mask=allowed)
    assert_grads_match(got, want, torch.float32)
    assert torch.equal(got[0][:, :, 5], torch.zeros_like(got[0][:, :, 5]))


def test_sdpa_half_precision_mask_on_fp32_inputs(poisoned):
    """The Triton backward reads bool, fp32 or the inputs' dtype: other float masks are cast, the gradient
    comes back in the mask's dtype."""
    mask = torch.randn(19, 23, dtype=torch.float16, device=DEVICE, requires_grad=True)
    got, want = run_sdpa("triton", torch.float32, attn_mask=mask)
    assert got[3].dtype == torch.float16
    assert_grads_match(got[:3], want[:3], torch.float32)
    assert rel_error(got[3], want[3]) < TOLERANCE[torch.float16]


@settings(max_examples=16, deadline=None)
@given(
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    batch=st.integers(1, 2),
    n_q=st.integers(1, 40),
    n_k=st.integers(0, 40),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    head_dim=st.sampled_from([8, 16, 24, 40]),
    causal=st.booleans(),
    window_size=st.sampled_from([(-1, -1), (4, -1), (3, 5), (0, 0)]),
)
def test_hypothesis_dense_grads(backend, dtype, batch, n_q, n_k, heads, head_dim, causal, window_size):
    got, want = run_dense(backend, dtype, batch=batch, n_q=n_q, n_k=n_k, hq=heads[0], hkv=heads[1],
                          head_dim=head_dim, causal=causal, window_size=window_size)
    assert_grads_match(got, want, dtype)


# ---- determinism and the plan ----


def grads_twice(fn, tensors):
    """The gradients of two calls of fn with the same dO."""
    out = fn()
    do = torch.randn_like(out)
    return torch.autograd.grad(out, tensors, do), torch.autograd.grad(fn(), tensors, do)


def test_deterministic_backward_is_bitwise_reproducible(poisoned):
    q, k, v = leaves((2, 40, 4, 16), (2, 40, 2, 16), (2, 40, 2, 16))
    plan = ioattn.explain(q, k, v, causal=True, deterministic=True, backend="triton")
    assert plan.deterministic and "bitwise reproducible" in str(plan)
    runs = grads_twice(lambda: ioattn.flash_attn_func(q, k, v, causal=True, deterministic=True, backend="triton"),
                       (q, k, v))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_deterministic_from_environment_for_sdpa_with_a_broadcast_mask(monkeypatch, poisoned):
    """sdpa has no deterministic argument: IOATTN_DETERMINISTIC=1 selects it, the broadcast mask's gradient
    then avoids atomics too."""
    monkeypatch.setenv("IOATTN_DETERMINISTIC", "1")
    q, k, v = leaves((2, 2, 24, 16), (2, 2, 24, 16), (2, 2, 24, 16))
    mask = torch.randn(24, 24, device=DEVICE, requires_grad=True)
    assert ioattn.explain(q, k, v, attn_mask=mask, backend="triton").deterministic
    runs = grads_twice(lambda: ioattn.sdpa(q, k, v, attn_mask=mask, backend="triton"), (q, k, v, mask))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_deterministic_follows_torch_setting():
    q, k, v = leaves((1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16))
    assert not ioattn.explain(q, k, v, backend="triton").deterministic
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert ioattn.explain(q, k, v, backend="triton").deterministic
        assert not ioattn.explain(q, k, v, backend="triton", deterministic=False).deterministic
    finally:
        torch.use_deterministic_algorithms(previous)


def test_plan_names_the_backward():
    q, k, v = leaves((1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16))
    text = str(ioattn.explain(q, k, v, backend="torch"))
    assert "attention_bwd_torch" in text and "deterministic (tiled torch" in text
    plan = ioattn.explain(q, k, v, backend="triton", deterministic=False)
    assert plan.bwd_config is not None and str(plan.bwd_config) in str(plan)
    assert "prefill_bwd.attention_bwd" in str(plan) and "separate dQ kernel" in str(plan)


def test_hopper_backward_table_covers_every_head_dim():
    for head_dim in (8, 16, 24, 32, 64, 72, 128, 256):
        config, source = backward.tuned_bwd_config(head_dim, torch.bfloat16, HOPPER)
        assert "table sm90" in source and config.kv_block_n >= 64


def test_deterministic_argument_is_checked():
    q, k, v = leaves((1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16))
    with pytest.raises(ValueError, match="deterministic must be True, False or None"):
        ioattn.flash_attn_func(q, k, v, deterministic="yes")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_is_not_differentiable(backend):
    q, k, v = leaves((1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16))
    out, lse = ioattn.flash_attn_func(q, k, v, return_lse=True, backend=backend)
    assert out.requires_grad and not lse.requires_grad


# ---- device (H200): bf16 through the public API, skipped on CPU-only machines ----


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_flash_attn_func_bf16(deterministic, poisoned):
    for kwargs in (dict(batch=2, n_q=300, n_k=300, hq=8, hkv=2, head_dim=128, causal=True),
                   dict(batch=1, n_q=257, n_k=513, hq=4, hkv=4, head_dim=64, window_size=(100, 30))):
        got, want = run_dense("auto", torch.bfloat16, deterministic=deterministic, **kwargs)
        assert_grads_match(got, want, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_varlen_bf16(poisoned):
    seqlens = [(100, 300), (0, 40), (257, 257), (31, 0)]
    q, k, v, cu_q, cu_k = varlen_problem(seqlens, 8, 2, 128, torch.bfloat16)
    out = ioattn.flash_attn_varlen_func(q, k, v, cu_q.cuda(), cu_k.cuda(), 257, 300, causal=True)
    do = torch.randn_like(out)
    out.backward(do)
    want = attention_grads_ref(q.cpu(), k.cpu(), v.cpu(), do.cpu(), scale=128**-0.5, causal=True,
                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_grads_match((q.grad, k.grad, v.grad), want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4, 200, 230), (200, 230)], ids=["full", "broadcast"])
def test_gpu_sdpa_additive_mask_bf16(shape, poisoned):
    mask = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    mask.masked_fill_(torch.rand(shape, device="cuda") < 0.1, -math.inf)
    got, want = run_sdpa("auto", torch.bfloat16, n_q=200, n_k=230, head_dim=64,
                         attn_mask=mask.requires_grad_())
    assert got[3].dtype == torch.bfloat16
    assert_grads_match(got, want, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_deterministic_bitwise_bf16():
    q, k, v = leaves((2, 1024, 8, 128), (2, 1024, 2, 128), (2, 1024, 2, 128), dtype=torch.bfloat16)
    runs = grads_twice(lambda: ioattn.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_gradient_magnitudes_bound_the_reference_and_show_cancellation(packed):
    """The oracle the op fuzzer's gradient checks add float32's tolerance of: every reference gradient entry lies
    within its magnitude (the same sums over absolute values), and a softmax row that is almost one-hot makes dq
    cancel to far below it (the fuzzer's case: fp16, Nq 1, Nk 2, D 72, scale 0.5, p = 1 - 3.5e-7)."""
    from attention_grad_ref import gradient_magnitudes

    generator = torch.Generator().manual_seed(0)
    shape_q, shape_k = ((7, 4, 16), (9, 2, 16)) if packed else ((2, 5, 4, 16), (2, 6, 2, 16))
    q, k, v = (torch.randn(s, generator=generator, dtype=torch.float64) for s in (shape_q, shape_k, shape_k))
    do = torch.randn(shape_q, generator=generator, dtype=torch.float64)
    varlen = {}
    if packed:
        varlen = dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32))
    o, _ = ioattn.reference.attention_ref(q, k, v, causal=True, softmax_scale=0.25, **varlen)
    grads = attention_grads_ref(q, k, v, do, scale=0.25, causal=True, saved_o=o, **varlen)[:3]
    for grad, magnitude in zip(grads, gradient_magnitudes(q, k, v, do, o, scale=0.25, causal=True, **varlen)):
        assert grad.shape == magnitude.shape and (grad.abs() <= magnitude + 1e-12).all()
    q1, k1 = torch.zeros(1, 1, 1, 8, dtype=torch.float64), torch.zeros(1, 2, 1, 8, dtype=torch.float64)
    q1[..., 0], k1[0, 0, 0, 0] = 1.0, 60.0  # scores 15 and 0 at scale 0.25: p = 1 - 3e-7
    v1, do1 = torch.randn(1, 2, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    o1, _ = ioattn.reference.attention_ref(q1, k1, v1, softmax_scale=0.25)
    dq = attention_grads_ref(q1, k1, v1, do1, scale=0.25, saved_o=o1)[0]
    assert dq.norm() < 1e-4 * gradient_magnitudes(q1, k1, v1, do1, o1, scale=0.25)[0].norm()
