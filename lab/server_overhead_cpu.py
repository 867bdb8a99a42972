"""Where does `ioattn serve` spend CPU per streamed token, and how close does it come to the offline engine?

The H200 bar (W2 6/7) is server output tok/s / offline output tok/s >= 0.9 at ~8000 tok/s over 256 streams: every
per-token cost of the HTTP process, the engine-core process's output sending and the benchmark client must stay
at tens of µs. Without a GPU, this script makes the engine nearly free (a 1-layer, hidden-64 random Llama on the
CPU, one step of 256 sequences in a few ms) so that the serving path is what costs, and runs one workload

- offline: `serve_offline.run_engine` on the engine in this process (what `ioattn bench serve --offline` does);
- through the server: this script started again as the HTTP process (`create_app` + uvicorn, as `ioattn serve`
  runs them), which spawns its engine-core process; the client is `ioattn bench serve`'s own (`serve_online`),
  streaming over HTTP on loopback from this process.

Reported: output tok/s of both and their ratio, and CPU µs per output token of each process (the HTTP process and
the engine process from /proc through psutil, the client from `time.process_time`). On a 2-core machine shared by
three busy processes the wall-clock ratio is pessimistic and noisy, and CPU time itself inflates with a
neighbour's load; the per-token CPU figures are what carry over to a host with a core per process. `--profile DIR`
runs the server three more times under cProfile (CPU-time clock: HTTP process, engine process, client) and writes
the top functions by own time.

`--host-paths` measures instead each host path alone in this process, with no sockets and no process competing
(steadier; see `host_paths`): the offline engine, the engine process's loop on the same engine, and the HTTP
process's handling of what that loop sent (uvicorn, starlette and the sockets left out).

    PYTHONPATH=. python3 lab/server_overhead_cpu.py [--requests 256] [--output-len 256] [--repeat 3]
        [--host-paths] [--profile DIR] [--out bench/results/<date>-server-overhead-cpu]

writes OUT.json and OUT.md (with the disclosure: machine, versions, commit, command). ~1 minute per repeat on two
cores. To compare commits, put each one's package in a folder (`git archive <commit> ioattn | tar -x -C DIR`) and
run this script with PYTHONPATH=DIR, alternating the folders (the script only uses names every compared commit has).
Beyond the benchmark hooks it reaches into private names (`serve_online._drive`, `EngineCore._apply/_step/_send`,
`EngineClient._handle`, `Server._events`): the paths it measures have no public handle; a rename breaks it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from ioattn.server.core import EngineSpec

MODEL_NAME = "micro"
MAX_MODEL_LEN = 512


def micro_config():
    from ioattn.models.config import ModelConfig
    from ioattn.models.tokenizer import ByteTokenizer

    tokens = ByteTokenizer()
    # vocab 512 as `tiny`: about half the sampled ids are past the byte range and decode to nothing, as most of
    # llama3-8b-shape's do.
    return ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=4096, bos_token_id=tokens.bos_token_id,
                       eos_token_ids=tokens.eos_token_ids)


def engine_config(num_requests: int):
    from ioattn.engine.config import EngineConfig

    return EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=num_requests, num_blocks=num_requests * 40,
                        device="cpu", dtype="float32")


@dataclass(frozen=True)
class MicroSpec(EngineSpec):
    """The micro engine; with `profile` set, the engine process runs under cProfile and writes its stats there at
    exit."""

    profile: str | None = None

    def build(self):
        import torch

        from ioattn.engine.llm_engine import LLMEngine
        from ioattn.models.presets import RandomPreset

        torch.set_num_threads(1)
        loaded = RandomPreset(micro_config(), seed=0, draw_on_cpu=True, summary="").load(dtype=torch.float32,
                                                                                         device="cpu")
        engine = LLMEngine(loaded, self.config)
        if self.profile:
            _profile_until_exit(self.profile)
        return engine


def _profile_until_exit(path: str) -> None:
    import atexit
    import cProfile

    profiler = cProfile.Profile(time.process_time)  # CPU time: a process descheduled in a call is not charged
    profiler.enable()
    atexit.register(lambda: (profiler.disable(), profiler.dump_stats(path)))


# -- the HTTP process (this script run with --serve) ------------------------------------------------------------


def serve(port: int, num_requests: int, profile_http: str | None, profile_engine: str | None) -> None:
    import gc

    import uvicorn

    from ioattn.models.tokenizer import ByteTokenizer
    from ioattn.server.app import create_app
    from ioattn.server.security import ServerLimits

    spec = MicroSpec(MODEL_NAME, engine_config(num_requests), log_level="warning", profile=profile_engine)
    app = create_app(spec, served_model_name=MODEL_NAME, tokenizer=ByteTokenizer(),
                     limits=ServerLimits(max_queued_requests=max(1024, 2 * num_requests)))
    gc.collect()
    gc.freeze()  # as `ioattn serve` does
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=30,
                            backlog=4096)
    server = uvicorn.Server(config)
    # uvicorn raises SIGTERM again once drained: a quiet handler lets this process end normally (and write its
    # profile), as `ioattn serve` does.
    signal.signal(signal.SIGTERM, lambda *_: None)
    if profile_http:
        _profile_until_exit(profile_http)
    server.run()


# -- the runs ----------------------------------------------------------------------------------------------------


def workload(args):
    from ioattn.bench.workload import make_workload

    return make_workload(args.requests, (args.input_len[0], args.input_len[1]), (args.output_len, args.output_len),
                         seed=0)


def run_offline(args) -> dict:
    from ioattn.bench.serve_offline import Pacing, run_engine
    from ioattn.bench.workload import make_workload

    engine = MicroSpec(MODEL_NAME, engine_config(args.requests)).build()
    warmup = make_workload(16, (4, 32), (4, 8), seed=1)
    run_engine(engine, warmup, 0.0, Pacing.all_at_once(warmup))
    work = workload(args)
    cpu = time.process_time()
    result = run_engine(engine, work, 0.0, Pacing.all_at_once(work))
    cpu = time.process_time() - cpu
    return {"output_tokens_per_s": result["output_tokens_per_s"], "duration_s": result["duration_s"],
            "output_tokens": result["output_tokens"], "median_ttft_ms": result["median_ttft_ms"],
            "cpu_us_per_token": 1e6 * cpu / result["output_tokens"]}


def run_server(args, profile_http: str | None = None, profile_engine: str | None = None,
               profile_client: str | None = None) -> dict:
    import socket

    import httpx
    import psutil

    from ioattn.bench.serve_online import _drive
    from ioattn.bench.workload import summarize

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, os.path.abspath(__file__), "--serve", str(port), "--requests", str(args.requests)]
    if profile_http:
        command += ["--profile-http", profile_http]
    if profile_engine:
        command += ["--profile-engine", profile_engine]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        http = psutil.Process(process.pid)
        (engine,) = [child for child in http.children() if "resource_tracker" not in " ".join(child.cmdline())]
        work = workload(args)
        # The warm-up: the same as the measured run's first steps, so both processes have run every path once.
        asyncio.run(_drive(url, MODEL_NAME, work[:16], float("inf"), None, 0.0, 0, {}))

        def cpu(p):
            times = p.cpu_times()
            return times.user + times.system

        before = {"http": cpu(http), "engine": cpu(engine), "client": time.process_time()}
        if profile_client:
            import cProfile

            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
        results, duration = asyncio.run(_drive(url, MODEL_NAME, work, float("inf"), None, 0.0, 0, {}))
        if profile_client:
            profiler.disable()
            profiler.dump_stats(profile_client)
        after = {"http": cpu(http), "engine": cpu(engine), "client": time.process_time()}
    finally:
        process.terminate()
        process.wait(timeout=60)
    summary = summarize(results, duration, None, sum(len(item.prompt_token_ids) for item in work))
    tokens = summary["output_tokens"]
    assert summary["failed"] == 0, [r.error for r in results if not r.ok][:3]
    return {"output_tokens_per_s": summary["output_tokens_per_s"], "duration_s": duration, "output_tokens": tokens,
            "median_ttft_ms": summary["median_ttft_ms"],
            "cpu_us_per_token": {name: 1e6 * (after[name] - before[name]) / tokens for name in before}}


# -- the two host paths alone, in this process -------------------------------------------------------------------


class _Sink:
    """A socket that keeps what is sent through it."""

    def __init__(self):
        self.frames = []

    def send(self, frame, copy=True):
        self.frames.append(bytes(frame))


def engine_core_path(engine, work) -> tuple[float, list[bytes]]:
    """CPU seconds of the engine process's loop over `work` (`EngineCore` adding every request, then stepping and
    encoding each step's outputs, as its `run` does), and the frames it sent."""
    import zmq

    from ioattn.engine.sampling import SamplingParams
    from ioattn.server import transport as wire
    from ioattn.server.core import EngineCore

    context = zmq.Context()
    inputs, sink = context.socket(zmq.PULL), _Sink()
    try:
        core = EngineCore(engine, inputs, sink)
        tokenizer, engine.tokenizer = engine.tokenizer, None  # the engine process has none
        adds = [wire.AddRequest(f"req-{i}", item.prompt_token_ids, SamplingParams(
                max_tokens=item.output_len, ignore_eos=True, temperature=0.0), time.monotonic())
                for i, item in enumerate(work)]
        cpu = time.process_time()
        core._apply(wire.Inputs(adds=adds, aborts=[]))
        core._send(wire.Outputs(accepted=core.accepted, refused=core.refused))
        while engine.has_unfinished_requests():
            core._step()
        cpu = time.process_time() - cpu
        engine.tokenizer = tokenizer
    finally:
        inputs.close(linger=0)
        context.term()
    return cpu, sink.frames


