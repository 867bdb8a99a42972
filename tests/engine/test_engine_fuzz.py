"""Hostile input to LLMEngine, LLM and the sampler: every bad argument is a ValueError naming it, raised before
any state changes; whatever is accepted finishes normally; no block leaks, and no request's parameters can make
`step()` fail for the others.

First the cases an attacker-style review found, one test each; then a hypothesis fuzzer that interleaves hostile
and valid `add_request` calls with `step()` and `abort_request` on the tiny model (one layer, CPU), checking the
whole engine after every call. `-m slow` runs the fuzzer longer.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import assert_all_free, greedy, make_engine, prompt, run_all, tiny
from ioattn.llm import LLM
from ioattn.engine.llm_engine import EngineConfig
from ioattn.engine.sampling import OUTPUT_KINDS, BeamSearch, BeamSearchParams, Sampler, SamplingParams
from ioattn.engine.scheduler import Scheduler, SchedulerConfig
from ioattn.engine.sequence import SequenceStatus
from ioattn.kv import KVCacheManager

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 512  # the tiny preset's
MAX_NUM_SEQS = 6
MAX_MODEL_LEN = 32


def small_engine(**kwargs):
    defaults = dict(model=tiny(num_layers=1), num_blocks=24, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                    max_num_batched_tokens=16)
    return make_engine(**{**defaults, **kwargs})


def engine_state(engine) -> tuple:
    """What a refused call must leave exactly as it was."""
    engine.kv.check_invariants()
    scheduler = engine.scheduler
    queues = tuple(tuple(seq.seq_id for seq in queue) for queue in (scheduler.waiting, scheduler.running,
                                                                    scheduler.swapped))
    return tuple(engine.requests), queues, engine.kv.stats(), engine._num_beam_requests


def decode_five(engine) -> list[str]:
    """Five unrelated requests, each one token into its decode."""
    ids = [engine.add_request(f"live{i}", prompt_token_ids=prompt(5 + i, i), params=greedy(6)) for i in range(5)]
    for _ in range(3):
        engine.step()
    assert all(engine.requests[i].seqs[0].output_token_ids for i in ids)
    return ids


def assert_all_finished(engine, ids) -> None:
    outputs = run_all(engine)
    for request_id in ids:
        assert outputs[request_id].error is None
        assert [c.finish_reason for c in outputs[request_id].outputs] == ["length"]


# ---------------------------------------------------------------- the review's cases


@pytest.mark.parametrize("params, words", [
    (SamplingParams(stop_token_ids=[600], min_tokens=1),
     r"stop_token_ids must be token ids in \[0, 512\), got \[600\]"),
    (SamplingParams(stop_token_ids=[3, 2**70], min_tokens=1), r"stop_token_ids must be .*1180591620717411303424"),
    (BeamSearchParams(beam_width=2, stop_token_ids=[512], min_tokens=2), "stop_token_ids"),
    (SamplingParams(n=MAX_NUM_SEQS + 1), "n"),
])
def test_a_request_the_model_cannot_serve_fails_alone_at_add_request(params, words):
    engine = small_engine()
    live = decode_five(engine)
    before = engine_state(engine)
    with pytest.raises(ValueError, match=f"^{words}"):
        engine.add_request("bad", prompt="x", params=params)
    assert engine_state(engine) == before
    assert_all_finished(engine, live)


@pytest.mark.parametrize("field, value, words", [
    ("seed", 2**70, r"seed must be None or an int in \[-2\*\*63, 2\*\*64 - n\]"),
    ("seed", -(2**63) - 1, "seed must be"),
    ("top_k", 10**400, None),  # accepted: larger than the vocabulary is no truncation
    ("temperature", 10**400, "temperature must be"),  # an int past float's range: not OverflowError
])
def test_values_past_torch_ranges_are_refused_or_harmless(field, value, words):
    if words is not None:
        with pytest.raises(ValueError, match=f"^{words}"):
            SamplingParams(**{field: value})
        return
    engine = small_engine()
    engine.add_request("r", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=3, **{field: value}))
    assert run_all(engine)["r"].outputs[0].finish_reason in ("stop", "length")


def test_seeds_fill_torch_generators_whole_range():
    SamplingParams(seed=-(2**63))
    SamplingParams(seed=2**64 - 3, n=3)  # samples seed .. seed + 2 all fit
    with pytest.raises(ValueError, match="^seed"):
        SamplingParams(seed=2**64 - 2, n=3)


def test_sampler_never_indexes_outside_the_vocabulary():
    """Out-of-vocabulary stop ids can never be sampled: nothing to mask, and no write outside the logits."""
    logits = torch.randn(2, 8)
    params = [SamplingParams(stop_token_ids=[3, 600, 2**70], min_tokens=2, temperature=0.0)] * 2
    out = Sampler(eos_token_ids=[7, 99]).sample(logits, params, history=[([1], []), ([1], [8])])
    masked = logits.clone()
    masked[:, [3, 7]] = -math.inf
    assert out.token_ids.tolist() == masked.argmax(dim=-1).tolist()
    search = BeamSearch(BeamSearchParams(beam_width=2, stop_token_ids=[600], min_tokens=1, max_tokens=2),
                        eos_token_ids=[1])
    step = search.step(torch.randn(1, 8))
    assert 1 not in step.tokens


def test_length_penalty_cannot_overflow_a_beam_step():
    for penalty in (16.0, -16.0):
        search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=40, length_penalty=penalty), eos_token_ids=[0])
        while not search.done:
            search.step(torch.randn(len(search.running), 4))
        assert all(math.isfinite(beam.score) or beam.score == -math.inf for beam in search.best())
    with pytest.raises(ValueError, match=r"^length_penalty must be a number in \[-16, 16\]"):
        BeamSearchParams(beam_width=2, length_penalty=1e10)


def test_a_prompt_utf8_cannot_encode_fails_alone():
    engine = small_engine()
    live = decode_five(engine)
    before = engine_state(engine)
    for text in ("\ud800", "ok \udfff then"):
        with pytest.raises(ValueError, match=r"^prompt must be text that UTF-8 can encode: .* lone surrogate"):
            engine.add_request(prompt=text, params=greedy(2))
    assert engine_state(engine) == before
    assert_all_finished(engine, live)

    llm = LLM(tiny(num_layers=1), device="cpu", block_size=4, num_blocks=24, max_model_len=MAX_MODEL_LEN)
    outputs = llm.generate(["Hi", "\ud800", "", "there"], greedy(2), use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, False, True]
    assert "lone surrogate" in outputs[1].error and "non-empty" in outputs[2].error
    assert_all_free(llm.engine)


def test_llm_generate_refuses_each_bad_prompt_alone():
    llm = LLM(tiny(num_layers=1), device="cpu", block_size=4, num_blocks=24, max_model_len=MAX_MODEL_LEN)
    params = [greedy(2)] * 4 + [SamplingParams(stop_token_ids=[VOCAB]), "greedy", greedy(2)]
    outputs = llm.generate(prompt_token_ids=[[1, 2], [VOCAB], [1, "a"], [], [3], [4], [3, 4]], sampling_params=params,
                           use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, False, False, False, False, True]
    assert [o.error.split()[0] for o in outputs[1:6]] == ["prompt_token_ids"] * 3 + ["stop_token_ids", "params"]
    for call, words in [(lambda: llm.generate("x", BeamSearchParams(beam_width=2)), "sampling_params must be"),
                        (lambda: llm.generate(5), "prompts must be"),
                        (lambda: llm.generate(prompt_token_ids=5), "prompt_token_ids must be")]:
        with pytest.raises(ValueError, match=f"^{words}"):
            call()
    assert_all_free(llm.engine)


def test_swap_preemption_without_a_cpu_pool_is_refused_at_construction():
    with pytest.raises(ValueError, match="^swap_space must be > 0 GiB with preemption_mode=\"swap\""):
        EngineConfig(preemption_mode="swap", swap_space=0)
    with pytest.raises(ValueError, match=r"^swap_space \(1e-12 GiB\) holds no KV block"):
        small_engine(preemption_mode="swap", swap_space=1e-12)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        Scheduler(SchedulerConfig(max_model_len=16, preemption_mode="swap"), KVCacheManager(8, 4))
    small_engine(swap_space=0)  # recompute needs no CPU pool


def test_a_failed_preemption_leaves_every_sequence_in_one_queue(monkeypatch):
    """Root cause of the swap leak: `_preempt` took the victim out of `running` before a call that raised."""
    engine = small_engine(num_blocks=10, preemption_mode="swap", swap_space=0.0005)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_token_ids=prompt(6, i), params=greedy(20))

    def failing_swap_out(seq_id):
        raise RuntimeError("injected swap failure")

    monkeypatch.setattr(engine.kv, "swap_out", failing_swap_out)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(200):
            engine.step()
    scheduler = engine.scheduler
    queued = scheduler.waiting + scheduler.running + scheduler.swapped
    for request in engine.requests.values():
        for seq in request.seqs:
            assert queued.count(seq) == 1 and seq.status is not SequenceStatus.FINISHED
    for request_id in list(engine.requests):
        assert engine.abort_request(request_id)
    assert_all_free(engine)


@pytest.mark.parametrize("kwargs, words", [
    (dict(arrival_time="yesterday"), "arrival_time must be None or a finite number"),
    (dict(arrival_time=math.nan), "arrival_time"),
    (dict(arrival_time=math.inf), "arrival_time"),
    (dict(arrival_time=True), "arrival_time"),
    (dict(priority=1.5), "priority must be an int"),
    (dict(priority=None), "priority"),
    (dict(request_id=["a"]), "request_id must be a str"),
    (dict(request_id=1.5), "request_id"),
    (dict(params={"temperature": 0}), "params must be"),
    (dict(prompt_token_ids=5, prompt=None), "prompt_token_ids must be a list of ints"),
    (dict(prompt_token_ids="abc", prompt=None), "prompt_token_ids must be a list of ints"),
    (dict(prompt_token_ids=[1, True], prompt=None), r"prompt_token_ids must be ints in \[0, 512\), got \[True\]"),
    (dict(prompt_token_ids=[1, 2.0], prompt=None), "prompt_token_ids"),
    (dict(prompt_token_ids=[2**70], prompt=None), "prompt_token_ids"),
])
def test_every_add_request_argument_is_checked_before_registration(kwargs, words):
    """A bad argument used to be accepted and to break the next valid request (a ghost request, then "this is a
    bug" from step())."""
    engine = small_engine()
    live = decode_five(engine)
    before = engine_state(engine)
    with pytest.raises(ValueError, match=f"^{words}"):
        engine.add_request(**{"request_id": "bad", "prompt": "x", "params": greedy(2), **kwargs})
    assert engine_state(engine) == before
    engine.add_request("next", prompt="x", params=greedy(2))
    assert_all_finished(engine, live + ["next"])


def test_registration_is_all_or_nothing(monkeypatch):
    engine = small_engine()
    before = engine_state(engine)

    def failing_add(seq):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.scheduler, "add", failing_add)
    with pytest.raises(RuntimeError):
        engine.add_request("r", prompt="x", params=BeamSearchParams(beam_width=2, max_tokens=2))
    assert engine_state(engine) == before
    monkeypatch.undo()
    engine.add_request("r", prompt="x", params=greedy(2))
    assert_all_finished(engine, ["r"])


