"""`ioattn bench decode --mla`: MLA (DeepSeek-V3) decode over a paged latent cache beside torch, one run.

Multi-head latent attention decode by ioattn's kernel, beside the best torch-only absorbed MLA decode on the same
inputs, against the copy and matmul ceilings measured in the same run.

Shapes: DeepSeek-V3 decode with W_UK already absorbed into the query, W_UV left for after attention. Each cached
token is one latent row of 576 = 512 (the compressed c, `v_head_dim`) + 64 (the rotary key) values shared by all
heads; q (B, H, 576) holds one query token per sequence; out (B, H, 512) = softmax(scale · q @ rowsᵀ) @ rows[:, :512]
with scale = 192^-0.5 (V3's qk_head_dim 128 + 64, YaRN's mscale left out). H = 128 (TP 1) and 16 (as per GPU at TP 8).

Counting (MEASURING.md: count first):
- bytes = B·L·576·itemsize (each latent row read once: V is its first 512 columns, read with K) plus
  B·H·(576 + 512)·itemsize (query read, output written); the block table (4 bytes per block) is left out.
- FLOPs = 2·B·H·L·(576 + 512): q·rowsᵀ over 576 columns, then P·V over 512.
- intensity = FLOPs / bytes ≈ 2·H·1088 / (576·itemsize) ≈ 1.9·H FLOP/byte at bf16: 30 at 16 heads
  (memory-bound), 242 at 128 heads, past the H200's ridge (~700 TFLOP/s / 4.3 TB/s ≈ 165, ~88 heads): compute-bound.
So every row reports both: GB/s and its % of the device-copy ceiling, TFLOP/s and its % of the bf16 matmul
(8192³) ceiling, both measured in this run by `harness.measure_ceilings`. A copy counts bytes read + written, so
reads alone may pass 100%.

Rows per case (B sequences of L cached tokens each):
- `ioattn-mla`: `ioattn.ops.mla.mla_paged_attention` (backend `--mla-backend`, default triton) over a pool of
  `--block-size` (64) token blocks in shuffled order; `used` quotes `explain_mla`'s plan.
- `torch-absorbed-sdpa`: the same rows gathered from the pool into a contiguous (B, 1, L, 576) copy outside timing,
  k = that copy, v = k[..., :512] (a view); the fastest correct of torch SDPA's backends forced one at a time
  (FLASH, EFFICIENT, CUDNN, MATH) in three layouts: `gqa` (q (B, H, 1, 576), enable_gqa=True), `broadcast` (K/V
  expanded to H heads by a stride-0 view) and `heads-as-queries` (q (B, 1, H, 576): decode has no mask, so MQA over
  H heads is one head with H queries). Every attempt's µs or refusal is in extra.attempts and in the report; MATH
  is run in `heads-as-queries` only (the other two make it repeat K/V for every head, H times the cache).
- `torch-absorbed-matmul`: on the same contiguous copy, scores = (scale·q) @ kᵀ by bmm, softmax in float32, cast
  back, @ v by bmm (the scale folded into the B·H·576 query, not into the B·H·L scores).

Timing as `ioattn bench decode` (the harness's `capture_graph`, `layer_count`, `layer_copies`): each backend in a
CUDA graph over `layers` distinct copies of the cache (up to `--layers` within `--layers-gib`), µs per layer. Outputs are
filled with NaN after capture (and ioattn's out buffer before it), so an output the timed runs never wrote reads
as error inf. Error: ‖out − ref‖_F / ‖ref‖_F on the first sequence against float64 `attention_ref`.

Bars (the issue's), per ok row of a case they cover, summarised for every backend: ≥ 85% of the copy ceiling at
16 heads wherever B·L ≥ 64k; ≥ 60% of the matmul ceiling at 128 heads, B ≥ 64.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ioattn.bench import harness
from ioattn.bench.harness import Row, block_table, capture_graph, layer_copies, layer_count
from ioattn.ops.mla import candidate_configs, explain_mla, mla_paged_attention, mla_workspace
from ioattn.reference import TOLERANCE, attention_ref, rel_error

LATENT_DIM = 512  # kv_lora_rank: the value part of a latent row
ROPE_DIM = 64
ROW_DIM = LATENT_DIM + ROPE_DIM
SOFTMAX_SCALE = (128 + ROPE_DIM) ** -0.5  # DeepSeek-V3's qk_head_dim, as the expanded form scales
BACKENDS = ("ioattn-mla", "torch-absorbed-sdpa", "torch-absorbed-matmul")
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
SDPA_LAYOUTS = ("gqa", "broadcast", "heads-as-queries")
CASE_COLUMNS = [("H", "H"), ("B", "B"), ("L", "L")]


@dataclass(frozen=True)
class Case:
    dtype: str
    batch: int
    heads: int
    seqlen: int

    def label(self) -> str:
        return f"H{self.heads} B{self.batch} L{self.seqlen} {self.dtype}"

    def columns(self) -> dict[str, Any]:
        return {"H": self.heads, "B": self.batch, "L": self.seqlen, "dtype": self.dtype}

    @property
    def itemsize(self) -> int:
        return harness.parse_dtype(self.dtype).itemsize

    @property
    def kv_bytes(self) -> int:
        """The latent cache's bytes (what `layer_count` budgets): B·L·576·itemsize."""
        return self.batch * self.seqlen * ROW_DIM * self.itemsize

    @property
    def bytes(self) -> int:
        """Bytes that must move: the cache once, the query read, the output written."""
        return self.kv_bytes + self.batch * self.heads * (ROW_DIM + LATENT_DIM) * self.itemsize

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.heads * self.seqlen * (ROW_DIM + LATENT_DIM)


