"""`ioattn bench decode`: decode attention over a paged KV cache against torch SDPA and FlexAttention, one run.

Per case (B sequences of L cached tokens, one new query token each, Hq/Hkv heads, D): ioattn's split-KV kernel
over a block-16 pool in shuffled order (`ioattn-paged`), the same kernel over the same bytes read as one
contiguous run per sequence (identity block table, block 256: `ioattn-contiguous`), torch SDPA forced to FLASH,
EFFICIENT and CUDNN (q (B, Hq, 1, D), `enable_gqa=True`) and FlexAttention (compiled per shape, dynamo reset per
shape), the last two on a contiguous (B, H, L, D) copy made outside timing. Rate: bytes of K and V read per
second (2·B·L·Hkv·D·itemsize / time) and its share of the device-copy ceiling measured in the same run.
Each backend is captured in a CUDA graph when it allows it (column `used`), so µs-scale rows time the GPU, not
Python's launch overhead. A graph runs the backend over `layers` distinct copies of the cache back to back, as a
model's decode step runs its layers (as many as fit in `--layers-gib`, at most `--layers`; 1 times a lone call);
µs is per layer. A lone call also pays the graph's launch (about 4 µs here, ~8% of a 50 µs row), which a model's
step pays once for all its layers. Error: ‖out − ref‖/‖ref‖ on the first sequence against float64
`attention_ref`.

Chunked prefill (`--prefill`, on by default on CUDA): 4k new tokens appended to a 4k paged context (Nq 4k,
Nk 8k, causal bottom-right) through `ioattn.paged_attention` (its default path, which gathers the context and
runs the dense forward for chunks this long, and the paged kernel forced with `gather=False`), against the dense
forward `ioattn.flash_attn_func` at the same shape; TFLOP/s by FlashAttention's count (4·B·Hq·Nq·Nk·D).

`--kv-cache-dtype fp8_e4m3` (or fp8_e5m2) adds `ioattn-paged-fp8`: the same kernel over the same block-16
shuffled pool of the same keys and values quantized to fp8 (per-KV-head scales from their amax, the engine's
calibration rule), beside bf16 ioattn and the peers on the bf16 cache. Its rate counts the bytes it reads, one
per element (2·B·L·Hkv·D), so TB/s compare memory traffic and "tokens/s" (B·L / time, context tokens read per
second) compares useful work; its `error` is against float64 attention on the dequantized cache (what the kernel
computes), `extra.error_vs_bf16` against the unquantized one (the quantization's own error, for a random cache).
The report adds fp8 / bf16 and fp8 / peer ratios, and the issue's bar where B·L >= 64k.

`--tune` also times every `candidate_configs` entry and a range of split counts for `ioattn-paged` (and
`ioattn-paged-fp8`), and records the fastest in the row's `extra` (for setting the defaults in ioattn/ops/paged.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ioattn.bench import harness
from ioattn.bench.harness import Row, block_table, capture_graph, layer_copies, layer_count
from ioattn.engine.kv_scales import HEADROOM as FP8_HEADROOM  # the engine's calibration rule
from ioattn.ops.fp8 import KV_CACHE_DTYPES, bytes_view, dequantize, quantize, scale_for_amax
from ioattn.ops.paged import candidate_configs, paged_attention, paged_workspace, plan_paged_attention
from ioattn.reference import TOLERANCE, attention_ref, rel_error

SDPA_PEERS = {"torch-flash": "FLASH_ATTENTION", "torch-efficient": "EFFICIENT_ATTENTION",
              "torch-cudnn": "CUDNN_ATTENTION"}
BACKENDS = ("ioattn-paged", "ioattn-contiguous", *SDPA_PEERS, "flex")
FP8_BACKEND = "ioattn-paged-fp8"  # with --kv-cache-dtype fp8_*
# The bar for the fp8 row, where B·L >= BAR_TOKENS: rate over bf16 ioattn-paged and over torch CUDNN.
BAR_TOKENS = 65536
BAR = {"ioattn-paged": 1.7, "torch-cudnn": 1.6}
PAGED_BLOCK = 16
CONTIGUOUS_BLOCK = 256  # the largest block the kernel takes: one table entry per 256 contiguous tokens
TUNE_SPLITS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 66, 96, 132)
CASE_COLUMNS = [("B", "B"), ("L", "L"), ("Hq/Hkv", "heads"), ("D", "D")]


@dataclass(frozen=True)
class Case:
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen: int
    head_dim: int

    def label(self) -> str:
        return f"B{self.batch} L{self.seqlen} {self.heads_q}/{self.heads_kv} D{self.head_dim} {self.dtype}"

    def columns(self) -> dict[str, Any]:
        return {"B": self.batch, "L": self.seqlen, "heads": f"{self.heads_q}/{self.heads_kv}", "D": self.head_dim,
                "dtype": self.dtype}

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_at(harness.parse_dtype(self.dtype).itemsize)

    def kv_bytes_at(self, itemsize: int) -> int:
        """Bytes of K and V read with `itemsize` bytes per element (1 for an fp8 cache)."""
        return 2 * self.batch * self.seqlen * self.heads_kv * self.head_dim * itemsize


def build_cases(args) -> list[Case]:
    cases = [Case(args.dtype, b, hq, hkv, n, args.head_dim)
             for hq, hkv in args.heads for n in args.seqlens for b in args.batches]
    cases += [Case(args.dtype, 1, hq, hkv, n, args.head_dim) for hq, hkv in args.heads for n in args.long_seqlens]
    return cases


# --- inputs -------------------------------------------------------------------------------------------------


def paged_pool(k: torch.Tensor, v: torch.Tensor, page: int, shuffled: bool):
    """Dense k/v (B, L, Hkv, D) written into a pool of B·L/page blocks of `page` tokens, sequence b's blocks at
    the entries of row b of the returned block table (shuffled through the pool, or in order):
    (k_cache, v_cache, block_table)."""
    batch, length, heads, dim = k.shape
    blocks = length // page
    table = block_table(batch, blocks, shuffled, k.device)
    k_cache = torch.empty(batch * blocks, page, heads, dim, dtype=k.dtype, device=k.device)
    v_cache = torch.empty_like(k_cache)
    k_cache[table.view(-1).long()] = k.reshape(batch * blocks, page, heads, dim)
    v_cache[table.view(-1).long()] = v.reshape(batch * blocks, page, heads, dim)
    return k_cache, v_cache, table


def _contiguous_block(seqlen: int) -> int:
    return math.gcd(seqlen, CONTIGUOUS_BLOCK)


# --- backends -----------------------------------------------------------------------------------------------


def paged_decode_runner(case: Case, q, k, v, lens, *, block: int, shuffled: bool, config=None, num_splits=0,
                        layers=1, k_scale=None, v_scale=None):
    """The `ioattn-paged` / `ioattn-contiguous` backend of this benchmark, ready to time (a benchmark hook: `lab/`
    uses it too). k, v (B, L, Hkv, D) become the pool itself, viewed as blocks of `block` tokens and, if
    `shuffled`, scattered through it in place; `config` and `num_splits` go to `plan_paged_attention`.
    Returns (forward, out, plan, restore): forward() runs paged_attention over `layers` copies of the cache into
    `out` and returns it, plan is the plan it runs, restore() undoes the scatter (call it before k and v are
    read as dense tensors again). k_scale / v_scale: an fp8 k and v's per-head scales."""
    blocks = case.seqlen // block
    k_cache = k.view(case.batch * blocks, block, case.heads_kv, case.head_dim)
    v_cache = v.view(case.batch * blocks, block, case.heads_kv, case.head_dim)
    table = block_table(case.batch, blocks, shuffled, q.device)
    if shuffled:  # the same logical cache, its blocks scattered through the pool (fp8 moved as bytes)
        inverse = torch.empty_like(table.view(-1))
        inverse[table.view(-1).long()] = torch.arange(table.numel(), dtype=torch.int32, device=q.device)
        for cache in (bytes_view(k_cache), bytes_view(v_cache)):
            cache.copy_(cache[inverse.long()])
    plan = plan_paged_attention(q, k_cache, table, decode=True, max_seqlen_q=1, num_splits=num_splits, config=config)
    workspace = paged_workspace(case.batch, case.heads_q, case.head_dim, max_splits=plan.num_splits, device=q.device)
    out = torch.empty_like(q)
    caches = layer_copies((k_cache, v_cache), layers)

    def forward():
        for layer_k, layer_v in caches:
            paged_attention(q, layer_k, layer_v, table, lens, out=out, workspace=workspace,
                            num_splits=plan.num_splits, config=plan.config, k_scale=k_scale, v_scale=v_scale)
        return out

    def restore():  # undo the scatter so later backends see the contiguous cache again
        if shuffled:
            for cache in (bytes_view(k_cache), bytes_view(v_cache)):
                cache.copy_(cache[table.view(-1).long()])

    return forward, out, plan, restore


