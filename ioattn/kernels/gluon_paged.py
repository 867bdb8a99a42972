"""Paged decode for sm_90 in Gluon: a producer warp brings K/V pages in by TMA, four consumer warps do the math.

The Triton paged kernel (`ioattn.kernels.paged_attention`) loads each gathered K/V tile into registers, and
Triton 3.6's pipeliner gives those table-dependent loads a single buffer: a program waits for every tile's
loads in full, and its threads spend instructions on 64-bit gather addresses. With an fp8 cache that kernel is
bound by its own per-tile work, not by memory (2.5-2.7 TB/s of fp8 bytes on an H100 or an H200 alike). Here
(`gl.warp_specialize`):

- the producer (1 warp, few registers) reads each tile's block ids from the table and, once the tile's stage of
  the STAGES-deep shared-memory ring is free, issues one TMA copy per cache page for K and one for V (box: the
  page's slots x D of one KV head, the cache viewed as (blocks * PAGE, Hkv * D) rows of slots), completing the
  stage's `ready` mbarrier;
- the consumers (the default partition, 4 warps) own (sequence, KV head, split) with the query heads of the group
  as the rows of a 16-row tile (GROUP <= 16), as the Triton kernel's decode: per tile S = Q·Kᵀ and O += P·V with
  mma.sync (warps split the keys for S and the head dim for O), the online softmax in base 2, then `empty` hands
  the stage back. O and the row sums are rescaled only when some row's max moved (a uniform branch: after the
  first tiles it rarely does); the row sums stay per key column and are reduced once, at the end.

FP8 caches: K converted to float16 two codes per instruction as its mma fragments are loaded (ldmatrix reads 4
codes per word), V converted in registers and restaged as float16 (mma takes key pairs per register, and sm_90
has no 8-bit transposing ldmatrix), bf16 queries scaled into float16 by a power of two per row (as the Triton
kernel), the K scale folded into the softmax scale and the V scale into the output. The last tile, which may
reach past seq_len, is peeled: its stale rows (possibly NaN codes, brought in with the whole page) are masked in
S and zeroed in V; no other tile pays for masks.

Out/Lse take the Triton kernel's layout (split partials merged by `ioattn.kernels.combine`). Decode only, every
key below seq_len visible (no left window or sinks: those stay on the Triton kernel), pages of 16+ slots.
"""


from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

_LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
BLOCK_M: gl.constexpr = gl.constexpr(16)
PRODUCER_REGS: gl.constexpr = gl.constexpr(40)  # the producer warp's registers: table ids and TMA coordinates


@gluon.jit
def _rows_to_fp16(q):
    """q (rows, D) -> (q * 2^e as float16, 2^-e per row), each row's largest |q| in [2^14, 2^15] (exact: see
    `ioattn.kernels.paged_attention.to_fp16_by_rows`)."""
    qf = q.to(gl.float32)
    amax = gl.max(gl.abs(qf), 1)
    biased = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    shift = gl.where((biased > 0) & (biased < 255), 141 - biased, 0)
    shift = gl.minimum(gl.maximum(shift, -126), 126)
    up = ((shift + 127) << 23).to(gl.float32, bitcast=True)
    down = ((127 - shift) << 23).to(gl.float32, bitcast=True)
    return (qf * up[:, None]).to(gl.float16), down


@gluon.jit
def _page_blocks(table_row, tile, seq_len, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, ids_layout: gl.constexpr):
    """Block ids of tile `tile`'s pages, every thread holding all of them (0 for pages past seq_len: any valid
    block, its rows are masked)."""
    PAGES: gl.constexpr = (BLOCK_N + PAGE - 1) // PAGE
    first = (tile * BLOCK_N) // PAGE
    pages = first + gl.arange(0, PAGES, layout=ids_layout)
    return gl.load(table_row + pages, mask=pages * PAGE < seq_len, other=0)


