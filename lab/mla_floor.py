"""Where the 16-head MLA decode's time goes at W2 7/7's smallest bar rows (B·L = 64k tokens, 75 MB of latent),
beside what any kernel reaching those bytes gets at that size on this card.

Per shape, µs per layer in one CUDA graph over the same distinct layer caches as `ioattn bench decode --mla`:
- `full`: the default call (split kernel, then the combine);
- `split`: the split kernel alone, `combine`: the combine alone (over the partials the split kernel wrote);
- `read`: a Triton kernel that only sums the same pool's bytes, page by page in the block table's order (the best
  of 1, 4 or 8 pages per program; `read_storage`: in storage order; `read_boxes`: each page in the order of the
  MLA kernel's TMA boxes, 128 bytes of every row at a time), `copy`: torch's copy of the same bytes into another
  buffer (counted read + written);
- `launch`: an empty kernel, per launch (the graph's own cost per kernel).
Figures as % of the copy ceiling measured in the same run.

    PYTHONPATH=. python3 lab/mla_floor.py       # writes $OUT/mla-floor.json (CUDA, sm_90)
    MLA_FLOOR_SHAPES="64x1024 8x8192 1x65536 32x4096 128x1024 64x4096"
"""

from __future__ import annotations

import json
import math
import os

import torch
import triton
import triton.language as tl

from ioattn.bench import harness
from ioattn.bench.harness import capture_graph, layer_copies, layer_count
from ioattn.bench.mla import LATENT_DIM, ROW_DIM, SOFTMAX_SCALE, Case, latent_pool
from ioattn.ops.gluon_mla import launch_gluon_mla
from ioattn.ops.mla import explain_mla, mla_paged_attention, mla_workspace
from ioattn.ops.paged import combine_splits
from lab.fp8_tiles import run_setup

HEADS = 16
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get(
    "MLA_FLOOR_SHAPES", "64x1024 8x8192 1x65536 32x4096 128x1024 64x4096").split()]
READ_PAGES = (1, 4, 8)  # pages per program of the read kernel, the best one reported
READ_BLOCK = 2048  # int32 words per load step (8 KB); a 64-slot page of 576 bf16 values is 9 steps


@triton.jit
def _read_kernel(src, order, out, PAGE_WORDS: tl.constexpr, PAGES: tl.constexpr, BLOCK: tl.constexpr):
    """Sums (wrapping) the int32 words of PAGES pages, the program's entries of `order`, so that no load is
    elided: the latent pool's bytes read page by page in the block table's order (or in storage order)."""
    acc = tl.zeros([BLOCK], tl.int32)
    for k in range(PAGES):
        page = tl.load(order + tl.program_id(0) * PAGES + k).to(tl.int64)
        for step in range(0, PAGE_WORDS, BLOCK):
            acc += tl.load(src + page * PAGE_WORDS + step + tl.arange(0, BLOCK))
    tl.store(out + tl.program_id(0), tl.sum(acc))