def _sdpa_runner(name: str, q4, caches):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_PEERS[name])

    def forward():
        with sdpa_kernel(backend):
            for kt, vt in caches:
                out = torch.nn.functional.scaled_dot_product_attention(q4, kt, vt, enable_gqa=True)
        return out

    return forward


def _flex_runner(q4, caches):
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()  # a fresh compile per shape, never past dynamo's recompile limit (MEASURING.md)
    compiled = torch.compile(flex_attention, dynamic=False)

    def forward():
        for kt, vt in caches:
            out = compiled(q4, kt, vt, enable_gqa=True)
        return out

    return forward


def _measure(fn, device: str, args, layers: int = 1) -> tuple[float, str]:
    """Milliseconds per layer of `fn`, which runs `layers` of them (in one CUDA graph when it captures)."""
    graphed, how = capture_graph(fn, device)
    ms = harness.time_ms(graphed, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms).ms / layers
    return ms, how if layers == 1 else f"{how} of {layers} layers"


def run_case(case: Case, args, ceilings: dict[str, Any]) -> list[Row]:
    device, dtype = args.device, harness.parse_dtype(case.dtype)
    rows: list[Row] = []
    copy_tbps = ceilings.get("copy_tbps")
    if case.kv_bytes > args.max_kv_gib * 2**30:
        return [Row(case.columns(), name, status=f"skipped: K/V needs {case.kv_bytes / 2**30:.0f} GiB > "
                    f"--max-kv-gib {args.max_kv_gib}") for name in args.backends]
    shape = (case.batch, case.seqlen, case.heads_kv, case.head_dim)
    k = torch.randn(shape, dtype=dtype, device=device)
    v = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(case.batch, case.heads_q, case.head_dim, dtype=dtype, device=device)
    lens = torch.full((case.batch,), case.seqlen, dtype=torch.int32, device=device)
    ref, _ = attention_ref(q[:1, None], k[:1], v[:1])
    ref = ref[0, 0]

    layers = layer_count(case, args)

    def add(name, fn, out_of: Callable[[], torch.Tensor], used: str, extra=None, *, kv_bytes=None, row_layers=None,
            row_ref=None):
        result: dict[str, Any] = {}
        kv_bytes = kv_bytes or case.kv_bytes

        def work():
            ms, how = _measure(fn, device, args, row_layers or layers)
            result.update(ms=ms, how=how, error=rel_error(out_of(), ref if row_ref is None else row_ref))
            if row_ref is not None:
                row.extra["error_vs_bf16"] = rel_error(out_of(), ref)

        row = Row(case.columns(), name, extra=extra or {})
        row.status = harness.guarded(work, ours=name.startswith("ioattn"))
        if row.status == "ok":
            row.ms, row.error = result["ms"], result["error"]
            row.used = f"{used}, {result['how']}"
            row.rate = kv_bytes / (row.ms * 1e-3) / 1e12
            row.ceiling_pct = 100.0 * row.rate / copy_tbps if copy_tbps else None
            row.extra.update(kv_bytes=kv_bytes, tokens_per_s=case.batch * case.seqlen / (row.ms * 1e-3))
        rows.append(row)

    for name, block, shuffled in (("ioattn-paged", PAGED_BLOCK, True),
                                  ("ioattn-contiguous", _contiguous_block(case.seqlen), False)):
        if name in args.backends:
            _ioattn_row(name, case, (q, k, v, lens), ref, block, shuffled, add, args, layers)
    if FP8_BACKEND in args.backends:
        _fp8_row(case, q, k, v, lens, add, args)

    peers = [n for n in args.backends if not n.startswith("ioattn")]
    if peers:
        q4 = q.view(case.batch, case.heads_q, 1, case.head_dim)
        kt = k.transpose(1, 2).contiguous()
        del k  # one layout at a time: the largest cases fill most of the GPU
        vt = v.transpose(1, 2).contiguous()
        del v
        caches = layer_copies((kt, vt), layers)
        for name in peers:
            if not device.startswith("cuda"):
                rows.append(Row(case.columns(), name, status="skipped: CUDA only"))
                continue
            holder: dict[str, torch.Tensor] = {}
            fn = _flex_runner(q4, caches) if name == "flex" else _sdpa_runner(name, q4, caches)

            def keep(fn=fn, holder=holder):
                holder["out"] = fn()
                return holder["out"]

            used = "flex_attention, torch.compile(dynamic=False)" if name == "flex" else f"SDPA {SDPA_PEERS[name]} (forced)"
            add(name, keep, lambda holder=holder: holder["out"][0, :, 0], used)
    return rows


