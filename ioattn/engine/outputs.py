"""What the engine hands back (vLLM's `RequestOutput` shape): a request's completions so far and its timings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Per-request timings, in `time.monotonic()` seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        """Mean gap between output tokens after the first (TPOT); None with fewer than two tokens."""
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the request's own list, shared by all its outputs: read it, do not mutate it
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set (and finished True, outputs empty) when the request was refused: the message says why.
    error: str | None = None
