"""Split-KV attention over a paged KV cache (Flash-Decoding), for decode and multi-token queries.

One program owns (query tile of one sequence, KV head, split). Its tile packs, row by row, every query head
that shares the KV head and — for multi-token queries — several consecutive tokens (row r: token r // GROUP,
head r % GROUP), so each K/V tile is loaded once for the whole group. Keys are gathered through the block
table: a K/V tile of BLOCK_N logical positions maps to physical rows `block_table[pos // PAGE] * PAGE +
pos % PAGE`, with one table read per page of the tile (reading it per position cost a quarter of the decode
bandwidth on an H200: 2.97 against 4.21 TB/s at B=64 L=4k, bench/results/2026-12-01-explore1/2-h200.json).
Splits divide the visible key range of the tile; every split writes its normalised partial output and
natural-log LSE, and `ioattn.kernels.combine` merges them. With one split the program writes the final output
directly. Masking is over logical positions: query at position p sees key k iff k < seq_len, k <= p + right
(when right >= 0) and (k >= p - left or k < sink_tokens) (when left >= 0). A table entry of -1 (a block an
eviction policy freed) is never read: masked tiles load only positions whose block id is >= 0.

FP8 caches (FP8): K/V tiles are loaded as fp8 (half the bytes of bf16) and converted exactly in registers: to the
query's dtype, or (FP16_DOTS, bf16 queries on CUDA) to float16, two codes per instruction, with the queries scaled
into float16 by a power of two per row (`to_fp16_by_rows`) and the dots run in float16. Triton converts fp8 to bf16
through float32, an F2F per element; an integer fp8 -> bf16 upcast still cost 3 instructions per cached element
against 0.5 for the conversion to float16 (lab/aot.py --sass: 741 -> 415 per thread per 64-key tile; H100 decode
4-6% faster than the integer upcast, 17-21% than Triton's bf16 conversion, bench/results/2026-12-06-fp8-fp16-dots-h100).
The dequantization scales, one per KV head (the program's), cost two scalar loads: the K scale multiplies the
softmax scale, the V scale the normalised output (partials included: the merge is linear), so the kernel computes
attention over the dequantized cache with no rounding of its own beyond the usual (float16 keeps 3 more bits of
the probabilities than bf16).

Loop shape, as Triton 3.6 pipelines it (read off the sm_90 TTGIR with lab/aot.py): the gathered K/V
loads get one shared-memory buffer, issued at the end of an iteration and awaited at the start of the next, so
a program overlaps little of its own load latency; resident programs hide it for each other, which is why the
decode tile is small (few registers and little shared memory: ~5 programs per SM) and why the split heuristic
in `ioattn.ops.paged` aims at several programs per SM.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


# fp8 -> fp16 by the conversion unit, 2 codes per instruction (cvt.rn.f16x2.e4m3x2 / e5m2x2; NaN stays NaN, inf
# inf), written as inline PTX so that V's conversion can be pinned (see `upcast_fp8_fp16`).
_FP8_TO_FP16 = """{ .reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.FMT $0, lo;
cvt.rn.f16x2.FMT $1, hi; }"""
E4M3_TO_FP16: tl.constexpr = tl.constexpr(_FP8_TO_FP16.replace("FMT", "e4m3x2"))
E5M2_TO_FP16: tl.constexpr = tl.constexpr(_FP8_TO_FP16.replace("FMT", "e5m2x2"))


@triton.jit
def upcast_fp8_fp16(x, PINNED: tl.constexpr):
    """fp8 codes -> float16, exactly. PINNED keeps the conversion where it is written: as a pure op Triton moves it
    past the tile's change to the dot-operand layout, which for V (the second operand of P @ V, keys along its
    rows) reads fp8 from shared memory one byte per instruction (256 LDS.U8 in the sm_90 decode build); pinned, V
    is converted in the load's layout and changes layout as float16, with ldmatrix.trans."""
    if x.dtype == tl.float8e5:
        asm: tl.constexpr = E5M2_TO_FP16
    else:
        asm: tl.constexpr = E4M3_TO_FP16
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                     is_pure=not PINNED, pack=4)


