"""Disaggregated prefill/decode: a prefill worker computes prompts' KV, the decode engine continues generation.

`DisaggregatedEngine` is an `LLMEngine` (the decode side, rank 0, in the caller's process) paired with a spawned
prefill worker (rank 1) running its own engine on the same checkpoint. A request's prompt goes to the prefill
worker, which runs the prompt and ships back only that request's full KV blocks — the ones a prefix-cache lookup
can use, i.e. those before the block of the last prompt token — with their chained prefix hashes, through
torch.distributed send/recv (gloo on the CPU, NCCL between GPUs); `KVCacheManager.export_prefix` names them. The
decode side's `KVCacheManager.import_prefix` checks each hash against the prompt's tokens and registers fresh
blocks of its own pool in its prefix cache (all or none: a pool too full to hold them now imports none), the
shipped KV is copied into them, then the request is admitted: the scheduler's prefix lookup finds the shipped
blocks, so decode computes only the prompt's last partial block (fewer than block_size tokens, which also yields
the first token) and the generated tokens. Sampling happens on the decode side only, so outputs equal the
colocated engine's token for token.

Control messages go over a multiprocessing pipe (pollable, and it closes when a process dies): decode -> prefill
`(PREFILL, ticket, token ids)` or `(STOP,)`; prefill -> decode `(SHIPPED, ticket, n_blocks)` or `(STOPPED,)`. The
blocks themselves go through torch.distributed send/recv right after their SHIPPED message: digests (n_blocks, 32)
uint8, then KV (layers, caches_per_layer, n_blocks, block_size, kv_heads, head_dim) in the cache's dtype (K and V,
or an MLA model's one latent cache; an fp8 cache's blocks travel as their bytes, quantized once, by the prefill
worker). Both sides resolve the same settings, so an fp8 cache has the same scales on both (calibrated alike, or
given); the prefix key holds the cache's dtype and scales, so blocks of another format never match the decode side's
hashes (`RuntimeError`, not garbage). A dead peer makes the decode side raise `WorkerDiedError` (it polls the
process while waiting, within the engine's timeout).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ioattn.distributed.parallel_state import DEFAULT_TIMEOUT_S, destroy_distributed, free_port, init_distributed
from ioattn.distributed.worker import JOIN_TIMEOUT_S, WorkerDiedError
from ioattn.engine.config import EngineConfig
from ioattn.engine.llm_engine import LLMEngine
from ioattn.engine.sampling import SamplingParams
from ioattn.engine.outputs import RequestMetrics, RequestOutput
from ioattn.kv.prefix_hash import DIGEST_SIZE
from ioattn.ops.fp8 import bytes_view

PREFILL, SHIPPED, STOP, STOPPED = "prefill", "shipped", "stop", "stopped"
DECODE_RANK, PREFILL_RANK = 0, 1
# How often a waiting side looks at its pending receive and at its peer's liveness.
POLL_S = 0.001


def _prefill_main(port: int, model: str, config: EngineConfig, device_type: str, timeout_s: float, conn) -> None:
    state = init_distributed(PREFILL_RANK, 2, port, device_type, timeout_s)
    try:
        # Synchronous: overlapping would only ship each prompt one (long) prefill step later.
        engine = LLMEngine(model, dataclasses.replace(config, device=state.device, async_scheduling=False))
        _serve_prefills(engine, conn)
    finally:
        destroy_distributed()


def _serve_prefills(engine: LLMEngine, conn) -> None:
    """Admit every prompt that arrived, step, ship each finished prompt's blocks; until told to stop (or until
    the decode process is gone: its end of the pipe closes)."""
    prompts: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    while True:
        # Admit everything that is waiting before the next step; idle, block (briefly) for the next prompt.
        if conn.poll(0 if engine.has_unfinished_requests() else POLL_S):
            message = conn.recv()
            if message[0] == STOP:
                conn.send((STOPPED,))
                return
            _, ticket, token_ids = message
            prompts[str(ticket)] = token_ids
            engine.add_request(str(ticket), params=params, prompt_token_ids=token_ids)
            continue
        if engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    _ship(engine, conn, int(output.request_id), prompts.pop(output.request_id))


def _ship(engine: LLMEngine, conn, ticket: int, token_ids: list[int]) -> None:
    """Send the prompt's computed full blocks, still in the prefix cache right after the request finished (up to
    the first one evicted already, in a tiny pool: decode recomputes from there)."""
    exported = engine.kv.export_prefix(token_ids, engine.prefix_key)
    conn.send((SHIPPED, ticket, len(exported)))
    if not exported:
        return
    blocks, digests = zip(*exported)
    kv = engine.attention.read_blocks(list(blocks))
    dist.send(torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).to(kv.device), dst=DECODE_RANK)
    dist.send(bytes_view(kv.contiguous()), dst=DECODE_RANK)


class DisaggregatedEngine(LLMEngine):
    """Decode engine in this process + a prefill worker process; `LLMEngine`'s API plus `shutdown()`.

    model: a checkpoint folder or a preset name (both sides load it). Prefix caching must be on: shipped blocks
    enter the decode side through its prefix cache. On CUDA the prefill worker uses GPU 1, the decode side GPU 0.
    """

    def __init__(self, model: str | os.PathLike = "tiny", config: EngineConfig | None = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError("model must be a checkpoint folder or a preset name with disaggregated serving (the "
                             f"prefill worker loads it too), got {type(model).__name__}")
        config = config or EngineConfig(**kwargs)
        if not config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching must be True: shipped KV blocks enter through the prefix cache")
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.timeout_s = timeout_s
        self._closed = False
        port = free_port()
        context = mp.get_context("spawn")
        self._conn, worker_conn = context.Pipe()
        self._worker = context.Process(
            target=_prefill_main, args=(port, os.fspath(model), config, device.type, timeout_s, worker_conn),
            name="ioattn-prefill", daemon=True,
        )
        self._worker.start()
        atexit.register(self.shutdown)
        try:
            state = init_distributed(DECODE_RANK, 2, port, device.type, timeout_s, self.check_worker)
            super().__init__(model, dataclasses.replace(config, device=state.device))
        except BaseException:
            self.shutdown()
            raise
        self._tickets = itertools.count()
        # ticket -> add_request's arguments, for requests whose KV is on its way.
        self._in_prefill: dict[int, dict] = {}
        self._failed: list[RequestOutput] = []
        self.shipped_blocks = 0

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(self, request_id=None, prompt=None, params=None, *, prompt_token_ids=None,
                    arrival_time=None, priority: int = 0) -> str:
        """Validate the prompt and send it to the prefill worker; the request joins the decode engine once its
        KV arrived. A request refused then (invalid sampling values) finishes with `error` set."""
        self.check_worker()
        request_id = self._new_request_id(request_id)
        if any(a["request_id"] == request_id for a in self._in_prefill.values()):
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = self.check_params(SamplingParams() if params is None else params)  # before a prefill is spent
        token_ids = self._prompt_ids(prompt, prompt_token_ids)
        self._check_arrival_and_priority(arrival_time, priority)
        ticket = next(self._tickets)
        self._in_prefill[ticket] = dict(
            request_id=request_id, prompt=prompt, params=params, prompt_token_ids=token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time, priority=priority,
        )
        self._conn.send((PREFILL, ticket, token_ids))
        return request_id

    def abort_request(self, request_id: str) -> bool:
        for ticket, args in self._in_prefill.items():
            if args["request_id"] == str(request_id):
                args["aborted"] = True  # its KV still arrives (the worker is not told); it is then dropped
                return True
        return super().abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or any(not a.get("aborted") for a in self._in_prefill.values())

    # -- one step ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Take in every KV transfer that arrived (waiting for one when nothing else can run), then decode."""
        self._receive(wait=not super().has_unfinished_requests() and bool(self._in_prefill))
        failed, self._failed = self._failed, []
        return failed + (super().step() if self.requests else [])

    def _receive(self, wait: bool) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.check_worker()
            if self._conn.poll(POLL_S if wait else 0):
                _, ticket, num_blocks = self._conn.recv()
                self._admit(self._in_prefill.pop(ticket), num_blocks)
                wait = False
                continue
            if not wait:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the prefill worker (pid {self._worker.pid}) is alive but sent no KV within "
                                   f"{self.timeout_s} s")

    def _admit(self, args: dict, num_blocks: int) -> None:
        if num_blocks:
            device = self.runner.device
            digests = torch.empty(num_blocks, DIGEST_SIZE, dtype=torch.uint8, device=device)
            dist.recv(digests, src=PREFILL_RANK)
            shape = (self.runner.config.num_layers, self.attention.caches_per_layer, num_blocks,
                     *self.attention.k_caches[0].shape[1:])
            kv = torch.empty(shape, dtype=self.attention.cache_dtype, device=device)
            dist.recv(bytes_view(kv), src=PREFILL_RANK)
            self._import_blocks(args["prompt_token_ids"], [bytes(row) for row in digests.tolist()], kv)
        if args.pop("aborted", False):
            return
        try:
            super().add_request(**args)
        except ValueError as error:
            self._failed.append(RequestOutput(
                args["request_id"], args["prompt"], args["prompt_token_ids"], [], finished=True,
                metrics=RequestMetrics(arrival_time=args["arrival_time"]), error=str(error),
            ))

    def _import_blocks(self, token_ids: list[int], digests: list[bytes], kv: torch.Tensor) -> None:
        """Copy shipped blocks into this pool's prefix cache (cached, unheld, so evictable); those it has already
        (a shared prefix) are not copied again."""
        try:
            writes = self.kv.import_prefix(token_ids, digests, self.prefix_key)
        except ValueError as error:
            raise RuntimeError("prefill worker shipped blocks whose prefix hashes do not match the prompt's tokens; "
                               "the two sides disagree on the block layout or on the KV cache's dtype and scales "
                               f"(this side: {self.prefix_key})") from error
        if not writes:
            return  # None: no room now, decode recomputes the prompt; []: every block is cached here already
        shipped = torch.tensor([i for i, _ in writes], dtype=torch.int64, device=kv.device)
        self.attention.write_blocks([block for _, block in writes], kv.index_select(2, shipped))
        self.shipped_blocks += len(writes)

    # -- lifecycle ---------------------------------------------------------------------------------------

    @property
    def worker_process(self):
        """The spawned prefill worker."""
        return self._worker

    def check_worker(self) -> None:
        if self._closed:
            raise RuntimeError("the disaggregated engine was shut down")
        if self._worker.exitcode is not None:
            raise WorkerDiedError(f"prefill worker (pid {self._worker.pid}) exited with code "
                                  f"{self._worker.exitcode}; the engine cannot continue")

    def shutdown(self) -> None:
        """Stop the prefill worker (join with a timeout, then kill) and leave the process group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if dist.is_initialized() and self._worker.exitcode is None and hasattr(self, "_in_prefill"):
            try:
                self._conn.send((STOP,))
                # Transfers already under way are received (and dropped) so that the worker reaches the stop.
                while self._conn.poll(JOIN_TIMEOUT_S):
                    message = self._conn.recv()
                    if message[0] == STOPPED:
                        break
                    _, ticket, num_blocks = message
                    self._admit(dict(self._in_prefill.pop(ticket), aborted=True), num_blocks)
            except (OSError, EOFError, RuntimeError):
                pass  # the worker died meanwhile: the kill below is all that is left to do
        self._worker.join(timeout=JOIN_TIMEOUT_S)
        if self._worker.exitcode is None:
            self._worker.kill()
            self._worker.join(timeout=JOIN_TIMEOUT_S)
        destroy_distributed()

    def __enter__(self) -> DisaggregatedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
