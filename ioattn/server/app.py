"""The OpenAI-compatible HTTP app: `create_app(EngineSpec(...))` -> a FastAPI app to run with uvicorn; its lifespan
starts the engine-core process (`ioattn.server.client`) and stops it.

Routes: POST /v1/completions (one prompt or a batch), POST /v1/chat/completions (both with `stream`: server-sent
events in OpenAI's chunk format, ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus text), GET /version.

Every request is checked in its handler before it reaches the engine (every string UTF-8-encodable, model name,
prompts, lengths, sampling values), and the engine process checks the rest (what this model cannot serve, such as
stop token ids outside its vocabulary) before its next step, so bad input gets a 400 with an OpenAI error body whose
`param` names the field as the client spelled it before any byte of a stream, and never disturbs the engine or
other requests. An unknown model is a 404 (`model_not_found`); past `max_queued_requests` unfinished requests the
server answers 429; while the engine process is not serving, 503. A client that disconnects (streaming or not) or
cancels has its requests aborted, which frees their KV blocks before the engine's next step. Responses never carry a
stack trace: an unexpected error is logged and answered with a plain 500.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import ioattn
from ioattn.engine.sampling import SamplingParams
from ioattn.kv.manager import all_token_ids
from ioattn.server import protocol as api
from ioattn.server.chat_template import ChatTemplate, TemplateError
from ioattn.server.client import EngineClient, EngineFailure, EngineUnavailable, Overloaded, Submission
from ioattn.server.core import EngineSpec
from ioattn.server.metrics import CONTENT_TYPE, ServerMetrics
from ioattn.server.responses import ChatFormatter, CompletionFormatter, Formatter
from ioattn.server.security import RequestGuard, ServerLimits

log = logging.getLogger("ioattn.server")


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type: str, param: str | None = None, code: str | None = None):
    # Both may quote what the client sent, which may not be encodable (a lone surrogate in an unknown key).
    param = None if param is None else api.printable(param)
    body = api.ErrorResponse(error=api.ErrorInfo(message=api.printable(message), type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(errors: list[dict], body) -> tuple[str, str | None]:
    """FastAPI's validation errors -> (message, param) in words a client can act on. A union field (`prompt`,
    `content`) fails once per member: the error that reaches deepest into what the client sent explains best."""
    error = max(errors, key=lambda e: len(_client_param(e.get("loc", ()), body, False) or ""))
    kind = error.get("type")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    if kind == api.UNENCODABLE:
        return error["msg"], error["ctx"]["param"]
    param = _client_param(error.get("loc", ()), body, kind == "missing")
    if kind == "extra_forbidden":
        return f"{param}: unknown or unsupported parameter", param
    return (f"{param}: {error.get('msg')}" if param else f"the request body is invalid: {error.get('msg')}"), param


def _client_param(loc, body, missing: bool) -> str | None:
    """The dotted path of the field as the client sent it: the parts of pydantic's location that index into the
    body (the others are union-member tags such as `str` or `list[int]`), plus a missing field's name."""
    loc = tuple(loc)
    loc = loc[1:] if loc[:1] == ("body",) else loc
    parts, node = [], body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node or (isinstance(node, list) and isinstance(part, int)
                                                         and 0 <= part < len(node)):
            node = node[part]
        elif not (missing and isinstance(node, dict) and i == len(loc) - 1):
            continue
        parts.append(str(part))
    return ".".join(parts) or None


def _param_of(error: ValueError) -> str:
    """The field a SamplingParams / engine ValueError names: its first word, by their convention."""
    return str(error).split()[0] if str(error) else None


