"""Asynchronous scheduling (one step of lookahead) against the synchronous engine on the CPU: every request's
token ids, text, logprobs, cumulative logprob, finish and stop reasons are identical, whatever the batching does
(preemption by recompute and swap, chunked prefill, prefix-cache hits, forks, stops right after the first token,
aborts), and every KV block is free after each run.

The model is the tiny preset in float64: the engines batch requests differently (a request that stops is
scheduled once more under overlap, frees and prefix hits come one step later), and the CPU's matmuls round a row
differently with the number of rows in the batch; in float64 that rounding stays far below the float32 logits'
resolution, so logprobs can be compared bit for bit."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import assert_all_free, greedy, make_engine, prompt, reference_greedy, tiny
from ioattn.engine.llm_engine import EngineConfig
from ioattn.engine.sampling import BeamSearchParams, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model(num_layers=None):
    return tiny(num_layers=num_layers, dtype=torch.float64)


def completions(output) -> tuple:
    """Everything a request returns but its timings."""
    return output.finished, output.error, [
        (c.index, c.token_ids, c.text, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
        for c in output.outputs
    ]


def run(async_scheduling: bool, requests: dict, arrivals: dict | None = None, loaded=None, **engine_kwargs):
    """Requests (id -> (prompt ids, params)) added at once, or at the step `arrivals` gives; the final outputs,
    and the engine. Checks the KV invariants after every step."""
    engine = make_engine(model=loaded or model(), async_scheduling=async_scheduling, **engine_kwargs)
    arrivals = arrivals or {}
    pending = dict(requests)
    finished = {}
    for step in range(10_000):
        for request_id in [r for r in pending if arrivals.get(r, 0) <= step]:
            ids, params = pending.pop(request_id)
            engine.add_request(request_id, prompt_token_ids=ids, params=params)
        if not pending and not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.kv.check_invariants()
    assert_all_free(engine)
    return {request_id: completions(output) for request_id, output in finished.items()}, engine


def assert_same(requests: dict, arrivals: dict | None = None, loaded=None, **engine_kwargs):
    """Both engines, the same outputs; those outputs and the two engines, for checks of what the batching did.
    The overlapping engine overlapped, unless a beam search ran from its first step to its last."""
    expected, sync = run(False, requests, arrivals, loaded, **engine_kwargs)
    got, overlapped = run(True, requests, arrivals, loaded, **engine_kwargs)
    assert got.keys() == expected.keys() == requests.keys()
    for request_id in requests:
        assert got[request_id] == expected[request_id], request_id
    assert sync.stats()["scheduling"]["overlapped_steps"] == 0
    beams = [r for r, (_, params) in requests.items() if isinstance(params, BeamSearchParams)]
    assert overlapped.stats()["scheduling"]["overlapped_steps"] > 0 or beams
    return got, sync, overlapped


@pytest.fixture(scope="module")
def stops() -> tuple[int, str]:
    """A token early in prompt(8, 3)'s greedy output and a character late in prompt(9, 4)'s text: they stop those
    requests before max_tokens."""
    stop_token = reference_greedy(prompt(8, 3), 3, loaded=model())[2]
    text = model().tokenizer.decode(reference_greedy(prompt(9, 4), 8, loaded=model())[3:])
    return stop_token, text[0]


def mixed_requests(stop_token: int, stop_text: str) -> dict:
    """Greedy and seeded requests, with logprobs, forks, a stop token, a stop string, penalties, min_tokens and
    a single output token."""
    seeded = dict(temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    return {
        **{f"g{i}": (prompt(10 + 2 * i, 10 + i), greedy(12 - i, logprobs=i % 3 or None)) for i in range(5)},
        "fork": (prompt(9, 30), greedy(10, n=3)),
        "seeded": (prompt(7, 8), SamplingParams(n=2, seed=1234, max_tokens=9, logprobs=2, **seeded)),
        "one": (prompt(6, 40), greedy(1)),
        "one-fork": (prompt(5, 41), SamplingParams(n=2, seed=7, max_tokens=1, **seeded)),
        "stop-token": (prompt(8, 3), SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token])),
        "stop-text": (prompt(9, 4), SamplingParams(temperature=0, max_tokens=16, stop=[stop_text])),
        "penalized": (prompt(11, 9), greedy(10, repetition_penalty=1.5, frequency_penalty=0.7,
                                             presence_penalty=0.4, min_tokens=3, logprobs=1)),
        # Unpenalized, its greedy output repeats one token from the 6th on: each step must count the last one.
        "no-repeats": (prompt(16, 13), greedy(10, frequency_penalty=2.0)),
    }


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_oversubscribed_batch_gives_the_outputs_of_the_synchronous_engine(preemption_mode, stops):
    # ~60 blocks of 4 wanted, 24 in the pool; 12 tokens a step: prompts prefill in chunks next to decodes.
    outputs, sync, overlapped = assert_same(mixed_requests(*stops), num_blocks=24, max_num_batched_tokens=12,
                                            max_num_seqs=8, preemption_mode=preemption_mode, swap_space=0.002)
    for engine in (sync, overlapped):
        assert engine.scheduler.num_preemptions > 0
        if preemption_mode == "swap":
            assert engine.kv.stats().swap_out_blocks > 0
    assert overlapped.stats()["scheduling"]["synchronous_steps"] == 0
    # (index, token ids, text, cumulative logprob, logprobs, finish reason, stop reason) of the first sample
    assert outputs["stop-token"][2][0][5:] == ("stop", stops[0]) and len(outputs["stop-token"][2][0][1]) == 3
    assert outputs["stop-text"][2][0][5:] == ("stop", stops[1])
    assert len(outputs["one-fork"][2]) == 2 and len(outputs["one"][2][0][1]) == 1


def test_prefix_hits_and_late_arrivals_give_the_same_outputs(stops):
    """Requests sharing a system prompt arrive while others decode: some hit blocks computed steps before (one
    step later than the synchronous engine can, under overlap)."""
    system = prompt(16, 99)
    requests = {f"s{i}": (system + prompt(3 + i, 50 + i), greedy(6 + i, logprobs=1)) for i in range(5)}
    requests.update(mixed_requests(*stops))
    arrivals = {"s0": 0, "s1": 3, "s2": 4, "s3": 9, "s4": 10, "one": 6, "fork": 7}
    _, sync, overlapped = assert_same(requests, arrivals, max_num_batched_tokens=16)
    for engine in (sync, overlapped):
        assert engine.kv.stats().prefix_hit_tokens >= 3 * 16


def test_only_sequences_that_stop_early_cost_an_extra_token():
    """A sequence whose in-flight token is its last by max_tokens is not scheduled again; one that stops on a
    stop token was, and that token is discarded."""
    requests = {f"l{i}": (prompt(6 + i, 80 + i), greedy(2 + i, n=1 + i % 2)) for i in range(4)}
    _, _, overlapped = assert_same(requests)
    assert overlapped.stats()["scheduling"]["discarded_tokens"] == 0
    stop_token = reference_greedy(prompt(8, 3), 3, loaded=model())[2]
    requests = {"stop": (prompt(8, 3), SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token]))}
    _, _, overlapped = assert_same(requests)
    assert overlapped.stats()["scheduling"]["discarded_tokens"] == 1


def test_abort_in_the_middle_frees_everything_and_leaves_the_others_alone():
    """Each request aborted once it has returned 3 tokens (under overlap a 4th is on its way then: discarded)."""
    requests = {f"a{i}": (prompt(7 + i, 60 + i), greedy(20, n=2 if i == 0 else 1)) for i in range(4)}
    requests["kept"] = (prompt(9, 70), greedy(12, logprobs=2))
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(model=model(), async_scheduling=async_scheduling, num_blocks=20,
                             max_num_batched_tokens=8, preemption_mode="swap", swap_space=0.002)
        for request_id, (ids, params) in requests.items():
            engine.add_request(request_id, prompt_token_ids=ids, params=params)
        last = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                last[output.request_id] = completions(output)
                if output.request_id != "kept" and min(len(c.token_ids) for c in output.outputs) >= 3:
                    assert engine.abort_request(output.request_id)
            engine.kv.check_invariants()
        assert_all_free(engine)
        results.append(last)
    assert results[0] == results[1]
    assert all(len(tokens) == 3 for request_id in requests if request_id != "kept"
               for _, tokens, *_ in results[1][request_id][2])


def test_beam_search_runs_synchronously_and_the_others_overlap_again():
    requests = {"beam": (prompt(9, 17), BeamSearchParams(beam_width=3, max_tokens=5)),
                "plain": (prompt(12, 18), greedy(14, logprobs=1))}
    _, _, overlapped = assert_same(requests, {"beam": 2}, num_blocks=40, max_num_batched_tokens=16)
    scheduling = overlapped.stats()["scheduling"]
    assert scheduling["overlapped_steps"] > 0 and scheduling["synchronous_steps"] > 0
    assert scheduling["status"] == "overlapping"
    # Step time is measured, and the wait for sampled tokens is part of it.
    assert 0 < scheduling["device_wait_seconds"] <= scheduling["step_seconds"]


def test_async_scheduling_is_an_option_on_by_default():
    assert make_engine(model=model(num_layers=1)).async_scheduling
    engine = make_engine(model=model(num_layers=1), async_scheduling=False)
    assert not engine.async_scheduling and "async_scheduling=False" in engine.stats()["scheduling"]["status"]
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    from ioattn.distributed.worker import TensorParallelEngine

    with pytest.raises(ValueError, match="async_scheduling"):
        TensorParallelEngine("tiny", EngineConfig(async_scheduling=True, device="cpu"), tensor_parallel_size=2)


def _random_params(rng: random.Random, beams: bool):
    kind = rng.random() if beams else rng.uniform(0.1, 1)
    max_tokens = rng.randint(1, 10)
    stops = dict(max_tokens=max_tokens, min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
                 stop_token_ids=rng.sample(range(256), rng.choice([0, 0, 24])),
                 stop=rng.sample([chr(c) for c in range(33, 127)], rng.choice([0, 0, 12])),
                 logprobs=rng.choice([None, None, 0, 3]))
    if kind < 0.1:
        return BeamSearchParams(beam_width=rng.randint(1, 3), max_tokens=rng.randint(1, 6))
    if kind < 0.5:
        return SamplingParams(n=rng.randint(1, 3), temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.8]),
                              seed=rng.randint(0, 99), **stops)
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.5) if rng.random() < 0.3 else {}
    return SamplingParams(n=rng.randint(1, 2), temperature=0.0, **penalties, **stops)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), preemption_mode=st.sampled_from(["recompute", "swap"]),
       num_blocks=st.sampled_from([14, 40]), budget=st.sampled_from([6, 16]), prefix_caching=st.booleans())
def test_random_workloads_give_the_outputs_of_the_synchronous_engine(seed, preemption_mode, num_blocks, budget,
                                                                    prefix_caching):
    """Greedy (some penalized), seeded n > 1 and beam requests with stop tokens and strings, arriving over the
    first steps, some sharing a prefix, in pools from tight to roomy (no beams in the tight one: whether a beam
    search fits it would depend on when the others free their blocks)."""
    rng = random.Random(seed)
    shared = prompt(8, seed)
    requests, arrivals = {}, {}
    for i in range(rng.randint(3, 9)):
        ids = (shared if rng.random() < 0.4 else []) + prompt(rng.randint(1, 14), seed + i)
        requests[f"r{i}"] = (ids, _random_params(rng, beams=num_blocks == 40))
        arrivals[f"r{i}"] = rng.randint(0, 8)
    assert_same(requests, arrivals, loaded=model(num_layers=1), num_blocks=num_blocks, max_model_len=40,
                max_num_batched_tokens=budget, max_num_seqs=6, preemption_mode=preemption_mode, swap_space=0.001,
                enable_prefix_caching=prefix_caching)


def test_final_only_outputs_are_the_last_cumulative_ones():
    """output_kind="final_only" (what LLM.generate asks for): no output before a request finishes, then the
    cumulative engine's final one."""
    requests = {f"f{i}": (prompt(6 + i, 90 + i), greedy(3 + 2 * i, n=1 + i % 2, logprobs=1)) for i in range(4)}
    expected = run(True, requests)[0]
    engine = make_engine(model=model(), async_scheduling=True)
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, prompt_token_ids=ids,
                           params=SamplingParams(**{**vars(params), "output_kind": "final_only"}))
    seen = [output for _ in range(100) for output in engine.step()]
    assert all(output.finished for output in seen)
    assert {output.request_id: completions(output) for output in seen} == expected
    assert_all_free(engine)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="all")


