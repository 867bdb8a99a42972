"""The HTTP process's side of the engine: it starts the engine-core process (`ioattn.server.core`, spawned: the
engine, and with it the CUDA context, belongs to that process alone), hands it requests and aborts, turns the
token deltas it sends into each request's text (`ioattn.server.detokenize`), and notices when it dies.

Everything here runs on the event loop. A handler `submit`s one request per prompt (a `Submission`), awaits their
acceptance (the engine checks what the handler could not, such as stop token ids against its vocabulary, and
answers before its next step), then reads outputs as they come. Adds and aborts of one event-loop turn go out as one
message; a request aborted before its add left is never sent. A `RequestStream` keeps no queue: its output is
rebuilt from its text when read, so a slow client gets several steps merged into one chunk and loses nothing.

If the engine process dies (killed, out of memory, a crash in native code), every request in flight ends with an
`EngineFailure` (a 500, or an error event mid-stream), new requests get `EngineUnavailable` (503), /health fails,
the log says how it died, and then the server is told to exit (`on_engine_exit`), unless `restart_engine` is set:
then a new engine process is started and serves new requests once it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from ioattn.engine.outputs import RequestOutput
from ioattn.engine.sampling import SamplingParams
from ioattn.server import core
from ioattn.server import transport as wire
from ioattn.server.detokenize import RequestText
from ioattn.server.metrics import ServerMetrics
from ioattn.server.security import ServerLimits

log = logging.getLogger("ioattn.server")

DEFAULT_MAX_QUEUED_REQUESTS = ServerLimits.max_queued_requests
# After the engine process exits: time for the messages it sent before dying to be read.
EXIT_DRAIN_S = 0.1
STOP_TIMEOUT_S = 30.0


class Overloaded(Exception):
    """The server holds `max_queued_requests` unfinished requests already."""


class EngineFailure(Exception):
    """The engine lost this request (a failed step, its process died, the server stops); the message says why."""


class EngineUnavailable(Exception):
    """The engine process is not serving (starting, restarting, or dead); the message says which."""


class RequestStream:
    """One engine request: accepted yet or not, its text, and whether its handler has read the latest output."""

    def __init__(self, text: RequestText, submission: Submission):
        self.text = text
        self.submission = submission
        self.accepted = False
        self.error: Exception | None = None
        self.done = False  # finished or failed: nothing more will come
        self.fresh = False  # an output the handler has not read

    @property
    def request_id(self) -> str:
        return self.text.request_id

    def changed(self, done: bool = False) -> None:
        self.fresh = True
        self.done = self.done or done
        self.submission.wake.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.changed(done=True)


class Submission:
    """The engine requests of one HTTP request, one per prompt, in prompt order."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.streams: list[RequestStream] = []
        self.wake = asyncio.Event()

    async def accepted(self) -> None:
        """Return once the engine took every prompt; else abort the others and raise the first refusal
        (ValueError: the request's fault; EngineFailure: the engine's)."""
        while not all(stream.accepted or stream.error for stream in self.streams):
            await self.wake.wait()
            self.wake.clear()
        error = next((stream.error for stream in self.streams if stream.error), None)
        if error is not None:
            self.close()
            raise error

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, its request's whole output so far) whenever one has new tokens, until all finished;
        raises the first failure."""
        while True:
            for index, stream in enumerate(self.streams):
                if stream.error is not None:
                    raise stream.error
                if stream.fresh:
                    stream.fresh = False
                    yield index, stream.text.output()
            if all(stream.done and not stream.fresh for stream in self.streams):
                return
            await self.wake.wait()
            self.wake.clear()

    async def finals(self) -> list[RequestOutput]:
        finals = [None] * len(self.streams)
        async for index, output in self.outputs():
            finals[index] = output
        return finals

    def close(self) -> None:
        """Abort every request not finished; call it whenever the handler stops listening."""
        for stream in self.streams:
            if not stream.done:
                stream.done = True
                self.client.abort(stream.request_id)

    async def aclose(self) -> None:
        """`close` as a coroutine: starlette runs a plain background function in a thread, off the event loop."""
        self.close()


class EngineClient:
    def __init__(self, spec: core.EngineSpec, tokenizer, metrics: ServerMetrics, *,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, restart_engine: bool = False,
                 on_engine_exit: Callable[[str], None] | None = None):
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.spec, self.tokenizer, self.metrics = spec, tokenizer, metrics
        self.max_queued_requests = max_queued_requests
        self.restart_engine = restart_engine
        self.on_engine_exit = on_engine_exit
        self.state = "created"  # starting | ready | restarting | failed | stopping | stopped
        self.failure: str | None = None  # why the engine is not serving, in words
        self.info: wire.EngineInfo | None = None
        self.process: multiprocessing.Process | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, RequestStream] = {}
        self._adds: dict[str, msgspec.Raw] = {}  # encoded AddRequests
        self._aborts: list[str] = []
        self._flush_scheduled = False
        self._ids = itertools.count()
        self._queries: dict[int, asyncio.Future] = {}
        self._ready: asyncio.Future | None = None
        self._start_error: str | None = None
        self._alive_writer = None
        self._receiver: asyncio.Task | None = None
        self._encoder = wire.encoder()
        self._decoder = wire.decoder(wire.FromEngine)

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> wire.EngineInfo:
        """Start the engine process; return what it loaded once it is ready (RuntimeError if it fails)."""
        self.loop = asyncio.get_running_loop()
        self.state = "starting"
        self.addresses = wire.Addresses.create()
        self.context = zmq.asyncio.Context()
        self.to_engine = wire.configure(self.context.socket(zmq.PUSH))
        self.to_engine.bind(self.addresses.to_engine)
        self.from_engine = wire.configure(self.context.socket(zmq.PULL))
        self.from_engine.bind(self.addresses.from_engine)
        self._receiver = self.loop.create_task(self._receive(), name="ioattn-engine-receiver")
        return await self._launch("starting")

    async def _launch(self, state: str) -> wire.EngineInfo:
        self.state, self.failure = state, f"the engine process is {state}"
        if state == "restarting":
            self.metrics.engine_restarted()
        self._start_error = None
        context = multiprocessing.get_context("spawn")
        if self._alive_writer is not None:
            self._alive_writer.close()  # the previous engine process's
        # The engine process reads its end until EOF, which comes only when this process (the one holder of the
        # writing end) has closed it or died: then it exits too.
        watch, self._alive_writer = context.Pipe(duplex=False)
        process = context.Process(target=core.main, args=(self.spec, self.addresses, watch),
                                  name="ioattn-engine-core")
        self._ready = self.loop.create_future()
        process.start()
        watch.close()
        self.process = process
        self.loop.add_reader(process.sentinel, self._process_exited, process)
        self.info = await self._ready
        self.metrics.engine_ready(self.info)
        self.state, self.failure = "ready", None
        return self.info

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Fail what is still running, stop the engine process (killing it past `timeout`), release the sockets;
        also after a start that failed."""
        if self.state in ("created", "stopped"):
            return
        self.state, self.failure = "stopping", "the server is shutting down"
        self._fail_all(EngineFailure("the server is shutting down"))
        if self._ready is not None and not self._ready.done():  # a restart under way: it ends here
            self._ready.set_exception(EngineFailure("the server is shutting down"))
        process = self.process
        if process is not None and process.exitcode is None:
            self.to_engine.send(self._encoder.encode(wire.Shutdown()))
            deadline = time.monotonic() + timeout
            while process.exitcode is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if process.exitcode is None:
                log.warning("the engine process did not stop within %.0f s: killing it", timeout)
                process.kill()
            process.join()
        if self._alive_writer is not None:
            self._alive_writer.close()
        self._receiver.cancel()
        try:
            await self._receiver
        except asyncio.CancelledError:
            pass
        for socket in (self.to_engine, self.from_engine):
            socket.close(linger=0)
        self.context.term()
        self.addresses.close()
        self.state = "stopped"

    def _process_exited(self, process: multiprocessing.Process) -> None:
        self.loop.remove_reader(process.sentinel)
        if process is self.process and self.state != "stopping":
            self.loop.create_task(self._engine_died(process))

    async def _engine_died(self, process: multiprocessing.Process) -> None:
        await asyncio.sleep(EXIT_DRAIN_S)
        process.join()
        if self.state == "stopping":
            return
        why = f"the engine process (pid {process.pid}) {wire.exit_description(process.exitcode)}"
        if not self._ready.done():  # it never got ready
            self._ready.set_exception(RuntimeError(why + (f": {self._start_error}" if self._start_error else "")))
            return
        log.error("%s; %d request(s) in flight fail", why, len(self.streams))
        self.state, self.failure = "failed", why
        self._fail_all(EngineFailure(f"{why} while serving this request"))
        if self.restart_engine:
            log.warning("restarting the engine process (--restart-engine)")
            try:
                await self._launch("restarting")
            except Exception as error:  # noqa: BLE001 (a restart that fails ends the server like a death does)
                if self.state == "stopping":
                    return
                log.error("the engine process could not restart: %s", error)
                self.state, self.failure = "failed", f"{why}, and could not restart: {error}"
            else:
                log.info("the engine process is ready again (pid %d)", self.info.pid)
                return
        if self.on_engine_exit is not None:
            self.on_engine_exit(self.failure)

    # -- requests -------------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.state == "ready"

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> Submission:
        """Queue one engine request per (prompt ids, params), checked by the handler; raises EngineUnavailable when
        the engine is not serving and Overloaded past `max_queued_requests`."""
        if self.state != "ready":
            raise EngineUnavailable(f"the server cannot take requests now: {self.failure}")
        if len(self.streams) + len(requests) > self.max_queued_requests:
            raise Overloaded(f"the server holds {len(self.streams)} unfinished requests; {len(requests)} more would "
                             f"pass its limit (max_queued_requests {self.max_queued_requests}); retry later")
        info = self.info
        now = time.monotonic()
        adds = {}
        for prompt, params in requests:
            request_id = f"req-{next(self._ids)}"
            engine_params = dataclasses.replace(params, stop=[]) if params.stop else params
            try:  # encoded now, so that what cannot be sent fails this request alone, here
                adds[request_id] = msgspec.Raw(self._encoder.encode(
                    wire.AddRequest(request_id, prompt, engine_params, now)))
            except (OverflowError, TypeError) as error:
                raise ValueError(f"this request holds a value the engine cannot be sent: {error}") from None
        submission = Submission(self)
        for (request_id, add), (prompt, params) in zip(adds.items(), requests):
            text = RequestText(request_id, prompt, params, self.tokenizer, info.eos_token_ids, info.max_model_len,
                               now)
            stream = RequestStream(text, submission)
            submission.streams.append(stream)
            self.streams[request_id] = stream
            self._adds[request_id] = add
        self._schedule_flush()
        return submission

    def abort(self, request_id: str) -> None:
        """The client went away: drop the request, and have the engine free its blocks."""
        if self.streams.pop(request_id, None) is None:
            return
        self.metrics.request_aborted()
        if self._adds.pop(request_id, None) is None:  # it has reached the engine (or is on its way)
            self._aborts.append(request_id)
            self._schedule_flush()

    async def stats(self, check_invariants: bool = False) -> dict:
        """`engine.stats()` from the engine process, with what its scheduler holds (and its KV invariants)."""
        if self.state != "ready":
            raise EngineUnavailable(f"the engine is not serving: {self.failure}")
        query_id = next(self._ids)
        reply = self._queries[query_id] = self.loop.create_future()
        self.to_engine.send(self._encoder.encode(wire.StatsQuery(query_id, check_invariants)))
        return await reply

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not (self._adds or self._aborts) or self.state != "ready":
            return
        message = wire.Inputs(list(self._adds.values()), self._aborts)
        self._adds, self._aborts = {}, []
        self.to_engine.send(self._encoder.encode(message), copy=False)

    def _fail_all(self, error: Exception) -> None:
        streams, self.streams, self._adds, self._aborts = self.streams, {}, {}, []
        for stream in streams.values():
            stream.fail(error)
            if stream.accepted:
                self.metrics.request_failed()
        for reply in self._queries.values():
            if not reply.done():
                reply.set_exception(EngineFailure(str(error)))
        self._queries.clear()

    # -- what the engine sends ------------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            frame = await self.from_engine.recv(copy=False)
            try:
                self._handle(self._decoder.decode(frame.buffer))
            except Exception:  # a bug here must not stop the outputs of every other request
                log.exception("failed to handle a message from the engine process")

    def _handle(self, message) -> None:
        if isinstance(message, wire.Outputs):
            self._outputs(message)
        elif isinstance(message, wire.Ready):
            if not self._ready.done():
                self._ready.set_result(message.info)
        elif isinstance(message, wire.StartFailed):
            self._start_error = message.message
        elif isinstance(message, wire.StatsReply):
            reply = self._queries.pop(message.query_id, None)
            if reply is not None and not reply.done():
                reply.set_result(message.stats)

    def _outputs(self, message: wire.Outputs) -> None:
        streams, metrics = self.streams, self.metrics
        for request_id in message.accepted:
            stream = streams.get(request_id)
            if stream is not None:
                stream.accepted = True
                metrics.request_admitted(len(stream.text.prompt_token_ids))
                stream.changed()
        for refused in message.refused:
            stream = streams.pop(request_id := refused.request_id, None)
            if stream is not None:
                if not refused.invalid:
                    log.error("the engine refused %s: %s", request_id, refused.message)
                stream.fail(ValueError(refused.message) if refused.invalid else EngineFailure(refused.message))
        generated = 0
        for delta in message.deltas:
            stream = streams.get(delta.request_id)
            if stream is None:
                continue  # aborted while the engine ran its step
            text = stream.text
            generated += text.apply(delta)
            if text.error is not None:
                del streams[delta.request_id]
                stream.fail(ValueError(text.error))
            elif text.finished:
                del streams[delta.request_id]
                if text.metrics.finished_time is None:
                    text.metrics.finished_time = time.monotonic()
                metrics.request_finished(text.output())
                if not delta.finished:  # stop strings ended it here: the engine still runs it
                    self._aborts.append(delta.request_id)
                    self._schedule_flush()
                stream.changed(done=True)
            else:
                stream.changed()
        for failed in message.failed:
            stream = streams.pop(failed.request_id, None)
            if stream is not None:
                stream.fail(EngineFailure(failed.message))
                metrics.request_failed()
        if generated:
            metrics.tokens_generated(generated)
        if message.state is not None:
            metrics.update_engine(message.state, sum(not stream.accepted for stream in streams.values()))
