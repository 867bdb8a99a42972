"""The OpenAI API over real HTTP with the official client: completions, chat, streaming, n > 1, stop, usage."""

import httpx
import pytest

import ioattn
from ioattn.models.tokenizer import ByteTokenizer
from ioattn.server.chat_template import ChatTemplate

from server_helpers import MAX_MODEL_LEN, MODEL, SLOW_STEP

TOKENIZER = ByteTokenizer()
LENGTH = {"ignore_eos": True}  # every sample runs to max_tokens: token counts are exact


def streamed(chunks) -> tuple[dict[int, str], dict[int, list[str]], dict[int, str], list]:
    """Per choice index: concatenated text, logprob tokens (with text offsets for completions), finish reason;
    and the usage chunks."""
    texts, tokens, reasons, usages = {}, {}, {}, []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            logprobs = getattr(choice, "logprobs", None)
            if logprobs is not None:
                tokens.setdefault(choice.index, []).extend(
                    zip(logprobs.tokens, logprobs.text_offset) if hasattr(logprobs, "tokens")
                    else [t.token for t in logprobs.content])
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    return texts, tokens, reasons, usages


def test_models_health(live_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(live_server.url + "/health").json()
    assert health["status"] == "ok"


def test_completion_usage_and_logprobs(client):
    prompt = "The sky is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                    extra_body=LENGTH)
    (choice,) = out.choices
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(TOKENIZER.encode(prompt))
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == out.usage.prompt_tokens + 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(lp_ <= 0 for lp_ in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely, so its logprob is the best of its position.
    assert all(abs(lp_ - max(top.values())) < 1e-5 for lp_, top in zip(lp.token_logprobs, lp.top_logprobs))
    # Token ids are a prompt too.
    by_ids = client.completions.create(model=MODEL, prompt=TOKENIZER.encode(prompt), max_tokens=5, temperature=0,
                                       extra_body=LENGTH)
    assert by_ids.choices[0].text == choice.text


@pytest.mark.parametrize("n", [1, 3])
def test_stream_matches_non_stream_for_seeded_request(client, n):
    request = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, n=n,
                   logprobs=1, extra_body=LENGTH)
    full = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    texts, tokens, reasons, usages = streamed(chunks)
    assert sorted(c.index for c in full.choices) == list(range(n))
    for choice in full.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == list(zip(choice.logprobs.tokens, choice.logprobs.text_offset))
        assert reasons[choice.index] == choice.finish_reason == "length"
    assert len(usages) == 1 and usages[0] == full.usage and full.usage.completion_tokens == 8 * n
    if n > 1:  # sample i draws from seed + i: the samples differ
        assert len({tuple(c.logprobs.tokens) for c in full.choices}) > 1


def test_chat_stream_and_non_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    request = dict(model=MODEL, messages=messages, max_tokens=6, seed=7, n=2, logprobs=True, top_logprobs=3,
                   extra_body=LENGTH)
    full = client.chat.completions.create(**request)
    rendered = ChatTemplate.plain().render(messages)
    assert full.object == "chat.completion"
    assert full.usage.prompt_tokens == len(TOKENIZER.encode(rendered)) and full.usage.completion_tokens == 12
    for choice in full.choices:
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert len(choice.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    texts, tokens, reasons, usages = streamed(chunks)
    assert not usages  # only with stream_options.include_usage
    first_deltas = {}
    for chunk in chunks:
        for choice in chunk.choices:
            first_deltas.setdefault(choice.index, choice.delta)
    assert all(delta.role == "assistant" for delta in first_deltas.values())
    for choice in full.choices:
        assert texts[choice.index] == choice.message.content
        assert tokens[choice.index] == [t.token for t in choice.logprobs.content]


def test_stop_strings(client):
    """A stop string cuts the text before it, streamed or not, and finishes with reason 'stop'."""
    for seed_prompt in ("abc", "def", "ghi", "jkl", "mno"):
        free = client.completions.create(model=MODEL, prompt=seed_prompt, max_tokens=16, temperature=0,
                                         extra_body=LENGTH).choices[0].text
        cut = next((i for i in range(2, len(free)) if free[i].isascii() and free[i].isprintable()), None)
        if cut is not None:
            break
    else:
        pytest.skip("the tiny model wrote no ASCII character to stop on")
    stop = free[cut]
    expected = free[: free.index(stop)]
    request = dict(model=MODEL, prompt=seed_prompt, max_tokens=16, temperature=0, stop=[stop, "\x01never"])
    (choice,) = client.completions.create(**request).choices
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    texts, _, reasons, _ = streamed(client.completions.create(**request, stream=True))
    assert (texts[0], reasons[0]) == (expected, "stop")


def test_max_tokens_default_fits_the_context(client):
    """The completions default (16 tokens) shrinks for a prompt near max_model_len instead of failing."""
    prompt = "x" * (MAX_MODEL_LEN - 4)  # + BOS = MAX_MODEL_LEN - 3 tokens
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body=LENGTH)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_chat_template_from_checkpoint(tmp_path):
    """A checkpoint's tokenizer_config.json template, with its special tokens; the BOS it writes is not added
    again; a template's raise_exception is a TemplateError (a 400 in the server)."""
    import json

    from ioattn.server.chat_template import TemplateError

    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
                "{% endif %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = ChatTemplate.for_model(tmp_path)
    assert not chat.add_special_tokens
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    assert chat.render(messages) == "<s>[user] Hi!</s>[assistant] "
    with pytest.raises(TemplateError, match="no tools"):
        chat.render([{"role": "tool", "content": "x"}])
    with pytest.raises(TemplateError, match="only text parts"):
        chat.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert ChatTemplate.for_model("tiny").add_special_tokens


def test_a_batch_of_prompts(live_server, client):
    """A list of prompts is one request per prompt: choice i * n + j is sample j of prompt i (greedy here, so
    each prompt's samples are its own single request's text); usage adds up; streamed or not."""
    prompts = ["a", "bb", "The sky is"]
    request = dict(model=MODEL, max_tokens=4, temperature=0, n=2, extra_body=LENGTH)
    alone = [client.completions.create(**request, prompt=p).choices[0].text for p in prompts]
    full = client.completions.create(**request, prompt=prompts)
    assert [c.index for c in full.choices] == list(range(6))
    assert [c.text for c in full.choices] == [text for text in alone for _ in range(2)]
    assert full.usage.prompt_tokens == sum(len(TOKENIZER.encode(p)) for p in prompts)
    assert full.usage.completion_tokens == 6 * 4
    texts, _, reasons, usages = streamed(client.completions.create(**request, prompt=prompts, stream=True,
                                                                   stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in full.choices} and set(reasons.values()) == {"length"}
    assert usages == [full.usage]
    by_ids = client.completions.create(**request, prompt=[TOKENIZER.encode(p) for p in prompts])
    assert [c.text for c in by_ids.choices] == [c.text for c in full.choices]
    live_server.wait_idle()


def test_logprobs_keep_every_entry(client):
    """Tokens that decode alike (single bytes of multi-byte characters all decode to U+FFFD) keep one entry each:
    the later ones keyed token_id:N; return_tokens_as_token_ids names every token so."""
    request = dict(model=MODEL, prompt="\u00e9t\u00e9", max_tokens=8, temperature=0, logprobs=5, extra_body=LENGTH)
    lp = client.completions.create(**request).choices[0].logprobs
    assert all(len(top) == 5 for top in lp.top_logprobs)
    assert any(key.startswith("token_id:") for top in lp.top_logprobs for key in top)
    as_ids = client.completions.create(**{**request, "extra_body": {**LENGTH, "return_tokens_as_token_ids": True}})
    ids_lp = as_ids.choices[0].logprobs
    assert all(token.startswith("token_id:") for token in ids_lp.tokens)
    assert [sorted(top.values()) for top in ids_lp.top_logprobs] == [sorted(top.values()) for top in lp.top_logprobs]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "\u00e9t\u00e9"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body={**LENGTH, "return_tokens_as_token_ids": True})
    for token in chat.choices[0].logprobs.content:
        assert token.token.startswith("token_id:") and len({t.token for t in token.top_logprobs}) == 5


def test_stop_string_ends_the_request_in_the_engine(live_server, client):
    """Stop strings are matched in the HTTP process, which then aborts the request in the engine: with steps
    slowed to 20 ms (SLOW_STEP) the 400-token request would run 8 s; it is gone from the engine at once."""
    prompt = SLOW_STEP + "abc"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body=LENGTH).choices[0].text
    stop = next((ch for ch in free[1:] if ch.isascii() and ch.isprintable()), None)
    if stop is None:
        pytest.skip("the tiny model wrote no ASCII character to stop on")
    (choice,) = client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, temperature=0, stop=stop,
                                          extra_body=LENGTH).choices
    assert (choice.text, choice.finish_reason) == (free[: free.index(stop)], "stop")
    assert live_server.wait_idle(timeout=2)["unfinished_requests"] == 0


def test_version_and_content_types(live_server):
    assert httpx.get(live_server.url + "/version").json() == {"version": ioattn.__version__}
    body = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}'
    for headers in ({"content-type": "text/plain"}, {}, {"content-type": "application/x-www-form-urlencoded"}):
        response = httpx.post(live_server.url + "/v1/completions", content=body, headers=headers)
        assert response.status_code == 415, response.text
        assert "must be JSON sent as Content-Type: application/json" in response.json()["error"]["message"]
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/merge-patch+json"):
        response = httpx.post(live_server.url + "/v1/completions", content=body, headers={"content-type": content_type})
        assert response.status_code == 200, (content_type, response.text)