def _ioattn_row(name: str, case: Case, inputs, ref, block: int, shuffled: bool, add, args, layers: int) -> None:
    forward, out, plan, restore = paged_decode_runner(case, *inputs, block=block, shuffled=shuffled, layers=layers)
    extra = {"splits": plan.num_splits, "config": dataclasses.asdict(plan.config), "block_size": block,
             "layers": layers}
    add(name, forward, lambda: out[0], f"paged_attention ({plan.config.kernel} kernel) block {block}, "
        f"{plan.num_splits} splits", extra)
    del forward  # its layer copies, before the tuning trials and the peers allocate theirs
    restore()
    if args.tune and name == "ioattn-paged":
        extra["tuning"] = tune(case, *inputs, ref, args, layers)


def fp8_inputs(k: torch.Tensor, v: torch.Tensor, fp8: torch.dtype):
    """k, v (B, L, Hkv, D) quantized to `fp8` with per-KV-head scales from their amax (the engine's calibration
    rule): (k8, v8, k_scale, v_scale), the fp8 tensors in the same layout."""
    out = []
    for t in (k, v):
        # One sequence at a time: quantizing a whole B256 L32k cache at once takes float32 temporaries of 4x its size.
        amax = torch.stack([row.abs().amax(dim=(0, 2)) for row in t]).amax(dim=0)
        scale = scale_for_amax(amax.float().cpu(), fp8, FP8_HEADROOM).to(t.device)
        quantized = torch.empty(t.shape, dtype=fp8, device=t.device)
        for row, dst in zip(t, quantized):
            dst.copy_(quantize(row, scale, fp8))
        out += [quantized, scale]
    return out[0], out[2], out[1], out[3]