@triton.jit
def to_fp16_by_rows(q):
    """q (rows, D) -> (q * 2^e as float16, 2^-e per row): e puts each row's largest |q| in [2^14, 2^15], so a bf16
    row fits float16 (max 65504) whatever its magnitude, exactly (a power of two; bf16's 8 significant bits fit
    float16's 11 down to 2^-32 of the row's max, where float16's subnormals begin to drop them)."""
    amax = tl.max(tl.abs(q.to(tl.float32)), 1)
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the exponent field: 0 zero/subnormal, 255 inf/NaN
    shift = tl.where((biased > 0) & (biased < 255), 141 - biased, 0)  # 14 - (biased - 127)
    shift = tl.minimum(tl.maximum(shift, -126), 126)
    up = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * up[:, None]).to(tl.float16), down


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b (acc may be None). fp32 inputs must not round to tf32: the fp32 tolerance is tighter."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _upcast_kv(k, v, dtype: tl.constexpr, FP8: tl.constexpr, FP16_DOTS: tl.constexpr):
    """K and V tiles as the dots take them: unchanged, or fp8 converted exactly (every fp8 value is a float16/
    bfloat16/float32 value) to float16 (FP16_DOTS) or to the queries' dtype."""
    if FP8:
        if FP16_DOTS:
            return upcast_fp8_fp16(k, False), upcast_fp8_fp16(v, True)
        else:
            return k.to(dtype), v.to(dtype)
    else:
        return k, v


@triton.jit
def _scaled(s, scale_log2, FP16_DOTS: tl.constexpr):
    """Scores times the softmax scale in base 2: one per row with FP16_DOTS (it undoes each row's power of two, see
    `to_fp16_by_rows`), else one for all."""
    if FP16_DOTS:
        return s * scale_log2[:, None]
    else:
        return s * scale_log2


@triton.jit
def _tile_blocks(table_row, tile, seq_len, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical block id (int64) of the positions of K/V tile `tile`; -1 past seq_len (the table is not read)."""
    start = tile * BLOCK_N
    if PAGE >= BLOCK_N:
        # The whole tile lies in one cache block: a single table read, and the rows stay provably contiguous.
        return tl.load(table_row + start // PAGE, mask=start < seq_len, other=-1).to(tl.int64)
    else:
        # One table read per page of the tile, broadcast over the page's slots (not one per position).
        PAGES: tl.constexpr = BLOCK_N // PAGE
        pages = start // PAGE + tl.arange(0, PAGES)
        blocks = tl.load(table_row + pages, mask=pages * PAGE < seq_len, other=-1).to(tl.int64)
        return tl.reshape(tl.broadcast_to(blocks[:, None], [PAGES, PAGE]), [BLOCK_N])


@triton.jit
def _tile_rows(K_head, V_head, table_row, tile, seq_len, stride_kb, stride_ks, stride_vb, stride_vs, offs_d,
               PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(K pointers, V pointers, logical positions, physical block per position) of key tile `tile`."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    block = _tile_blocks(table_row, tile, seq_len, PAGE, BLOCK_N)
    slot = offs_n % PAGE
    k_ptrs = K_head + (block * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = V_head + (block * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
    return k_ptrs, v_ptrs, offs_n, block


@triton.jit
def _online_softmax(acc, m_i, l_i, s, v, IEEE: tl.constexpr):
    """Fold one tile's base-2 scores s (rows, keys; -inf where unseen) and its values into the running state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, pos, K_head, V_head, table_row, seq_len, tile_lo, tile_hi,
                  window_left, window_right, sink_tokens, scale_log2,
                  stride_kb, stride_ks, stride_vb, stride_vs,
                  offs_d, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr, NUM_STAGES: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr,
                  FP16_DOTS: tl.constexpr, PAIRED: tl.constexpr):
    """Online softmax over key tiles [tile_lo, tile_hi); scores kept in base 2 (exp2 is the fast path).

    MASKED=False is for tiles every row sees whole: no bounds or position tests at all. PAIRED (with MASKED=False):
    two tiles per step, both loaded before either is used, so a program has twice the bytes in flight at the
    registers of one tile (the pipeliner gives the table-dependent gathers a single buffer, so a program waits
    for each step's loads in full); an odd last tile goes alone.
    """
    d_ok = offs_d < HEAD_DIM
    if PAIRED and not MASKED:
        pairs = (tile_hi - tile_lo) // 2
        for pair in tl.range(0, pairs, num_stages=NUM_STAGES):
            tile = tile_lo + 2 * pair
            k_ptrs, v_ptrs, _, _ = _tile_rows(K_head, V_head, table_row, tile, seq_len, stride_kb, stride_ks,
                                              stride_vb, stride_vs, offs_d, PAGE, BLOCK_N)
            k0 = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v0 = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            k_ptrs, v_ptrs, _, _ = _tile_rows(K_head, V_head, table_row, tile + 1, seq_len, stride_kb, stride_ks,
                                              stride_vb, stride_vs, offs_d, PAGE, BLOCK_N)
            k1 = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v1 = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            k0, v0 = _upcast_kv(k0, v0, q.dtype, FP8, FP16_DOTS)
            s = _scaled(_dot(q, tl.trans(k0), None, IEEE), scale_log2, FP16_DOTS)
            acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, v0, IEEE)
            k1, v1 = _upcast_kv(k1, v1, q.dtype, FP8, FP16_DOTS)
            s = _scaled(_dot(q, tl.trans(k1), None, IEEE), scale_log2, FP16_DOTS)
            acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, v1, IEEE)
        tile_lo = tile_lo + 2 * pairs
    for tile in tl.range(tile_lo, tile_hi, num_stages=NUM_STAGES):
        k_ptrs, v_ptrs, offs_n, block = _tile_rows(K_head, V_head, table_row, tile, seq_len, stride_kb, stride_ks,
                                                   stride_vb, stride_vs, offs_d, PAGE, BLOCK_N)
        if MASKED:
            live = (block >= 0) & (offs_n < seq_len)  # evicted blocks and positions past the end read as zero
            k = tl.load(k_ptrs, mask=live[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=live[:, None] & d_ok[None, :], other=0.0)
            k, v = _upcast_kv(k, v, q.dtype, FP8, FP16_DOTS)
            s = _scaled(_dot(q, tl.trans(k), None, IEEE), scale_log2, FP16_DOTS)
            seen = (live[None, :]
                    & ((window_right < 0) | (offs_n[None, :] <= pos[:, None] + window_right))
                    & ((window_left < 0) | (offs_n[None, :] >= pos[:, None] - window_left)
                       | (offs_n[None, :] < sink_tokens)))
            s = tl.where(seen, s, float("-inf"))
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            k, v = _upcast_kv(k, v, q.dtype, FP8, FP16_DOTS)
            s = _scaled(_dot(q, tl.trans(k), None, IEEE), scale_log2, FP16_DOTS)
        acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, v, IEEE)
    return acc, m_i, l_i


