"""`ioattn bench prefill`: ioattn's attention against every peer, side by side in one run.

Peers on CUDA: torch SDPA forced (torch.nn.attention.sdpa_kernel) to FLASH_ATTENTION, EFFICIENT_ATTENTION and
CUDNN_ATTENTION; FlexAttention compiled once per shape (dynamo is reset per shape: past its recompile limit it
would silently run eagerly at ~10 TFLOP/s); naive attention unless its N×N scores exceed a memory budget.
On CPU: ioattn (its torch backend under `auto`) against SDPA MATH and naive, in fp32, to check the harness.

Each peer gets its preferred layout, made from the same values outside the timed region: ioattn (B, N, H, D),
SDPA and Flex (B, H, N, D), all contiguous. Self-attention only (Nq = Nk), so top-left and bottom-right causal
agree. Error: ‖out − ref‖/‖ref‖ against float64 `attention_ref` on a slice (last batch entry, the query heads
of the last KV head, the last ≤ 1024 query rows: bottom-right alignment keeps those rows exact). `--backward`:
the same peers' backward and forward+backward. The backward is timed alone (`retain_graph`) where every backend
of a case allows a second backward, else as forward+backward minus forward for every backend of that case (a
compiled Flex graph with donated buffers refuses it), so ratios always compare one method. Error is the worst
of out, dq, dk, dv against float64 autograd on the last batch entry and KV group (all rows, in chunks); peak
memory of forward+backward at N and 2N shows which backends grow linearly.

The sweep is ordered so that the bar's rows (D 128 and 64, MHA) come first; `--budget-s` stops it between
cases, and the JSON / markdown / PNG are written with whatever ran (the rest is listed as not run).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager

import torch

from ioattn.bench import harness
from ioattn.bench.harness import Row
from ioattn.reference import attention_ref, rel_error, visible

SDPA_PEERS = {
    "torch-flash": "FLASH_ATTENTION",
    "torch-efficient": "EFFICIENT_ATTENTION",
    "torch-cudnn": "CUDNN_ATTENTION",
    "torch-math": "MATH",
}
# ioattn-fp8: the FP8 forward on inputs quantized before timing (e4m3 with flash-attn 3's per-(sequence, KV
# head) descales: the kernel alone, as FlashAttention-3 reports it); ioattn-fp8-quant: on the 16-bit inputs, the
# per-128-position block quantization inside the timed call. Forward only; error against the original inputs.
FP8_BACKENDS = ("ioattn-fp8", "ioattn-fp8-quant")
# The forward's targets, checked on every forward run that times their backends: ioattn at least torch CUDNN on
# every row; the FP8 forward (e4m3 inputs) at least FP8_BAR x ioattn's 16-bit forward at D 128 from FP8_BAR_MIN_N.
FP8_BAR, FP8_BAR_MIN_N = 1.6, 4096
BACKENDS = ("ioattn", *FP8_BACKENDS, *SDPA_PEERS, "flex", "naive")
DEFAULT_BACKENDS = {
    "cuda": ("ioattn", "torch-flash", "torch-efficient", "torch-cudnn", "flex", "naive"),
    "cpu": ("ioattn", "torch-math", "naive"),
}
CASE_COLUMNS = [(key, key) for key in ("dtype", "B", "Hq", "Hkv", "N", "D", "causal")]
ERROR_ROWS = 1024  # query rows compared against float64 in forward mode
NAIVE_MEMORY_FRACTION = 0.5  # of the GPU's memory; naive attention is skipped past it
CPU_NAIVE_BYTES = 2 * 2**30


@dataclass(frozen=True)
class Case:
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def flops(self, pass_: str) -> float:
        return harness.attention_flops(
            self.batch, self.heads_q, self.seqlen, self.seqlen, self.head_dim, causal=self.causal, pass_=pass_
        )

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "B": self.batch, "Hq": self.heads_q, "Hkv": self.heads_kv,
                "N": self.seqlen, "D": self.head_dim, "causal": self.causal}

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.dtype} B{self.batch} H{self.heads_q}/{self.heads_kv} N{self.seqlen} D{self.head_dim} {mask}"


# --- the sweep ----------------------------------------------------------------------------------------------


def _defaults(cuda: bool, quick: bool, backward: bool) -> dict[str, Any]:
    if not cuda:
        return dict(dims=[64], seqlens=[128, 256], tokens=512, model_dim=256, dtypes=["float32"],
                    gqa=[1], warmup_ms=2.0, rep_ms=10.0) if quick else \
            dict(dims=[64, 128], seqlens=[128, 256, 512], tokens=1024, model_dim=512, dtypes=["float32"],
                 gqa=[1, 4], warmup_ms=5.0, rep_ms=50.0)
    if quick:
        return dict(dims=[128], seqlens=[1024, 4096], tokens=16384, model_dim=2048, dtypes=["bfloat16"],
                    gqa=[1], warmup_ms=10.0, rep_ms=50.0)
    # Backward compiles are slow (FlexAttention above all), so its default keeps the bar's dims and N >= 2k.
    return dict(dims=[128, 64] if backward else [128, 64, 256],
                seqlens=[2048, 4096, 8192, 16384] if backward else [512, 1024, 2048, 4096, 8192, 16384],
                tokens=16384, model_dim=2048, dtypes=["bfloat16"], gqa=None, warmup_ms=10.0, rep_ms=50.0)


def build_cases(dims, seqlens, causals, dtypes, gqa, tokens, model_dim) -> list[Case]:
    """B·N = tokens and H·D = model_dim per case. `gqa` lists Hq/Hkv ratios; None means MHA everywhere plus
    4:1 at D = 128. MHA comes first, so a time budget cuts GQA rows before the bar's rows."""
    ratios = sorted({1, 4}) if gqa is None else list(dict.fromkeys(gqa))
    cases = []
    for ratio in ratios:
        for dtype in dtypes:
            for head_dim in dims:
                if gqa is None and ratio != 1 and head_dim != 128:
                    continue
                heads_q = model_dim // head_dim
                if heads_q == 0 or heads_q % ratio:
                    continue
                for causal in causals:
                    for seqlen in seqlens:
                        batch = max(1, tokens // seqlen)
                        cases.append(Case(dtype, batch, heads_q, heads_q // ratio, seqlen, head_dim, causal))
    return cases


# --- backends: each returns a Runner or raises Skip ---------------------------------------------------------


@dataclass
class Runner:
    forward: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]  # q, k, v as this backend takes them; gradients land here
    heads_first: bool  # (B, H, N, D) rather than (B, N, H, D)
    used: str  # short, for the table
    context: Callable[[], ContextManager] = contextlib.nullcontext
    explanation: str = ""  # ioattn.explain()'s full text, kept in the JSON

    def to_bnhd(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if self.heads_first else t


def _leaves(tensors, heads_first: bool, requires_grad: bool):
    return tuple(
        (t.transpose(1, 2).contiguous() if heads_first else t).detach().requires_grad_(requires_grad)
        for t in tensors
    )


def _ioattn_api():
    """(flash_attn_func, explain), imported at use: the kernels live in other modules of the package."""
    import ioattn

    return ioattn.flash_attn_func, ioattn.explain


def _run_ioattn(case: Case, qkv, args) -> Runner:
    try:
        flash_attn_func, explain = _ioattn_api()
    except (ImportError, AttributeError) as exc:
        raise harness.Skip(f"unsupported: ioattn kernels not importable ({exc})") from exc
    q, k, v = _leaves(qkv, False, args.backward)
    kwargs = dict(causal=case.causal, backend=args.ioattn_backend)
    plan = explain(q, k, v, **kwargs)
    runner = Runner(lambda: flash_attn_func(q, k, v, **kwargs), (q, k, v), False,
                    _describe_plan(plan, backward=args.backward))
    runner.explanation = " ".join(str(plan).split())
    return runner


def _run_ioattn_fp8(name: str, case: Case, qkv, args) -> Runner:
    if args.backward:
        raise harness.Skip("unsupported: the fp8 forward has no backward")
    from ioattn.ops.fp8_attention import flash_attn_fp8_func, quantize_per_head

    q, k, v = _leaves(qkv, False, False)
    if name == "ioattn-fp8-quant":
        return Runner(lambda: flash_attn_fp8_func(q, k, v, causal=case.causal), (q, k, v), False,
                      "fp8 forward, block scales per 128 positions, quantized in the call")
    (qc, qs), (kc, ks), (vc, vs) = quantize_per_head(q, case.group), quantize_per_head(k), quantize_per_head(v)
    return Runner(lambda: flash_attn_fp8_func(qc, kc, vc, causal=case.causal, q_descale=qs, k_descale=ks,
                                              v_descale=vs), (q, k, v), False,
                  "fp8 forward on e4m3 inputs, one descale per (sequence, KV head)")


def _describe_plan(plan, backward: bool = False) -> str:
    """Kernel and tiles (and the backward's, in --backward mode), short enough for a table cell; the whole
    explanation goes to the JSON."""
    kernel = getattr(plan, "kernel", None)
    if kernel is None:
        return " ".join(str(plan).split())
    tiles = getattr(plan, "config", None) or getattr(plan, "torch_tiles", None)
    text = f"{getattr(plan, 'backend', '')} {kernel.rsplit('.', 1)[-1]} {tiles}".strip()
    bwd_kernel = getattr(plan, "bwd_kernel", None)
    if backward and bwd_kernel:
        text += f"; backward {bwd_kernel.rsplit('.', 1)[-1]} {getattr(plan, 'bwd_config', None) or ''}".rstrip()
    return text


def _run_sdpa(name: str, case: Case, qkv, args) -> Runner:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_PEERS[name], None)
    if backend is None:
        raise harness.Skip(f"unsupported: this torch has no SDPBackend.{SDPA_PEERS[name]}")
    q, k, v = _leaves(qkv, True, args.backward)
    gqa = case.group > 1

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa)

    return Runner(forward, (q, k, v), True, f"SDPA {SDPA_PEERS[name]} (forced)", lambda: sdpa_kernel(backend))


def _causal_mod(batch, head, q_idx, kv_idx):
    return q_idx >= kv_idx


def _run_flex(case: Case, qkv, args) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _leaves(qkv, True, args.backward)
    torch._dynamo.reset()  # a fresh compile per shape, never past dynamo's recompile limit (MEASURING.md)
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if case.causal:
        block_mask = create_block_mask(_causal_mod, None, None, case.seqlen, case.seqlen, device=q.device)
    gqa = case.group > 1

    def forward():
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    used = "flex_attention, torch.compile(dynamic=False)" + (", causal block mask" if case.causal else "")
    return Runner(forward, (q, k, v), True, used)


def naive_bytes(case: Case, backward: bool) -> int:
    """Scores, masked scores, fp32 probabilities and their cast: B·Hq·N²·(3·elem + 4); twice that with grads."""
    elem = harness.parse_dtype(case.dtype).itemsize
    per_pass = case.batch * case.heads_q * case.seqlen**2 * (3 * elem + 4)
    return per_pass * (2 if backward else 1)


def _memory_budget(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(device).total_memory * NAIVE_MEMORY_FRACTION)
    return CPU_NAIVE_BYTES


def _run_naive(case: Case, qkv, args) -> Runner:
    need, budget = naive_bytes(case, args.backward), _memory_budget(args.device)
    if need > budget:
        raise harness.Skip(
            f"skipped: memory (N×N scores need ~{need / 2**30:.1f} GiB, budget {budget / 2**30:.1f} GiB)"
        )
    q, k, v = _leaves(qkv, True, args.backward)
    hidden = ~visible(case.seqlen, case.seqlen, causal=True, device=q.device) if case.causal else None
    scale = case.head_dim**-0.5

    def forward():
        keys, values = k, v
        if case.group > 1:
            keys, values = k.repeat_interleave(case.group, dim=1), v.repeat_interleave(case.group, dim=1)
        scores = (q @ keys.transpose(-2, -1)) * scale
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values

    return Runner(forward, (q, k, v), True, "naive: matmul, fp32 softmax, matmul (N×N scores in memory)")


def _runner(name: str, case: Case, qkv, args) -> Runner:
    if name == "ioattn":
        return _run_ioattn(case, qkv, args)
    if name in FP8_BACKENDS:
        return _run_ioattn_fp8(name, case, qkv, args)
    if name in SDPA_PEERS:
        return _run_sdpa(name, case, qkv, args)
    return {"flex": _run_flex, "naive": _run_naive}[name](case, qkv, args)


# --- reference on a slice -----------------------------------------------------------------------------------


def _q_slice(t: torch.Tensor, case: Case, rows: int | None = None) -> torch.Tensor:
    """(B, N, Hq, D) -> the last batch entry, the last `rows` rows, the query heads of the last KV head."""
    return t[-1:, -(rows or case.seqlen):, case.heads_q - case.group:]


def _kv_slice(t: torch.Tensor) -> torch.Tensor:
    return t[-1:, :, -1:]


@dataclass
class Reference:
    out: torch.Tensor  # float64, (1, rows, group, D)
    rows: int
    grads: tuple[torch.Tensor, ...] | None = None  # float64 dq (1, N, group, D), dk, dv (1, N, 1, D)


def forward_reference(case: Case, q, k, v) -> Reference:
    rows = min(case.seqlen, ERROR_ROWS)
    out, _ = attention_ref(_q_slice(q, case, rows), _kv_slice(k), _kv_slice(v), causal=case.causal)
    return Reference(out, rows)


def backward_reference(case: Case, q, k, v, dout) -> Reference:
    """Float64 autograd on the slice, one chunk of query rows at a time (an N×N float64 matrix per head would
    not fit at N = 16k); each chunk sees its rows of the causal visibility as a bool mask."""
    q64, k64, v64 = (
        s.detach().to(torch.float64).requires_grad_() for s in (_q_slice(q, case), _kv_slice(k), _kv_slice(v))
    )
    dout64 = _q_slice(dout, case).to(torch.float64)
    allowed = visible(case.seqlen, case.seqlen, causal=case.causal, device=q.device)
    chunk = max(1, 2**25 // (case.group * case.seqlen))  # ≈ 256 MiB of float64 scores per chunk
    outs = []
    for start in range(0, case.seqlen, chunk):
        rows = slice(start, start + chunk)
        out, _ = attention_ref(q64[:, rows], k64, v64, attn_mask=allowed[rows], differentiable=True)
        out.backward(dout64[:, rows])
        outs.append(out.detach())
    return Reference(torch.cat(outs, dim=1), case.seqlen, (q64.grad, k64.grad, v64.grad))


# --- one measurement ----------------------------------------------------------------------------------------


def _measure_forward(runner: Runner, case: Case, ref: Reference, args, row: Row) -> None:
    out = runner.forward()  # first call compiles / autotunes, outside the timed region
    row.error = rel_error(_q_slice(runner.to_bnhd(out), case, ref.rows), ref.out)
    del out
    timing = harness.time_ms(runner.forward, args.device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    row.ms, row.rate, row.extra["reps"] = timing.ms, harness.tflops(case.flops("forward"), timing.ms), timing.reps
    row.peak_mib = harness.peak_memory_mib(runner.forward, args.device)


def ceiling_pct(backend: str, dtype: str, rate: float, ceilings: dict) -> float | None:
    """% of the run's matmul ceiling in the dtype the backend's matmuls run in (e4m3 for the fp8 backends; None
    where the run has no such ceiling: fp8 off sm_89+)."""
    ceiling = ceilings["matmul_tflops"].get("float8_e4m3fn" if backend in FP8_BACKENDS else dtype)
    return 100 * rate / ceiling if ceiling else None


def more_forward_rounds(case_rows: list[Row], case: Case, qkv, args, ceilings: dict) -> None:
    """args.rounds - 1 more forward timings of every backend that ran, the backends taking turns, so that a drift
    of the GPU's clocks over the case falls on all of them alike; each row then reports the median round
    (all of them in extra["round_ms"])."""
    timed = [row for row in case_rows if row.status == "ok" and row.ms is not None]
    for row in timed:
        row.extra["round_ms"] = [row.ms]
    for _ in range(args.rounds - 1):
        for row in timed:
            runner = _runner(row.backend, case, qkv, args)
            with runner.context():
                row.extra["round_ms"].append(harness.time_ms(runner.forward, args.device, warmup_ms=args.warmup_ms,
                                                             rep_ms=args.rep_ms).ms)
    for row in timed:
        row.ms = statistics.median(row.extra["round_ms"])
        row.rate = harness.tflops(case.flops("forward"), row.ms)
        row.ceiling_pct = ceiling_pct(row.backend, case.dtype, row.rate, ceilings)


BACKWARD_ALONE = "backward alone (retain_graph)"
BACKWARD_BY_DIFFERENCE = "forward+backward minus forward"


def uniform_backward_timing(case_rows: list[Row], ceilings: dict) -> None:
    """One timing method for every backend of a case, so their ratios compare like with like: the backward
    alone where every measured backend allows a second backward through its graph, else forward+backward
    minus forward for all of them (the backward-alone figure stays in extra["backward_alone_ms"])."""
    measured = [r for r in case_rows if r.status == "ok" and "fwd_bwd_minus_fwd_ms" in r.extra]
    refusing = [r.backend for r in measured if r.extra["backward_timing"] != BACKWARD_ALONE]
    if not refusing:
        return
    for row in measured:
        by_difference = row.extra["fwd_bwd_minus_fwd_ms"]
        row.rate *= row.ms / by_difference  # the same FLOPs over the other time
        row.ms = by_difference
        row.ceiling_pct = 100 * row.rate / ceilings["matmul_tflops"][row.case["dtype"]]
        row.extra["backward_timing"] = (f"{BACKWARD_BY_DIFFERENCE}, as every backend of this case "
                                        f"({', '.join(refusing)} refused a second backward)")


def _measure_backward(runner: Runner, case: Case, ref: Reference, dout: torch.Tensor, args, row: Row) -> None:
    dout = dout.transpose(1, 2).contiguous() if runner.heads_first else dout
    leaves, device, reps = runner.leaves, args.device, dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)

    def forward_backward():
        runner.forward().backward(dout)

    out = runner.forward()
    out.backward(dout)
    got = [_q_slice(runner.to_bnhd(out), case), _q_slice(runner.to_bnhd(leaves[0].grad), case)]
    got += [_kv_slice(runner.to_bnhd(t.grad)) for t in leaves[1:]]
    errors = {f"error_{n}": rel_error(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), got, (ref.out, *ref.grads))}
    row.extra.update(errors)
    row.error = max(errors.values())
    del out, got
    for t in leaves:
        t.grad = None

    fwd = harness.time_ms(runner.forward, device, **reps)
    both = harness.time_ms(forward_backward, device, grad_to_none=leaves, **reps)
    out = runner.forward()
    by_difference = row.extra["fwd_bwd_minus_fwd_ms"] = both.ms - fwd.ms
    try:
        bwd = harness.time_ms(lambda: out.backward(dout, retain_graph=True), device, grad_to_none=leaves, **reps)
        bwd_ms, row.extra["reps"] = bwd.ms, bwd.reps
        row.extra["backward_alone_ms"] = bwd.ms
        row.extra["backward_timing"] = BACKWARD_ALONE
    except Exception as exc:  # noqa: BLE001 — a graph that refuses a second backward only changes how it is timed
        bwd_ms, row.extra["reps"] = by_difference, both.reps
        row.extra["backward_timing"] = BACKWARD_BY_DIFFERENCE
        row.extra["backward_alone_refused"] = f"{type(exc).__name__}: {exc}"[:300]
    del out
    for t in leaves:
        t.grad = None
    row.ms, row.rate = bwd_ms, harness.tflops(case.flops("backward"), bwd_ms)
    row.extra.update(
        fwd_ms=fwd.ms, fwd_tflops=harness.tflops(case.flops("forward"), fwd.ms),
        fwd_bwd_ms=both.ms, fwd_bwd_tflops=harness.tflops(case.flops("forward+backward"), both.ms),
    )
    row.peak_mib = harness.peak_memory_mib(forward_backward, device)


def measure(name: str, case: Case, qkv, dout, ref: Reference, args, ceilings: dict) -> Row:
    row = Row(case=case.as_dict(), backend=name)

    def work():
        runner = _runner(name, case, qkv, args)
        row.used = runner.used
        if runner.explanation:
            row.extra["explain"] = runner.explanation
        with runner.context():
            if args.backward:
                _measure_backward(runner, case, ref, dout, args, row)
            else:
                _measure_forward(runner, case, ref, args, row)

    row.status = harness.guarded(work, ours=name == "ioattn" or name in FP8_BACKENDS)
    if row.status != "ok":
        row.ms = row.rate = row.peak_mib = row.error = None
    elif row.rate is not None:
        row.ceiling_pct = ceiling_pct(name, case.dtype, row.rate, ceilings)
    return row


def _random_inputs(case: Case, device: str):
    dtype = harness.parse_dtype(case.dtype)
    shape_q = (case.batch, case.seqlen, case.heads_q, case.head_dim)
    shape_kv = (case.batch, case.seqlen, case.heads_kv, case.head_dim)
    qkv = tuple(torch.randn(s, dtype=dtype, device=device) for s in (shape_q, shape_kv, shape_kv))
    return qkv, torch.randn(shape_q, dtype=dtype, device=device)


def memory_growth(case: Case, backends, args) -> list[dict[str, Any]]:
    """Peak memory of forward+backward at N and 2N (same B, H, D) per backend: a ratio near 2 is linear in N,
    near 4 quadratic. Only peaks, no timing; CUDA only (the CPU allocator keeps no peak)."""
    results = []
    for name in backends:
        entry: dict[str, Any] = {"backend": name}
        for scale in (1, 2):
            sized = replace(case, seqlen=case.seqlen * scale)
            qkv, dout = _random_inputs(sized, args.device)

            def work():
                runner = _runner(name, sized, qkv, args)
                grad_out = dout.transpose(1, 2).contiguous() if runner.heads_first else dout
                with runner.context():
                    runner.forward().backward(grad_out)  # compile and autotune first
                    for t in runner.leaves:
                        t.grad = None
                    entry[f"peak_mib_{scale}n"] = harness.peak_memory_mib(
                        lambda: runner.forward().backward(grad_out), args.device
                    )

            status = harness.guarded(work, ours=name == "ioattn")
            if status != "ok":
                entry[f"status_{scale}n"] = status
            del qkv, dout
        results.append(entry)
    return results


# --- report -------------------------------------------------------------------------------------------------


def render_markdown(meta: dict[str, Any], rows: list[Row], growth: list[dict[str, Any]], backends) -> str:
    backward = meta["settings"]["mode"] == "backward"
    disclosure = meta["disclosure"]
    where = disclosure.get("gpu") if disclosure.get("gpu") != "none" else f"CPU ({disclosure['cpu']})"
    unit = "backward TFLOP/s" if backward else "TFLOP/s"
    extra = []
    if backward:
        extra = [("fwd TFLOP/s", "fwd_tflops"), ("fwd+bwd TFLOP/s", "fwd_bwd_tflops"), ("fwd+bwd ms", "fwd_bwd_ms")]
    parts = [
        f"# ioattn bench prefill — {meta['settings']['mode']}, {where}, {disclosure['date_utc']} UTC",
        "## Disclosure", harness.disclosure_markdown(meta),
        f"## Results ({unit}; FlashAttention FLOP convention, % of the matmul ceiling of this run "
        "in the row's dtype, e4m3 for the fp8 backends)",
        harness.rows_table(rows, CASE_COLUMNS, unit, extra),
    ]
    peers = [b for b in backends if b != "ioattn"]
    if "ioattn" in backends and peers:
        parts += [f"## ioattn / peer ({unit}, same run; > 1 means ioattn is faster)",
                  harness.ratio_table(rows, CASE_COLUMNS, "ioattn", peers)]
    if not backward:
        parts += bar_lines(rows)
    if growth:
        n = meta["settings"]["memory_growth_case"]
        body = []
        for entry in growth:
            one, two = entry.get("peak_mib_1n"), entry.get("peak_mib_2n")
            ratio = f"{two / one:.2f}" if one and two else entry.get("status_2n") or entry.get("status_1n")
            body.append([entry["backend"], one, two, ratio])
        parts += [f"## Peak memory of forward+backward at N and 2N ({n}; ≈2 linear, ≈4 quadratic)",
                  harness.markdown_table(["backend", "peak MiB at N", "peak MiB at 2N", "2N / N"], body)]
    not_run = meta["settings"].get("not_run")
    if not_run:
        parts += ["## Not run (time budget)", "\n".join(f"- {label}" for label in not_run)]
    return "\n\n".join(parts) + "\n"


def bar_lines(rows: list[Row]) -> list[str]:
    """The forward's bars over the rows that have both sides: ioattn / torch-cudnn >= 1 on every row, and
    ioattn-fp8 / ioattn >= FP8_BAR at D 128 from FP8_BAR_MIN_N tokens; each line names the rows that miss."""
    by_case: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row.status == "ok" and row.rate:
            by_case.setdefault(tuple(row.case.get(k) for _, k in CASE_COLUMNS), {})[row.backend] = row.rate
    checks = [("ioattn", "torch-cudnn", 1.0, lambda case: True, "every row"),
              ("ioattn-fp8", "ioattn", FP8_BAR, lambda case: case["D"] == 128 and case["N"] >= FP8_BAR_MIN_N,
               f"D 128, N ≥ {FP8_BAR_MIN_N}")]
    lines = []
    for ours, theirs, bar, applies, where in checks:
        ratios = {key: rates[ours] / rates[theirs] for key, rates in by_case.items()
                  if ours in rates and theirs in rates and applies(dict(zip([k for _, k in CASE_COLUMNS], key)))}
        if not ratios:
            continue
        misses = [f"{_case_label(key)} {ratio:.2f}×" for key, ratio in ratios.items() if ratio < bar]
        verdict = "met on every one" if not misses else f"missed on {len(misses)}: " + "; ".join(misses)
        lines.append(f"Bar: {ours} / {theirs} ≥ {bar}× ({where}): {len(ratios) - len(misses)} of {len(ratios)} "
                     f"rows, {verdict}.")
    return lines


def _case_label(key: tuple) -> str:
    case = dict(zip([k for _, k in CASE_COLUMNS], key))
    causal = " causal" if case["causal"] else ""
    return f"D{case['D']} N{case['N']} H{case['Hq']}/{case['Hkv']}{causal}"


# --- command line -------------------------------------------------------------------------------------------


def _bools(text: str) -> list[bool]:
    names = {"yes": True, "true": True, "1": True, "causal": True,
             "no": False, "false": False, "0": False, "full": False}
    try:
        return [names[x.strip().lower()] for x in text.split(",") if x.strip()]
    except KeyError as exc:
        raise argparse.ArgumentTypeError(f"--causal takes a list of yes/no, got {text!r}") from exc


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ioattn bench prefill", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a handful of small rows (CPU: fp32 through the torch backend)")
    p.add_argument("--backward", action="store_true",
                   help="time backward and forward+backward; gradients' error; peak memory at N and 2N")
    p.add_argument("--dims", type=harness.int_list, help="head dims, e.g. 64,128")
    p.add_argument("--seqlens", type=harness.int_list, help="sequence lengths N, e.g. 2048,4096")
    p.add_argument("--causal", type=_bools, default=[False, True], help="no,yes (default both)")
    p.add_argument("--gqa", type=harness.int_list, help="Hq/Hkv ratios (default: 1, and 4 at D=128)")
    p.add_argument("--dtype", type=lambda t: [harness.dtype_name(harness.parse_dtype(x)) for x in t.split(",")],
                   help="bfloat16 (CUDA default), float16, float32 (CPU default)")
    p.add_argument("--backends", type=harness.name_list(BACKENDS), help=f"any of {', '.join(BACKENDS)}")
    p.add_argument("--tokens", type=int, help="B·N per case (default 16384 on CUDA)")
    p.add_argument("--model-dim", type=int, help="H·D per case (default 2048 on CUDA)")
    p.add_argument("--ioattn-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--warmup-ms", type=float)
    p.add_argument("--rep-ms", type=float)
    p.add_argument("--rounds", type=int,
                   help="forward timings per backend, the backends taking turns each round; the median is reported "
                        "(default 3 on CUDA, where clocks drift by a few %% between back-to-back timings; 1 on CPU)")
    harness.add_run_args(p, budget_s=390.0, out_help="directory for <date>-prefill[-backward]-<device>.{json,md,png}")
    p.add_argument("--plot", help="write a PNG of TFLOP/s against N per backend here")
    args = p.parse_args(argv)
    args.device = harness.default_device(args.device)
    cuda = args.device.startswith("cuda")
    for key, value in _defaults(cuda, args.quick, args.backward).items():
        name = {"dtypes": "dtype"}.get(key, key)
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.backends = args.backends or list(DEFAULT_BACKENDS["cuda" if cuda else "cpu"])
    if args.rounds is None:
        args.rounds = 3 if cuda and not args.backward else 1
    if args.rounds < 1 or (args.backward and args.rounds != 1):
        p.error(f"--rounds must be >= 1 (1 with --backward), got {args.rounds}")
    return args