async def http_path(frames: list[bytes], work) -> float:
    """CPU seconds of the HTTP process's handling of `frames` (what `engine_core_path` sent for `work`): one
    submission per request, the engine client applying each message (detokenizing, stop checks, metrics), every
    request's SSE generator formatting its chunks. uvicorn, starlette and the sockets are not in it."""
    from ioattn.models.tokenizer import ByteTokenizer
    from ioattn.server import transport as wire
    from ioattn.server.app import Server
    from ioattn.server.chat_template import ChatTemplate
    from ioattn.server.client import EngineClient
    from ioattn.server.metrics import ServerMetrics
    from ioattn.server.responses import CompletionFormatter
    from ioattn.server.security import ServerLimits

    tokenizer = ByteTokenizer()
    client = EngineClient(MicroSpec(MODEL_NAME), tokenizer, ServerMetrics(), max_queued_requests=2 * len(work))
    client.loop, client.state, client.to_engine = asyncio.get_running_loop(), "ready", _Sink()
    client.info = wire.EngineInfo(model=MODEL_NAME, dtype="float32", device="cpu", vocab_size=512,
                                  max_model_len=MAX_MODEL_LEN, max_num_seqs=len(work), eos_token_ids=[257],
                                  block_size=16, num_blocks=1, kv_cache_bytes=0, cache_dtype=None,
                                  attention_backend="torch", tensor_parallel_size=1, pid=0)
    server = Server(client, MODEL_NAME, ChatTemplate.plain(), tokenizer, ServerLimits())
    decoder = wire.decoder(wire.FromEngine)
    streamed = [0]

    async def listen(submission, formatter):
        async for event in server._events(submission, formatter):
            streamed[0] += len(event)

    from ioattn.engine.sampling import SamplingParams

    cpu = time.process_time()
    listeners = []
    for i, item in enumerate(work):
        params = SamplingParams(max_tokens=item.output_len, ignore_eos=True, temperature=0.0)
        submission = client.submit([(item.prompt_token_ids, params)])
        formatter = CompletionFormatter(f"cmpl-{i}", MODEL_NAME, tokenizer, [len(item.prompt_token_ids)], 1, None,
                                        True)
        listeners.append(asyncio.ensure_future(listen(submission, formatter)))
    for frame in frames:
        client._handle(decoder.decode(frame))
        await asyncio.sleep(0)  # every handler woken by this message formats its chunks
    await asyncio.gather(*listeners)
    cpu = time.process_time() - cpu
    assert streamed[0] > 0
    return cpu