def test_params_changed_after_they_were_built_are_checked_again():
    engine = small_engine()
    params = greedy(2)
    params.temperature = "hot"
    with pytest.raises(ValueError, match="^temperature must be"):
        engine.add_request("r", prompt="x", params=params)
    assert not engine.requests


def test_generated_request_ids_skip_ids_in_use():
    engine = small_engine()
    engine.add_request("0", prompt="x", params=greedy(2))
    assert engine.add_request(prompt="x", params=greedy(2)) == "1"
    with pytest.raises(ValueError, match="^request_id must be"):
        engine.abort_request(None)
    run_all(engine)


def test_engine_config_names_each_bad_setting():
    for field, value in [("max_num_seqs", 0), ("max_num_seqs", "8"), ("block_size", True), ("num_blocks", 0),
                         ("max_model_len", 1.5), ("gpu_memory_utilization", "0.9"), ("swap_space", math.inf),
                         ("watermark", 1.0), ("watermark", None), ("policy", "lifo"), ("scheduling", ["static"]),
                         ("enable_prefix_caching", 1), ("async_scheduling", 0)]:
        with pytest.raises(ValueError, match=f"^{field} must be "):
            EngineConfig(**{field: value})


# ---------------------------------------------------------------- the fuzzer

SURROGATES = st.sampled_from(["\ud800", "\udfff", "ok\udc80", "\ud83d"])  # lone; the last a high half alone
TEXT = st.text(st.characters(codec="utf-8"), max_size=6)
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.just(10**400), st.floats(), TEXT, SURROGATES,
    st.binary(max_size=4), st.lists(st.integers(-3, 600), max_size=3), st.just(object()), st.just({"a": 1}),
    st.text(max_size=300).map(lambda s: s * 100),
)
# Neither a str nor an int (bools are neither here).
NOT_STR_OR_INT = st.one_of(st.booleans(), st.floats(), st.binary(max_size=4),
                           st.lists(st.integers(-3, 600), max_size=3), st.just(object()), st.just({"a": 1}),
                           st.just(()))
