"""`ioattn bench serve`: drive an OpenAI-compatible server with a synthetic workload; compare with offline.

    ioattn bench serve --url http://127.0.0.1:8000                    # a running server (any OpenAI-compatible one)
    ioattn bench serve --launch --offline --model llama3-8b-shape     # start `ioattn serve`, then LLM.generate

Workload: `--num-requests` prompts of random token ids (lengths uniform in `--input-len MIN MAX`, exact: they are
sent as token ids), each asking for `--output-len` tokens (or uniform in `--output-len MIN MAX`) with
`ignore_eos` (vLLM's extension) so every request generates exactly its length; greedy by default. Requests
arrive as a Poisson process at `--request-rate` per second (default: all at once), or are kept at
`--concurrency` in flight. Every request streams (SSE) with usage; the client records TTFT (first chunk),
TPOT ((latency - TTFT) / (tokens - 1)) and latency; output throughput is all generated tokens over the wall
time from the first send to the last response.

`--offline` runs the same requests through `ioattn.LLM.generate` in this process (all submitted at once) and
reports server throughput / offline throughput: the server's overhead (goal >= 0.9). With `--launch` the server
is this package's own, started as a subprocess with the same engine settings and stopped before the offline
run, so the two never share the device. A warm-up request precedes each measured run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from statistics import mean

# Ids every vocabulary has (the byte range of the byte-level tokenizer of the presets, and of any real one).
PROMPT_ID_RANGE = 256


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[WorkItem]:
    rng = random.Random(seed)
    return [
        WorkItem([rng.randrange(PROMPT_ID_RANGE) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
        for _ in range(num_requests)
    ]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def summarize(results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "requests_per_s": len(done) / duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
    }
    for name, values in (("ttft_ms", [r.ttft * 1e3 for r in done]),
                         ("tpot_ms", [r.tpot * 1e3 for r in done if r.tpot is not None]),
                         ("latency_ms", [r.latency * 1e3 for r in done])):
        summary[f"{name}_mean"] = mean(values) if values else None
        summary[f"{name}_p50"] = percentile(values, 50)
        summary[f"{name}_p99"] = percentile(values, 99)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


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
        rng = random.Random(seed + 1)

        async def run(item: WorkItem) -> Result:
            async with gate:
                return await _one_request(client, url, model, item, temperature)

        start = time.perf_counter()
        tasks = []
        for item in work:
            tasks.append(asyncio.create_task(run(item)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
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


def run_offline(work: list[WorkItem], args) -> dict:
    from ioattn.engine.llm import LLM
    from ioattn.engine.sampling import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_blocks=args.num_blocks,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs, device=args.device)
    params = [SamplingParams(max_tokens=item.output_len, ignore_eos=True, temperature=args.temperature)
              for item in work]
    llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=[item.prompt_token_ids for item in work], sampling_params=params,
                           use_tqdm=False)
    duration = time.perf_counter() - start
    results = []
    for output in outputs:
        if output.error is not None:
            results.append(Result(False, error=output.error))
            continue
        m = output.metrics
        results.append(Result(True, ttft=m.time_to_first_token, latency=m.finished_time - m.arrival_time,
                              output_tokens=len(output.outputs[0].token_ids)))
    stats = llm.engine.stats()
    return {**summarize(results, duration), "preemptions": stats["preemptions"],
            "prefix_hit_rate": stats["kv"].prefix_hit_rate}


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
    if args.offline:
        result["offline"] = run_offline(work, args)
    if "server" in result and "offline" in result:
        result["server_over_offline"] = (result["server"]["output_tokens_per_s"]
                                         / result["offline"]["output_tokens_per_s"])
        if args.request_rate != float("inf") or args.concurrency:
            result["ratio_note"] = ("offline submits every request at once; with --request-rate or --concurrency "
                                    "the server run saw a lighter load, so the ratio is not the server's overhead")
    return result


def to_markdown(result: dict) -> str:
    from ioattn.bench.harness import markdown_table

    keys = ["completed", "failed", "duration_s", "requests_per_s", "output_tokens_per_s", "ttft_ms_p50",
            "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "latency_ms_p50", "latency_ms_p99"]
    runs = [name for name in ("server", "offline") if name in result]
    text = markdown_table(["metric", *runs], [[key, *(result[name].get(key) for name in runs)] for key in keys])
    if "server_over_offline" in result:
        text += f"\n\nserver / offline output throughput: {result['server_over_offline']:.3f} (goal >= 0.9)"
        if "ratio_note" in result:
            text += f"\n\nnote: {result['ratio_note']}"
    for name in runs:
        for key in ("errors", "server_counters"):
            if key in result[name]:
                text += f"\n\n{name} {key}: {result[name][key]}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ioattn bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true", help="start `ioattn serve --model MODEL` for the run")
    parser.add_argument("--offline", action="store_true", help="also run the workload through LLM.generate")
    parser.add_argument("--model", default="tiny", help="checkpoint or preset for --launch / --offline")
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
    engine = parser.add_argument_group("engine settings (--launch and --offline)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--device", default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--num-blocks", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for the server")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--out", help="directory for commit-ready <date>-serve-<device>.{json,md} with disclosure")
    args = parser.parse_args(argv)
    if not (args.url or args.launch or args.offline):
        parser.error("give --url, --launch or --offline")
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
        disclosure["timing"] = "wall clock (time.perf_counter) on the client; percentiles nearest-rank"
        disclosure["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
        result = {"disclosure": disclosure, **result}
        payload = json.dumps(result, indent=1, default=str) + "\n"
        if args.json:
            write_text(args.json, payload)
        if args.out:
            paths = dated_paths(args.out, "serve", device_tag(disclosure))
            write_text(paths["json"], payload)
            write_text(paths["md"], f"# ioattn bench serve\n\n{disclosure_markdown(result)}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
