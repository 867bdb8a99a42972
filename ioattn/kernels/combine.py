"""Exact merging of partial attentions by their log-sum-exp.

A partial attention over a subset of keys is (o_i, lse_i) with o_i already normalised. Over the union,
lse = log Σ exp(lse_i) and o = Σ exp(lse_i − lse) · o_i. A part with lse −inf saw no key and weighs 0; when
every part is empty the result is output 0 and LSE −inf, never NaN. Flash-Decoding's split combine and
`merge_states` (cascade attention over a shared prefix) are the same identity over S = num_splits or S = 2.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def _merge(lse, o):
    """lse [S] natural log, o [S, D] float32 -> (merged o [D], merged lse scalar)."""
    top = tl.max(lse, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top_safe)
    total = tl.sum(weight, 0)
    # An empty part's output is never read, so garbage (even NaN) there cannot leak into the merge.
    weighted = tl.where(weight[:, None] > 0.0, o * weight[:, None], 0.0)
    merged = tl.sum(weighted, 0) / tl.where(total == 0.0, 1.0, total)
    merged_lse = tl.where(total == 0.0, float("-inf"), top_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    return merged, merged_lse


# The split count and the strides that scale with the token count vary per call: no specialisation on them.
@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_qs", "stride_lt", "stride_lh"])
def combine_splits_kernel(
    Partial_out, Partial_lse, Out, Lse, num_splits,
    stride_ps, stride_pt, stride_ph,
    stride_qs, stride_qt, stride_qh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, AFTER_PRIMARY: tl.constexpr = False,
):
    """Grid (tokens, heads, cdiv(HEAD_DIM, BLOCK_D)): columns of BLOCK_D per program, so that many splits of a
    wide head (MLA's 512 at one sequence) spread over the SMs. Partials [split, token, head, (D)] in float32 ->
    Out [token, head, D], Lse [token, head] (stored by each head's first column block).

    AFTER_PRIMARY: launched by programmatic dependent launch while the split kernel still runs (sm_90+); the
    programs wait here until it has finished and its partials are visible."""
    if AFTER_PRIMARY:
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    column_block = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = column_block * BLOCK_D + tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(Partial_lse + offs_s * stride_qs + token * stride_qt + head * stride_qh,
                  mask=s_ok, other=float("-inf"))
    o = tl.load(Partial_out + offs_s[:, None] * stride_ps + token * stride_pt + head * stride_ph + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    merged, merged_lse = _merge(lse, o)
    tl.store(Out + token * stride_ot + head * stride_oh + offs_d, merged.to(Out.dtype.element_ty), mask=d_ok)
    if column_block == 0:
        tl.store(Lse + token * stride_lt + head * stride_lh, merged_lse)


@triton.jit
def merge_states_kernel(
    O_a, Lse_a, O_b, Lse_b, Out, Lse,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_lat, stride_lah, stride_lbt, stride_lbh, stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (tokens, heads): two partial states [token, head, D] / [token, head] -> their exact merge."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    o_a = tl.load(O_a + token * stride_at + head * stride_ah + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    o_b = tl.load(O_b + token * stride_bt + head * stride_bh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    lse_a = tl.load(Lse_a + token * stride_lat + head * stride_lah).to(tl.float32)
    lse_b = tl.load(Lse_b + token * stride_lbt + head * stride_lbh).to(tl.float32)
    side = tl.arange(0, 2)
    lse = tl.where(side == 0, lse_a, lse_b)
    o = tl.where(side[:, None] == 0, o_a[None, :], o_b[None, :])
    merged, merged_lse = _merge(lse, o)
    tl.store(Out + token * stride_ot + head * stride_oh + offs_d, merged.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + token * stride_lt + head * stride_lh, merged_lse)
