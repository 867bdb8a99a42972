"""Choosing the next token: request parameters, a batched sampler, stop conditions and beam search.

- `SamplingParams` (vLLM's names, defaults and meanings) and `BeamSearchParams` (vLLM's separate beam-search
  parameters, as in `LLM.beam_search`): plain dataclasses that validate every value when built, in the ranges the
  sampler can use (a seed torch.Generator takes for every sample, a length penalty whose powers stay finite); the
  engine checks them again at `add_request`, against its model (stop token ids inside the vocabulary).
- `Sampler.sample` turns one step's logits, one row per running sequence, into tokens for a whole batch whose
  rows may each use different settings, in vLLM's order: stop tokens masked under `min_tokens`, repetition /
  frequency / presence penalties, then greedy argmax or temperature -> min-p -> top-k -> top-p -> a random draw.
  A seeded row draws from its own `torch.Generator`, so its tokens do not depend on the rest of the batch.
  It only queues device work: its per-row settings reach the device through pinned copies (`to_device`), and
  the history of a row may end in a token that has not reached the host yet (asynchronous scheduling), given
  as a device tensor.
  Returned logprobs are those of the raw model distribution, `log_softmax(logits)` before penalties and
  temperature: vLLM's default (`logprobs_mode="raw_logprobs"`), so they do not change with the sampling knobs.
- `StopChecker` follows one sequence's output: detokenizes it incrementally, decides "stop" (EOS, a stop token,
  a stop string, even one spanning tokens) or "length", and truncates the text at a stop string.
- `BeamSearch` reproduces transformers' `generate(num_beams=k, do_sample=False)` step by step; the engine keeps
  one sequence per running beam and forks them as each step's `parents` say (shared blocks, copy-on-write).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ioattn.engine.transfer import to_device

# Temperatures below this are greedy (vLLM's threshold): dividing by them would only overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# torch.Generator.manual_seed takes [-2**63, 2**64); sample i of a request draws from seed + i.
SEED_RANGE = (-(2**63), 2**64)
# Beam scores divide by length ** length_penalty: within this bound it is a finite, non-zero float for every
# length below 2**64, so ranking beams can neither overflow nor divide by zero.
MAX_LENGTH_PENALTY = 16.0


def is_int(value) -> bool:
    """An int and not a bool (True is an int to Python, never a count or an id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_real(value) -> float:
    """The value as a float for range checks; NaN (failing every check) when it is not a real number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        return math.nan


def _require(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(kw_only=True)
class _StopParams:
    """When a sequence ends, and which outputs the engine returns; shared by sampling and beam search."""

    max_tokens: int | None = 16  # None: until the model's context length
    min_tokens: int = 0  # tokens generated before EOS / stop tokens / stop strings may end the output
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's RequestOutputKind: "cumulative" (an output after every step that made progress, everything so far),
    # "delta" (the same outputs, each holding only what is new since the last: token ids, logprobs and text; what
    # the server's engine process streams, copying no sample's whole history at every step; sampling only) or
    # "final_only" (one output, once the request has finished: what LLM.generate reads; the engine then builds no
    # other).
    output_kind: str = "cumulative"

    def __post_init__(self):
        _require(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
                 "max_tokens", "an int >= 1 or None", self.max_tokens)
        _require(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an int >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _require(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})",
                     self.min_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        _require(isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop), "stop",
                 "a non-empty string or a list of them", self.stop)
        stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        _require(isinstance(stop_token_ids, (list, tuple)) and all(is_int(t) and t >= 0 for t in stop_token_ids),
                 "stop_token_ids", "a list of token ids >= 0", self.stop_token_ids)
        self.stop, self.stop_token_ids = list(stop), list(stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, "True or False", getattr(self, name))
        _require(self.output_kind in OUTPUT_KINDS, "output_kind", f"one of {OUTPUT_KINDS}", self.output_kind)


@dataclass(kw_only=True)
class SamplingParams(_StopParams):
    """vLLM's sampling parameters. `n` samples of one prompt fork its blocks; sample i of a seeded request draws
    from `seed + i` (`generator(i)`), so the samples differ and each is reproducible on its own."""

    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # tokens of prompt and output: positive logits / p, negative ones * p
    presence_penalty: float = 0.0  # OpenAI's, over output tokens: - p once a token occurred
    frequency_penalty: float = 0.0  # OpenAI's, over output tokens: - p per occurrence
    seed: int | None = None
    logprobs: int | None = None  # top logprobs returned besides the sampled token's; None: none at all

    def __post_init__(self):
        super().__post_init__()
        _require(is_int(self.n) and self.n >= 1, "n", "an int >= 1", self.n)
        _require(0 <= as_real(self.temperature) < math.inf, "temperature", ">= 0", self.temperature)
        _require(0 < as_real(self.top_p) <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(is_int(self.top_k) and self.top_k >= -1, "top_k", "-1 or 0 (off) or an int >= 1", self.top_k)
        _require(0 <= as_real(self.min_p) <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(0 < as_real(self.repetition_penalty) < math.inf, "repetition_penalty", "> 0 and finite",
                 self.repetition_penalty)
        _require(-2 <= as_real(self.presence_penalty) <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _require(-2 <= as_real(self.frequency_penalty) <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        low, high = SEED_RANGE
        _require(self.seed is None or (is_int(self.seed) and low <= self.seed and self.seed + self.n <= high),
                 "seed", "None or an int in [-2**63, 2**64 - n] (sample i seeds a torch.Generator with seed + i)",
                 self.seed)
        _require(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"None or an int in [0, {MAX_LOGPROBS}]", self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def generator(self, sample_index: int = 0, device=None) -> torch.Generator | None:
        """The generator of sample `sample_index` of a seeded request (None when unseeded)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed + sample_index)


