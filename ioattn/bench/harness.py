"""What every ioattn benchmark shares: disclosure, ceilings, timing, memory, FLOPs, rows, tables, JSON.

The method is /work/shared/MEASURING.md's: count FLOPs (or bytes) first, time after warm-up with the median of
many repetitions, measure the hardware ceilings in the same run, report per row the backend actually used,
peak memory and the error against a higher-precision reference, and compare peers as ratios from one run.

A benchmark module builds `Row`s with these helpers and hands them to `rows_table` / `ratio_table` /
`write_json`; `ioattn.bench.plot` draws them. Typical use:

    meta = {"disclosure": collect_disclosure(device, command),
            "ceilings": measure_ceilings(device, [torch.bfloat16])}
    timing = time_ms(lambda: fn(q, k, v), device)
    rows.append(Row(case={"N": n}, backend="ioattn", used=..., ms=timing.ms, rate=tflops(flops, timing.ms)))
    print(rows_table(rows, [("N", "N")], "TFLOP/s"))
    write_json(path, meta, rows)

On CUDA, timing is `triton.testing.do_bench`: it writes a 256 MB buffer before every repetition, so inputs
never sit warm in the 60 MB L2 between repetitions; that is what rotating input copies would buy, so the
harness does not also rotate. On CPU, timing is `time.perf_counter` medians and numbers only check the harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch


@dataclass
class Row:
    """One (case, backend) measurement. A row that could not run keeps `status` and no numbers.

    `rate` is in the unit its table names (TFLOP/s for attention, TB/s for memory-bound benchmarks);
    `status` is "ok", "unsupported: <reason>", "skipped: <reason>" or "failed: <error>".
    """

    case: dict[str, Any]
    backend: str
    used: str = ""
    ms: float | None = None
    rate: float | None = None
    ceiling_pct: float | None = None
    peak_mib: float | None = None
    error: float | None = None
    status: str = "ok"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Timing:
    ms: float  # median over `reps` repetitions
    reps: int


# --- FLOPs --------------------------------------------------------------------------------------------------

PASS_FACTOR = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}


def attention_flops(
    batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, head_dim: int, *, causal: bool, pass_: str = "forward"
) -> float:
    """FlashAttention's convention: forward 4·B·H·Nq·Nk·D (two matmuls), halved for causal when Nq = Nk;
    backward 2.5× forward (five matmuls against two). Masked-out tiles still count for non-square causal,
    as in flash-attn's own benchmarks."""
    if pass_ not in PASS_FACTOR:
        raise ValueError(f"pass_ must be one of {sorted(PASS_FACTOR)}, got {pass_!r}")
    forward = 4.0 * batch * heads_q * seqlen_q * seqlen_k * head_dim
    if causal and seqlen_q == seqlen_k:
        forward /= 2
    return forward * PASS_FACTOR[pass_]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# --- timing and memory --------------------------------------------------------------------------------------


def time_ms(
    fn: Callable[[], Any],
    device: str,
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> Timing:
    """Median milliseconds of `fn()`, after warm-up, over about `rep_ms` of repetitions (at least 3).

    CUDA: triton.testing.do_bench (L2 flushed before each repetition, CUDA events); the repetition count adapts
    to the kernel's length, so big shapes get fewer reps. `grad_to_none` tensors get `.grad = None` before each
    repetition, outside the timed region, so a backward pass never accumulates.
    """
    if device.startswith("cuda"):
        import triton.testing

        times = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="all"
        )
        return Timing(statistics.median(times), len(times))

    def clear_grads():
        for t in grad_to_none or ():
            t.grad = None

    clear_grads()
    start = time.perf_counter()
    fn()
    first_ms = (time.perf_counter() - start) * 1e3
    for _ in range(max(0, math.ceil(warmup_ms / max(first_ms, 1e-3)) - 1)):
        clear_grads()
        fn()
    times = []
    while len(times) < 3 or (sum(times) < rep_ms and len(times) < 1000):
        clear_grads()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(times), len(times))


def peak_memory_mib(fn: Callable[[], Any], device: str) -> float | None:
    """Peak CUDA memory allocated while `fn()` runs, above what was allocated before (MiB); None on CPU."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


# --- running a backend that may refuse ---------------------------------------------------------------------


class Skip(Exception):
    """A backend cannot run a case; the message becomes the row's status ("unsupported: …", "skipped: …")."""