@gluon.jit
def _issue_tile(k_desc, v_desc, k_dst, v_dst, ready, blocks, tile, kv_head, PAGE: gl.constexpr,
                BLOCK_N: gl.constexpr, ids_layout: gl.constexpr):
    """TMA tile `tile`'s K and V pages (block ids `blocks`) into one stage; `ready` completes when all landed."""
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    PAGES: gl.constexpr = BLOCK_N // ROWS
    mbarrier.expect(ready, 2 * k_desc.block_type.nbytes * PAGES)
    slot = (tile * BLOCK_N) % PAGE if PAGE > BLOCK_N else 0
    ids = gl.arange(0, PAGES, layout=ids_layout)
    for p in gl.static_range(PAGES):
        row = gl.sum(gl.where(ids == p, blocks, 0), 0) * PAGE + slot  # every thread holds all ids: no exchange
        tma.async_copy_global_to_shared(k_desc, [row, kv_head * HEAD_DIM], ready, k_dst.slice(p * ROWS, ROWS))
        tma.async_copy_global_to_shared(v_desc, [row, kv_head * HEAD_DIM], ready, v_dst.slice(p * ROWS, ROWS))


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, table_row, seq_len, lo, hi, kv_head,
              PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp: per tile, its block ids from the table, then the TMA copies of its pages once the stage is free."""
    STAGES: gl.constexpr = k_smem.shape[0]
    PAGES: gl.constexpr = (BLOCK_N + PAGE - 1) // PAGE
    ids_layout: gl.constexpr = gl.BlockedLayout([PAGES], [32], [1], [0])
    for tile in range(lo, hi):
        j = tile - lo
        stage = j % STAGES
        blocks = _page_blocks(table_row, tile, seq_len, PAGE, BLOCK_N, ids_layout)
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes the first lap
        _issue_tile(k_desc, v_desc, k_smem.index(stage), v_smem.index(stage), ready.index(stage), blocks, tile,
                    kv_head, PAGE, BLOCK_N, ids_layout)


@gluon.jit
def _rescale(acc, m_i, l_tile, s):
    """The running max moved to each row's max over s: O and the row sums rescaled, P against the new max."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = gl.exp2(m_i - m_safe)
    return acc * alpha[:, None], m_new, l_tile * alpha[:, None], gl.exp2(s - m_safe[:, None])


