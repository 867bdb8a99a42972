"""Where a Gluon MLA decode program spends its time: the lockstep and seesaw 64-head wgmma kernels and the 16-head
mma.sync kernel of `ioattn.kernels.gluon_mla` rebuilt here with %globaltimer stamps (ns) per program at: kernel
start, Q staged, the first tile (seesaw: pair) folded in, the last one, O and LSE stored (each consumer warpgroup
of the seesaw), and the producer's start, first block ids read and last TMA issued. O is staged through the ring
as the 64-head defaults do. Prints each phase's median over programs, relative to the kernel's start (16 heads:
also the spread over programs of the first tile, the last tile and the store), after warm-up launches: 128 heads
at B 1 and 64, L 64 and 1024 (seesaw: 128 to 4096); 16 heads at W2 7/7's B·L = 64k rows with the split
heuristic's count (the partials only; no combine) and at B128 L1k (latent 512 + 64, pages of 64). The 64-head
probes check their output against float64 first.

    PYTHONPATH=. python3 lab/gluon_mla_probe.py [16|128|seesaw ...]     # CUDA, sm_90; default 128 and 16
"""

from __future__ import annotations

import math
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ioattn.bench.mla import LATENT_DIM, ROW_DIM, SOFTMAX_SCALE, latent_pool
from ioattn.kernels.gluon_mla import (
    SEESAW_REGS, SEESAW_TILE, SYNC_L, WIDE_HEADS, _attend_tile, _page_blocks, _producer, _publish,
    _seesaw_pair, _seesaw_producer, _stage_q, _store_out, _wide_tile, seesaw_buffers, seesaw_stage_q,
)
from ioattn.kernels.gluon_paged import (
    PRODUCER_REGS, finish_row_sums, finish_rows, ring_barriers, split_tiles, store_rows,
)
from ioattn.ops.gluon_paged import cache_descriptor
from ioattn.ops.mla import explain_mla

SLOTS: gl.constexpr = gl.constexpr(16)  # stamp columns per program
BLOCK_M16 = gl.constexpr(16)  # the 16-head kernel's query rows
NAMES = ["start", "Q staged", "first tile", "last tile", "stored", "producer start", "first ids", "producer done"]


@gluon.jit
def _stamp(Stamps, slot: gl.constexpr, after):
    """%globaltimer into Stamps[program, slot], read once `after` (a value the stamp must wait for) exists."""
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [after], dtype=gl.int64,
                                    is_pure=False, pack=1)
    program = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    gl.store(Stamps + program * SLOTS + slot, now)


@gluon.jit
def _tile(dtype: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr):
    """A rows x cols shared-memory tile in the layout wgmma and TMA take."""
    return gl.allocate_shared_memory(dtype, [rows, cols], gl.NVMMASharedLayout.get_default_for([rows, cols], dtype))


@gluon.jit
def _ring(dtype: gl.constexpr, stages: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr):
    """`stages` such tiles."""
    return gl.allocate_shared_memory(dtype, [stages, rows, cols],
                                     gl.NVMMASharedLayout.get_default_for([rows, cols], dtype))