BAD_TOKENS = st.sampled_from(["a", 1.5, None, 2**70, 2**63, True, -1, VOCAB, object()])
GOOD_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
GOOD_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=10)

# Values each SamplingParams / BeamSearchParams field refuses (on its own, with every other field at its default).
BAD_FIELDS = {
    "n": [0, -1, 1.5, "2", None, True],
    "temperature": [-1, math.nan, math.inf, "0.5", None, True, 10**400],
    "top_p": [0, 1.01, math.nan, None], "top_k": [-2, 2.0, None, True], "min_p": [-0.1, 1.5, None, math.nan],
    "repetition_penalty": [0, -1, math.inf, math.nan], "presence_penalty": [2.5, -3, math.nan, True],
    "frequency_penalty": [3, None, "0"], "seed": [1.0, "1", 2**64, -(2**63) - 1, 2**70, True],
    "logprobs": [-1, 21, 1.5, True], "max_tokens": [0, -5, 2.0, "16", True], "min_tokens": [-1, 1.5, None, 10**6],
    "stop": ["", [""], [3], 5, b"ab", {"a": 1}], "stop_token_ids": [[-1], ["a"], [1.5], [True], 5, "abc"],
    "ignore_eos": [1, None, "yes"], "include_stop_str_in_output": [None, 0], "skip_special_tokens": ["yes"],
    "output_kind": ["all", None, 3],
}
BAD_BEAM_FIELDS = {
    "beam_width": [0, 1.5, None, True], "n": [0, 3], "length_penalty": [math.nan, math.inf, 17, -100, 10**400, "1"],
    "early_stopping": ["sometimes", 1, None], "stop": ["x", ["x"]], "max_tokens": [0, -1],
    "output_kind": ["delta"],
}
# Valid values that this engine cannot serve, found at add_request.
UNSERVABLE = {"n": [MAX_NUM_SEQS + 1, 2**70], "stop_token_ids": [[VOCAB], [1, 2**70]]}


