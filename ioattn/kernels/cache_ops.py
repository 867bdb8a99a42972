"""Writes of new tokens' keys and values into a paged KV cache (the `reshape_and_cache` of vLLM).

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