@gluon.jit
def _attend_tile(acc, m_i, l_tile, q, scale_rows, k_smem, v_smem, v16_smem, p_smem, ready, empty, j, tile, seq_len,
                 mma: gl.constexpr, MASKED: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr):
    """One K/V tile (ring slot j % STAGES) folded into the running state. MASKED: the tile reaches past seq_len
    (its stale rows are masked in S and zeroed in V: their codes may be NaN). RESCALE_THRESHOLD (log2 units, > 0):
    the running max moves only when some P would exceed 2**threshold; the result is exact either way, as O, the
    row sums and the LSE all refer to the same max."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    FP8: gl.constexpr = k_smem.dtype.primitive_bitwidth == 8
    VEC: gl.constexpr = 16 * 8 // k_smem.dtype.primitive_bitwidth
    rows_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // HEAD_DIM, HEAD_DIM // VEC], [gl.num_warps(), 1],
                                                 [1, 0])
    k_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4 if FP8 else 2)
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    v_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    k = k_smem.index(stage).permute((1, 0)).load(k_operand)
    s = mma_v2(q, k.to(q.dtype), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)) * scale_rows[:, None]
    if MASKED:
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        s = gl.where(keys[None, :] < seq_len, s, float("-inf"))
    if FP8:  # V's rows as float16, restaged below for P·V; the ring stage is then read
        v_rows = v_smem.index(stage).load(rows_layout).to(gl.float16)
        if MASKED:
            rows = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows_layout))
            v_rows = gl.where((rows < seq_len)[:, None], v_rows, 0.0)
        mbarrier.arrive(empty.index(stage), count=1)
    elif MASKED:
        v_rows = v_smem.index(stage).load(rows_layout)
        rows = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows_layout))
        v_smem.index(stage).store(gl.where((rows < seq_len)[:, None], v_rows, 0.0))
    if RESCALE_THRESHOLD > 0:
        # FA4's conditional rescale without a cross-warp max per tile: P against the running max as it stands;
        # every warp then holds all of P, so "some P above 2**threshold" (or the program's first tile) is one
        # decision, taken alike by all warps with no barrier, and only then is the true row max reduced
        m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(s - m_ref[:, None])
        if FP8:
            v16_smem.store(v_rows)
        p_smem.store(p.to(p_smem.dtype))
        p_op = p_smem.load(p_operand)
        if (j == 0) | (gl.max(gl.max(p_op.to(gl.float32), 1), 0) > 2.0 ** RESCALE_THRESHOLD):
            acc, m_i, l_tile, p = _rescale(acc, m_i, l_tile, s)
            p_smem.store(p.to(p_smem.dtype))
            p_op = p_smem.load(p_operand)
        l_tile = l_tile + p
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        if gl.max(m_new - m_i, 0) > 0.0:  # some row's max moved (or a row saw its first key): rescale
            alpha = gl.exp2(m_i - m_safe)
            acc = acc * alpha[:, None]
            l_tile = l_tile * alpha[:, None]
            m_i = m_new
        p = gl.exp2(s - m_safe[:, None])
        l_tile = l_tile + p
        if FP8:
            v16_smem.store(v_rows)
        p_smem.store(p.to(p_smem.dtype))  # P to every warp: through a buffer of its own, not the reductions' scratch
        p_op = p_smem.load(p_operand)
    if FP8:
        v = v16_smem.load(v_operand)
    else:
        v = v_smem.index(stage).load(v_operand)
        mbarrier.arrive(empty.index(stage), count=1)
    acc = mma_v2(p_op, v, acc)
    return acc, m_i, l_tile


@gluon.jit
def _consumer(Q, Out, Lse, K_scale, V_scale, k_smem, v_smem, v16_smem, p_smem, ready, empty, seq, kv_head, split,
              seq_len, lo, hi, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
              stride_lh, scale_log2, GROUP: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr):
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    cache_dtype: gl.constexpr = k_smem.dtype
    FP8: gl.constexpr = cache_dtype.primitive_bitwidth == 8
    K_WIDTH: gl.constexpr = 4 if FP8 else 2  # fp8 K fragments: 4 keys' codes per ldmatrix word
    NUM_WARPS: gl.constexpr = gl.num_warps()
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, NUM_WARPS], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    q_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=K_WIDTH)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)

    q_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
    q_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(Q + seq.to(gl.int64) * stride_qt + (kv_head * GROUP + q_rows)[:, None] * stride_qh + q_cols[None, :],
                mask=(q_rows < GROUP)[:, None], other=0.0)
    if FP8:
        scale_log2 = scale_log2 * gl.load(K_scale + kv_head)
        if q.dtype == gl.bfloat16:
            q, row_scale = _rows_to_fp16(q)
            scale_rows = scale_log2 * gl.convert_layout(row_scale, row_layout)
        else:
            scale_rows = gl.full([BLOCK_M], scale_log2, gl.float32, row_layout)
    else:
        scale_rows = gl.full([BLOCK_M], scale_log2, gl.float32, row_layout)
    q = gl.convert_layout(q, q_operand)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_tile = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)  # row sums per key column, reduced at the end
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma)
    # tiles below full_hi hold keys below seq_len only (no masks); clamped to lo for a split past the last tile
    full_hi = gl.maximum(gl.minimum(hi, seq_len // BLOCK_N), lo)
    for tile in range(lo, full_hi):
        acc, m_i, l_tile = _attend_tile(acc, m_i, l_tile, q, scale_rows, k_smem, v_smem, v16_smem, p_smem, ready, empty,
                                        tile - lo, tile, seq_len, mma, False, RESCALE_THRESHOLD)
    for tile in range(full_hi, hi):  # the last tile, partly past seq_len
        acc, m_i, l_tile = _attend_tile(acc, m_i, l_tile, q, scale_rows, k_smem, v_smem, v16_smem, p_smem, ready, empty,
                                        tile - lo, tile, seq_len, mma, True, RESCALE_THRESHOLD)

    out, lse = finish_rows(acc, m_i, l_tile)
    if FP8:
        out = out * gl.load(V_scale + kv_head)
    store_rows(Out, Lse, out, lse, split, seq, kv_head * GROUP, GROUP, stride_os, stride_ot, stride_oh, stride_ls,
               stride_lt, stride_lh)


@gluon.jit
def release_dependents(RELEASE: gl.constexpr):
    """RELEASE: let the split combine, launched by programmatic dependent launch, start once every program of this
    grid has started (sm_90+; it waits for this grid's results itself), as the Triton decode kernels do."""
    if RELEASE:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """(ready, empty): an mbarrier per ring stage for each direction, one arrival each."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def split_tiles(Seq_lens, seq, split, num_splits, BLOCK_N: gl.constexpr):
    """(seq_len, lo, hi): sequence `seq`'s length and the key tiles [lo, hi) of split `split` (empty past the end)."""
    seq_len = gl.load(Seq_lens + seq)
    n_tiles = gl.cdiv(seq_len, BLOCK_N)
    per_split = gl.cdiv(n_tiles, num_splits)
    lo = gl.minimum(split * per_split, n_tiles)
    return seq_len, lo, gl.minimum(lo + per_split, n_tiles)


@gluon.jit
def finish_rows(acc, m_i, l_tile):
    """(O / l, the natural-log LSE) of a finished running state whose row sums stay per key column (l_tile);
    rows that saw no key give 0 and -inf, never NaN."""
    return finish_row_sums(acc, m_i, gl.sum(l_tile, 1))


@gluon.jit
def finish_row_sums(acc, m_i, l_i):
    """`finish_rows` for row sums held as one value per row (l_i)."""
    empty_row = l_i == 0.0
    out = acc / gl.convert_layout(gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, acc.type.layout))[:, None]
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(gl.where(empty_row, 1.0, l_i))) * _LN2)
    return out, lse


