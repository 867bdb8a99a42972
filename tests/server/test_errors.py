"""Bad input gets a 400 with an OpenAI error body naming the problem; the engine keeps serving; overload -> 429."""

import httpx
import openai
import pytest

from server_helpers import FAIL_ADD, FAIL_STEP, MAX_MODEL_LEN, MAX_PROMPTS, MODEL, assert_engine_empty

GOOD = dict(model=MODEL, prompt="Hello", max_tokens=2)
CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

# (request body, the words the message must contain, the parameter the error names)
BAD_COMPLETIONS = [
    ({**GOOD, "prompt": ""}, "empty", "prompt"),
    ({**GOOD, "prompt": []}, "empty", "prompt"),
    ({**GOOD, "prompt": "x" * (2 * MAX_MODEL_LEN)}, "max_model_len", "prompt"),
    ({**GOOD, "prompt": "x" * (MAX_MODEL_LEN - 10), "max_tokens": 50}, "max_model_len", "max_tokens"),
    ({**GOOD, "prompt": [1, 2, 10**6]}, "token ids", "prompt"),
    ({**GOOD, "prompt": ["a"] * (MAX_PROMPTS + 1)}, "batch", "prompt"),
    ({**GOOD, "prompt": ["a", ""]}, "empty", "prompt.1"),
    ({**GOOD, "prompt": [[1, 2], [3, 10**6]]}, "token ids", "prompt.1"),
    ({**GOOD, "max_tokens": -1}, "greater than or equal to 1", "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "greater than or equal to 1", "max_tokens"),
    ({**GOOD, "temperature": -0.5}, "greater than or equal to 0", "temperature"),
    ({**GOOD, "temperature": 1e9}, "less than or equal to 2", "temperature"),
    ({**GOOD, "top_p": 0}, "top_p must be in (0, 1]", "top_p"),
    ({**GOOD, "top_p": 1.5}, "top_p must be in (0, 1]", "top_p"),
    ({**GOOD, "n": 0}, "greater than or equal to 1", "n"),
    ({**GOOD, "n": 10**6}, "less than or equal to", "n"),
    ({**GOOD, "logprobs": 50}, "less than or equal to 5", "logprobs"),
    ({**GOOD, "seed": 2**70}, "less than or equal to", "seed"),
    ({**GOOD, "stop": [""]}, "stop must be", "stop"),
    ({**GOOD, "presence_penalty": 7}, "presence_penalty must be in [-2, 2]", "presence_penalty"),
    ({**GOOD, "top_k": -5}, "top_k must be", "top_k"),
    ({**GOOD, "temprature": 0.5}, "unknown or unsupported parameter", "temprature"),
    ({**GOOD, "echo": True}, "echo is not supported", "echo"),
    ({**GOOD, "logit_bias": {"1": 5}}, "logit_bias is not supported", "logit_bias"),
    ({"model": MODEL, "max_tokens": 2}, "Field required", "prompt"),
    ({**GOOD, "max_tokens": "many"}, "valid integer", "max_tokens"),
    # What the model cannot serve is refused here, not in the engine's step (which used to fail every request).
    ({**GOOD, "stop_token_ids": [600], "min_tokens": 1}, "stop_token_ids must be token ids in [0, 512), got [600]",
     "stop_token_ids"),
    ({**GOOD, "stop_token_ids": [2**70]}, "stop_token_ids must be token ids", "stop_token_ids"),
    # Strict types: a boolean is neither a token id nor a count, a string no boolean.
    ({**GOOD, "prompt": [1, True]}, "valid integer", "prompt.1"),
    ({**GOOD, "max_tokens": True}, "valid integer", "max_tokens"),
    ({**GOOD, "ignore_eos": "yes"}, "valid boolean", "ignore_eos"),
    ({**GOOD, "stream_options": {"include_usage": "yes"}}, "valid boolean", "stream_options.include_usage"),
    ({**GOOD, "stop_token_ids": [1.5]}, "valid integer", "stop_token_ids.0"),
]
BAD_CHATS = [
    ({**CHAT, "messages": []}, "at least 1 item", "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "role", "messages.0.role"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts", "messages"),
    ({**CHAT, "top_logprobs": 2}, "needs logprobs", "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "less than or equal to 20", "top_logprobs"),
    ({**CHAT, "max_completion_tokens": 10**6}, "max_model_len", "max_tokens"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools are not supported", "tools"),
]


def assert_error(response: httpx.Response, status: int, words: str, param: str | None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.url, timeout=60) as http:
        yield http


@pytest.mark.parametrize("path, body, words, param",
                         [("/v1/completions", *case) for case in BAD_COMPLETIONS]
                         + [("/v1/chat/completions", *case) for case in BAD_CHATS],
                         ids=lambda v: v if isinstance(v, str) and v.startswith("/") else None)
def test_bad_request_is_400_naming_the_problem(http, path, body, words, param):
    assert_error(http.post(path, json=body), 400, words, param)
    # Streaming requests are checked before the stream starts.
    if isinstance(body, dict) and "model" in body:
        assert_error(http.post(path, json={**body, "stream": True}), 400, words, param)


@pytest.mark.parametrize("path, body", [("/v1/completions", {**GOOD, "model": "gpt-5"}),
                                        ("/v1/chat/completions", {**CHAT, "model": "gpt-5", "stream": True})])
def test_unknown_model_is_404_model_not_found(http, path, body):
    """OpenAI's answer to a model it does not serve."""
    error = assert_error(http.post(path, json=body), 404, "does not exist", "model")
    assert error["code"] == "model_not_found"


# Lone surrogates, as JSON escapes (clients refuse to encode them): raw bodies, and the param that names where.
SURROGATE_BODIES = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "ok \\udfff", "stream": true}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["\\ud800"]}', "prompt.0"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["a", "\\udc80"]}', "stop.1"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "\\ud800": 1}', "\\ud800"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": {"\\ud800": 1}}', "logit_bias.\\ud800"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', "prompt"),  # its UTF-8-like bytes
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "\\udfff"}]}',
     "messages.0.name"),
]


