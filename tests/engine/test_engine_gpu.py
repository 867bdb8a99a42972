"""The engine on CUDA: the Triton paged path (reshape_and_cache + paged_attention), CUDA-graph decode, block
copies and swaps, and KV pool sizing from gpu_memory_utilization. Run on the device machine."""

import pytest
import torch

from engine_helpers import assert_all_free, greedy, kernels_compiled, make_engine, prompt, reference_greedy, run_all
from ioattn.engine.llm_engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.gpu

PROMPTS = {f"g{i}": prompt(5 + 3 * i, 80 + i) for i in range(6)}


def _greedy_tokens(engine, max_tokens=10, n_forked=2):
    for request_id, ids in PROMPTS.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(max_tokens))
    engine.add_request("forked", prompt_token_ids=prompt(10, 90), params=greedy(max_tokens, n=n_forked))
    outputs = run_all(engine)
    return {request_id: [c.token_ids for c in output.outputs] for request_id, output in outputs.items()}


@pytest.fixture(scope="module")
def expected():
    """Greedy tokens from dense full recomputation on the GPU (float32)."""
    tokens = {request_id: [reference_greedy(ids, 10, device="cuda")] for request_id, ids in PROMPTS.items()}
    tokens["forked"] = [reference_greedy(prompt(10, 90), 10, device="cuda")] * 2
    return tokens


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_paged_kernels_match_dense_recompute(expected, enforce_eager):
    """Eager and CUDA-graph decode (batch sizes padded to captured ones) give the reference's tokens."""
    engine = make_engine(device="cuda", max_num_batched_tokens=16, enforce_eager=enforce_eager)
    assert bool(engine.runner.graphs) != enforce_eager
    assert _greedy_tokens(engine) == expected


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_on_gpu_same_tokens(expected, preemption_mode):
    """An over-subscribed pool: preemption by recompute or swap (pinned CPU pool, swap_blocks), forks (copy_blocks)."""
    engine = make_engine(device="cuda", num_blocks=20, max_num_batched_tokens=12, preemption_mode=preemption_mode,
                         swap_space=0.002)
    assert _greedy_tokens(engine) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.kv.stats().cow_copies > 0
    if preemption_mode == "swap":
        assert engine.kv.stats().swap_out_blocks > 0


def test_pool_sized_from_gpu_memory_utilization_bf16():
    """The default path on CUDA: bfloat16, KV pool from a profiling pass, CUDA graphs."""
    engine = LLMEngine("tiny", EngineConfig(device="cuda", gpu_memory_utilization=0.2, max_model_len=256,
                                            max_num_seqs=16))
    assert engine.runner.dtype == torch.bfloat16 and engine.runner.graphs
    _, total = torch.cuda.mem_get_info()
    kv_bytes = sum(c.numel() * c.element_size() for c in (*engine.attention.k_caches, *engine.attention.v_caches))
    assert engine.kv.num_blocks * engine.config.block_size >= 256
    assert kv_bytes <= 0.2 * total
    engine.add_request("r", prompt_token_ids=prompt(20, 1), params=greedy(8))
    assert len(run_all(engine)["r"].outputs[0].token_ids) == 8
    assert_all_free(engine)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_async_scheduling_gives_the_synchronous_outputs(preemption_mode):
    """Overlapped steps on the device (token feed into graph replays and eager steps, pinned readback one step
    late, penalties over a token still on the device): the synchronous engine's tokens, finish reasons and
    (up to the rounding of other batch shapes) logprobs."""
    from ioattn.engine.sampling import SamplingParams

    seeded = dict(temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    requests = {
        **{f"g{i}": (prompt(6 + 3 * i, 20 + i), greedy(9, logprobs=2)) for i in range(5)},
        "fork": (prompt(10, 30), SamplingParams(n=3, max_tokens=8, **seeded)),
        "penalized": (prompt(16, 13), greedy(10, frequency_penalty=2.0)),
        "one": (prompt(7, 31), greedy(1)),
    }
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(device="cuda", num_blocks=24, max_num_batched_tokens=12, preemption_mode=preemption_mode,
                             swap_space=0.002, async_scheduling=async_scheduling)
        for request_id, (ids, params) in requests.items():
            engine.add_request(request_id, prompt_token_ids=ids, params=params)
        outputs = run_all(engine)
        assert engine.scheduler.num_preemptions > 0
        assert (engine.stats()["scheduling"]["overlapped_steps"] > 0) == async_scheduling
        results.append(outputs)
    for request_id in requests:
        sync, overlapped = (r[request_id].outputs for r in results)
        assert [c.token_ids for c in sync] == [c.token_ids for c in overlapped], request_id
        assert [c.finish_reason for c in sync] == [c.finish_reason for c in overlapped]
        assert [c.cumulative_logprob for c in overlapped] == pytest.approx([c.cumulative_logprob for c in sync],
                                                                            rel=1e-4, abs=1e-4)


def test_launching_an_overlapped_step_never_waits_for_the_device():
    """White-box: with PyTorch's sync debug mode set to "error", scheduling and launching steps of decodes,
    a forked prompt, seeded and penalized sampling and a chunked prefill raise if anything synchronizes (a
    blocking copy, .item(), .tolist() of a device tensor); landing a step is where the host may wait."""
    from ioattn.engine.sampling import SamplingParams

    engine = make_engine(device="cuda", max_num_batched_tokens=16, async_scheduling=True)
    for i in range(4):
        engine.add_request(f"d{i}", prompt_token_ids=prompt(6 + i, 40 + i), params=greedy(40, logprobs=2))
    engine.add_request("s", prompt_token_ids=prompt(9, 50),
                       params=SamplingParams(n=2, seed=1, max_tokens=40, frequency_penalty=0.5, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.add_request("late", prompt_token_ids=prompt(30, 60), params=greedy(4))  # prefill chunks next to decodes
    for _ in range(4):
        plan = engine.scheduler.schedule()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = engine._launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        touched = {}
        engine._land_in_flight(touched)
        engine._in_flight = launched
        engine._outputs(touched)
    run_all(engine)


def test_no_kernel_compiles_while_serving():
    """After the engine is built, steps of every shape (long chunks taking the gathered path, short chunks on the
    paged kernel, eager decode rows that split, CUDA-graph decodes) run kernels compiled at start-up only: one
    compiled mid-serving stalls its step for seconds."""
    engine = LLMEngine("tiny", EngineConfig(device="cuda", max_model_len=2048, max_num_seqs=16, num_blocks=2048,
                                            max_num_batched_tokens=1024))
    with kernels_compiled() as compiled:
        for i, (length, output) in enumerate([(900, 6), (1500, 4), (37, 9), (5, 12), (613, 3), (1, 7), (260, 5)]):
            engine.add_request(f"c{i}", prompt_token_ids=prompt(length, i), params=greedy(output))
        run_all(engine)
    assert compiled == []


def test_no_mla_kernel_compiles_while_serving():
    """tiny-mla in bf16: chunked prompts on the expanded path, decode rows that split and CUDA-graph decodes run
    kernels compiled at start-up only (the MLA warm-up)."""
    engine = LLMEngine("tiny-mla", EngineConfig(device="cuda", dtype="bfloat16", block_size=16, max_model_len=1024,
                                                max_num_seqs=16, num_blocks=512, max_num_batched_tokens=256))
    with kernels_compiled() as compiled:
        for i, (length, output) in enumerate([(600, 6), (37, 9), (5, 12), (300, 3), (1, 7), (130, 5)]):
            engine.add_request(f"c{i}", prompt_token_ids=prompt(length, i), params=greedy(output))
        run_all(engine)
    assert compiled == []
