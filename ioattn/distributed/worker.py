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
from ioattn.engine.llm_engine import CPU_KV_CACHE_BYTES, EngineConfig, LLMEngine
from ioattn.engine.attention import PagedAttention
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


def kv_pool_blocks(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """The KV pool size every rank agrees on: config.num_blocks, else the engine's CPU default, else (CUDA) the
    least that each rank's profile leaves room for. On CUDA every rank must call it (it runs collectives)."""
    if config.num_blocks:
        return config.num_blocks
    block_bytes = PagedAttention.block_bytes(loaded.config, config.block_size, loaded.model.model.norm.weight.dtype)
    if loaded.model.inv_freq.device.type != "cuda":
        return max(CPU_KV_CACHE_BYTES // block_bytes, -(-max_model_len // config.block_size))
    least = 2048 if config.enable_chunked_prefill else max_model_len
    num_blocks = ModelRunner.profile_num_blocks(
        loaded.model, block_size=config.block_size, gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens or max(least, config.max_num_seqs),
        max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
    )
    agreed = torch.tensor([num_blocks], device=loaded.model.inv_freq.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def _worker_main(rank: int, world_size: int, port: int, spec: WorkerSpec) -> None:
    state = init_distributed(rank, world_size, port, spec.device_type, spec.timeout_s)
    try:
        loaded = load_tensor_parallel(spec.model, rank, world_size, spec.config.dtype, state.device)
        max_model_len = spec.config.max_model_len or loaded.max_model_len
        kv_pool_blocks(loaded, spec.config, max_model_len)
        shape = broadcast_object()
        attention = PagedAttention(loaded.config, device=state.device, dtype=loaded.model.model.norm.weight.dtype,
                                   **shape["attention"])
        runner = ModelRunner(loaded.model, attention, **shape["runner"])
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
            max_model_len = config.max_model_len or loaded.max_model_len
            num_blocks = self._guarded(kv_pool_blocks, loaded, config, max_model_len)
            super().__init__(loaded, dataclasses.replace(config, num_blocks=num_blocks, enforce_eager=True,
                                                         async_scheduling=False, device=state.device))
            self._guarded(broadcast_object, dict(
                attention=dict(num_blocks=num_blocks, block_size=config.block_size, num_cpu_blocks=self.kv.cpu.num_blocks,
                               max_num_seqs=config.max_num_seqs, backend=config.attention_backend),
                runner=dict(max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs, use_cuda_graphs=False,
                            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens),
            ))
            self.runner = DriverRunner(self.runner, self)
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
