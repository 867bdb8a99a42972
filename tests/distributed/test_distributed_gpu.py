"""The same checks on GPUs (NCCL): run on a machine with at least two (the lead runs these on the device)."""

import pytest
import torch

from ioattn.distributed import DisaggregatedEngine, TensorParallelEngine
from ioattn.engine.llm_engine import EngineConfig, LLMEngine
from ioattn.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

# fp32 so that greedy tokens cannot flip on a near-tie between the sharded and the whole model's sums.
CONFIG = EngineConfig(dtype="float32", device="cuda", block_size=16, num_blocks=256, max_model_len=512,
                      max_num_seqs=8, max_num_batched_tokens=256)
PROMPTS = [[1, *range(10, 10 + n)] for n in (5, 40, 100, 17)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run_all(engine) -> dict:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", params=GREEDY, prompt_token_ids=prompt)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    return finished


def test_tp2_greedy_tokens_identical_on_gpus():
    expected = run_all(LLMEngine("tiny", CONFIG))
    with TensorParallelEngine("tiny", CONFIG, tensor_parallel_size=2, timeout_s=120) as engine:
        assert run_all(engine) == expected


def test_disaggregated_equals_colocated_on_two_gpus():
    expected = run_all(LLMEngine("tiny", CONFIG))
    with DisaggregatedEngine("tiny", CONFIG, timeout_s=120) as engine:
        assert run_all(engine) == expected
        assert engine.shipped_blocks > 0