@pytest.mark.parametrize("path, body, param", SURROGATE_BODIES)
def test_a_lone_surrogate_anywhere_is_400_and_the_connection_stays(http, path, body, param):
    """It used to be a 500 from the tokenizer, with the keep-alive connection reset."""
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, "lone surrogate", param)
    assert response.headers.get("connection") != "close"
    assert http.post("/v1/completions", json=GOOD).status_code == 200  # the same keep-alive connection


def test_one_bad_request_does_not_fail_five_live_ones(live_server, http):
    """The review's scenario: five unrelated streams mid-decode, then `stop_token_ids: [600]` with `min_tokens`
    (which used to raise IndexError inside the engine's step and fail all six with 500). The bad one gets a 400;
    the five finish normally."""
    import openai

    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        streams = [client.completions.create(model=MODEL, prompt=f"live {i}", max_tokens=12, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                   for i in range(5)]
        chunks = [[next(iter(stream))] for stream in streams]  # every one is decoding now
        bad = {**GOOD, "stop_token_ids": [600], "min_tokens": 1}
        for body in (bad, {**bad, "stream": True}, {**bad, "stop_token_ids": [2**70]}):
            assert_error(http.post("/v1/completions", json=body), 400, "stop_token_ids", "stop_token_ids")
        for stream, received in zip(streams, chunks):
            received.extend(stream)
    for received in chunks:
        assert [c.choices[0].finish_reason for c in received if c.choices][-1] == "length"
        assert received[-1].usage.completion_tokens == 12
    assert live_server.wait_idle()["kv"]["blocks_used"] == 0


def test_malformed_bodies(http):
    for content in (b"{not json", b"[1, 2]", b"null", b"\xff\xfe"):
        response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, (content, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400, "not valid JSON", None)
    assert http.get("/v1/nothing").status_code == 404
    assert "error" in http.get("/v1/nothing").json()


def test_openai_client_sees_400_then_good_requests_succeed(live_server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert "temperature" in str(caught.value)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert client.completions.create(**GOOD).usage.completion_tokens >= 1
    assert client.chat.completions.create(**CHAT).choices[0].message.role == "assistant"
    live_server.wait_idle()
    assert live_server.client.alive


def test_overload_is_429(live_server, client):
    loop = live_server.client
    saved = loop.max_queued_requests
    loop.max_queued_requests = 1
    try:
        holder = client.completions.create(model=MODEL, prompt="Hold", max_tokens=64, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(holder))  # the request is in the engine now
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(**GOOD)
        assert caught.value.body["code"] == "rate_limit_exceeded"
        holder.close()  # the client goes away mid-stream: the held request is aborted
        live_server.wait_idle(timeout=30)
    finally:
        loop.max_queued_requests = saved
    assert client.completions.create(**GOOD).choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_failed_step_is_an_error_and_the_engine_keeps_serving(live_server, client, stream):
    """A step that raises (in the engine process: FAIL_STEP makes the request's second step raise) fails the
    requests it held (500, or an error event mid-stream), frees their blocks, and the engine serves the next
    request."""
    request = dict(model=MODEL, prompt=FAIL_STEP + "Doomed", max_tokens=8, extra_body={"ignore_eos": True})
    if stream:
        with pytest.raises(openai.APIError, match="injected failure"):
            for _ in client.completions.create(**request, stream=True):
                pass
    else:
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            client.completions.create(**request)
    assert_engine_empty(live_server.wait_idle())
    assert client.completions.create(**GOOD).usage.completion_tokens >= 1


def test_an_add_request_that_raises_fails_that_request_alone(live_server, client):
    """Not a ValueError: a bug, reported as a 500 for that request; the engine lives on (it used to die)."""
    with pytest.raises(openai.InternalServerError, match="injected add failure"):
        client.completions.create(**{**GOOD, "prompt": FAIL_ADD + "Hello"})
    assert live_server.client.alive
    assert client.completions.create(**GOOD).usage.completion_tokens >= 1