@st.composite
def sampling_params(draw):
    max_tokens = draw(st.integers(1, 6))
    return SamplingParams(
        n=draw(st.integers(1, 2)), temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
        top_p=draw(st.sampled_from([1.0, 0.9])), top_k=draw(st.sampled_from([0, -1, 5, 10**400])),
        min_p=draw(st.sampled_from([0.0, 0.1])), repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
        presence_penalty=draw(st.sampled_from([0.0, -2.0, 2])), frequency_penalty=draw(st.sampled_from([0.0, 0.5])),
        seed=draw(st.sampled_from([None, 0, -(2**63), 2**64 - 2])), logprobs=draw(st.sampled_from([None, 0, 3, 20])),
        max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
        stop=draw(st.sampled_from([None, "a", ["\n", "the"], ("\ud800",)])),
        stop_token_ids=draw(st.sampled_from([None, [], [5, VOCAB - 1], [257] * 3])),
        ignore_eos=draw(st.booleans()), include_stop_str_in_output=draw(st.booleans()),
        output_kind=draw(st.sampled_from(OUTPUT_KINDS)),
    )


@st.composite
def beam_params(draw):
    return BeamSearchParams(
        beam_width=draw(st.integers(1, 2)), max_tokens=draw(st.integers(1, 4)),
        length_penalty=draw(st.sampled_from([-16, 0.0, 1.0, 16])),
        early_stopping=draw(st.sampled_from([False, True, "never"])),
        stop_token_ids=draw(st.sampled_from([None, [5]])), min_tokens=draw(st.integers(0, 1)),
    )


