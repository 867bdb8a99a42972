"""The real default model (smollm2, float32 on the CPU) with an fp8 KV cache: perplexity of the seeds slice near
the float32 cache's, and a greedy answer that still knows its facts. Slow (loads and runs the real model); the
full figures (32 prompts, 8192 tokens, scales with and without calibration and rotation) are in
bench/results/2026-12-06-fp8-kv-smollm2-cpu.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ioattn import LLM, SamplingParams
from ioattn.eval import perplexity
from ioattn.models.loader import load_model

SEEDS_SLICE = Path(__file__).parents[1] / "data" / "seeds_slice.txt"
# e4m3 with calibrated (rotated) scales costs smollm2 about 0.3% perplexity over 8192 tokens, 1.5% without the
# rotation (the results file); the slice is shorter and noisier.
PERPLEXITY_RTOL = 0.01

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
    assert fp8.kv_scales["source"] == "calibrated" and fp8.kv_scales["rotation"] is not None
    assert abs(fp8.perplexity / base.perplexity - 1) < PERPLEXITY_RTOL, (fp8.perplexity, base.perplexity)


def test_fp8_greedy_answers_keep_their_facts(smollm2):
    # Three factual chat prompts: the float32 cache's answers name the fact, and an e4m3 cache keeps it in at least
    # two of them. Not all three: the first token of the France answer flips under e4m3 with or without the rotation
    # ("L'Étoile, ..." for "The capital of France is Paris."), as 27 of the 32 prompts of the results file diverge
    # somewhere in 64 tokens; a 135M model sits that close to its decision boundaries.
    from ioattn.server.chat_template import ChatTemplate

    chat = ChatTemplate.for_model(smollm2)
    facts = {"What is the capital of France?": "Paris", "Who wrote Romeo and Juliet?": "Shakespeare",
             "What is the largest ocean on Earth?": "Pacific"}
    ids = [chat.token_ids(smollm2.tokenizer, [{"role": "user", "content": q}]) for q in facts]
    kept = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        llm = LLM(smollm2, kv_cache_dtype=kv_cache_dtype, num_blocks=128, max_model_len=1024)
        outs = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=16),
                            use_tqdm=False)
        kept[kv_cache_dtype] = [fact in out.outputs[0].text for fact, out in zip(facts.values(), outs)]
    assert all(kept["auto"]), kept
    assert sum(kept["fp8_e4m3"]) >= 2, kept
