"""`ioattn bench serve`: a serving workload through a server and/or offline systems, side by side, reported with
vLLM's `benchmark_serving` flags and metric names so results compare with published ones.

    ioattn bench serve --url http://127.0.0.1:8000                    # a running server (any OpenAI-compatible one)
    ioattn bench serve --launch --offline --model llama3-8b-shape     # start `ioattn serve`, then ioattn.LLM
    ioattn bench serve --launch --model smollm2 --request-rate 1,2,4,inf --goodput ttft:2000 tpot:50 --out DIR
    ioattn bench serve --launch --dataset-name sharegpt --dataset-path ShareGPT_V3.json --num-prompts 1000
    ioattn bench serve --compare ioattn,static,hf --model llama3-8b-shape --out bench/results
    ioattn bench serve --tp 1,2 --model llama3-8b-shape                # the same workload at TP 1 and TP 2
    ioattn bench serve --disagg --model llama3-8b-shape --input-len 1024 2048 --output-len 32 --concurrency 16

Workload: `--num-prompts` requests from `--dataset-name` (`ioattn.bench.datasets`): `random` token-id prompts
(lengths uniform in `--input-len MIN MAX`, or vLLM's `--random-input-len/--random-output-len/--random-range-ratio`;
exact, since they are sent as ids), a ShareGPT-format file, or `sonnet-like` prompts sharing a prefix. Each asks
for its output length with `ignore_eos` (vLLM's extension), so every request generates exactly that; greedy by
default. Requests arrive as a Poisson process at `--request-rate` per second (default `inf`: all at once), or are
kept at `--max-concurrency` in flight. Against a server (`ioattn.bench.serve_online`) every request streams;
reported: request, output and total token throughput, goodput under `--goodput` SLOs, and TTFT, TPOT, ITL and
E2EL (mean, median, P99) as `ioattn.bench.workload` defines them. Several rates (`--request-rate 2,4,8,inf`) are a
sweep: the server runs each in turn, and `--out` adds a PNG of latency against throughput.

`--compare` runs the same requests offline, all submitted at once, through ioattn's continuous batching
(`ioattn`), its static-batching baseline (`static`) and transformers' continuous batching (`hf`), and reports
ours / each peer, plus a batch-B decode step against its roofline bound: see `ioattn.bench.serve_offline`.
`--offline` is the `ioattn` system alone; with a server run it reports server throughput / offline throughput,
the server's overhead (goal >= 0.9). With `--launch` the server is this package's own, started as a subprocess
with the same engine settings and stopped before the offline runs, so they never share the device. Every measured
run, server or offline, is preceded by the same warm-up workload (`ioattn.bench.workload.warmup_workload`).

`--tp N` runs our engine on N tensor-parallel processes everywhere it runs (the launched server, `--offline`,
`--compare`'s ioattn and static; transformers stays one process). `--tp 1,2` (several sizes) is a comparison of
its own: the workload through our continuous engine at each size, one row each, with ratios to the first size;
all sizes run eager, because TP steps cannot use CUDA graphs. `--disagg` runs the workload through the colocated
engine and the disaggregated prefill/decode pair (`ioattn.distributed.DisaggregatedEngine`), TTFT and TPOT side by
side; for a prefill-heavy load give long prompts, short outputs and a request rate or concurrency, which both of
these modes follow (see `ioattn.bench.serve_offline`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

from ioattn.bench.datasets import add_dataset_args, build_workload, check_dataset_args
from ioattn.bench.serve_online import launch_server, run_server, run_sweep, stop_server
from ioattn.bench.workload import SLO_METRICS
from ioattn.cli_args import positive_int

# -- command line --------------------------------------------------------------------------------------------


def run(args) -> dict:
    work, notes = build_workload(args)
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "out", "api_key")}}
    if notes:
        result["notes"] = notes
    if args.url or args.launch:
        process, url = launch_server(args) if args.launch else (None, args.url.rstrip("/"))
        model = None if args.launch else args.served_model_name
        try:
            if len(args.request_rates) > 1:
                result["sweep"] = run_sweep(url, model, args, args.json and args.json + ".partial.jsonl")
            else:
                result["server"] = run_server(url, model, work, args, args.request_rate)
        finally:
            if process is not None:
                stop_server(process)
    systems = list(args.compare)
    if args.offline and "ioattn" not in systems:
        systems.insert(0, "ioattn")
    from ioattn.bench import serve_offline

    parts = [serve_offline.run_systems(work, args, systems)] if systems else []
    if len(args.tp) > 1:
        parts.append(serve_offline.run_tp_sweep(work, args))
    if args.disagg:
        parts.append(serve_offline.run_disaggregated(work, args))
    for part in parts:
        for key, value in part.items():
            if key in ("systems", "ratios"):
                result.setdefault(key, {}).update(value)
            elif key == "notes":
                result.setdefault(key, []).extend(value)
            else:
                result[key] = value
    offline = result.get("systems", {}).get("ioattn")
    if "server" in result and offline:
        result["server_over_offline"] = result["server"]["output_tokens_per_s"] / offline["output_tokens_per_s"]
        if args.request_rate != float("inf") or args.concurrency:
            result["ratio_note"] = ("offline submits every request at once; with --request-rate or --concurrency "
                                    "the server run saw a lighter load, so the ratio is not the server's overhead")
    return result


# vLLM's benchmark_serving report: (label, summary key).
REPORT_ROWS = (
    ("Successful requests", "completed"), ("Failed requests", "failed"), ("Benchmark duration (s)", "duration_s"),
    ("Total input tokens", "total_input_tokens"), ("Total generated tokens", "output_tokens"),
    ("Request throughput (req/s)", "request_throughput"), ("Request goodput (req/s)", "request_goodput"),
    ("Output token throughput (tok/s)", "output_throughput"),
    ("Total token throughput (tok/s)", "total_token_throughput"),
    *((f"{label} {metric.upper()} (ms)", f"{stat}_{metric}_ms") for metric in ("ttft", "tpot", "itl", "e2el")
      for label, stat in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))),
)
ENGINE_KEYS = ("preemptions", "prefix_hit_rate", "kv_utilization_mean", "kv_pool_usage_peak", "kv_pool_tokens",
               "kv_bytes_per_token", "requests_in_pool", "running_peak", "kv_cache_layout", "steps",
               "overlapped_steps", "step_ms_mean", "step_token_wait_share", "step_time_share", "shipped_blocks",
               "first_token_agreement")
SWEEP_COLUMNS = (("request rate (req/s)", "request_rate"), ("completed", "completed"),
                 ("req/s", "request_throughput"), ("output tok/s", "output_throughput"),
                 ("goodput (req/s)", "request_goodput"), ("median TTFT (ms)", "median_ttft_ms"),
                 ("P99 TTFT (ms)", "p99_ttft_ms"), ("median TPOT (ms)", "median_tpot_ms"),
                 ("P99 TPOT (ms)", "p99_tpot_ms"), ("median ITL (ms)", "median_itl_ms"), ("P99 ITL (ms)", "p99_itl_ms"),
                 ("median E2EL (ms)", "median_e2el_ms"))


def to_markdown(result: dict) -> str:
    from ioattn.bench.harness import fmt, markdown_table

    runs = {"server": result["server"]} if "server" in result else {}
    runs.update(result.get("systems", {}))
    rows = [(label, key) for label, key in (*REPORT_ROWS, *((key, key) for key in ENGINE_KEYS))
            if any(key in run for run in runs.values())]
    # A system that could not run shows why in its first cell.
    body = [[label, *(run.get(key, run.get("status") if i == 0 else None) for run in runs.values())]
            for i, (label, key) in enumerate(rows)]
    text = markdown_table(["metric", *runs], body) if runs else ""
    if "sweep" in result:
        sweep = [[run.get(key) for _, key in SWEEP_COLUMNS] for run in result["sweep"]]
        text += markdown_table([label for label, _ in SWEEP_COLUMNS], sweep)
        slo = result["sweep"][0].get("goodput_slo_ms")
        if slo:
            text += "\n\ngoodput: requests per second within " + ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())
        for run in result["sweep"]:
            if "errors" in run:
                text += f"\n\nrate {run['request_rate']:g} errors: {run['errors']}"
    for peer, bar in (("hf", ">= 5, project goal >= 10"), ("static", ">= 3")):
        if f"ioattn_over_{peer}" in result:
            text += f"\n\nioattn / {peer} output throughput: {result[f'ioattn_over_{peer}']:.2f}x (bar: {bar})"
    step = result.get("decode_step")
    if step:
        text += (f"\n\nbatch-{step['batch']} decode step at mean context {step['context_mean']:.0f}: "
                 f"{fmt(step['step_ms'])} ms (period over {step['steps_timed']} consecutive engine steps, "
                 f"{step['overlapped_steps']} of them overlapped; median step() call {fmt(step['step_ms_median'])} "
                 f"ms); bound "
                 f"{fmt(step['bound_ms'])} ms = {step['bound_note']}; weights {step['weight_bytes'] / 1e9:.3g} GB, "
                 f"KV {step['kv_bytes'] / 1e9:.3g} GB; step / bound: {fmt(step['step_over_bound'])} (bar: <= 1.5)")
        if step["preempted"]:
            text += "; WARNING: preemptions happened during the decode measurement (KV pool too small)"
    for name, ratios in result.get("ratios", {}).items():
        text += f"\n\n{name}: " + ", ".join(f"{key} {fmt(value)}x" for key, value in ratios.items())
    for note in result.get("notes", []):
        text += f"\n\nnote: {note}"
    if "server_over_offline" in result:
        text += f"\n\nserver / offline output throughput: {result['server_over_offline']:.3f} (goal >= 0.9)"
        if "ratio_note" in result:
            text += f"\n\nnote: {result['ratio_note']}"
    for name, run in runs.items():
        for key in ("errors", "server_counters", "attention", "cache"):
            if key in run:
                text += f"\n\n{name} {key}: {run[key]}"
    return text


def _systems(text: str) -> list[str]:
    from ioattn.bench.serve_offline import SYSTEMS

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--compare takes distinct names from {', '.join(SYSTEMS)}, got {text!r}")
    return names


def _tp_sizes(text: str) -> list[int]:
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"--tp takes one size or distinct comma-separated sizes >= 1, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ioattn bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true", help="start `ioattn serve --model MODEL` for the run")
    parser.add_argument("--offline", action="store_true", help="also run the workload through ioattn.LLM (the "
                        "`ioattn` system of --compare)")
    parser.add_argument("--compare", type=_systems, default=[], metavar="SYSTEMS",
                        help="comma-separated offline systems to run side by side: ioattn, static, hf")
    parser.add_argument("--tp", type=_tp_sizes, default=[1], metavar="N[,N...]",
                        help="tensor-parallel size of our engine (--launch, --offline, --compare; hf stays one "
                        "process); several sizes (e.g. 1,2): the workload through each, eager, side by side")
    parser.add_argument("--disagg", action="store_true", help="the workload (paced by --request-rate / "
                        "--concurrency) through the colocated engine and the disaggregated prefill/decode pair")
    parser.add_argument("--decode-batch", type=int, default=64, metavar="B",
                        help="time an engine step with B decodes at the workload's mean context, against its "
                        "roofline bound, on the ioattn system (0: skip)")
    parser.add_argument("--model", default="tiny", help="a preset (tiny, tiny-mla, llama3-8b-shape, ...) or a "
                        "checkpoint folder, for --launch, --offline and --compare")
    parser.add_argument("--served-model-name", default=None, help="`model` in requests to --url (default: the "
                        "server's first model)")
    parser.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=positive_int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"),
                        help="random dataset: prompt lengths uniform in [MIN, MAX] (or --random-input-len)")
    parser.add_argument("--output-len", type=int, nargs="+", default=[256], metavar="LEN",
                        help="random dataset: one length, or MIN MAX for uniform lengths (or --random-output-len)")
    parser.add_argument("--request-rate", type=_rates, default=[math.inf], metavar="RATE[,RATE...]",
                        help="Poisson arrivals per second, `inf`: all at once (default); several rates (e.g. "
                        "2,4,inf): a sweep against the server, one run each, with a latency-throughput plot")
    parser.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=positive_int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--goodput", nargs="+", type=_slo, default=[], metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:2000 tpot:50 (metrics: ttft, tpot, e2el; milliseconds)")
    parser.add_argument("--api-key", default=os.environ.get("IOATTN_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="Bearer token for --url (default: $IOATTN_API_KEY, then $OPENAI_API_KEY)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    add_dataset_args(parser)
    engine = parser.add_argument_group("engine settings (--launch, --offline, --compare)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--device", default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--num-blocks", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3", "fp8_e5m2"),
                        help="the engine's KV cache: the model's dtype, or fp8 (twice the tokens per pool byte)")
    engine.add_argument("--no-async-scheduling", action="store_true",
                        help="finish each engine step on the host before scheduling the next (default: overlap)")
    engine.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for the server")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--out", help="directory for commit-ready <date>-serve-<device>.{json,md} with disclosure "
                        "(a sweep: <date>-serve-sweep-<model>-<device>.{json,md,png})")
    parser.add_argument("--replot", metavar="RESULT.json", help="only draw a sweep's PNG from its JSON (written "
                        "where matplotlib was missing), beside it")
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    given = {word.split("=")[0] for word in (sys.argv[1:] if argv is None else argv) if word.startswith("--")}
    args.request_rates, args.request_rate = args.request_rate, args.request_rate[0]
    args.goodput = dict(args.goodput)
    check_dataset_args(parser, args, given)
    if len(args.request_rates) > 1 and not (args.url or args.launch):
        parser.error("a --request-rate sweep runs against a server: give --url or --launch")
    if len(args.request_rates) > 1 and (args.offline or args.compare or args.disagg or len(args.tp) > 1):
        parser.error("a --request-rate sweep is a run of its own: leave out --offline, --compare, --disagg and "
                     "several --tp sizes")
    if not (args.url or args.launch or args.offline or args.compare or args.disagg or len(args.tp) > 1):
        parser.error("give --url, --launch, --offline, --compare, --disagg or --tp with several sizes")
    if len(args.tp) > 1 and (args.url or args.launch or args.offline or args.compare or args.disagg):
        parser.error("--tp with several sizes is a comparison of its own: leave out --url, --launch, --offline, "
                     "--compare and --disagg")
    if args.disagg and args.tp != [1]:
        parser.error("--disagg runs one process per side: it takes no --tp")
    if args.decode_batch < 0:
        parser.error("--decode-batch must be >= 0")
    if args.decode_batch > args.max_num_seqs:
        parser.error(f"--decode-batch ({args.decode_batch}) must be <= --max-num-seqs ({args.max_num_seqs}); "
                     "0 skips the decode step")
    if args.url and args.launch:
        parser.error("--url and --launch are exclusive")
    if (args.url or args.launch) and importlib.util.find_spec("aiohttp") is None:
        parser.error("--url and --launch stream through aiohttp, which is not installed: pip install 'ioattn[bench]'")
    if len(args.output_len) == 1:
        args.output_len *= 2
    if len(args.output_len) != 2 or not 1 <= args.output_len[0] <= args.output_len[1]:
        parser.error("--output-len takes LEN or MIN MAX with 1 <= MIN <= MAX")
    if not 1 <= args.input_len[0] <= args.input_len[1]:
        parser.error("--input-len takes MIN MAX with 1 <= MIN <= MAX")

    result = run(args)
    text = to_markdown(result)
    print(text)
    if args.json or args.out:
        import torch

        from ioattn.bench.harness import collect_disclosure, dated_paths, device_tag, disclosure_markdown, write_text

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        disclosure = collect_disclosure(device, "ioattn bench serve " + " ".join(argv or sys.argv[1:]))
        disclosure["timing"] = ("wall clock: time.perf_counter on the client for the server run, the engine's "
                                "time.monotonic in this process for offline systems (after their warm-up); "
                                "percentiles nearest-rank")
        disclosure["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
        disclosure["tensor_parallel_size"] = args.tp if len(args.tp) > 1 else args.tp[0]
        disclosure["dataset"] = args.dataset_name + (f" ({args.dataset_path})" if args.dataset_path else "")
        if "hf" in args.compare:
            import transformers

            disclosure["transformers"] = transformers.__version__
        result = {"disclosure": disclosure, **result}
        payload = json.dumps(result, indent=1, default=str) + "\n"
        if args.json:
            write_text(args.json, payload)
        if args.out:
            # The TP and disaggregation comparisons get files of their own beside a same-day --compare run's.
            name = "serve" + ("-tp" if len(args.tp) > 1 else "") + ("-disagg" if args.disagg else "")
            if "sweep" in result:
                name = f"serve-sweep-{os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]}"
            paths = dated_paths(args.out, name, device_tag(disclosure))
            write_text(paths["json"], payload)
            figure = ""
            if "sweep" in result:
                figure = f"\n\n![latency against throughput]({paths['png'].name})\n"
                try:
                    plot_sweep(result["sweep"], paths["png"], sweep_title(result))
                except ImportError:
                    print(f"matplotlib is missing: draw the PNG elsewhere with `ioattn bench serve --replot "
                          f"{paths['json']}`", file=sys.stderr)
            write_text(paths["md"], f"# ioattn bench serve\n\n{disclosure_markdown(result)}\n\n{text}\n{figure}")
    return 0


def sweep_title(result: dict) -> str:
    gpu = result["disclosure"].get("gpu", "none")
    return f"ioattn serve, {result['settings']['model']}, {'CPU' if gpu == 'none' else gpu}"


def replot(path: str) -> int:
    with open(path) as f:
        result = json.load(f)
    if "sweep" not in result:
        print(f"ioattn bench serve: error: {path} holds no request-rate sweep", file=sys.stderr)
        return 2
    png = os.path.splitext(path)[0] + ".png"
    plot_sweep(result["sweep"], png, sweep_title(result))
    print(png)
    return 0


def plot_sweep(runs: list[dict], path, title: str) -> None:
    """TTFT and TPOT (median and P99) against output throughput, one point per request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    throughput = [run["output_throughput"] for run in runs]
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            values = [run[f"{stat}_{metric}_ms"] for run in runs]
            ax.plot(throughput, values, style, label=f"{'P99' if stat == 'p99' else 'median'} {metric.upper()}")
        for run, x in zip(runs, throughput):
            ax.annotate(f"{run['request_rate']:g}/s", (x, run[f"median_{metric}_ms"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + ": latency against throughput (points: request rates)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(rate) for rate in text.split(",")]
    except ValueError:
        rates = []
    if not rates or any(not rate > 0 for rate in rates) or len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"--request-rate takes a rate > 0 (or inf), or distinct comma-separated "
                                         f"rates, got {text!r}")
    return rates


def _slo(text: str) -> tuple[str, float]:
    name, _, bound = text.partition(":")
    try:
        value = float(bound)
    except ValueError:
        value = math.nan
    if name not in SLO_METRICS or not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"--goodput takes METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} and "
                                         f"MS > 0 milliseconds, got {text!r}")
    return name, value


if __name__ == "__main__":
    sys.exit(main())
