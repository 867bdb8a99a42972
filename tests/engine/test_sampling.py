"""Sampling parameters, the batched sampler, stop handling and beam search (parity with transformers)."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ioattn.engine.sampling import (
    BeamSearch,
    BeamSearchParams,
    Sampler,
    SamplingParams,
    StopChecker,
    apply_penalties,
    truncate,
)
from ioattn.models.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_ids[0]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0), ("n", 1.5), ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf),
        ("temperature", "0.5"), ("top_p", 0), ("top_p", 1.01), ("top_p", math.nan), ("top_k", -2), ("top_k", 2.0),
        ("min_p", -0.1), ("min_p", 1.5), ("min_p", None), ("repetition_penalty", 0), ("repetition_penalty", -1),
        ("repetition_penalty", math.inf), ("presence_penalty", True), ("presence_penalty", 2.5),
        ("presence_penalty", -2.1), ("frequency_penalty", 3), ("frequency_penalty", -3), ("seed", 1.0),
        ("seed", "1"), ("logprobs", -1), ("logprobs", 21), ("max_tokens", 0), ("max_tokens", 2.0),
        ("min_tokens", -1), ("min_tokens", 17), ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]),
        ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("ignore_eos", 1), ("include_stop_str_in_output", None),
        ("skip_special_tokens", "yes"),
    ],
)
def test_invalid_sampling_values_name_the_field_and_range(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be .*, got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value})


def test_temperature_message_matches_the_brief():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize(
    "field, value",
    [("beam_width", 0), ("n", 5), ("n", 0), ("length_penalty", math.nan), ("early_stopping", "sometimes"),
     ("early_stopping", 1), ("stop", "x"), ("max_tokens", 0)],
)
def test_invalid_beam_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be "):
        BeamSearchParams(**{"beam_width": 4, field: value})


def test_valid_values_are_normalised():
    params = SamplingParams(stop="###", stop_token_ids=None, top_k=-1, max_tokens=None, min_tokens=50)
    assert params.stop == ["###"] and params.stop_token_ids == [] and params.temperature == 1.0
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert BeamSearchParams(beam_width=3).n == 3
    assert SamplingParams().generator() is None
    first, second = (SamplingParams(seed=7).generator(i) for i in range(2))
    assert not torch.equal(torch.rand(8, generator=first), torch.rand(8, generator=second))


# ---------------------------------------------------------------- sampler


def _rows(params, rows):
    return [params] * rows


def test_greedy_rows_are_the_exact_argmax_inside_a_mixed_batch(device):
    logits = torch.randn(6, 300, device=device)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(temperature=0, logprobs=2),
              SamplingParams(top_p=0.3, seed=3), SamplingParams(temperature=1e-6), SamplingParams(min_p=0.5)]
    out = Sampler().sample(logits, params)
    greedy = [0, 2, 4]
    assert torch.equal(out.token_ids[greedy], logits[greedy].argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)


def _allowed_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The tokens a row may sample, in float64, stage by stage as documented."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    allowed = probs >= min_p * probs.max()
    order = torch.argsort(probs, descending=True)
    if top_k > 0:
        allowed[order[top_k:]] = False
    kept = torch.where(allowed, probs, 0.0)
    kept = kept / kept.sum()
    mass_before = torch.cumsum(kept[order], 0) - kept[order]
    allowed[order[mass_before >= top_p]] = False
    return allowed, torch.where(allowed, kept, 0.0) / torch.where(allowed, kept, 0.0).sum()


@pytest.mark.parametrize(
    "knobs",
    [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=4, top_p=0.7, temperature=0.7),
     dict(min_p=0.05, top_p=0.9, temperature=1.5), dict(top_k=1)],
)
def test_truncation_never_samples_outside_the_allowed_set(knobs, device):
    vocab, draws = 10, 4000
    logits = torch.randn(vocab) * 1.5
    allowed, expected = _allowed_reference(logits, **knobs)
    logits = logits.to(device)
    truncated = truncate(logits.expand(2, vocab), _rows(SamplingParams(**knobs), 2))
    assert torch.equal(torch.isfinite(truncated[0]).cpu(), allowed)
    # Half the draws seeded (one generator per row), half from the global generator.
    params = _rows(SamplingParams(seed=0, **knobs), draws)
    generators = [torch.Generator(device).manual_seed(i) if i % 2 else None for i in range(draws)]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = Sampler().sample(logits.expand(draws, vocab).clone(), params, generators).token_ids.cpu()
    assert allowed[tokens].all()
    frequency = torch.bincount(tokens, minlength=vocab).double() / draws
    # 5 standard deviations of a binomial proportion: a wrong distribution fails, chance does not.
    assert ((frequency - expected).abs() <= 5 * (expected * (1 - expected) / draws).sqrt() + 1e-9).all()


def test_penalties_are_exact_on_a_small_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]] * 3)
    history = [([0, 1], [2, 2, 3])] * 3
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(repetition_penalty=0.5, frequency_penalty=-1.0, presence_penalty=1.0)]
    apply_penalties(logits, params, history)
    expected = torch.tensor([
        # seen in prompt or output: 0, 1, 2, 3 -> positive / 2, negative * 2
        [1.0, -2.0, 0.25, -1.0, 3.0, 1.0],
        # output counts: token 2 twice, token 3 once -> - 0.5 * count - 0.25
        [2.0, -1.0, 0.5 - 1.0 - 0.25, -0.5 - 0.5 - 0.25, 3.0, 1.0],
        # repetition 0.5 first, then + 1.0 * count - 1.0
        [4.0, -0.5, 1.0 + 2.0 - 1.0, -0.25 + 1.0 - 1.0, 3.0, 1.0],
    ])
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_penalties_steer_greedy_rows_and_leave_others_alone():
    logits = torch.tensor([[1.0, 0.9, 0.0]] * 2)
    params = [SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0)]
    out = Sampler().sample(logits, params, history=[([], [0]), ([], [0])])
    assert out.token_ids.tolist() == [1, 0]
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(logits, params)


def test_a_pending_last_output_token_counts_like_a_known_one(device):
    """Asynchronous scheduling: a row's last output token may still be on the device (history holds an id < 0,
    `pending` its value); penalties and min_tokens see exactly what the full history gives them."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.3),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4]),
              SamplingParams(temperature=0, frequency_penalty=-0.8)]
    known = [([0, 1], [2, 5, 5]), ([3], [1, 4]), ([2], [])]
    unread = [([0, 1], [2, 5, -1]), ([3], [1, -1]), ([2], [])]
    pending = torch.tensor([5, 4, 0], device=device)
    expected, got = logits.clone(), logits.clone()
    apply_penalties(expected, params, known)
    apply_penalties(got, params, unread, pending)
    assert torch.equal(expected, got)
    sampler = Sampler(eos_token_ids=[EOS % 6])
    assert torch.equal(sampler.sample(logits, params, history=known).token_ids,
                       sampler.sample(logits, params, history=unread, pending=pending).token_ids)
    with pytest.raises(ValueError, match="pending"):
        apply_penalties(got, params, unread)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(4, 8)
    logits[:, EOS % 8] = 50.0
    logits[:, 3] = 40.0
    sampler = Sampler(eos_token_ids=[EOS % 8])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    history = [([], []), ([], [5]), ([], [5, 5]), ([], [5, 5, 5])]
    tokens = sampler.sample(logits, _rows(params, 4), history=history).token_ids.tolist()
    assert all(t not in (EOS % 8, 3) for t in tokens[:2])
    assert tokens[2:] == [EOS % 8] * 2
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits[:1], [ignoring], history=history[:1]).token_ids.item() == EOS % 8


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch(device):
    vocab, steps = 64, 5
    step_logits = [torch.randn(vocab, device=device) for _ in range(steps)]
    params = SamplingParams(seed=1234, top_p=0.95, temperature=0.9)
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=5, top_k=3),
              SamplingParams(min_p=0.1, repetition_penalty=1.2)]

    def run(batch_position, companions):
        generator = params.generator(device=device)
        companion_generators = [p.generator(device=device) for p in companions]
        tokens = []
        for logits in step_logits:
            batch = torch.randn(len(companions) + 1, vocab, device=device)
            batch[batch_position] = logits
            rows = list(companions)
            rows.insert(batch_position, params)
            generators = list(companion_generators)
            generators.insert(batch_position, generator)
            out = Sampler().sample(batch, rows, generators, history=[([1], [2])] * len(rows))
            tokens.append(out.token_ids[batch_position].item())
        return tokens

    alone = run(0, [])
    assert run(2, others) == alone and run(4, others) == alone and run(0, others[:1]) == alone
    first = Sampler().sample(step_logits[0][None], [params], [params.generator(device=device)]).token_ids.item()
    assert first == alone[0]


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, 50) * 3
    params = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5),
              SamplingParams(logprobs=0, top_k=2), SamplingParams(temperature=0)]
    out = Sampler().sample(logits, params, history=[([0, 1, 2], [3])] * 3)
    reference = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(out.logprobs.double(), reference.gather(1, out.token_ids[:, None])[:, 0],
                               rtol=0, atol=1e-5)
    expected_top, expected_ids = reference.topk(5, dim=-1)
    assert out.top_token_ids.shape == (3, 5) and torch.equal(out.top_token_ids, expected_ids)
    torch.testing.assert_close(out.top_logprobs.double(), expected_top, rtol=0, atol=1e-5)
    none_asked = Sampler().sample(logits, [SamplingParams()] * 3)
    assert none_asked.top_logprobs is None and none_asked.logprobs.shape == (3,)