@st.composite
def good_call(draw) -> dict:
    call = dict(params=draw(st.one_of(sampling_params(), sampling_params(), beam_params())),
                priority=draw(st.integers(-(2**70), 2**70)),
                arrival_time=draw(st.one_of(st.none(), st.floats(-1e300, 1e300))))
    if draw(st.booleans()):
        call["prompt_token_ids"] = draw(GOOD_IDS)
    else:
        call["prompt"] = draw(GOOD_TEXT)
    return call


@st.composite
def bad_call(draw) -> tuple[dict, tuple[str, ...]]:
    """A valid call with one argument (or one params field) made bad, and the names its error may give."""
    call = draw(good_call())
    beam = isinstance(call["params"], BeamSearchParams)
    kind = draw(st.sampled_from(["request_id", "prompt", "prompt_token_ids", "both", "neither", "params",
                                 "arrival_time", "priority", "field", "unservable"]))
    if kind == "request_id":
        call["request_id"] = draw(NOT_STR_OR_INT)
    elif kind == "prompt":
        call.pop("prompt_token_ids", None)
        call["prompt"] = draw(st.one_of(st.just(""), SURROGATES, st.just("x" * (MAX_MODEL_LEN + 1)), NOT_STR_OR_INT,
                                        st.integers()))
    elif kind == "prompt_token_ids":
        call.pop("prompt", None)
        ids = draw(GOOD_IDS)
        ids.insert(draw(st.integers(0, len(ids))), draw(BAD_TOKENS))
        call["prompt_token_ids"] = draw(st.one_of(
            st.just(ids), st.just([]), st.just([1] * (MAX_MODEL_LEN + 1)),
            st.one_of(st.integers(), TEXT, st.binary(), st.just({1: 2}), st.just({1, 2}), st.just(object()))))
    elif kind in ("both", "neither"):
        call.pop("prompt", None)
        call.pop("prompt_token_ids", None)
        if kind == "both":
            call.update(prompt="x", prompt_token_ids=[1])
        return call, ("prompt",)
    elif kind == "params":
        call["params"] = draw(st.one_of(NOT_STR_OR_INT, TEXT, st.integers()))
    elif kind == "arrival_time":
        call["arrival_time"] = draw(st.one_of(
            st.sampled_from([math.nan, math.inf, -math.inf, 10**400, True, False, b"1", "1.0", "yesterday", [1.0]]),
            TEXT, SURROGATES))
    elif kind == "priority":
        call["priority"] = draw(st.one_of(NOT_STR_OR_INT, st.none(), TEXT))
    elif kind == "field":  # changed after the params were built: add_request checks them again
        field, values = draw(st.sampled_from(sorted((BAD_BEAM_FIELDS if beam else BAD_FIELDS).items())))
        setattr(call["params"], field, draw(st.sampled_from(values)))
        kind = field
    else:
        field, values = draw(st.sampled_from(sorted(UNSERVABLE.items())))
        if beam:
            field = "beam_width" if field == "n" else field
        setattr(call["params"], field, draw(st.sampled_from(values)))
        if field == "n" and not beam:
            call["params"].seed = None  # so that n, not the seed's range, is what fails
        kind = field
    return call, (kind,)


@st.composite
def junk_call(draw) -> dict:
    """Anything in any argument: it must be refused with a ValueError, or be served."""
    names = ("request_id", "prompt", "params", "prompt_token_ids", "arrival_time", "priority")
    call = draw(good_call())
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        call[name] = draw(st.one_of(JUNK, GOOD_IDS) if name == "prompt_token_ids" else JUNK)
    return call


OPERATIONS = st.one_of(
    st.tuples(st.just("good"), good_call()),
    st.tuples(st.just("bad"), bad_call()),
    st.tuples(st.just("bad"), bad_call()),
    st.tuples(st.just("junk"), junk_call()),
    st.tuples(st.just("field"), st.booleans(), st.data()),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.one_of(st.integers(0, 40), JUNK)),
)