@dataclass(frozen=True)
class Bar:
    ceiling: str  # "copy" (row.ceiling_pct) or "matmul" (row.extra["matmul_pct"])
    pct: float
    where: str
    applies: Callable[[dict[str, Any]], bool]


BARS = (
    Bar("copy", 85.0, "16 heads, B·L ≥ 64k", lambda c: c["H"] == 16 and c["B"] * c["L"] >= 65536),
    Bar("matmul", 60.0, "128 heads, B ≥ 64", lambda c: c["H"] == 128 and c["B"] >= 64),
)


def _ceiling_pct(row: Row, ceiling: str) -> float | None:
    return row.ceiling_pct if ceiling == "copy" else row.extra.get("matmul_pct")


def bar_verdict(row: Row) -> str | None:
    """"met …" / "missed …" for an ok row of a case a bar covers, None where no bar applies."""
    for bar in BARS:
        if row.status == "ok" and bar.applies(row.case):
            pct = _ceiling_pct(row, bar.ceiling)
            if pct is None:
                return f"no {bar.ceiling} ceiling measured"
            return f"{'met' if pct >= bar.pct else 'missed'} (≥ {bar.pct:g}% {bar.ceiling})"
    return None


def bar_lines(rows: list[Row]) -> list[str]:
    """One line per bar: for each backend, on how many of the covered cases it met the bar, and its misses."""
    lines = []
    for bar in BARS:
        covered = [r for r in rows if r.status == "ok" and bar.applies(r.case)]
        if not covered:
            lines.append(f"Bar ≥ {bar.pct:g}% of {bar.ceiling} at {bar.where}: no case measured.")
            continue
        parts = []
        for backend in dict.fromkeys(r.backend for r in covered):
            mine = [r for r in covered if r.backend == backend]
            missed = [r for r in mine if not (bar_verdict(r) or "").startswith("met")]
            detail = "; ".join(f"H{r.case['H']} B{r.case['B']} L{r.case['L']} "
                               f"{harness.fmt(_ceiling_pct(r, bar.ceiling))}%" for r in missed)
            parts.append(f"{backend} met {len(mine) - len(missed)}/{len(mine)}" + (f" (missed: {detail})" if missed
                                                                                   else ""))
        lines.append(f"Bar ≥ {bar.pct:g}% of {bar.ceiling} at {bar.where}: " + "; ".join(parts) + ".")
    return lines


# --- inputs and backends ------------------------------------------------------------------------------------