def _short(exc: BaseException, caught: list) -> str:
    """The error's first line, then the first two distinct UserWarnings (SDPA's reasons), never deprecations."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    messages = (str(w.message).strip() for w in caught if w.category is UserWarning)
    reasons = dict.fromkeys(m.splitlines()[0] for m in messages if m and "deprecat" not in m.lower())
    return "; ".join([text, *list(reasons)[:2]])[:240]


def guarded(work: Callable[[], None], *, ours: bool) -> str:
    """Run `work`; return "ok" or the status of why it could not run. SDPA says why it refuses a backend only in
    warnings, so those are recorded and quoted. An error from a peer means the peer cannot run the case; an
    unexpected error from our own code (`ours`) is a failure and is shown as one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            work()
            return "ok"
        except Skip as exc:
            return str(exc)
        except torch.OutOfMemoryError:
            return "skipped: out of memory"
        except (ValueError, NotImplementedError) as exc:
            return f"unsupported: {_short(exc, [] if ours else caught)}"
        except Exception as exc:  # noqa: BLE001 — a peer's refusal comes as many exception types
            status = "failed" if ours else "unsupported"
            return f"{status}: {type(exc).__name__}: {_short(exc, [] if ours else caught)}"
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


# --- disclosure and ceilings --------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except OSError:
        return "unknown"


def collect_disclosure(device: str, command: str) -> dict[str, Any]:
    """Everything a reader needs to reproduce or discount a run: machine, software versions, command line."""
    # read triton's version without importing it: on a CPU-only machine triton must load after ioattn.kernels
    # has selected the interpreter (see ioattn/kernels/__init__.py)
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "not installed"
    import numpy

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "command": command,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton_version,
        "numpy": numpy.__version__,
        "device": device,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            driver=_nvidia_driver(),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            timing="triton.testing.do_bench, median, L2 flushed before every repetition",
        )
    else:
        info.update(gpu="none", timing="time.perf_counter median (CPU: checks the harness, says nothing of GPU speed)")
    return info


def device_tag(disclosure: dict[str, Any]) -> str:
    """Short lowercase name for file names: 'h200' for 'NVIDIA H200', 'cpu' without a GPU."""
    gpu = disclosure.get("gpu", "none")
    if gpu == "none":
        return "cpu"
    words = [w for w in gpu.lower().replace("nvidia", "").split() if w]
    return "-".join(words[:2]) or "gpu"


def measure_ceilings(device: str, dtypes: Iterable[torch.dtype], fp8: bool = False) -> dict[str, Any]:
    """Matmul TFLOP/s per dtype and device-copy TB/s, measured now, on this device.

    CUDA: 8192³ matmul per dtype, and a 2 GiB device-to-device copy counting bytes read + written; with fp8 (on
    sm_89+) also an e4m3 8192³ `torch._scaled_mm` (fast accumulation, bf16 out) under "float8_e4m3fn".
    CPU: a 1024³ matmul per dtype only (a CPU number, no GPU meaning); no copy ceiling, no fp8 one.
    """
    cuda = device.startswith("cuda")
    size = 8192 if cuda else 1024
    ceilings: dict[str, Any] = {"matmul_size": size, "matmul_tflops": {}, "copy_tbps": None}
    for dtype in dict.fromkeys(dtypes):
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        timing = time_ms(lambda: a @ b, device)
        ceilings["matmul_tflops"][dtype_name(dtype)] = tflops(2.0 * size**3, timing.ms)
        del a, b
    if cuda and fp8 and torch.cuda.get_device_capability(device) >= (8, 9):
        a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        # fast accumulation: the tensor cores' own rate, without cuBLAS promoting partial sums to fp32 every few k
        timing = time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                  use_fast_accum=True), device)
        ceilings["matmul_tflops"][dtype_name(torch.float8_e4m3fn)] = tflops(2.0 * size**3, timing.ms)
        del a, b
    if cuda:
        src = torch.randn(2**29, device=device)  # 2 GiB of random float32: far past L2
        dst = torch.empty_like(src)
        timing = time_ms(lambda: dst.copy_(src), device)
        ceilings["copy_tbps"] = 2 * src.numel() * src.element_size() / (timing.ms * 1e-3) / 1e12
        del src, dst
        torch.cuda.empty_cache()
        ceilings["note"] = ("measured in this run: matmul 8192³ per dtype (e4m3: torch._scaled_mm); copy of 2 GiB, "
                            "bytes read + written")
    else:
        ceilings["note"] = "CPU run: matmul 1024³ on the CPU only; no copy ceiling"
    return ceilings