def test_rows_without_edits_skip_the_copy_and_match_the_editing_path():
    """A batch with no penalties or min_tokens samples from the logits as given (no clone, left unchanged);
    its rows come out exactly as when another row's penalty sends the batch through the editing path."""
    logits = torch.randn(5, 64) * 3
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0.7, top_k=5, seed=1), SamplingParams(temperature=0),
              SamplingParams(top_p=0.9, seed=2)]
    plain = Sampler().sample(logits, params, [p.generator() for p in params])
    assert torch.equal(logits, before)
    edited = Sampler().sample(torch.cat([logits, logits[:1]]), [*params, SamplingParams(repetition_penalty=1.3)],
                              [*(p.generator() for p in params), None], history=[([1], [2])] * 6)
    assert torch.equal(plain.token_ids, edited.token_ids[:5]) and torch.equal(plain.logprobs, edited.logprobs[:5])
    assert torch.equal(plain.top_token_ids, edited.top_token_ids[:5])
    assert torch.equal(plain.top_logprobs, edited.top_logprobs[:5])


@pytest.mark.parametrize("logprobs", [None, 4])
def test_sampler_output_tolist_returns_every_value_exactly(logprobs):
    logits = torch.randn(7, 300) * 5
    out = Sampler().sample(logits, [SamplingParams(temperature=0, logprobs=logprobs)] * 7)
    token_ids, sampled, top_ids, top_lps = out.tolist()
    assert token_ids == out.token_ids.tolist() and all(type(t) is int for t in token_ids)
    assert sampled == out.logprobs.tolist()
    if logprobs is None:
        assert top_ids is None and top_lps is None
    else:
        assert top_ids == out.top_token_ids.tolist() and top_lps == out.top_logprobs.tolist()


