"""Bad input gets a 400 with an OpenAI error body naming the problem; the engine keeps serving; overload -> 429."""

import httpx
import openai
import pytest

from server_helpers import MAX_MODEL_LEN, MODEL

GOOD = dict(model=MODEL, prompt="Hello", max_tokens=2)
CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

# (request body, the words the message must contain, the parameter the error names)
BAD_COMPLETIONS = [
    ({**GOOD, "model": "gpt-5"}, "does not exist", "model"),
    ({**GOOD, "prompt": ""}, "empty", "prompt"),
    ({**GOOD, "prompt": []}, "empty", "prompt"),
    ({**GOOD, "prompt": "x" * (2 * MAX_MODEL_LEN)}, "max_model_len", "prompt"),
    ({**GOOD, "prompt": "x" * (MAX_MODEL_LEN - 10), "max_tokens": 50}, "max_model_len", "max_tokens"),
    ({**GOOD, "prompt": [1, 2, 10**6]}, "token ids", "prompt"),
    ({**GOOD, "prompt": ["a", "b"]}, "batch", "prompt"),
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
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert client.completions.create(**GOOD).usage.completion_tokens >= 1
    assert client.chat.completions.create(**CHAT).choices[0].message.role == "assistant"
    live_server.wait_idle()
    assert live_server.server.loop.alive


def test_overload_is_429(live_server, client):
    loop = live_server.server.loop
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
def test_failed_step_is_an_error_and_the_engine_keeps_serving(live_server, client, monkeypatch, stream):
    """A step that raises fails the requests it held (500, or an error event mid-stream), frees their blocks,
    and the loop serves the next request."""
    engine = live_server.server.engine
    real_step, calls = engine.step, []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 2:  # after the prefill: a streamed request has its first chunk
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine, "step", step_failing_once)
    request = dict(model=MODEL, prompt="Doomed", max_tokens=8, extra_body={"ignore_eos": True})
    if stream:
        with pytest.raises(openai.APIError, match="injected failure"):
            for _ in client.completions.create(**request, stream=True):
                pass
    else:
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            client.completions.create(**request)
    live_server.wait_idle()
    assert engine.kv.stats().blocks_used == 0
    assert client.completions.create(**GOOD).usage.completion_tokens >= 1
