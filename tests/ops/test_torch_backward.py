"""The tiled torch backward (CPU path) against float64 autograd."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_grad_ref import make_problem, reference_grads
from ioattn.ops.torch_backward import attention_bwd_torch
from ioattn.reference import TOLERANCE, rel_error


def check(problem, *, mask_grad=False, block=8):
    grads = attention_bwd_torch(problem.do, problem.q, problem.k, problem.v, problem.o, problem.lse,
                                **problem.kwargs, mask_grad=mask_grad, block=block)
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), grads, reference_grads(problem, mask_grad)):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape, name
        err = rel_error(got, want)
        assert err < TOLERANCE[problem.q.dtype], f"{name}: relative error {err:.2e}"
    return grads


CASES = {
    "plain": dict(n_q=24, n_k=40),
    "causal_bottom_right_gqa": dict(n_q=20, n_k=37, hq=4, hkv=2, causal=True, head_dim=24),
    "causal_top_left": dict(n_q=37, n_k=20, causal=True, bottom_right=False),
    "causal_more_queries_than_keys": dict(n_q=37, n_k=20, causal=True),
    "window": dict(n_q=45, n_k=45, window_size=(5, 9)),
    "bool_mask": dict(batch=2, n_q=19, n_k=23, mask="bool", causal=True, bottom_right=False),
    "varlen_zero_lengths": dict(seqlens=[(5, 9), (0, 7), (17, 3), (6, 0), (0, 0), (20, 20)], hq=4, hkv=2,
                                causal=True),
    "fp16": dict(n_q=30, n_k=30, causal=True, dtype=torch.float16),
    "bf16": dict(n_q=30, n_k=30, causal=True, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_float64_autograd(case):
    check(make_problem(**CASES[case]))


@pytest.mark.parametrize("mask", ["additive", "additive_broadcast"])
def test_additive_mask_gradient(mask):
    problem = make_problem(batch=2, hq=2, hkv=1, n_q=19, n_k=23, mask=mask, causal=True)
    dmask = check(problem, mask_grad=True)[3]
    assert dmask.shape == problem.kwargs["attn_mask"].shape


def test_padding_mask_broadcast_over_queries():
    mask = torch.randn(2, 1, 1, 23)
    mask[0, ..., 20:] = float("-inf")
    check(make_problem(batch=2, hq=2, hkv=2, n_q=19, n_k=23, mask=mask), mask_grad=True)


@pytest.mark.parametrize("n_q, n_k", [(0, 5), (5, 0)])
def test_no_queries_or_no_keys(n_q, n_k):
    grads = check(make_problem(n_q=n_q, n_k=n_k))
    assert all(not g.any() for g in grads[:3])


def test_fully_masked_rows_get_zero_gradient():
    mask = torch.rand(1, 1, 20, 20) > 0.3
    mask[..., 3:7, :] = False
    dq = check(make_problem(n_q=20, n_k=20, mask=mask))[0]
    assert torch.equal(dq[:, 3:7], torch.zeros_like(dq[:, 3:7]))


def test_block_size_does_not_change_the_result():
    problem = make_problem(batch=2, n_q=50, n_k=70, hq=4, hkv=1, causal=True, window_size=(20, -1))
    small = check(problem, block=8)
    large = check(problem, block=128)
    for a, b in zip(small[:3], large[:3]):
        assert rel_error(a, b) < 1e-6


def test_mask_grad_needs_additive_mask():
    problem = make_problem(n_q=8, n_k=8, mask="bool")
    with pytest.raises(ValueError, match="mask_grad"):
        check(problem, mask_grad=True)


def test_shares_the_triton_launchers_argument_checks():
    varlen = make_problem(seqlens=[(4, 4)])
    with pytest.raises(ValueError, match="attn_mask"):
        check(dataclasses.replace(varlen, kwargs=varlen.kwargs | dict(attn_mask=torch.zeros(4, 4))))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        check(dataclasses.replace(varlen, kwargs=varlen.kwargs | dict(max_seqlen_q=None)))
    dense = make_problem(n_q=8, n_k=8)
    with pytest.raises(ValueError, match="lse must have shape"):
        check(dataclasses.replace(dense, lse=dense.lse[..., :4]))


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 2), n_q=st.integers(1, 40), n_k=st.integers(1, 40),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), head_dim=st.sampled_from([8, 16, 40]),
    causal=st.booleans(), bottom_right=st.booleans(),
    window=st.sampled_from([(-1, -1), (4, -1), (-1, 3), (7, 2), (0, 0)]),
    mask=st.sampled_from([None, "bool", "additive", "additive_broadcast"]),
    dtype=st.sampled_from([torch.float32, torch.float16]), block=st.sampled_from([8, 16, 128]),
)
def test_shape_space(batch, n_q, n_k, heads, head_dim, causal, bottom_right, window, mask, dtype, block):
    problem = make_problem(batch=batch, n_q=n_q, n_k=n_k, hq=heads[0], hkv=heads[1], head_dim=head_dim,
                           causal=causal, bottom_right=bottom_right, window_size=window, mask=mask, dtype=dtype)
    check(problem, mask_grad=mask is not None and mask.startswith("additive"), block=block)


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=4),
       causal=st.booleans(), window=st.sampled_from([(-1, -1), (5, 0)]))
def test_varlen_space(lengths, causal, window):
    check(make_problem(seqlens=lengths, hq=2, hkv=1, causal=causal, window_size=window))


def test_deterministic():
    problem = make_problem(batch=2, n_q=40, n_k=40, hq=4, hkv=1, causal=True, mask="additive_broadcast")
    runs = [check(problem, mask_grad=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
