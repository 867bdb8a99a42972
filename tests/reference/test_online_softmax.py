"""The seeds' worked examples, and the NumPy tiled forward against the float64 reference."""

import math

import numpy as np
import pytest
import torch

from ioattn.reference import OnlineSoftmaxState, attention_ref, online_softmax_trace, tiled_attention


def test_seed_example_running_sums():
    # Scores [2, 1, 3, 0] in two blocks of two: l = 1.3679 after the first (max 2), 1.5530 after the second (max 3).
    first, second = online_softmax_trace([2.0, 1.0, 3.0, 0.0], [(0, 2), (2, 4)])
    assert first.m[0] == 2.0 and second.m[0] == 3.0
    assert first.l[0] == pytest.approx(1 + math.exp(-1), abs=1e-12)
    assert round(first.l[0], 4) == 1.3679
    assert round(second.l[0], 4) == 1.5530
    assert second.l[0] == pytest.approx(sum(math.exp(s - 3) for s in (2, 1, 3, 0)), abs=1e-12)


def test_seed_example_weighted_mean():
    # Scores [0, 1, 2] tiled [0, 1] and [2] with values [1, 3, 5] equal the plain softmax-weighted mean.
    scores = np.array([0.0, 1.0, 2.0])
    values = np.array([[1.0], [3.0], [5.0]])
    first, final = online_softmax_trace(scores, [(0, 2), (2, 3)], values)
    assert first.m[0] == 1.0 and first.l[0] == pytest.approx(math.exp(-1) + 1)
    weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    assert final.output()[0, 0] == pytest.approx(float(weights @ values[:, 0]), abs=1e-14)
    torch_version = (torch.tensor(scores).softmax(-1) @ torch.tensor(values)).item()
    assert final.output()[0, 0] == pytest.approx(torch_version, abs=1e-14)


def test_empty_and_fully_masked_tiles_leave_state_unchanged():
    state = OnlineSoftmaxState.empty(2, 3)
    state = state.update(np.full((2, 4), -np.inf), np.ones((4, 3)))
    state = state.update(np.zeros((2, 0)), np.zeros((0, 3)))
    assert np.all(np.isneginf(state.m)) and np.all(state.l == 0)
    assert np.all(state.output() == 0) and np.all(np.isneginf(state.lse()))
    assert not np.isnan(state.output()).any()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k,block", [(256, 256, 64), (37, 101, 16), (5, 3, 2), (64, 64, 1)])
def test_tiled_attention_matches_reference(n_q, n_k, block, causal):
    q, k, v = torch.randn(n_q, 16), torch.randn(n_k, 16), torch.randn(n_k, 8)
    out, lse = tiled_attention(q.numpy(), k.numpy(), v.numpy(), block_q=block, block_k=block, causal=causal)
    ref, ref_lse = attention_ref(q[None, :, None], k[None, :, None], v[None, :, None], causal=causal)
    np.testing.assert_allclose(out, ref[0, :, 0].numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse[0, 0].numpy(), rtol=0, atol=1e-12)
