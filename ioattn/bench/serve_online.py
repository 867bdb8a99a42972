"""The server half of `ioattn bench serve`: the workload through an OpenAI-compatible server over HTTP (any such
server with `--url`, or ours started for the run with `--launch`), one request rate or a sweep of them.

Every request streams its completion (SSE) with usage and `ignore_eos`; the client records TTFT (first chunk),
each gap between chunks (ITL) and the latency (E2EL); TPOT is (latency - TTFT) / (tokens - 1); throughput is over
the wall time from the first send to the last response. Each run is preceded by the warm-up workload the offline
systems run (`ioattn.bench.workload.warmup_workload`), sent at once.
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

from ioattn.bench.datasets import build_workload
from ioattn.bench.workload import Result, WorkItem, arrival_offsets, step_times, summarize, warmup_workload

# -- the server run ------------------------------------------------------------------------------------------


async def _one_request(session, url: str, model: str, item: WorkItem, temperature: float,
                       headers: dict) -> Result:
    prompt = item.prompt if item.prompt is not None else item.prompt_token_ids
    body = {"model": model, "prompt": prompt, "max_tokens": item.output_len, "stream": True,
            "temperature": temperature, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens, last, gaps = None, 0, None, []
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                return Result(False, error=f"HTTP {response.status}: {(await response.read())[:200]!r}")
            pending = b""
            async for piece in response.content.iter_any():  # the bytes that arrived, split into SSE lines
                *lines, pending = (pending + piece).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[len(b"data: "):])
                    if "error" in chunk:
                        return Result(False, error=str(chunk["error"].get("message")))
                    if chunk.get("choices"):
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - start
                        else:
                            gaps.append(now - last)
                        last = now
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except Exception as error:  # a failed request is counted and reported, the run goes on
        return Result(False, error=f"{type(error).__name__}: {error}")
    latency = time.perf_counter() - start
    return Result(True, ttft=latency if ttft is None else ttft, latency=latency, output_tokens=tokens, itl=gaps)


def _session(limit: int):
    # aiohttp, as vLLM's benchmark client: httpx's pool rescans every connection as each request starts and ends
    # and its parser costs ~55 µs of client CPU per chunk at 256 streams, so the client fell behind the server it
    # measured (bench/results/2026-12-06-server-overhead-cpu.md).
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=None, connect=60))


async def _warm_up(url: str, model: str, warmup: list[WorkItem], temperature: float, headers: dict) -> None:
    """The offline systems' warm-up, sent at once: the measured run then compiles nothing (a server that starts
    cold otherwise pays its kernel specializations inside the clock, which the offline run does not)."""
    async with _session(len(warmup)) as session:
        await asyncio.gather(*(_one_request(session, url, model, item, temperature, headers) for item in warmup))


async def _drive(url: str, model: str, work: list[WorkItem], request_rate: float, concurrency: int | None,
                 temperature: float, seed: int, headers: dict) -> tuple[list[Result], float]:
    limit = concurrency or len(work)
    async with _session(limit) as session:
        gate = asyncio.Semaphore(limit)

        async def run(item: WorkItem) -> Result:
            async with gate:
                return await _one_request(session, url, model, item, temperature, headers)

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
                  "ioattn_generation_tokens_total", "ioattn_engine_steps_total", "ioattn_engine_step_seconds_total",
                  "ioattn_engine_device_wait_seconds_total")
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}
    except Exception:
        return {}


def served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_server(url: str, model: str | None, work: list[WorkItem], args, request_rate: float) -> dict:
    model = model or served_model(url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    asyncio.run(_warm_up(url, model, warmup_workload(work, args.seed), args.temperature, headers))
    before = server_metrics(url)  # after the warm-up: the counters cover the measured requests alone
    results, duration = asyncio.run(_drive(url, model, work, request_rate, args.concurrency, args.temperature,
                                           args.seed, headers))
    after = server_metrics(url)
    summary = summarize(results, duration, args.goodput, sum(len(item.prompt_token_ids) for item in work))
    counters = {name.removeprefix("ioattn_"): after[name] - before.get(name, 0.0) for name in after}
    if not counters:
        return summary
    steps = step_times(int(counters.get("engine_steps_total", 0)), counters.get("engine_step_seconds_total", 0.0),
                       counters.get("engine_device_wait_seconds_total", 0.0), duration)
    return {**summary, "server_counters": counters, **steps}


def run_sweep(url: str, model: str | None, args, partial_path: str | None = None) -> list[dict]:
    """The workload at each of `args.request_rates`, in order, against one server. Rate i draws its prompts with
    seed + i: the same distribution, none found in the prefix cache from an earlier rate. Each rate's summary is
    appended to `partial_path` (JSON lines) as soon as it is done, so a run cut short keeps what it measured."""
    runs = []
    for index, rate in enumerate(args.request_rates):
        work, _ = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + index}))
        run = {"request_rate": rate, **run_server(url, model, work, args, rate)}
        runs.append(run)
        print(f"request rate {rate:g}/s: {run['output_throughput']:.1f} output tok/s, TTFT median / P99 "
              f"{run['median_ttft_ms']:.0f} / {run['p99_ttft_ms']:.0f} ms, TPOT median / P99 "
              f"{run['median_tpot_ms'] or 0:.1f} / {run['p99_tpot_ms'] or 0:.1f} ms", file=sys.stderr)
        if partial_path:
            with open(partial_path, "a") as f:
                f.write(json.dumps(run, default=str) + "\n")
    return runs


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
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    return flags


def launch_server(args) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "ioattn.server.cli", "serve", "--model", args.model, "--port", str(port),
               "--log-level", "warning", "--max-queued-requests", str(max(1024, 2 * args.num_requests)),
               *_engine_flags(args)]
    env = {**os.environ, "IOATTN_API_KEY": args.api_key} if args.api_key else None
    process = subprocess.Popen(command, env=env)
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
