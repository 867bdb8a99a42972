"""`ioattn bench serve`: a synthetic serving workload through a server and/or offline systems, side by side.

    ioattn bench serve --url http://127.0.0.1:8000                    # a running server (any OpenAI-compatible one)
    ioattn bench serve --launch --offline --model llama3-8b-shape     # start `ioattn serve`, then ioattn.LLM
    ioattn bench serve --compare ioattn,static,hf --model llama3-8b-shape --out bench/results
    ioattn bench serve --tp 1,2 --model llama3-8b-shape                # the same workload at TP 1 and TP 2
    ioattn bench serve --disagg --model llama3-8b-shape --input-len 1024 2048 --output-len 32 --concurrency 16

Workload: `--num-requests` prompts of random token ids (lengths uniform in `--input-len MIN MAX`, exact: they are
sent as token ids), each asking for `--output-len` tokens (or uniform in `--output-len MIN MAX`) with
`ignore_eos` (vLLM's extension) so every request generates exactly its length; greedy by default. Requests
arrive as a Poisson process at `--request-rate` per second (default: all at once), or are kept at
`--concurrency` in flight. Every request streams (SSE) with usage; the client records TTFT (first chunk),
TPOT ((latency - TTFT) / (tokens - 1)) and latency; output throughput is all generated tokens over the wall
time from the first send to the last response.

`--compare` runs the same requests offline, all submitted at once, through ioattn's continuous batching
(`ioattn`), its static-batching baseline (`static`) and transformers' continuous batching (`hf`), and reports
ours / each peer, plus a batch-B decode step against its roofline bound: see `ioattn.bench.serve_offline`.
`--offline` is the `ioattn` system alone; with a server run it reports server throughput / offline throughput,
the server's overhead (goal >= 0.9). With `--launch` the server is this package's own, started as a subprocess
with the same engine settings and stopped before the offline runs, so they never share the device. A warm-up
request precedes each measured run.

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
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

from ioattn.bench.workload import Result, WorkItem, arrival_offsets, make_workload, summarize

# -- the server run ------------------------------------------------------------------------------------------


async def _one_request(client, url: str, model: str, item: WorkItem, temperature: float) -> Result:
    body = {"model": model, "prompt": item.prompt_token_ids, "max_tokens": item.output_len, "stream": True,
            "temperature": temperature, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Result(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"].get("message")))
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as error:  # a failed request is counted and reported, the run goes on
        return Result(False, error=f"{type(error).__name__}: {error}")
    latency = time.perf_counter() - start
    return Result(True, ttft=latency if ttft is None else ttft, latency=latency, output_tokens=tokens)


async def _drive(url: str, model: str, work: list[WorkItem], request_rate: float, concurrency: int | None,
                 temperature: float, seed: int) -> tuple[list[Result], float]:
    import httpx

    limit = concurrency or len(work)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60), limits=limits) as client:
        await _one_request(client, url, model, WorkItem([1, 2, 3, 4], 4), temperature)  # warm-up
        gate = asyncio.Semaphore(limit)

        async def run(item: WorkItem) -> Result:
            async with gate:
                return await _one_request(client, url, model, item, temperature)

        start = time.perf_counter()
        tasks = []
        for item, offset in zip(work, arrival_offsets(len(work), request_rate, seed)):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(run(item)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def server_metrics(url: str) -> dict[str, float]:
    """The server's own counters, when it exposes ioattn's /metrics (other servers: empty)."""
    import httpx

    try:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(url + "/metrics", timeout=10).text
        wanted = ("ioattn_num_preemptions_total", "ioattn_prefix_cache_hits_total", "ioattn_prefix_cache_queries_total",
                  "ioattn_generation_tokens_total")
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}
    except Exception:
        return {}


def served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_server(url: str, model: str | None, work: list[WorkItem], args) -> dict:
    model = model or served_model(url)
    before = server_metrics(url)
    results, duration = asyncio.run(_drive(url, model, work, args.request_rate, args.concurrency,
                                           args.temperature, args.seed))
    after = server_metrics(url)
    summary = summarize(results, duration)
    counters = {name.removeprefix("ioattn_"): after[name] - before.get(name, 0.0) for name in after}
    return {**summary, "server_counters": counters} if counters else summary


# -- launching our server, and the offline run ---------------------------------------------------------------


def _engine_flags(args) -> list[str]:
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    for name in ("max_model_len", "num_blocks", "device"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.tp != [1]:
        flags += ["--tp", str(args.tp[0])]
    if getattr(args, "no_async_scheduling", False):
        flags.append("--no-async-scheduling")
    return flags


def launch_server(args) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "ioattn.server.cli", "serve", "--model", args.model, "--port", str(port),
               "--log-level", "warning", "--max-queued-requests", str(max(1024, 2 * args.num_requests)),
               *_engine_flags(args)]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.launch_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server was not ready after {args.launch_timeout} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- command line --------------------------------------------------------------------------------------------


def run(args) -> dict:
    work = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed)
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "out")}}
    if args.url or args.launch:
        process, url = launch_server(args) if args.launch else (None, args.url.rstrip("/"))
        try:
            result["server"] = run_server(url, None if args.launch else args.served_model_name, work, args)
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


SUMMARY_KEYS = ("completed", "failed", "duration_s", "requests_per_s", "output_tokens_per_s", "ttft_ms_p50",
                "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "latency_ms_p50", "latency_ms_p99")
ENGINE_KEYS = ("preemptions", "prefix_hit_rate", "kv_utilization_mean", "kv_pool_usage_peak", "steps",
               "overlapped_steps", "shipped_blocks", "first_token_agreement")


def to_markdown(result: dict) -> str:
    from ioattn.bench.harness import fmt, markdown_table

    runs = {"server": result["server"]} if "server" in result else {}
    runs.update(result.get("systems", {}))
    keys = [key for key in (*SUMMARY_KEYS, *ENGINE_KEYS) if any(key in run for run in runs.values())]
    # A system that could not run shows why in its first cell.
    body = [[key, *(run.get(key, run.get("status") if key == keys[0] else None) for run in runs.values())]
            for key in keys]
    text = markdown_table(["metric", *runs], body)
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
    parser.add_argument("--model", default="tiny", help="tiny, llama3-8b-shape or a checkpoint folder, for --launch, "
                        "--offline and --compare")
    parser.add_argument("--served-model-name", default=None, help="`model` in requests to --url (default: the "
                        "server's first model)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs="+", default=[256], metavar="LEN",
                        help="one length, or MIN MAX for uniform lengths")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    parser.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine settings (--launch, --offline, --compare)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--device", default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--num-blocks", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--no-async-scheduling", action="store_true",
                        help="finish each engine step on the host before scheduling the next (default: overlap)")
    engine.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for the server")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--out", help="directory for commit-ready <date>-serve-<device>.{json,md} with disclosure")
    args = parser.parse_args(argv)
    if not (args.url or args.launch or args.offline or args.compare or args.disagg or len(args.tp) > 1):
        parser.error("give --url, --launch, --offline, --compare, --disagg or --tp with several sizes")
    if len(args.tp) > 1 and (args.url or args.launch or args.offline or args.compare or args.disagg):
        parser.error("--tp with several sizes is a comparison of its own: leave out --url, --launch, --offline, "
                     "--compare and --disagg")
    if args.disagg and args.tp != [1]:
        parser.error("--disagg runs one process per side: it takes no --tp")
    if args.decode_batch < 0:
        parser.error("--decode-batch must be >= 0")
    if args.url and args.launch:
        parser.error("--url and --launch are exclusive")
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
            paths = dated_paths(args.out, name, device_tag(disclosure))
            write_text(paths["json"], payload)
            write_text(paths["md"], f"# ioattn bench serve\n\n{disclosure_markdown(result)}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