def _fp8_row(case: Case, q, k, v, lens, add, args) -> None:
    """The `ioattn-paged-fp8` row: k and v quantized, a block-16 shuffled pool, one byte per element read."""
    fp8 = KV_CACHE_DTYPES[args.kv_cache_dtype]
    k8, v8, k_scale, v_scale = fp8_inputs(k, v, fp8)
    ref8, _ = attention_ref(q[:1, None], dequantize(k8[:1], k_scale, torch.float64),
                            dequantize(v8[:1], v_scale, torch.float64))
    kv_bytes = case.kv_bytes_at(1)
    layers = layer_count(case, args, kv_bytes)
    forward, out, plan, restore = paged_decode_runner(case, q, k8, v8, lens, block=PAGED_BLOCK, shuffled=True,
                                                      layers=layers, k_scale=k_scale, v_scale=v_scale)
    extra = {"splits": plan.num_splits, "config": dataclasses.asdict(plan.config), "block_size": PAGED_BLOCK,
             "layers": layers, "kv_cache_dtype": args.kv_cache_dtype}
    add(FP8_BACKEND, forward, lambda: out[0], f"paged_attention ({plan.config.kernel} kernel) block {PAGED_BLOCK}, "
        f"{args.kv_cache_dtype} cache, {plan.num_splits} splits", extra, kv_bytes=kv_bytes, row_layers=layers,
        row_ref=ref8[0, 0])
    del forward
    restore()
    if args.tune:
        extra["tuning"] = tune(case, q, k8, v8, lens, ref8[0, 0], args, layers, k_scale=k_scale, v_scale=v_scale)