def host_paths(args) -> dict:
    """CPU µs per output token of each host path alone, in this process, alternating over `--repeat` rounds (the
    minimum of each: the least disturbed by a neighbour): the offline engine (`run_engine`), the engine process's
    loop on the same engine, and the HTTP process's handling of what that loop sent."""
    from ioattn.bench.serve_offline import Pacing, run_engine
    from ioattn.bench.workload import make_workload

    engine = MicroSpec(MODEL_NAME, engine_config(args.requests)).build()
    warmup = make_workload(16, (4, 32), (4, 8), seed=1)
    run_engine(engine, warmup, 0.0, Pacing.all_at_once(warmup))
    rounds = []
    for round_ in range(args.repeat):
        # Fresh prompts for every run: none is found in the prefix cache from an earlier one.
        offline_work, core_work = (make_workload(args.requests, tuple(args.input_len), (args.output_len,) * 2,
                                                 seed=100 + 2 * round_ + k) for k in (0, 1))
        cpu = time.process_time()
        run_engine(engine, offline_work, 0.0, Pacing.all_at_once(offline_work))
        offline = time.process_time() - cpu
        core, frames = engine_core_path(engine, core_work)
        http = asyncio.run(http_path(frames, core_work))
        tokens = sum(item.output_len for item in core_work)
        rounds.append({"offline_engine": offline, "engine_process": core, "http_process": http})
        rounds[-1] = {name: 1e6 * value / tokens for name, value in rounds[-1].items()}
        print(json.dumps(rounds[-1]), file=sys.stderr)
    return {"rounds": rounds, **{name: min(r[name] for r in rounds) for name in rounds[0]}}


