"""FlashAttention-3-style forward for sm_90 in Gluon: a TMA producer warp and two (or three) consumer warpgroups.

A work tile is CONSUMERS x BLOCK_M query rows of one (batch, head). The grid is persistent: each program walks the
work tiles tile = program_id, + num_programs, ... (the launcher sizes the grid to the SMs; one program per tile is
the non-persistent case), or with DYNAMIC takes each next one at run time from a launch-wide counter, so that a
program whose tiles ran long takes fewer. Its warps split three ways (`gl.warp_specialize`):

- the producer (1 warp, few registers) TMA-loads a work tile's Q tiles (one per consumer) once their buffers are
  free (a Q-empty mbarrier per consumer), then streams its K and V tiles through a STAGES-deep shared-memory ring:
  per stage one ready and one empty mbarrier for K and another pair for V, so S = Q·Kᵀ can start as soon as K
  lands while V is still in flight. The ring's and the barriers' counters run on across work tiles, so the next
  tile's Q, K and V load while the consumers finish the last P·V and store O (O has a buffer of its own where
  shared memory allows; otherwise it is staged in Q's, which is then freed only once the store has read it);
- two consumer warpgroups (the default partition and one 4-warp worker), each owning its own BLOCK_M = 64-row
  Q tile and reading the same K/V stages (the empty barriers count both consumers' arrivals). 64 rows is the
  wgmma atom for one warpgroup and keeps S (64 x BLOCK_N fp32), O (64 x D fp32) and P (16-bit) in registers
  without spills at D = 128 (a 128-row tile per warpgroup would need 256 accumulator registers per thread);
  sharing each K/V tile between two Q tiles halves K/V traffic per query row. With PINGPONG the two take
  turns issuing their wgmmas (a pair of mbarriers hands the turn over; FA3 uses named barriers), so one
  warpgroup's softmax runs while the other's matmuls hold the tensor cores; without it they run unordered
  and the warp scheduler interleaves them as it may. CONSUMERS = 3 (FA3's 192-row tiles at D 64, where the
  registers of a 64-row consumer hold its tiles at 160 per thread) passes the turn round all three and shares
  each K/V tile among three Q tiles.

Inside a consumer the loop overlaps as FA3's intra-warpgroup pipelining: S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1}
are issued back to back as async wgmmas, the softmax of S_j runs while the P·V product is still in the tensor
cores, and only then is O rescaled. The softmax is online in base 2. With RESCALE_THRESHOLD = 0 (the default,
measured faster: see GluonConfig) O is rescaled every tile as in FA2; with a positive threshold the rescale is
conditional (FA4): the running max moves (and O, l are rescaled) only when some row's max grows by more than
RESCALE_THRESHOLD (log2 units); otherwise P = exp2(S - stale max) stays below 2**RESCALE_THRESHOLD, and the
result is exact because the final O / l and LSE use the same stale max. Without OVERLAP
(`_serial_key_loop`) each tile's S, softmax and P·V run in turn and the consumers take no turns: only one
accumulator is live beside O, which lets three consumer warpgroups hold the fp8 forward's fresh P·V accumulator
(or a masked D 64 loop) in 160 registers; their number, not the overlap, keeps the tensor cores fed.

Layout: dense (B, N, H, D) tensors through rank-4 TMA descriptors with boxes [1, rows, 1, D], so rows past a
sequence's end read as zero and are clipped on store, per batch. Varlen: packed (total, H, D) tensors seen as
(1, total, H, D), each sequence's rows offset by cu_seqlens; rows past a sequence's end read the next one's
(keys are masked by the sequence's length, query rows are not stored), and a sequence's last query tile stores
O from registers with a row mask instead of a TMA box that would write into the next sequence. Causal masks and
sliding windows are aligned bottom-right (query i sees keys i + Nk - Nq - window_left ..= i + Nk - Nq +
window_right; causal is window_right 0): a work tile loads only the K/V tiles its rows may see. Rows that see no
key get O = 0 and LSE = -inf. Scores are masked only on K/V tiles that cross a window edge or the end of K. Work
tiles run longest-first by bands of query blocks (`_tile_coords`): the last query tiles, which see the most keys
under causal, come first; with bands of several blocks the tiles running at once share a few heads' K/V.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
_LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _key_blocks(rows_start, rows_end, n_q, n_k, LEFT: gl.constexpr, RIGHT: gl.constexpr, window_left,
                window_right, BLOCK_N: gl.constexpr):
    """The K/V tiles [first, end) that query rows [rows_start, rows_end) may see: row i sees keys
    i + Nk - Nq - window_left ..= i + Nk - Nq + window_right (a side without its flag is unbounded)."""
    first = 0
    if LEFT:
        first = gl.maximum(rows_start + n_k - n_q - window_left, 0) // BLOCK_N
    keys = n_k
    if RIGHT:
        keys = gl.minimum(n_k, gl.maximum(rows_end + n_k - n_q + window_right, 0))
    return first, gl.cdiv(keys, BLOCK_N)


@gluon.jit
def _tile_coords(tile, n_heads, batch_heads, n_m_blocks, ROWS: gl.constexpr, BAND: gl.constexpr):
    """Work tile -> (batch, head, first query row). The query blocks go in bands of BAND from the last down (causal:
    the longest first); within a band, every (batch, head) in turn, each with its band's blocks next to each other,
    so the ~one tile per SM that run at once read the K/V of a few heads together (L2 hits; heads of one KV group
    are neighbours). BAND 1 is (batch, head) fastest, where every running tile streams K/V of its own: 0.64x cuDNN
    at N 2k on an H100 (bench/results/2026-12-06-gluon-fwd-persistent-h100)."""
    band_tiles = BAND * batch_heads
    band = tile // band_tiles
    rest = tile % band_tiles
    blocks = gl.minimum(n_m_blocks - band * BAND, BAND)  # the last band may be short
    bh = rest // blocks
    return bh // n_heads, bh % n_heads, (n_m_blocks - 1 - band * BAND - rest % blocks) * ROWS


@gluon.jit
def _snake(tile, total):
    """Work tile `tile` of the persistent loop (program_id + turn x num_programs) taken from the far end of its round
    on odd turns (num_programs - 1 - program_id), rounds that are complete only, so that under causal's longest-first
    order a program that drew one of a round's long tiles draws one of the next round's short ones (a static model
    of the causal rows: the longest program 1.19x the mean at N 2k, 1.06x at 16k; reversed rounds 1.03x)."""
    programs = gl.num_programs(0)
    turn = tile // programs
    reverse = (turn % 2 == 1) & ((turn + 1) * programs <= total)
    return gl.where(reverse, turn * programs + programs - 1 - tile % programs, tile)


@gluon.jit
def _next_tile(k, counter, DYNAMIC: gl.constexpr):
    """The producer's next work tile after tile k: static, k + num_programs; DYNAMIC, the next one no program has
    taken (a launch-wide counter from 0, after the first num_programs tiles, which the programs take by id)."""
    following = k + gl.num_programs(0)
    if DYNAMIC:
        following = gl.atomic_add(counter, 1, sem="relaxed") + gl.num_programs(0)
    return following


@gluon.jit
def _publish_tile(slots, c: gl.constexpr, tile):
    """The producer's work tile for consumer c, read once its Q-ready barrier completes (the producer's arrive on
    it follows a warp barrier, which orders this store before it)."""
    slots.index(c).store(gl.full([1], tile, gl.int32, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))


@gluon.jit
def _read_tile(slots, c: gl.constexpr, q_ready, t_local):
    """Consumer c's next work tile under DYNAMIC, or the count of work tiles once none is left: it waits for that
    tile's Q-ready barrier, which the producer completes after publishing the tile."""
    mbarrier.wait(q_ready.index(c), t_local & 1)
    return gl.max(slots.index(c).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), 0)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, n_heads, group, batch_heads, n_m_blocks, n_q,
              n_k, window_left, window_right, seqs, schedule, LEFT: gl.constexpr, RIGHT: gl.constexpr,
              VARLEN: gl.constexpr, BAND: gl.constexpr, SNAKE: gl.constexpr, DYNAMIC: gl.constexpr):
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    counter, slots = schedule
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    box_q: gl.constexpr = [1, BLOCK_M, 1, q_smem.shape[2]]
    box_kv: gl.constexpr = [1, BLOCK_N, 1, k_smem.shape[2]]
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    FP8: gl.constexpr = k_smem.dtype.primitive_bitwidth == 8  # then V is transposed: [STAGES, D, BLOCK_N]
    it = 0  # K/V tiles loaded so far: the ring's position and phase
    t_local = 0  # work tiles of this program so far: the Q barriers' phase
    total = batch_heads * n_m_blocks
    k = gl.program_id(0)
    while k < total:
        tile = k
        if SNAKE:
            tile = _snake(k, total)
        batch, head, m_start = _tile_coords(tile, n_heads, batch_heads, n_m_blocks, CONSUMERS * BLOCK_M, BAND)
        seq_batch, q_start, k_start, len_q, len_k = _sequence(batch, n_q, n_k, seqs, VARLEN)
        if m_start < len_q:  # varlen: the query blocks past a sequence's end are no work
            kv_head = head // group
            for c in gl.static_range(CONSUMERS):
                # a box wholly past the end of Q loads zeros (varlen: the next sequence's rows, never stored): every
                # work tile loads, waits and frees both Q tiles
                mbarrier.wait(q_empty.index(c), (t_local & 1) ^ 1)
                if DYNAMIC:
                    _publish_tile(slots, c, k)
                mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [seq_batch, q_start + m_start + c * BLOCK_M, head, 0],
                                                q_ready.index(c), q_smem.index(c).reshape(box_q))
            # the tiles either consumer's rows see: the first consumer's start, the last one's end
            first, end = _key_blocks(m_start, m_start + CONSUMERS * BLOCK_M, len_q, len_k, LEFT, RIGHT,
                                     window_left, window_right, BLOCK_N)
            for j in range(first, end):
                stage = it % STAGES
                phase = (it // STAGES) & 1
                # a fresh mbarrier counts as having completed the phase before 0: the first lap does not wait
                mbarrier.wait(k_empty.index(stage), phase ^ 1)
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [seq_batch, k_start + j * BLOCK_N, kv_head, 0],
                                                k_ready.index(stage), k_smem.index(stage).reshape(box_kv))
                mbarrier.wait(v_empty.index(stage), phase ^ 1)
                mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                if FP8:  # V transposed (B, Hkv, D, keys): box [1, 1, D, BLOCK_N]
                    tma.async_copy_global_to_shared(v_desc, [batch, kv_head, 0, j * BLOCK_N], v_ready.index(stage),
                                                    v_smem.index(stage).reshape([1, 1, v_smem.shape[1], BLOCK_N]))
                else:
                    tma.async_copy_global_to_shared(v_desc, [seq_batch, k_start + j * BLOCK_N, kv_head, 0],
                                                    v_ready.index(stage), v_smem.index(stage).reshape(box_kv))
                it += 1
            t_local += 1
        k = _next_tile(k, counter, DYNAMIC)
    if DYNAMIC:  # no more work: each consumer reads `total` as its next tile
        for c in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(c), (t_local & 1) ^ 1)
            _publish_tile(slots, c, total)
            mbarrier.arrive(q_ready.index(c), count=1)