@triton.jit
def _read_boxes_kernel(src, order, out, ROWS: tl.constexpr, ROW_WORDS: tl.constexpr, BOX_WORDS: tl.constexpr):
    """`_read_kernel` at one page per program, in the order the MLA kernel's TMA boxes take a page: 128 bytes
    of every row (a [ROWS, 64] box of 16-bit values at the row stride), then the next 128 bytes."""
    page = tl.load(order + tl.program_id(0)).to(tl.int64)
    rows = tl.arange(0, ROWS)[:, None] * ROW_WORDS + tl.arange(0, BOX_WORDS)[None, :]
    acc = tl.zeros([ROWS, BOX_WORDS], tl.int32)
    for box in tl.static_range(ROW_WORDS // BOX_WORDS):
        acc += tl.load(src + page * ROWS * ROW_WORDS + box * BOX_WORDS + rows)
    tl.store(out + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _empty_kernel(out):
    pass


def graph_us(body, layers: int, args) -> float:
    """µs per layer of `body()` (which runs every layer once) replayed from a CUDA graph."""
    graphed, how = capture_graph(body, args.device)
    assert how == "CUDA graph", how
    return harness.time_ms(graphed, args.device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms).ms * 1e3 / layers


def main() -> None:
    out_dir, args, result = run_setup("lab/mla_floor.py")
    ceilings = harness.measure_ceilings(args.device, [torch.bfloat16])
    copy_tbps = ceilings["copy_tbps"]
    result["disclosure"].update(copy_tbps=copy_tbps, matmul_tflops=ceilings["matmul_tflops"]["bfloat16"])
    print(f"copy ceiling {copy_tbps:.3f} TB/s", flush=True)
    sink = torch.zeros(1, device=args.device)
    result["launch_us"] = graph_us(lambda: [_empty_kernel[(1,)](sink) for _ in range(32)], 32, args)
    print(f"empty kernel {result['launch_us']:.2f} us per launch", flush=True)
    for batch, length in SHAPES:
        case = Case("bfloat16", batch, HEADS, length)
        q = torch.randn(batch, HEADS, ROW_DIM, dtype=torch.bfloat16, device=args.device)
        latent = torch.randn(batch, length, ROW_DIM, dtype=torch.bfloat16, device=args.device)
        lens = torch.full((batch,), length, dtype=torch.int32, device=args.device)
        pool, table = latent_pool(latent, 64)
        del latent
        layers = layer_count(case, args)
        pools = [p for (p,) in layer_copies((pool,), layers)]
        kwargs = dict(v_head_dim=LATENT_DIM, softmax_scale=SOFTMAX_SCALE)
        plan = explain_mla(q, pool, table, lens, **kwargs)
        splits, config = plan.num_splits, plan.config
        workspace = mla_workspace(batch, HEADS, LATENT_DIM, max_splits=max(splits, 1), device=args.device)
        out = torch.empty(batch, HEADS, LATENT_DIM, dtype=q.dtype, device=args.device)
        lse = torch.empty(batch, HEADS, dtype=torch.float32, device=args.device)
        part_out, part_lse = workspace.partial_out[:splits, :batch], workspace.partial_lse[:splits, :batch]
        if splits == 1:  # the kernel writes the output itself
            part_out, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
        row = {"B": batch, "L": length, "H": HEADS, "bytes": case.bytes, "kv_bytes": case.kv_bytes,
               "layers": layers, "splits": splits, "plan": str(plan)}

        def full():
            for layer_pool in pools:
                mla_paged_attention(q, layer_pool, table, lens, out=out, workspace=workspace, **kwargs)

        def split():
            for layer_pool in pools:
                launch_gluon_mla(q, layer_pool, table, lens, part_out, part_lse, LATENT_DIM, SOFTMAX_SCALE, splits,
                                 config, False)

        def combine():
            for _ in pools:
                combine_splits(part_out, part_lse, out, lse, False)

        row["full_us"] = graph_us(full, layers, args)
        if config.kernel == "gluon":
            row["split_us"] = graph_us(split, layers, args)
            if splits > 1:
                row["combine_us"] = graph_us(combine, layers, args)
        # the read floor over the same pools, page by page in the table's order and in storage order; the copy
        flat_pools = [layer_pool.view(torch.int32).view(-1) for layer_pool in pools]
        page_words = flat_pools[0].numel() // pool.shape[0]
        orders = {"table": table.reshape(-1).contiguous(),
                  "storage": torch.arange(pool.shape[0], dtype=torch.int32, device=args.device)}
        sums = torch.empty(pool.shape[0], dtype=torch.int32, device=args.device)
        for order_name, order in orders.items():
            best = None
            for pages in READ_PAGES:
                if pool.shape[0] % pages:
                    continue

                def read(order=order, pages=pages):
                    for flat in flat_pools:
                        _read_kernel[(pool.shape[0] // pages,)](flat, order, sums, PAGE_WORDS=page_words, PAGES=pages,
                                                                BLOCK=READ_BLOCK, num_warps=8)

                us = graph_us(read, layers, args)
                row[f"read_{order_name}_p{pages}_us"] = us
                best = us if best is None else min(best, us)
            row[f"read_{order_name}_us"] = best
        row["read_us"] = row["read_table_us"]

        def read_boxes():
            for flat in flat_pools:
                _read_boxes_kernel[(pool.shape[0],)](flat, orders["table"], sums, ROWS=pool.shape[1],
                                                     ROW_WORDS=page_words // pool.shape[1], BOX_WORDS=32, num_warps=8)

        row["read_boxes_us"] = graph_us(read_boxes, layers, args)
        flats = flat_pools[:16]
        dsts = [torch.empty_like(flat) for flat in flats]

        def copy():
            for flat, dst in zip(flats, dsts):
                dst.copy_(flat)

        row["copy_us"] = graph_us(copy, len(flats), args)
        for key in ("full", "split", "read", "read_storage", "read_boxes"):
            if f"{key}_us" in row:
                row[f"{key}_copy_pct"] = 100 * case.bytes / (row[f"{key}_us"] * 1e-6) / 1e12 / copy_tbps
        row["copy_copy_pct"] = 100 * 2 * case.kv_bytes / (row["copy_us"] * 1e-6) / 1e12 / copy_tbps
        result["rows"].append(row)
        print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                       if k != "plan"), flush=True)
        (out_dir / "mla-floor.json").write_text(json.dumps(result, indent=1) + "\n")
        del pools, pool, flat_pools, flats, dsts, workspace
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