def top_functions(path: str, count: int = 25) -> list[dict]:
    import pstats

    stats = pstats.Stats(path).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:count]
    return [{"function": f"{os.path.basename(file)}:{line}({name})", "calls": calls, "own_s": round(own, 4),
             "cumulative_s": round(cumulative, 4)}
            for (file, line, name), (_, calls, own, cumulative, _) in rows]


def disclosure() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    versions = {}
    for name in ("fastapi", "starlette", "uvicorn", "pydantic", "msgspec", "pyzmq", "httpx", "uvloop", "httptools"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = None
    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "packages": versions, "commit": commit,
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def to_markdown(result: dict) -> str:
    server, offline = result["server"], result["offline"]
    cpu = server["cpu_us_per_token"]
    lines = [
        "# Server overhead on the CPU (micro engine)", "",
        f"{result['settings']['requests']} requests, prompts {result['settings']['input_len']} ids, "
        f"{result['settings']['output_len']} output tokens each (ignore_eos, greedy), all at once.", "",
        f"Medians over {len(result['runs'])} alternating runs of each (every run: the JSON's `runs`).", "",
        "| run | output tok/s | median TTFT (ms) | CPU µs / output token |", "|---|---|---|---|",
        f"| offline (engine in one process) | {offline['output_tokens_per_s']:.0f} | "
        f"{offline['median_ttft_ms']:.0f} | {offline['cpu_us_per_token']:.1f} |",
        f"| server (HTTP + engine + client) | {server['output_tokens_per_s']:.0f} | {server['median_ttft_ms']:.0f} | "
        f"HTTP {cpu['http']:.1f}, engine {cpu['engine']:.1f}, client {cpu['client']:.1f} |", "",
        f"server / offline: {result['server_over_offline']:.3f} (median of the runs' ratios: "
        f"{', '.join(format(run['server_over_offline'], '.3f') for run in result['runs'])})", "",
    ]
    for name in ("http", "engine", "client"):
        rows = result.get("profile", {}).get(name)
        if rows:
            lines += [f"## {name} process under cProfile: top functions by own time", "",
                      "| function | calls | own s | cumulative s |", "|---|---|---|---|"]
            lines += [f"| `{r['function']}` | {r['calls']} | {r['own_s']} | {r['cumulative_s']} |" for r in rows]
            lines.append("")
    lines += ["## Disclosure", "", "```", json.dumps(result["disclosure"], indent=2), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (medians are reported)")
    parser.add_argument("--host-paths", action="store_true",
                        help="instead: each host path alone in this process (see host_paths)")
    parser.add_argument("--profile", help="a folder: profile the HTTP and engine processes in two more runs")
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the HTTP process, on this port
    parser.add_argument("--profile-http", help=argparse.SUPPRESS)
    parser.add_argument("--profile-engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.requests, args.profile_http, args.profile_engine)
        return
    result = {"settings": {"requests": args.requests, "input_len": list(args.input_len),
                           "output_len": args.output_len}, "disclosure": disclosure()}
    if args.host_paths:
        result["host_paths"] = host_paths(args)
        print(json.dumps({k: v for k, v in result["host_paths"].items() if k != "rounds"}), file=sys.stderr)
        if args.out:
            with open(args.out + ".json", "w") as f:
                json.dump(result, f, indent=2)
        return
    # The runs alternate (offline, server, offline, ...) so that a neighbour's load on the shared cores falls on
    # both alike; each figure reported is the median over the repeats.
    runs = []
    for _ in range(args.repeat):
        offline, server = run_offline(args), run_server(args)
        runs.append({"offline": offline, "server": server,
                     "server_over_offline": server["output_tokens_per_s"] / offline["output_tokens_per_s"]})
        print(json.dumps(runs[-1]), file=sys.stderr)
    result["runs"] = runs
    result["offline"] = {key: statistics.median(run["offline"][key] for run in runs) for key in runs[0]["offline"]}
    result["server"] = {key: statistics.median(run["server"][key] for run in runs)
                        for key in runs[0]["server"] if key != "cpu_us_per_token"}
    result["server"]["cpu_us_per_token"] = {name: statistics.median(run["server"]["cpu_us_per_token"][name]
                                                                    for run in runs)
                                            for name in runs[0]["server"]["cpu_us_per_token"]}
    result["server_over_offline"] = statistics.median(run["server_over_offline"] for run in runs)
    print(json.dumps({k: result[k] for k in ("offline", "server", "server_over_offline")}), file=sys.stderr)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        result["profile"] = {}
        for name in ("http", "engine", "client"):
            path = os.path.join(args.profile, f"{name}.prof")
            run_server(args, **{f"profile_{name}": path})
            result["profile"][name] = top_functions(path)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(to_markdown(result))


if __name__ == "__main__":
    main()