@dataclass(kw_only=True)
class BeamSearchParams(_StopParams):
    """vLLM's beam-search parameters with transformers' meaning: `beam_width` = num_beams, scores are sums of
    raw logprobs, a finished beam ranks by sum / length ** length_penalty (length counts generated tokens with
    the EOS), `early_stopping` False / True / "never" as in transformers; `n` best beams are returned (default:
    all `beam_width`, as vLLM). Stop strings are not supported: beams end at EOS, stop tokens or max_tokens."""

    beam_width: int
    n: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        super().__post_init__()
        _require(is_int(self.beam_width) and self.beam_width >= 1, "beam_width", "an int >= 1", self.beam_width)
        self.n = self.beam_width if self.n is None else self.n
        _require(is_int(self.n) and 1 <= self.n <= self.beam_width, "n", "an int in [1, beam_width]", self.n)
        _require(abs(as_real(self.length_penalty)) <= MAX_LENGTH_PENALTY, "length_penalty",
                 f"a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]", self.length_penalty)
        _require(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
                 'False, True or "never"', self.early_stopping)
        _require(not self.stop, "stop", "empty for beam search (use stop_token_ids)", self.stop)
        _require(self.output_kind != "delta", "output_kind", '"cumulative" or "final_only" for beam search (beams '
                 "are re-ranked every step: a delta has no meaning)", self.output_kind)


@dataclass
class SamplerOutput:
    """One step for S rows. Row i's top logprobs are `top_*[i, :params[i].logprobs]`; K is the batch's largest."""

    token_ids: torch.Tensor  # (S,) int64
    logprobs: torch.Tensor  # (S,) float32, raw logprob of the sampled token
    top_token_ids: torch.Tensor | None  # (S, K) int64, most likely first; None when no row asked
    top_logprobs: torch.Tensor | None  # (S, K) float32

    def packed(self) -> torch.Tensor:
        """(S, 2 + 2K) float64: token id, logprob, K top ids, K top logprobs; one tensor, so one device -> host
        transfer (float64 holds every id below 2**53 and every float32 value exactly)."""
        columns = [self.token_ids[:, None], self.logprobs[:, None]]
        if self.top_token_ids is not None:
            columns += [self.top_token_ids, self.top_logprobs]
        return torch.cat([c.double() for c in columns], dim=1)

    @staticmethod
    def unpack(packed: torch.Tensor) -> tuple[list[int], list[float], list[list[int]] | None,
                                               list[list[float]] | None]:
        """token_ids, logprobs, top_token_ids, top_logprobs as Python lists, from a host copy of `packed()`."""
        token_ids, logprobs = packed[:, 0].long().tolist(), packed[:, 1].tolist()
        k = (packed.shape[1] - 2) // 2
        if not k:
            return token_ids, logprobs, None, None
        return token_ids, logprobs, packed[:, 2 : 2 + k].long().tolist(), packed[:, 2 + k :].tolist()

    def tolist(self) -> tuple[list[int], list[float], list[list[int]] | None, list[list[float]] | None]:
        return self.unpack(self.packed().cpu())


