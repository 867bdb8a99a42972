"""Absorbed MLA decode for sm_90 in Gluon: a producer warp brings latent rows in by TMA, consumer warps do the math
(the design of `ioattn.kernels.gluon_paged`, for MLA's one shared KV head of LATENT + ROPE values): 16 query heads
per program on mma.sync, or (WIDE) 64 on wgmma for the compute-bound head counts.

A cached row is one token's latent (LATENT values, 512 in DeepSeek-V3) followed by its RoPE key (ROPE, 64). In
the absorbed form every query head attends to the same rows: S = q_latent · latentᵀ + q_rope · k_ropeᵀ and
O = P · latent, so V is the latent part of the very tile K came from and is read from HBM once.

- The producer (1 warp) reads each tile's block ids and, once the tile's stage of the STAGES-deep ring is free,
  TMA-loads each page's latent part and RoPE part (two boxes of the cache viewed as (blocks * PAGE, LATENT +
  ROPE) rows of slots) into the stage, completing its `ready` mbarrier.
- The consumers (4 warps) own (sequence, block of 16 query heads, split). Q sits in shared memory (16 x 576 in
  registers would not leave room for the 16 x 512 float32 accumulator). S is accumulated over 64-column chunks
  of Q and of the latent tile with mma.sync, the warps splitting the keys; P goes to every warp through shared
  memory and O += P · V runs 16 keys at a time, the warps splitting V's columns. The running max moves only when
  some P would pass 2**RESCALE_THRESHOLD (as `gluon_paged`'s conditional rescale: exact either way). The last
  tile, which may reach past seq_len, is peeled: its stale rows are masked in S and zeroed in the stage before
  P · V reads them.

- WIDE: two consumer warpgroups; S = Q·Kᵀ and O += P·V on wgmma from shared memory, the warpgroups splitting S's
  keys and O's LATENT columns (64 x 256 float32 each at 512), the running max moved every tile.

Out/Lse take `ioattn.kernels.mla_attention`'s layout (split partials merged by `ioattn.kernels.combine`). Decode
only; bf16 or fp16; LATENT a multiple of 64 up to 512, ROPE 64; pages of 16+ slots.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ioattn.kernels.gluon_paged import (
    BLOCK_M, PRODUCER_REGS, _page_blocks, _rescale, finish_rows, release_dependents, ring_barriers, split_tiles,
    store_rows,
)

CHUNK: gl.constexpr = gl.constexpr(64)  # columns per S step: one 128-byte swizzle row of a 16-bit tile
KEYS_PER_PV: gl.constexpr = gl.constexpr(16)  # keys per O += P·V step (mma's k)
# the 16-head consumer moves the running max only when some P would pass 2**8 (as the Gluon paged decode's default)
RESCALE_THRESHOLD: gl.constexpr = gl.constexpr(8.0)


@gluon.jit
def _producer(lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi,
              PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp: per tile, its block ids from the table, then the TMA copies of its pages once the stage is free."""
    STAGES: gl.constexpr = lat_smem.shape[0]
    LATENT: gl.constexpr = lat_smem.shape[2]
    ROWS: gl.constexpr = lat_desc.block_type.shape[0]
    PAGES: gl.constexpr = BLOCK_N // ROWS
    ids_layout: gl.constexpr = gl.BlockedLayout([PAGES], [32], [1], [0])
    ids = gl.arange(0, PAGES, layout=ids_layout)
    for tile in range(lo, hi):
        j = tile - lo
        stage = j % STAGES
        blocks = _page_blocks(table_row, tile, seq_len, PAGE, BLOCK_N, ids_layout)
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes the first lap
        ready_s = ready.index(stage)
        mbarrier.expect(ready_s, PAGES * (lat_desc.block_type.nbytes + rope_desc.block_type.nbytes))
        slot = (tile * BLOCK_N) % PAGE if PAGE > BLOCK_N else 0
        for p in gl.static_range(PAGES):
            row = gl.sum(gl.where(ids == p, blocks, 0), 0) * PAGE + slot  # every thread holds all ids
            tma.async_copy_global_to_shared(lat_desc, [row, 0], ready_s, lat_smem.index(stage).slice(p * ROWS, ROWS))
            tma.async_copy_global_to_shared(rope_desc, [row, LATENT], ready_s,
                                            rope_smem.index(stage).slice(p * ROWS, ROWS))