_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- tables, JSON, files ------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: None as an em dash, floats to `digits` significant digits, small errors in e-notation."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v, digits) for v in value)
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e6):
            return f"{value:.{max(digits - 1, 1)}e}"
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines)


def rows_table(
    rows: Sequence[Row],
    case_columns: Sequence[tuple[str, str]],
    rate_unit: str,
    extra_columns: Sequence[tuple[str, str]] = (),
) -> str:
    """Markdown: one line per row, the case columns (header, key) first, then the measurements, then
    `extra_columns` (header, key in `row.extra`). A row that did not run shows its status in the `used` column."""
    header = [h for h, _ in case_columns] + ["backend", "used", "ms", rate_unit, "% ceiling", "peak MiB", "error"]
    header += [h for h, _ in extra_columns]
    body = []
    for row in rows:
        cells = [row.case.get(key) for _, key in case_columns] + [row.backend]
        if row.status == "ok":
            cells += [row.used, row.ms, row.rate, row.ceiling_pct, row.peak_mib, row.error]
            cells += [row.extra.get(key) for _, key in extra_columns]
        else:
            cells += [row.status] + [None] * (5 + len(extra_columns))
        body.append(cells)
    return markdown_table(header, body)


def ratio_table(rows: Sequence[Row], case_columns: Sequence[tuple[str, str]], ours: str, peers: Sequence[str]) -> str:
    """Markdown: per case, our rate / each peer's rate ('1.25×' = ours is 25% faster); — when either is missing."""
    by_case: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        key = tuple(row.case.get(k) for _, k in case_columns)
        by_case.setdefault(key, {})[row.backend] = row
    body = []
    for key, backends in by_case.items():
        mine = backends.get(ours)
        cells: list[Any] = list(key)
        for peer in peers:
            theirs = backends.get(peer)
            ok = mine and theirs and mine.rate and theirs.rate
            cells.append(f"{mine.rate / theirs.rate:.2f}×" if ok else None)
        body.append(cells)
    return markdown_table([h for h, _ in case_columns] + [f"{ours} / {p}" for p in peers], body)


def disclosure_markdown(meta: dict[str, Any]) -> str:
    """Bullet list of the disclosure, ceilings and settings sections of `meta`."""
    lines = []
    for section in ("disclosure", "ceilings", "settings"):
        for key, value in meta.get(section, {}).items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {fmt(v)}" for k, v in value.items())
            lines.append(f"- {key}: {fmt(value, 4)}")
    return "\n".join(lines)


def write_json(path: str | Path, meta: dict[str, Any], rows: Sequence[Row]) -> None:
    payload = {**meta, "rows": [dataclasses.asdict(r) for r in rows]}
    write_text(path, json.dumps(payload, indent=1, default=str) + "\n")


def write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def read_json(path: str | Path) -> tuple[dict[str, Any], list[Row]]:
    payload = json.loads(Path(path).read_text())
    rows = [Row(**r) for r in payload.pop("rows")]
    return payload, rows


def dated_paths(out_dir: str | Path, name: str, tag: str) -> dict[str, Path]:
    """out_dir/<UTC date>-<name>-<tag>.{json,md,png}, e.g. 2026-11-29-prefill-h200.json."""
    stem = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}-{name}-{tag}"
    return {ext: Path(out_dir) / f"{stem}.{ext}" for ext in ("json", "md", "png")}


# --- command line and output, shared by the `ioattn bench` modules ------------------------------------------


def int_list(text: str) -> list[int]:
    """argparse type: "1,8,64" -> [1, 8, 64]."""
    return [int(x) for x in text.split(",") if x.strip()]


def name_list(known: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list of backend names, each one of `known`."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown backends {unknown}; choose from {', '.join(known)}")
        return names

    return parse


def add_run_args(parser: argparse.ArgumentParser, budget_s: float, out_help: str) -> None:
    """--budget-s, --device and the output flags (--out, --json, --md) every case-sweeping benchmark takes."""
    parser.add_argument("--budget-s", type=float, default=budget_s,
                        help="stop starting new cases after this many seconds")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--out", help=out_help)
    parser.add_argument("--json", help="write rows and disclosure as JSON here")
    parser.add_argument("--md", help="write the markdown report here")


