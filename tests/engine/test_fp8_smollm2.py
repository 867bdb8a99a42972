"""The real default model (smollm2, float32 on the CPU) with an fp8 KV cache: perplexity of the seeds slice near
the float32 cache's, and a greedy answer that still knows its facts. Slow (loads and runs the real model); the
full figures (32 prompts, 8192 tokens, scales with and without calibration) are in
bench/results/2026-12-02-fp8-kv-smollm2-cpu.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ioattn import LLM, SamplingParams
from ioattn.eval import perplexity
from ioattn.models.loader import load_model

SEEDS_SLICE = Path(__file__).parents[1] / "data" / "seeds_slice.txt"
# e4m3 costs smollm2 about 1.6% perplexity over 8192 tokens (the results file); the slice is shorter and noisier.
PERPLEXITY_RTOL = 0.03

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU path's many small ops: one thread beats two on shared cores
    yield load_model("smollm2", dtype="float32", device="cpu")
    torch.set_num_threads(threads)


def test_fp8_perplexity_close_to_float32(smollm2):
    ids = smollm2.tokenizer.encode(SEEDS_SLICE.read_text(encoding="utf-8"))
    base = perplexity(smollm2, ids, chunk=512)
    fp8 = perplexity(smollm2, ids, chunk=512, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_scales["source"] == "calibrated"
    assert abs(fp8.perplexity / base.perplexity - 1) < PERPLEXITY_RTOL, (fp8.perplexity, base.perplexity)


def test_fp8_greedy_answer(smollm2):
    from ioattn.server.chat_template import ChatTemplate

    chat = ChatTemplate.for_model(smollm2)
    ids = chat.token_ids(smollm2.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    llm = LLM(smollm2, kv_cache_dtype="fp8_e4m3", num_blocks=64, max_model_len=1024)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
