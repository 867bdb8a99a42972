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
- SEESAW (WIDE's 64 heads): the two warpgroups on a pair of tiles at once, each with its own S, so one's softmax
  overlaps the other's wgmmas (see the section below).

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
    BLOCK_M, PRODUCER_REGS, _page_blocks, _rescale, finish_row_sums, finish_rows, release_dependents, ring_barriers,
    split_tiles, store_rows,
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
def _stage_q(Q, q_lat, q_rope, seq, first_head, num_heads, stride_qt, stride_qh, q_layout: gl.constexpr,
             first: gl.constexpr = 0, count: gl.constexpr = 0, WITH_ROPE: gl.constexpr = True):
    """The queries of heads first_head.. of sequence `seq` to shared memory (rows past num_heads as 0): latent
    chunks first .. first + count of 64 columns (count 0: all of them) and, WITH_ROPE, the RoPE part; every load
    is issued before the first store (one global latency)."""
    LATENT: gl.constexpr = q_lat.shape[1]
    COLS: gl.constexpr = count * CHUNK if count else LATENT
    heads = first_head + gl.arange(0, q_lat.shape[0], layout=gl.SliceLayout(1, q_layout))
    q_row = Q + seq.to(gl.int64) * stride_qt + heads[:, None] * stride_qh
    live = (heads < num_heads)[:, None]
    q_cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, q_layout))
    lat = gl.load(q_row + first * CHUNK + q_cols[None, :], mask=live, other=0.0)
    if WITH_ROPE:
        r_cols = gl.arange(0, q_rope.shape[1], layout=gl.SliceLayout(0, q_layout))
        q_rope.store(gl.load(q_row + LATENT + r_cols[None, :], mask=live, other=0.0))
    q_lat.slice(first * CHUNK, COLS, dim=1).store(lat)


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
def _store_out(staging, Out, Lse, out, lse, split, seq, first_head, live_rows, stride_os, stride_ot, stride_oh,
               stride_ls, stride_lt, stride_lh, STAGED: gl.constexpr):
    """store_rows, or STAGED: through shared memory, O (in the accumulator's layout, whose warp-wide stores touch 8
    rows) into `staging` (ring stages no warp reads any more), then back in whole rows, 16 bytes per thread."""
    if STAGED:
        dtype: gl.constexpr = Out.dtype.element_ty
        VEC: gl.constexpr = 128 // dtype.primitive_bitwidth
        staged = staging._reinterpret(dtype, out.shape, gl.SwizzledSharedLayout(VEC, 1, 8, order=[1, 0]))
        gl.thread_barrier()  # every warp of this partition is done with the stages
        staged.store(out.to(dtype))
        gl.thread_barrier()
        out = staged.load(gl.BlockedLayout([1, VEC], [1, 32], [gl.num_warps(), 1], [1, 0]))
    store_rows(Out, Lse, out, lse, split, seq, first_head, live_rows, stride_os, stride_ot, stride_oh, stride_ls,
               stride_lt, stride_lh)


@gluon.jit
def _consumer(Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block, split,
              seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
              stride_lh, scale_log2, STAGE_OUT: gl.constexpr):
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
    _store_out(lat_smem, Out, Lse, out, lse, split, seq, head_block * BLOCK_M, num_heads - head_block * BLOCK_M,
               stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, STAGE_OUT)


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
                   stride_lt, stride_lh, scale_log2, STAGE_OUT: gl.constexpr):
    """The 64-head consumer (two warpgroups): it moves the running max every tile. STAGE_OUT: O leaves through the
    ring's stages (`_store_out`)."""
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
    _store_out(lat_smem, Out, Lse, out, lse, split, seq, head_block * WIDE_HEADS, num_heads - head_block * WIDE_HEADS,
               stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, STAGE_OUT)


