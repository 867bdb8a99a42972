"""Split-KV attention over a paged KV cache (Flash-Decoding), for decode and multi-token queries.

One program owns (query tile of one sequence, KV head, split). Its tile packs, row by row, every query head
that shares the KV head and — for multi-token queries — several consecutive tokens (row r: token r // GROUP,
head r % GROUP), so each K/V tile is loaded once for the whole group. Keys are gathered through the block
table: a K/V tile of BLOCK_N logical positions maps to physical rows `block_table[pos // PAGE] * PAGE +
pos % PAGE`. Splits divide the visible key range of the tile; every split writes its normalised partial
output and natural-log LSE, and `ioattn.kernels.combine` merges them. With one split the program writes the
final output directly. Masking is over logical positions: query at position p sees key k iff k < seq_len,
k <= p + right (when right >= 0) and (k >= p - left or k < sink_tokens) (when left >= 0).
"""

import triton
import triton.language as tl

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b (acc may be None). fp32 inputs must not round to tf32: the fp32 tolerance is tighter."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _page_blocks(table_row, offs_n, tile_start, seq_len, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical block id (int64) of each logical position `offs_n` of one K/V tile."""
    if PAGE >= BLOCK_N:
        # The whole tile lies in one cache block: a single table read, and the rows stay provably contiguous.
        return tl.load(table_row + tile_start // PAGE).to(tl.int64)
    else:
        return tl.load(table_row + offs_n // PAGE, mask=offs_n < seq_len, other=0).to(tl.int64)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, pos, K_head, V_head, table_row, seq_len, tile_lo, tile_hi,
                  window_left, window_right, sink_tokens, scale_log2,
                  stride_kb, stride_ks, stride_vb, stride_vs,
                  offs_d, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr, NUM_STAGES: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax over key tiles [tile_lo, tile_hi); scores kept in base 2 (exp2 is the fast path).

    MASKED=False is for tiles every row sees whole: no bounds or position tests at all (the common case).
    """
    d_ok = offs_d < HEAD_DIM
    for tile in tl.range(tile_lo, tile_hi, num_stages=NUM_STAGES):
        start = tile * BLOCK_N
        offs_n = start + tl.arange(0, BLOCK_N)
        block = _page_blocks(table_row, offs_n, start, seq_len, PAGE, BLOCK_N)
        slot = offs_n % PAGE
        k_ptrs = K_head + (block * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
        v_ptrs = V_head + (block * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
        if MASKED:
            in_seq = offs_n < seq_len
            k = tl.load(k_ptrs, mask=in_seq[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_seq[:, None] & d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k), None, IEEE) * scale_log2
            seen = (in_seq[None, :]
                    & ((window_right < 0) | (offs_n[None, :] <= pos[:, None] + window_right))
                    & ((window_left < 0) | (offs_n[None, :] >= pos[:, None] - window_left)
                       | (offs_n[None, :] < sink_tokens)))
            s = tl.where(seen, s, float("-inf"))
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k), None, IEEE) * scale_log2

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(
    Q, K_cache, V_cache, Block_table, Seq_lens, Cu_seqlens_q, Out, Lse,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_table,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt, stride_lh,
    scale_log2, window_left, window_right, sink_tokens, num_splits, q_tiles_per_seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DECODE: tl.constexpr,
    IEEE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Grid (batch * q_tiles_per_seq, num_kv_heads, num_splits). Out/Lse are indexed [split, token, head]."""
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
    # Tiles that every row of this tile sees whole need no mask: [full_lo, full_hi) within this split.
    full_lo = tl.where(window_left >= 0, (tl.maximum(last_pos - window_left, 0) + BLOCK_N - 1) // BLOCK_N, tile_lo)
    full_hi = tl.where(window_right >= 0, tl.minimum(seq_len, first_pos + window_right + 1), seq_len) // BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, split_lo), split_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), split_hi)

    # Sink tiles left of the window are always visible; the first split owns them.
    sink_hi = tl.minimum((tl.minimum(sink_tokens, kv_hi) + BLOCK_N - 1) // BLOCK_N, tile_lo)
    sink_hi = tl.where(split == 0, sink_hi, 0)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, pos, K_head, V_head, table_row, seq_len, 0, sink_hi,
        window_left, window_right, sink_tokens, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
        offs_d, HEAD_DIM, PAGE, BLOCK_N, IEEE, NUM_STAGES, True)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, pos, K_head, V_head, table_row, seq_len, split_lo, full_lo,
        window_left, window_right, sink_tokens, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
        offs_d, HEAD_DIM, PAGE, BLOCK_N, IEEE, NUM_STAGES, True)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, pos, K_head, V_head, table_row, seq_len, full_lo, full_hi,
        window_left, window_right, sink_tokens, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
        offs_d, HEAD_DIM, PAGE, BLOCK_N, IEEE, NUM_STAGES, False)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, pos, K_head, V_head, table_row, seq_len, full_hi, split_hi,
        window_left, window_right, sink_tokens, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
        offs_d, HEAD_DIM, PAGE, BLOCK_N, IEEE, NUM_STAGES, True)

    # Empty rows (no visible key in this split) write output 0 and LSE -inf, never NaN.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = (Out + split.to(tl.int64) * stride_os + (q_start + token)[:, None].to(tl.int64) * stride_ot
              + head[:, None] * stride_oh + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    l_ptrs = Lse + split.to(tl.int64) * stride_ls + (q_start + token).to(tl.int64) * stride_lt + head * stride_lh
    tl.store(l_ptrs, lse, mask=row_ok)