def test_delta_outputs_add_up_to_the_cumulative_ones():
    """output_kind="delta" (what the server's engine process streams): after every step, outputs for the same
    requests as "cumulative", each holding only what is new (token ids, logprobs, text: stop strings' hold-back
    included); joined, they are the cumulative ones. Beam search refuses it."""
    requests = {f"d{i}": (prompt(5 + i, 60 + i), SamplingParams(
        temperature=1.0, seed=i, max_tokens=4 + 3 * i, n=1 + i % 2, logprobs=i % 2 or None,
        stop=["\ufffd\ufffd", "xyz"] if i % 3 else None, include_stop_str_in_output=i == 4)) for i in range(6)}
    engines = {kind: make_engine(model=model(), async_scheduling=True) for kind in ("cumulative", "delta")}
    for kind, engine in engines.items():
        for request_id, (ids, params) in requests.items():
            engine.add_request(request_id, prompt_token_ids=ids, params=SamplingParams(**{**vars(params),
                                                                                        "output_kind": kind}))
    joined: dict[tuple[str, int], list] = {}
    for _ in range(100):
        cumulative, delta = (engines[kind].step() for kind in ("cumulative", "delta"))
        assert [output.request_id for output in delta] == [output.request_id for output in cumulative]
        for whole, new in zip(cumulative, delta):
            assert (new.finished, new.error) == (whole.finished, whole.error)
            for c, d in zip(whole.outputs, new.outputs, strict=True):
                so_far = joined.setdefault((new.request_id, d.index), [[], "", []])
                so_far[0] += d.token_ids
                so_far[1] += d.text
                so_far[2] += d.logprobs or []
                assert so_far == [c.token_ids, c.text, c.logprobs or []]
                assert (d.index, d.finish_reason, d.stop_reason) == (c.index, c.finish_reason, c.stop_reason)
        if not engines["cumulative"].has_unfinished_requests():
            break
    assert not engines["delta"].has_unfinished_requests()
    assert {request_id for request_id, _ in joined} == set(requests)
    with pytest.raises(ValueError, match="output_kind"):
        BeamSearchParams(beam_width=2, output_kind="delta")
