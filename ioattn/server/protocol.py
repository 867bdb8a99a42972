"""The OpenAI API's request and response bodies (pydantic), and their translation to `SamplingParams`.

Requests accept OpenAI's fields plus vLLM's sampling extensions (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, ...), which clients send through `extra_body`. Unknown fields are refused (400
naming the field) rather than ignored: a misspelt `temprature` must not silently sample at 1.0. Types are strict
(`true` is not the token id 1, nor `"yes"` a boolean). Range checks live in `SamplingParams` (one source of truth
with the engine); here only the limits OpenAI itself documents and those the engine cannot know (a seed must fit
in 64 bits, `max_tokens` must fit the context).

Every string of a request, dict keys included, must be one UTF-8 can encode: JSON lets a client send a lone
surrogate (`"\\ud800"`), which no tokenizer takes. One check over the whole raw body refuses it before any field
is read (`UNENCODABLE`), naming where it is as a dotted path (`messages.0.content`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ioattn.engine.sampling import SamplingParams

# OpenAI's limits: legacy completions return at most 5 alternatives per token, chat at most 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
# Samples per request: each is a sequence in the engine's batch, so the engine's max_num_seqs bounds it too.
MAX_N = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# The validation error type of a string UTF-8 cannot encode; its ctx holds the dotted path ("param").
UNENCODABLE = "string_not_utf8"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, ser_json_inf_nan="null")


def printable(text: str) -> str:
    """text with what UTF-8 cannot encode written as a backslash escape (a key that is itself a lone surrogate
    still has to be named in an error body)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def unencodable_string(value: Any) -> tuple[str, str] | None:
    """(dotted path, that string) of the first string in a JSON value, keys included, that UTF-8 cannot encode;
    None when there is none. Iterative: nesting depth cannot overflow the stack."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path, item
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                key_path = f"{path}.{key}" if path else str(key)
                children += [(key_path, key), (key_path, child)]
            stack.extend(reversed(children))
        elif isinstance(item, list):
            # Token-id prompts are long lists of ints: only containers and strings need a look.
            stack.extend(reversed([(f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item)
                                   if isinstance(child, (str, dict, list))]))
    return None


class StreamOptions(StrictModel):
    include_usage: bool = False


class _SamplingRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    @model_validator(mode="before")
    @classmethod
    def _strings_utf8_can_encode(cls, data: Any) -> Any:
        found = unencodable_string(data)
        if found is not None:
            path, text = found
            index = next(i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
            raise PydanticCustomError(
                UNENCODABLE, "{param}: the string holds a lone surrogate ({char}) at index {index}, which UTF-8 "
                "cannot encode: send text as valid Unicode",
                {"param": printable(path), "char": ascii(text[index]), "index": index})
        return data

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility, unused
    # vLLM's extensions
    top_k: int = Field(0, le=INT64_MAX)  # bounds past the engine's own: what the engine process can be sent
    min_p: float = Field(0.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, allow_inf_nan=False)
    min_tokens: int = Field(0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprob tokens written "token_id:N"

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the first invalid field."""
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, stop=self.stop,
            seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
        )


class CompletionRequest(_SamplingRequest):
    # One prompt (a string or token ids), or a batch of them (a list of strings or of token-id lists).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None


class ChatMessage(StrictModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed through to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# -- responses ---------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ioattn"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
