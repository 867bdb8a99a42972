"""The engine loop: the one place that touches `LLMEngine` in a server.

`LLMEngine` is single-threaded: `add_request`, `step` and `abort_request` must never overlap. The loop is one
asyncio task: between steps it hands queued adds and aborts to the engine (on the event-loop thread), then runs
`engine.step()` in a worker thread so that HTTP handlers keep running while the model computes (always the same
thread, with the engine's CUDA device made current in it: the current device is per thread), then passes each
`RequestOutput` to its request's `RequestStream`. Handlers only append to the loop's queues and wait on streams.

A stream keeps only the latest output: engine outputs are cumulative (every field holds the whole output so far),
so a slow client loses nothing when several steps merge into one chunk, and a stream never grows.

An abort (client disconnect or cancel) is handed to the engine before the next step, which frees the request's
blocks at once; a request still queued in the loop is dropped without reaching the engine. A request the engine
refuses at `add_request` fails alone. If a step raises, every request in flight gets the error, the engine aborts
them all, and the loop keeps serving new requests: a last resort, for bugs; no request's parameters can cause it
(the handlers ask the engine's `check_params` first, and `add_request` checks the rest before registering).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ioattn.engine.llm_engine import LLMEngine
from ioattn.engine.sampling import SamplingParams
from ioattn.engine.outputs import RequestOutput
from ioattn.server.metrics import ServerMetrics

log = logging.getLogger("ioattn.server")

# Unfinished requests one server accepts (admitted, waiting in the engine, or queued in the loop); more get 429.
DEFAULT_MAX_QUEUED_REQUESTS = 1024


class Overloaded(Exception):
    """The server holds `max_queued_requests` unfinished requests already."""


class EngineFailure(Exception):
    """A step raised; the requests it was serving are lost (the message says why)."""


class RequestStream:
    """One request's outputs, as an async iterator that ends after the finished output."""

    def __init__(self, request_id: str, loop: EngineLoop):
        self.request_id = request_id
        self._loop = loop
        self._latest: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()
        self.finished = False
        self.num_output_tokens = 0  # counted by the loop, for the generated-tokens metric

    def put(self, item: RequestOutput | Exception) -> None:
        self._latest = item
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item = self._latest
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def final(self) -> RequestOutput:
        output = None
        async for output in self:
            pass
        return output

    def close(self) -> None:
        """Abort the request unless it has finished; call it (on the event loop) whenever its client goes away."""
        if not self.finished:
            self.finished = True
            self._loop.abort(self.request_id)

    async def aclose(self) -> None:
        """`close` as a coroutine: starlette runs a plain background function in a thread, off the event loop."""
        self.close()


@dataclass
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS):
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self._streams: dict[str, RequestStream] = {}
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._ids = itertools.count()

    # -- called by handlers, on the event-loop thread ---------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def add(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Queue a validated request; raises Overloaded past `max_queued_requests`."""
        if len(self._streams) >= self.max_queued_requests:
            raise Overloaded(f"the server holds {len(self._streams)} unfinished requests, its limit "
                             f"(max_queued_requests); retry later")
        stream = RequestStream(f"req-{next(self._ids)}", self)
        self._streams[stream.request_id] = stream
        self._adds.append(_Add(stream, list(prompt_token_ids), params, time.monotonic()))
        self._wake_up()
        return stream

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return
        self._aborts.append(request_id)
        self.metrics.request_aborted()
        self._wake_up()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ioattn-engine", initializer=self._enter_device)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ioattn-engine-loop")
        self._wake_up()

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._executor.shutdown(wait=True)
        for request_id in list(self._streams):
            self._streams.pop(request_id).put(EngineFailure("the server is shutting down"))

    def _enter_device(self) -> None:
        import torch

        device = self.engine.runner.device
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- the loop -----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._apply_queued()
            while self.engine.has_unfinished_requests():
                try:
                    outputs = await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.step)
                except Exception as error:  # the engine's state is unknown: fail what it held, keep serving
                    log.exception("engine step failed")
                    self._fail_all(EngineFailure(f"the engine failed while serving this request: {error!r}"))
                    outputs = []
                self._dispatch(outputs)
                self._apply_queued()

    def _apply_queued(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort_request(request_id)
        adds, self._adds = self._adds, []
        for add in adds:
            stream = add.stream
            if stream.request_id not in self._streams:
                continue  # aborted before it reached the engine
            try:
                self.engine.add_request(stream.request_id, params=add.params, prompt_token_ids=add.prompt_token_ids,
                                        arrival_time=add.arrival_time)
            except Exception as error:  # the handler validated it; this is a mismatch to report, not to hide
                if not isinstance(error, ValueError):
                    log.exception("add_request failed")
                    error = EngineFailure(f"the engine could not take this request: {error!r}")
                del self._streams[stream.request_id]
                stream.put(error)
                continue
            self.metrics.request_admitted(len(add.prompt_token_ids))
        self.metrics.update_engine(self.engine, len(self._adds))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        generated = 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted during the step
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            generated += num_tokens - stream.num_output_tokens
            stream.num_output_tokens = num_tokens
            if output.finished:
                del self._streams[output.request_id]
                self.metrics.request_finished(output)
            stream.put(output)
        self.metrics.tokens_generated(generated)

    def _fail_all(self, error: EngineFailure) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # keep failing the others' streams: the loop must outlive a broken engine
                log.exception("abort of %s failed after a failed step", request_id)
        for request_id in list(self._streams):
            if not any(add.stream.request_id == request_id for add in self._adds):
                self._streams.pop(request_id).put(error)
                self.metrics.request_failed()