def _progress(index: int, total: int, case: Case, row: Row, started: float) -> None:
    if row.status == "ok":
        result = f"{row.ms:9.3f} ms {row.rate:8.2f} TFLOP/s  err {row.error:.1e}  {row.used}"
    else:
        result = row.status
    print(f"[{index}/{total}] {case.label():38s} {row.backend:16s} {result}  ({time.monotonic() - started:.0f} s)",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    started = time.monotonic()
    cases = build_cases(args.dims, args.seqlens, args.causal, args.dtype, args.gqa, args.tokens, args.model_dim)
    if not cases:
        raise SystemExit("ioattn bench prefill: no cases (--model-dim must be a multiple of D·gqa for some D)")
    mode = "backward" if args.backward else "forward"
    print(f"ioattn bench prefill: {mode}, {len(cases)} cases × {len(args.backends)} backends on {args.device}",
          flush=True)
    meta: dict[str, Any] = {
        "disclosure": harness.collect_disclosure(args.device, " ".join(["ioattn bench prefill", *argv])),
        "ceilings": harness.measure_ceilings(args.device, [harness.parse_dtype(d) for d in args.dtype],
                                             fp8=any(b in FP8_BACKENDS for b in args.backends)),
        "settings": {
            "mode": mode, "backends": args.backends, "ioattn_backend": args.ioattn_backend,
            "tokens_per_case (B·N)": args.tokens, "model_dim (H·D)": args.model_dim,
            "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "budget_s": args.budget_s,
            **({} if args.backward else {"rounds": f"{args.rounds}, the backends taking turns; the median round"}),
            "layouts": "ioattn (B, N, H, D); SDPA and Flex (B, H, N, D); contiguous, made outside timing",
            "flops": "forward 4·B·Hq·N²·D, halved when causal; backward 2.5× forward",
            **({"backward_timing": "the backward alone (retain_graph) where every backend of a case allows a second "
                                   "backward, else forward+backward minus forward for every backend of that case"}
               if args.backward else {}),
            "error": "worst of out/dq/dk/dv vs float64 autograd on the last batch entry and KV group"
            if args.backward
            else f"out vs float64 attention_ref on the last batch entry and KV group, last ≤ {ERROR_ROWS} rows",
        },
    }
    print(harness.disclosure_markdown(meta), flush=True)

    rows: list[Row] = []
    for index, case in enumerate(cases, 1):
        if harness.budget_spent(started, args.budget_s, meta, cases[index - 1:]):
            break
        qkv, dout = _random_inputs(case, args.device)
        if args.backward:
            ref = backward_reference(case, *qkv, dout)
        else:
            ref = forward_reference(case, *qkv)
        case_rows = []
        for name in args.backends:
            row = measure(name, case, qkv, dout, ref, args, meta["ceilings"])
            row.extra["seconds"] = round(time.monotonic() - started, 1)
            case_rows.append(row)
        if args.backward:
            uniform_backward_timing(case_rows, meta["ceilings"])
        else:
            more_forward_rounds(case_rows, case, qkv, args, meta["ceilings"])
        for row in case_rows:
            _progress(index, len(cases), case, row, started)
        rows += case_rows
        del qkv, dout, ref

    growth = []
    if args.backward and args.device.startswith("cuda") and time.monotonic() - started < args.budget_s:
        # N = 4k and 8k (at most): big enough that naive attention's quadratic growth is plain, small enough
        # that it fits the memory budget at 2N.
        seqlen = min(max(c.seqlen for c in cases) // 2, 4096)
        heads = args.model_dim // args.dims[0]
        probe = Case(args.dtype[0], 1, heads, heads, max(seqlen, 1), args.dims[0], args.causal[-1])
        meta["settings"]["memory_growth_case"] = f"{probe.label()} and N{2 * probe.seqlen}"
        growth = memory_growth(probe, args.backends, args)
        meta["memory_growth"] = growth

    meta["settings"]["wall_s"] = round(time.monotonic() - started, 1)
    disclosure = meta["disclosure"]
    meta["plot"] = {
        "x_key": "N",
        "facet_keys": ["D", "causal", "Hkv"] if len(args.dtype) == 1 else ["dtype", "D", "causal", "Hkv"],
        "ylabel": "backward TFLOP/s" if args.backward else "TFLOP/s",
        "title": f"ioattn bench prefill ({mode}) — {disclosure['gpu']}, {disclosure['date_utc']} UTC",
    }
    report = render_markdown(meta, rows, growth, args.backends)
    print(report, flush=True)
    paths = harness.write_outputs(args, "prefill" + ("-backward" if args.backward else ""), meta, rows, report)
    json_path, png_path = paths["json"], args.plot or paths["png"]
    if png_path:
        try:
            from ioattn.bench.plot import plot_rates

            plot_rates(rows, png_path, **meta["plot"])
            print(f"wrote {png_path}", flush=True)
        except ImportError as exc:  # the GPU machine may lack matplotlib: the JSON keeps what the plot needs
            print(f"no PNG ({exc}); draw it elsewhere: python -m ioattn.bench.plot {json_path or 'RESULT.json'}")
    return 0
