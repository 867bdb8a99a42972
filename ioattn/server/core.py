"""The engine-core process: the one owner of the `LLMEngine`, started by the HTTP process (spawn) and driven over
`ioattn.server.transport`.

Its loop: take every message waiting (blocking only while the engine is idle), apply aborts then adds (each add
is answered, accepted or refused, before the next step runs, so a streaming handler knows before its first byte
whether the request is valid), run one `engine.step()`, send each request's new tokens. An abort therefore lands
before the next step and frees the request's blocks at once.

The engine here never sees text: the HTTP process tokenizes, detokenizes and checks stop strings, and aborts a
request here once a stop string has ended all its samples (vLLM v1's split). So the engine runs without a
tokenizer (its stop checkers keep ids only) and its requests carry no stop strings.

Failures: a refused add (ValueError: the request's fault; anything else: a bug) fails that request alone; a step
that raises fails every request the engine held, which are aborted, and the loop serves on. The process exits when
told to (`Shutdown`), when its parent dies (a watchdog thread reads the pipe whose other end only the parent
holds), or when it is killed; SIGINT and SIGTERM are ignored here, so a terminal's Ctrl-C or a service manager's
SIGTERM to the whole process group reaches the HTTP process, which drains its requests and then stops this one.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from ioattn.server import transport as wire

log = logging.getLogger("ioattn.engine_core")

# How often, at most, a busy engine sends its state for /metrics (an idle one sends it at once).
STATE_INTERVAL_S = 0.05


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: picklable, sent to it at spawn. Subclasses may build a different engine
    (tests wrap one)."""

    model: str
    config: object = None  # an EngineConfig (typed loosely: importing the engine here would load torch early)
    tensor_parallel_size: int = 1
    log_level: str = "info"

    def build(self):
        from ioattn.engine.config import EngineConfig
        from ioattn.engine.llm_engine import LLMEngine

        config = self.config or EngineConfig()
        if self.tensor_parallel_size == 1:
            return LLMEngine(self.model, config)
        from ioattn.distributed.worker import TensorParallelEngine

        return TensorParallelEngine(self.model, config, tensor_parallel_size=self.tensor_parallel_size)


