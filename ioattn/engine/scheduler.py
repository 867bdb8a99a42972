"""Iteration-level scheduler (Orca's continuous batching on vLLM's paged memory), with chunked prefill.

Every step the scheduler builds one flat batch under a token budget (`max_num_batched_tokens`) and a sequence
cap (`max_num_seqs`):

1. Running decodes first, one token each, in service order (priority, then arrival). A decode whose token needs
   a new block and finds none preempts the running sequence served last (latest arrival, or lowest priority),
   which may be itself: by recompute (its blocks are freed; it re-enters the waiting queue and later re-prefills
   prompt + output, mostly from its own cached blocks) or by swap (its blocks move to the CPU pool).
2. Running sequences still in prefill then take chunks of their prompt from what is left of the budget.
3. Swapped sequences come back (swap-in), then waiting requests are admitted, FCFS with head-of-line blocking,
   when the KV manager can allocate their prompt above its watermark; cached prefix blocks skip their prefill.
   Neither happens in a step that preempted, so memory freed by a preemption is not refilled at once.

No preemption storms: a resumed sequence is not chosen as a victim again before it has produced a new token
(unless nothing else is left to preempt), so sequences cannot evict each other in turn without progress.

`mode="static"` is the pre-vLLM baseline for comparisons: a new batch is admitted only when the previous one
has completely finished, and each sequence is admitted only if the batch's contiguous max-length reservations
(`max_model_len` tokens per sequence) fit the pool. It never preempts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ioattn.engine.sequence import Sequence, SequenceStatus
from ioattn.intmath import cdiv
from ioattn.kv import KVCacheManager

PREEMPTION_MODES = ("recompute", "swap")
POLICIES = ("fcfs", "priority")
MODES = ("continuous", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    mode: str = "continuous"

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, allowed in (("preemption_mode", PREEMPTION_MODES), ("policy", POLICIES), ("mode", MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token of budget to decode"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): a whole prompt must fit one step"
            )


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of a sequence are computed this step. `samples`: the chunk reaches the
    sequence's last token (when it was scheduled), so its logits give the next token."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu), before swap_in
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu), before the step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.copies or self.swap_out or self.swap_in)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, prefix_key=None):
        """prefix_key: the `extra_key` of every prompt's prefix-cache lookup (the KV cache's format: see
        `PagedAttention.prefix_key`)."""
        self.config = config
        self.kv = kv
        self.prefix_key = prefix_key
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        if config.preemption_mode == "swap" and kv.cpu.num_blocks == 0:
            raise ValueError('preemption_mode="swap" needs a CPU pool: construct the KV manager with '
                             'num_cpu_blocks > 0')
        self.num_preemptions = 0
        self._by_priority = config.policy == "priority"
        # Static mode: blocks promised to the current batch's max-length reservations.
        self._reserved_blocks = 0

    # -- queues --------------------------------------------------------------------------------------------

    def _key(self, seq: Sequence) -> tuple:
        return seq.scheduling_key(self._by_priority)

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._key)

    def add(self, seq: Sequence) -> None:
        self._insert(self.waiting, seq)  # first: the only step that can raise (keys that do not compare)
        seq.status = SequenceStatus.WAITING

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A running sequence's sibling sample shares all its blocks (n > 1)."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self._insert(self.running, child)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and free its blocks at once (finished or aborted)."""
        queue = {
            SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
            SequenceStatus.SWAPPED: self.swapped,
        }.get(seq.status)
        if queue is None:
            return
        queue.remove(seq)
        if seq.status is not SequenceStatus.WAITING:
            self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        if self.config.mode == "static" and not (self.running or self.swapped):
            self._reserved_blocks = 0

    def advance(self, chunk: ScheduledChunk) -> None:
        """The step computing the chunk was launched: the next schedule counts its tokens as computed (a later
        step reads their KV only after this one wrote it, in stream order)."""
        seq = chunk.seq
        seq.num_computed_tokens = chunk.end
        if chunk.samples:  # progress is a new token: a recompute only restores what it had
            seq.resumed_without_progress = False

    def commit(self, chunk: ScheduledChunk) -> None:
        """The step ran and every token of the chunk has its value on the host: its full blocks become
        prefix-cacheable. A sequence preempted or finished since its step was launched has no such blocks left
        (they were freed or swapped out with its table); a later chunk of it registers them."""
        if chunk.seq.status is SequenceStatus.RUNNING:
            self.kv.mark_computed(chunk.seq.seq_id, chunk.end)

    # -- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

        for seq in list(self.running):
            if (seq.status is SequenceStatus.RUNNING and self._needs_slot(seq) and not seq.finishing
                    and seq.seq_id not in scheduled):
                if self._reserve_slot(seq, scheduled, out):
                    budget -= self._schedule(seq, 1, scheduled, out)
        for seq in self.running:
            if budget == 0:
                break
            if seq.seq_id not in scheduled and not self._needs_slot(seq):
                budget -= self._schedule(seq, budget, scheduled, out)
        if out.preempted:
            return out
        budget = self._swap_in(budget, scheduled, out)
        if not self.swapped:
            self._admit(budget, scheduled, out)
        return out

    def _schedule(self, seq: Sequence, budget: int, scheduled: set[int], out: SchedulerOutput) -> int:
        uncomputed = seq.num_uncomputed_tokens
        num_tokens = min(uncomputed, budget)
        if num_tokens > 0:
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_tokens, num_tokens == uncomputed))
            scheduled.add(seq.seq_id)
        return num_tokens

    def _needs_slot(self, seq: Sequence) -> bool:
        """A sampled token is waiting for its KV slot (a decode step): the KV manager holds fewer tokens."""
        return self.kv.reserved_tokens(seq.seq_id) < seq.num_tokens

    def _reserve(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Slots for the tokens the KV manager does not hold yet; its copy-on-write pairs, or None (no room)."""
        return self.kv.append(seq.seq_id, seq.token_ids[self.kv.reserved_tokens(seq.seq_id) :])

    def _reserve_slot(self, seq: Sequence, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Reserve the slot of a decode's new token, preempting until it fits; False if seq itself went."""
        while True:
            copies = self._reserve(seq)
            if copies is not None:
                out.copies.extend(copies)
                return True
            victim = self._victim(scheduled)
            self._preempt(victim, out)
            if victim is seq:
                return False

    def _victim(self, scheduled: set[int]) -> Sequence:
        """The running sequence served last that is not in this step yet, sparing freshly resumed ones."""
        candidates = [seq for seq in self.running if seq.seq_id not in scheduled]
        unprotected = [seq for seq in candidates if not seq.resumed_without_progress]
        return (unprotected or candidates)[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # All or nothing: the KV manager's calls (the ones that can raise) come before the sequence leaves
        # `running`, so an exception never leaves it outside every queue, holding blocks nobody frees.
        moves = self.kv.swap_out(seq.seq_id) if self.config.preemption_mode == "swap" else None
        if moves is None:  # recompute (or swap with a full CPU pool): drop the KV; re-admission recomputes it
            self.kv.free(seq.seq_id)
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if moves is not None:
            out.swap_out.extend(moves)
            seq.status = SequenceStatus.SWAPPED
            self._insert(self.swapped, seq)
            return
        seq.num_computed_tokens = 0
        self.add(seq)

    def _swap_in(self, budget: int, scheduled: set[int], out: SchedulerOutput) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            moves = self.kv.swap_in(seq.seq_id)
            if moves is None:
                break
            self.swapped.pop(0)
            out.swap_in.extend(moves)
            seq.status = SequenceStatus.RUNNING
            seq.resumed_without_progress = True
            self._insert(self.running, seq)
            if self._needs_slot(seq):
                copies = self._reserve(seq)
                if copies is None:
                    continue  # resident again; its decode waits for a block
                out.copies.extend(copies)
            budget -= self._schedule(seq, budget, scheduled, out)
        return budget

    def _admit(self, budget: int, scheduled: set[int], out: SchedulerOutput) -> None:
        static = self.config.mode == "static"
        if static and self.running:
            return
        while self.waiting and (budget > 0 or static):
            seq = self.waiting[0]
            if len(self.running) + seq.width > self.config.max_num_seqs:
                break
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            reservation = seq.width * cdiv(self.config.max_model_len, self.kv.block_size)
            if static and self._reserved_blocks + reservation > self.kv.num_blocks - self.kv.watermark_blocks:
                break
            cached = self.kv.allocate(seq.seq_id, seq.token_ids, self.prefix_key, is_resume=seq.num_preemptions > 0)
            if cached is None:
                break
            self.waiting.pop(0)
            if static:
                self._reserved_blocks += reservation
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            seq.resumed_without_progress = seq.num_preemptions > 0
            self._insert(self.running, seq)
            budget -= self._schedule(seq, budget, scheduled, out)
