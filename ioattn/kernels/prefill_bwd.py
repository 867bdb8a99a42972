"""FlashAttention backward by recomputation in Triton: only O and the row log-sum-exp were saved.

With P = exp(S - lse) recomputed tile by tile, the gradients are (FlashAttention-2, Algorithm 2):
    delta = rowsum(dO * O)          dV = P^T dO          dP = dO V^T
    dS = P * (dP - delta)           dQ = scale dS K      dK = scale dS^T Q      d(additive mask) = dS
Two kernels: a dQ kernel (one Q tile resident, K/V streamed; it also writes each row's lse in base 2 and
delta, so no preprocess pass reads O and dO on its own) and then a dK/dV kernel (one K/V tile resident in
registers, Q/dO tiles of every query head of its GQA group streamed past it, so dK/dV are summed over the group
without atomics). Two ways to get dQ, chosen by the caller:
  - separate dQ kernel (deterministic): no atomics, bitwise reproducible; costs two extra tile matmuls per
    (Q, K) tile pair (S and dP are recomputed: 7 matmuls instead of 5, +40% tensor-core work).
  - fused atomics (`BwdConfig.atomic_dq`): a preprocess writes the row statistics, then the dK/dV kernel adds
    each dS K into an fp32 dQ buffer with relaxed atomics; 5 matmuls, but the summation order varies from run
    to run (results differ in the last bits) and it needs an fp32 (total_q, Hq, D) buffer plus a cast pass.
Each kernel walks its grid longest tile first in groups of a few heads (`_longest_first`), so under causal
masks the grid does not end on a few long programs.
A gradient for an additive mask that broadcasts over batch/heads is reduced with atomics unless deterministic;
in deterministic mode it is written per (batch, head) into an expanded fp32 buffer and summed by torch
(B*Hq*Nq*Nk floats of extra memory).
The per-row statistics travel as an fp32 (rows, Hq, 4) tensor next to Q: [lse2, delta, 0, 0] rows are 16 bytes,
so they load through tensor descriptors like Q and dO (plain pointer loads inside the streaming loop make
ptxas serialize the wgmma instructions of the dK/dV kernel on sm_90, warning C7515).
Tiles no query can see (causal / window) are skipped; only tiles that straddle a boundary apply per-element
masks. Scores live in base 2 (exp2 with log2(e) folded into the scale). Rows that saw no key have lse = -inf:
the statistics pass turns it into +inf so their P is exactly 0 and they contribute zero gradient, never NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ioattn.kernels.prefill_fwd import LOG2E

_LOG2E = tl.constexpr(LOG2E)  # scores live in base 2 inside the kernels
DMASK_NONE, DMASK_STORE, DMASK_ATOMIC = 0, 1, 2  # how the dK/dV kernel writes an additive mask's gradient


@triton.jit
def _sequence(cu_q, cu_k, batch, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(first row in the packed tensor, length) of this batch entry's queries and keys."""
    if VARLEN:
        q_start = tl.load(cu_q + batch)
        k_start = tl.load(cu_k + batch)
        return q_start, tl.load(cu_q + batch + 1) - q_start, k_start, tl.load(cu_k + batch + 1) - k_start
    else:
        zero = batch * 0  # a tensor, like the varlen starts
        return zero, seqlen_q, zero, seqlen_k


@triton.jit
def _longest_first(HEAD_GROUP: tl.constexpr):
    """(tile rank, batch x head index) of this program of a (tiles, batch x heads) grid. Programs start in launch
    order, so the grid is walked in groups of HEAD_GROUP (batch, head) pairs, one group after another, and inside
    a group rank 0 of every pair, then rank 1, and so on. The caller maps rank 0 to its longest tile under causal
    masks: the last programs to start are short ones, so no SM is left with a long tail, and the programs
    running at once share the K/V or Q/dO of a few heads in L2."""
    tiles = tl.num_programs(0)
    linear = tl.program_id(1) * tiles + tl.program_id(0)
    group = linear // (HEAD_GROUP * tiles)
    first = group * HEAD_GROUP
    in_group = tl.minimum(tl.num_programs(1) - first, HEAD_GROUP)
    within = linear - group * HEAD_GROUP * tiles
    return within // in_group, first + within % in_group


