"""Tensor-parallel serving: `TensorParallelEngine` is an `LLMEngine` whose forward pass runs on N processes.

The engine's own process is rank 0: it loads its shard, schedules exactly as the single-process engine does, and
each step broadcasts the step plan (swaps, copy-on-write pairs, the packed batch) to the workers. Ranks 1..N-1 are
spawned with torch.multiprocessing; each loads its shard from the same checkpoint, holds its share of the paged KV
cache (its KV heads, the same block ids as rank 0's manager hands out) and runs the plan. The shards meet in the
model's all-reduces; logits are all-gathered, and rank 0 samples.

Failure handling: every collective carries the world's timeout, and before each step rank 0 checks that every
worker is alive, so a worker that died makes `step()` raise `WorkerDiedError` (at once, or within the timeout when
it dies mid-step) instead of hanging. `shutdown()` (also run at interpreter exit) stops the workers, joins them
with a timeout and kills stragglers.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ioattn.distributed.parallel_state import (
    DEFAULT_TIMEOUT_S,
    broadcast_object,
    destroy_distributed,
    free_port,
    init_distributed,
)
from ioattn.distributed.tp import load_tensor_parallel
from ioattn.engine.config import EngineConfig, build_attention, build_runner, resolve_settings
from ioattn.engine.llm_engine import LLMEngine
from ioattn.engine.runner import Batch, ModelRunner
from ioattn.models.loader import LoadedModel

# Seconds shutdown() waits for a worker to leave on its own before killing it.
JOIN_TIMEOUT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A worker process of a multi-process engine exited; the engine cannot continue."""


@dataclass
class StepPlan:
    """What every rank does in one step, in this order."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    batch: Batch


def run_plan(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    return runner.run(plan.swap_out, plan.swap_in, plan.copies, plan.batch)


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs to build its rank (picklable)."""

    model: str
    config: EngineConfig
    device_type: str
    timeout_s: float


def agree_min(value: int) -> int:
    """The least `value` over the ranks (every rank calls it: a collective)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    agreed = torch.tensor([value], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def _worker_main(rank: int, world_size: int, port: int, spec: WorkerSpec) -> None:
    state = init_distributed(rank, world_size, port, spec.device_type, spec.timeout_s)
    try:
        loaded = load_tensor_parallel(spec.model, rank, world_size, spec.config.dtype, state.device)
        settings = resolve_settings(spec.config, loaded, agree_min)
        attention = build_attention(loaded.config, settings, spec.config)
        runner = build_runner(loaded.model, attention, settings, spec.config, use_cuda_graphs=False)
        while (plan := broadcast_object()) is not None:
            run_plan(runner, plan)
    finally:
        destroy_distributed()


class TensorParallelEngine(LLMEngine):
    """`LLMEngine` over `tensor_parallel_size` processes; same API, plus `shutdown()` and a context manager.

    model: a checkpoint folder or a preset name (each rank loads its own shard; a `LoadedModel` cannot be split
    across processes). timeout_s bounds every collective, hence how long a dead worker can go unnoticed.
    CUDA graphs are not captured (the forward pass holds collectives); steps run eagerly and synchronously
    (no asynchronous scheduling: every rank reads its input tokens from the broadcast plan).
    """

    def __init__(self, model: str | os.PathLike = "tiny", config: EngineConfig | None = None, *,
                 tensor_parallel_size: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
        if isinstance(model, LoadedModel) or not isinstance(model, (str, os.PathLike)):
            raise ValueError("model must be a checkpoint folder or a preset name with tensor parallelism (every "
                             f"rank loads its own shard), got {type(model).__name__}")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
        config = config or EngineConfig(**kwargs)
        if config.async_scheduling:
            raise ValueError("async_scheduling=True is not supported with tensor parallelism: the workers take "
                             "their input tokens from the host's step plan (leave it None or set False)")
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) exceeds the {torch.cuda.device_count()} "
                             "visible GPUs")
        self.tensor_parallel_size = tensor_parallel_size
        self._closed = False
        self._serving = False  # every rank is in the step loop: a stop message reaches them all
        self._workers = []
        port = free_port()
        spec = WorkerSpec(os.fspath(model), config, device.type, timeout_s)
        context = mp.get_context("spawn")
        for rank in range(1, tensor_parallel_size):
            process = context.Process(target=_worker_main, args=(rank, tensor_parallel_size, port, spec),
                                      name=f"ioattn-tp-rank{rank}", daemon=True)
            process.start()
            self._workers.append(process)
        atexit.register(self.shutdown)
        try:
            state = init_distributed(0, tensor_parallel_size, port, device.type, timeout_s, self.check_workers)
            loaded = load_tensor_parallel(model, 0, tensor_parallel_size, config.dtype, state.device)
            config = dataclasses.replace(config, enforce_eager=True, async_scheduling=False, device=state.device)
            settings = self._guarded(resolve_settings, config, loaded, agree_min)
            super().__init__(loaded, config, settings=settings)
            self._serving = True
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_processes(self) -> list:
        """The spawned ranks 1..N-1, in rank order."""
        return list(self._workers)

    def check_workers(self) -> None:
        """Raise WorkerDiedError if a worker process has exited."""
        for rank, process in enumerate(self._workers, start=1):
            if process.exitcode is not None:
                raise WorkerDiedError(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                    "the engine cannot continue: shut it down and start a new one"
                )

    def _guarded(self, fn, *args):
        """Run a step of the lock-step protocol; a failure with a dead worker behind it becomes WorkerDiedError."""
        if self._closed:
            raise RuntimeError("the tensor-parallel engine was shut down")
        self.check_workers()
        try:
            return fn(*args)
        except Exception:
            for process in self._workers:
                process.join(timeout=1.0)  # a peer's broken connection is seen before its exit code is
            self.check_workers()
            raise

    def shutdown(self) -> None:
        """Stop the workers (join with a timeout, then kill) and leave the process group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._serving and all(p.exitcode is None for p in self._workers):
            try:
                broadcast_object(None)
                for process in self._workers:
                    process.join(timeout=JOIN_TIMEOUT_S)
            except Exception:
                pass  # a worker died meanwhile: the kill below stops the rest
        # Workers not in the step loop (a failed start, a dead peer) may sit in a collective: kill them.
        for process in self._workers:
            if process.exitcode is None:
                process.kill()
                process.join(timeout=JOIN_TIMEOUT_S)
        destroy_distributed()

    def __enter__(self) -> TensorParallelEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


    def _build_runner(self):
        """Rank 0's shard runs behind a driver that first broadcasts each step plan to the workers."""
        return DriverRunner(super()._build_runner(), self)


class DriverRunner:
    """Rank 0's runner: broadcasts each step plan to the workers, then runs its own shard."""

    def __init__(self, runner: ModelRunner, engine: TensorParallelEngine):
        self.runner, self.engine = runner, engine
        self.device = runner.device

    def run(self, swap_out, swap_in, copies, batch: Batch, feed=None) -> torch.Tensor:
        # The workers get host token ids only; the engine never schedules asynchronously over them.
        assert feed is None, "tensor-parallel steps have no token feed"
        plan = StepPlan(list(swap_out), list(swap_in), list(copies), batch)
        self.engine._guarded(broadcast_object, plan)
        return self.engine._guarded(run_plan, self.runner, plan)