def _rank(trials, run_trial, tolerance: float) -> list[dict[str, Any]]:
    """Time each (config, splits) trial; `run_trial` returns (ms, error, plan). The five fastest correct trials
    come first; a trial that misses the reference or fails is listed apart under "wrong", never ranked."""
    results, wrong = [], []
    for config, splits in trials:
        entry: dict[str, Any] = {"config": config and dataclasses.asdict(config), "splits": splits}

        def work(config=config, splits=splits, entry=entry):
            ms, error, plan = run_trial(config, splits)
            entry.update(config=dataclasses.asdict(plan.config), splits=plan.num_splits, us=round(ms * 1e3, 2),
                         error=error)

        entry["status"] = harness.guarded(work, ours=True)
        ok = entry["status"] == "ok" and entry["error"] < tolerance
        (results if ok else wrong).append(entry)
    ranked = sorted(results, key=lambda r: r["us"])[:5]
    return ranked + ([{"wrong": wrong}] if wrong else [])


def tune(case: Case, q, k, v, lens, ref, args, layers: int = 1, k_scale=None, v_scale=None) -> list[dict[str, Any]]:
    """Every decode candidate config (heuristic splits), then every split count in TUNE_SPLITS (default config).
    k, v may be fp8 (with their scales): the candidates then include the tiles of twice as many keys."""
    def run_trial(config, splits):
        forward, out, plan, restore = paged_decode_runner(case, q, k, v, lens, block=PAGED_BLOCK, shuffled=True,
                                                          config=config, num_splits=splits, layers=layers,
                                                          k_scale=k_scale, v_scale=v_scale)
        try:
            ms, _ = _measure(forward, args.device, args, layers)
            return ms, rel_error(out[0], ref), plan
        finally:
            restore()

    trials = [(c, 0) for c in candidate_configs(decode=True, head_dim=case.head_dim, cache_dtype=k.dtype)]
    trials += [(None, s) for s in TUNE_SPLITS]
    return _rank(trials, run_trial, TOLERANCE[q.dtype])


