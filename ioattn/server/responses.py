"""Request outputs -> OpenAI response bodies and streaming chunks, for completions and chat.

Outputs are cumulative, so a formatter remembers, per choice, how much text and how many tokens it has sent, and
each chunk carries only what is new. Streamed text is the stable text (it holds back what a stop string could
still take back), so the chunks of a choice concatenate to exactly the non-streamed text. A batch of prompts
(completions) is one engine request per prompt; as in OpenAI's API, choice `i * n + j` is sample j of prompt i,
and usage adds up every prompt.

Logprob tokens are their decoded text, which two tokens can share (bytes of one unfinished character both
decode to U+FFFD): every entry is kept. A completions `top_logprobs` dict cannot hold one key twice, so a token
whose text an earlier entry of its position already took is written `token_id:N`, the spelling vLLM's
`return_tokens_as_token_ids` uses, which (accepted here too) writes every token that way.

Streaming chunks are JSON text. A chunk without logprobs (every token's chunk, at thousands a second) is written
into the request's own frame, the bytes pydantic would write for the chunk's model, without building the model:
pydantic's validation and serialization cost more than everything else of the chunk.
"""

from __future__ import annotations

import time
from json.encoder import encode_basestring

from pydantic import BaseModel

from ioattn.engine.outputs import CompletionOutput, RequestOutput
from ioattn.server import protocol as api


class Formatter:
    def __init__(self, request_id: str, model: str, tokenizer, prompt_lengths: list[int], n: int,
                 logprobs: int | None, include_usage: bool, tokens_as_ids: bool = False):
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.prompt_lengths, self.n = prompt_lengths, n
        self.logprobs, self.include_usage, self.tokens_as_ids = logprobs, include_usage, tokens_as_ids
        self.created = int(time.time())
        choices = len(prompt_lengths) * n
        self.sent_text = [""] * choices
        self.sent_tokens = [0] * choices
        self.finished = [False] * choices
        self.latest: list[RequestOutput | None] = [None] * len(prompt_lengths)
        # The JSON of this request's chunk with no choices, split where a choice goes (see `chunk_json`).
        empty = self.chunk_model([]).model_dump_json()
        head, tail = empty.split('"choices":[]')
        self.chunk_head, self.chunk_tail = head + '"choices":[', "]" + tail

    def decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """How a logprob entry names its token."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.decoded(token_id)

    def top(self, completion: CompletionOutput, position: int) -> list[tuple[int, float]]:
        """The `logprobs` most likely (token id, logprob) at one position, most likely first (the engine's dict also
        holds the sampled token, which is dropped here unless it is among them)."""
        return sorted(completion.logprobs[position].items(), key=lambda item: -item[1])[: self.logprobs]

    def usage(self) -> api.Usage:
        prompt = sum(self.prompt_lengths)
        generated = sum(len(c.token_ids) for output in self.latest if output is not None for c in output.outputs)
        return api.Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)

    def chunks(self, output: RequestOutput, prompt_index: int = 0) -> list[str]:
        """The chunks (JSON) that carry what `output` (the request of prompt `prompt_index`) adds to what was
        sent."""
        self.latest[prompt_index] = output
        chunks = []
        for completion in output.outputs:
            i = prompt_index * self.n + completion.index
            if self.finished[i]:
                continue
            text = completion.text[len(self.sent_text[i]):]
            first, last = self.sent_tokens[i], len(completion.token_ids)
            if text or last > first or completion.finished:
                chunks.append(self.chunk_json(i, completion, text, first, last))
            self.sent_text[i], self.sent_tokens[i] = completion.text, last
            self.finished[i] = completion.finished
        return chunks

    def choices(self, outputs: list[RequestOutput]) -> list[tuple[int, CompletionOutput]]:
        """(choice index, completion) of every prompt's final output, in choice order."""
        self.latest = list(outputs)
        return [(p * self.n + c.index, c) for p, output in enumerate(outputs) for c in output.outputs]

    def usage_chunk(self) -> BaseModel | None:
        raise NotImplementedError

    def chunk_json(self, choice: int, completion: CompletionOutput, text: str, first: int, last: int) -> str:
        """`chunk(...).model_dump_json()`, written directly when there are no logprobs."""
        if self.logprobs is not None:
            return self.chunk(choice, completion, text, first, last).model_dump_json()
        return f"{self.chunk_head}{self.choice_json(choice, completion, text, first)}{self.chunk_tail}"

    def chunk_model(self, choices: list) -> BaseModel:
        """A streaming chunk of this request holding `choices`."""
        raise NotImplementedError

    def chunk(self, choice: int, completion: CompletionOutput, text: str, first: int, last: int) -> BaseModel:
        raise NotImplementedError

    def choice_json(self, choice: int, completion: CompletionOutput, text: str, first: int) -> str:
        """The JSON of `chunk`'s one choice, when there are no logprobs."""
        raise NotImplementedError

    def response(self, outputs: list[RequestOutput]) -> BaseModel:
        raise NotImplementedError


