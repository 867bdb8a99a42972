"""The serving workload every `ioattn bench serve` system runs (server and offline alike): requests, their arrival
times, each request's result and the summary of a run.

The summary has vLLM's `benchmark_serving` names (`request_throughput`, `output_throughput`,
`total_token_throughput`, `request_goodput`, and `mean_/median_/std_/p99_` of `ttft_ms`, `tpot_ms`, `itl_ms`,
`e2el_ms`), with their meanings: TTFT from sending to the first chunk, TPOT (latency - TTFT) / (tokens - 1) per
request, ITL every gap between consecutive chunks of a request (pooled over requests), E2EL the whole latency;
goodput counts the completed requests within every given SLO (a request with one token has no TPOT and meets a
TPOT SLO). It also keeps the names this project's earlier results and the offline systems use
(`output_tokens_per_s`, `ttft_ms_p50`, `latency_ms_p99`, ...). Percentiles are nearest-rank.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from statistics import mean, pstdev

# Ids every vocabulary has (the byte range of the byte-level tokenizer of the presets, and of any real one).
PROMPT_ID_RANGE = 256


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None  # the text the ids encode (sent as text to a server, so that it tokenizes)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks (streamed runs)

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


# The warm-up every system runs before its measured requests (server and offline alike): as many prompts of the
# workload's length range, a few output tokens each, so that every kernel specialization and torch path the
# measured run takes is compiled before the clock starts.
WARMUP_REQUESTS = 32
WARMUP_OUTPUT_LEN = 4
# Far from the seeds a request-rate sweep gives its rates (seed + rate index): no warm-up prompt is a measured one.
WARMUP_SEED_OFFSET = 1_000_003


def warmup_workload(work: list[WorkItem], seed: int) -> list[WorkItem]:
    """Prompts of the workload's length range, different from its own (no prefix-cache hits on the measured run)."""
    lengths = [len(w.prompt_token_ids) for w in work]
    count = min(len(work), WARMUP_REQUESTS)
    return make_workload(count, (min(lengths), max(lengths)), (WARMUP_OUTPUT_LEN, WARMUP_OUTPUT_LEN),
                         seed + WARMUP_SEED_OFFSET)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


# Service-level objectives `--goodput` takes: metric -> the Result field it bounds (seconds).
SLO_METRICS = ("ttft", "tpot", "e2el")


def meets(result: Result, slo_ms: dict[str, float]) -> bool:
    """Whether a completed request is within every SLO (milliseconds, by SLO_METRICS name)."""
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.latency}
    return all(values[name] is None or values[name] * 1e3 <= bound for name, bound in slo_ms.items())


def summarize(results: list[Result], duration: float, slo_ms: dict[str, float] | None = None,
              input_tokens: int | None = None) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "requests_per_s": len(done) / duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
        "request_throughput": len(done) / duration, "output_throughput": tokens / duration,
    }
    if input_tokens is not None:
        summary["total_input_tokens"] = input_tokens
        summary["total_token_throughput"] = (input_tokens + tokens) / duration
    if slo_ms:
        summary["goodput_slo_ms"] = dict(slo_ms)
        summary["request_goodput"] = sum(meets(r, slo_ms) for r in done) / duration
    series = {"ttft": [r.ttft * 1e3 for r in done], "tpot": [r.tpot * 1e3 for r in done if r.tpot is not None],
              "itl": [gap * 1e3 for r in done for gap in r.itl], "e2el": [r.latency * 1e3 for r in done]}
    for name, values in series.items():
        if name == "itl" and not values:
            continue  # offline systems and non-streamed runs see no chunks
        summary[f"mean_{name}_ms"] = mean(values) if values else None
        summary[f"median_{name}_ms"] = percentile(values, 50)
        summary[f"std_{name}_ms"] = pstdev(values) if values else None
        summary[f"p99_{name}_ms"] = percentile(values, 99)
    for name, vllm_name in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("latency_ms", "e2el")):
        summary[f"{name}_mean"] = summary[f"mean_{vllm_name}_ms"]
        summary[f"{name}_p50"] = summary[f"median_{vllm_name}_ms"]
        summary[f"{name}_p99"] = summary[f"p99_{vllm_name}_ms"]
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def step_times(steps: int, step_seconds: float, device_wait_seconds: float, duration: float) -> dict:
    """An engine's steps over a run: their mean wall time, the share of it spent waiting for sampled tokens to
    reach the host (small: the device was done before the host asked, so the host's work sets the step rate,
    unless a synchronizing call elsewhere in the step hides the wait), and the run's share spent inside steps (the
    rest: the loop around them, or an engine idle while requests were on their way)."""
    if not steps or step_seconds <= 0:
        return {"steps": steps, "step_ms_mean": None, "step_token_wait_share": None, "step_time_share": None}
    return {"steps": steps, "step_ms_mean": 1e3 * step_seconds / steps,
            "step_token_wait_share": device_wait_seconds / step_seconds,
            "step_time_share": step_seconds / duration if duration > 0 else None}


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process (the first at 0), or all at 0."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    offsets = [0.0]
    for _ in range(num_requests - 1):
        offsets.append(offsets[-1] + rng.expovariate(request_rate))
    return offsets