# --- seesaw: 64 heads, the two warpgroups on two tiles at once (the compute-bound shapes) -------------------------
#
# O (64 x LATENT float32) fills one warpgroup's registers twice over, so it is split by columns: warpgroup 0 holds
# O's left half, warpgroup 1 its right half. Each pair of 64-key tiles (ring stages 0 and 1) runs as
#   [0] S0 = Q·K0ᵀ, m0 = max(m, rowmax S0) -> [1]; P0 = exp2(S0 - m0); O_L = O_L·exp2(m - m0) + P0·V0_L
#   [1] S1 = Q·K1ᵀ, m1 = max(m0, rowmax S1) -> [0] with P1 = exp2(S1 - m1); O_R = O_R·exp2(m - m1) + P1·V1_R
#   [0] P0 ·= exp2(m0 - m1) -> [1]; O_L = O_L·exp2(m0 - m1) + P1·V1_L        [1] O_R += P0·V0_R
# (FlashMLA's "seesaw" schedule): one warpgroup's softmax runs while the other's wgmmas hold the tensor cores, S is
# a full 64 x 64 wgmma (the lockstep kernel's 64 x 32 halves read Q from shared memory twice as often), and the
# running max is exchanged as one row vector per step instead of reduced across both warpgroups. P0 and P1 go
# through the RoPE part of their own stage (read by S before, reloaded only after both halves of P·V).
# Each stage is released in two halves as soon as their readers are done, so the next pair's loads start early:
#   stage 0: LATENT columns of O_L (after [0]'s P0·V0_L), the rest with the RoPE part (after [1]'s P0·V0_R);
#   stage 1: LATENT columns of O_R (after [1]'s P1·V1_R), the rest with the RoPE part (after [0]'s P1·V1_L);
# and S reads its stage's early half first. Every 64-column chunk has its own `ready` barrier.

SEESAW_TILE: gl.constexpr = gl.constexpr(64)  # keys per tile (wgmma's M is the 64 heads, its N these keys)
# setmaxnreg of consumer warpgroup 1 (a worker partition); warpgroup 0, the default partition, gets the same from
# what the launch has (168 x 384) less the producer's 40
SEESAW_REGS: gl.constexpr = gl.constexpr(232)
# the `sync` barriers between the two consumer warpgroups
SYNC_Q: gl.constexpr = gl.constexpr(0)  # both: Q staged (2 arrivals)
SYNC_M0: gl.constexpr = gl.constexpr(1)  # [0] -> [1]: m0 in xchg[0]
SYNC_S1: gl.constexpr = gl.constexpr(2)  # [1] -> [0]: m1 in xchg[1], P1 in stage 1's RoPE slot
SYNC_P0: gl.constexpr = gl.constexpr(3)  # [0] -> [1]: P0 (rescaled to m1) in stage 0's RoPE slot
SYNC_L: gl.constexpr = gl.constexpr(4)  # both: row sums in xchg (2 arrivals)
# the `empty` barriers: (stage, half) as the producer refills them
EMPTY_EARLY0: gl.constexpr = gl.constexpr(0)  # stage 0, O_L's columns
EMPTY_EARLY1: gl.constexpr = gl.constexpr(1)  # stage 1, O_R's columns
EMPTY_LATE0: gl.constexpr = gl.constexpr(2)  # stage 0, O_R's columns + RoPE
EMPTY_LATE1: gl.constexpr = gl.constexpr(3)  # stage 1, O_L's columns + RoPE


@gluon.jit
def _seesaw_issue(desc, lat, rope, ready, blocks, tile, first: gl.constexpr, count: gl.constexpr,
                  WITH_ROPE: gl.constexpr, PAGE: gl.constexpr, ids_layout: gl.constexpr):
    """TMA chunks first .. first + count of tile `tile` (64-column boxes of its pages) into stage `lat` / `rope`,
    chunk c completing ready[c] (and WITH_ROPE, the RoPE part ready[LATENT // 64])."""
    CHUNKS: gl.constexpr = lat.shape[1] // CHUNK
    for c in gl.static_range(first, first + count):
        _issue_chunk(desc, lat.slice(c * CHUNK, CHUNK, dim=1), ready.index(c), blocks, tile, c * CHUNK, PAGE,
                     ids_layout)
    if WITH_ROPE:
        _issue_chunk(desc, rope, ready.index(CHUNKS), blocks, tile, CHUNKS * CHUNK, PAGE, ids_layout)


@gluon.jit
def _issue_chunk(desc, dst, ready, blocks, tile, column: gl.constexpr, PAGE: gl.constexpr, ids_layout: gl.constexpr):
    """One 64-column chunk of a tile's rows, page by page, into dst (64 rows), completing `ready`."""
    ROWS: gl.constexpr = desc.block_type.shape[0]
    PAGES: gl.constexpr = SEESAW_TILE // ROWS
    slot = (tile * SEESAW_TILE) % PAGE if PAGE > SEESAW_TILE else 0
    ids = gl.arange(0, PAGES, layout=ids_layout)
    mbarrier.expect(ready, PAGES * desc.block_type.nbytes)
    for p in gl.static_range(PAGES):
        row = gl.sum(gl.where(ids == p, blocks, 0), 0) * PAGE + slot  # every thread holds all ids
        tma.async_copy_global_to_shared(desc, [row, column], ready, dst.slice(p * ROWS, ROWS))


