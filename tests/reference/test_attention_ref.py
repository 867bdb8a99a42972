"""The float64 reference itself, checked against independent formulations (PyTorch math SDPA in float64)."""

import pytest
import torch
import torch.nn.functional as F

from ioattn.reference import attention_ref, lse_error, rel_error, sdpa_ref, visible


def test_visible_rules():
    # bottom-right causal: Nq=2, Nk=4 -> query 0 at position 2, query 1 at position 3
    assert visible(2, 4, causal=True).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert visible(2, 4, causal=True, causal_align="top_left").tolist() == [
        [True, False, False, False], [True, True, False, False]]
    # window (1, 0) with one sink: position 3 sees keys 2, 3 and the sink 0
    assert visible(1, 4, causal=False, window_size=(1, 0), sink_tokens=1).tolist() == [[True, False, True, True]]
    with pytest.raises(ValueError, match="causal_align"):
        visible(1, 1, causal=True, causal_align="middle")


@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_math_sdpa_with_gqa(is_causal):
    q, k, v = torch.randn(2, 8, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal, enable_gqa=True)
    out, _ = sdpa_ref(q, k, v, is_causal=is_causal)
    assert rel_error(out, expected) < 1e-12


def test_bool_and_additive_masks_agree():
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8)
    keep = torch.rand(1, 1, 5, 7) > 0.4
    additive = torch.zeros(1, 1, 5, 7).masked_fill(~keep, float("-inf"))
    out_b, lse_b = attention_ref(q, k, v, attn_mask=keep)
    out_a, lse_a = attention_ref(q, k, v, attn_mask=additive)
    assert rel_error(out_a, out_b) == 0.0 and lse_error(lse_a, lse_b) == 0.0


def test_fully_masked_rows_and_empty_sequences():
    q, k, v = torch.randn(1, 3, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    out, lse = attention_ref(q, k, v, attn_mask=torch.zeros(1, 1, 3, 4, dtype=torch.bool))
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 3, 7], dtype=torch.int32)
    qv, kv = torch.randn(5, 2, 8), torch.randn(7, 1, 8)
    out, lse = attention_ref(qv, kv, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:, :2]))
    assert torch.isfinite(lse[:, 2:]).all()


def test_error_metrics_never_pass_nan():
    ref = torch.randn(4, 4)
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert rel_error(bad, ref) == float("inf")
    assert lse_error(torch.tensor([float("nan")]), torch.tensor([0.0])) == float("inf")
    assert lse_error(torch.tensor([0.0]), torch.tensor([float("-inf")])) == float("inf")