def main(spec: EngineSpec, addresses: wire.Addresses, parent_alive) -> None:
    """The process's entry point (multiprocessing target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_alive,), name="ioattn-parent-watch", daemon=True).start()
    _leave_a_core(spec)
    context = zmq.Context()
    inputs = wire.configure(context.socket(zmq.PULL))
    inputs.connect(addresses.to_engine)
    outputs = wire.configure(context.socket(zmq.PUSH))
    outputs.connect(addresses.from_engine)
    encoder = wire.encoder()
    try:
        engine = spec.build()
        engine.tokenizer = None  # see the module docstring: no text in this process
        info = describe(engine, spec)
        # Everything allocated so far (torch, the model: ~300k tracked objects) lives as long as the process;
        # frozen, it leaves the cyclic GC's full collections, which otherwise stall a step for ~150 ms now and then
        # (0.3 ms once frozen, measured with the engine's host path at 256 sequences).
        gc.collect()
        gc.freeze()
    except BaseException as error:  # noqa: BLE001 (whatever stops the start is reported, then the process ends)
        log.exception("the engine could not start")
        outputs.send(encoder.encode(wire.StartFailed(f"{type(error).__name__}: {error}")))
        _close(context, inputs, outputs)
        sys.exit(1)
    outputs.send(encoder.encode(wire.Ready(info)))
    try:
        EngineCore(engine, inputs, outputs).run()
    finally:
        shutdown = getattr(engine, "shutdown", None)  # tensor parallelism: stop the worker processes
        if shutdown is not None:
            shutdown()
        _close(context, inputs, outputs)


def _leave_a_core(spec: EngineSpec) -> None:
    """On a CPU device the engine's intra-op threads would take every core, and the HTTP process (tokenizing,
    detokenizing, streaming) would wait for one at every step, or worse, stall the threads' barriers: leave it
    one, unless OMP_NUM_THREADS says how many to use."""
    import torch

    device = getattr(spec.config, "device", None)
    on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    cores = len(os.sched_getaffinity(0))
    if on_cpu and cores > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cores - 1)
        log.info("CPU engine: %d intra-op threads, one core left to the HTTP process", cores - 1)


def _close(context: zmq.Context, *sockets: zmq.Socket) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()


def _exit_with_parent(parent_alive) -> None:
    try:
        parent_alive.recv()  # nothing is ever sent: this returns (EOFError) only once the parent's end is closed
    except (EOFError, OSError):
        pass
    os._exit(0)


def describe(engine, spec: EngineSpec) -> wire.EngineInfo:
    attention = engine.attention
    caches = [*attention.k_caches, *attention.v_caches]
    described = attention.describe()
    dtype = next(engine.model.parameters()).dtype
    return wire.EngineInfo(
        model=spec.model, dtype=str(dtype).removeprefix("torch."), device=str(engine.runner.device),
        vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
        max_num_seqs=engine.scheduler_config.max_num_seqs, eos_token_ids=list(engine.eos_token_ids),
        block_size=engine.kv.block_size, num_blocks=engine.kv.num_blocks,
        kv_cache_bytes=sum(cache.numel() * cache.element_size() for cache in caches),
        cache_dtype=described["cache_dtype"], attention_backend=str(described["backend"]),
        tensor_parallel_size=spec.tensor_parallel_size, pid=os.getpid(),
        kv_scales=(described.get("kv_scales") or {}).get("source"),
        kv_rotation=(described.get("kv_scales") or {}).get("rotation"),
    )


class EngineCore:
    def __init__(self, engine, inputs: zmq.Socket, outputs: zmq.Socket):
        self.engine = engine
        self.inputs, self.outputs = inputs, outputs
        self.encoder = wire.encoder()
        self.decoder = wire.decoder(wire.ToEngine)
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.accepted: list[str] = []
        self.refused: list[wire.Refused] = []
        self.state_changed = False
        self.state_sent_at = 0.0

    def run(self) -> None:
        engine = self.engine
        while True:
            for message in self._receive(block=not engine.has_unfinished_requests()):
                if isinstance(message, wire.Shutdown):
                    return
                if isinstance(message, wire.StatsQuery):
                    self._send(wire.StatsReply(message.query_id, self.stats(message.check_invariants)))
                else:
                    self._apply(message)
            if self.accepted or self.refused:
                self._send(wire.Outputs(accepted=self.accepted, refused=self.refused))
                self.accepted, self.refused = [], []
            if engine.has_unfinished_requests():
                self._step()
            elif self.state_changed:  # idle now: the gauges must show it
                self._send(wire.Outputs(state=self._state()))

    def _receive(self, block: bool) -> list:
        if block:
            self.poller.poll()  # an idle engine has nothing to do but wait
        messages = []
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(self.decoder.decode(frame.buffer))

    def _apply(self, inputs: wire.Inputs) -> None:
        engine = self.engine
        for request_id in inputs.aborts:
            engine.abort_request(request_id)
        for add in inputs.adds:
            try:
                # Deltas: each step's outputs hold only the new tokens, which is all this process sends.
                params = dataclasses.replace(add.params, output_kind="delta")
                engine.add_request(add.request_id, params=params, prompt_token_ids=add.prompt_token_ids,
                                   arrival_time=add.arrival_time)
            except ValueError as error:
                self.refused.append(wire.Refused(add.request_id, str(error), invalid=True))
                continue
            except Exception as error:  # the HTTP process checked it: a mismatch to report, not to hide
                log.exception("add_request failed")
                self.refused.append(wire.Refused(add.request_id, f"the engine could not take this request: "
                                                 f"{error!r}", invalid=False))
                continue
            self.accepted.append(add.request_id)
        self.state_changed = True

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as error:  # the engine's state is unknown: fail what it held, keep serving
            log.exception("engine step failed")
            message = f"the engine failed while serving this request: {error!r}"
            failed = []
            for request_id in list(engine.requests):
                failed.append(wire.Refused(request_id, message, invalid=False))
                try:
                    engine.abort_request(request_id)
                except Exception:  # keep failing the others: the loop must outlive a broken engine
                    log.exception("abort of %s failed after a failed step", request_id)
            self._send(wire.Outputs(failed=failed, state=self._state()))
            return
        self.state_changed = True
        now = time.monotonic()
        due = now - self.state_sent_at >= STATE_INTERVAL_S or not engine.has_unfinished_requests()
        deltas = [self._delta(output) for output in outputs]
        if deltas or due:
            self._send(wire.Outputs(deltas=deltas, state=self._state() if due else None))

    def _delta(self, output) -> wire.RequestDelta:
        samples = []
        for completion in output.outputs:
            if not completion.token_ids and not completion.finished:
                continue
            stop_reason = completion.stop_reason if isinstance(completion.stop_reason, int) else None
            samples.append(wire.SampleDelta(completion.index, completion.token_ids, completion.logprobs,
                                            completion.finish_reason, stop_reason))
        metrics = output.metrics
        return wire.RequestDelta(output.request_id, samples, output.finished, metrics.first_token_time,
                                 metrics.finished_time, metrics.num_preemptions, output.error)

    def _state(self) -> wire.EngineState:
        self.state_changed, self.state_sent_at = False, time.monotonic()
        scheduler, kv = self.engine.scheduler, self.engine.kv.stats()
        return wire.EngineState(
            requests_running=len({seq.request_id for seq in scheduler.running}),
            requests_waiting=len({seq.request_id for seq in scheduler.waiting}),
            requests_swapped=len({seq.request_id for seq in scheduler.swapped}),
            blocks_used=kv.blocks_used, num_blocks=kv.num_blocks, prefix_query_tokens=kv.prefix_query_tokens,
            prefix_hit_tokens=kv.prefix_hit_tokens, preemptions=scheduler.num_preemptions,
            steps=self.engine.num_steps, step_seconds=self.engine.step_seconds,
            device_wait_seconds=self.engine.device_wait_seconds)

    def stats(self, check_invariants: bool) -> dict:
        """`engine.stats()` plus what the scheduler holds and, when asked, the KV manager's invariant check."""
        engine = self.engine
        stats = engine.stats()
        stats["unfinished_requests"] = len(engine.requests)
        stats["scheduler"] = {name: len(getattr(engine.scheduler, name)) for name in ("running", "waiting", "swapped")}
        if check_invariants:
            try:
                engine.kv.check_invariants()
                stats["invariants"] = "ok"
            except Exception as error:  # reported to the asker, who decides
                stats["invariants"] = f"{type(error).__name__}: {error}"
        return stats

    def _send(self, message) -> None:
        self.outputs.send(self.encoder.encode(message), copy=False)