@gluon.jit
def _probe_producer(lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, Stamps,
                    PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    _stamp(Stamps, 5, seq_len)
    ids_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    blocks = _page_blocks(table_row, lo, seq_len, PAGE, BLOCK_N, ids_layout)
    _stamp(Stamps, 6, gl.sum(blocks, 0))
    _producer(lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE, BLOCK_N)
    _stamp(Stamps, 7, seq_len)


@gluon.jit
def _probe_consumer(Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block,
                    seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                    scale_log2, Stamps):
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
    _stamp(Stamps, 1, seq_len)
    m_i = gl.full([WIDE_HEADS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_tile = gl.zeros([WIDE_HEADS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([WIDE_HEADS, LATENT], gl.float32, o_layout)
    acc, m_i, l_tile = _wide_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty, 0, lo,
                                  seq_len, scale_log2, s_layout, o_layout, False)
    _stamp(Stamps, 2, gl.max(m_i, 0).to(gl.int32, bitcast=True))
    for tile in range(lo + 1, hi):
        acc, m_i, l_tile = _wide_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty,
                                      tile - lo, tile, seq_len, scale_log2, s_layout, o_layout, False)
    _stamp(Stamps, 3, gl.max(m_i, 0).to(gl.int32, bitcast=True))
    out, lse = finish_rows(acc, m_i, l_tile)
    _store_out(lat_smem, Out, Lse, out, lse, seq * 0, seq, head_block * WIDE_HEADS, num_heads - head_block * WIDE_HEADS,
               0, stride_ot, stride_oh, 0, stride_lt, stride_lh, True)  # O staged, as the default
    _stamp(Stamps, 4, seq_len)


@gluon.jit
def probe_kernel(lat_desc, rope_desc, Q, Block_table, Seq_lens, Out, Lse, Stamps, stride_qt, stride_qh, stride_table,
                 stride_ot, stride_oh, stride_lt, stride_lh, scale_log2, num_heads,
                 BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr):
    """The lockstep 64-head kernel for full tiles only (L a multiple of BLOCK_N), one split, with stamps."""
    LATENT: gl.constexpr = lat_desc.block_type.shape[1]
    ROPE: gl.constexpr = rope_desc.block_type.shape[1]
    dtype: gl.constexpr = lat_desc.dtype
    _stamp(Stamps, 0, gl.program_id(0))
    head_block = gl.program_id(0)
    seq = gl.program_id(1)
    seq_len, lo, hi = split_tiles(Seq_lens, seq, 0, 1, BLOCK_N)
    lat_smem, rope_smem = _ring(dtype, STAGES, BLOCK_N, LATENT), _ring(dtype, STAGES, BLOCK_N, ROPE)
    q_lat, q_rope = _tile(dtype, WIDE_HEADS, LATENT), _tile(dtype, WIDE_HEADS, ROPE)
    p_smem = _tile(dtype, WIDE_HEADS, BLOCK_N)
    ready, empty = ring_barriers(STAGES)
    table_row = Block_table + seq.to(gl.int64) * stride_table
    gl.warp_specialize([
        (_probe_consumer, (Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, head_block,
                           seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                           stride_lh, scale_log2, Stamps)),
        (_probe_producer, (lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, Stamps,
                           PAGE, BLOCK_N)),
    ], [1], [PRODUCER_REGS])


@gluon.jit
def _probe_consumer16(Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, split, seq_len, lo,
                      hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                      stride_lh, scale_log2, Stamps):
    """`gluon_mla._consumer` (16 heads, 4 warps, mma.sync) for full tiles, with stamps."""
    BLOCK_N: gl.constexpr = lat_smem.shape[1]
    LATENT: gl.constexpr = lat_smem.shape[2]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, NUM_WARPS], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    _stage_q(Q, q_lat, q_rope, seq, 0, num_heads, stride_qt, stride_qh, q_layout)
    _stamp(Stamps, 1, seq_len)
    m_i = gl.full([BLOCK_M16], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_tile = gl.zeros([BLOCK_M16, BLOCK_N], gl.float32, mma)
    acc = gl.zeros([BLOCK_M16, LATENT], gl.float32, mma)
    acc, m_i, l_tile = _attend_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty, 0, lo,
                                    seq_len, scale_log2, mma, False)
    _stamp(Stamps, 2, gl.max(m_i, 0).to(gl.int32, bitcast=True))
    for tile in range(lo + 1, hi):
        acc, m_i, l_tile = _attend_tile(acc, m_i, l_tile, q_lat, q_rope, lat_smem, rope_smem, p_smem, ready, empty,
                                        tile - lo, tile, seq_len, scale_log2, mma, False)
    _stamp(Stamps, 3, gl.max(m_i, 0).to(gl.int32, bitcast=True))
    out, lse = finish_rows(acc, m_i, l_tile)
    store_rows(Out, Lse, out, lse, split, seq, 0, num_heads, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
               stride_lh)
    _stamp(Stamps, 4, seq_len)


@gluon.jit
def probe16_kernel(lat_desc, rope_desc, Q, Block_table, Seq_lens, Out, Lse, Stamps, stride_qt, stride_qh,
                   stride_table, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, scale_log2,
                   num_heads, num_splits, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr):
    """The 16-head kernel for full tiles only (L a multiple of BLOCK_N), grid (1, batch, splits), with stamps."""
    LATENT: gl.constexpr = lat_desc.block_type.shape[1]
    ROPE: gl.constexpr = rope_desc.block_type.shape[1]
    dtype: gl.constexpr = lat_desc.dtype
    _stamp(Stamps, 0, gl.program_id(1))
    seq = gl.program_id(1)
    split = gl.program_id(2)
    seq_len, lo, hi = split_tiles(Seq_lens, seq, split, num_splits, BLOCK_N)
    lat_smem, rope_smem = _ring(dtype, STAGES, BLOCK_N, LATENT), _ring(dtype, STAGES, BLOCK_N, ROPE)
    q_lat, q_rope = _tile(dtype, BLOCK_M16, LATENT), _tile(dtype, BLOCK_M16, ROPE)
    p_smem = _tile(dtype, BLOCK_M16, BLOCK_N)
    ready, empty = ring_barriers(STAGES)
    table_row = Block_table + seq.to(gl.int64) * stride_table
    gl.warp_specialize([
        (_probe_consumer16, (Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, p_smem, ready, empty, seq, split,
                             seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_os, stride_ot, stride_oh,
                             stride_ls, stride_lt, stride_lh, scale_log2, Stamps)),
        (_probe_producer, (lat_desc, rope_desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, Stamps,
                           PAGE, BLOCK_N)),
    ], [1], [PRODUCER_REGS])


SEESAW_NAMES = ["start", "[0] Q", "[0] pair 1", "[0] last pair", "[0] stored", "producer start", "-",
                "producer done", "[1] Q", "[1] pair 1", "[1] last pair", "[1] stored"]


@gluon.jit
def _probe_seesaw_producer(desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, Stamps,
                           PAGE: gl.constexpr):
    _stamp(Stamps, 5, seq_len)
    _seesaw_producer(desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, PAGE)
    _stamp(Stamps, 7, seq_len)


@gluon.jit
def _probe_seesaw_consumer(half: gl.constexpr, Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty,
                           sync, seq, head_block, seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_ot,
                           stride_oh, stride_lt, stride_lh, scale_log2, Stamps):
    """`gluon_mla._seesaw_consumer` for whole pairs of full tiles (L a multiple of 128), one split, with stamps
    (warpgroup 0 in slots 1-4, warpgroup 1 in 8-11)."""
    LATENT: gl.constexpr = lat_smem.shape[2]
    BASE: gl.constexpr = 1 if half == 0 else 8
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, SEESAW_TILE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, LATENT // 2, 16])
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    first_head = head_block * WIDE_HEADS
    seesaw_stage_q(half, Q, q_lat, q_rope, sync, seq, first_head, num_heads, stride_qt, stride_qh)
    _stamp(Stamps, BASE, seq_len)
    m_i = gl.full([WIDE_HEADS], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([WIDE_HEADS], gl.float32, rows)
    acc = gl.zeros([WIDE_HEADS, LATENT // 2], gl.float32, o_layout)
    pairs = (hi - lo) // 2
    acc, m_i, l_i = _seesaw_pair(half, acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty, sync,
                                 lo - lo, lo, seq_len, scale_log2, s_layout, o_layout, p_operand, False, True)
    _stamp(Stamps, BASE + 1, gl.max(m_i, 0).to(gl.int32, bitcast=True))
    for k in range(1, pairs):
        acc, m_i, l_i = _seesaw_pair(half, acc, m_i, l_i, q_lat, q_rope, lat_smem, rope_smem, xchg, ready, empty,
                                     sync, k, lo + 2 * k, seq_len, scale_log2, s_layout, o_layout, p_operand, False,
                                     True)
    _stamp(Stamps, BASE + 2, gl.max(m_i, 0).to(gl.int32, bitcast=True))
    xchg[2 + half].store(l_i)
    _publish(sync, SYNC_L, False)
    mbarrier.wait(sync.index(SYNC_L), 0)
    l_total = xchg[2].load(rows) + xchg[3].load(rows)
    out, lse = finish_row_sums(acc, m_i, l_total)
    _store_out(lat_smem.index(half), Out + half * (LATENT // 2), Lse, out, lse, seq * 0, seq, first_head,
               num_heads - first_head, 0, stride_ot, stride_oh, 0, stride_lt, stride_lh, True)
    _stamp(Stamps, BASE + 3, seq_len)


@gluon.jit
def probe_seesaw_kernel(desc, Q, Block_table, Seq_lens, Out, Lse, Stamps, stride_qt, stride_qh, stride_table,
                        stride_ot, stride_oh, stride_lt, stride_lh, scale_log2, num_heads, LATENT: gl.constexpr,
                        PAGE: gl.constexpr):
    """The seesaw 64-head kernel (`gluon_mla._seesaw_kernel`'s buffers) with stamps; desc: 64-column boxes."""
    _stamp(Stamps, 0, gl.program_id(0))
    head_block = gl.program_id(0)
    seq = gl.program_id(1)
    seq_len, lo, hi = split_tiles(Seq_lens, seq, 0, 1, SEESAW_TILE)
    lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty, sync = seesaw_buffers(desc.dtype, LATENT)
    table_row = Block_table + seq.to(gl.int64) * stride_table
    gl.warp_specialize([
        (_probe_seesaw_consumer, (0, Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty, sync, seq,
                                  head_block, seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                                  stride_lt, stride_lh, scale_log2, Stamps)),
        (_probe_seesaw_consumer, (1, Q, Out, Lse, lat_smem, rope_smem, q_lat, q_rope, xchg, ready, empty, sync, seq,
                                  head_block, seq_len, lo, hi, num_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                                  stride_lt, stride_lh, scale_log2, Stamps)),
        (_probe_seesaw_producer, (desc, lat_smem, rope_smem, ready, empty, table_row, seq_len, lo, hi, Stamps, PAGE)),
    ], [4, 1], [SEESAW_REGS, PRODUCER_REGS])


def report(label: str, stamps: torch.Tensor) -> None:
    """Each phase's median over programs (µs from the first program's start) and the spread of the late ones."""
    stamps = stamps[:, :len(NAMES)]
    rel = (stamps - stamps[:, 0].min()).double() / 1e3
    medians = rel.median(0).values.tolist()
    spans = (stamps[:, 4] - stamps[:, 0]).double() / 1e3
    print(f"{label}: {stamps.shape[0]} programs, span median {spans.median():.1f} µs, max {spans.max():.1f}; "
          f"latest store {rel[:, 4].max():.1f} µs after the first start", flush=True)
    print("   " + "  ".join(f"{n} {m:.1f}" for n, m in zip(NAMES, medians)), flush=True)
    for slot in (0, 2, 3, 4):
        q = torch.quantile(rel[:, slot].cpu(), torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
        print(f"   {NAMES[slot]:>10}: min {q[0]:.1f} p10 {q[1]:.1f} p50 {q[2]:.1f} p90 {q[3]:.1f} max {q[4]:.1f}",
              flush=True)


def run16(batch: int, length: int, heads: int = 16) -> None:
    """The 16-head kernel at the split heuristic's count for this shape (its partials; no combine)."""
    q = torch.randn(batch, heads, ROW_DIM, dtype=torch.bfloat16, device="cuda")
    latent = torch.randn(batch, length, ROW_DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    pool, table = latent_pool(latent, 64)
    del latent
    splits = explain_mla(q, pool, table, lens, v_head_dim=LATENT_DIM, softmax_scale=SOFTMAX_SCALE).num_splits
    out = torch.empty(splits, batch, heads, LATENT_DIM, dtype=torch.float32, device="cuda")
    lse = torch.empty(splits, batch, heads, dtype=torch.float32, device="cuda")
    stamps = torch.zeros(batch * splits, 16, dtype=torch.int64, device="cuda")
    for _ in range(3):  # the last launch's stamps (the first compiles and warms)
        stamps.zero_()
        probe16_kernel[(1, batch, splits)](
            cache_descriptor(pool, 64, LATENT_DIM), cache_descriptor(pool, 64, 64), q, table, lens, out, lse, stamps,
            q.stride(0), q.stride(1), table.stride(0), out.stride(0), out.stride(1), out.stride(2), lse.stride(0),
            lse.stride(1), lse.stride(2), SOFTMAX_SCALE * math.log2(math.e), heads, splits,
            BLOCK_N=64, PAGE=64, STAGES=2, num_warps=4)
        torch.cuda.synchronize()
    report(f"H16 B{batch} L{length} splits {splits}", stamps)


def run_wide(batch: int, length: int, seesaw: bool, heads: int = 128) -> None:
    """A 64-head kernel (lockstep, or the seesaw: L a multiple of 128), one split: its output against float64, then
    each phase's median over programs."""
    q = torch.randn(batch, heads, ROW_DIM, dtype=torch.bfloat16, device="cuda")
    latent = torch.randn(batch, length, ROW_DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    pool, table = latent_pool(latent, 64)
    out = torch.empty(batch, heads, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
    grid = (math.ceil(heads / 64), batch)
    stamps = torch.zeros(grid[0] * grid[1], 16, dtype=torch.int64, device="cuda")
    rest = (q, table, lens, out, lse, stamps, q.stride(0), q.stride(1), table.stride(0), out.stride(0), out.stride(1),
            lse.stride(0), lse.stride(1), SOFTMAX_SCALE * math.log2(math.e), heads)
    for _ in range(3):  # the last launch's stamps (the first compiles and warms)
        stamps.zero_()
        if seesaw:
            probe_seesaw_kernel[grid](cache_descriptor(pool, 64, 64), *rest, LATENT=LATENT_DIM, PAGE=64, num_warps=4)
        else:
            probe_kernel[grid](cache_descriptor(pool, 64, LATENT_DIM), cache_descriptor(pool, 64, 64), *rest,
                               BLOCK_N=64, PAGE=64, STAGES=2, num_warps=8)
        torch.cuda.synchronize()
    label = f"{'seesaw' if seesaw else 'lockstep'} B{batch} L{length}"
    check_against_reference(q, latent, out, label)
    names, stored = (SEESAW_NAMES, [4, 11]) if seesaw else (NAMES, [4])
    rel = (stamps[:, :len(names)] - stamps[:, 0].min()).double() / 1e3  # µs from the first program's start
    medians = rel.median(0).values.tolist()
    print(f"{label}: latest store {rel[:, stored].max():.1f} µs after the first start; medians:", flush=True)
    print("   " + "  ".join(f"{n} {m:.1f}" for n, m in zip(names, medians) if n != "-"), flush=True)


def check_against_reference(q, latent, out, label: str) -> None:
    """The first sequence's output against the absorbed attention in float64 (a probe that computes garbage
    times nothing)."""
    lat = latent[0].double()
    scores = (q[0].double() @ lat.T) * SOFTMAX_SCALE
    want = torch.softmax(scores, -1) @ lat[:, :LATENT_DIM]
    err = ((out[0].double() - want).norm() / want.norm()).item()
    print(f"{label}: relative error {err:.2e} against float64", flush=True)
    if not err < 1e-2:
        raise SystemExit(f"{label}: the probe kernel is wrong (relative error {err:.2e})")


if __name__ == "__main__":
    which = sys.argv[1:] or ["128", "16"]
    if "128" in which:
        for batch, length in ((1, 64), (1, 1024), (64, 64), (64, 1024)):
            run_wide(batch, length, seesaw=False)
    if "seesaw" in which:
        for batch, length in ((1, 128), (1, 1024), (64, 128), (64, 1024), (64, 4096)):
            run_wide(batch, length, seesaw=True)
    if "16" in which:
        for batch, length in ((64, 1024), (8, 8192), (1, 65536), (32, 4096), (128, 1024)):
            run16(batch, length)