class Server:
    """Request checks and the route handlers' logic, around one engine client."""

    def __init__(self, client: EngineClient, served_model_name: str, chat_template: ChatTemplate, tokenizer,
                 limits: ServerLimits):
        self.client = client
        self.model_name = served_model_name
        self.chat_template = chat_template
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = client.metrics

    @property
    def info(self):
        return self.client.info

    # -- checks -----------------------------------------------------------------------------------------

    def check_common(self, body: api.CompletionRequest | api.ChatCompletionRequest) -> None:
        if body.model != self.model_name:
            raise ApiError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", status=404, code="model_not_found")
        if body.logit_bias:
            raise ApiError("logit_bias is not supported", "logit_bias")
        max_seqs = self.info.max_num_seqs
        if body.n > max_seqs:
            raise ApiError(f"n ({body.n}) must be <= the server's max_num_seqs ({max_seqs})", "n")

    def completion_prompts(self, body: api.CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            prompts, params = [prompt], ["prompt"]
        else:
            if len(prompt) > self.limits.max_prompts:
                raise ApiError(f"prompt: a batch of {len(prompt)} prompts is more than this server takes in one "
                               f"request ({self.limits.max_prompts}); split it", "prompt")
            prompts, params = prompt, [f"prompt.{i}" for i in range(len(prompt))]
        return [self._checked_ids(self.tokenizer.encode(p) if isinstance(p, str) and p else list(p), param)
                for p, param in zip(prompts, params)]

    def chat_prompt(self, body: api.ChatCompletionRequest) -> list[int]:
        if body.tools:
            raise ApiError("tools are not supported", "tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise ApiError("response_format: only {'type': 'text'} is supported", "response_format")
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        try:
            text = self.chat_template.render(messages, body.add_generation_prompt)
        except TemplateError as error:
            raise ApiError(str(error), "messages") from error
        except Exception as error:  # a checkpoint's template is code run on the client's messages: their fault
            raise ApiError(f"the chat template failed on these messages: {error!r}", "messages") from error
        ids = self.tokenizer.encode(text, add_special_tokens=self.chat_template.add_special_tokens)
        return self._checked_ids(ids, "messages")

    def _checked_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(f"{param}: the prompt is empty; it must hold at least one token", param)
        vocab, max_model_len = self.info.vocab_size, self.info.max_model_len
        if not all_token_ids(ids, limit=vocab):  # sent by the client, or a tokenizer larger than the model
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ApiError(f"{param}: token ids must be in [0, {vocab}), got {bad[:5]}", param)
        if len(ids) >= max_model_len:
            raise ApiError(f"{param}: the prompt is {len(ids)} tokens; this model's context (max_model_len) is "
                           f"{max_model_len}, which must leave room for at least one generated token", param)
        return ids

    def sampling_params(self, body, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                        max_tokens_given: bool) -> SamplingParams:
        """Values checked here; what this model can serve is checked by the engine when it takes the request."""
        max_model_len = self.info.max_model_len
        room = max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            if not max_tokens_given:
                max_tokens = room  # the completions default (16) shrinks to fit; an explicit value does not
            else:
                raise ApiError(f"max_tokens ({max_tokens}) + prompt tokens ({prompt_len}) exceed this model's "
                               f"context (max_model_len {max_model_len})", "max_tokens")
        try:
            params = body.sampling_params(max_tokens, logprobs)
        except ValueError as error:
            raise ApiError(str(error), _param_of(error)) from error
        # The engine checks this too when it takes the request; here it spares sending an id that does not fit
        # a 64-bit integer, in the engine's own words.
        vocab = self.info.vocab_size
        out_of_vocab = [t for t in params.stop_token_ids if t >= vocab]
        if out_of_vocab:
            raise ApiError(f"stop_token_ids must be token ids in [0, {vocab}), got {out_of_vocab[:5]}",
                           "stop_token_ids")
        return params

    # -- serving ----------------------------------------------------------------------------------------

    def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> Submission:
        try:
            return self.client.submit(requests)
        except Overloaded as error:
            raise ApiError(str(error), status=429, type="rate_limit_error", code="rate_limit_exceeded") from error
        except EngineUnavailable as error:
            raise ApiError(str(error), status=503, type="server_error", code="engine_unavailable") from error
        except ValueError as error:  # a value the transport cannot carry
            raise ApiError(str(error)) from error

    async def respond(self, request: Request, submission: Submission, formatter: Formatter, streaming: bool):
        streamed = False
        try:
            try:
                accepted = await _unless_disconnected(request, submission.accepted())
                if accepted is _GONE:
                    return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
                if streaming:
                    streamed = True
                    # The background task runs after the response ends, also when starlette cancelled it on a
                    # disconnect before the generator ever started (its own `finally` would then never run).
                    return StreamingResponse(self._events(submission, formatter), media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"},
                                             background=BackgroundTask(submission.aclose))
                finals = await _unless_disconnected(request, submission.finals())
            except ValueError as error:  # the engine refused what the handler's checks let through
                raise ApiError(str(error), _param_of(error)) from error
            if finals is _GONE:
                return Response(status_code=499)
            return JSONResponse(formatter.response(finals).model_dump(exclude_none=False))
        except EngineFailure as error:
            return error_response(500, str(error), "server_error")
        finally:
            if not streamed:
                submission.close()

    async def _events(self, submission: Submission, formatter: Formatter) -> AsyncIterator[str]:
        """SSE lines; the requests are aborted if the client goes away (starlette cancels this generator)."""
        try:
            async for prompt_index, output in submission.outputs():
                for chunk in formatter.chunks(output, prompt_index):
                    yield f"data: {chunk}\n\n"
            usage_chunk = formatter.usage_chunk()
            if usage_chunk is not None:
                yield _sse(usage_chunk)
        except Exception as error:  # the stream has begun: report in-band, as OpenAI does
            log.warning("request %s failed: %s", formatter.request_id, error)
            status = 400 if isinstance(error, ValueError) else 500
            yield _sse(api.ErrorResponse(error=api.ErrorInfo(
                message=api.printable(str(error)), type="invalid_request_error" if status == 400 else "server_error")))
        finally:
            submission.close()
        yield "data: [DONE]\n\n"


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


_GONE = object()  # what _unless_disconnected returns when the client left first


async def _unless_disconnected(request: Request, work):
    """`work`'s result, or _GONE if the client disconnects first (uvicorn does not cancel handlers)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    return _GONE


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(spec: EngineSpec, *, served_model_name: str, chat_template: ChatTemplate | None = None,
               tokenizer=None, limits: ServerLimits = ServerLimits(), restart_engine: bool = False,
               on_engine_exit: Callable[[str], None] | None = None, address: str | None = None) -> FastAPI:
    """The app for the engine `spec` describes. tokenizer: the model's (default: read from its files, without the
    weights). on_engine_exit(why): called when the engine process has died and will not be restarted (the CLI
    stops the server, exiting non-zero). address: shown in the start-up log."""
    if tokenizer is None:
        from ioattn.models.loader import load_tokenizer

        tokenizer = load_tokenizer(spec.model)
    client = EngineClient(spec, tokenizer, ServerMetrics(), max_queued_requests=limits.max_queued_requests,
                          restart_engine=restart_engine, on_engine_exit=on_engine_exit)
    server = Server(client, served_model_name, chat_template or ChatTemplate.plain(), tokenizer, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            info = await client.start()
        except BaseException:
            await client.stop()
            raise
        log.info("serving %s as %r%s: %s on %s, tensor parallel %d; KV pool %d blocks x %d tokens = %d tokens, "
                 "%.3g GiB (%s); max_model_len %d; API key %s; engine process pid %d", info.model, served_model_name,
                 f" at {address}" if address else "", info.dtype, info.device, info.tensor_parallel_size,
                 info.num_blocks, info.block_size, info.kv_tokens, info.kv_cache_bytes / 2**30, info.cache_dtype,
                 info.max_model_len, "required" if limits.api_key else "not required", info.pid)
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(title="ioattn", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(RequestGuard, api_key=limits.api_key, max_body_bytes=limits.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        message, param = _validation_message(error.errors(), error.body)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return error_response(error.status_code, str(error.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, "internal server error (the server's log has the details)", "server_error")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        server.check_common(body)
        for name, supported in (("echo", not body.echo), ("suffix", body.suffix is None),
                                ("best_of", body.best_of in (None, body.n))):
            if not supported:
                raise ApiError(f"{name} is not supported" + (" (other than best_of = n)" if name == "best_of" else ""),
                               name)
        prompts = server.completion_prompts(body)
        given = "max_tokens" in body.model_fields_set
        requests = [(ids, server.sampling_params(body, len(ids), body.max_tokens, body.logprobs, given))
                    for ids in prompts]
        formatter = CompletionFormatter(_request_id("cmpl"), server.model_name, tokenizer, [len(p) for p in prompts],
                                        body.n, body.logprobs, body.include_usage_in_stream,
                                        body.return_tokens_as_token_ids)
        return await server.respond(request, server.submit(requests), formatter, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        server.check_common(body)
        prompt_ids = server.chat_prompt(body)
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = server.sampling_params(body, len(prompt_ids), max_tokens, top_logprobs, max_tokens is not None)
        formatter = ChatFormatter(_request_id("chatcmpl"), server.model_name, tokenizer, [len(prompt_ids)], body.n,
                                  top_logprobs, body.include_usage_in_stream, body.return_tokens_as_token_ids)
        return await server.respond(request, server.submit([(prompt_ids, params)]), formatter, body.stream)

    @app.get("/v1/models")
    async def models():
        return api.ModelList(data=[api.ModelCard(id=server.model_name, max_model_len=server.info.max_model_len)])

    @app.get("/health")
    async def health():
        if not client.alive:
            return error_response(503, client.failure or "the engine is not serving", "server_error")
        return {"status": "ok", "unfinished_requests": client.num_unfinished}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": ioattn.__version__}

    return app


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
