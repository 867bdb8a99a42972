"""Disaggregated prefill/decode (two CPU processes, gloo) against the colocated engine, token for token."""

import os
import signal
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_checkpoints import save_hf_model
from ioattn.distributed import DisaggregatedEngine, WorkerDiedError
from ioattn.engine.llm_engine import EngineConfig, LLMEngine
from ioattn.engine.sampling import SamplingParams

CONFIG = EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=4,
                      max_num_batched_tokens=8)
# Two prompts share two full blocks; one is shorter than a block (nothing to ship); one is exactly 3 blocks.
PROMPTS = [[1, 4, 9, 16, 25, 36, 49, 64, 81, 3, 5], [1, 4, 9, 16, 25, 36, 49, 64, 7, 8], [1, 50, 60],
           list(range(20, 32))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=0)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", path)
    return str(path)


def run_all(engine) -> dict:
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", params=params, prompt_token_ids=prompt)
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                finished[output.request_id] = [(c.token_ids, c.logprobs) for c in output.outputs]
    assert not engine.has_unfinished_requests()
    return finished


def test_disaggregated_generation_equals_colocated(checkpoint):
    colocated = run_all(LLMEngine(checkpoint, CONFIG))
    with DisaggregatedEngine(checkpoint, CONFIG, timeout_s=60) as engine:
        disaggregated = run_all(engine)
        # Blocks before each prompt's last token: 2 (the other prompt's two are the same ones) + 0 + 2.
        assert engine.shipped_blocks == 4
        stats = engine.kv.stats()
        assert stats.prefix_hit_tokens == 4 * 2 + 4 * 2 + 4 * 2
        # A second round finds everything cached already: nothing new is written, the outputs stay the same.
        again = run_all(engine)
        assert engine.shipped_blocks == 4
    assert disaggregated.keys() == colocated.keys() == again.keys()
    for request_id, expected in colocated.items():
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(disaggregated[request_id], expected, strict=True):
            assert tokens == ref_tokens, request_id
            for step, ref_step in zip(logprobs or [], ref_logprobs or [], strict=True):
                assert step.keys() == ref_step.keys()
                assert all(abs(step[t] - ref_step[t]) < 1e-4 for t in step)
        assert [tokens for tokens, _ in again[request_id]] == [tokens for tokens, _ in expected]


def test_dead_prefill_worker_fails_fast(checkpoint):
    engine = DisaggregatedEngine(checkpoint, CONFIG, timeout_s=60)
    try:
        with pytest.raises(ValueError, match="prompt_token_ids must be ints"):
            engine.add_request("bad", prompt_token_ids=[1, 10_000])
        os.kill(engine.worker_process.pid, signal.SIGKILL)
        engine.worker_process.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"prefill worker \(pid \d+\) exited with code -9"):
            engine.add_request("a", params=SamplingParams(max_tokens=2), prompt_token_ids=PROMPTS[0])
            for _ in range(10):
                engine.step()
        assert time.monotonic() - start < 5
    finally:
        engine.shutdown()


def test_disaggregated_needs_prefix_caching_and_a_model_name():
    from ioattn.models import load_model

    with pytest.raises(ValueError, match="enable_prefix_caching must be True"):
        DisaggregatedEngine("tiny", EngineConfig(device="cpu", enable_prefix_caching=False))
    with pytest.raises(ValueError, match="model must be a checkpoint folder or a preset name"):
        DisaggregatedEngine(load_model("tiny", dtype="float32", device="cpu"))