@gluon.jit
def _zero_stale_rows(lat, tile, seq_len):
    """Zero the rows of latent tile `tile` (a ring stage) at or past seq_len: P·V reads them as V, and a stale row
    may hold anything (NaN included) that a zero probability would not cancel."""
    BLOCK_N: gl.constexpr = lat.shape[0]
    LATENT: gl.constexpr = lat.shape[1]
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows_layout))
    for c in gl.static_range(LATENT // CHUNK):
        v_chunk = lat.slice(c * CHUNK, CHUNK, dim=1)
        v_chunk.store(gl.where((rows < seq_len)[:, None], v_chunk.load(rows_layout), 0.0))


@gluon.jit
def _stage_q(Q, q_lat, q_rope, seq, first_head, num_heads, stride_qt, stride_qh, q_layout: gl.constexpr):
    """The queries of heads first_head.. of sequence `seq` to shared memory: the latent part and the RoPE part of
    each row (rows past num_heads as 0)."""
    LATENT: gl.constexpr = q_lat.shape[1]
    heads = first_head + gl.arange(0, q_lat.shape[0], layout=gl.SliceLayout(1, q_layout))
    q_row = Q + seq.to(gl.int64) * stride_qt + heads[:, None] * stride_qh
    q_cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, q_layout))
    q_lat.store(gl.load(q_row + q_cols[None, :], mask=(heads < num_heads)[:, None], other=0.0))
    r_cols = gl.arange(0, q_rope.shape[1], layout=gl.SliceLayout(0, q_layout))
    q_rope.store(gl.load(q_row + LATENT + r_cols[None, :], mask=(heads < num_heads)[:, None], other=0.0))


@gluon.jit
def _attend_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty, j, tile, seq_len,
                 scale_log2, mma: gl.constexpr, MASKED: gl.constexpr):
    """One latent tile (ring slot j % STAGES) folded into the running state; MASKED: the tile reaches past
    seq_len (its stale rows are masked in S and zeroed before P·V: they may hold anything, NaN included)."""
    STAGES: gl.constexpr = lat_smem.shape[0]
    BLOCK_N: gl.constexpr = lat_smem.shape[1]
    LATENT: gl.constexpr = lat_smem.shape[2]
    a_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    lat = lat_smem.index(stage)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    for c in gl.static_range(LATENT // CHUNK):
        k = lat.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)).load(b_operand)
        s = mma_v2(q_lat.slice(c * CHUNK, CHUNK, dim=1).load(a_operand), k, s)
    s = mma_v2(q_rope.load(a_operand), rope_smem.index(stage).permute((1, 0)).load(b_operand), s) * scale_log2
    if MASKED:
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        s = gl.where(keys[None, :] < seq_len, s, float("-inf"))
        _zero_stale_rows(lat, tile, seq_len)
    # P against the running max as it stands; every warp then holds all of P, so "some P above 2**threshold" (or
    # the program's first tile) is one decision taken alike by all warps, and only then is the row max reduced
    m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(s - m_ref[:, None])
    p_smem.store(p.to(p_smem.dtype))
    if (j == 0) | (gl.max(gl.max(p_smem.load(a_operand).to(gl.float32), 1), 0) > 2.0 ** RESCALE_THRESHOLD):
        acc, m_i, l_tile, p = _rescale(acc, m_i, l_tile, s)
        p_smem.store(p.to(p_smem.dtype))
    l_tile = l_tile + p
    for k0 in gl.static_range(0, BLOCK_N, KEYS_PER_PV):
        p_k = p_smem.slice(k0, KEYS_PER_PV, dim=1).load(a_operand)
        acc = mma_v2(p_k, lat.slice(k0, KEYS_PER_PV).load(b_operand), acc)
    mbarrier.arrive(empty.index(stage), count=1)
    return acc, m_i, l_tile