class Sampler:
    """Batched next-token choice; see the module docstring for the order of the stages.

    `eos_token_ids` are masked (with each row's `stop_token_ids`) while a row has fewer than `min_tokens`
    outputs; an id outside the logits' vocabulary is never sampled, so it is skipped rather than indexed. Every
    stage runs only on the rows that use it and is skipped when none does.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
        pending: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits (S, V); params, generators (on logits' device, None: unseeded) and history (prompt ids, output
        ids) one per row. History may be None only when no row uses penalties or min_tokens.

        A row's output ids may end in one id < 0, a token not on the host yet: `pending` (S,) int64 on logits'
        device holds its value (and anything in rows without one). It counts as an output token like any other."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D (rows, vocab), got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        generators = [None] * num_rows if generators is None else list(generators)
        if len(params) != num_rows or len(generators) != num_rows or (history is not None and len(history) != num_rows):
            raise ValueError(f"params, generators and history need one entry per logits row ({num_rows})")
        raw = logits.float()
        # Rows mostly share a few parameter objects (often one): ask each object once what it needs.
        kinds = {id(p): p for p in params}.values()
        # The raw logits stay untouched for the logprobs; only masks and penalties need a copy to edit.
        if any(p.penalized or p.min_tokens for p in kinds):
            logits = raw.clone()
            self._mask_early_stops(logits, params, history)
            apply_penalties(logits, params, history, pending)
        else:
            logits = raw
        token_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in kinds):
            random_rows = []
        elif not any(p.greedy for p in kinds):
            random_rows = list(range(num_rows))
        else:
            random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = to_device(random_rows, torch.int64, logits.device)
            truncated = truncate(logits[rows], [params[i] for i in random_rows])
            token_ids[rows] = _draw(truncated, [generators[i] for i in random_rows])
        sampled_logprobs = raw.gather(1, token_ids[:, None])[:, 0] - torch.logsumexp(raw, dim=-1)
        num_top = max((p.logprobs or 0 for p in kinds), default=0)
        top_logprobs = top_ids = None
        if num_top:
            top_logprobs, top_ids = torch.log_softmax(raw, dim=-1).topk(num_top, dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, top_ids, top_logprobs)

    def _mask_early_stops(self, logits, params, history) -> None:
        rows, ids, vocab = [], [], logits.shape[1]
        for i, p in enumerate(params):
            if p.min_tokens and len(_history(history, i)[1]) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                # An id outside the vocabulary can never be sampled: nothing to mask (and no index to write).
                stops = sorted(t for t in stops if t < vocab)
                rows += [i] * len(stops)
                ids += stops
        if rows:
            logits[to_device(rows, torch.int64, logits.device), to_device(ids, torch.int64, logits.device)] = -math.inf


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], history,
                    pending: torch.Tensor | None = None) -> None:
    """In place, on the rows that use them, in vLLM's order: repetition (HF's rule, over prompt and output
    tokens), then frequency and presence (OpenAI's, over output tokens). History and pending as in `sample`."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if not penalized:
        return
    device, vocab = logits.device, logits.shape[1]
    chosen = [params[i] for i in penalized]
    rows = to_device(penalized, torch.int64, device)
    outputs = [_history(history, i)[1] for i in penalized]
    output_counts = _token_counts(outputs, vocab, device)
    unread = [r for r, ids in enumerate(outputs) if ids and ids[-1] < 0]
    if unread:
        if pending is None:
            raise ValueError("an output history ends in a token not on the host (id < 0) but pending is None")
        unread_rows = to_device(unread, torch.int64, device)
        counted = pending.index_select(0, rows.index_select(0, unread_rows))
        output_counts.view(-1).scatter_add_(0, unread_rows * vocab + counted, torch.ones(len(unread), device=device))
    prompt_counts = _token_counts([_history(history, i)[0] for i in penalized], vocab, device)
    sub = logits[rows]
    repetition = _column([p.repetition_penalty for p in chosen], device)
    seen = (output_counts > 0) | (prompt_counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub -= _column([p.frequency_penalty for p in chosen], device) * output_counts
    sub -= _column([p.presence_penalty for p in chosen], device) * (output_counts > 0)
    logits[rows] = sub


def _history(history, row):
    if history is None:
        raise ValueError("history (prompt ids, output ids per row) is needed for penalties and min_tokens")
    return history[row]


def _column(values, device) -> torch.Tensor:
    return to_device(values, torch.float32, device)[:, None]


def _token_counts(id_lists, vocab: int, device) -> torch.Tensor:
    """(rows, vocab) float32: how often each token occurs in each row's list (ids outside [0, vocab) are not
    counted: a pending one is < 0, and no other row's counts may be touched)."""
    counts = torch.zeros(len(id_lists), vocab, dtype=torch.float32, device=device)
    flat = [r * vocab + t for r, ids in enumerate(id_lists) for t in ids if 0 <= t < vocab]
    if flat:
        counts.view(-1).scatter_add_(0, to_device(flat, torch.int64, device), torch.ones(len(flat), device=device))
    return counts


def truncate(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (on what top-k kept, renormalised) as -inf: the logits that
    random rows draw from."""
    device, vocab = logits.device, logits.shape[1]
    logits = logits / _column([p.temperature for p in params], device)
    if any(p.min_p > 0 for p in params):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p): no softmax needed.
        log_min_p = torch.log(_column([p.min_p for p in params], device))
        logits = logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + log_min_p, -math.inf)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        top_k = _column([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)
        drop = rank >= top_k
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, -math.inf), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows without top-p get a threshold above 1 so float rounding of the cumsum never drops their tail.
        top_p = _column([p.top_p if p.top_p < 1 else 2.0 for p in params], device)
        drop |= mass_before >= top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), -math.inf)
    return logits


def _draw(logits: torch.Tensor, generators) -> torch.Tensor:
    """One token per row: argmax(probs / q) with q ~ Exp(1) picks token i with probability probs_i (an
    exponential race), and lets each seeded row draw its q from its own generator."""
    vocab = logits.shape[1]
    probs = torch.softmax(logits, dim=-1)
    race = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        if generator is not None:
            race[row].exponential_(generator=generator)
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if unseeded:
        race[to_device(unseeded, torch.int64, logits.device)] = torch.empty(
            len(unseeded), vocab, device=logits.device).exponential_()
    return (probs / race.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


class StopChecker:
    """One sequence's output ids and text, and whether (and why) it has finished.

    `append(token)` returns the finish reason once there is one: "stop" for EOS (unless `ignore_eos`), a stop
    token or a stop string, "length" for `max_tokens` or the context length (`max_model_len`, counting the
    prompt); a stop wins over length on the same token. Stops count only after `min_tokens` outputs. The
    stopping token's text and a stop string are cut from `text` unless `include_stop_str_in_output` (the ids
    keep every token, as in vLLM); `stop_reason` is the stop token id or string (None for EOS and length).
    Stop strings are matched on the detokenized text, so one may span any number of tokens.
    """

    def __init__(self, params: _StopParams, tokenizer=None, prompt_token_ids: Sequence[int] = (),
                 eos_token_ids: Sequence[int] = (), max_model_len: int | None = None):
        from ioattn.models.tokenizer import incremental_detokenizer

        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to detokenize the output")
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_length = min(
            math.inf if params.max_tokens is None else params.max_tokens,
            math.inf if max_model_len is None else max_model_len - len(prompt_token_ids),
        )
        self.detokenizer = None if tokenizer is None else incremental_detokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        self.longest_stop = max(map(len, params.stop), default=0)
        self.output_token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str | None:
        assert not self.finished, "append after the sequence finished"
        self.output_token_ids.append(token_id)
        may_stop = len(self.output_token_ids) > self.params.min_tokens
        if may_stop and (token_id in self.eos_token_ids or token_id in self.stop_token_ids):
            if self.params.include_stop_str_in_output:
                self._push(token_id)
            self._finish("stop", token_id if token_id in self.stop_token_ids else None)
        else:
            searched_from = max(0, len(self.text) - self.longest_stop + 1)
            self._push(token_id)
            if may_stop and self.params.stop:
                self._find_stop_string(searched_from)
        if not self.finished and len(self.output_token_ids) >= self.max_length:
            self._finish("length", None)
        return self.finish_reason

    @property
    def stable_text(self) -> str:
        """The text that no later stop string can take back: safe to stream."""
        if self.finished or self.params.include_stop_str_in_output or not self.longest_stop:
            return self.text
        return self.text[: max(0, len(self.text) - self.longest_stop + 1)]

    def fork(self) -> StopChecker:
        """An independent copy (for n > 1 and beam forks)."""
        forked = copy.copy(self)
        forked.output_token_ids = list(self.output_token_ids)
        if self.detokenizer is not None:
            forked.detokenizer = self.detokenizer.fork()
        return forked

    def _push(self, token_id: int) -> None:
        if self.detokenizer is not None:
            self.text += self.detokenizer.push(token_id)

    def _find_stop_string(self, start: int) -> None:
        hits = [(index, stop) for stop in self.params.stop if (index := self.text.find(stop, start)) >= 0]
        if hits:
            index, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            self.text = self.text[: index + len(stop) if self.params.include_stop_str_in_output else index]
            self.finish_reason, self.stop_reason = "stop", stop

    def _finish(self, reason: str, stop_reason) -> None:
        if self.detokenizer is not None:
            self.text += self.detokenizer.flush()
        self.finish_reason, self.stop_reason = reason, stop_reason


@dataclass
class Beam:
    token_ids: list[int]  # generated tokens (the prompt is the engine's)
    score: float  # running: sum of logprobs; finished: that sum / length ** length_penalty


@dataclass
class BeamStep:
    """What the engine does after one step: new running beam j continues old beam `parents[j]` with
    `tokens[j]` (fork the parent's sequence when it has several children, free it when it has none)."""

    parents: list[int]
    tokens: list[int]


class BeamSearch:
    """One request's beam search, transformers' algorithm: each step keeps the best `beams_to_keep` =
    max(2, 1 + #stop ids) * beam_width continuations of all beams by summed logprob; those ending in a stop id
    (or at max length) enter the finished set only when ranked within the first beam_width, scored
    sum / length ** length_penalty, and the set keeps its best beam_width; the best beam_width unfinished ones
    run on. The search ends when no running beam can beat the worst of a full finished set (transformers'
    heuristic for `early_stopping`), when the set is full and `early_stopping` is True, or at max length.
    """

    def __init__(self, params: BeamSearchParams, eos_token_ids: Sequence[int] = (), prompt_len: int = 0,
                 max_model_len: int | None = None):
        self.params = params
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stop_ids = sorted(stops)
        self.max_length = min(
            math.inf if params.max_tokens is None else params.max_tokens,
            math.inf if max_model_len is None else max_model_len - prompt_len,
        )
        self.running = [Beam([], 0.0)]  # best first
        self.finished: list[Beam] = []  # best first, at most beam_width
        self.done = False
        self._can_improve = True

    def step(self, logits: torch.Tensor) -> BeamStep:
        """logits (len(running), V) of the running beams' next tokens, in `running`'s order."""
        assert not self.done and logits.shape[0] == len(self.running)
        width, length = self.params.beam_width, len(self.running[0].token_ids)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if length < self.params.min_tokens and self.stop_ids:
            logprobs[:, [t for t in self.stop_ids if t < logits.shape[1]]] = -math.inf
        scores = logprobs + torch.tensor([b.score for b in self.running], device=logprobs.device)[:, None]
        beams_to_keep = min(max(2, 1 + len(self.stop_ids)) * width, scores.numel())
        top_scores, top_indices = scores.flatten().topk(beams_to_keep)
        vocab, at_max_length = logits.shape[1], length + 1 >= self.max_length
        accepting = self._can_improve and not self._full_and_stopping_early()
        parents, tokens, next_running = [], [], []
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_indices.tolist())):
            parent, token = divmod(index, vocab)
            beam = Beam(self.running[parent].token_ids + [token], score)
            if at_max_length or token in self.stop_ids:
                if rank < width and accepting:
                    self._add_finished(beam)
            elif len(next_running) < width:
                parents.append(parent)
                tokens.append(token)
                next_running.append(beam)
        self.running = next_running
        self._update_can_improve(length + 1)
        self.done = not self.running or not self._can_improve or self._full_and_stopping_early()
        return BeamStep(parents, tokens)

    def best(self) -> list[Beam]:
        """The `n` best finished beams, best first (call once `done`)."""
        return self.finished[: self.params.n]

    def _add_finished(self, beam: Beam) -> None:
        beam.score /= len(beam.token_ids) ** self.params.length_penalty
        self.finished.append(beam)
        # Stable sort: on a tie the beam that finished first stays ahead.
        self.finished.sort(key=lambda b: -b.score)
        del self.finished[self.params.beam_width :]

    def _full_and_stopping_early(self) -> bool:
        return self.params.early_stopping is True and len(self.finished) == self.params.beam_width

    def _update_can_improve(self, length: int) -> None:
        if not self.running or len(self.finished) < self.params.beam_width:
            return
        if self.params.early_stopping == "never" and self.params.length_penalty > 0:
            length = self.max_length  # the best a running beam could still reach
        best_possible = self.running[0].score / length ** self.params.length_penalty
        self._can_improve = best_possible > self.finished[-1].score