def default_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def budget_spent(started: float, budget_s: float, meta: dict[str, Any], not_run: Sequence[Any]) -> bool:
    """True once `budget_s` seconds have passed since `started` (time.monotonic()); then the labels of the
    cases `not_run` are recorded in meta["settings"]["not_run"] and the cut is printed."""
    if time.monotonic() - started <= budget_s:
        return False
    meta["settings"]["not_run"] = [case.label() for case in not_run]
    print(f"time budget of {budget_s:.0f} s spent: {len(not_run)} cases not run", flush=True)
    return True


def sweep(cases: Sequence[Any], run_case: Callable[[Any], Iterable[Row]], describe: Callable[[Row], str], *,
          started: float, budget_s: float, meta: dict[str, Any], device: str) -> list[Row]:
    """Every case's rows from `run_case(case)` until the time budget is spent (`budget_spent`), one progress line
    per row (`describe(row)` where it ran, else its status); the CUDA cache allocator is emptied between cases, so
    one case's buffers never crowd the next's."""
    rows: list[Row] = []
    for index, case in enumerate(cases, 1):
        if budget_spent(started, budget_s, meta, cases[index - 1:]):
            break
        for row in run_case(case):
            rows.append(row)
            result = describe(row) if row.status == "ok" else row.status
            print(f"[{index}/{len(cases)}] {case.label():32s} {row.backend:22s} {result}", flush=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def write_outputs(args: argparse.Namespace, name: str, meta: dict[str, Any], rows: Sequence[Row],
                  report: str) -> dict[str, str | Path | None]:
    """Write the JSON (meta and rows) and the markdown report where --json / --md say, else under --out with
    dated names. Returns the paths by extension ("json", "md", "png"; None where nothing goes), so a caller
    can draw the PNG."""
    dated = dated_paths(args.out, name, device_tag(meta["disclosure"])) if args.out else {}
    paths = {"json": args.json or dated.get("json"), "md": args.md or dated.get("md"), "png": dated.get("png")}
    if paths["json"]:
        write_json(paths["json"], meta, rows)
        print(f"wrote {paths['json']}", flush=True)
    if paths["md"]:
        write_text(paths["md"], report)
        print(f"wrote {paths['md']}", flush=True)
    return paths


# --- decode timing hooks (CUDA graphs over distinct cache copies) ----------------------------------------


def capture_graph(fn: Callable[[], Any], device: str) -> tuple[Callable[[], Any], str]:
    """`fn` captured in a CUDA graph (after two warm-up calls on a side stream), so that timing µs-scale kernels
    times the GPU, not Python's launches: (the graph's replay, "CUDA graph"). On a CPU, or if capture fails,
    (fn itself, "eager" or "eager (<error> in graph capture)"). A benchmark hook: `lab/` times through it too."""
    if not device.startswith("cuda"):
        return fn, "eager"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, "CUDA graph"
    except Exception as exc:  # noqa: BLE001 — any capture failure means: time it eagerly, and say so
        torch.cuda.synchronize()
        return fn, f"eager ({type(exc).__name__} in graph capture)"


def layer_count(case, args, kv_bytes: int | None = None) -> int:
    """How many distinct caches one timed graph runs through: as many as fit in --layers-gib, at most --layers.
    kv_bytes: one cache's bytes, when not the case's dtype's (an fp8 cache)."""
    return max(1, min(args.layers, int(args.layers_gib * 2**30 // (kv_bytes or case.kv_bytes))))


def layer_copies(tensors: tuple[torch.Tensor, ...], layers: int) -> list[tuple[torch.Tensor, ...]]:
    """`tensors` and layers - 1 copies of them at other addresses (the same values: each layer's output checks)."""
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(layers - 1)]


def block_table(batch: int, blocks_per_seq: int, shuffled: bool, device) -> torch.Tensor:
    """(batch, blocks_per_seq) int32: every block of a pool once, in shuffled or in table order."""
    order = torch.randperm(batch * blocks_per_seq) if shuffled else torch.arange(batch * blocks_per_seq)
    return order.view(batch, blocks_per_seq).to(torch.int32).to(device)