class EngineFuzz:
    """Drives one engine, checking every call's contract as it goes."""

    def __init__(self, engine):
        self.engine = engine
        self.accepted: list[str] = []
        self.aborted: set[str] = set()
        self.finished: dict = {}
        self.next_id = 0

    def add(self, call: dict, names: tuple[str, ...] | None) -> None:
        """names: the call is bad and its error must name one of them; None: it may be refused or served."""
        call = dict(call)
        if "request_id" not in call:
            self.next_id += 1
            call["request_id"] = f"f{self.next_id}"
        before = engine_state(self.engine)
        try:
            request_id = self.engine.add_request(**call)
        except ValueError as error:
            assert engine_state(self.engine) == before, f"a refused add_request changed the engine: {error}"
            if names is not None:
                assert any(name in str(error) for name in names), (names, str(error))
            return
        assert names is None, f"a bad call was accepted: {call}"
        self.accepted.append(request_id)

    def build_params(self, beam: bool, data) -> None:
        """Hostile values in every field at once: construction is refused naming a field, or the params run."""
        fields = BAD_BEAM_FIELDS if beam else BAD_FIELDS
        kwargs = {name: data.draw(st.sampled_from(values)) for name, values in fields.items()
                  if data.draw(st.booleans())}
        if beam:
            kwargs["beam_width"] = kwargs.get("beam_width", 2)
        try:
            params = (BeamSearchParams if beam else SamplingParams)(**kwargs)
        except ValueError as error:
            assert str(error).split()[0] in kwargs, (kwargs, str(error))
            return
        self.add(dict(prompt_token_ids=[1, 2], params=params), None)

    def step(self) -> None:
        for output in self.engine.step():
            if output.finished:
                self.finished[output.request_id] = output
        self.engine.kv.check_invariants()

    def abort(self, target) -> None:
        if isinstance(target, int) and not isinstance(target, bool) and 0 <= target < len(self.accepted):
            target = self.accepted[target]
        try:
            aborted = self.engine.abort_request(target)
        except ValueError as error:
            assert "request_id" in str(error) and not (isinstance(target, (str, int)) and not isinstance(target, bool))
            return
        if aborted:
            self.aborted.add(str(target))
        self.engine.kv.check_invariants()

    def finish(self) -> None:
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        for request_id in self.accepted:
            if request_id in self.aborted:
                continue
            output = self.finished[request_id]
            assert output.error is None, output.error
            assert output.outputs and all(c.finish_reason in ("stop", "length") for c in output.outputs), output
        assert_all_free(self.engine)
        assert self.engine.kv.stats().blocks_free + self.engine.kv.stats().blocks_cached == self.engine.kv.num_blocks


def fuzz(engine_kwargs: dict, operations: list) -> None:
    run = EngineFuzz(small_engine(**engine_kwargs))
    for operation in operations:
        kind = operation[0]
        if kind == "good":
            run.add(operation[1], None)
        elif kind == "bad":
            run.add(*operation[1])
        elif kind == "junk":
            run.add(operation[1], None)
        elif kind == "field":
            run.build_params(operation[1], operation[2])
        elif kind == "step":
            for _ in range(operation[1]):
                run.step()
        else:
            run.abort(operation[1])
    run.finish()


ENGINES = st.fixed_dictionaries({
    "preemption_mode": st.sampled_from(["recompute", "swap"]), "async_scheduling": st.booleans(),
    "num_blocks": st.sampled_from([16, 24]),
}).map(lambda kwargs: {**kwargs, "swap_space": 0.0005})
FUZZ_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=100, **FUZZ_SETTINGS)
@given(engine_kwargs=ENGINES, operations=st.lists(OPERATIONS, min_size=5, max_size=40))
def test_fuzz_hostile_requests_among_live_ones(engine_kwargs, operations):
    fuzz(engine_kwargs, operations)


@pytest.mark.slow
@settings(max_examples=2000, **FUZZ_SETTINGS)
@given(engine_kwargs=ENGINES, operations=st.lists(OPERATIONS, min_size=5, max_size=60))
def test_fuzz_hostile_requests_among_live_ones_long(engine_kwargs, operations):
    fuzz(engine_kwargs, operations)
