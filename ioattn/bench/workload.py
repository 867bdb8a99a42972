"""The synthetic serving workload every `ioattn bench serve` system runs (server and offline alike): requests,
their arrival times, each request's result and the summary of a run (throughput, TTFT, TPOT, latency)."""

from __future__ import annotations

import math
import random
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


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process (the first at 0), or all at 0."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    offsets = [0.0]
    for _ in range(num_requests - 1):
        offsets.append(offsets[-1] + rng.expovariate(request_rate))
    return offsets
