"""Tensor parallelism on CPU/gloo worlds of 2 and 4 processes against the single-process model and engine."""

import os
import signal
import time

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from dist_helpers import packed_logits, run_world
from hf_checkpoints import save_hf_model
from ioattn.distributed import ShardPlan, TensorParallelEngine, WorkerDiedError, load_tensor_parallel
from ioattn import LLM
from ioattn.engine.llm_engine import EngineConfig
from ioattn.engine.sampling import SamplingParams
from ioattn.models import load_model
from ioattn.models.presets import PRESETS
from ioattn.reference import rel_error

# Same bound as the single-process parity tests: sharded matmuls and the all-reduce only reorder fp32 sums.
LOGITS_TOL = 1e-5
# Three packed sequences, longer than every family's sliding window, and one of length 1.
SEQS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], [7], [3, 90, 11, 60, 42, 8, 77]]
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=8)
PROMPTS = [[1, 4, 9, 16, 25, 36, 49, 64, 81, 3, 5], [1, 4, 9, 16, 25, 36, 49, 64, 7], [1, 50, 60]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> checkpoint folder. Llama's vocabulary (98) splits unevenly across 4 ranks (padding rows);
    Qwen2 ties its embeddings and slides a window on layer 1; Qwen3 has q/k norms and head_dim 32, and is saved
    in several safetensors shards (ranks slice tensors across files)."""
    paths = {}
    for family, overrides in (("llama", dict(vocab_size=98)), ("qwen2", {}), ("qwen3", dict(max_shard_size="40KB"))):
        path = tmp_path_factory.mktemp(family)
        save_hf_model(family, path, **overrides)
        paths[family] = str(path)
    return paths


def _logits_against_whole_model(rank, world_size, paths):
    """On every rank: the shard's logits; on rank 0 also the whole model's, compared (plain values only)."""
    report = {}
    for family, path in paths.items():
        shard = load_tensor_parallel(path, rank, world_size, dtype=torch.float32, device="cpu")
        logits = packed_logits(shard.model, shard.config, SEQS)
        if rank == 0:
            whole = load_model(path, dtype=torch.float32, device="cpu")
            ref = packed_logits(whole.model, whole.config, SEQS)
            report[family] = dict(shape_ok=logits.shape == ref.shape, error=rel_error(logits, ref),
                                  same_argmax=torch.equal(logits.argmax(-1), ref.argmax(-1)))
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_logits_equal_single_process(checkpoints, world_size):
    report = run_world(_logits_against_whole_model, world_size, checkpoints)[0]
    assert set(report) == set(checkpoints)
    for family, result in report.items():
        assert result["shape_ok"], family
        assert result["error"] < LOGITS_TOL, (family, result)
        assert result["same_argmax"], family


def _generate(llm, params):
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("family, world_size", [("qwen3", 2), ("llama", 4)])
def test_tp_engine_greedy_tokens_identical(checkpoints, family, world_size):
    """Chunked prefill (8-token budget), prefix-cache hits (shared 8-token prefix), n=2 forks, logprobs."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=6, ignore_eos=True, logprobs=0)]
    expected = _generate(LLM(checkpoints[family], **ENGINE), params)
    llm = LLM(checkpoints[family], tensor_parallel_size=world_size, **ENGINE)
    try:
        got = _generate(llm, params)
        assert llm.engine.kv.stats().prefix_hit_tokens > 0
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in llm.engine.worker_processes)
    for got_request, expected_request in zip(got, expected, strict=True):
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got_request, expected_request, strict=True):
            assert tokens == ref_tokens
            for step, ref_step in zip(logprobs, ref_logprobs, strict=True):
                assert step.keys() == ref_step.keys()
                assert all(abs(step[t] - ref_step[t]) < 1e-4 for t in step)


def test_tp_engine_swap_preemption_matches_single_process(checkpoints):
    """A 10-block pool forces swap-outs and swap-ins: every rank moves its share of the same blocks."""
    config = dict(ENGINE, num_blocks=10, max_model_len=32, preemption_mode="swap", swap_space=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = _generate(LLM(checkpoints["qwen3"], **config), params)
    llm = LLM(checkpoints["qwen3"], tensor_parallel_size=2, **config)
    try:
        assert _generate(llm, params) == expected
        assert llm.engine.stats()["preemptions"] > 0
    finally:
        llm.shutdown()


def test_dead_worker_fails_fast_and_shutdown_is_clean(checkpoints):
    engine = TensorParallelEngine(checkpoints["qwen3"], EngineConfig(**ENGINE), tensor_parallel_size=2,
                                  timeout_s=30)
    try:
        engine.add_request("a", params=SamplingParams(max_tokens=4), prompt_token_ids=PROMPTS[0])
        engine.step()
        (worker,) = engine.worker_processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            for _ in range(10):
                engine.step()
        assert time.monotonic() - start < 5
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()


def test_shard_plan_splits_and_validates():
    config = PRESETS["tiny"].config  # 8 query heads, 2 KV heads of 32, intermediate 768, vocab 512
    two = [ShardPlan(config, rank, 2) for rank in range(2)]
    assert [p.checkpoint_slice("model.layers.0.self_attn.q_proj.weight") for p in two] == [(0, 0, 128),
                                                                                           (0, 128, 256)]
    assert [p.checkpoint_slice("model.layers.0.self_attn.k_proj.weight") for p in two] == [(0, 0, 32), (0, 32, 64)]
    assert two[1].checkpoint_slice("model.layers.0.self_attn.o_proj.weight") == (1, 128, 256)
    assert two[1].checkpoint_slice("model.layers.0.mlp.down_proj.weight") == (1, 384, 768)
    assert two[0].checkpoint_slice("model.layers.0.mlp.down_proj.bias") is None
    assert two[0].checkpoint_slice("model.norm.weight") is None
    # 4 ranks over 2 KV heads: ranks 0, 1 share KV head 0 and ranks 2, 3 KV head 1, matching their query heads.
    four = [ShardPlan(config, rank, 4) for rank in range(4)]
    assert [p.first_kv_head for p in four] == [0, 0, 1, 1]
    assert all(p.local_config().num_kv_heads == 1 and p.local_config().num_heads == 2 for p in four)
    uneven = config.replace(vocab_size=510)
    assert ShardPlan(uneven, 3, 4).checkpoint_slice("lm_head.weight") == (0, 384, 510)
    with pytest.raises(ValueError, match="tensor_parallel_size \\(3\\) must divide num_attention_heads"):
        ShardPlan(config, 0, 3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ShardPlan(config.replace(num_kv_heads=4, num_heads=12), 0, 6)
    with pytest.raises(ValueError, match="model must be a checkpoint folder or a preset name"):
        TensorParallelEngine(load_model("tiny", dtype="float32", device="cpu"), tensor_parallel_size=2)


def test_failed_start_raises_and_leaves_no_worker(checkpoints):
    """Every rank refuses 3-way sharding of 4 heads; rank 0's error surfaces and the workers are reaped."""
    engine = TensorParallelEngine.__new__(TensorParallelEngine)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_attention_heads \(4\)"):
        engine.__init__(checkpoints["qwen3"], EngineConfig(**ENGINE), tensor_parallel_size=3, timeout_s=30)
    assert len(engine.worker_processes) == 2
    assert all(p.exitcode is not None for p in engine.worker_processes)


def test_serve_parses_tp():
    import argparse

    from ioattn.server.cli import add_serve_command

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--tp", "2"]).tensor_parallel_size == 2
    assert parser.parse_args(["serve"]).tensor_parallel_size == 1