@gluon.jit
def _mask_scores(s, j, rows, n_q, n_k, LEFT: gl.constexpr, RIGHT: gl.constexpr, window_left, window_right,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    visible = keys[None, :] < n_k
    if RIGHT:
        visible = visible & (keys[None, :] <= rows[:, None] + (n_k - n_q + window_right))
    if LEFT:
        visible = visible & (keys[None, :] >= rows[:, None] + (n_k - n_q - window_left))
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _softmax_step(s, m_i, l_i, scale_rows, scale_cols, RESCALE_THRESHOLD: gl.constexpr, P_LOG2: gl.constexpr):
    """One tile of the online softmax in base 2. Returns P (x 2**P_LOG2), the new (m, l), whether O must be
    rescaled and by what. The scores' scale is per row (scale_rows: a scalar or a row vector; scale_cols: the
    same, broadcastable over the tile). With a positive threshold m only moves when some row's max grew by more
    than it: every row's P stays below 2**threshold, and O, l, LSE all refer to the same m. With 0, m follows
    every row's max (FA2)."""
    m_tile = gl.max(s, 1) * scale_rows
    m_new = gl.maximum(m_i, m_tile)
    if RESCALE_THRESHOLD > 0:
        growth = gl.where(m_new > m_i, m_new - m_i, 0.0)  # -inf vs -inf (no key seen yet) is no growth
        rescale = gl.max(growth, 0) > RESCALE_THRESHOLD  # one decision per warpgroup: a uniform branch
    else:
        rescale = True
    alpha = gl.full_like(m_i, 1.0)
    if rescale:
        # rows that have seen no key yet keep m = -inf; their O and l are 0, so any finite alpha does
        alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
        m_i = m_new
        l_i = l_i * alpha
    m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(s * scale_cols - (m_safe - P_LOG2)[:, None])
    l_i = l_i + gl.sum(p, 1)
    return p, m_i, l_i, rescale, alpha


@gluon.jit
def _fp8_operand(p, p_layout: gl.constexpr):
    """FP8: P (fp32, S's accumulator layout) as the e4m3 A operand of the P·V wgmma, without moving a byte between
    threads. A thread's accumulator holds keys 8b + 2t + (0, 1) of a row (t its lane's quad position, b = 0, 1 in
    each 16 keys); the 8-bit operand wants keys 4t + 0..3. Relabelling key 8b + 2t + e as 4t + 2b + e maps one
    onto the other, so the wgmma computes P·V over keys in that order: V's keys come permuted alike
    (`ioattn.ops.fp8_attention.KEY_ORDER`). The conversion runs where the wgmma is issued: an fp8 tensor carried
    round the loop is repacked byte by byte."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    p = gl.convert_layout(p.reshape([M, N // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([M, N]), p_layout)
    # four keys into one register: two cvt (e4m3x2) and a move, as the operand wants them
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _pack_pairs(p, dtype: gl.constexpr):
    """16-bit P carried round the key loop as int32 pairs (S's accumulator holds keys 2t, 2t + 1 of a row in one
    thread, as the operand wants them): 16-bit values carried one by one are re-paired by a PRMT each where the
    wgmma reads them (32 of a 64 x 128 tile's ~500 instructions, sm_90 build)."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    even, odd = p.reshape([M, N // 2, 2]).split()
    cvt: gl.constexpr = "cvt.rn.bf16x2.f32 $0, $2, $1;" if dtype == gl.bfloat16 else "cvt.rn.f16x2.f32 $0, $2, $1;"
    return gl.inline_asm_elementwise(cvt, "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _unpack_pairs(pairs, dtype: gl.constexpr, p_layout: gl.constexpr):
    """The P·V wgmma's A operand from `_pack_pairs`' int32 pairs (the split and re-pairing fold away)."""
    M: gl.constexpr = pairs.shape[0]
    N: gl.constexpr = pairs.shape[1] * 2
    even, odd = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs], dtype=(dtype.value, dtype.value),
                                          is_pure=True, pack=1)
    return gl.convert_layout(gl.join(even, odd).reshape([M, N]), p_layout)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """The P·V wgmma's A operand in registers, built where the wgmma is issued: fp8 from fp32 P (`_fp8_operand`),
    16-bit from `_pack_pairs`' int32 pairs."""
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    if FP8:
        operand = _fp8_operand(p, p_layout)
    else:
        operand = _unpack_pairs(p, dtype, p_layout)
    return operand


@gluon.jit
def _take_turn(turns, c: gl.constexpr, slot, PINGPONG: gl.constexpr):
    """Ping-pong: the consumers issue their wgmmas in turn (0, 1, .., 0, ..), so one warpgroup's softmax runs
    while another's matmuls hold the tensor cores. Consumer c > 0's slot k waits for consumer c - 1 to hand over
    slot k; consumer 0's slot k for the last consumer to hand over slot k - 1 (a fresh barrier lets slot 0
    through)."""
    if PINGPONG:
        if c == 0:
            mbarrier.wait(turns.index(c), (slot & 1) ^ 1)
        else:
            mbarrier.wait(turns.index(c), slot & 1)


@gluon.jit
def _pass_turn(turns, c: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index((c + 1) % turns.shape[0]), count=1)


@gluon.jit
def _release(k_ready, k_empty, v_ready, v_empty, j):
    """Give the ring's tile j (as the producer counts them) back unread (once loaded: an early arrival would count
    for a later lap)."""
    STAGES: gl.constexpr = k_ready.shape[0]
    stage = j % STAGES
    phase = (j // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    mbarrier.arrive(k_empty.index(stage), count=1)
    mbarrier.wait(v_ready.index(stage), phase)
    mbarrier.arrive(v_empty.index(stage), count=1)


@gluon.jit
def _tile_scale(scales, j, last_tile):
    """FP8: the K or V scale of key tile j (one per tile: no division in the key loop); tiles past the end read
    the last tile's (the loop loads one tile ahead)."""
    return gl.load(scales + gl.minimum(j, last_tile))


@gluon.jit
def _sequence(batch, n_q, n_k, seqs, VARLEN: gl.constexpr):
    """(TMA batch coordinate, first Q row, first K row, Nq, Nk) of batch entry `batch`: varlen reads them from
    cu_seqlens (seqs[0], seqs[1]) over packed (1, total, H, D) tensors."""
    if VARLEN:
        q_start = gl.load(seqs[0] + batch)
        k_start = gl.load(seqs[1] + batch)
        return 0, q_start, k_start, gl.load(seqs[0] + batch + 1) - q_start, gl.load(seqs[1] + batch + 1) - k_start
    return batch, 0, 0, n_q, n_k


@gluon.jit
def _store_tma(o, o_desc, staged, coords):
    """O through shared memory and one TMA store (rows past the tensor's end are clipped)."""
    staged.store(o.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, coords, staged.reshape(o_desc.block_type.shape))


@gluon.jit
def _store_rows(o, seqs, first_row, rows_left, head, o_layout: gl.constexpr):
    """O's first `rows_left` rows stored from registers (varlen, a sequence's last query tile): seqs[2] is O's
    base, seqs[3] / seqs[4] its row and head strides."""
    rows = gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, o_layout))
    offsets = ((first_row + rows).to(gl.int64) * seqs[3] + head * seqs[4])[:, None] + cols[None, :]
    gl.store(seqs[2] + offsets, o.to(seqs[2].dtype.element_ty), mask=(rows < rows_left)[:, None])


