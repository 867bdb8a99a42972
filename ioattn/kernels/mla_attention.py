"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, weights absorbed.

Each cached row holds one token's latent (LATENT values, e.g. 512) followed by its decoupled RoPE key (ROPE, 64):
a single shared "KV head". With W_UK folded into the query and W_UV applied after, attention is MQA in the latent
space: scores = q_latent · latentᵀ + q_rope · k_ropeᵀ and output = p · latent, so V is the first LATENT columns
of the very rows K came from, loaded once for both dots. The group is every query head, so one program owns a
block of BLOCK_H heads (16 rows at TP 8's 16 heads; 64 at 128 heads, two programs per sequence) and, for
multi-token queries (speculative verify, chunked prefill over a cache), TOKENS consecutive tokens of one sequence
(row r: token r // BLOCK_H, head r % BLOCK_H), causal bottom-right: query i of a sequence with q_len queries
sits at position seq_len - q_len + i.

Splits divide a tile's visible key range as in `ioattn.kernels.paged_attention` (whose `_tile_blocks` reads
the block table once per page of a key tile); each split writes its normalised partial and natural-log LSE for
`ioattn.kernels.combine`, or with one split the final output. Rows that see no key give output 0 and LSE -inf,
never NaN.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ioattn.kernels.paged_attention import LN2, _dot, _online_softmax, _tile_blocks


@triton.jit
def _latent_tiles(acc, m_i, l_i, q_latent, q_rope, pos, Cache, table_row, seq_len, tile_lo, tile_hi, scale_log2,
                  stride_cb, stride_cs, offs_l, offs_r, LATENT: tl.constexpr, ROPE: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Online softmax (base 2) over key tiles [tile_lo, tile_hi) of one sequence's latent rows. Every tile is
    masked: the 1088-wide dots dwarf the mask, and one loop holds fewer registers than an unmasked inner loop
    beside a masked boundary one (214 against 255 and spills at 64 heads x 512, sm_90 build)."""
    l_ok = offs_l < LATENT
    r_ok = offs_r < ROPE
    for tile in tl.range(tile_lo, tile_hi, num_stages=NUM_STAGES):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        block = _tile_blocks(table_row, tile, seq_len, PAGE, BLOCK_N)
        row = (block * stride_cb + (offs_n % PAGE) * stride_cs)[:, None]
        live = (block >= 0) & (offs_n < seq_len)
        latent = tl.load(Cache + row + offs_l[None, :], mask=live[:, None] & l_ok[None, :], other=0.0)
        k_rope = tl.load(Cache + row + LATENT + offs_r[None, :], mask=live[:, None] & r_ok[None, :], other=0.0)
        s = _dot(q_latent, tl.trans(latent), None, IEEE)
        s = _dot(q_rope, tl.trans(k_rope), s, IEEE) * scale_log2
        s = tl.where(live[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, latent, IEEE)
    return acc, m_i, l_i


# Per-call values (split count, tiles per sequence, the table width and the strides that scale with the token
# count, the alignment of row slices of an engine's batch arrays) would each compile a specialisation mid-serving.
@triton.jit(do_not_specialize=["num_splits", "q_tiles_per_seq", "stride_table", "stride_os", "stride_ls",
                               "stride_lt", "stride_lh"],
            do_not_specialize_on_alignment=["Block_table", "Seq_lens", "Cu_seqlens_q"])
def mla_attention_kernel(
    Q, Cache, Block_table, Seq_lens, Cu_seqlens_q, Out, Lse,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_table,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt, stride_lh,
    scale_log2, num_heads, num_splits, q_tiles_per_seq,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    DECODE: tl.constexpr, IEEE: tl.constexpr, NUM_STAGES: tl.constexpr, RELEASE_DEPENDENTS: tl.constexpr = False,
):
    """Grid (batch * q_tiles_per_seq, cdiv(num_heads, BLOCK_H), num_splits). Out [split, token, head, LATENT] and
    Lse [split, token, head]. RELEASE_DEPENDENTS: let the split combine, launched by programmatic dependent
    launch, start once every program of this grid has started (sm_90+)."""
    if RELEASE_DEPENDENTS:
        gdc_launch_dependents()
    seq = tl.program_id(0) // q_tiles_per_seq
    q_tile = tl.program_id(0) % q_tiles_per_seq
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + seq)
    if DECODE:
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(Cu_seqlens_q + seq)
        q_len = tl.load(Cu_seqlens_q + seq + 1) - q_start

    rows = tl.arange(0, TOKENS * BLOCK_H)
    token = q_tile * TOKENS + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (head < num_heads) & (token < q_len)
    pos = seq_len - q_len + token
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = Q + (q_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q_latent = tl.load(q_row + offs_l[None, :], mask=row_ok[:, None] & (offs_l < LATENT)[None, :], other=0.0)
    q_rope = tl.load(q_row + LATENT + offs_r[None, :], mask=row_ok[:, None] & (offs_r < ROPE)[None, :], other=0.0)

    # Keys this tile may see: up to its last valid token's position; none for a padding tile of a short sequence.
    last_pos = seq_len - q_len + tl.minimum(q_tile * TOKENS + TOKENS, q_len) - 1
    kv_hi = tl.where(q_tile * TOKENS < q_len, last_pos + 1, 0)
    tile_hi = (kv_hi + BLOCK_N - 1) // BLOCK_N
    per_split = (tile_hi + num_splits - 1) // num_splits
    split_lo = tl.minimum(split * per_split, tile_hi)
    split_hi = tl.minimum(split_lo + per_split, tile_hi)

    acc = tl.zeros([TOKENS * BLOCK_H, BLOCK_L], dtype=tl.float32)
    m_i = tl.full([TOKENS * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([TOKENS * BLOCK_H], dtype=tl.float32)
    table_row = Block_table + seq.to(tl.int64) * stride_table
    acc, m_i, l_i = _latent_tiles(
        acc, m_i, l_i, q_latent, q_rope, pos, Cache, table_row, seq_len, split_lo, split_hi, scale_log2,
        stride_cb, stride_cs, offs_l, offs_r, LATENT, ROPE, PAGE, BLOCK_N, IEEE, NUM_STAGES)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    token64 = (q_start + token).to(tl.int64)
    o_ptrs = (Out + split.to(tl.int64) * stride_os + token64[:, None] * stride_ot + head[:, None] * stride_oh
              + offs_l[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_l < LATENT)[None, :])
    tl.store(Lse + split.to(tl.int64) * stride_ls + token64 * stride_lt + head * stride_lh, lse, mask=row_ok)