def test_low_precision_logits_and_bad_shapes():
    logits = torch.randn(2, 40, dtype=torch.float16)
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 2)
    assert torch.equal(out.token_ids, logits.float().argmax(-1)) and out.logprobs.dtype == torch.float32
    with pytest.raises(ValueError, match="2-D"):
        Sampler().sample(torch.randn(40), [SamplingParams()])
    with pytest.raises(ValueError, match="one entry per logits row"):
        Sampler().sample(logits, [SamplingParams()])


# ---------------------------------------------------------------- stop handling


# The detokenizer holds back text ending in U+FFFD as a character still incomplete, until the sequence ends.
WHOLE_CHARACTERS = st.characters(codec="utf-8", exclude_characters="\ufffd")  # encodable text: no lone surrogates


def _run(checker, text, extra_ids=()):
    for token in [*TOKENIZER.encode(text, add_special_tokens=False), *extra_ids]:
        if checker.append(token):
            break
    return checker


def test_stop_string_spanning_tokens_is_cut_from_the_text():
    params = SamplingParams(stop=["STOP", "never"], max_tokens=100)
    checker = _run(StopChecker(params, TOKENIZER, TOKENIZER.encode("prompt")), "Hello STOP and more")
    assert (checker.finish_reason, checker.stop_reason, checker.text) == ("stop", "STOP", "Hello ")
    assert len(checker.output_token_ids) == len("Hello STOP")  # the ids keep every token
    kept = _run(StopChecker(SamplingParams(stop="STOP", include_stop_str_in_output=True), TOKENIZER), "ab STOPx")
    assert kept.text == "ab STOP"


