"""Writes of new tokens' keys and values into a paged KV cache (the `reshape_and_cache` of vLLM).

`gather_cache_kernel` is the reverse: it copies sequences' cached K/V, through their block tables, into a packed
(tokens, heads, D) buffer (the chunked-prefill path that runs the dense forward over the gathered context).

Cache layout (num_blocks, PAGE, num_kv_heads, head_dim); slot = block * PAGE + offset; slot < 0 is padding and
is skipped. Values are cast to the cache's element type on store, so the cache type is independent of the
model's. FP8 caches (QUANT) store x / scale per KV head, saturated to ±FP8_MAX and rounded to nearest even in
the same launch; the gather (DEQUANT) multiplies the scale back on its way to the packed buffer.
"""

import triton
import triton.language as tl


@triton.jit
def quantize_fp8(x, scale, out_type: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                 MIN_EXP: tl.constexpr):
    """x / scale in float32 -> fp8 `out_type`: saturated to ±FP8_MAX, rounded to nearest even, NaN kept.

    The rounding is done here, not by the conversion: Triton's interpreter converts to fp8 without carrying the
    rounding into the exponent (124.99 -> 64), so the value is first rounded onto the fp8 grid in float32
    ((|x| + c) - c, with c a power of two whose float32 ulp is the fp8 spacing at |x|: 2^(e - MANTISSA) for a
    normal fp8 exponent e, 2^(MIN_EXP - MANTISSA) below the normal range), which float32 addition does to nearest
    even; the conversion of a value on the grid is exact everywhere, and on a GPU it is the same instruction."""
    x = tl.div_rn(x.to(tl.float32), scale)
    magnitude = tl.minimum(tl.abs(x), FP8_MAX)
    exponent = tl.maximum(magnitude.to(tl.int32, bitcast=True) >> 23, MIN_EXP + 127)
    grid = ((exponent + 23 - MANTISSA) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + grid) - grid
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    rounded = (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    bits = rounded.to(out_type).to(tl.uint8, bitcast=True)
    # NaN stays NaN with its sign (0x7F / 0xFF in both formats, as torch converts it), which the interpreter loses.
    bits = tl.where(x != x, (0x7F | ((sign >> 24) & 0x80)).to(tl.uint8), bits)
    return bits.to(out_type, bitcast=True)


@triton.jit
def reshape_and_cache_kernel(
    Key, Value, K_cache, V_cache, Slot_mapping, K_scale, V_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    QUANT: tl.constexpr = False, FP8_MAX: tl.constexpr = 0.0, MANTISSA: tl.constexpr = 0, MIN_EXP: tl.constexpr = 0,
):
    """Grid (tokens, cdiv(num_kv_heads, BLOCK_H)): one token's heads [BLOCK_H, D] per program. QUANT: the caches
    are fp8 and K_scale/V_scale (num_kv_heads,) float32 divide each head first (else both are None)."""
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
    if QUANT:
        heads_ok = heads < num_kv_heads
        k_scale = tl.load(K_scale + heads, mask=heads_ok, other=1.0)[:, None]
        v_scale = tl.load(V_scale + heads, mask=heads_ok, other=1.0)[:, None]
        k = quantize_fp8(k, k_scale, K_cache.dtype.element_ty, FP8_MAX, MANTISSA, MIN_EXP)
        v = quantize_fp8(v, v_scale, V_cache.dtype.element_ty, FP8_MAX, MANTISSA, MIN_EXP)
    tl.store(k_dst, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_cache.dtype.element_ty), mask=mask)


# The table width and the per-sequence arrays' alignment (row slices of a batch) vary per call.
@triton.jit(do_not_specialize=["stride_table"],
            do_not_specialize_on_alignment=["Block_table", "Seq_lens", "Cu_seqlens_k"])
def gather_cache_kernel(
    K_cache, V_cache, Block_table, Seq_lens, Cu_seqlens_k, K_out, V_out, K_scale, V_scale,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_table, stride_ot, stride_oh,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, DEQUANT: tl.constexpr = False,
):
    """Grid (cdiv(max positions, BLOCK_T), batch): positions [t*BLOCK_T, (t+1)*BLOCK_T) of sequence b, read
    through its block table, to rows Cu_seqlens_k[b] + position of the packed K_out/V_out (rows, heads, D).
    Positions at or past Seq_lens[b] are not touched; a table entry < 0 (an evicted block) is never read and
    its positions are written as zeros. DEQUANT: fp8 caches, multiplied by K_scale/V_scale (num_kv_heads,) per
    head in float32 before the store casts to the packed buffers' dtype."""
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
            if DEQUANT:
                heads_ok = heads < num_kv_heads
                k = k.to(tl.float32) * tl.load(K_scale + heads, mask=heads_ok, other=1.0)[None, :, None]
                v = v.to(tl.float32) * tl.load(V_scale + heads, mask=heads_ok, other=1.0)[None, :, None]
            dst = (row * stride_ot)[:, None, None] + heads[None, :, None] * stride_oh + offs_d[None, None, :]
            tl.store(K_out + dst, k.to(K_out.dtype.element_ty), mask=live[:, None, None] & ok)
            tl.store(V_out + dst, v.to(V_out.dtype.element_ty), mask=live[:, None, None] & ok)