def _finish_reason(completion: CompletionOutput) -> str | None:
    return completion.finish_reason if completion.finish_reason != "abort" else None


def _json_or_null(text: str | None) -> str:
    return "null" if text is None else encode_basestring(text)


class CompletionFormatter(Formatter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offsets = [0] * len(self.sent_text)  # per choice: where the next streamed token's text starts

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
            for top_id, logprob in self.top(completion, position):
                text = self.token_text(top_id)
                top[f"token_id:{top_id}" if text in top else text] = logprob
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def chunk(self, choice, completion, text, first, last):
        logprobs = self.logprobs_between(completion, first, last, self.text_offsets[choice])
        if logprobs is not None and logprobs.tokens:
            self.text_offsets[choice] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        body = api.CompletionChoice(index=choice, text=text, finish_reason=_finish_reason(completion),
                                    logprobs=logprobs)
        return self.chunk_model([body])

    def chunk_model(self, choices):
        return api.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices)

    def choice_json(self, choice, completion, text, first):
        return (f'{{"index":{choice},"text":{encode_basestring(text)},"logprobs":null,'
                f'"finish_reason":{_json_or_null(_finish_reason(completion))}}}')

    def usage_chunk(self):
        if not self.include_usage or not any(self.latest):
            return None
        return api.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[],
                                      usage=self.usage())

    def response(self, outputs):
        choices = [
            api.CompletionChoice(index=i, text=c.text, finish_reason=_finish_reason(c),
                                 logprobs=self.logprobs_between(c, 0, len(c.token_ids), 0))
            for i, c in self.choices(outputs)
        ]
        return api.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())


class ChatFormatter(Formatter):
    def entry(self, token_id: int) -> tuple[str, list[int]]:
        """A chat logprob's token and bytes (those of its decoded text)."""
        decoded = self.decoded(token_id)
        return (f"token_id:{token_id}" if self.tokens_as_ids else decoded), list(decoded.encode())

    def logprobs_between(self, completion: CompletionOutput, first: int, last: int) -> api.ChatLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for position in range(first, last):
            token_id = completion.token_ids[position]
            top = [api.TopLogprob(token=text, logprob=logprob, bytes=data)
                   for (text, data), logprob in ((self.entry(t), lp) for t, lp in self.top(completion, position))]
            token, data = self.entry(token_id)
            content.append(api.TokenLogprob(token=token, logprob=completion.logprobs[position][token_id], bytes=data,
                                            top_logprobs=top))
        return api.ChatLogprobs(content=content)

    def chunk(self, choice, completion, text, first, last):
        # A choice's first chunk names the role, as OpenAI's do.
        delta = api.DeltaMessage(role="assistant" if first == 0 else None, content=text)
        body = api.ChatChunkChoice(index=choice, delta=delta, finish_reason=_finish_reason(completion),
                                   logprobs=self.logprobs_between(completion, first, last))
        return self.chunk_model([body])

    def chunk_model(self, choices):
        return api.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices)

    def choice_json(self, choice, completion, text, first):
        role = '"assistant"' if first == 0 else "null"
        return (f'{{"index":{choice},"delta":{{"role":{role},"content":{encode_basestring(text)}}},'
                f'"logprobs":null,"finish_reason":{_json_or_null(_finish_reason(completion))}}}')

    def usage_chunk(self):
        if not self.include_usage or not any(self.latest):
            return None
        return api.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                       usage=self.usage())

    def response(self, outputs):
        choices = [
            api.ChatChoice(index=i, message=api.AssistantMessage(content=c.text), finish_reason=_finish_reason(c),
                           logprobs=self.logprobs_between(c, 0, len(c.token_ids)))
            for i, c in self.choices(outputs)
        ]
        return api.ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                          usage=self.usage())