@gluon.jit
def _consumer(Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block, split,
              seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
              stride_lh, scale_log2):
    BLOCK_N: gl.constexpr = lat_smem.shape[1]
    LATENT: gl.constexpr = lat_smem.shape[2]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, NUM_WARPS], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)

    _stage_q(Q, q_lat, q_rope, seq, head_block * BLOCK_M, num_heads, stride_qt, stride_qh, q_layout)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_tile = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)  # row sums per key column, reduced at the end
    acc = gl.zeros([BLOCK_M, LATENT], gl.float32, mma)
    # tiles below full_hi hold keys below seq_len only (no masks); clamped to lo for a split past the last tile
    full_hi = gl.maximum(gl.minimum(hi, seq_len // BLOCK_N), lo)
    for tile in range(lo, full_hi):
        acc, m_i, l_tile = _attend_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty,
                                        tile - lo, tile, seq_len, scale_log2, mma, False)
    for tile in range(full_hi, hi):  # the last tile, partly past seq_len
        acc, m_i, l_tile = _attend_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty,
                                        tile - lo, tile, seq_len, scale_log2, mma, True)

    out, lse = finish_rows(acc, m_i, l_tile)
    store_rows(Out, Lse, out, lse, split, seq, head_block * BLOCK_M, num_heads - head_block * BLOCK_M, stride_os,
               stride_ot, stride_oh, stride_ls, stride_lt, stride_lh)


# --- 64 heads per program on wgmma (the compute-bound shapes: 128 heads at TP 1) --------------------------------

WIDE_HEADS: gl.constexpr = gl.constexpr(64)  # query heads per program: wgmma's M