@gluon.jit
def store_rows(Out, Lse, out, lse, split, seq, first_head, live_rows, stride_os, stride_ot, stride_oh, stride_ls,
               stride_lt, stride_lh):
    """Rows r < live_rows of out (heads first_head + r) and of lse to their split's partials (Out (splits,
    tokens, heads, D), Lse (splits, tokens, heads))."""
    rows = gl.arange(0, out.shape[0], layout=gl.SliceLayout(1, out.type.layout))
    cols = gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, out.type.layout))
    o_ptrs = Out + split.to(gl.int64) * stride_os + seq.to(gl.int64) * stride_ot \
        + (first_head + rows)[:, None] * stride_oh + cols[None, :]
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(rows < live_rows)[:, None])
    lse_rows = gl.arange(0, lse.shape[0], layout=lse.type.layout)
    gl.store(Lse + split.to(gl.int64) * stride_ls + seq.to(gl.int64) * stride_lt + (first_head + lse_rows) * stride_lh,
             lse, mask=lse_rows < live_rows)


@gluon.jit(do_not_specialize=["num_splits", "stride_table", "stride_os", "stride_ls", "stride_lt", "stride_lh"],
           do_not_specialize_on_alignment=["Block_table", "Seq_lens"])
def gluon_paged_decode_kernel(
    k_desc, v_desc, Q, Block_table, Seq_lens, Out, Lse, K_scale, V_scale,
    stride_qt, stride_qh, stride_table, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh,
    scale_log2, num_splits,
    GROUP: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
    RESCALE_THRESHOLD: gl.constexpr = 0.0, RELEASE_DEPENDENTS: gl.constexpr = False,
):
    """Grid (batch, num_kv_heads, num_splits), 4 warps (+ 1 producer warp). k_desc/v_desc: TMA descriptors over the
    caches viewed as (blocks * PAGE, Hkv * D) with boxes [min(PAGE, BLOCK_N), D]. Out (splits, tokens, heads, D)
    and Lse (splits, tokens, heads), float32 (or Out in q's dtype with one split), as `paged_attention_kernel`
    writes them. FP8 caches: K_scale/V_scale float32 (num_kv_heads,). RESCALE_THRESHOLD: see `_attend_tile`.
    RELEASE_DEPENDENTS: see `release_dependents`."""
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    cache_dtype: gl.constexpr = k_desc.dtype
    ring_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], cache_dtype)

    release_dependents(RELEASE_DEPENDENTS)
    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    seq_len, lo, hi = split_tiles(Seq_lens, seq, split, num_splits, BLOCK_N)

    k_smem = gl.allocate_shared_memory(cache_dtype, [STAGES, BLOCK_N, HEAD_DIM], ring_layout)
    v_smem = gl.allocate_shared_memory(cache_dtype, [STAGES, BLOCK_N, HEAD_DIM], ring_layout)
    # V restaged as float16 when the cache is fp8 (else unused)
    v16_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_N if cache_dtype.primitive_bitwidth == 8 else 16,
                                                      HEAD_DIM], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    p_smem = gl.allocate_shared_memory(gl.float16 if cache_dtype.primitive_bitwidth == 8 else Q.dtype.element_ty,
                                       [BLOCK_M, BLOCK_N], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    ready, empty = ring_barriers(STAGES)
    table_row = Block_table + seq.to(gl.int64) * stride_table

    gl.warp_specialize([
        (_consumer, (Q, Out, Lse, K_scale, V_scale, k_smem, v_smem, v16_smem, p_smem, ready, empty, seq, kv_head, split,
                     seq_len, lo, hi, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls,
                     stride_lt, stride_lh, scale_log2, GROUP, RESCALE_THRESHOLD)),
        (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, table_row, seq_len, lo, hi, kv_head, PAGE,
                     BLOCK_N)),
    ], [1], [PRODUCER_REGS])
