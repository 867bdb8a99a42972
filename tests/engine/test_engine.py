"""LLMEngine and LLM on the CPU with the tiny model: greedy outputs equal a full-recompute reference whatever the
batching (chunked prefill, preemption by recompute or swap, prefix-cache hits, static batching), forks share
blocks, abort frees at once, and bad requests fail alone."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import (
    assert_all_free, cached_reference, greedy, make_engine, next_token_logits, prompt, reference_beam_search,
    reference_greedy, run_all, tiny,
)
from ioattn.llm import LLM
from ioattn.engine.sampling import BeamSearch, BeamSearchParams, Sampler, SamplingParams


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's matmuls gain nothing from threads, and on a busy shared CPU spinning threads make them
    ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tokens(outputs: dict, request_id: str, index: int = 0) -> list[int]:
    return outputs[request_id].outputs[index].token_ids


def test_greedy_with_chunked_prefill_matches_full_recompute():
    engine = make_engine(max_num_batched_tokens=8)  # prompts of 13 and 21 tokens prefill in chunks
    prompts = {"a": prompt(5, 1), "b": prompt(13, 2), "c": prompt(21, 3)}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(8))
    outputs = run_all(engine)
    for request_id, ids in prompts.items():
        assert tokens(outputs, request_id) == cached_reference(tuple(ids), 8)
        assert outputs[request_id].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("gather_rows", [None, 1])
def test_triton_paged_path_matches_full_recompute(gather_rows, monkeypatch):
    """The CUDA code path (reshape_and_cache + paged_attention, copy_blocks, swap_blocks) in Triton's interpreter:
    a mixed batch of prefill chunks and decodes, a fork, and swap preemption in a small pool. One layer: the
    interpreter is slow. gather_rows=1: every prefill chunk takes the gathered-context path (dense forward)."""
    if gather_rows is not None:
        monkeypatch.setattr("ioattn.ops.paged.GATHER_MIN_GROUP_ROWS", gather_rows)
    model = tiny(num_layers=1)
    engine = make_engine(model=model, attention_backend="triton", num_blocks=8, max_model_len=24,
                         max_num_batched_tokens=8, preemption_mode="swap", swap_space=0.002)
    engine.add_request("t2", prompt_token_ids=prompt(7, 6), params=greedy(6, n=2))  # first: never preempted
    prompts = {"t0": prompt(11, 4), "t1": prompt(6, 5)}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(6))
    outputs = run_all(engine)
    stats = engine.kv.stats()
    assert stats.swap_out_blocks > 0 and stats.cow_copies > 0
    for request_id, ids in prompts.items():
        assert tokens(outputs, request_id) == reference_greedy(ids, 6, loaded=model), request_id
    expected = reference_greedy(prompt(7, 6), 6, loaded=model)
    assert [c.token_ids for c in outputs["t2"].outputs] == [expected, expected]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sliding_window_matches_full_recompute(backend):
    model = tiny(num_layers=1, sliding_window=5)
    engine = make_engine(model=model, attention_backend=backend, max_num_batched_tokens=8)
    ids = prompt(13, 7)
    engine.add_request("w", prompt_token_ids=ids, params=greedy(6))
    assert tokens(run_all(engine), "w") == reference_greedy(ids, 6, loaded=model)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_oversubscribed_batch_gives_the_same_tokens_as_alone(preemption_mode):
    # 7 sequences of up to 30 tokens want ~50 blocks of 4; the pool has 20, the step budget 12 tokens.
    engine = make_engine(num_blocks=20, max_num_batched_tokens=12, preemption_mode=preemption_mode,
                         swap_space=0.002)
    prompts = {f"r{i}": prompt(10 + 2 * i, 10 + i) for i in range(6)}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(12))
    engine.add_request("forked", prompt_token_ids=prompt(9, 30), params=greedy(12, n=2))
    outputs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    if preemption_mode == "swap":
        assert engine.kv.stats().swap_out_blocks > 0
    for request_id, ids in prompts.items():
        assert tokens(outputs, request_id) == cached_reference(tuple(ids), 12), request_id
    expected = cached_reference(tuple(prompt(9, 30)), 12)
    assert [c.token_ids for c in outputs["forked"].outputs] == [expected, expected]
    assert sum(o.metrics.num_preemptions for o in outputs.values()) == engine.scheduler.num_preemptions


def test_prefix_cache_hits_change_nothing():
    system = prompt(16, 99)
    prompts = {f"s{i}": system + prompt(3 + i, 50 + i) for i in range(4)}
    engine = make_engine()
    engine.add_request("warm", prompt_token_ids=prompts["s0"], params=greedy(6))
    run_all(engine)
    for request_id, ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(6))
    outputs = run_all(engine)
    stats = engine.kv.stats()
    assert stats.prefix_hit_tokens >= 4 * 16
    for request_id, ids in prompts.items():
        assert tokens(outputs, request_id) == cached_reference(tuple(ids), 6), request_id


def test_static_batching_baseline_same_tokens_and_no_preemption():
    engine = make_engine(num_blocks=40, scheduling="static", max_model_len=32)  # 8 blocks per sequence: 5 at once
    prompts = {f"q{i}": (prompt(6 + i, 70 + i), 3 + i % 3 * 4) for i in range(7)}
    for request_id, (ids, max_tokens) in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(max_tokens))
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 5 and engine.scheduler.num_preemptions == 0
    assert_all_free(engine)
    for request_id, (ids, max_tokens) in prompts.items():
        assert tokens(outputs, request_id) == cached_reference(tuple(ids), max_tokens), request_id


def test_n_samples_fork_the_prompt_and_copy_on_write_once_per_extra_sample():
    engine = make_engine(max_num_batched_tokens=32)
    ids = prompt(10, 5)  # 2 full blocks of 4 + a partial one shared by the forks
    engine.add_request("n3", prompt_token_ids=ids, params=greedy(4, n=3))
    engine.step()  # prefill; samples 3 first tokens and forks
    stats = engine.kv.stats()
    assert stats.blocks_used == 3 and len(engine.kv.seqs) == 3
    engine.step()  # each sample writes its token: 2 copy the shared partial block, the last writes in place
    assert engine.kv.stats().cow_copies == 2
    outputs = run_all(engine)
    expected = cached_reference(tuple(ids), 4)
    assert [c.index for c in outputs["n3"].outputs] == [0, 1, 2]
    assert all(c.token_ids == expected for c in outputs["n3"].outputs)


@pytest.mark.parametrize("num_blocks", [64, 12])
def test_beam_search_forks_share_blocks_and_match_recompute(monkeypatch, num_blocks):
    """Beams fork their parent's blocks; each step copies a shared partial block once per extra child. With 12
    blocks the beams of two requests do not fit at once, so some are preempted and lag behind their siblings."""
    ids = {"b0": prompt(9, 17), "b1": prompt(11, 18)}
    first = cached_reference(tuple(ids["b0"]), 3)
    params = BeamSearchParams(beam_width=3, max_tokens=7, stop_token_ids=[first[2]])
    expected_copies = 0
    step = BeamSearch.step

    def counting_step(search, logits):
        nonlocal expected_copies
        request = next(r for r in engine.requests.values() if r.beam is search)
        length = len(request.prompt_token_ids) + len(search.running[0].token_ids)
        out = step(search, logits)
        if not search.done and length % 4:  # the next token lands in the parent's partial block
            expected_copies += sum(out.parents.count(p) - 1 for p in set(out.parents))
        return out

    monkeypatch.setattr(BeamSearch, "step", counting_step)
    engine = make_engine(num_blocks=num_blocks, max_num_batched_tokens=16, max_model_len=32)
    for request_id, prompt_ids in ids.items():
        engine.add_request(request_id, prompt_token_ids=prompt_ids, params=params)
    engine.step()
    engine.step()  # first beam step: 3 beams over the 3 prompt blocks of b0 (plus b1's)
    outputs = run_all(engine)
    if num_blocks == 64:
        assert engine.kv.stats().cow_copies == expected_copies > 0
    else:
        assert engine.scheduler.num_preemptions > 0
    monkeypatch.setattr(BeamSearch, "step", step)
    for request_id, prompt_ids in ids.items():
        beams = reference_beam_search(prompt_ids, params, engine.max_model_len)
        got = outputs[request_id].outputs
        assert [c.token_ids for c in got] == [b.token_ids for b in beams]
        assert [c.cumulative_logprob for c in got] == pytest.approx([b.score for b in beams], rel=1e-4)


def test_penalties_see_the_prompt_and_output_history():
    """Repetition / frequency / presence penalties in a chunked-prefill batch equal the sampler applied to
    full-recompute logits with the true history."""
    params = greedy(8, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    prompts = {f"p{i}": prompt(6 + i, 3 * i) + prompt(6, 1) for i in range(3)}
    engine = make_engine(num_blocks=16, max_num_batched_tokens=8)
    for request_id, ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=params)
    outputs = run_all(engine)
    sampler = Sampler(tiny().eos_token_ids)
    for request_id, ids in prompts.items():
        out = []
        for _ in range(8):
            logits = next_token_logits(ids + out)[None]
            out.append(int(sampler.sample(logits, [params], [None], [(ids, out)]).token_ids[0]))
        assert tokens(outputs, request_id) == out, request_id
    assert out != cached_reference(tuple(ids), 8)  # the penalties changed something


def test_seeded_samples_do_not_depend_on_the_batch():
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=6, ignore_eos=True)
    ids = prompt(7, 8)

    def samples(with_others: bool):
        engine = make_engine()
        if with_others:
            for i in range(3):
                engine.add_request(f"o{i}", prompt_token_ids=prompt(5 + i, 40 + i),
                                   params=SamplingParams(temperature=1.0, max_tokens=6))
        engine.add_request("seeded", prompt_token_ids=ids, params=params)
        return [c.token_ids for c in run_all(engine)["seeded"].outputs]

    alone = samples(False)
    assert alone == samples(True)
    assert alone[0] != alone[1]  # each sample draws from its own generator


def test_abort_frees_every_block_at_once():
    engine = make_engine(preemption_mode="swap", swap_space=0.002, num_blocks=16, max_num_batched_tokens=8)
    for i in range(4):
        engine.add_request(f"x{i}", prompt_token_ids=prompt(12, 60 + i), params=greedy(30, n=2 if i == 0 else 1))
    for _ in range(12):
        engine.step()
    assert engine.kv.stats().blocks_used > 0
    assert engine.abort_request("x0")
    assert not engine.abort_request("x0") and not engine.abort_request("never-added")
    engine.kv.check_invariants()
    for i in range(1, 4):
        engine.abort_request(f"x{i}")
    assert_all_free(engine)
    assert not engine.step()


def test_bad_requests_fail_alone():
    llm = LLM(tiny(), device="cpu", block_size=4, num_blocks=64, max_model_len=32, max_num_seqs=4,
              max_num_batched_tokens=32)
    good = prompt(6, 3)
    outputs = llm.generate(prompt_token_ids=[good, [], list(range(40)), [1, 2, 100_000], good],
                           sampling_params=greedy(5), use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, False, False, True]
    assert "empty" in outputs[1].error and "max_model_len" in outputs[2].error
    assert "prompt_token_ids" in outputs[3].error
    assert outputs[0].outputs[0].token_ids == outputs[4].outputs[0].token_ids == cached_reference(tuple(good), 5)
    text_outputs = llm.generate(["", "hello"], greedy(3), use_tqdm=False)
    assert "non-empty" in text_outputs[0].error and text_outputs[1].outputs[0].finish_reason == "length"

    engine = llm.engine
    engine.add_request("dup", prompt_token_ids=good, params=greedy(3))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", prompt_token_ids=good, params=greedy(3))
    with pytest.raises(ValueError, match="n"):
        engine.add_request("wide", prompt_token_ids=good, params=greedy(3, n=5))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    assert tokens(run_all(engine), "dup") == cached_reference(tuple(good), 3)


def test_stream_logprobs_and_metrics():
    engine = make_engine()
    ids = prompt(9, 21)
    engine.add_request("s", prompt_token_ids=ids, params=greedy(5, logprobs=2))
    seen = [output for output in engine.stream() if output.request_id == "s"]
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3, 4, 5]
    assert [o.finished for o in seen] == [False] * 4 + [True]
    final = seen[-1].outputs[0]
    assert final.token_ids == cached_reference(tuple(ids), 5)
    assert len(final.logprobs) == 5
    for token, entry in zip(final.token_ids, final.logprobs):
        assert token in entry and len(entry) <= 3
        assert entry[token] == max(entry.values())  # greedy takes the most likely token
    assert final.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(final.token_ids, final.logprobs)))
    metrics = seen[-1].metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time
    assert metrics.time_per_output_token(5) >= 0
    assert_all_free(engine)


def test_llm_generate_text_in_input_order():
    llm = LLM(tiny(), device="cpu", block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16)
    prompts = ["The sky is", "Hello", "A longer prompt for chunked prefill"]
    outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for text, output in zip(prompts, outputs):
        assert output.prompt_token_ids == llm.tokenizer.encode(text)
        assert output.outputs[0].token_ids == cached_reference(tuple(output.prompt_token_ids), 6)
        assert output.outputs[0].text == llm.tokenizer.decode(output.outputs[0].token_ids)
    beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=2, max_tokens=3), use_tqdm=False)
    assert [len(o.outputs) for o in beams] == [2, 2] and all(o.finished for o in beams)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for o in beams for c in o.outputs)
    assert_all_free(llm.engine)


def test_beam_search_that_cannot_fit_fails_alone():
    """Four beams of up to 59 tokens cannot be resident together in 16 blocks of 4: that request fails with an
    error, the other one completes."""
    engine = make_engine(num_blocks=16, max_model_len=64, max_num_batched_tokens=16)
    engine.add_request("wide", prompt_token_ids=prompt(9, 3), params=BeamSearchParams(beam_width=4, max_tokens=50))
    engine.add_request("plain", prompt_token_ids=prompt(5, 4), params=greedy(4))
    outputs = run_all(engine)
    assert "beam_width" in outputs["wide"].error
    assert tokens(outputs, "plain") == cached_reference(tuple(prompt(5, 4)), 4)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), preemption_mode=st.sampled_from(["recompute", "swap"]),
       scheduling=st.sampled_from(["continuous", "static"]), num_blocks=st.sampled_from([12, 24]))
def test_random_mixed_workloads_finish_and_free_everything(seed, preemption_mode, scheduling, num_blocks):
    """Greedy, seeded n > 1 and beam requests with priorities, arriving over time, some aborted, in a small pool:
    every request ends (or is refused at add_request), invariants hold after every step, nothing leaks."""
    rng = random.Random(seed)
    engine = make_engine(model=tiny(num_layers=1), num_blocks=num_blocks, max_model_len=40, max_num_batched_tokens=12,
                         preemption_mode=preemption_mode, swap_space=0.0005, scheduling=scheduling,
                         policy=rng.choice(["fcfs", "priority"]))
    added = []
    for step in range(1000):
        if step < 20 and rng.random() < 0.5:
            kind = rng.random()
            if kind < 0.2:
                params = BeamSearchParams(beam_width=rng.randint(1, 3), max_tokens=rng.randint(1, 8))
            elif kind < 0.5:
                params = SamplingParams(n=rng.randint(1, 3), temperature=1.0, seed=rng.randint(0, 9),
                                        max_tokens=rng.randint(1, 12), ignore_eos=True)
            else:
                params = greedy(rng.randint(1, 16))
            try:
                engine.add_request(f"r{step}", prompt_token_ids=prompt(rng.randint(1, 24), step), params=params,
                                   priority=rng.randint(0, 2))
                added.append(f"r{step}")
            except ValueError as error:
                assert scheduling == "static" and "reserves" in str(error)
        if added and rng.random() < 0.03:
            engine.abort_request(rng.choice(added))
        engine.step()
        engine.kv.check_invariants()
        if step >= 20 and not engine.has_unfinished_requests():
            break
    assert_all_free(engine)