def latent_pool(latent: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense latent rows (B, L, 576) written into a pool of B·L/block blocks in shuffled order:
    (latent_cache (num_blocks, block, 1, 576), block_table (B, L/block) int32)."""
    batch, length, dim = latent.shape
    table = block_table(batch, length // block, True, latent.device)
    pool = torch.empty(batch * length // block, block, 1, dim, dtype=latent.dtype, device=latent.device)
    pool[table.view(-1).long()] = latent.view(-1, block, 1, dim)
    return pool, table


def ioattn_runner(q, pool, table, lens, args, layers: int, config=None, num_splits=None, dependent_combine=None):
    """(forward, out, plan): forward() runs mla_paged_attention over `layers` copies of the pool into `out`
    (dependent_combine as mla_paged_attention takes it)."""
    kwargs = dict(v_head_dim=LATENT_DIM, softmax_scale=SOFTMAX_SCALE, backend=args.mla_backend, config=config,
                  num_splits=args.num_splits if num_splits is None else num_splits,
                  dependent_combine=dependent_combine)
    plan = explain_mla(q, pool, table, lens, **kwargs)
    splits = getattr(plan, "num_splits", 0)
    workspace = mla_workspace(q.shape[0], q.shape[1], LATENT_DIM, **({"max_splits": splits} if splits else {}),
                              device=q.device)
    out = torch.full((*q.shape[:2], LATENT_DIM), float("nan"), dtype=q.dtype, device=q.device)
    pools = layer_copies((pool,), layers)

    def forward():
        for (layer_pool,) in pools:
            mla_paged_attention(q, layer_pool, table, lens, out=out, workspace=workspace, **kwargs)
        return out

    return forward, out, plan


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, layout: str) -> torch.Tensor:
    """Absorbed MLA decode by torch SDPA: q (B, H, 576), k (B, 1, L, 576) -> (B, H, 512), v = k[..., :512]."""
    v = k[..., :LATENT_DIM]
    if layout == "heads-as-queries":
        return F.scaled_dot_product_attention(q[:, None], k, v, scale=SOFTMAX_SCALE)[:, 0]
    if layout == "broadcast":
        batch, heads, length = q.shape[0], q.shape[1], k.shape[2]
        k, v = k.expand(batch, heads, length, ROW_DIM), v.expand(batch, heads, length, LATENT_DIM)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=SOFTMAX_SCALE)[:, :, 0]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=SOFTMAX_SCALE, enable_gqa=True)[:, :, 0]


def matmul_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Absorbed MLA decode by two bmm: q (B, H, 576), k (B, 1, L, 576) -> (B, H, 512), softmax in float32."""
    rows = k[:, 0]
    scores = torch.bmm(q * SOFTMAX_SCALE, rows.transpose(1, 2))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, rows[..., :LATENT_DIM])


def _time(forward: Callable[[], torch.Tensor], ref: torch.Tensor, args, layers: int) -> dict[str, Any]:
    """µs per layer of `forward` (all layers, graph-captured when it allows) and the error of its output."""
    holder: dict[str, torch.Tensor] = {}

    def run():
        holder["out"] = forward()
        return holder["out"]

    graphed, how = capture_graph(run, args.device)
    if "out" in holder:  # written by the capture's warm-up: poison it, so only the timed replays can fix it
        holder["out"].fill_(float("nan"))
    ms = harness.time_ms(graphed, args.device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms).ms / layers
    return {"ms": ms, "how": how if layers == 1 else f"{how} of {layers} layers",
            "error": rel_error(holder["out"][0], ref)}


def _row(case: Case, name: str, result: dict[str, Any], used: str, ceilings: dict[str, Any], extra=None) -> Row:
    """An ok row from a `_time` result: µs, GB/s and % copy, TFLOP/s and % matmul, the bar verdict."""
    copy_tbps = ceilings.get("copy_tbps")
    matmul = ceilings.get("matmul_tflops", {}).get(case.dtype)
    row = Row(case.columns(), name, used=f"{used}, {result['how']}", ms=result["ms"], error=result["error"],
              extra=dict(extra or {}))
    row.rate = case.bytes / (row.ms * 1e-3) / 1e9
    row.ceiling_pct = 100.0 * row.rate / (copy_tbps * 1e3) if copy_tbps else None
    tflops = harness.tflops(case.flops, row.ms)
    row.extra.update(bytes=case.bytes, flops=case.flops, tflops=tflops,
                     matmul_pct=100.0 * tflops / matmul if matmul else None)
    row.extra["bar"] = bar_verdict(row)
    return row


def _failed(case: Case, name: str, status: str) -> Row:
    return Row(case.columns(), name, status=status)


