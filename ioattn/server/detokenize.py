"""A request's text, made in the HTTP process from the token ids the engine process sends.

Each sample runs the engine's own `StopChecker` (with the tokenizer, which only this process has) over the ids as
they arrive: incremental detokenization, stop strings even when they span tokens, `min_tokens`,
`include_stop_str_in_output`, and the stable text that no later stop string can take back (what streams). So text,
finish reasons and token counts are exactly what the engine produces in one process. EOS, stop tokens and lengths
end a sample here on the very token they end it in the engine (same parameters, stop ids and context length);
stop strings end it only here. Once every sample of a request has ended here while the engine still runs it (a
stop string), the caller aborts it in the engine, a step or two later than an in-process check would have (vLLM
v1 does the same). With n > 1, a sample that met a stop string while its siblings run on keeps running in the
engine until the request ends; its further tokens are dropped here.
"""

from __future__ import annotations

from ioattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ioattn.engine.sampling import SamplingParams, StopChecker
from ioattn.server.transport import RequestDelta


class RequestText:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 eos_token_ids: list[int], max_model_len: int, arrival_time: float):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.checkers = [StopChecker(params, tokenizer, prompt_token_ids, eos_token_ids, max_model_len)
                         for _ in range(params.n)]
        self.logprobs = [None if params.logprobs is None else [] for _ in range(params.n)]
        # A finish the engine reported that this side's checker did not reach (only an engine-side abort can).
        self.ended: list[tuple[str, int | None] | None] = [None] * params.n
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.error: str | None = None
        self.finished = False  # every sample has ended, here or in the engine

    def apply(self, delta: RequestDelta) -> int:
        """Take the engine's new tokens for this request; return how many the engine generated (those dropped here
        after a stop string included)."""
        generated = 0
        for sample in delta.samples:
            index, tokens = sample.index, sample.token_ids
            generated += len(tokens)
            checker, logprobs = self.checkers[index], self.logprobs[index]
            if self._ended(index):
                continue  # it met a stop string here; the engine runs it on with its siblings
            for position, token in enumerate(tokens):
                if logprobs is not None:
                    logprobs.append(sample.logprobs[position])
                if checker.append(token) is not None:
                    break
            if sample.finish_reason is not None and not checker.finished:
                self.ended[index] = (sample.finish_reason, sample.stop_reason)
        if delta.finished:  # the engine is done with every sample, whatever this side made of them
            for index in range(len(self.checkers)):
                if not self._ended(index):
                    self.ended[index] = ("abort", None)
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = delta.first_token_time
        metrics.num_preemptions = delta.num_preemptions
        if delta.finished_time is not None:
            metrics.finished_time = delta.finished_time
        if delta.error is not None:
            self.error = delta.error
        # Only this method ends samples: kept, not recounted by every reader.
        self.finished = all(self._ended(index) for index in range(len(self.checkers)))
        return generated

    def _ended(self, index: int) -> bool:
        return self.checkers[index].finished or self.ended[index] is not None

    def output(self) -> RequestOutput:
        """The request's whole output so far. Its lists are this object's own, still growing: read them before the
        next message from the engine is applied (the formatters do, synchronously)."""
        completions = []
        for index, checker in enumerate(self.checkers):
            reason, stop_reason = self.ended[index] or (checker.finish_reason, checker.stop_reason)
            completions.append(CompletionOutput(
                index=index, text=checker.text if reason is not None else checker.stable_text,
                token_ids=checker.output_token_ids, cumulative_logprob=None, logprobs=self.logprobs[index],
                finish_reason=reason, stop_reason=stop_reason))
        return RequestOutput(self.request_id, None, self.prompt_token_ids, completions, self.finished, self.metrics,
                             self.error)
