"""Writes of new tokens' keys and values into a paged KV cache (the `reshape_and_cache` of vLLM).

`gather_cache_kernel` is the reverse: it copies sequences' cached K/V, through their block tables, into a packed
(tokens, heads, D) buffer (the chunked-prefill path that runs the dense forward over the gathered context).

Cache layout (num_blocks, PAGE, num_kv_heads, head_dim); slot = block * PAGE + offset; slot < 0 is padding and
is skipped. Values are cast to the cache's element type on store, so the cache type is independent of the
model's (FP8 caches plug in here).
"""

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    Key, Value, K_cache, V_cache, Slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    """Grid (tokens, cdiv(num_kv_heads, BLOCK_H)): one token's heads [BLOCK_H, D] per program."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(Slot_mapping + token).to(tl.int64)
    keep = slot >= 0
    slot = tl.maximum(slot, 0)
    block = slot // PAGE
    offset = slot % PAGE
    mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM) & keep

    k = tl.load(Key + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(Value + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = K_cache + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + offs_d[None, :]
    v_dst = V_cache + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_cache.dtype.element_ty), mask=mask)


# The table width and the per-sequence arrays' alignment (row slices of a batch) vary per call.
@triton.jit(do_not_specialize=["stride_table"],
            do_not_specialize_on_alignment=["Block_table", "Seq_lens", "Cu_seqlens_k"])
def gather_cache_kernel(
    K_cache, V_cache, Block_table, Seq_lens, Cu_seqlens_k, K_out, V_out,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_table, stride_ot, stride_oh,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Grid (cdiv(max positions, BLOCK_T), batch): positions [t*BLOCK_T, (t+1)*BLOCK_T) of sequence b, read
    through its block table, to rows Cu_seqlens_k[b] + position of the packed K_out/V_out (rows, heads, D).
    Positions at or past Seq_lens[b] are not touched; a table entry < 0 (an evicted block) is never read and
    its positions are written as zeros."""
    seq = tl.program_id(1)
    seq_len = tl.load(Seq_lens + seq)
    start = tl.program_id(0) * BLOCK_T
    if start < seq_len:
        pos = start + tl.arange(0, BLOCK_T)
        live = pos < seq_len
        block = tl.load(Block_table + seq.to(tl.int64) * stride_table + pos // PAGE, mask=live, other=-1).to(tl.int64)
        present = live & (block >= 0)
        block = tl.maximum(block, 0)
        row = (tl.load(Cu_seqlens_k + seq) + pos).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        for h0 in range(0, num_kv_heads, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            ok = (heads[None, :, None] < num_kv_heads) & (offs_d[None, None, :] < HEAD_DIM)
            src_k = (K_cache + (block * stride_kcb + (pos % PAGE) * stride_kcs)[:, None, None]
                     + heads[None, :, None] * stride_kch + offs_d[None, None, :])
            src_v = (V_cache + (block * stride_vcb + (pos % PAGE) * stride_vcs)[:, None, None]
                     + heads[None, :, None] * stride_vch + offs_d[None, None, :])
            k = tl.load(src_k, mask=present[:, None, None] & ok, other=0.0)
            v = tl.load(src_v, mask=present[:, None, None] & ok, other=0.0)
            dst = (row * stride_ot)[:, None, None] + heads[None, :, None] * stride_oh + offs_d[None, None, :]
            tl.store(K_out + dst, k, mask=live[:, None, None] & ok)
            tl.store(V_out + dst, v, mask=live[:, None, None] & ok)
