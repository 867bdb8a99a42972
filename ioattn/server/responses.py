"""Engine outputs -> OpenAI response bodies and streaming chunks, for completions and chat.

Engine outputs are cumulative, so a formatter remembers, per choice, how much text and how many tokens it has
sent, and each chunk carries only what is new. Streamed text is the engine's stable text (it holds back what a
stop string could still take back), so the chunks of a choice concatenate to exactly the non-streamed text.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from ioattn.engine.outputs import CompletionOutput, RequestOutput
from ioattn.server import protocol as api


class Formatter:
    def __init__(self, request_id: str, model: str, tokenizer, num_prompt_tokens: int, n: int,
                 logprobs: int | None, include_usage: bool):
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.num_prompt_tokens, self.n = num_prompt_tokens, n
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(time.time())
        self.sent_text = [""] * n
        self.sent_tokens = [0] * n
        self.finished = [False] * n
        self.latest: RequestOutput | None = None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def top(self, completion: CompletionOutput, position: int) -> list[tuple[str, float]]:
        """The `logprobs` most likely tokens at one position, most likely first (the engine's dict also holds the
        sampled token, which is dropped here unless it is among them)."""
        entries = sorted(completion.logprobs[position].items(), key=lambda item: -item[1])[: self.logprobs]
        return [(self.token_text(token), logprob) for token, logprob in entries]

    def usage(self, output: RequestOutput) -> api.Usage:
        generated = sum(len(c.token_ids) for c in output.outputs)
        return api.Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=generated,
                         total_tokens=self.num_prompt_tokens + generated)

    def chunks(self, output: RequestOutput) -> list[BaseModel]:
        """The chunks that carry what `output` adds to what was sent."""
        self.latest = output
        chunks = []
        for completion in output.outputs:
            i = completion.index
            if self.finished[i]:
                continue
            text = completion.text[len(self.sent_text[i]):]
            first, last = self.sent_tokens[i], len(completion.token_ids)
            if text or last > first or completion.finished:
                chunks.append(self.chunk(completion, text, first, last))
            self.sent_text[i], self.sent_tokens[i] = completion.text, last
            self.finished[i] = completion.finished
        return chunks

    def usage_chunk(self) -> BaseModel | None:
        raise NotImplementedError

    def chunk(self, completion: CompletionOutput, text: str, first: int, last: int) -> BaseModel:
        raise NotImplementedError

    def response(self, output: RequestOutput) -> BaseModel:
        raise NotImplementedError


def _finish_reason(completion: CompletionOutput) -> str | None:
    return completion.finish_reason if completion.finish_reason != "abort" else None


class CompletionFormatter(Formatter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offsets = [0] * self.n  # per choice: where the next streamed token's text starts

    def logprobs_between(self, completion: CompletionOutput, first: int, last: int,
                         offset: int) -> api.CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        result = api.CompletionLogprobs()
        for position in range(first, last):
            token_id = completion.token_ids[position]
            token = self.token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(completion.logprobs[position][token_id])
            top: dict[str, float] = {}
            for text, logprob in self.top(completion, position):
                top.setdefault(text, logprob)  # tokens that decode alike (partial UTF-8): keep the likeliest
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def chunk(self, completion, text, first, last):
        logprobs = self.logprobs_between(completion, first, last, self.text_offsets[completion.index])
        if logprobs is not None and logprobs.tokens:
            self.text_offsets[completion.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        choice = api.CompletionChoice(index=completion.index, text=text, finish_reason=_finish_reason(completion),
                                      logprobs=logprobs)
        return api.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self):
        if not self.include_usage or self.latest is None:
            return None
        return api.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[],
                                      usage=self.usage(self.latest))

    def response(self, output):
        choices = [
            api.CompletionChoice(index=c.index, text=c.text, finish_reason=_finish_reason(c),
                                 logprobs=self.logprobs_between(c, 0, len(c.token_ids), 0))
            for c in output.outputs
        ]
        return api.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(output))


class ChatFormatter(Formatter):
    def logprobs_between(self, completion: CompletionOutput, first: int, last: int) -> api.ChatLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for position in range(first, last):
            token_id = completion.token_ids[position]
            token = self.token_text(token_id)
            top = [api.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
                   for text, logprob in self.top(completion, position)]
            content.append(api.TokenLogprob(token=token, logprob=completion.logprobs[position][token_id],
                                            bytes=list(token.encode()), top_logprobs=top))
        return api.ChatLogprobs(content=content)

    def chunk(self, completion, text, first, last):
        # A choice's first chunk names the role, as OpenAI's do.
        delta = api.DeltaMessage(role="assistant" if first == 0 else None, content=text)
        choice = api.ChatChunkChoice(index=completion.index, delta=delta, finish_reason=_finish_reason(completion),
                                     logprobs=self.logprobs_between(completion, first, last))
        return api.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self):
        if not self.include_usage or self.latest is None:
            return None
        return api.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                       usage=self.usage(self.latest))

    def response(self, output):
        choices = [
            api.ChatChoice(index=c.index, message=api.AssistantMessage(content=c.text),
                           finish_reason=_finish_reason(c), logprobs=self.logprobs_between(c, 0, len(c.token_ids)))
            for c in output.outputs
        ]
        return api.ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                          usage=self.usage(output))