@gluon.jit
def _loop_copy(part: gl.constexpr, start, plain_start, plain_end, n_own, LEFT: gl.constexpr):
    """The key tiles [j_start, j_end) of copy `part` of a key loop over tiles start .. n_own: 0, those crossing
    the left window edge (masked); 1, those no score mask touches (plain_start .. plain_end); 2, those crossing
    the diagonal or the end of K (masked)."""
    unmasked_start = gl.minimum(gl.maximum(plain_start, start), n_own)
    unmasked_end = gl.minimum(gl.maximum(plain_end, unmasked_start), n_own)
    if part == 0:
        j_start = start
        j_end = start
        if LEFT:
            j_end = unmasked_start
    elif part == 1:
        j_start = unmasked_start
        j_end = unmasked_end
    else:
        j_start = unmasked_end
        j_end = n_own
    return j_start, j_end


@gluon.jit
def _split_columns(o, half_layout: gl.constexpr):
    """O's columns [0, D/2) and [D/2, D) as two accumulators of a D/2-column wgmma (each thread holds the same
    values: a relabelling, no data moves)."""
    M: gl.constexpr = o.shape[0]
    D: gl.constexpr = o.shape[1]
    lo, hi = o.reshape([M, 2, D // 2]).permute((0, 2, 1)).split()
    return gl.convert_layout(lo, half_layout), gl.convert_layout(hi, half_layout)


@gluon.jit
def _join_columns(lo, hi, layout: gl.constexpr):
    """`_split_columns` undone."""
    M: gl.constexpr = lo.shape[0]
    D: gl.constexpr = lo.shape[1] * 2
    return gl.convert_layout(gl.join(lo, hi).permute((0, 2, 1)).reshape([M, D]), layout)


@gluon.jit
def _pv_block(p_op, v_t, block: gl.constexpr, init):
    """FP8: P times V's column block `block` (as wide as `init`; V transposed in shared memory, [D, keys]) into a
    fresh accumulator (two-level accumulation), issued without waiting."""
    WIDTH: gl.constexpr = init.shape[1]
    return warpgroup_mma(p_op, v_t.slice(block * WIDTH, WIDTH).permute((1, 0)), init, use_acc=False, is_async=True)


@gluon.jit
def _serial_key_loop(q, k_smem, v_smem, p_smem, bars, it, first, n_own, plain_start, plain_end, rows, len_q, len_k,
                     window_left, window_right, o, m_i, l_i, qk_scale_log2, row_scale, k_scales, v_scales,
                     scale_tiles_k, LEFT: gl.constexpr, RIGHT: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr,
                     P_SHARED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                     p_layout: gl.constexpr):
    """A work tile's key loop without intra-warpgroup overlap: each tile's S, softmax and P·V in turn, so only
    one wgmma accumulator besides O is live (three consumer warpgroups fit their registers; their number, not
    the overlap, keeps the tensor cores fed). Tiles 0 .. n_own of the ring from `it`; returns (O, m, l)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    BLOCK_M: gl.constexpr = q.shape[0]
    HEAD_DIM: gl.constexpr = q.shape[1]
    dtype: gl.constexpr = q.dtype
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    P_LOG2: gl.constexpr = 8.0 - RESCALE_THRESHOLD if FP8 else 0.0
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): only its layout counts
    o_init = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    # FP8 at D > 128: O (64 x D float32) and a fresh P·V accumulator as large would take 2D registers a thread; the
    # tile's P·V runs as four wgmmas of D/4 columns, each added to its quarter of O as the next one runs (halves
    # spill: ptxas shuffles O through local memory to free a contiguous block for the second accumulator)
    PV_QUARTERS: gl.constexpr = FP8 and HEAD_DIM > 128
    if PV_QUARTERS:
        QUARTER: gl.constexpr = HEAD_DIM // 4
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, HEAD_DIM // 2, 32])
        quarter_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                 instr_shape=[16, QUARTER, 32])
        p_quarter_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=quarter_layout, k_width=4)
        quarter_init = gl.zeros([BLOCK_M, QUARTER], gl.float32, quarter_layout)
        o_lo, o_hi = _split_columns(o, half_layout)
        o0, o1 = _split_columns(o_lo, quarter_layout)
        o2, o3 = _split_columns(o_hi, quarter_layout)
    k_scale = qk_scale_log2  # the 16-bit forward's scores have one scale
    if FP8:
        k_scale = _tile_scale(k_scales, first, scale_tiles_k - 1)
        # O is held in units of the latest tile's V scale, so that its rescale, the change of scale and the add of
        # the tile's P·V are one FFMA per element (a multiply and an FFMA otherwise: 64 of ~517 instructions a tile)
        o_unit = _tile_scale(v_scales, first, scale_tiles_k - 1)
    for part in gl.static_range(3):
        j_start, j_end = _loop_copy(part, 0, plain_start, plain_end, n_own, LEFT)
        for j in range(j_start, j_end):
            stage = (it + j) % STAGES
            phase = ((it + j) // STAGES) & 1
            mbarrier.wait(k_ready.index(stage), phase)
            s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_init, use_acc=False, is_async=True)
            if FP8:  # the next tile's K scale and this tile's V scale load while S runs (V's is needed after
                # the softmax; one register fewer across the loop than loading it a tile ahead)
                k_scale_next = _tile_scale(k_scales, first + j + 1, scale_tiles_k - 1)
                v_scale = _tile_scale(v_scales, first + j, scale_tiles_k - 1)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(stage), count=1)
            if part != 1:
                s = _mask_scores(s, first + j, rows, len_q, len_k, LEFT, RIGHT, window_left, window_right, BLOCK_N,
                                 s_layout)
            if FP8:
                tile_rows = row_scale * k_scale
                p, m_i, l_i, rescale, alpha = _softmax_step(s, m_i, l_i, tile_rows, tile_rows[:, None],
                                                            RESCALE_THRESHOLD, P_LOG2)
                # per row: O's factor to this tile's V-scale units, rescaled as P was (applied with the tile's P·V)
                to_tile = gl.convert_layout(alpha * gl.where(o_unit == v_scale, 1.0, o_unit / v_scale), o_row_layout)
                o_unit = v_scale
            else:
                p, m_i, l_i, rescale, alpha = _softmax_step(s, m_i, l_i, qk_scale_log2, qk_scale_log2,
                                                            RESCALE_THRESHOLD, P_LOG2)
                if rescale:
                    o = o * gl.convert_layout(alpha, o_row_layout)[:, None]
            mbarrier.wait(v_ready.index(stage), phase)
            if PV_QUARTERS:
                if P_SHARED:
                    p_smem.store(p.to(dtype))
                    fence_async_shared()
                    p_op = p_smem
                else:
                    p_op = _fp8_operand(p, p_quarter_layout)
                v_t = v_smem.index(stage)
                factor = gl.convert_layout(to_tile, gl.SliceLayout(1, quarter_layout))[:, None]
                # each quarter's wgmma is issued before the one ahead of it is added to O (two quarter
                # accumulators live), so the tensor cores run while the CUDA cores rescale. (P from registers is
                # no dependency: the wait takes no 8-bit operand; ptxas keeps a register an in-flight wgmma reads.)
                pv0 = _pv_block(p_op, v_t, 0, quarter_init)
                pv1 = _pv_block(p_op, v_t, 1, quarter_init)
                o0 = o0 * factor + warpgroup_mma_wait(1, deps=[pv0])
                pv2 = _pv_block(p_op, v_t, 2, quarter_init)
                o1 = o1 * factor + warpgroup_mma_wait(1, deps=[pv1])
                pv3 = _pv_block(p_op, v_t, 3, quarter_init)
                o2 = o2 * factor + warpgroup_mma_wait(1, deps=[pv2])
                o3 = o3 * factor + warpgroup_mma_wait(0, deps=[pv3])
                k_scale = k_scale_next
            elif FP8:  # two-level accumulation: the tile's P·V in a fresh accumulator, added to O with its V scale
                if P_SHARED:
                    p_smem.store(p.to(dtype))
                    fence_async_shared()
                    pv = warpgroup_mma(p_smem, v_smem.index(stage).permute((1, 0)), o_init, use_acc=False,
                                       is_async=True)
                    pv = warpgroup_mma_wait(0, deps=[pv])
                else:
                    p_op = _fp8_operand(p, p_layout)
                    pv = warpgroup_mma(p_op, v_smem.index(stage).permute((1, 0)), o_init, use_acc=False,
                                       is_async=True)
                    pv = warpgroup_mma_wait(0, deps=[pv])  # (no 8-bit dependency: p_op is rebuilt next tile)
                o = o * to_tile[:, None] + pv
                k_scale = k_scale_next
            else:
                p_op = _unpack_pairs(_pack_pairs(p, dtype), dtype, p_layout)
                o = warpgroup_mma(p_op, v_smem.index(stage), o, is_async=True)
                o = warpgroup_mma_wait(0, deps=[o, p_op])[0]
            mbarrier.arrive(v_empty.index(stage), count=1)
    if PV_QUARTERS:
        o = _join_columns(_join_columns(o0, o1, half_layout), _join_columns(o2, o3, half_layout), o_layout) * o_unit
    elif FP8:
        o = o * o_unit
    return o, m_i, l_i


@gluon.jit
def _consumer(c: gl.constexpr, o_desc, q_smem, k_smem, v_smem, o_smem, p_buffers, bars, LSE, n_heads, group,
              batch_heads, n_m_blocks, n_q, n_k, window_left, window_right, qk_scale_log2, scales,
              seqs, schedule, LEFT: gl.constexpr, RIGHT: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr,
              PINGPONG: gl.constexpr, SEPARATE_O: gl.constexpr, VARLEN: gl.constexpr, BAND: gl.constexpr,
              SNAKE: gl.constexpr, P_SHARED: gl.constexpr, OVERLAP: gl.constexpr, DYNAMIC: gl.constexpr):
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns = bars
    counter, slots = schedule
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    # FP8: e4m3 Q, K and V (V transposed in shared memory), block scales, P rounded to e4m3 x 2**8, each tile's
    # P·V in a fresh accumulator added to O with the tile's V scale (two-level accumulation). P is the P·V wgmma's
    # register operand (V's keys permuted to match: _fp8_operand), or with P_SHARED goes through shared memory
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    gl.static_assert(FP8 or not P_SHARED, "P_SHARED is the fp8 forward's")
    # FP8 with P in registers issues P·V before S and takes it into O before the softmax: its e4m3 operand and
    # accumulator are free again while the softmax holds S (else the key loops spill)
    PV_FIRST: gl.constexpr = FP8 and not P_SHARED
    # FP8: P x 2**P_LOG2 rounds to e4m3 (448 at most, subnormal from 2**-9): P stays below 2**RESCALE_THRESHOLD, so
    # the product below 2**8
    P_LOG2: gl.constexpr = 8.0 - RESCALE_THRESHOLD if FP8 else 0.0
    k_width: gl.constexpr = 256 // dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, k_width])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, k_width])
    # P feeds the second wgmma from registers: S's accumulator layout maps onto this operand layout in place
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // dtype.primitive_bitwidth)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    gl.static_assert(STAGES >= 2, "ping-pong and the P·V lag need two K/V stages")
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): only its layout counts
    o_init = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)  # FP8: P·V's fresh accumulator (ignored)
    q = q_smem.index(c)
    # O goes out through a buffer of its own, or through Q's once the last S wgmma has read Q
    staged = o_smem.index(c) if SEPARATE_O else q
    if P_SHARED:
        p_smem = p_buffers.index(c)
    if FP8:
        q_scale_base, k_scale_base, v_scale_base, scale_block, scale_blocks_q, scale_tiles_k = scales

    it = 0  # K/V tiles of the ring passed so far (as the producer counts them)
    t_local = 0  # work tiles of this program so far; each took it + 1 ping-pong turns
    total = batch_heads * n_m_blocks
    k = gl.program_id(0)
    if DYNAMIC:
        k = _read_tile(slots, c, q_ready, t_local)
    while k < total:
        tile = k
        if SNAKE:
            tile = _snake(k, total)
        batch, head, m_start = _tile_coords(tile, n_heads, batch_heads, n_m_blocks, CONSUMERS * BLOCK_M, BAND)
        seq_batch, q_start, k_start, len_q, len_k = _sequence(batch, n_q, n_k, seqs, VARLEN)
        if m_start < len_q:  # varlen: the query blocks past a sequence's end are no work
            row_start = m_start + c * BLOCK_M
            active = row_start < len_q  # the last query block's second Q tile may lie wholly past the end of Q
            rows = row_start + gl.arange(0, BLOCK_M, layout=row_layout)
            # the producer's tiles first .. end, counted from 0 here: n_all of them. This consumer's rows see tiles
            # 0 .. n_own (those before its own first one come masked: under a left window the second consumer's
            # rows start further on, by a tile at most); plain_start .. plain_end need no score mask
            first, end = _key_blocks(m_start, m_start + CONSUMERS * BLOCK_M, len_q, len_k, LEFT, RIGHT, window_left,
                                     window_right, BLOCK_N)
            n_all = gl.maximum(end - first, 0)
            own_end = _key_blocks(row_start, row_start + BLOCK_M, len_q, len_k, LEFT, RIGHT, window_left, window_right,
                                  BLOCK_N)[1]
            n_own = gl.where(active, gl.minimum(gl.maximum(own_end - first, 0), n_all), 0)
            plain_start = 0
            if LEFT:  # tiles wholly right of every row's left edge
                plain_start = gl.cdiv(gl.maximum(row_start + BLOCK_M - 1 + len_k - len_q - window_left, 0),
                                      BLOCK_N) - first
            plain_end = len_k // BLOCK_N - first
            if RIGHT:  # tiles wholly left of every row's right edge
                plain_end = gl.minimum(plain_end, gl.maximum(row_start + len_k - len_q + window_right + 1, 0) // BLOCK_N
                                       - first)

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
            l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
            o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
            if FP8:
                kv_row = (batch * (n_heads // group) + head // group).to(gl.int64) * scale_tiles_k
                k_scales = k_scale_base + kv_row
                v_scales = v_scale_base + kv_row
                q_scales = q_scale_base + (batch * n_heads + head).to(gl.int64) * scale_blocks_q
                row_scale = qk_scale_log2 * gl.load(q_scales + rows // scale_block, mask=rows < len_q, other=0.0)
                # each tile's scales are loaded one tile ahead, so their latency hides behind that tile's wgmmas
                k_scale_next = _tile_scale(k_scales, first, scale_tiles_k - 1)

            slot_base = it + t_local  # ping-pong turns taken before this work tile
            mbarrier.wait(q_ready.index(c), t_local & 1)
            if not OVERLAP:
                if n_own > 0:
                    if not FP8:  # one scale for every score: row_scale is qk_scale_log2, the scale pointers unread
                        row_scale = qk_scale_log2
                        k_scales = LSE
                        v_scales = LSE
                        scale_tiles_k = 1
                    o, m_i, l_i = _serial_key_loop(
                        q, k_smem, v_smem, p_buffers.index(c), bars, it, first, n_own, plain_start, plain_end, rows,
                        len_q, len_k, window_left, window_right, o, m_i, l_i, qk_scale_log2, row_scale, k_scales,
                        v_scales, scale_tiles_k, LEFT, RIGHT, RESCALE_THRESHOLD, P_SHARED, s_layout, o_layout,
                        p_layout)
                if SEPARATE_O:  # every S wgmma has read Q: the producer may load the next work tile's
                    mbarrier.arrive(q_empty.index(c), count=1)
            elif n_own > 0:
                # slot 0: tile 0's scores only; its P·V is issued together with tile 1's scores
                mbarrier.wait(k_ready.index(it % STAGES), (it // STAGES) & 1)
                _take_turn(turns, c, slot_base, PINGPONG)
                s = warpgroup_mma(q, k_smem.index(it % STAGES).permute((1, 0)), s_init, use_acc=False, is_async=True)
                _pass_turn(turns, c, PINGPONG)
                s = warpgroup_mma_wait(0, deps=[s])
                mbarrier.arrive(k_empty.index(it % STAGES), count=1)
                if (plain_start > 0) | (plain_end <= 0):
                    s = _mask_scores(s, first, rows, len_q, len_k, LEFT, RIGHT, window_left, window_right, BLOCK_N,
                                     s_layout)
                if FP8:
                    tile_rows = row_scale * k_scale_next
                    k_scale_next = _tile_scale(k_scales, first + 1, scale_tiles_k - 1)
                    v_scale_prev = _tile_scale(v_scales, first, scale_tiles_k - 1)
                    p, m_i, l_i, rescale, alpha = _softmax_step(s, m_i, l_i, tile_rows, tile_rows[:, None],
                                                                RESCALE_THRESHOLD, P_LOG2)
                else:
                    p, m_i, l_i, rescale, alpha = _softmax_step(s, m_i, l_i, qk_scale_log2, qk_scale_log2,
                                                                RESCALE_THRESHOLD, P_LOG2)
                if P_SHARED:
                    p_smem.store(p.to(dtype))
                    fence_async_shared()
                elif not FP8:  # FP8: converted where its P·V is issued
                    p = _pack_pairs(p, dtype)
                # the loop in copies (`_loop_copy`) from tile 1: the unmasked copy is a third shorter, and no copy
                # spills (the persistent loop's state does, once per work tile)
                for part in gl.static_range(3):
                    j_start, j_end = _loop_copy(part, 1, plain_start, plain_end, n_own, LEFT)
                    for j in range(j_start, j_end):
                        stage = (it + j) % STAGES
                        prev = (it + j - 1) % STAGES
                        if not P_SHARED:
                            p_op = _p_operand(p, dtype, p_layout)
                        mbarrier.wait(k_ready.index(stage), ((it + j) // STAGES) & 1)
                        mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
                        _take_turn(turns, c, slot_base + j, PINGPONG)
                        if PV_FIRST:
                            pv = warpgroup_mma(p_op, v_smem.index(prev).permute((1, 0)), o_init, use_acc=False,
                                               is_async=True)
                        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_init, use_acc=False, is_async=True)
                        if FP8:
                            if P_SHARED:
                                pv = warpgroup_mma(p_smem, v_smem.index(prev).permute((1, 0)), o_init, use_acc=False,
                                                   is_async=True)
                            k_scale = k_scale_next
                            v_scale = v_scale_prev
                            k_scale_next = _tile_scale(k_scales, first + j + 1, scale_tiles_k - 1)
                            v_scale_prev = _tile_scale(v_scales, first + j, scale_tiles_k - 1)
                        else:
                            o = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
                        _pass_turn(turns, c, PINGPONG)
                        if PV_FIRST:  # P·V is done (S may still run): O takes it before the softmax needs registers
                            # (the wait takes no 8-bit dependency: p_op is not written again before it)
                            pv = warpgroup_mma_wait(1, deps=[pv])
                            mbarrier.arrive(v_empty.index(prev), count=1)
                            o = o + pv * v_scale
                            s = warpgroup_mma_wait(0, deps=[s])
                        else:
                            s = warpgroup_mma_wait(1, deps=[s])  # the older group (S) is done; P·V may still run
                        mbarrier.arrive(k_empty.index(stage), count=1)
                        if part != 1:
                            s = _mask_scores(s, first + j, rows, len_q, len_k, LEFT, RIGHT, window_left, window_right,
                                             BLOCK_N, s_layout)
                        if FP8:
                            tile_rows = row_scale * k_scale
                            p_next, m_i, l_i, rescale, alpha = _softmax_step(s, m_i, l_i, tile_rows, tile_rows[:, None],
                                                                             RESCALE_THRESHOLD, P_LOG2)
                            if P_SHARED:
                                pv = warpgroup_mma_wait(0, deps=[pv])
                                mbarrier.arrive(v_empty.index(prev), count=1)
                                o = o + pv * v_scale
                        else:
                            p_next, m_i, l_i, rescale, alpha = _softmax_step(s, m_i, l_i, qk_scale_log2, qk_scale_log2,
                                                                             RESCALE_THRESHOLD, P_LOG2)
                            o, p_op = warpgroup_mma_wait(0, deps=[o, p_op])
                            mbarrier.arrive(v_empty.index(prev), count=1)
                        if rescale:
                            o = o * gl.convert_layout(alpha, o_row_layout)[:, None]
                        if P_SHARED:
                            p_smem.store(p_next.to(dtype))
                            fence_async_shared()
                        elif FP8:
                            p = p_next
                        else:
                            p = _pack_pairs(p_next, dtype)
                if SEPARATE_O:  # every S wgmma has read Q: the producer may load the next work tile's
                    mbarrier.arrive(q_empty.index(c), count=1)
                # slot n_own: the last tile's P·V
                last = (it + n_own - 1) % STAGES
                if not P_SHARED:
                    p_op = _p_operand(p, dtype, p_layout)
                mbarrier.wait(v_ready.index(last), ((it + n_own - 1) // STAGES) & 1)
                _take_turn(turns, c, slot_base + n_own, PINGPONG)
                if FP8:
                    pv = warpgroup_mma(p_smem if P_SHARED else p_op, v_smem.index(last).permute((1, 0)), o_init,
                                       use_acc=False, is_async=True)
                    _pass_turn(turns, c, PINGPONG)
                    pv = warpgroup_mma_wait(0, deps=[pv])
                    o = o + pv * v_scale_prev
                else:
                    o = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
                    _pass_turn(turns, c, PINGPONG)
                    o = warpgroup_mma_wait(0, deps=[o, p_op])[0]
                mbarrier.arrive(v_empty.index(last), count=1)
            elif SEPARATE_O:
                mbarrier.arrive(q_empty.index(c), count=1)
            # tiles [n_own, n_all) only the other consumer's rows see: released unread. Under ping-pong both consumers
            # hand over n_all + 1 times (a slot per tile, one for the last P·V; one idle slot when no row sees a key):
            # the one with fewer tiles of its own hands over idly, releasing tile k - 1 before idle slot k, so that the
            # other never waits on a tile it holds
            if PINGPONG:
                for slot in range(gl.where(n_own > 0, n_own + 1, 0), n_all + 1):
                    if slot > n_own:
                        _release(k_ready, k_empty, v_ready, v_empty, it + slot - 1)
                    _take_turn(turns, c, slot_base + slot, PINGPONG)
                    _pass_turn(turns, c, PINGPONG)
            else:
                for j in range(n_own, n_all):
                    _release(k_ready, k_empty, v_ready, v_empty, it + j)

            if active:
                # O / l and LSE in natural log; rows that saw no key give 0 and -inf
                seen = l_i > 0.0
                inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
                o = o * gl.convert_layout(inv_l, o_row_layout)[:, None]
                lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0)) - P_LOG2) * _LN2, float("-inf"))
                if VARLEN:  # LSE (Hq, total_q)
                    lse_row = head.to(gl.int64) * seqs[5] + q_start
                else:  # LSE (B, Hq, Nq)
                    lse_row = (batch * n_heads + head).to(gl.int64) * len_q
                gl.store(LSE + lse_row + rows, lse, mask=rows < len_q)
                tma.store_wait(0)  # the previous work tile's O store has read the buffer
                if VARLEN:
                    if row_start + BLOCK_M > len_q:  # a TMA box would write into the next sequence's rows
                        _store_rows(o, seqs, q_start + row_start, len_q - row_start, head, o_layout)
                    else:
                        _store_tma(o, o_desc, staged, [seq_batch, q_start + row_start, head, 0])
                else:
                    _store_tma(o, o_desc, staged, [batch, row_start, head, 0])
            if not SEPARATE_O:
                tma.store_wait(0)  # O was staged in Q's buffer: free it once the store has read it
                mbarrier.arrive(q_empty.index(c), count=1)
            it += n_all
            t_local += 1
        if DYNAMIC:
            k = _read_tile(slots, c, q_ready, t_local)
        else:
            k += gl.num_programs(0)
    tma.store_wait(0)


# lengths, head counts and window sizes stay runtime values: one build per (dtype, head dim, window sides)
@gluon.jit(do_not_specialize=["n_q", "n_k", "n_heads", "group", "batch_heads", "n_m_blocks", "window_left",
                              "window_right", "scale_block", "scale_blocks_q", "scale_tiles_k", "stride_o_row",
                              "stride_o_head", "lse_stride"])
def gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, n_q, n_k, n_heads, group, batch_heads, n_m_blocks,
                     window_left, window_right, qk_scale_log2, LEFT: gl.constexpr, RIGHT: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     RESCALE_THRESHOLD: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr, SEPARATE_O: gl.constexpr, Q_scale=None, K_scale=None, V_scale=None,
                     scale_block=1, scale_blocks_q=1, scale_tiles_k=1, Cu_seqlens_q=None, Cu_seqlens_k=None, O=None,
                     stride_o_row=0, stride_o_head=0, lse_stride=0, VARLEN: gl.constexpr = False,
                     BAND: gl.constexpr = 1, CONSUMERS: gl.constexpr = 2, SNAKE: gl.constexpr = False,
                     P_SHARED: gl.constexpr = False, OVERLAP: gl.constexpr = True, Tile_counter=None,
                     DYNAMIC: gl.constexpr = False):
    """Grid: (programs,), any number up to batch_heads x n_m_blocks work tiles (batch_heads = B * Hq, n_m_blocks =
    cdiv(Nq, CONSUMERS * BLOCK_M)). q/o descriptors: boxes [1, BLOCK_M, 1, D]; k/v: [1, BLOCK_N, 1, D]. LSE: float32
    (B, Hq, Nq) contiguous. qk_scale_log2 = softmax_scale * log2(e) (> 0). LEFT / RIGHT: the window's sides that
    are bounded (causal: RIGHT with window_right = 0), by window_left / window_right >= 0 keys, aligned
    bottom-right. SEPARATE_O: O is staged in a buffer of its own (else in Q's). BAND: the work tiles' order
    (`_tile_coords`). CONSUMERS: 2 or 3 consumer warpgroups, each with its own BLOCK_M-row Q tile (a work tile is
    CONSUMERS x BLOCK_M rows; n_m_blocks counts those). SNAKE: the persistent loop's order (`_snake`).
    FP8 (e4m3 q, k, v descriptors; o 16-bit; SEPARATE_O): v's descriptor is over V transposed (B, Hkv, D, keys)
    with boxes [1, 1, D, BLOCK_N]; Q_scale (B, Hq, scale_blocks_q) float32 contiguous, one scale per
    `scale_block` query rows; K_scale and V_scale (B, Hkv, scale_tiles_k) float32 contiguous, one scale per
    BLOCK_N-key tile. P_SHARED: P goes to the P·V wgmma through shared memory; else from registers with V's keys
    permuted in groups of 16 (`_fp8_operand`). OVERLAP: tile j + 1's S wgmma runs beside tile j's softmax and P·V
    (FA3's intra-warpgroup overlap); else each tile in turn (`_serial_key_loop`), without ping-pong. DYNAMIC:
    after its first work tile (its program id) a program's producer takes the next one no program has taken, by
    an atomic add on Tile_counter (int32, 0 at launch), and hands it to the consumers through shared memory (the
    tiles go in `_tile_coords` order; not with SNAKE)."""
    gl.static_assert(not (DYNAMIC and SNAKE), "DYNAMIC takes the work tiles in order: no SNAKE")
    gl.static_assert(OVERLAP or not PINGPONG, "ping-pong takes turns by the overlapped loop's slots")
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    gl.static_assert(SEPARATE_O or not FP8, "the fp8 forward stages its 16-bit O in a buffer of its own")
    tile_layout_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    tile_layout_kv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], tile_layout_q)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout_kv)
    if SEPARATE_O:
        tile_layout_o: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], o_desc.dtype)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, BLOCK_M, HEAD_DIM], tile_layout_o)
    else:
        o_smem = q_smem
    if FP8:
        tile_layout_vt: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], dtype)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM, BLOCK_N], tile_layout_vt)
        if P_SHARED:
            tile_layout_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
            p_buffers = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, BLOCK_N], tile_layout_p)
        else:
            p_buffers = q_smem  # unread
        scales = (Q_scale, K_scale, V_scale, scale_block, scale_blocks_q, scale_tiles_k)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout_kv)
        p_buffers = q_smem  # P stays in registers
        scales = (LSE, LSE, LSE, scale_block, scale_blocks_q, scale_tiles_k)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
        mbarrier.init(turns.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns)
    if DYNAMIC:  # each consumer's next work tile, from the producer
        slots = gl.allocate_shared_memory(gl.int32, [CONSUMERS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        schedule = (Tile_counter, slots)
    else:
        schedule = (LSE, q_ready)  # unread
    if VARLEN:
        seqs = (Cu_seqlens_q, Cu_seqlens_k, O, stride_o_row, stride_o_head, lse_stride)
    else:
        seqs = (LSE, LSE, LSE, 0, 0, 0)  # unread

    # (Gluon takes no *args in a call and tuple concatenation would turn the constexprs into tensors: each
    # partition's arguments are spelled out, once per consumer count)
    gl.static_assert((CONSUMERS == 2) | (CONSUMERS == 3), "2 or 3 consumer warpgroups")
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, o_desc, q_smem, k_smem, v_smem, o_smem, p_buffers, bars, LSE, n_heads, group, batch_heads,
                         n_m_blocks, n_q, n_k, window_left, window_right, qk_scale_log2, scales, seqs, schedule, LEFT,
                         RIGHT, RESCALE_THRESHOLD, PINGPONG, SEPARATE_O, VARLEN, BAND, SNAKE, P_SHARED, OVERLAP,
                         DYNAMIC)),
            (_consumer, (1, o_desc, q_smem, k_smem, v_smem, o_smem, p_buffers, bars, LSE, n_heads, group, batch_heads,
                         n_m_blocks, n_q, n_k, window_left, window_right, qk_scale_log2, scales, seqs, schedule, LEFT,
                         RIGHT, RESCALE_THRESHOLD, PINGPONG, SEPARATE_O, VARLEN, BAND, SNAKE, P_SHARED, OVERLAP,
                         DYNAMIC)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, n_heads, group, batch_heads, n_m_blocks,
                         n_q, n_k, window_left, window_right, seqs, schedule, LEFT, RIGHT, VARLEN, BAND, SNAKE,
                         DYNAMIC)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, o_desc, q_smem, k_smem, v_smem, o_smem, p_buffers, bars, LSE, n_heads, group, batch_heads,
                         n_m_blocks, n_q, n_k, window_left, window_right, qk_scale_log2, scales, seqs, schedule, LEFT,
                         RIGHT, RESCALE_THRESHOLD, PINGPONG, SEPARATE_O, VARLEN, BAND, SNAKE, P_SHARED, OVERLAP,
                         DYNAMIC)),
            (_consumer, (1, o_desc, q_smem, k_smem, v_smem, o_smem, p_buffers, bars, LSE, n_heads, group, batch_heads,
                         n_m_blocks, n_q, n_k, window_left, window_right, qk_scale_log2, scales, seqs, schedule, LEFT,
                         RIGHT, RESCALE_THRESHOLD, PINGPONG, SEPARATE_O, VARLEN, BAND, SNAKE, P_SHARED, OVERLAP,
                         DYNAMIC)),
            (_consumer, (2, o_desc, q_smem, k_smem, v_smem, o_smem, p_buffers, bars, LSE, n_heads, group, batch_heads,
                         n_m_blocks, n_q, n_k, window_left, window_right, qk_scale_log2, scales, seqs, schedule, LEFT,
                         RIGHT, RESCALE_THRESHOLD, PINGPONG, SEPARATE_O, VARLEN, BAND, SNAKE, P_SHARED, OVERLAP,
                         DYNAMIC)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, n_heads, group, batch_heads, n_m_blocks,
                         n_q, n_k, window_left, window_right, seqs, schedule, LEFT, RIGHT, VARLEN, BAND, SNAKE,
                         DYNAMIC)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
