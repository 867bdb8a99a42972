"""What crosses between the HTTP process and the engine-core process, and how.

Two ZeroMQ PUSH/PULL pipes over Unix-domain (`ipc://`) sockets in a directory only this user can enter (mode
0700, from `tempfile.mkdtemp`): the HTTP process binds both and the engine process connects, so a restarted engine
process finds the same addresses. Messages are msgpack (`msgspec`), decoded into the typed structs below: a
message that does not match its schema is refused whole, and nothing is ever unpickled. Both sockets have no
high-water mark (a burst of outputs must not block the engine, a burst of requests must not block the event loop)
and no linger (a closing side does not wait for a peer that died).

To the engine: `Inputs` (requests to add and ids to abort, batched per event-loop turn), `StatsQuery`,
`Shutdown`. From the engine: `Ready` (what was loaded, once), `StartFailed`, `Outputs` (per loop turn: requests
accepted or refused, each request's new tokens since the last message, requests a failed step lost, and now and
then the engine's state for /metrics), `StatsReply`. Outputs are deltas: token ids and their logprobs; the text
is made in the HTTP process (`ioattn.server.detokenize`).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from ioattn.engine.sampling import SamplingParams


class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # without stop strings: the HTTP process checks those (the engine has no text)
    arrival_time: float  # time.monotonic() in the HTTP process (one clock for every process of the machine)


class Inputs(msgspec.Struct, tag="inputs"):
    adds: list[AddRequest]
    aborts: list[str]


class StatsQuery(msgspec.Struct, tag="stats"):
    query_id: int
    check_invariants: bool = False


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ToEngine = Inputs | StatsQuery | Shutdown


class EngineInfo(msgspec.Struct):
    """What the engine process loaded, for the start-up log, request checks and /v1/models."""

    model: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int
    kv_cache_bytes: int
    cache_dtype: str | None
    attention_backend: str
    tensor_parallel_size: int
    pid: int
    kv_scales: str | None = None  # an fp8 cache's scale source (checkpoint, calibrated, user, unit)
    kv_rotation: str | None = None  # an fp8 cache's rotation (`ioattn.engine.kv_scales`), None if unrotated

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo


class StartFailed(msgspec.Struct, tag="start_failed"):
    message: str


class SampleDelta(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]  # generated since the last delta of this sample
    logprobs: list[dict[int, float]] | None  # one entry per new token: the sampled one's and the top ones
    finish_reason: str | None
    stop_reason: int | None  # a stop token id (stop strings are the HTTP process's)


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    samples: list[SampleDelta]
    finished: bool
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    error: str | None = None


class Refused(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    invalid: bool  # True: the request's own fault (a 400); False: the engine's (a 500)


class EngineState(msgspec.Struct, array_like=True):
    """The gauges of /metrics, as of the end of a step."""

    requests_running: int
    requests_waiting: int
    requests_swapped: int
    blocks_used: int
    num_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    # Cumulative: engine steps, the wall time inside them and the part spent waiting for the device.
    steps: int = 0
    step_seconds: float = 0.0
    device_wait_seconds: float = 0.0


class Outputs(msgspec.Struct, tag="outputs"):
    accepted: list[str] = []
    refused: list[Refused] = []
    deltas: list[RequestDelta] = []
    failed: list[Refused] = []  # requests a failed step lost (the engine serves on)
    state: EngineState | None = None


class StatsReply(msgspec.Struct, tag="stats"):
    query_id: int
    stats: dict[str, Any]


FromEngine = Ready | StartFailed | Outputs | StatsReply


@dataclass(frozen=True)
class Addresses:
    """The two endpoints of one server, in a private directory (removed by `close`)."""

    directory: str
    to_engine: str
    from_engine: str

    @classmethod
    def create(cls) -> Addresses:
        directory = tempfile.mkdtemp(prefix="ioattn-")  # mode 0700
        return cls(directory, f"ipc://{directory}/to-engine", f"ipc://{directory}/from-engine")

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def configure(socket: zmq.Socket) -> zmq.Socket:
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    return socket


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


def exit_description(exitcode: int | None) -> str:
    """A process's exit code in words (multiprocessing: negative = killed by that signal)."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"

