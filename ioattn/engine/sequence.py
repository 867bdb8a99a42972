"""A sequence's state in the engine (the KV manager's block bookkeeping for it is `ioattn.kv.ledger.BlockLedger`).

A request owns one sequence per sample: it starts with a single one holding the prompt, and when `n > 1` the
engine forks it after the prompt's first sampled token (the children share the prompt's KV blocks). The
scheduler works on sequences only; token ids are the prompt followed by the generated tokens, and
`num_computed_tokens` counts those whose KV is in the cache (or is being written by a launched step). Under
asynchronous scheduling the last one or two generated tokens may be `ioattn.kv.PLACEHOLDER`: sampled on the
device, not read on the host yet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no KV blocks: not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its blocks are in the CPU pool
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    arrival_time: float
    priority: int = 0
    index: int = 0  # which of the request's n samples
    # How many sequences this one stands for in admission: n for a prompt that will fork, 1 otherwise.
    width: int = 1
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Set when a preempted sequence is resumed and cleared once it produces a new token: it is not chosen as a
    # preemption victim in between, so that sequences cannot evict each other step after step without progress.
    resumed_without_progress: bool = False
    # Its last token (by max_tokens or the context length) is sampled but not landed yet: it finishes when the
    # token lands, whatever its value, so the scheduler gives it no further step (asynchronous scheduling).
    finishing: bool = False
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def scheduling_key(self, by_priority: bool) -> tuple:
        """Sort key: served first when smaller; the largest running sequence is the preemption victim."""
        return (self.priority if by_priority else 0, self.arrival_time, self.seq_id)
