"""The exact torch backend of `ioattn.ops.paged.paged_attention`, for CPU tensors (and anywhere Triton cannot run).

Each sequence's keys are gathered through its block table (evicted entries are never read: their positions are
invisible to every query, which the contents checks ensure), then the sequence's queries attend under the same
visibility rule as the kernel: key k is visible to a query at position p iff k <= p + right, and k >= p - left or
k < sink_tokens. Without LSE the attention is PyTorch's SDPA with that rule as a bool mask (its CPU kernels are
tiled and exact); with LSE, the tiled float32 online softmax of `ioattn.ops.torch_backend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ioattn.ops import torch_backend
from ioattn.ops.checks import AttentionInputs

DESCRIPTION = "keys gathered per sequence through its block table, then SDPA (or the tiled torch forward for LSE)"


def _visible(num_queries: int, seq_len: int, window: tuple[int, int], sink_tokens: int) -> torch.Tensor:
    """Bool (num_queries, seq_len): the keys each query (at positions seq_len - num_queries ..) may see."""
    positions = torch.arange(seq_len - num_queries, seq_len)[:, None]
    keys = torch.arange(seq_len)[None, :]
    left, right = window
    visible = keys <= positions + (right if right >= 0 else seq_len)
    if left >= 0:
        visible &= (keys >= positions - left) | (keys < sink_tokens)
    return visible


def context_slots(table_row: torch.Tensor, seq_len: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slot of each position 0..seq_len-1 of a sequence, and whether its block is present (an evicted
    block's positions get slot-sized placeholders, never visible)."""
    positions = torch.arange(seq_len, device=table_row.device)
    blocks = table_row.long()[positions // page]
    return blocks.clamp(min=0) * page + positions % page, blocks >= 0


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, window, sink_tokens, scale, out,
                    return_lse):
    """Arguments as checked by `ioattn.ops.paged.paged_attention` (window already normalised, causal folded in)."""
    decode = cu_seqlens_q is None
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lens = seq_lens.tolist()
    starts = list(range(len(lens) + 1)) if decode else cu_seqlens_q.tolist()
    result = torch.zeros_like(q) if out is None else out.zero_()
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    for row, seq_len in enumerate(lens):
        start, end = starts[row], starts[row + 1]
        if start == end or seq_len == 0:
            continue
        slots, present = context_slots(block_table[row], seq_len, page)
        keys, values = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
        visible = _visible(end - start, seq_len, window, sink_tokens).to(q.device) & present[None, :]
        if return_lse:
            _with_lse(q[start:end], keys, values, visible, scale, result[start:end], lse[start:end])
        else:
            # (1, H, N, D) views; GQA through enable_gqa, no copies of K/V per query head.
            attended = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=visible, scale=scale, enable_gqa=True)[0].transpose(0, 1)
            seen = visible.any(dim=1)  # a row that sees no key returns 0 (SDPA would give NaN)
            result[start:end] = torch.where(seen[:, None, None], attended, 0.0)
    if not return_lse:
        return result
    return result, lse if decode else lse.t()


def _with_lse(q, keys, values, visible, scale, out, lse):
    """One sequence through the tiled float32 forward, with its visibility as a dense bool mask."""
    inputs = AttentionInputs(q[None], keys[None], values[None], scale, -1, -1, True,
                             attn_mask=visible[None, None].expand(1, q.shape[1], *visible.shape),
                             max_seqlen_q=q.shape[0], max_seqlen_k=keys.shape[0])
    torch_backend.attention_forward(inputs, out[None], lse.t()[None])
