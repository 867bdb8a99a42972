"""`LLMEngine`: requests in, one scheduled step at a time, `RequestOutput`s out (vLLM's engine API).

Each `step()` asks the scheduler for a batch, has the runner execute its memory plans (swap-out, swap-in,
copy-on-write) and forward pass, marks the computed KV, samples one token for every sequence whose chunk
reached its end, applies the stop rules and frees finished sequences' blocks at once. A request with `n > 1`
runs its prompt once: the first step that samples forks it into n sequences sharing the prompt's blocks.

Bad input (an empty or too-long prompt, an unknown token id, a duplicate request id, invalid sampling values)
raises ValueError from `add_request` for that request only; the engine's state is unchanged and it keeps
serving the others.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field

import torch

from ioattn.engine.runner import BatchEntry, ModelRunner
from ioattn.engine.sampling import BeamSearch, BeamSearchParams, Sampler, SamplingParams, StopChecker
from ioattn.engine.scheduler import Scheduler, SchedulerConfig
from ioattn.engine.sequence import CompletionOutput, RequestMetrics, RequestOutput, Sequence, SequenceStatus
from ioattn.kv import KVCacheManager
from ioattn.models.loader import LoadedModel, load_model

# KV pool on a CPU device when num_blocks is not given (there is no device memory to profile).
CPU_KV_CACHE_BYTES = 256 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs besides the model; `LLM(...)` keyword arguments land here."""

    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    num_blocks: int | None = None  # default: from gpu_memory_utilization (CUDA) or CPU_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_num_seqs), or max_model_len unchunked
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    scheduling: str = "continuous"  # or "static": the contiguous-reservation baseline
    swap_space: float = 4.0  # GiB of CPU blocks for preemption_mode="swap"
    watermark: float = 0.01
    enforce_eager: bool = False  # True: no CUDA graphs
    attention_backend: str = "auto"  # "triton" paged kernels (CUDA default), "torch" exact path (CPU default)
    device: str | torch.device | None = None

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        block_size = self.block_size
        if not (isinstance(block_size, int) and block_size >= 1 and block_size & (block_size - 1) == 0):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    # Sampling: one per sample, in index order (one until the prompt forks). Beam search: the running beams,
    # in the order of `beam.running`.
    seqs: list[Sequence]
    metrics: RequestMetrics
    checkers: list[StopChecker] = field(default_factory=list)  # sampling: one per sample
    generators: list[torch.Generator | None] = field(default_factory=list)  # sampling: one per sample
    beam: BeamSearch | None = None
    # Beam search: each running beam's next-token logits, kept until every beam of the request has its row.
    pending_logits: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def forked(self) -> bool:
        return len(self.seqs) == self.params.n

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return self.forked and all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, model: str | os.PathLike | LoadedModel = "tiny", config: EngineConfig | None = None, **kwargs):
        config = config or EngineConfig(**kwargs)
        self.config = config
        loaded = model
        if not isinstance(model, LoadedModel):
            loaded = load_model(model, dtype=config.dtype, device=config.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size = loaded.config.vocab_size
        self.max_model_len = config.max_model_len or loaded.max_model_len
        if self.max_model_len > loaded.max_model_len:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be <= the model's max_position_embeddings "
                             f"({loaded.max_model_len})")
        # Without chunking a whole prompt must fit one step.
        least = 2048 if config.enable_chunked_prefill else self.max_model_len
        batched = config.max_num_batched_tokens or max(least, config.max_num_seqs)
        self.scheduler_config = SchedulerConfig(
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=batched,
            enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
            policy=config.policy, mode=config.scheduling,
        )
        device = self.model.inv_freq.device
        dtype = self.model.model.embed_tokens.weight.dtype
        block_bytes = ModelRunner.block_bytes(loaded.config, config.block_size, dtype)
        num_blocks = config.num_blocks or self._default_num_blocks(device, block_bytes, batched)
        num_cpu_blocks = int(config.swap_space * GiB) // block_bytes if config.preemption_mode == "swap" else 0
        self.kv = KVCacheManager(num_blocks, config.block_size, num_cpu_blocks=num_cpu_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching, watermark=config.watermark)
        # Admission leaves the watermark free, so that is what one sequence of max_model_len must fit in.
        self._admissible_blocks = num_blocks - self.kv.watermark_blocks
        if self._admissible_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"num_blocks ({num_blocks}, {self.kv.watermark_blocks} of them the admission watermark) x block_size "
                f"({config.block_size}) must hold one max_model_len ({self.max_model_len}) sequence"
            )
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.runner = ModelRunner(
            self.model, num_blocks=num_blocks, block_size=config.block_size, max_model_len=self.max_model_len,
            num_cpu_blocks=num_cpu_blocks, max_num_seqs=config.max_num_seqs, use_cuda_graphs=not config.enforce_eager,
            attention_backend=config.attention_backend,
        )
        self.sampler = Sampler(self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.num_steps = 0

    def _default_num_blocks(self, device: torch.device, block_bytes: int, max_num_batched_tokens: int) -> int:
        if device.type != "cuda":
            return max(CPU_KV_CACHE_BYTES // block_bytes, -(-self.max_model_len // self.config.block_size))
        return ModelRunner.profile_num_blocks(
            self.model, block_size=self.config.block_size, gpu_memory_utilization=self.config.gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
        )

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError (state unchanged) when the request is invalid."""
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = SamplingParams() if params is None else params
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        token_ids = self._prompt_ids(prompt, prompt_token_ids)
        beam_search = isinstance(params, BeamSearchParams)
        width = params.beam_width if beam_search else params.n
        if width > self.scheduler_config.max_num_seqs:
            name = "beam_width" if beam_search else "n"
            raise ValueError(f"{name} ({width}) must be <= max_num_seqs ({self.scheduler_config.max_num_seqs})")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        reservation = width * -(-self.max_model_len // self.config.block_size)
        if self.scheduler_config.mode == "static" and reservation > self._admissible_blocks:
            raise ValueError(f"static scheduling reserves max_model_len for each of the {width} sequences: "
                             f"{reservation} blocks, more than the pool's {self._admissible_blocks}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(next(self._seq_ids), request_id, token_ids, len(token_ids), arrival, priority, width=width)
        request = Request(request_id, prompt, list(token_ids), params, [seq], RequestMetrics(arrival_time=arrival))
        if beam_search:
            request.beam = BeamSearch(params, eos_token_ids=self.eos_token_ids, prompt_len=len(token_ids),
                                      max_model_len=self.max_model_len)
        else:
            request.checkers = [
                StopChecker(params, self.tokenizer, token_ids, self.eos_token_ids, self.max_model_len)
                for _ in range(params.n)
            ]
            request.generators = [params.generator(i, device=self.runner.device) for i in range(params.n)]
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: Seq[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (a string) and prompt_token_ids (a list of ints)")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt_token_ids)
            bad = [t for t in token_ids
                   if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids must be ints in [0, {self.vocab_size}), got {bad[:5]}")
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, longer than max_model_len ({self.max_model_len})")
        return token_ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free all its blocks now; False if it is unknown or already finished."""
        request = self.requests.pop(str(request_id), None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; the outputs of every request that made progress (cumulative, vLLM-style)."""
        plan = self.scheduler.schedule()
        if plan.is_empty and self.requests:
            return self._fail_stalled()
        now = time.monotonic()
        self.runner.swap(plan.swap_out, plan.swap_in)
        self.runner.copy_blocks(plan.copies)
        entries = [
            BatchEntry(
                c.seq.token_ids[c.start : c.end], c.start, self.kv.block_table(c.seq.seq_id),
                self.kv.slot_mapping(c.seq.seq_id, c.start, c.end), c.samples,
            )
            for c in plan.chunks
        ]
        logits = self.runner.execute(entries)
        self.num_steps += 1
        for chunk in plan.chunks:
            self.scheduler.computed(chunk)
            metrics = self.requests[chunk.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        touched = self._sample([c.seq for c in plan.chunks if c.samples], logits)
        for seq in plan.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
        outputs = []
        for request, finished in touched:
            if finished:
                del self.requests[request.request_id]
            outputs.append(self._output(request, finished))
        return outputs

    def _fail_stalled(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests remain: beam searches whose beams cannot all be resident
        at once hold blocks while waiting for a beam that cannot get any. Fail those requests alone."""
        stalled = [request for request in self.requests.values() if request.pending_logits]
        if not stalled:
            raise RuntimeError("the scheduler found no work although requests remain; this is a bug")
        outputs = []
        for request in stalled:
            self.abort_request(request.request_id)
            output = self._output(request, finished=True)
            output.finished, output.error = True, (
                f"beam search with beam_width {request.params.beam_width} does not fit the KV pool "
                f"({self.kv.num_blocks} blocks of {self.config.block_size}): raise num_blocks or lower beam_width"
            )
            outputs.append(output)
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Request, bool]]:
        """Sample every row, fork prompts with n > 1, apply stop rules; the requests touched, in order, each with
        whether it has finished."""
        rows, row_seqs = [], []
        touched = {}
        for row, seq in enumerate(seqs):
            request = self.requests[seq.request_id]
            if request.beam is not None:
                request.pending_logits[seq.seq_id] = logits[row]
                continue
            if request.forked:
                rows.append(row)
                row_seqs.append((request, seq, seq.index))
                continue
            # An unforked prompt samples its n first tokens from one row; sample i uses generator i.
            rows.extend(row for _ in range(request.params.n))
            row_seqs.extend((request, seq, index) for index in range(request.params.n))
        if rows:
            if rows != list(range(logits.shape[0])):
                logits = logits[torch.tensor(rows, device=logits.device)]
            self._sample_rows(logits, row_seqs, touched)
        # A beam search steps once all its beams have logits and are resident (a preempted beam may lag behind).
        for request in self.requests.values():
            if request.pending_logits and all(
                seq.seq_id in request.pending_logits and seq.status is SequenceStatus.RUNNING
                and seq.num_uncomputed_tokens == 0 for seq in request.seqs
            ):
                self._beam_step(request)
                touched[request.request_id] = request
        now = time.monotonic()
        states = []
        for request in touched.values():
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
            states.append((request, finished))
        return states

    def _sample_rows(self, logits: torch.Tensor, row_seqs: list[tuple[Request, Sequence, int]], touched: dict) -> None:
        params = [request.params for request, _, _ in row_seqs]
        generators = [request.generators[index] for request, _, index in row_seqs]
        history = None
        # Only penalties and min_tokens read the token history; slicing it for every row would cost O(length).
        if any(p.penalized or p.min_tokens for p in params):
            history = [(seq.prompt_token_ids, seq.output_token_ids) for _, seq, _ in row_seqs]
        token_ids, logprobs, top_ids, top_lps = self.sampler.sample(logits, params, generators, history).tolist()
        # Fork before any token lands: a sample that stops at once must not free blocks its siblings still need.
        for request, seq, index in row_seqs:
            if index > 0 and len(request.seqs) == index:
                self._fork(request, seq, index)
            seq.width = 1
        for i, (request, _, index) in enumerate(row_seqs):
            top = None if top_ids is None else dict(zip(top_ids[i], top_lps[i]))
            self._append(request, request.seqs[index], token_ids[i], logprobs[i], top)
            touched[request.request_id] = request

    def _beam_step(self, request: Request) -> None:
        """Advance a beam search once every running beam has its logits: fork parents with several
        continuations (they share all blocks; the next write copies the shared partial block), free parents
        with none, and free everything once the search is done."""
        parents = request.seqs
        step = request.beam.step(torch.stack([request.pending_logits.pop(seq.seq_id) for seq in parents]))
        continuing, beams = set(), []
        for parent_index in step.parents:
            parent = parents[parent_index]
            beams.append(parent if parent_index not in continuing else self._fork(request, parent, len(beams)))
            continuing.add(parent_index)
        for index, parent in enumerate(parents):
            parent.width = 1
            if index not in continuing:
                self.scheduler.finish(parent)
        for beam, token in zip(beams, step.tokens):
            beam.token_ids.append(token)
        request.seqs = beams
        if request.beam.done:
            for beam in beams:
                self.scheduler.finish(beam)

    def _fork(self, request: Request, parent: Sequence, index: int) -> Sequence:
        child = Sequence(
            next(self._seq_ids), request.request_id, list(parent.token_ids), parent.num_prompt_tokens,
            parent.arrival_time, parent.priority, index=index,
        )
        self.scheduler.fork(parent, child)
        if request.beam is None:
            request.seqs.append(child)
        return child

    def _append(self, request: Request, seq: Sequence, token: int, logprob: float, top: dict | None) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if request.params.logprobs is not None:
            top = dict(list(top.items())[: request.params.logprobs]) if top else {}
            seq.logprobs.append({token: logprob, **top})
        checker = request.checkers[seq.index]
        reason = checker.append(token)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, checker.stop_reason
            self.scheduler.finish(seq)

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        if request.beam is not None:
            return self._beam_output(request)
        completions = []
        for seq in request.seqs:
            checker = request.checkers[seq.index]
            completions.append(CompletionOutput(
                index=seq.index,
                text=checker.text if seq.is_finished else checker.stable_text,
                # The checker holds exactly the sequence's outputs: copying them skips the prompt.
                token_ids=checker.output_token_ids[:],
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             request.metrics)

    def _beam_output(self, request: Request) -> RequestOutput:
        """Finished: the n best beams, score = sum of logprobs / length ** length_penalty. Running: the beams
        so far, score = their running sum."""
        search = request.beam
        beams = search.best() if search.done else search.running
        skip_special_tokens = request.params.skip_special_tokens
        completions = [
            CompletionOutput(
                index=i, text=self.tokenizer.decode(beam.token_ids, skip_special_tokens=skip_special_tokens),
                token_ids=list(beam.token_ids), cumulative_logprob=beam.score, logprobs=None,
                finish_reason=None if not search.done else (
                    "stop" if beam.token_ids and beam.token_ids[-1] in search.stop_ids else "length"),
            )
            for i, beam in enumerate(beams)
        ]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, search.done,
                             request.metrics)

    # -- streaming ---------------------------------------------------------------------------------------

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every queued request has finished, yielding each step's outputs as they come."""
        while self.has_unfinished_requests():
            yield from self.step()

    def stats(self) -> dict:
        """Counters for reports: steps, preemptions and the KV manager's snapshot."""
        return {"steps": self.num_steps, "preemptions": self.scheduler.num_preemptions, "kv": self.kv.stats()}