def test_stop_string_inside_one_token_and_multibyte_stops():
    word = {i + 300: w for i, w in enumerate(["alpha", "be|ta", "gamma"])}

    class WordTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(word.get(i, "") for i in ids)

    checker = StopChecker(SamplingParams(stop="|"), WordTokenizer())
    assert [checker.append(t) for t in (300, 301)] == [None, "stop"] and checker.text == "alphabe"
    euro = _run(StopChecker(SamplingParams(stop="€"), TOKENIZER), "price: 5€ only")
    assert euro.text == "price: 5" and euro.stop_reason == "€"


@settings(max_examples=40, deadline=None)
@given(st.text(WHOLE_CHARACTERS, max_size=30), st.text(WHOLE_CHARACTERS, min_size=1, max_size=4), st.booleans())
def test_stop_strings_end_the_text_at_their_first_occurrence(text, stop, include):
    checker = StopChecker(SamplingParams(stop=[stop], include_stop_str_in_output=include, max_tokens=None),
                          TOKENIZER)
    streamed = []
    for token in TOKENIZER.encode(text, add_special_tokens=False):
        done = checker.append(token)
        streamed.append(checker.stable_text)
        if done:
            break
    if stop in text:
        cut = text.index(stop) + (len(stop) if include else 0)
        assert (checker.finish_reason, checker.text) == ("stop", text[:cut])
    else:
        assert not checker.finished and checker.text == text
    # What was safe to stream is never taken back by a stop string found later.
    assert all(checker.text.startswith(piece) for piece in streamed)


def test_token_stops_length_and_min_tokens():
    eos = StopChecker(SamplingParams(), TOKENIZER, eos_token_ids=[EOS])
    assert _run(eos, "ab", [EOS]).finish_reason == "stop" and eos.stop_reason is None and eos.text == "ab"
    assert eos.output_token_ids[-1] == EOS
    ignored = _run(StopChecker(SamplingParams(ignore_eos=True, max_tokens=4), TOKENIZER, eos_token_ids=[EOS]),
                   "ab", [EOS, 99])
    assert ignored.finish_reason == "length" and len(ignored.output_token_ids) == 4 and ignored.text == "abc"
    stop_id = _run(StopChecker(SamplingParams(stop_token_ids=[ord("!")]), TOKENIZER), "hi!there")
    assert (stop_id.finish_reason, stop_id.stop_reason, stop_id.text) == ("stop", ord("!"), "hi")
    shown = _run(StopChecker(SamplingParams(stop_token_ids=[ord("!")], include_stop_str_in_output=True), TOKENIZER),
                 "hi!there")
    assert shown.text == "hi!"
    late = _run(StopChecker(SamplingParams(stop_token_ids=[ord("!")], stop="x", min_tokens=3), TOKENIZER), "x!x!ab")
    # The "x" ending token 3 came before min_tokens: only the "!" of token 4 may stop.
    assert late.text == "x!x" and late.stop_reason == ord("!") and len(late.output_token_ids) == 4
    context = _run(StopChecker(SamplingParams(max_tokens=None), TOKENIZER, [1, 2, 3], max_model_len=6), "abcdef")
    assert context.finish_reason == "length" and context.text == "abc"
    # A character split across tokens is released when the sequence ends by length.
    split = _run(StopChecker(SamplingParams(max_tokens=2), TOKENIZER), "€")
    assert split.finish_reason == "length" and split.text == "\ufffd"


