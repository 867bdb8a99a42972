"""Helpers for the distributed tests: a world of spawned ranks with a bounded join, and tiny checkpoints."""

from __future__ import annotations

import queue
import traceback

import torch
import torch.multiprocessing as mp

from ioattn.distributed.parallel_state import destroy_distributed, free_port, init_distributed

# Seconds one world may take from spawn to the last rank's exit (imports dominate on a loaded 2-core machine).
WORLD_TIMEOUT_S = 120.0


def _rank_main(rank: int, world_size: int, port: int, fn, args, results) -> None:
    try:
        init_distributed(rank, world_size, port, "cpu", timeout_s=WORLD_TIMEOUT_S)
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            destroy_distributed()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_world(fn, world_size: int, *args, timeout_s: float = WORLD_TIMEOUT_S) -> list:
    """Run fn(rank, world_size, *args) on `world_size` spawned CPU ranks of one gloo world; their return values
    in rank order. A rank that raises, exits without a result, or overruns the timeout fails the call (the
    others are killed): a broken collective can never hang the test run."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results), daemon=True)
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    outcomes = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"world of {world_size} ranks did not finish within {timeout_s} s "
                                   f"(results from ranks {sorted(outcomes)})") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            outcomes[rank] = value
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.exitcode is None:
                process.kill()
                process.join()
    return [outcomes[rank] for rank in range(world_size)]


def packed_logits(model, config, seqs: list[list[int]]) -> torch.Tensor:
    """Logits of every token of several packed sequences, dense causal attention on the exact torch path."""
    from ioattn.models import DenseCausalAttention, dense_causal_attention

    model.attention = dense_causal_attention
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    ctx = DenseCausalAttention.build([len(s) for s in seqs], config, "cpu", backend="torch")
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, ctx))
