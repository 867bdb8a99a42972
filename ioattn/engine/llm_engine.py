"""`LLMEngine`: requests in, one scheduled step at a time, `RequestOutput`s out (vLLM's engine API).

Each `step()` asks the scheduler for a batch, has the runner execute its memory plans (swap-out, swap-in,
copy-on-write) and forward pass, samples one token for every sequence whose chunk reached its end, then lands
the sampled tokens on the host: marks the computed KV, applies the stop rules and frees finished sequences'
blocks. A request with `n > 1` runs its prompt once: the first step that samples forks it into n sequences
sharing the prompt's blocks.

**Asynchronous scheduling** (`async_scheduling`, one step of lookahead). A step is launched, then the
previous step is landed while the device runs it, and `step()` returns that previous step's outputs: the
host's stop checks, detokenization, output building and the next schedule overlap the device's work instead of
idling it. Step t+1 is scheduled before step t's tokens reach the host, so:

- a token sampled at step t is a `PLACEHOLDER` in its sequence (and, once step t+1 reserved its slot, in the KV
  manager) until step t lands; step t+1 reads its value from step t's sampled-token tensor on the device
  (a `TokenFeed`), and penalties count it from there. The samples reach the host through one pinned copy with
  an event, read one step later;
- whatever is keyed on token values waits for them: a chunk's full blocks enter the prefix cache when its step
  lands (`Scheduler.commit`), so a prompt admitted at step t+1 cannot hit blocks step t filled;
- a sequence found finished when step t lands was scheduled once more in step t+1: that extra token is
  discarded when step t+1 lands, and its blocks are freed when step t lands, one step later than the
  synchronous engine frees them (every later use of them is queued on the device behind step t+1). A sequence
  whose in-flight token is its last by max_tokens or the context length is not scheduled again at all.

Outputs are those of the synchronous engine: the same tokens, text, logprobs and finish reasons for every
request. Only timings and batch shapes differ (frees and prefix-cache hits one step later, one extra row for
a sequence that stops early), and with them the device's rounding wherever its matmuls are not
batch-invariant, exactly as it differs between two synchronous runs that batch requests differently.

It is on by default (`async_scheduling=None` or True; False keeps every step synchronous). On a CPU device it
is exact too but overlaps nothing: the forward pass runs on the host itself. Steps run synchronously (the step
in flight is landed before scheduling, and each step lands at once) while a beam-search request is unfinished:
a beam step forks and frees sequences from the logits of all of a request's beams, which the next schedule
must see. `TensorParallelEngine` never overlaps (its workers read input tokens from the broadcast plan), nor
does the disaggregated prefill worker (it would ship each prompt a step later). `stats()["scheduling"]` says
how many steps overlapped, why the others did not, and how many tokens were computed in vain.

Bad input (an empty or too-long prompt, one UTF-8 cannot encode, an unknown token id, a duplicate request id,
sampling values that are invalid or that this model cannot serve, a bad arrival time or priority) raises
ValueError naming the argument from `add_request` for that request only: every argument is checked before
anything is registered, so the engine's state is unchanged and it keeps serving the others. What passes those
checks cannot make a later `step()` fail (`check_params` says what a model can serve; the server calls it too).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Iterator, Sequence as Seq

import torch

from ioattn.engine.async_step import LaunchedStep
from ioattn.engine.request import Request, request_output
from ioattn.engine.config import EngineConfig, EngineSettings, build_attention, build_runner, resolve_settings
from ioattn.engine.runner import Batch
from ioattn.engine.sampling import (BeamSearch, BeamSearchParams, Sampler, SamplerOutput, SamplingParams, StopChecker,
                                    is_int, as_real)
from ioattn.engine.scheduler import (ScheduledChunk, Scheduler, SchedulerOutput)
from ioattn.engine.outputs import RequestMetrics, RequestOutput
from ioattn.engine.sequence import Sequence, SequenceStatus
from ioattn.engine.transfer import HostCopy, to_device
from ioattn.kv import PLACEHOLDER, KVCacheManager
from ioattn.kv.manager import all_token_ids
from ioattn.models.loader import LoadedModel, load_model

class LLMEngine:
    def __init__(self, model: str | os.PathLike | LoadedModel = "tiny", config: EngineConfig | None = None, *,
                 settings: EngineSettings | None = None, **kwargs):
        """model: a preset name, a GGUF file, a checkpoint folder or a `LoadedModel`. settings: the resolved
        settings (`resolve_settings`), when a caller has them already (tensor parallelism agrees on them)."""
        config = config or EngineConfig(**kwargs)
        self.config = config
        loaded = model
        if not isinstance(model, LoadedModel):
            loaded = load_model(model, dtype=config.dtype, device=config.device)
        self.loaded = loaded
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size = loaded.config.vocab_size
        self.settings = settings = settings or resolve_settings(config, loaded)
        self.max_model_len = settings.max_model_len
        self.scheduler_config = settings.scheduler_config(config)
        self.kv = KVCacheManager(settings.num_blocks, settings.block_size, num_cpu_blocks=settings.num_cpu_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching, watermark=config.watermark)
        self._admissible_blocks = settings.admissible_blocks
        self.attention = build_attention(loaded.config, settings, config)
        # Blocks are cached under the cache's format too: another dtype's or other scales' blocks never match.
        self.prefix_key = self.attention.prefix_key()
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.prefix_key)
        self.runner = self._build_runner()
        self.sampler = Sampler(self.eos_token_ids)
        self.async_scheduling = config.async_scheduling is not False
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._num_beam_requests = 0
        self._in_flight: LaunchedStep | None = None
        self.num_steps = 0
        self.num_overlapped_steps = 0
        self.num_discarded_tokens = 0  # scheduled after a sequence's last token, before that token landed
        # Wall time inside step(), and the part of it spent waiting for sampled tokens to reach the host: the rest
        # is the host's work (and any synchronizing call inside it).
        self.step_seconds = 0.0
        self.device_wait_seconds = 0.0

    def _build_runner(self):
        """What executes each step plan (`run(swap_out, swap_in, copies, batch, feed)`): the model runner here;
        multi-process engines return their own executor."""
        return build_runner(self.model, self.attention, self.settings, self.config,
                            use_cuda_graphs=not self.config.enforce_eager)

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
        """Queue a request; returns its id. Raises ValueError naming the argument when the request is invalid, with
        the state unchanged: every argument is checked before anything is registered."""
        request_id = self._new_request_id(request_id)
        params = self.check_params(SamplingParams() if params is None else params)
        token_ids = self._prompt_ids(prompt, prompt_token_ids)
        self._check_arrival_and_priority(arrival_time, priority)
        beam_search = isinstance(params, BeamSearchParams)
        width = params.beam_width if beam_search else params.n
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
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
        # The scheduler first: it is the only step that compares this request with others; nothing after it raises.
        self.scheduler.add(seq)
        self.requests[request_id] = request
        self._num_beam_requests += beam_search
        return request_id

    def check_params(self, params: SamplingParams | BeamSearchParams) -> SamplingParams | BeamSearchParams:
        """`params` if this engine can serve them, else ValueError naming the field: their values are checked again
        (a dataclass may be changed after it was built), then against the model and the engine: stop token ids
        inside the vocabulary, no more logprobs than tokens, n / beam_width within max_num_seqs (and, scheduling
        statically, their max-length reservations within the pool). Reads only settings fixed at construction."""
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        params.__post_init__()
        vocab = self.vocab_size
        out_of_vocab = [t for t in params.stop_token_ids if t >= vocab]
        if out_of_vocab:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {out_of_vocab[:5]}")
        beam_search = isinstance(params, BeamSearchParams)
        if not beam_search and params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be <= the vocabulary size ({vocab}), got {params.logprobs}")
        name, width = ("beam_width", params.beam_width) if beam_search else ("n", params.n)
        if width > self.scheduler_config.max_num_seqs:
            raise ValueError(f"{name} ({width}) must be <= max_num_seqs ({self.scheduler_config.max_num_seqs})")
        reservation = width * -(-self.max_model_len // self.config.block_size)
        if self.scheduler_config.mode == "static" and reservation > self._admissible_blocks:
            raise ValueError(f"{name} ({width}) is too large for static scheduling, which reserves max_model_len for "
                             f"each sequence: {reservation} blocks, more than the pool's {self._admissible_blocks}")
        return params

    @staticmethod
    def _check_arrival_and_priority(arrival_time, priority) -> None:
        if arrival_time is not None and not math.isfinite(as_real(arrival_time)):
            raise ValueError(f"arrival_time must be None or a finite number (time.monotonic() seconds), "
                             f"got {arrival_time!r}")
        if not is_int(priority):
            raise ValueError(f"priority must be an int, got {priority!r}")

    def _new_request_id(self, request_id) -> str:
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in self.requests:  # a caller's own id may look like a generated one
                request_id = str(next(self._request_ids))
            return request_id
        if not isinstance(request_id, str) and not is_int(request_id):
            raise ValueError(f"request_id must be a str (or an int, or None), got {type(request_id).__name__}")
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        return request_id

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: Seq[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (a string) and prompt_token_ids (a list of ints)")
        vocab = self.vocab_size
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
            _check_utf8("prompt", prompt)
            token_ids = self.tokenizer.encode(prompt)
            if not all_token_ids(token_ids, limit=vocab):
                raise ValueError(f"prompt: the tokenizer gave ids outside the model's vocabulary [0, {vocab}): "
                                 f"{_bad_token_ids(token_ids, vocab)[:5]}")
        else:
            if not isinstance(prompt_token_ids, Seq) or isinstance(prompt_token_ids, (str, bytes, bytearray)):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {type(prompt_token_ids).__name__}")
            token_ids = list(prompt_token_ids)
            if not all_token_ids(token_ids, limit=vocab):
                raise ValueError(f"prompt_token_ids must be ints in [0, {vocab}), "
                                 f"got {_bad_token_ids(token_ids, vocab)[:5]}")
        name = "prompt" if prompt is not None else "prompt_token_ids"
        if not token_ids:
            raise ValueError(f"{name} is empty: it must hold at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{name} is {len(token_ids)} tokens, longer than max_model_len ({self.max_model_len})")
        return token_ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free all its blocks now; False if it is unknown or already finished."""
        if not isinstance(request_id, str) and not is_int(request_id):
            raise ValueError(f"request_id must be a str (or an int), got {type(request_id).__name__}")
        request = self.requests.get(str(request_id))
        if request is None:
            return False
        self._drop(request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        return True

    def _drop(self, request: Request) -> None:
        del self.requests[request.request_id]
        if request.beam is not None:
            self._num_beam_requests -= 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; the outputs of every request that made progress (cumulative, vLLM-style).

        Overlapping, the batch is launched and the previous one is landed: the outputs are those of the
        previous step (none on the first call)."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        overlap = self.async_scheduling and not self._num_beam_requests
        touched: dict[str, Request] = {}
        if not overlap:
            self._land_in_flight(touched)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self._in_flight is None and not touched and self.requests:
                return self._fail_stalled()
            self._land_in_flight(touched)
            return self._outputs(touched)
        launched = self._launch(plan)
        self._land_in_flight(touched)
        if overlap:
            self._in_flight = launched
            self.num_overlapped_steps += 1
        else:
            self._land(launched, touched)
        return self._outputs(touched)

    def _land_in_flight(self, touched: dict[str, Request]) -> None:
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._land(launched, touched)

    def _fail_stalled(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests remain: beam searches whose beams cannot all be resident
        at once hold blocks while waiting for a beam that cannot get any. Fail those requests alone."""
        stalled = [request for request in self.requests.values() if request.pending_logits]
        if not stalled:
            raise RuntimeError("the scheduler found no work although requests remain; this is a bug")
        outputs = []
        for request in stalled:
            self.abort_request(request.request_id)
            output = request_output(request, True, self.tokenizer)
            output.finished, output.error = True, (
                f"beam search with beam_width {request.params.beam_width} does not fit the KV pool "
                f"({self.kv.num_blocks} blocks of {self.config.block_size}): raise num_blocks or lower beam_width"
            )
            outputs.append(output)
        return outputs

    # -- launch: the device's share of a step, queued ----------------------------------------------------------

    def _launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """Queue the plan's copies, the forward pass and the sampling; fork prompts with n > 1 and give every
        sampled token a placeholder. Nothing here waits for the device."""
        now = time.monotonic()
        feed = self._in_flight.feed(plan.chunks) if self._in_flight is not None else None
        logits = self.runner.run(plan.swap_out, plan.swap_in, plan.copies, self._batch(plan.chunks), feed)
        self.num_steps += 1
        for chunk in plan.chunks:
            self.scheduler.advance(chunk)
            metrics = self.requests[chunk.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        for seq in plan.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
        return self._sample(plan.chunks, logits)

    def _batch(self, chunks: list[ScheduledChunk]) -> Batch:
        token_ids = []
        for c in chunks:
            token_ids += c.seq.token_ids[c.start : c.end]
        tables, table_lens = self.kv.block_tables([c.seq.seq_id for c in chunks])
        return Batch(token_ids, [c.start for c in chunks], [c.num_tokens for c in chunks],
                     [c.samples for c in chunks], tables, table_lens)

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> LaunchedStep:
        rows, samples, prompts = [], [], []
        for row, seq in enumerate(c.seq for c in chunks if c.samples):
            request = self.requests[seq.request_id]
            if request.beam is not None:
                request.pending_logits[seq.seq_id] = logits[row]
                continue
            if request.forked:
                rows.append(row)
                samples.append((request, seq, seq.index))
                continue
            # An unforked prompt samples its n first tokens from one row; sample i uses generator i.
            rows.extend(row for _ in range(request.params.n))
            samples.extend((request, seq, index) for index in range(request.params.n))
            prompts.append((request, seq))
        if not rows:
            return LaunchedStep(chunks, [], None, None, {})
        if prompts or len(rows) != logits.shape[0]:
            logits = logits[to_device(rows, torch.int64, logits.device)]
        out = self._sample_rows(logits, samples)
        # Fork before any token lands: a sample that stops at once must not free blocks its siblings still need.
        for request, seq in prompts:
            seq.width = 1
            for index in range(1, request.params.n):
                self._fork(request, seq, index)
        placed, placeholders = [], {}
        for row, (request, _, index) in enumerate(samples):
            seq = request.seqs[index]
            seq.token_ids.append(PLACEHOLDER)
            position = seq.num_tokens - 1
            placed.append((request, seq, position))
            placeholders[seq.seq_id] = (row, position)
            # Its last token by length: it finishes when this one lands, whatever its value, so no step needs it.
            seq.finishing = position - seq.num_prompt_tokens + 1 >= request.checkers[index].max_length
        return LaunchedStep(chunks, placed, out.token_ids, HostCopy(out.packed()), placeholders)

    def _sample_rows(self, logits: torch.Tensor, samples: list[tuple[Request, Sequence, int]]) -> SamplerOutput:
        params = [request.params for request, _, _ in samples]
        generators = [request.generators[index] for request, _, index in samples]
        history = pending = None
        # Only penalties and min_tokens read the token history; slicing it for every row would cost O(length).
        if any(p.penalized or p.min_tokens for p in params):
            history = [(seq.prompt_token_ids, seq.output_token_ids) for _, seq, _ in samples]
            if self._in_flight is not None:
                pending = self._in_flight.pending([seq for _, seq, _ in samples])
        return self.sampler.sample(logits, params, generators, history, pending)

    def _fork(self, request: Request, parent: Sequence, index: int) -> Sequence:
        child = Sequence(
            next(self._seq_ids), request.request_id, list(parent.token_ids), parent.num_prompt_tokens,
            parent.arrival_time, parent.priority, index=index,
        )
        self.scheduler.fork(parent, child)
        if request.beam is None:
            request.seqs.append(child)
        return child

    # -- land: the host's share, once the sampled tokens are here -------------------------------------------

    def _land(self, launched: LaunchedStep, touched: dict[str, Request]) -> None:
        """Register the step's computed blocks, put its tokens in place of their placeholders and apply the stop
        rules (waits for the step's sampled tokens); beam searches step once all their beams have logits."""
        for chunk in launched.chunks:
            self.scheduler.commit(chunk)
        if launched.samples:
            start = time.perf_counter()
            token_ids, logprobs, top_ids, top_lps = launched.read()
            self.device_wait_seconds += time.perf_counter() - start
            for i, (request, seq, position) in enumerate(launched.samples):
                if seq.is_finished:  # finished or aborted after this step was launched: an unused extra token
                    continue
                top = None if top_ids is None else dict(zip(top_ids[i], top_lps[i]))
                self._append(request, seq, position, token_ids[i], logprobs[i], top)
                touched[request.request_id] = request
        if not self._num_beam_requests:
            return
        # A beam search steps once all its beams have logits and are resident (a preempted beam may lag behind).
        for request in self.requests.values():
            if request.pending_logits and all(
                seq.seq_id in request.pending_logits and seq.status is SequenceStatus.RUNNING
                and seq.num_uncomputed_tokens == 0 for seq in request.seqs
            ):
                self._beam_step(request)
                touched[request.request_id] = request

    def _append(self, request: Request, seq: Sequence, position: int, token: int, logprob: float,
                top: dict | None) -> None:
        seq.token_ids[position] = token
        if self.kv.reserved_tokens(seq.seq_id) > position:  # the next schedule reserved its slot
            self.kv.fill(seq.seq_id, position, token)
        seq.cumulative_logprob += logprob
        if request.params.logprobs is not None:
            top = dict(list(top.items())[: request.params.logprobs]) if top else {}
            seq.logprobs.append({token: logprob, **top})
        checker = request.checkers[seq.index]
        reason = checker.append(token)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, checker.stop_reason
            self.scheduler.finish(seq)
            self.num_discarded_tokens += seq.num_tokens - position - 1

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

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for request in touched.values():
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            finished = request.finished
            if finished:
                metrics.finished_time = now
                self._drop(request)
            elif request.params.output_kind == "final_only":
                continue
            outputs.append(request_output(request, finished, self.tokenizer))
        return outputs

    # -- streaming ---------------------------------------------------------------------------------------

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every queued request has finished, yielding each step's outputs as they come."""
        while self.has_unfinished_requests():
            yield from self.step()

    def stats(self) -> dict:
        """Counters for reports: steps, preemptions, how steps were scheduled, the KV manager's snapshot and the
        attention seam (backend, cache dtype and geometry, windows, how kernel inputs are checked)."""
        return {"steps": self.num_steps, "preemptions": self.scheduler.num_preemptions,
                "scheduling": self.scheduling_stats(), "kv": self.kv.stats(), "attention": self.attention.describe()}

    def scheduling_stats(self) -> dict:
        """Whether steps overlap the device (asynchronous scheduling), how many did, why the others did not, the
        tokens computed in vain (scheduled for a sequence whose stopping token had not landed yet), and the time
        in steps with the part spent waiting for the device."""
        if not self.async_scheduling:
            why = "async_scheduling=False (always with tensor parallelism, and in a disaggregated prefill worker)"
        elif self._num_beam_requests:
            why = "synchronous while a beam-search request is unfinished"
        else:
            why = "overlapping"
        return {"async_scheduling": self.async_scheduling, "overlapped_steps": self.num_overlapped_steps,
                "synchronous_steps": self.num_steps - self.num_overlapped_steps,
                "discarded_tokens": self.num_discarded_tokens, "status": why,
                "step_seconds": self.step_seconds, "device_wait_seconds": self.device_wait_seconds}


def _check_utf8(name: str, text: str) -> None:
    """ValueError unless UTF-8 can encode text (a lone surrogate, e.g. from a JSON "\\ud800" escape, cannot)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} must be text that UTF-8 can encode: the character at index {error.start} "
                         f"({text[error.start]!r}) is a lone surrogate") from None


def _bad_token_ids(ids: list, vocab: int) -> list:
    return [t for t in ids if type(t) is not int or not 0 <= t < vocab]