def test_fork_is_independent_and_stop_strings_need_a_tokenizer():
    parent = _run(StopChecker(SamplingParams(stop="XY", max_tokens=50), TOKENIZER), "abc")
    child = parent.fork()
    _run(parent, "X")
    _run(child, "XY")
    assert parent.text == "abcX" and not parent.finished
    assert child.text == "abc" and child.finish_reason == "stop" and len(parent.output_token_ids) == 4
    with pytest.raises(ValueError, match="tokenizer"):
        StopChecker(SamplingParams(stop="x"))
    no_text = StopChecker(SamplingParams(max_tokens=2))
    assert [no_text.append(5), no_text.append(6)] == [None, "length"] and no_text.text == ""


# ---------------------------------------------------------------- beam search


@pytest.fixture(scope="module")
def tiny_hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        initializer_range=0.3,  # spread-out logits: no near-ties for float rounding to decide
    )
    # float64 so transformers' cached decoding and the recomputing driver agree to the last float32 bit.
    return transformers.LlamaForCausalLM(config).double().eval()


@torch.no_grad()
def _beam_search_by_recompute(model, prompt, params, eos_ids):
    search = BeamSearch(params, eos_token_ids=eos_ids, prompt_len=len(prompt))
    while not search.done:
        step = search.step(model(torch.tensor([prompt + b.token_ids for b in search.running])).logits[:, -1])
        assert len(step.parents) == len(step.tokens) == len(search.running) <= params.beam_width
        assert all(b.token_ids[-1] == t for b, t in zip(search.running, step.tokens))
    return search.best()


@pytest.mark.parametrize(
    "width, max_new, length_penalty, early_stopping, n, num_eos",
    [(3, 8, 1.0, False, 3, 1), (4, 7, 2.0, "never", 2, 1), (2, 8, -0.5, True, 1, 1), (4, 6, 0.0, False, 4, 2)],
)
def test_beam_search_matches_transformers(tiny_hf_llama, width, max_new, length_penalty, early_stopping, n,
                                          num_eos):
    model = tiny_hf_llama
    prompt = [0, *torch.randint(2, 48, (5,)).tolist()]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, eos_token_id=None)
    # EOS ids taken from the greedy continuation, so beams really end at EOS during the search.
    continuation = greedy[0, len(prompt):].tolist()
    eos_ids = list(dict.fromkeys(continuation[2:]))[:num_eos]
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=max_new,
            num_return_sequences=n, eos_token_id=eos_ids, pad_token_id=eos_ids[0], length_penalty=length_penalty,
            early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True,
        )
    params = BeamSearchParams(beam_width=width, n=n, max_tokens=max_new, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    beams = _beam_search_by_recompute(model, prompt, params, eos_ids)
    assert len(beams) == n
    for row, score, beam in zip(expected.sequences.tolist(), expected.sequences_scores.tolist(), beams):
        generated = row[len(prompt):]
        assert generated[: len(beam.token_ids)] == beam.token_ids
        assert all(t == eos_ids[0] for t in generated[len(beam.token_ids):])  # transformers' padding
        assert beam.score == pytest.approx(score, rel=1e-5)


def test_beam_search_steps_by_hand():
    """Two beams over a 4-token vocabulary with EOS = 3: the forks and finished set follow the rules."""
    log = torch.log
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0), eos_token_ids=[3])
    step = search.step(log(torch.tensor([[0.1, 0.5, 0.3, 0.1]])))
    assert (step.parents, step.tokens) == ([0, 0], [1, 2]) and not search.finished
    # Beam 0 ("1") ends with EOS at rank 0; its continuation "1 0" and "2 1" run on.
    step = search.step(log(torch.tensor([[0.3, 0.05, 0.05, 0.6], [0.1, 0.8, 0.05, 0.05]])))
    assert (step.parents, step.tokens) == ([1, 0], [1, 0])
    assert [b.token_ids for b in search.finished] == [[1, 3]]
    assert search.finished[0].score == pytest.approx((math.log(0.5) + math.log(0.6)) / 2)
    # Max length: the first two candidates finish and the set keeps the best two of all three.
    search.step(log(torch.tensor([[0.9, 0.05, 0.03, 0.02], [0.25, 0.25, 0.25, 0.25]])))
    assert search.done and not search.running
    assert [b.token_ids for b in search.best()] == [[2, 1, 0], [1, 3]]