@dataclass
class PrefillInputs:
    """One sequence appending `new` tokens to `context` cached ones: dense q (1, new, Hq, D) and k/v
    (1, new + context, Hkv, D), and the same keys and values in a pool of `page`-token blocks in shuffled
    order, with its block table, cu_seqlens_q and seq_lens."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor


def chunked_prefill_inputs(heads_q: int, heads_kv: int, head_dim: int, new: int, context: int, page: int,
                           dtype: torch.dtype, device) -> PrefillInputs:
    total = new + context
    q = torch.randn(1, new, heads_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(1, total, heads_kv, head_dim, dtype=dtype, device=device)
    v = torch.randn(1, total, heads_kv, head_dim, dtype=dtype, device=device)
    k_cache, v_cache, table = paged_pool(k, v, page, shuffled=True)
    return PrefillInputs(q, k, v, k_cache, v_cache, table, torch.tensor([0, new], dtype=torch.int32, device=device),
                         torch.tensor([total], dtype=torch.int32, device=device))


def run_prefill(args, ceilings) -> list[Row]:
    """4k new tokens on a 4k paged context vs the dense forward at Nq 4k, Nk 8k."""
    import ioattn

    device, dtype = args.device, harness.parse_dtype(args.dtype)
    hq, hkv = args.heads[0]
    new, context, d = args.prefill_tokens, args.prefill_tokens, args.head_dim
    total = new + context
    case = {"B": 1, "L": total, "heads": f"{hq}/{hkv}", "D": d, "dtype": args.dtype, "Nq": new}
    inputs = chunked_prefill_inputs(hq, hkv, d, new, context, PAGED_BLOCK, dtype, device)
    q, k, v, k_cache, v_cache, table = inputs.q, inputs.k, inputs.v, inputs.k_cache, inputs.v_cache, inputs.table
    cu, lens = inputs.cu_seqlens_q, inputs.seq_lens
    rows_ref = min(new, 256)
    ref, _ = attention_ref(q[:, -rows_ref:], k, v, causal=True)
    flops = harness.attention_flops(1, hq, new, total, d, causal=True)
    packed_q = q[0]
    plan = plan_paged_attention(packed_q, k_cache, table, decode=False, max_seqlen_q=new)
    kernel_plan = plan_paged_attention(packed_q, k_cache, table, decode=False, max_seqlen_q=new, gather=False)
    runners = {
        "ioattn-paged-prefill": (lambda: paged_attention(packed_q, k_cache, v_cache, table, lens, cu_seqlens_q=cu,
                                                          max_seqlen_q=new), lambda o: o[None, -rows_ref:],
                                 f"paged_attention block {PAGED_BLOCK}: {plan}"),
        "ioattn-paged-kernel": (lambda: paged_attention(packed_q, k_cache, v_cache, table, lens, cu_seqlens_q=cu,
                                                         max_seqlen_q=new, gather=False),
                                lambda o: o[None, -rows_ref:], f"paged_attention block {PAGED_BLOCK}, gather=False: "
                                                               f"{kernel_plan}"),
        "ioattn-dense": (lambda: ioattn.flash_attn_func(q, k, v, causal=True), lambda o: o[:, -rows_ref:],
                         "flash_attn_func (dense forward)"),
    }
    rows = []
    tuning = None
    if args.tune:
        def run_trial(config, splits):
            def forward():
                return paged_attention(packed_q, k_cache, v_cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=new,
                                       num_splits=splits, config=config)
            ms, _ = _measure(forward, device, args)
            trial_plan = plan_paged_attention(packed_q, k_cache, table, decode=False, max_seqlen_q=new,
                                              num_splits=splits, config=config)
            return ms, rel_error(forward()[None, -rows_ref:], ref), trial_plan

        tuning = _rank([(c, 1) for c in candidate_configs(decode=False, head_dim=d)], run_trial, TOLERANCE[dtype])
    for name, (fn, pick, used) in runners.items():
        result: dict[str, Any] = {}

        def work(fn=fn, pick=pick):
            ms, how = _measure(fn, device, args)
            result.update(ms=ms, how=how, error=rel_error(pick(fn()), ref))

        status = harness.guarded(work, ours=True)
        row_plan = plan if name == "ioattn-paged-prefill" else kernel_plan
        extra = {"splits": row_plan.num_splits, "config": dataclasses.asdict(row_plan.config), "tuning": tuning,
                 "gather": row_plan.gather} if "paged" in name else {}
        row = Row(case, name, status=status, extra=extra)
        if status == "ok":
            row.ms, row.error, row.used = result["ms"], result["error"], f"{used}, {result['how']}"
            row.rate = harness.tflops(flops, row.ms)
        rows.append(row)
    return rows


# --- report -------------------------------------------------------------------------------------------------


def render_markdown(meta: dict[str, Any], rows: list[Row], prefill: list[Row]) -> str:
    body = []
    for row in rows:
        cells = [row.case[k] for _, k in CASE_COLUMNS] + [row.backend]
        if row.status == "ok":
            cells += [row.ms * 1e3, row.rate, row.ceiling_pct, row.extra.get("splits"), row.error, row.used]
        else:
            cells += [None, None, None, None, None, row.status]
        body.append(cells)
    parts = [
        "# ioattn bench decode", "", harness.disclosure_markdown(meta), "",
        harness.markdown_table([h for h, _ in CASE_COLUMNS] + ["backend", "µs", "TB/s K+V", "% copy", "splits",
                                                                "error", "used"], body), "",
        "Ratios of K/V bandwidth (ours / peer):", "",
        harness.ratio_table(rows, CASE_COLUMNS, "ioattn-paged", ["ioattn-contiguous", "torch-cudnn", "torch-flash",
                                                                 "flex"]),
    ]
    if any(row.backend == FP8_BACKEND for row in rows):
        parts += ["", f"{FP8_BACKEND}: K/V bytes are 1 per element. Ratios of context tokens read per second "
                  "(fp8 / bf16 cache; equal to the ratio of times):", "",
                  _fp8_ratio_table(rows), "", _fp8_bar(rows)]
    if prefill:
        parts += ["", "Chunked prefill (TFLOP/s, 4·B·Hq·Nq·Nk·D):", "",
                  harness.rows_table(prefill, [("Nq", "Nq"), ("Nk", "L"), ("Hq/Hkv", "heads"), ("D", "D")], "TFLOP/s")]
        by_name = {r.backend: r for r in prefill if r.status == "ok"}
        dense = by_name.get("ioattn-dense")
        for name, label in (("ioattn-paged-prefill", "paged (default path) / dense"),
                            ("ioattn-paged-kernel", "paged kernel (gather=False) / dense")):
            if dense and name in by_name:
                bar = " (bar: >= 0.9×)" if name == "ioattn-paged-prefill" else ""
                parts += ["", f"{label}: {by_name[name].rate / dense.rate:.2f}×{bar}"]
    tuned = [r for r in rows + prefill if r.extra.get("tuning")]
    if tuned:
        parts += ["", "Tuning (ioattn-paged, fastest first):", ""]
        parts += [f"- {r.backend} B{r.case['B']} L{r.case['L']} {r.case['heads']}: {r.extra['tuning'][:3]}"
                  for r in tuned]
    return "\n".join(parts) + "\n"


def _speedups(rows: list[Row]) -> list[tuple[dict, dict[str, float]]]:
    """(case, {peer: fp8 tokens/s over the peer's}) per case that has an fp8 row."""
    by_case: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        if row.status == "ok":
            by_case.setdefault(tuple(row.case[k] for _, k in CASE_COLUMNS), {})[row.backend] = row
    out = []
    for backends in by_case.values():
        mine = backends.get(FP8_BACKEND)
        if mine is None:
            continue
        out.append((mine.case, {peer: backends[peer].ms / mine.ms for peer in ("ioattn-paged", "torch-cudnn",
                                                                              "torch-flash") if peer in backends}))
    return out


def _fp8_ratio_table(rows: list[Row]) -> str:
    body = [[case[k] for _, k in CASE_COLUMNS] + [f"{ratios[p]:.2f}×" if p in ratios else None
                                                  for p in ("ioattn-paged", "torch-cudnn", "torch-flash")]
            for case, ratios in _speedups(rows)]
    return harness.markdown_table([h for h, _ in CASE_COLUMNS] + [f"{FP8_BACKEND} / {p}" for p in
                                                                  ("ioattn-paged", "torch-cudnn", "torch-flash")], body)


def _fp8_bar(rows: list[Row]) -> str:
    """Whether the fp8 row meets the bar on every case with B·L >= BAR_TOKENS."""
    misses, checked = [], 0
    for case, ratios in _speedups(rows):
        if case["B"] * case["L"] < BAR_TOKENS:
            continue
        for peer, bar in BAR.items():
            if peer in ratios:
                checked += 1
                if ratios[peer] < bar:
                    misses.append(f"B{case['B']} L{case['L']} {case['heads']} vs {peer}: {ratios[peer]:.2f}× < {bar}×")
    bars = ", ".join(f"≥ {bar}× {peer}" for peer, bar in BAR.items())
    if not checked:
        return f"Bar ({bars} where B·L ≥ {BAR_TOKENS}): no case measured."
    verdict = "met on every one" if not misses else f"missed on {len(misses)}: " + "; ".join(misses)
    return f"Bar ({bars} where B·L ≥ {BAR_TOKENS}): {checked} comparisons, {verdict}."


# --- command line -------------------------------------------------------------------------------------------


def _heads(text: str) -> list[tuple[int, int]]:
    return [tuple(int(h) for h in pair.split("/")) for pair in text.split(",") if pair.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ioattn bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--mla", action="store_true",
                   help="run the MLA (DeepSeek-V3 latent) decode benchmark instead: `--mla --help` lists its flags")
    p.add_argument("--quick", action="store_true", help="a few small rows (runs on the CPU too)")
    p.add_argument("--batches", type=harness.int_list, help="B values (default 1,8,64,256)")
    p.add_argument("--seqlens", type=harness.int_list, help="L values (default 1024,4096,16384,32768)")
    p.add_argument("--long-seqlens", type=harness.int_list, help="extra L values at B=1 (default 131072)")
    p.add_argument("--heads", type=_heads, help="Hq/Hkv pairs (default 32/8,32/32)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", help="bfloat16 (CUDA default) / float16 / float32 (CPU default)")
    p.add_argument("--backends", type=harness.name_list((*BACKENDS, FP8_BACKEND)),
                   help=f"any of {', '.join(BACKENDS)} ({FP8_BACKEND} with --kv-cache-dtype)")
    p.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="chunked-prefill rows (default: on with CUDA)")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="new tokens = cached tokens (default 4096)")
    p.add_argument("--tune", action="store_true", help="time candidate configs and split counts for ioattn-paged")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                   help=f"fp8_e4m3 / fp8_e5m2: add {FP8_BACKEND}, the paged kernel over the cache quantized to it "
                        "(beside the bf16 rows)")
    p.add_argument("--max-kv-gib", type=float, default=60.0, help="skip cases whose K+V exceed this")
    p.add_argument("--layers", type=int,
                   help="distinct caches run back to back in one timed graph, as a model's layers (default 32 on "
                        "CUDA, 1 on the CPU; 1 times a lone call)")
    p.add_argument("--layers-gib", type=float, default=8.0,
                   help="memory all layers' caches may take (the case's own included); fewer layers where a "
                        "case's K+V is larger, never fewer than 1")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    harness.add_run_args(p, budget_s=480.0, out_help="directory for <date>-decode-<device>.{json,md}")
    args = p.parse_args(argv)
    args.device = harness.default_device(args.device)
    cuda = args.device.startswith("cuda")
    if args.quick:
        defaults = dict(batches=[1, 8], seqlens=[1024, 4096], long_seqlens=[], heads=[(32, 8)]) if cuda else \
            dict(batches=[1, 2], seqlens=[64, 256], long_seqlens=[], heads=[(4, 2)])
    else:
        defaults = dict(batches=[1, 8, 64, 256], seqlens=[1024, 4096, 16384, 32768], long_seqlens=[131072],
                        heads=[(32, 8), (32, 32)])
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not cuda and args.quick and args.head_dim == 128:
        args.head_dim = 64
    args.dtype = harness.dtype_name(harness.parse_dtype(args.dtype or ("bfloat16" if cuda else "float32")))
    args.backends = args.backends or list(BACKENDS)
    if args.kv_cache_dtype != "auto" and FP8_BACKEND not in args.backends:
        args.backends.append(FP8_BACKEND)
    if args.kv_cache_dtype == "auto" and FP8_BACKEND in args.backends:
        p.error(f"--backends {FP8_BACKEND} needs --kv-cache-dtype fp8_e4m3 or fp8_e5m2")
    args.prefill = cuda if args.prefill is None else args.prefill
    args.layers = (32 if cuda else 1) if args.layers is None else args.layers
    if args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if not cuda and args.quick:
        args.prefill_tokens = min(args.prefill_tokens, 64)
        args.warmup_ms, args.rep_ms = min(args.warmup_ms, 1.0), min(args.rep_ms, 1.0)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "--mla" in argv:  # its own cases and flags: hand off before this parser sees them
        from ioattn.bench import mla

        return mla.main([a for a in argv if a != "--mla"])
    args = parse_args(argv)
    started = time.monotonic()
    cases = build_cases(args)
    print(f"ioattn bench decode: {len(cases)} cases × {len(args.backends)} backends on {args.device}", flush=True)
    meta: dict[str, Any] = {
        "disclosure": harness.collect_disclosure(args.device, " ".join(["ioattn bench decode", *argv])),
        "ceilings": harness.measure_ceilings(args.device, [harness.parse_dtype(args.dtype)]),
        "settings": {
            "backends": args.backends, "dtype": args.dtype, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "paged": f"block {PAGED_BLOCK}, blocks shuffled through the pool; contiguous: identity table, "
                     f"block {CONTIGUOUS_BLOCK}; SDPA/Flex: contiguous (B, H, L, D) copy",
            "rate": "bytes of K and V read per second, 2·B·L·Hkv·D·itemsize / time (itemsize 1 for fp8 rows); "
                    "extra.tokens_per_s: B·L / time",
            "kv_cache_dtype": args.kv_cache_dtype,
            "error": "first sequence vs float64 attention_ref",
            "graphs": "each backend captured in a CUDA graph when it allows (see `used`)",
            "layers": f"per-layer time in a graph over distinct cache copies, up to {args.layers} layers within "
                      f"{args.layers_gib:g} GiB (see `used`)",
        },
    }
    print(harness.disclosure_markdown(meta), flush=True)
    rows = harness.sweep(
        cases, lambda case: run_case(case, args, meta["ceilings"]),
        lambda row: (f"{row.ms * 1e3:10.1f} µs {row.rate:6.2f} TB/s {row.ceiling_pct or 0:5.1f}% "
                     f"splits {row.extra.get('splits', '-')} err {row.error:.1e}"),
        started=started, budget_s=args.budget_s, meta=meta, device=args.device)
    prefill = run_prefill(args, meta["ceilings"]) if args.prefill else []
    report = render_markdown(meta, rows, prefill)
    print(report, flush=True)
    harness.write_outputs(args, "decode", meta, rows + prefill, report)
    return 0