def best_sdpa(case: Case, q, caches, ref, args, layers: int, ceilings) -> Row:
    """Every SDPA backend x layout that runs, timed; the row of the fastest correct one (else the fastest)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attempts: dict[str, str] = {}
    timed: list[tuple[dict[str, Any], str]] = []
    for backend in SDPA_BACKENDS:
        for layout in SDPA_LAYOUTS:
            key = f"{backend} {layout}"
            if backend == "MATH" and layout != "heads-as-queries":
                attempts[key] = "skipped: MATH repeats K/V for every head (H times the cache)"
                continue

            def forward(backend=backend, layout=layout):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    for (k,) in caches:
                        out = sdpa_attention(q, k, layout)
                return out

            result: dict[str, Any] = {}
            status = harness.guarded(lambda forward=forward, result=result: result.update(
                _time(forward, ref, args, layers)), ours=False)
            if status == "ok":
                timed.append((result, key))
                status = f"{result['ms'] * 1e3:.1f} µs, error {result['error']:.1e}"
            attempts[key] = status
    if not timed:
        return Row(case.columns(), "torch-absorbed-sdpa", status="unsupported: no SDPA backend ran",
                   extra={"attempts": attempts})
    correct = [t for t in timed if t[0]["error"] <= TOLERANCE[q.dtype]] or timed
    result, key = min(correct, key=lambda t: t[0]["ms"])
    backend, layout = key.split()
    return _row(case, "torch-absorbed-sdpa", result, f"SDPA {backend} (forced), {layout}", ceilings,
                {"sdpa_backend": backend, "layout": layout, "attempts": attempts, "layers": layers})


def tune(case: Case, q, pool, table, lens, ref, args, layers: int) -> list[dict[str, Any]]:
    """Every `candidate_configs` entry at the heuristic's split count and at 1, 2x and half of it: the five
    fastest correct ones, fastest first (for the defaults in ioattn/ops/mla.py)."""
    default_splits = explain_mla(q, pool, table, lens, v_head_dim=LATENT_DIM, backend=args.mla_backend).num_splits
    trials = []
    for config in candidate_configs(case.heads, decode=True):
        for splits in sorted({1, default_splits, max(1, default_splits // 2), min(64, 2 * default_splits)}):
            result: dict[str, Any] = {}

            def work(config=config, splits=splits, result=result):
                forward, _, _ = ioattn_runner(q, pool, table, lens, args, layers, config, splits)
                result.update(_time(forward, ref, args, layers))

            if harness.guarded(work, ours=True) == "ok" and result["error"] <= TOLERANCE[q.dtype]:
                trials.append({"config": dataclasses.asdict(config), "splits": splits, "us": result["ms"] * 1e3})
    return sorted(trials, key=lambda t: t["us"])[:5]


def run_case(case: Case, args, ceilings: dict[str, Any]) -> list[Row]:
    device, dtype = args.device, harness.parse_dtype(case.dtype)
    if case.kv_bytes > args.max_kv_gib * 2**30:
        return [_failed(case, name, f"skipped: latent cache needs {case.kv_bytes / 2**30:.1f} GiB > --max-kv-gib "
                                    f"{args.max_kv_gib:g}") for name in args.backends]
    if case.seqlen % args.block_size:
        return [_failed(case, name, f"skipped: L {case.seqlen} is not a multiple of --block-size "
                                    f"{args.block_size}") for name in args.backends]
    q = torch.randn(case.batch, case.heads, ROW_DIM, dtype=dtype, device=device)
    latent = torch.randn(case.batch, case.seqlen, ROW_DIM, dtype=dtype, device=device)
    lens = torch.full((case.batch,), case.seqlen, dtype=torch.int32, device=device)
    first = latent[:1, :, None]
    ref = attention_ref(q[:1, None], first, first[..., :LATENT_DIM], softmax_scale=SOFTMAX_SCALE)[0][0, 0]
    pool, table = latent_pool(latent, args.block_size)
    del latent, first  # the pool holds the rows now; the peers gather their copy from it
    layers = layer_count(case, args)
    rows: list[Row] = []

    if "ioattn-mla" in args.backends:
        result: dict[str, Any] = {}
        holder: dict[str, Any] = {}

        def work():
            forward, _, plan = ioattn_runner(q, pool, table, lens, args, layers)
            holder["plan"] = plan
            result.update(_time(forward, ref, args, layers))

        status = harness.guarded(work, ours=True)
        plan = holder.get("plan")
        extra = {"splits": getattr(plan, "num_splits", None), "block_size": args.block_size, "layers": layers,
                 "mla_backend": args.mla_backend}
        if args.tune and status == "ok":
            extra["tune"] = tune(case, q, pool, table, lens, ref, args, layers)
        rows.append(_row(case, "ioattn-mla", result, f"mla_paged_attention block {args.block_size}: {plan}",
                         ceilings, extra) if status == "ok" else _failed(case, "ioattn-mla", status))

    peers = [n for n in args.backends if n != "ioattn-mla"]
    if peers:
        contiguous = pool[table.long()].view(case.batch, 1, case.seqlen, ROW_DIM)  # the gather, outside timing
        del pool
        caches = layer_copies((contiguous,), layers)
        if "torch-absorbed-sdpa" in peers:
            rows.append(best_sdpa(case, q, caches, ref, args, layers, ceilings))
        if "torch-absorbed-matmul" in peers:
            def forward():
                for (k,) in caches:
                    out = matmul_attention(q, k)
                return out

            result = {}
            status = harness.guarded(lambda: result.update(_time(forward, ref, args, layers)), ours=False)
            rows.append(_row(case, "torch-absorbed-matmul", result, "bmm, softmax float32, bmm", ceilings,
                             {"layers": layers}) if status == "ok" else
                        _failed(case, "torch-absorbed-matmul", status))
    return rows


# --- report -------------------------------------------------------------------------------------------------


def _attempt_lines(rows: list[Row]) -> list[str]:
    """Per SDPA backend x layout: on how many cases it ran, and the distinct reasons it did not."""
    seen: dict[str, dict[str, Any]] = {}
    for row in rows:
        for key, status in row.extra.get("attempts", {}).items():
            entry = seen.setdefault(key, {"ran": 0, "cases": 0, "reasons": {}})
            entry["cases"] += 1
            if "µs" in status:
                entry["ran"] += 1
            else:
                entry["reasons"][status] = None
    lines = []
    for key, entry in seen.items():
        reasons = list(entry["reasons"])[:2]  # the first two distinct: the rest differ in shapes only
        lines.append(f"- {key}: ran on {entry['ran']}/{entry['cases']} cases" + "".join(f"; {r}" for r in reasons))
    return lines


def render_markdown(meta: dict[str, Any], rows: list[Row]) -> str:
    body = []
    for row in rows:
        cells = [row.case[k] for _, k in CASE_COLUMNS] + [row.backend]
        if row.status == "ok":
            cells += [row.ms * 1e3, row.rate, row.ceiling_pct, row.extra["tflops"], row.extra["matmul_pct"],
                      row.error, row.extra.get("bar"), row.used]
        else:
            cells += [None] * 7 + [row.status]
        body.append(cells)
    header = [h for h, _ in CASE_COLUMNS] + ["backend", "µs", "GB/s", "% copy", "TFLOP/s", "% matmul", "error",
                                             "bar", "used"]
    parts = ["# ioattn bench decode --mla", "", harness.disclosure_markdown(meta), "",
             harness.markdown_table(header, body), "", *bar_lines(rows), "",
             "Ratios of rate (ours / peer; equal bytes, so the inverse ratio of times):", "",
             harness.ratio_table(rows, CASE_COLUMNS, "ioattn-mla", ["torch-absorbed-sdpa", "torch-absorbed-matmul"])]
    attempts = _attempt_lines(rows)
    if attempts:
        parts += ["", "SDPA attempts (forced backend, layout):", "", *attempts]
    return "\n".join(parts) + "\n"


# --- command line -------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ioattn bench decode --mla", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few small rows (runs on the CPU too)")
    p.add_argument("--heads", type=harness.int_list, help="query heads (default 16,128)")
    p.add_argument("--batches", type=harness.int_list, help="B values (default 1,8,32,64,128)")
    p.add_argument("--seqlens", type=harness.int_list, help="L values (default 1024,4096,8192,32768)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per block of the latent pool")
    p.add_argument("--dtype", help="bfloat16 (CUDA default) / float16 / float32 (CPU default)")
    p.add_argument("--backends", type=harness.name_list(BACKENDS), help=f"any of {', '.join(BACKENDS)}")
    p.add_argument("--mla-backend", default="triton", choices=("auto", "triton", "torch"),
                   help="mla_paged_attention's backend for the ioattn-mla row")
    p.add_argument("--num-splits", type=int, default=0, help="split count for ioattn-mla (0: its heuristic)")
    p.add_argument("--tune", action="store_true", help="also time every candidate config (Triton; the Gluon decode "
                                                      "on sm_90) and a few split counts for ioattn-mla (extra.tune: "
                                                      "the five fastest)")
    p.add_argument("--max-kv-gib", type=float, default=60.0, help="skip cases whose latent cache exceeds this")
    p.add_argument("--layers", type=int, help="distinct caches run back to back in one timed graph (default 32 on "
                                              "CUDA, 1 on the CPU)")
    p.add_argument("--layers-gib", type=float, default=8.0, help="memory all layers' caches may take")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    harness.add_run_args(p, budget_s=480.0, out_help="directory for <date>-decode-mla-<device>.{json,md}")
    args = p.parse_args(argv)
    args.device = harness.default_device(args.device)
    cuda = args.device.startswith("cuda")
    if args.quick:
        defaults = dict(heads=[16, 128], batches=[1, 64], seqlens=[4096]) if cuda else \
            dict(heads=[16], batches=[1, 2], seqlens=[2 * args.block_size])
    else:
        defaults = dict(heads=[16, 128], batches=[1, 8, 32, 64, 128], seqlens=[1024, 4096, 8192, 32768])
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = harness.dtype_name(harness.parse_dtype(args.dtype or ("bfloat16" if cuda else "float32")))
    args.backends = args.backends or list(BACKENDS)
    args.layers = (32 if cuda else 1) if args.layers is None else args.layers
    if args.layers < 1 or args.block_size < 1:
        p.error("--layers and --block-size must be >= 1")
    if not cuda and args.quick:
        args.warmup_ms, args.rep_ms = min(args.warmup_ms, 1.0), min(args.rep_ms, 1.0)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    started = time.monotonic()
    cases = [Case(args.dtype, b, h, n) for h in args.heads for n in args.seqlens for b in args.batches]
    print(f"ioattn bench decode --mla: {len(cases)} cases × {len(args.backends)} backends on {args.device}",
          flush=True)
    meta: dict[str, Any] = {
        "disclosure": harness.collect_disclosure(args.device, " ".join(["ioattn bench decode --mla", *argv])),
        "ceilings": harness.measure_ceilings(args.device, [harness.parse_dtype(args.dtype)]),
        "settings": {
            "backends": args.backends, "dtype": args.dtype, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "shape": f"latent {LATENT_DIM} + rope {ROPE_DIM} = {ROW_DIM} per token, one latent head; "
                     f"softmax scale 192^-0.5",
            "paged": f"ioattn-mla: block {args.block_size}, blocks shuffled through the pool, backend "
                     f"{args.mla_backend}; torch peers: contiguous (B, 1, L, {ROW_DIM}) copy gathered outside timing",
            "rate": f"GB/s of B·L·{ROW_DIM}·itemsize + B·H·({ROW_DIM} + {LATENT_DIM})·itemsize; "
                    f"extra.tflops of 2·B·H·L·({ROW_DIM} + {LATENT_DIM})",
            "error": "first sequence vs float64 attention_ref; outputs poisoned with NaN before the timed runs",
            "layers": f"per-layer time in a CUDA graph over distinct cache copies, up to {args.layers} layers "
                      f"within {args.layers_gib:g} GiB (see `used`)",
        },
    }
    print(harness.disclosure_markdown(meta), flush=True)
    rows = harness.sweep(
        cases, lambda case: run_case(case, args, meta["ceilings"]),
        lambda row: (f"{row.ms * 1e3:10.1f} µs {row.rate:8.1f} GB/s {row.ceiling_pct or 0:5.1f}% "
                     f"{row.extra['tflops']:7.1f} TFLOP/s {row.extra['matmul_pct'] or 0:5.1f}% "
                     f"err {row.error:.1e} {row.extra['bar'] or ''}"),
        started=started, budget_s=args.budget_s, meta=meta, device=args.device)
    report = render_markdown(meta, rows)
    print(report, flush=True)
    harness.write_outputs(args, "decode-mla", meta, rows, report)
    return 0