@gluon.jit
def _seesaw_producer(desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE: gl.constexpr):
    """One warp: per pair of tiles, each stage's halves in the order their readers release them (stage 0's early
    half, stage 1's early half, then the late halves); a last unpaired tile fills stage 0 only."""
    HALF: gl.constexpr = lat_smem.shape[2] // CHUNK // 2
    PAGES: gl.constexpr = (SEESAW_TILE + PAGE - 1) // PAGE
    ids_layout: gl.constexpr = gl.BlockedLayout([PAGES], [32], [1], [0])
    ready0, ready1 = ready
    pairs = (hi - lo) // 2
    for k in range(0, pairs):
        tile = lo + 2 * k
        free = (k & 1) ^ 1  # a fresh barrier passes the first lap
        blocks0 = _page_blocks(table_row, tile, seq_len, PAGE, SEESAW_TILE, ids_layout)
        blocks1 = _page_blocks(table_row, tile + 1, seq_len, PAGE, SEESAW_TILE, ids_layout)
        mbarrier.wait(empty.index(EMPTY_EARLY0), free)
        _seesaw_issue(desc, lat_smem.index(0), rope_smem.index(0), ready0, blocks0, tile, 0, HALF, False, PAGE,
                      ids_layout)
        mbarrier.wait(empty.index(EMPTY_EARLY1), free)
        _seesaw_issue(desc, lat_smem.index(1), rope_smem.index(1), ready1, blocks1, tile + 1, HALF, HALF, False,
                      PAGE, ids_layout)
        mbarrier.wait(empty.index(EMPTY_LATE0), free)
        _seesaw_issue(desc, lat_smem.index(0), rope_smem.index(0), ready0, blocks0, tile, HALF, HALF, True, PAGE,
                      ids_layout)
        mbarrier.wait(empty.index(EMPTY_LATE1), free)
        _seesaw_issue(desc, lat_smem.index(1), rope_smem.index(1), ready1, blocks1, tile + 1, 0, HALF, True, PAGE,
                      ids_layout)
    for k in range(pairs, (hi - lo + 1) // 2):  # the unpaired last tile
        tile = lo + 2 * k
        free = (k & 1) ^ 1
        blocks0 = _page_blocks(table_row, tile, seq_len, PAGE, SEESAW_TILE, ids_layout)
        mbarrier.wait(empty.index(EMPTY_EARLY0), free)
        _seesaw_issue(desc, lat_smem.index(0), rope_smem.index(0), ready0, blocks0, tile, 0, HALF, False, PAGE,
                      ids_layout)
        mbarrier.wait(empty.index(EMPTY_LATE0), free)
        _seesaw_issue(desc, lat_smem.index(0), rope_smem.index(0), ready0, blocks0, tile, HALF, HALF, True, PAGE,
                      ids_layout)


@gluon.jit
def _seesaw_scores(q_lat, q_rope, lat, rope, ready, phase, FIRST_HALF: gl.constexpr, s_layout: gl.constexpr):
    """S = Q·Kᵀ of one stage (64 heads x 64 keys, float32), each chunk multiplied once it landed: the chunks of
    LATENT half FIRST_HALF first (the half released earlier), then the other, then the RoPE part."""
    CHUNKS: gl.constexpr = lat.shape[1] // CHUNK
    START: gl.constexpr = FIRST_HALF * (CHUNKS // 2)
    s = gl.zeros([WIDE_HEADS, SEESAW_TILE], gl.float32, s_layout)
    for c in gl.static_range(START, CHUNKS):
        s = _score_chunk(q_lat.slice(c * CHUNK, CHUNK, dim=1), lat.slice(c * CHUNK, CHUNK, dim=1), ready.index(c),
                         phase, s, c > START)
    for c in gl.static_range(0, START):
        s = _score_chunk(q_lat.slice(c * CHUNK, CHUNK, dim=1), lat.slice(c * CHUNK, CHUNK, dim=1), ready.index(c),
                         phase, s, True)
    s = _score_chunk(q_rope, rope, ready.index(CHUNKS), phase, s, True)
    return warpgroup_mma_wait(0, deps=[s])


@gluon.jit
def _score_chunk(q, k, ready, phase, s, USE_ACC: gl.constexpr):
    """s += q·kᵀ over one 64-column chunk once it landed (asynchronous: the caller waits)."""
    mbarrier.wait(ready, phase)
    return warpgroup_mma(q, k.permute((1, 0)), s, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _seesaw_mask(s, lat, tile, seq_len, MASKED: gl.constexpr):
    """MASKED (a pair holding the last tile): keys at or past seq_len out of S, and their stale rows zeroed in the
    stage (P·V reads them as V: they may hold anything, NaN included)."""
    if MASKED:
        keys = tile * SEESAW_TILE + gl.arange(0, SEESAW_TILE, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(keys[None, :] < seq_len, s, float("-inf"))
        _zero_stale_rows(lat, tile, seq_len)
        fence_async_shared()  # the zeros before any wgmma reads the stage (this warpgroup's P·V comes first)
        gl.thread_barrier()
    return s


@gluon.jit
def _publish(sync, which: gl.constexpr, ASYNC_READERS: gl.constexpr):
    """Hand what this warpgroup stored to shared memory to the other one (after a fence when wgmma reads it)."""
    if ASYNC_READERS:
        fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(sync.index(which), count=1)


@gluon.jit
def _seesaw_left_pair(acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync, k, tile,
                      seq_len, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr, p_operand: gl.constexpr,
                      MASKED: gl.constexpr, PAIRED: gl.constexpr):
    """Warpgroup 0's part of pair k (tiles `tile`, `tile` + 1; PAIRED: the second exists): O's left half."""
    HALF: gl.constexpr = lat_smem.shape[2] // 2
    dtype: gl.constexpr = lat_smem.dtype
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    phase = k & 1
    lat0 = lat_smem.index(0)
    s = _seesaw_scores(q_lat, q_rope, lat0, rope_smem.index(0), ready[0], phase, 0, s_layout) * scale_log2
    s = _seesaw_mask(s, lat0, tile, seq_len, MASKED)
    m0 = gl.maximum(m_i, gl.max(s, 1))
    xchg[0].store(m0)
    _publish(sync, SYNC_M0, False)
    m0_safe = gl.where(m0 == float("-inf"), 0.0, m0)  # a row that has seen nothing yet stays at 0
    scale0 = gl.exp2(m_i - m0_safe)
    p0 = gl.exp2(s - m0_safe[:, None])
    l_i = l_i * scale0 + gl.sum(p0, 1)
    acc = acc * gl.convert_layout(scale0, o_rows)[:, None]
    p0 = p0.to(dtype)  # (held as 16 bits until rescaled for [1]: float32 would spill)
    p0_operand = gl.convert_layout(p0, p_operand)
    acc = warpgroup_mma(p0_operand, lat0.slice(0, HALF, dim=1), acc, is_async=True)
    mbarrier.wait(sync.index(SYNC_S1), phase)
    m1 = xchg[1].load(rows)
    scale1 = gl.exp2(m0 - gl.where(m1 == float("-inf"), 0.0, m1))
    acc, _ = warpgroup_mma_wait(0, deps=[acc, p0_operand])
    mbarrier.arrive(empty.index(EMPTY_EARLY0), count=1)
    rope_smem.index(0).store((p0.to(gl.float32) * scale1[:, None]).to(dtype))  # P0 for [1], against m1
    _publish(sync, SYNC_P0, True)
    l_i = l_i * scale1
    acc = acc * gl.convert_layout(scale1, o_rows)[:, None]
    if PAIRED:
        acc = warpgroup_mma(rope_smem.index(1), lat_smem.index(1).slice(0, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(EMPTY_LATE1), count=1)
    return acc, m1, l_i


@gluon.jit
def _seesaw_right_pair(acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync, k, tile,
                       seq_len, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr, p_operand: gl.constexpr,
                       MASKED: gl.constexpr, PAIRED: gl.constexpr):
    """Warpgroup 1's part of pair k: O's right half."""
    HALF: gl.constexpr = lat_smem.shape[2] // 2
    dtype: gl.constexpr = lat_smem.dtype
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    phase = k & 1
    if PAIRED:
        lat1 = lat_smem.index(1)
        s = _seesaw_scores(q_lat, q_rope, lat1, rope_smem.index(1), ready[1], phase, 1,
                           s_layout) * scale_log2
        s = _seesaw_mask(s, lat1, tile + 1, seq_len, MASKED)
        mbarrier.wait(sync.index(SYNC_M0), phase)
        m0 = xchg[0].load(rows)
        m1 = gl.maximum(m0, gl.max(s, 1))
        m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
        p1 = gl.exp2(s - m1_safe[:, None])
        xchg[1].store(m1)
        rope_smem.index(1).store(p1.to(dtype))  # P1 for [0]: S1 has read the RoPE keys
        _publish(sync, SYNC_S1, True)
        scale = gl.exp2(m_i - m1_safe)
        l_i = l_i * scale + gl.sum(p1, 1)
        acc = acc * gl.convert_layout(scale, o_rows)[:, None]
        p1_operand = gl.convert_layout(p1.to(dtype), p_operand)
        acc = warpgroup_mma(p1_operand, lat1.slice(HALF, HALF, dim=1), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=[acc, p1_operand])
        mbarrier.arrive(empty.index(EMPTY_EARLY1), count=1)
    else:  # no second tile: m1 is m0
        mbarrier.wait(sync.index(SYNC_M0), phase)
        m1 = xchg[0].load(rows)
        xchg[1].store(m1)
        _publish(sync, SYNC_S1, False)
        scale = gl.exp2(m_i - gl.where(m1 == float("-inf"), 0.0, m1))
        l_i = l_i * scale
        acc = acc * gl.convert_layout(scale, o_rows)[:, None]
    mbarrier.wait(sync.index(SYNC_P0), phase)
    acc = warpgroup_mma(rope_smem.index(0), lat_smem.index(0).slice(HALF, HALF, dim=1), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index(EMPTY_LATE0), count=1)
    return acc, m1, l_i


@gluon.jit
def _seesaw_pair(half: gl.constexpr, acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync, k,
                 tile, seq_len, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr, p_operand: gl.constexpr,
                 MASKED: gl.constexpr, PAIRED: gl.constexpr):
    """Warpgroup `half`'s part of pair k."""
    if half == 0:
        return _seesaw_left_pair(acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync, k, tile,
                                 seq_len, scale_log2, s_layout, o_layout, p_operand, MASKED, PAIRED)
    else:
        return _seesaw_right_pair(acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync, k,
                                  tile, seq_len, scale_log2, s_layout, o_layout, p_operand, MASKED, PAIRED)


@gluon.jit
def seesaw_stage_q(half: gl.constexpr, Q, q_lat, q_rope, sync, seq, first_head, num_heads, stride_qt, stride_qh):
    """Consumer warpgroup `half` of the seesaw kernel stages half of Q's latent chunks (warpgroup 0 the RoPE part
    too), then waits for the other's half."""
    CHUNKS: gl.constexpr = q_lat.shape[1] // CHUNK
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    _stage_q(Q, q_lat, q_rope, seq, first_head, num_heads, stride_qt, stride_qh, q_layout, half * (CHUNKS // 2),
             CHUNKS // 2, half == 0)
    _publish(sync, SYNC_Q, True)
    mbarrier.wait(sync.index(SYNC_Q), 0)


@gluon.jit
def _seesaw_consumer(half: gl.constexpr, Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty, sync,
                     seq, head_block, split, seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot,
                     stride_oh, stride_ls, stride_lt, stride_lh, scale_log2, STAGE_OUT: gl.constexpr):
    """Consumer warpgroup `half` (0: O's left LATENT / 2 columns, 1: the right ones)."""
    LATENT: gl.constexpr = lat_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, SEESAW_TILE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, LATENT // 2, 16])
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    # P from registers as the A operand of O += P·V: S's accumulator layout maps onto it in place
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    first_head = head_block * WIDE_HEADS
    seesaw_stage_q(half, Q, q_lat, q_rope, sync, seq, first_head, num_heads, stride_qt, stride_qh)

    m_i = gl.full([WIDE_HEADS], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([WIDE_HEADS], gl.float32, rows)
    acc = gl.zeros([WIDE_HEADS, LATENT // 2], gl.float32, o_layout)
    pairs = (hi - lo) // 2
    # pairs whose both tiles hold keys below seq_len only (no masks); then a last pair, or a last unpaired tile
    full_hi = gl.maximum(gl.minimum(hi, seq_len // SEESAW_TILE), lo)
    unmasked = gl.minimum((full_hi - lo) // 2, pairs)
    for k in range(0, unmasked):
        acc, m_i, l_i = _seesaw_pair(half, acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync,
                                     k, lo + 2 * k, seq_len, scale_log2, s_layout, o_layout, p_operand, False, True)
    for k in range(unmasked, pairs):
        acc, m_i, l_i = _seesaw_pair(half, acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync,
                                     k, lo + 2 * k, seq_len, scale_log2, s_layout, o_layout, p_operand, True, True)
    for k in range(pairs, (hi - lo + 1) // 2):
        acc, m_i, l_i = _seesaw_pair(half, acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync,
                                     k, lo + 2 * k, seq_len, scale_log2, s_layout, o_layout, p_operand, True, False)

    # each half summed the rows of its own tiles: the total from both
    xchg[2 + half].store(l_i)
    _publish(sync, SYNC_L, False)
    mbarrier.wait(sync.index(SYNC_L), 0)
    l_total = xchg[2].load(rows) + xchg[3].load(rows)
    out, lse = finish_row_sums(acc, m_i, l_total)
    # past SYNC_L neither warpgroup reads a stage any more: each stages its half of O in its own
    _store_out(lat_smem.index(half), Out + half * (LATENT // 2), Lse, out, lse, split, seq, first_head,
               num_heads - first_head, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, STAGE_OUT)


@gluon.jit
def seesaw_buffers(dtype: gl.constexpr, LATENT: gl.constexpr):
    """The seesaw kernel's shared memory, its barriers initialised: the two stages (latent, RoPE), Q, the row
    vectors between the warpgroups (xchg: m0, m1, then each half's row sums), a `ready` barrier per 64-column
    chunk of each stage and its RoPE part, the `empty` and the `sync` barriers."""
    CHUNKS: gl.constexpr = LATENT // CHUNK
    chunk_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SEESAW_TILE, CHUNK], dtype)
    lat_smem = gl.allocate_shared_memory(dtype, [2, SEESAW_TILE, LATENT],
                                         gl.NVMMASharedLayout.get_default_for([SEESAW_TILE, LATENT], dtype))
    rope_smem = gl.allocate_shared_memory(dtype, [2, SEESAW_TILE, CHUNK], chunk_layout)
    q_lat = gl.allocate_shared_memory(dtype, [WIDE_HEADS, LATENT],
                                      gl.NVMMASharedLayout.get_default_for([WIDE_HEADS, LATENT], dtype))
    q_rope = gl.allocate_shared_memory(dtype, [WIDE_HEADS, CHUNK], chunk_layout)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    xchg = (gl.allocate_shared_memory(gl.float32, [WIDE_HEADS], row_layout),
            gl.allocate_shared_memory(gl.float32, [WIDE_HEADS], row_layout),
            gl.allocate_shared_memory(gl.float32, [WIDE_HEADS], row_layout),
            gl.allocate_shared_memory(gl.float32, [WIDE_HEADS], row_layout))
    # allocations of a power of two
    ready0 = gl.allocate_shared_memory(gl.int64, [2 * CHUNKS, 1], mbarrier.MBarrierLayout())
    ready1 = gl.allocate_shared_memory(gl.int64, [2 * CHUNKS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CHUNKS + 1):
        mbarrier.init(ready0.index(i), count=1)
        mbarrier.init(ready1.index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(5):
        mbarrier.init(sync.index(i), count=2 if (i == SYNC_Q) or (i == SYNC_L) else 1)
    return lat_smem, rope_smem, q_lat, q_rope, xchg, (ready0, ready1), empty, sync


@gluon.jit
def _seesaw_kernel(desc, Q, Out, Lse, seq, head_block, split, seq_len, lo, hi, num_heads, Block_table, stride_qt,
                   stride_qh, stride_table, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh,
                   scale_log2, LATENT: gl.constexpr, PAGE: gl.constexpr, STAGE_OUT: gl.constexpr):
    """The seesaw kernel's buffers and partitions (`gluon_mla_decode_kernel` with SEESAW)."""
    lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty, sync = seesaw_buffers(desc.dtype, LATENT)
    table_row = Block_table + seq.to(gl.int64) * stride_table
    gl.warp_specialize([
        (_seesaw_consumer, (0, Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty, sync, seq,
                            head_block, split, seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os,
                            stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, scale_log2, STAGE_OUT)),
        (_seesaw_consumer, (1, Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty, sync, seq,
                            head_block, split, seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os,
                            stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, scale_log2, STAGE_OUT)),
        (_seesaw_producer, (desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE)),
    ], [4, 1], [SEESAW_REGS, PRODUCER_REGS])


# stride_os (a multiple of LATENT in every layout the launcher passes) stays specialised: it proves O's rows aligned,
# so O is stored two values per instruction (bench/results/2026-12-07-defaults-h100: the store was a 5-9 µs epilogue)
@gluon.jit(do_not_specialize=["num_splits", "stride_table", "stride_ls", "stride_lt", "stride_lh"],
           do_not_specialize_on_alignment=["Block_table", "Seq_lens"])
def gluon_mla_decode_kernel(
    lat_desc, rope_desc, Q, Block_table, Seq_lens, Out, Lse,
    stride_qt, stride_qh, stride_table, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh,
    scale_log2, num_heads, num_splits,
    BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, WIDE: gl.constexpr,
    RELEASE_DEPENDENTS: gl.constexpr = False, SEESAW: gl.constexpr = False, STAGE_OUT: gl.constexpr = False,
):
    """Grid (cdiv(num_heads, BLOCK_H), batch, num_splits) with BLOCK_H 16 (4 warps, mma.sync) or, WIDE, 64 (8
    warps: two warpgroups on wgmma), + 1 producer warp. lat_desc / rope_desc: TMA descriptors over the latent cache
    viewed as (blocks * PAGE, LATENT + ROPE) with boxes [min(PAGE, BLOCK_N), LATENT] and [min(PAGE, BLOCK_N),
    ROPE]. Q (tokens, heads, LATENT + ROPE). Out (splits, tokens, heads, LATENT) and Lse (splits, tokens, heads),
    float32 (or Out in q's dtype with one split), as `mla_attention_kernel` writes them. RELEASE_DEPENDENTS: see
    `gluon_paged.release_dependents`. SEESAW (WIDE, BLOCK_N 64, STAGES 2; 4 warps, + 4 + 1 in the partitions):
    the seesaw schedule above, by TMA boxes of 64 columns (rope_desc's)."""
    LATENT: gl.constexpr = lat_desc.block_type.shape[1]
    ROPE: gl.constexpr = rope_desc.block_type.shape[1]
    HEADS: gl.constexpr = WIDE_HEADS if WIDE else BLOCK_M
    dtype: gl.constexpr = lat_desc.dtype

    release_dependents(RELEASE_DEPENDENTS)
    head_block = gl.program_id(0)  # the fastest axis: a sequence's head blocks run together and share its rows in L2
    seq = gl.program_id(1)
    split = gl.program_id(2)
    seq_len, lo, hi = split_tiles(Seq_lens, seq, split, num_splits, BLOCK_N)

    if SEESAW:
        gl.static_assert(WIDE and BLOCK_N == SEESAW_TILE and STAGES == 2 and ROPE == CHUNK,
                         "the seesaw kernel takes 64 heads, two stages of 64 keys and a RoPE part of 64")
        _seesaw_kernel(rope_desc, Q, Out, Lse, seq, head_block, split, seq_len, lo, hi, num_heads, Block_table,
                       stride_qt, stride_qh, stride_table, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                       stride_lh, scale_log2, LATENT, PAGE, STAGE_OUT)
    else:
        lat_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, LATENT],
                                             gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype))
        rope_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE],
                                              gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype))
        q_lat = gl.allocate_shared_memory(dtype, [HEADS, LATENT],
                                          gl.NVMMASharedLayout.get_default_for([HEADS, LATENT], dtype))
        q_rope = gl.allocate_shared_memory(dtype, [HEADS, ROPE],
                                           gl.NVMMASharedLayout.get_default_for([HEADS, ROPE], dtype))
        p_smem = gl.allocate_shared_memory(dtype, [HEADS, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], dtype))
        ready, empty = ring_barriers(STAGES)
        table_row = Block_table + seq.to(gl.int64) * stride_table
        # (a tuple held in a variable loses its constexprs: each partition's arguments are written out)
        if WIDE:
            gl.warp_specialize([(_wide_consumer, (
                Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block, split, seq_len,
                lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                stride_lh, scale_log2, STAGE_OUT)), (_producer, (
                lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE, BLOCK_N))],
                [1], [PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer, (
                Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block, split, seq_len,
                lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                stride_lh, scale_log2, STAGE_OUT)), (_producer, (
                lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE, BLOCK_N))],
                [1], [PRODUCER_REGS])