@triton.jit
def _rows_stats(stats_desc, start):
    """(lse2, delta) of rows start.. from their [lse2, delta, 0, 0] records; rows past the end read 0, 0,
    which with their zero Q and dO rows makes P * (dP - delta) exactly 0."""
    records = stats_desc.load([start, 0])
    field = tl.arange(0, 4)[None, :]
    return tl.sum(tl.where(field == 0, records, 0.0), axis=1), tl.sum(tl.where(field == 1, records, 0.0), axis=1)


@triton.jit
def _recompute(
    q, k, v, do, lse2, delta, rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
    mask_bh, stride_mm, stride_mn, qk_scale,
    KEYS_MAJOR: tl.constexpr, MASKED: tl.constexpr, LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr,
    MASK_KIND: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """P and dS of one (query tile, key tile); rows/cols are positions inside the sequence. KEYS_MAJOR gives
    the (keys, queries) tiles, so the dK/dV kernel feeds them to its matmuls without transposes."""
    if KEYS_MAJOR:
        r = rows[None, :]
        c = cols[:, None]
        s = tl.dot(k, q.T, input_precision=INPUT_PRECISION) * qk_scale
    else:
        r = rows[:, None]
        c = cols[None, :]
        s = tl.dot(q, k.T, input_precision=INPUT_PRECISION) * qk_scale
    if MASK_KIND != 0:
        inside = (r < seqlen_q) & (c < seqlen_k)
        dense = tl.load(mask_bh + r.to(tl.int64) * stride_mm + c * stride_mn, mask=inside, other=0)  # Nq*Nk > 2^31
        if MASK_KIND == 1:  # MASK_BOOL
            s = tl.where(dense != 0, s, float("-inf"))
        else:
            s += dense.to(tl.float32) * _LOG2E
    if MASKED:
        key_pos = r + diag  # where each query sits on the key axis
        ok = (r < seqlen_q) & (c < seqlen_k)
        if RIGHT_BOUNDED:
            ok &= c <= key_pos + window_right
        if LEFT_BOUNDED:
            ok &= c >= key_pos - window_left
        s = tl.where(ok, s, float("-inf"))
    if KEYS_MAJOR:
        p = tl.math.exp2(s - lse2[None, :])
        return p, p * (tl.dot(v, do.T, input_precision=INPUT_PRECISION) - delta[None, :])
    else:
        p = tl.math.exp2(s - lse2[:, None])
        return p, p * (tl.dot(do, v.T, input_precision=INPUT_PRECISION) - delta[:, None])


@triton.jit
def _dkdv_steps(
    dk, dv, k, v, q_desc, do_desc, stats_desc, dq_rows, stride_qn, mask_bh, stride_mm, stride_mn,
    dmask_bh, stride_dmm, stride_dmn, lo, hi, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
    softmax_scale, qk_scale,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
    LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, MASK_KIND: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DMASK_MODE: tl.constexpr, INPUT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """Stream query tiles [lo, hi) past the resident K/V tile, accumulating dK and dV."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    for start in tl.range(lo, hi, BLOCK_M, num_stages=LOOP_STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        q = q_desc.load([start, 0])
        do = do_desc.load([start, 0])
        lse2, delta = _rows_stats(stats_desc, start)
        p_t, ds_t = _recompute(
            q, k, v, do, lse2, delta, rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
            mask_bh, stride_mm, stride_mn, qk_scale, True, MASKED, LEFT_BOUNDED, RIGHT_BOUNDED, MASK_KIND,
            INPUT_PRECISION,
        )
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(ds_t.to(k.dtype).T, k, input_precision=INPUT_PRECISION) * softmax_scale
            in_rows = (rows[:, None] < seqlen_q) & (dims[None, :] < HEAD_DIM)
            dq_ptrs = dq_rows + rows.to(tl.int64)[:, None] * stride_qn + dims[None, :]
            tl.atomic_add(dq_ptrs, dq, mask=in_rows, sem="relaxed")
        if DMASK_MODE != 0:  # DMASK_STORE or DMASK_ATOMIC
            inside = (rows[None, :] < seqlen_q) & (cols[:, None] < seqlen_k)
            dmask_ptrs = dmask_bh + rows.to(tl.int64)[None, :] * stride_dmm + cols[:, None] * stride_dmn
            if DMASK_MODE == 1:  # DMASK_STORE: one element per (batch, head, row, col)
                tl.store(dmask_ptrs, ds_t, mask=inside)
            else:  # the mask broadcasts over batch/heads: several programs add into one element
                tl.atomic_add(dmask_ptrs, ds_t, mask=inside, sem="relaxed")
    return dk, dv


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, STATS, DK, DV, DQ_ACCUM, MASK, DMASK, CU_Q, CU_K,
    seqlen_q, seqlen_k, num_kv_heads,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_sb, stride_sn, stride_sh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_dmb, stride_dmh, stride_dmm, stride_dmn,
    softmax_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, LEFT_BOUNDED: tl.constexpr,
    RIGHT_BOUNDED: tl.constexpr, MASK_KIND: tl.constexpr, ATOMIC_DQ: tl.constexpr, DMASK_MODE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr,
):
    """One program: one K/V tile of one (batch, KV head); writes its rows of dK and dV."""
    rank, pair = _longest_first(HEAD_GROUP)
    batch = pair // num_kv_heads
    kv_head = pair % num_kv_heads
    q_start, seqlen_q, k_start, seqlen_k = _sequence(CU_Q, CU_K, batch, seqlen_q, seqlen_k, VARLEN)
    start_n = rank * BLOCK_N  # the first key tiles are seen by the most queries under causal masks
    if start_n >= seqlen_k:
        return
    batch64 = batch.to(tl.int64)
    diag = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0  # query i sits at key position i + diag

    # Query rows that see any / every column of this tile; tiles outside [lo, hi) are skipped.
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if RIGHT_BOUNDED:  # key j visible to row i only if j <= i + diag + right
        lo = tl.maximum(start_n - diag - window_right, 0)
        full_lo = start_n + BLOCK_N - 1 - diag - window_right
    if LEFT_BOUNDED:  # ... and j >= i + diag - left
        hi = tl.minimum(start_n + BLOCK_N - diag + window_left, seqlen_q)
        full_hi = tl.minimum(start_n - diag + window_left + 1, seqlen_q)
    lo = lo // BLOCK_M * BLOCK_M
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(full_hi, 0) // BLOCK_M * BLOCK_M, full_lo), hi)
    if start_n + BLOCK_N > seqlen_k:  # zero K rows past the end would give exp2(0 - lse) > 0: mask them
        full_hi = full_lo

    kv_offset = batch64 * stride_kb + k_start.to(tl.int64) * stride_kn + kv_head.to(tl.int64) * stride_kh
    kv_shape = [seqlen_k, HEAD_DIM]
    k = tl.make_tensor_descriptor(K + kv_offset, kv_shape, [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD]).load([start_n, 0])
    v = tl.make_tensor_descriptor(V + kv_offset, kv_shape, [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD]).load([start_n, 0])
    cols = start_n + tl.arange(0, BLOCK_N)
    qk_scale = softmax_scale * _LOG2E
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    if seqlen_q > 0:
        for member in range(GROUP):
            head = kv_head * GROUP + member
            q_offset = batch64 * stride_qb + q_start.to(tl.int64) * stride_qn + head.to(tl.int64) * stride_qh
            q_desc = tl.make_tensor_descriptor(Q + q_offset, [seqlen_q, HEAD_DIM], [stride_qn, 1],
                                               [BLOCK_M, HEAD_DIM_PAD])
            do_desc = tl.make_tensor_descriptor(DO + q_offset, [seqlen_q, HEAD_DIM], [stride_qn, 1],
                                                [BLOCK_M, HEAD_DIM_PAD])
            stats_offset = batch64 * stride_sb + q_start.to(tl.int64) * stride_sn + head.to(tl.int64) * stride_sh
            stats_desc = tl.make_tensor_descriptor(STATS + stats_offset, [seqlen_q, 4], [stride_sn, 1], [BLOCK_M, 4])
            mask_bh = MASK + batch64 * stride_mb + head.to(tl.int64) * stride_mh
            dmask_bh = DMASK + batch64 * stride_dmb + head.to(tl.int64) * stride_dmh
            for segment in tl.static_range(3):  # boundary tiles, inner tiles (no element masks), boundary tiles
                seg_lo = lo if segment == 0 else (full_lo if segment == 1 else full_hi)
                seg_hi = full_lo if segment == 0 else (full_hi if segment == 1 else hi)
                dk, dv = _dkdv_steps(
                    dk, dv, k, v, q_desc, do_desc, stats_desc, DQ_ACCUM + q_offset,
                    stride_qn, mask_bh, stride_mm, stride_mn, dmask_bh, stride_dmm, stride_dmn, seg_lo, seg_hi,
                    cols, seqlen_q, seqlen_k, diag, window_left, window_right, softmax_scale, qk_scale,
                    BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, segment != 1, LEFT_BOUNDED, RIGHT_BOUNDED, MASK_KIND,
                    ATOMIC_DQ, DMASK_MODE, INPUT_PRECISION, LOOP_STAGES,
                )
    # Stored once per program: pointer stores spare building two more descriptors, and in the sm_90 build of the
    # D=128 tile they move the register spills out of the loop into the prologue and epilogue.
    dims = tl.arange(0, HEAD_DIM_PAD)
    kv_tile = kv_offset + cols.to(tl.int64)[:, None] * stride_kn + dims[None, :]
    kv_inside = (cols[:, None] < seqlen_k) & (dims[None, :] < HEAD_DIM)
    tl.store(DK + kv_tile, (dk * softmax_scale).to(DK.dtype.element_ty), mask=kv_inside)
    tl.store(DV + kv_tile, dv.to(DV.dtype.element_ty), mask=kv_inside)


@triton.jit
def _dq_steps(
    dq, q, do, lse2, delta, k_desc, v_desc, rows, lo, hi, seqlen_q, seqlen_k, diag, window_left, window_right,
    mask_bh, stride_mm, stride_mn, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr,
    MASK_KIND: tl.constexpr, INPUT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """Stream key tiles [lo, hi) past the resident Q tile, accumulating dQ (unscaled)."""
    for start in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        k = k_desc.load([start, 0])
        v = v_desc.load([start, 0])
        _, ds = _recompute(
            q, k, v, do, lse2, delta, rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
            mask_bh, stride_mm, stride_mn, qk_scale, False, MASKED, LEFT_BOUNDED, RIGHT_BOUNDED, MASK_KIND,
            INPUT_PRECISION,
        )
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, STATS, DQ, MASK, CU_Q, CU_K,
    seqlen_q, seqlen_k, num_heads,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh,
    stride_sb, stride_sn, stride_sh, stride_mb, stride_mh, stride_mm, stride_mn,
    softmax_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, LEFT_BOUNDED: tl.constexpr,
    RIGHT_BOUNDED: tl.constexpr, MASK_KIND: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    LOOP_STAGES: tl.constexpr, HEAD_GROUP: tl.constexpr,
):
    """One program: one Q tile of one (batch, query head); writes its rows of dQ."""
    rank, pair = _longest_first(HEAD_GROUP)
    batch = pair // num_heads
    head = pair % num_heads
    q_start, seqlen_q, k_start, seqlen_k = _sequence(CU_Q, CU_K, batch, seqlen_q, seqlen_k, VARLEN)
    start_m = (tl.num_programs(0) - 1 - rank) * BLOCK_M  # the last query tiles see the most keys under causal masks
    if start_m >= seqlen_q:
        return
    batch64 = batch.to(tl.int64)
    diag = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0

    # Key columns seen by any / every row of this tile.
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if LEFT_BOUNDED:
        lo = tl.maximum(start_m + diag - window_left, 0)
        full_lo = start_m + BLOCK_M - 1 + diag - window_left
    if RIGHT_BOUNDED:
        hi = tl.minimum(start_m + BLOCK_M + diag + window_right, seqlen_k)
        full_hi = tl.minimum(start_m + diag + window_right + 1, seqlen_k)
    lo = lo // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N, full_lo), hi)

    # The resident tiles load once, through pointers (no descriptors to build for them), and this program
    # writes its rows' statistics for the dK/dV kernel, which runs after this one (no preprocess launch).
    rows = start_m + tl.arange(0, BLOCK_M)
    valid = rows < seqlen_q
    row_pos = q_start.to(tl.int64) + rows
    head64 = head.to(tl.int64)
    do, lse2, delta = _write_row_stats(O, DO, LSE, STATS, batch64, head64, row_pos, valid, stride_qb, stride_qn,
                                       stride_qh, stride_lb, stride_lh, stride_sb, stride_sn, stride_sh, HEAD_DIM,
                                       HEAD_DIM_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_offsets = batch64 * stride_qb + row_pos[:, None] * stride_qn + head64 * stride_qh + dims[None, :]
    inside = valid[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(Q + row_offsets, mask=inside, other=0.0)

    kv_offset = (batch64 * stride_kb + k_start.to(tl.int64) * stride_kn
                 + (head // GROUP).to(tl.int64) * stride_kh)
    mask_bh = MASK + batch64 * stride_mb + head.to(tl.int64) * stride_mh
    qk_scale = softmax_scale * _LOG2E
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if seqlen_k > 0:  # a sequence without keys has dQ = 0 (and no zero-sized descriptor is built)
        k_desc = tl.make_tensor_descriptor(K + kv_offset, [seqlen_k, HEAD_DIM], [stride_kn, 1],
                                           [BLOCK_N, HEAD_DIM_PAD])
        v_desc = tl.make_tensor_descriptor(V + kv_offset, [seqlen_k, HEAD_DIM], [stride_kn, 1],
                                           [BLOCK_N, HEAD_DIM_PAD])
        for segment in tl.static_range(3):  # boundary tiles, inner tiles (no element masks), boundary tiles
            seg_lo = lo if segment == 0 else (full_lo if segment == 1 else full_hi)
            seg_hi = full_lo if segment == 0 else (full_hi if segment == 1 else hi)
            dq = _dq_steps(
                dq, q, do, lse2, delta, k_desc, v_desc, rows, seg_lo, seg_hi, seqlen_q, seqlen_k, diag,
                window_left, window_right, mask_bh, stride_mm, stride_mn, qk_scale, BLOCK_N, segment != 1,
                LEFT_BOUNDED, RIGHT_BOUNDED, MASK_KIND, INPUT_PRECISION, LOOP_STAGES,
            )
    tl.store(DQ + row_offsets, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=inside)


@triton.jit
def _write_row_stats(
    O, DO, LSE, STATS, batch64, head64, row_pos, valid, stride_qb, stride_qn, stride_qh, stride_lb, stride_lh,
    stride_sb, stride_sn, stride_sh, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """For rows row_pos (packed positions; `valid` where they exist) of one head: writes their [lse2, delta, 0, 0]
    records, lse2 = lse * log2(e) (+inf where lse = -inf, so P = 0) and delta = rowsum(dO * O) in fp32, and
    returns (dO tile, lse2, delta); rows that do not exist read zeros."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    offsets = batch64 * stride_qb + row_pos[:, None] * stride_qn + head64 * stride_qh + dims[None, :]
    inside = valid[:, None] & (dims[None, :] < HEAD_DIM)
    do = tl.load(DO + offsets, mask=inside, other=0.0)
    delta = tl.sum(tl.load(O + offsets, mask=inside, other=0.0).to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(LSE + batch64 * stride_lb + head64 * stride_lh + row_pos, mask=valid, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    field = tl.arange(0, 4)[None, :]
    records = tl.where(field == 0, lse2[:, None], tl.where(field == 1, delta[:, None], 0.0))
    record_ptrs = STATS + batch64 * stride_sb + row_pos[:, None] * stride_sn + head64 * stride_sh + field
    tl.store(record_ptrs, records, mask=valid[:, None])
    return do, lse2, delta


@triton.jit
def attention_bwd_preprocess_kernel(
    O, DO, LSE, STATS, CU_Q, seqlen_q, num_heads, stride_qb, stride_qn, stride_qh, stride_lb, stride_lh,
    stride_sb, stride_sn, stride_sh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):
    """Per row and head: the [lse2, delta, 0, 0] records the dK/dV kernel reads (`_write_row_stats`). Only the
    fused atomic-dQ mode needs this pass: otherwise the dQ kernel writes them and runs first."""
    batch = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    q_start, seqlen_q, _, _ = _sequence(CU_Q, CU_Q, batch, seqlen_q, seqlen_q, VARLEN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    _write_row_stats(O, DO, LSE, STATS, batch.to(tl.int64), head.to(tl.int64), (q_start + rows).to(tl.int64),
                     rows < seqlen_q, stride_qb, stride_qn, stride_qh, stride_lb, stride_lh, stride_sb, stride_sn,
                     stride_sh, HEAD_DIM, HEAD_DIM_PAD)