# Per-call values (split count, tiles per sequence, windows, the table width, the strides that scale with the
# number of query tokens, and the alignment of the per-sequence arrays, which an engine passes as row slices of
# one batch) would otherwise each compile a specialisation (== 1, % 16) in the middle of serving: an engine step
# of 686 tokens after steps of 2048 stalled 2-3 s on an H200 compiling one (the packed LSE's head stride is the
# token count; a slice seq_lens[n:] is 16-byte aligned only when 4 divides n).
@triton.jit(do_not_specialize=["window_left", "window_right", "sink_tokens", "num_splits", "q_tiles_per_seq",
                               "stride_table", "stride_os", "stride_ls", "stride_lt", "stride_lh"],
            do_not_specialize_on_alignment=["Block_table", "Seq_lens", "Cu_seqlens_q"])
def paged_attention_kernel(
    Q, K_cache, V_cache, Block_table, Seq_lens, Cu_seqlens_q, Out, Lse, K_scale, V_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_table,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt, stride_lh,
    scale_log2, window_left, window_right, sink_tokens, num_splits, q_tiles_per_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DECODE: tl.constexpr,
    IEEE: tl.constexpr, NUM_STAGES: tl.constexpr, RELEASE_DEPENDENTS: tl.constexpr = False,
    FP8: tl.constexpr = False, FP16_DOTS: tl.constexpr = False, PAIRED: tl.constexpr = False,
):
    """Grid (batch * q_tiles_per_seq, num_kv_heads, num_splits). Out/Lse are indexed [split, token, head].

    FP8: the caches are fp8 and K_scale/V_scale float32 (num_kv_heads,) dequantize them; else both are None.
    FP16_DOTS (fp8, bf16 queries, compiled CUDA kernels): queries scaled per row into float16 and the tiles converted
    to float16 two codes per instruction; the dots run in float16.

    PAIRED: the tiles every row sees whole two per step (`_attend_tiles`).

    RELEASE_DEPENDENTS: let a kernel launched after this one by programmatic dependent launch (the split combine)
    start as soon as every program of this grid has started; it waits for this grid's end itself (sm_90+)."""
    if RELEASE_DEPENDENTS:
        gdc_launch_dependents()
    seq = tl.program_id(0) // q_tiles_per_seq
    q_tile = tl.program_id(0) % q_tiles_per_seq
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + seq)
    if DECODE:
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(Cu_seqlens_q + seq)
        q_len = tl.load(Cu_seqlens_q + seq + 1) - q_start

    # Rows of this tile: (token, query head of the group).
    rows = tl.arange(0, BLOCK_M)
    token = q_tile * TOKENS + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (token < q_len)
    pos = seq_len - q_len + token
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + (q_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Key range this tile may see, from its first and last valid token's positions.
    first_pos = seq_len - q_len + q_tile * TOKENS
    last_pos = seq_len - q_len + tl.minimum(q_tile * TOKENS + TOKENS, q_len) - 1
    kv_hi = tl.where(window_right >= 0, tl.minimum(seq_len, last_pos + window_right + 1), seq_len)
    kv_hi = tl.where(q_tile * TOKENS < q_len, kv_hi, 0)  # a padding tile of a shorter sequence: nothing to do
    kv_lo = tl.where(window_left >= 0, tl.maximum(first_pos - window_left, 0), 0)
    tile_lo = kv_lo // BLOCK_N
    tile_hi = tl.maximum((kv_hi + BLOCK_N - 1) // BLOCK_N, tile_lo)
    per_split = (tile_hi - tile_lo + num_splits - 1) // num_splits
    split_lo = tl.minimum(tile_lo + split * per_split, tile_hi)
    split_hi = tl.minimum(split_lo + per_split, tile_hi)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = Block_table + seq.to(tl.int64) * stride_table
    K_head = K_cache + kv_head * stride_kh
    V_head = V_cache + kv_head * stride_vh
    if FP8:
        scale_log2 = scale_log2 * tl.load(K_scale + kv_head)
        if FP16_DOTS:
            q, row_scale = to_fp16_by_rows(q)
            scale_log2 = scale_log2 * row_scale

    # Sink tiles left of the window are always visible; the first split owns them.
    sink_hi = tl.minimum((tl.minimum(sink_tokens, kv_hi) + BLOCK_N - 1) // BLOCK_N, tile_lo)
    sink_hi = tl.where(split == 0, sink_hi, 0)
    # Tiles that every row of this tile sees whole need no mask: [full_lo, full_hi) within this split.
    full_lo = tl.where(window_left >= 0, (tl.maximum(last_pos - window_left, 0) + BLOCK_N - 1) // BLOCK_N, tile_lo)
    full_hi = tl.where(window_right >= 0, tl.minimum(seq_len, first_pos + window_right + 1), seq_len) // BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, split_lo), split_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), split_hi)
    for segment in tl.static_range(4):  # sinks, boundary tiles, inner tiles (no element masks), boundary tiles
        lo = 0 if segment == 0 else (split_lo if segment == 1 else (full_lo if segment == 2 else full_hi))
        hi = sink_hi if segment == 0 else (full_lo if segment == 1 else (full_hi if segment == 2 else split_hi))
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, pos, K_head, V_head, table_row, seq_len, lo, hi,
            window_left, window_right, sink_tokens, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
            offs_d, HEAD_DIM, PAGE, BLOCK_N, IEEE, NUM_STAGES, segment != 2, FP8, FP16_DOTS, PAIRED)

    # Empty rows (no visible key in this split) write output 0 and LSE -inf, never NaN.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FP8:
        out = out * tl.load(V_scale + kv_head)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    token64 = (q_start + token).to(tl.int64)
    o_ptrs = (Out + split.to(tl.int64) * stride_os + token64[:, None] * stride_ot + head[:, None] * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + split.to(tl.int64) * stride_ls + token64 * stride_lt + head * stride_lh, lse, mask=row_ok)
