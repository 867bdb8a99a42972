"""A request as the engine tracks it (its sequences, stop checkers, generators, beam search), and the
`RequestOutput` built from it after each step that touched it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ioattn.engine.sampling import BeamSearch, BeamSearchParams, SamplingParams, StopChecker
from ioattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ioattn.engine.sequence import Sequence


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
    # output_kind "delta": per sample index, the output tokens and text characters its outputs have held so far.
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def forked(self) -> bool:
        return len(self.seqs) == self.params.n

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, without a generator
            return self.params.n == 1 and seqs[0].is_finished
        return self.forked and all(seq.is_finished for seq in seqs)


def request_output(request: Request, finished: bool, tokenizer) -> RequestOutput:
    """The request's whole output so far (vLLM's cumulative outputs), or with output_kind "delta" what is new since
    its last output."""
    if request.beam is not None:
        return _beam_output(request, tokenizer)
    delta = request.params.output_kind == "delta"  # else cumulative (final_only is cumulative, built once)
    with_logprobs = request.params.logprobs is not None
    completions = []
    for seq in request.seqs:
        checker = request.checkers[seq.index]
        text = checker.text if seq.is_finished else checker.stable_text
        # The checker holds exactly the sequence's outputs that have reached the host: copying them skips the
        # prompt and any token still on its way.
        tokens = checker.output_token_ids
        first = first_char = 0
        if delta:
            first, first_char = request.sent.get(seq.index, (0, 0))
            request.sent[seq.index] = (len(tokens), len(text))
        completions.append(CompletionOutput(
            index=seq.index, text=text[first_char:], token_ids=tokens[first:],
            cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs[first:] if with_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        ))
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                         request.metrics)


def _beam_output(request: Request, tokenizer) -> RequestOutput:
    """Finished: the n best beams, score = sum of logprobs / length ** length_penalty. Running: the beams so far,
    score = their running sum."""
    search = request.beam
    beams = search.best() if search.done else search.running
    skip_special_tokens = request.params.skip_special_tokens
    completions = [
        CompletionOutput(
            index=i, text=tokenizer.decode(beam.token_ids, skip_special_tokens=skip_special_tokens),
            token_ids=list(beam.token_ids), cumulative_logprob=beam.score, logprobs=None,
            finish_reason=None if not search.done else (
                "stop" if beam.token_ids and beam.token_ids[-1] in search.stop_ids else "length"),
        )
        for i, beam in enumerate(beams)
    ]
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, search.done,
                         request.metrics)
