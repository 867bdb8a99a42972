"""FlashAttention forward (FA2 loop order) in Triton: one program per (query tile, batch x head).

The kernel holds no policy: tile sizes, warps, stages, GQA packing and the dot precision all come from the
caller (`ioattn.ops.forward`, which launches it, and `ioattn.ops.dispatch`, which plans it). Q, K, V and O move through device-side tensor descriptors (TMA on Hopper);
their out-of-bounds rows and columns read as zero and are clipped on store, so ragged sequence ends and the
head dim padded to a power of two need no load masks. With `FwdConfig.tma=False` the same tiles move through
pointer loads instead (masked where a tile crosses the sequence end or the padded head dim): no per-program
descriptor set-up, which short sequences feel. Per-element score masks are applied only on the K/V tiles that
straddle a causal/window/sequence boundary, or on every tile when a dense mask is streamed.

Warp specialization (`tl.range(..., warp_specialize=True)`) is not used: in Triton 3.6 it compiles only for a
single branch-free loop, and on an H200 that variant left rows of O and LSE unwritten (seen 2026-11-29), so
the kernel keeps the three-loop (masked / unmasked / masked) structure.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)  # scores live in base 2 inside the kernel
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2
# FP8 forward: probabilities (<= 1) are rounded to e4m3 after x 2^P_CODE_LOG2 (exact to undo), which keeps
# weights down to 2^-14 normal instead of flushing those below 2^-9 (e4m3's max is 448).
P_CODE_LOG2 = 8.0
_P_CODE_LOG2: tl.constexpr = tl.constexpr(P_CODE_LOG2)


@triton.jit
def _load_kv_tile(desc, base, start_n, stride_n, seqlen_k, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, TMA: tl.constexpr, BOUNDED: tl.constexpr):
    """Rows start_n.. of a K or V sequence; rows past seqlen_k and padded head-dim columns read as zero."""
    if TMA:
        return desc.load([start_n, 0])
    else:
        rows = start_n + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM_PAD)
        ptrs = base + rows.to(tl.int64)[:, None] * stride_n + dims[None, :]
        if BOUNDED:
            return tl.load(ptrs, mask=(rows < seqlen_k)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        elif HEAD_DIM != HEAD_DIM_PAD:
            return tl.load(ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _load_vt_tile(desc, base, start_n, stride_d, seqlen_k, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, TMA: tl.constexpr, BOUNDED: tl.constexpr):
    """Keys start_n.. of a transposed V (head dim major, keys contiguous), as the (BLOCK_N, D) tile: the layout an
    fp8 P·V takes from shared memory as it is (fp8 wgmma reads only operands whose reduction dim is contiguous)."""
    if TMA:
        return desc.load([0, start_n]).T
    else:
        keys = start_n + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM_PAD)
        ptrs = base + dims.to(tl.int64)[:, None] * stride_d + keys[None, :]
        if BOUNDED:
            return tl.load(ptrs, mask=(dims < HEAD_DIM)[:, None] & (keys < seqlen_k)[None, :], other=0.0).T
        else:
            return tl.load(ptrs, mask=(dims < HEAD_DIM)[:, None], other=0.0).T


@triton.jit
def _e4m3_grid(x):
    """Non-negative float32 x rounded to nearest even onto e4m3's grid (3 mantissa bits, normal from 2^-6), so
    that converting it is exact: what the GPU's conversion does by itself, and Triton's interpreter does not
    (see `ioattn.kernels.cache_ops.quantize_fp8`)."""
    exponent = tl.maximum(x.to(tl.int32, bitcast=True) >> 23, 127 - 6)
    grid = ((exponent + 20) << 23).to(tl.float32, bitcast=True)
    return (x + grid) - grid


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, stride_kn, stride_vn, lo, hi,
    key_pos, row_valid, mask_rows, stride_mn, seqlen_k, qk_scale, window_left, window_right,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TMA: tl.constexpr,
    MASKED: tl.constexpr, LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr,
    MASK_KIND: tl.constexpr, INPUT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr, FP8: tl.constexpr = False, row_scale=None, k_scales=None, v_scales=None,
    scale_block=1, ROUND_P: tl.constexpr = False,
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
        # scores in base 2: qk_scale already carries log2(e)
        k = _load_kv_tile(k_desc, k_base, start_n, stride_kn, seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, TMA, MASKED)
        qk = tl.dot(q, k.T, input_precision=INPUT_PRECISION)
        if FP8:
            # e4m3 codes: a score is q_code.k_code x (the row's Q block scale x this tile's K block scale); the
            # tile lies in one K scale block (the caller keeps BLOCK_N a divisor of the scale block)
            row_tile_scale = row_scale * tl.load(k_scales + start_n // scale_block)
            tile_scale = row_tile_scale[:, None]
        else:
            tile_scale = qk_scale
        if MASKED:
            s = qk * tile_scale
            cols = start_n + offs_n
            ok = (cols < seqlen_k)[None, :] & row_valid[:, None]
            if RIGHT_BOUNDED:
                ok &= cols[None, :] <= key_pos[:, None] + window_right
            if LEFT_BOUNDED:
                ok &= cols[None, :] >= key_pos[:, None] - window_left
            if MASK_KIND != 0:
                in_bounds = row_valid[:, None] & (cols < seqlen_k)[None, :]
                mask_tile = tl.load(mask_rows[:, None] + cols[None, :].to(tl.int64) * stride_mn, mask=in_bounds, other=0)
                if MASK_KIND == 1:  # MASK_BOOL
                    ok &= mask_tile != 0
                else:
                    s += mask_tile.to(tl.float32) * _LOG2E
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no visible key yet keeps max -inf: subtract 0 instead so exp2 gives 0, not NaN
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
            if FP8:  # the probabilities come out x 2^P_CODE_LOG2 (see below)
                p = tl.math.exp2(s - (m_base - _P_CODE_LOG2)[:, None])
            else:
                p = tl.math.exp2(s - m_base[:, None])
        elif FP8:  # per-row scales, all positive (the caller refuses softmax_scale <= 0 with fp8): one FMA a score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * row_tile_scale)
            m_base = m_new
            p = tl.math.exp2(qk * tile_scale - (m_base - _P_CODE_LOG2)[:, None])
        elif SCALE_POSITIVE:
            # max(qk)·scale is the max of the scaled row, so the scaling folds into one FMA per score
            # (bench/results/2026-11-29-fwd-fma.md)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_base = m_new
            p = tl.math.exp2(qk * qk_scale - m_base[:, None])
        else:
            s = qk * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_base = m_new
            p = tl.math.exp2(s - m_base[:, None])
        alpha = tl.math.exp2(m_i - m_base)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FP8:
            v = _load_vt_tile(v_desc, v_base, start_n, stride_vn, seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, TMA,
                              MASKED)
        else:
            v = _load_kv_tile(v_desc, v_base, start_n, stride_vn, seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, TMA,
                              MASKED)
        if FP8:
            # P x 2^8 in [0, 256] (exp2 of the score minus max - 8: small weights keep their mantissa instead of
            # going subnormal; the factor cancels between acc and l_i) rounded to e4m3; each tile's product lands
            # in a fresh fp32 accumulator and is added here with its V block scale (two-level accumulation: the
            # tensor cores' fp8 accumulation never spans tiles)
            if ROUND_P:
                p = _e4m3_grid(p)
            pv = tl.dot(p.to(v.dtype), v)
            acc += pv * tl.load(v_scales + start_n // scale_block)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# sequence lengths, window bounds and the strides that scale with them (the packed LSE's head stride is the
# token count) vary per call: specializing on them (== 1, % 16) would only recompile
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right", "stride_ob", "stride_lb",
                               "stride_lh", "stride_ln", "scale_block", "scale_blocks_q", "scale_blocks_k"])
def prefill_fwd_kernel(
    Q, K, V, O, LSE, MASK, cu_seqlens_q, cu_seqlens_k, K_descale, V_descale, Q_scale,
    seqlen_q, seqlen_k, num_heads_q, num_heads_kv,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_on, stride_oh,
    stride_lb, stride_lh, stride_ln,
    stride_mb, stride_mh, stride_mm, stride_mn,
    qk_scale, window_left, window_right, scale_block, scale_blocks_q, scale_blocks_k,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, PACK_GQA: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    LEFT_BOUNDED: tl.constexpr, RIGHT_BOUNDED: tl.constexpr, MASK_KIND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr, SCALE_POSITIVE: tl.constexpr, TMA: tl.constexpr,
    DESCALE: tl.constexpr = False, FP8: tl.constexpr = False, ROUND_P: tl.constexpr = False,
):
    # DESCALE: K and V hold fp8 codes (converted exactly); K_descale / V_descale (num_heads_kv,) float32 multiply
    # the softmax scale and the output, per KV head, so the dequantized values are never rounded to 16 bits.
    # FP8: Q, K and V hold e4m3 codes and both products run in fp8; Q_scale (B, Hq, scale_blocks_q), K_descale and
    # V_descale (B, Hkv, scale_blocks_k), float32, contiguous: one scale per `scale_block` positions of a head.
    # V is transposed (B, Hkv, D, keys): stride_vn steps between its head-dim rows (dense layout only).
    # ROUND_P: round the probabilities onto e4m3's grid before converting them (the interpreter's conversion
    # does not round to nearest; the GPU's does).
    # --- which rows this program owns: ROWS query positions of one head, or of a whole GQA group (packed)
    ROWS: tl.constexpr = BLOCK_M // GROUP if PACK_GQA else BLOCK_M
    # last query tiles first: under causal masks they see the most keys, so the grid's tail is short work
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    if PACK_GQA:
        batch = pid_bh // num_heads_kv
        head_kv = pid_bh % num_heads_kv
        head_q = head_kv * GROUP
    else:
        batch = pid_bh // num_heads_q
        head_q = pid_bh % num_heads_q
        head_kv = head_q // GROUP
    q_start64 = 0
    k_start64 = 0
    if VARLEN:
        q_start = tl.load(cu_seqlens_q + batch)
        seqlen_q = tl.load(cu_seqlens_q + batch + 1) - q_start
        k_start = tl.load(cu_seqlens_k + batch)
        seqlen_k = tl.load(cu_seqlens_k + batch + 1) - k_start
        q_start64 = q_start.to(tl.int64)
        k_start64 = k_start.to(tl.int64)
    start_row = pid_m * ROWS
    if start_row < seqlen_q:  # a program past this sequence's end has nothing to do
        batch64 = batch.to(tl.int64)

        # --- per-row position (in key coordinates) and head
        offs = tl.arange(0, BLOCK_M)
        if PACK_GQA:
            row = start_row + offs // GROUP
            row_head = head_q + offs % GROUP
        else:
            row = start_row + offs
            row_head = head_q + offs * 0
        row_valid = row < seqlen_q
        shift = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0
        key_pos = row + shift
        mask_rows = MASK + batch64 * stride_mb + row_head.to(tl.int64) * stride_mh + row.to(tl.int64) * stride_mm

        q_base = Q + batch64 * stride_qb + q_start64 * stride_qn
        o_base = O + batch64 * stride_ob + q_start64 * stride_on
        k_base = K + batch64 * stride_kb + k_start64 * stride_kn + head_kv * stride_kh
        v_base = V + batch64 * stride_vb + k_start64 * stride_vn + head_kv * stride_vh
        dims = tl.arange(0, HEAD_DIM_PAD)
        if TMA:
            # descriptors over this sequence only, so reads past its end are zero and writes past it are dropped
            if PACK_GQA:
                q_desc = tl.make_tensor_descriptor(q_base, shape=[seqlen_q, num_heads_q, HEAD_DIM],
                                                   strides=[stride_qn, stride_qh, 1],
                                                   block_shape=[ROWS, GROUP, HEAD_DIM_PAD])
                o_desc = tl.make_tensor_descriptor(o_base, shape=[seqlen_q, num_heads_q, HEAD_DIM],
                                                   strides=[stride_on, stride_oh, 1],
                                                   block_shape=[ROWS, GROUP, HEAD_DIM_PAD])
                q = q_desc.load([start_row, head_q, 0]).reshape(BLOCK_M, HEAD_DIM_PAD)
            else:
                q_desc = tl.make_tensor_descriptor(q_base + head_q * stride_qh, shape=[seqlen_q, HEAD_DIM],
                                                   strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM_PAD])
                o_desc = tl.make_tensor_descriptor(o_base + head_q * stride_oh, shape=[seqlen_q, HEAD_DIM],
                                                   strides=[stride_on, 1], block_shape=[BLOCK_M, HEAD_DIM_PAD])
                q = q_desc.load([start_row, 0])
            # an empty K/V sequence still gets a 1-row descriptor (never read: its tile range below is empty)
            k_desc = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(seqlen_k, 1), HEAD_DIM],
                                               strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM_PAD])
            if FP8:  # V transposed: stride_vn steps between head-dim rows of keys
                v_desc = tl.make_tensor_descriptor(v_base, shape=[HEAD_DIM, tl.maximum(seqlen_k, 1)],
                                                   strides=[stride_vn, 1], block_shape=[HEAD_DIM_PAD, BLOCK_N])
            else:
                v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(seqlen_k, 1), HEAD_DIM],
                                                   strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM_PAD])
        else:
            # pointer loads: no per-program descriptor setup, which short sequences feel most
            k_desc = K  # placeholders: _attend_tiles reads through k_base / v_base in this mode
            v_desc = V
            row_offsets = row.to(tl.int64)[:, None] * stride_qn + row_head.to(tl.int64)[:, None] * stride_qh
            io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
            q = tl.load(q_base + row_offsets + dims[None, :], mask=io_mask, other=0.0)

        # --- K/V tile ranges: [kv_lo, full_lo) and [full_hi, kv_hi) need per-element masks, [full_lo, full_hi) not
        first_pos = start_row + shift
        last_pos = tl.minimum(start_row + ROWS, seqlen_q) - 1 + shift
        kv_lo = 0
        kv_hi = seqlen_k
        full_lo = 0
        full_hi = seqlen_k
        if LEFT_BOUNDED:
            kv_lo = tl.maximum(first_pos - window_left, 0)
            full_lo = tl.maximum(last_pos - window_left, 0)
        if RIGHT_BOUNDED:  # kept >= 0: Triton's integer division truncates toward zero
            kv_hi = tl.maximum(tl.minimum(last_pos + window_right + 1, seqlen_k), 0)
            full_hi = tl.maximum(tl.minimum(first_pos + window_right + 1, seqlen_k), 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, kv_lo), kv_hi)
        if MASK_KIND != 0:
            full_hi = full_lo  # a dense mask has to be read on every tile
        full_hi = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_lo)

        # --- online softmax over the visible K/V tiles
        qk_scale = qk_scale * _LOG2E
        if DESCALE:
            qk_scale = qk_scale * tl.load(K_descale + head_kv)
        row_scale = qk_scale  # FP8: the softmax scale x each row's Q block scale
        k_scales = K_descale  # FP8: this head's K and V block scales
        v_scales = V_descale
        if FP8:
            q_scales = Q_scale + (batch64 * num_heads_q + row_head) * scale_blocks_q
            row_scale = qk_scale * tl.load(q_scales + row // scale_block, mask=row_valid, other=0.0)
            kv_scales = (batch64 * num_heads_kv + head_kv) * scale_blocks_k
            k_scales = K_descale + kv_scales
            v_scales = V_descale + kv_scales
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, stride_kn, stride_vn, kv_lo, full_lo, key_pos,
            row_valid, mask_rows, stride_mn, seqlen_k, qk_scale, window_left, window_right, BLOCK_N, HEAD_DIM,
            HEAD_DIM_PAD, TMA, True, LEFT_BOUNDED, RIGHT_BOUNDED, MASK_KIND,
            INPUT_PRECISION, LOOP_STAGES, SCALE_POSITIVE, FP8, row_scale, k_scales, v_scales, scale_block, ROUND_P)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, stride_kn, stride_vn, full_lo, full_hi, key_pos,
            row_valid, mask_rows, stride_mn, seqlen_k, qk_scale, window_left, window_right, BLOCK_N, HEAD_DIM,
            HEAD_DIM_PAD, TMA, False, LEFT_BOUNDED, RIGHT_BOUNDED, MASK_KIND,
            INPUT_PRECISION, LOOP_STAGES, SCALE_POSITIVE, FP8, row_scale, k_scales, v_scales, scale_block, ROUND_P)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, stride_kn, stride_vn, full_hi, kv_hi, key_pos,
            row_valid, mask_rows, stride_mn, seqlen_k, qk_scale, window_left, window_right, BLOCK_N, HEAD_DIM,
            HEAD_DIM_PAD, TMA, True, LEFT_BOUNDED, RIGHT_BOUNDED, MASK_KIND,
            INPUT_PRECISION, LOOP_STAGES, SCALE_POSITIVE, FP8, row_scale, k_scales, v_scales, scale_block, ROUND_P)

        # --- epilogue: rows that saw no key get output 0 and LSE -inf
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        if DESCALE:
            out = out * tl.load(V_descale + head_kv)
        log2_l = tl.math.log2(tl.where(empty, 1.0, l_i))
        if FP8:
            log2_l -= _P_CODE_LOG2  # l_i summed the probabilities x 2^8
        lse = tl.where(empty, float("-inf"), (m_i + log2_l) * _LN2)
        if not TMA:
            o_rows = row.to(tl.int64)[:, None] * stride_on + row_head.to(tl.int64)[:, None] * stride_oh
            tl.store(o_base + o_rows + dims[None, :], out.to(O.dtype.element_ty), mask=io_mask)
        elif PACK_GQA:
            o_desc.store([start_row, head_q, 0], out.to(O.dtype.element_ty).reshape(ROWS, GROUP, HEAD_DIM_PAD))
        else:
            o_desc.store([start_row, 0], out.to(O.dtype.element_ty))
        lse_ptrs = LSE + batch64 * stride_lb + row_head.to(tl.int64) * stride_lh + (q_start64 + row) * stride_ln
        tl.store(lse_ptrs, lse, mask=row_valid)