@gluon.jit
def _wide_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty, j, tile, seq_len,
               scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr, MASKED: gl.constexpr):
    """One latent tile folded into the running state of 64 heads: S = Q·Kᵀ and O += P·V on wgmma, the two
    warpgroups splitting each product's columns (S: the keys; O: the latent's 512 values)."""
    STAGES: gl.constexpr = lat_smem.shape[0]
    BLOCK_N: gl.constexpr = lat_smem.shape[1]
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    lat = lat_smem.index(stage)
    s = warpgroup_mma(q_lat, lat.permute((1, 0)), gl.zeros([WIDE_HEADS, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma(q_rope, rope_smem.index(stage).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s]) * scale_log2
    if MASKED:
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(keys[None, :] < seq_len, s, float("-inf"))
        _zero_stale_rows(lat, tile, seq_len)
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = gl.exp2(m_i - m_safe)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p = gl.exp2(s - m_safe[:, None])
    l_tile = l_tile * alpha[:, None] + p
    m_i = m_new
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    acc = warpgroup_mma(p_smem, lat, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index(stage), count=1)
    return acc, m_i, l_tile


@gluon.jit
def _wide_consumer(Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block, split,
                   seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls,
                   stride_lt, stride_lh, scale_log2):
    """The 64-head consumer (two warpgroups): it moves the running max every tile."""
    BLOCK_N: gl.constexpr = lat_smem.shape[1]
    LATENT: gl.constexpr = lat_smem.shape[2]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                       instr_shape=[16, BLOCK_N // (NUM_WARPS // 4), 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                       instr_shape=[16, LATENT // (NUM_WARPS // 4), 16])

    _stage_q(Q, q_lat, q_rope, seq, head_block * WIDE_HEADS, num_heads, stride_qt, stride_qh, q_layout)
    fence_async_shared()

    m_i = gl.full([WIDE_HEADS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_tile = gl.zeros([WIDE_HEADS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([WIDE_HEADS, LATENT], gl.float32, o_layout)
    full_hi = gl.maximum(gl.minimum(hi, seq_len // BLOCK_N), lo)
    for tile in range(lo, full_hi):
        acc, m_i, l_tile = _wide_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty,
                                      tile - lo, tile, seq_len, scale_log2, s_layout, o_layout, False)
    for tile in range(full_hi, hi):  # the last tile, partly past seq_len
        acc, m_i, l_tile = _wide_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty,
                                      tile - lo, tile, seq_len, scale_log2, s_layout, o_layout, True)

    out, lse = finish_rows(acc, m_i, l_tile)
    store_rows(Out, Lse, out, lse, split, seq, head_block * WIDE_HEADS, num_heads - head_block * WIDE_HEADS,
               stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh)


@gluon.jit(do_not_specialize=["num_splits", "stride_table", "stride_os", "stride_ls", "stride_lt", "stride_lh"],
           do_not_specialize_on_alignment=["Block_table", "Seq_lens"])
def gluon_mla_decode_kernel(
    lat_desc, rope_desc, Q, Block_table, Seq_lens, Out, Lse,
    stride_qt, stride_qh, stride_table, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh,
    scale_log2, num_heads, num_splits,
    BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, WIDE: gl.constexpr,
    RELEASE_DEPENDENTS: gl.constexpr = False,
):
    """Grid (cdiv(num_heads, BLOCK_H), batch, num_splits) with BLOCK_H 16 (4 warps, mma.sync) or, WIDE, 64 (8
    warps: two warpgroups on wgmma), + 1 producer warp. lat_desc / rope_desc: TMA descriptors over the latent cache
    viewed as (blocks * PAGE, LATENT + ROPE) with boxes [min(PAGE, BLOCK_N), LATENT] and [min(PAGE, BLOCK_N),
    ROPE]. Q (tokens, heads, LATENT + ROPE). Out (splits, tokens, heads, LATENT) and Lse (splits, tokens, heads),
    float32 (or Out in q's dtype with one split), as `mla_attention_kernel` writes them. RELEASE_DEPENDENTS: see
    `gluon_paged.release_dependents`."""
    LATENT: gl.constexpr = lat_desc.block_type.shape[1]
    ROPE: gl.constexpr = rope_desc.block_type.shape[1]
    HEADS: gl.constexpr = WIDE_HEADS if WIDE else BLOCK_M
    dtype: gl.constexpr = lat_desc.dtype

    release_dependents(RELEASE_DEPENDENTS)
    head_block = gl.program_id(0)  # the fastest axis: a sequence's head blocks run together and share its rows in L2
    seq = gl.program_id(1)
    split = gl.program_id(2)
    seq_len, lo, hi = split_tiles(Seq_lens, seq, split, num_splits, BLOCK_N)

    lat_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, LATENT],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype))
    rope_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype))
    q_lat = gl.allocate_shared_memory(dtype, [HEADS, LATENT], gl.NVMMASharedLayout.get_default_for([HEADS, LATENT],
                                                                                                    dtype))
    q_rope = gl.allocate_shared_memory(dtype, [HEADS, ROPE], gl.NVMMASharedLayout.get_default_for([HEADS, ROPE],
                                                                                                  dtype))
    p_smem = gl.allocate_shared_memory(dtype, [HEADS, BLOCK_N], gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N],
                                                                                                     dtype))
    ready, empty = ring_barriers(STAGES)
    table_row = Block_table + seq.to(gl.int64) * stride_table
    # (a tuple held in a variable loses its constexprs: the producer's stay written out)
    consumer_args = (Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block, split,
                     seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls,
                     stride_lt, stride_lh, scale_log2)
    if WIDE:
        gl.warp_specialize([(_wide_consumer, consumer_args), (_producer, (
            lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE, BLOCK_N))],
            [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, consumer_args), (_producer, (
            lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE, BLOCK_N))],
            [1], [PRODUCER_REGS])
