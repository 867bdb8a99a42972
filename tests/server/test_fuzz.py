"""Hostile requests against a real server while normal streams are in flight: every case is a 4xx with an OpenAI
error body or a 200, never a 5xx or a dropped connection; every live stream still finishes normally; afterwards
no request is left and every KV block is free.

Hypothesis draws over every field of /v1/completions and /v1/chat/completions: wrong types, out-of-range and huge
numbers, NaN, out-of-vocabulary token ids, lone surrogates (sent as JSON `\\ud800` escapes in raw bytes: clients
refuse to encode them), empty and long strings, nested garbage, unknown fields, missing fields, whole bodies that
are not objects. `-m slow` runs it longer.
"""

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_helpers import MAX_MODEL_LEN, MODEL, assert_engine_empty

LIVE_STREAMS = 3
LIVE_TOKENS = 12
ERROR_KEYS = {"message", "type", "param", "code"}

SURROGATE_TEXT = st.builds(lambda a, s, b: a + s + b, st.text(max_size=4),
                           st.sampled_from(["\ud800", "\udfff", "\udc80"]), st.text(max_size=4))
TEXT = st.one_of(st.text(max_size=12), st.text(max_size=12), SURROGATE_TEXT, st.just(""),
                 st.just("x" * (3 * MAX_MODEL_LEN)))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.sampled_from([2**63, -(2**63) - 1, 10**30]), st.floats(), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=10)
SMALL_INTS = st.sampled_from([-1, 0, 1, 2, 3, 5, 129, 600, 2**31, 2**63, 2**70])
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 300), st.sampled_from([511, 512, 600, 2**70, -1, True, 1.5, None])),
                     max_size=6)

# Per field: values near the valid range (so that a case reaches the deeper checks) or any JSON at all.
# Lengths stay small when valid, so that the cases that pass run in a few steps.
COMMON_FIELDS = {
    "model": st.one_of(st.just(MODEL), TEXT),
    "n": SMALL_INTS,
    "max_tokens": SMALL_INTS,
    "temperature": st.one_of(st.floats(-1, 3), st.just(float("nan"))),
    "top_p": st.floats(-0.5, 1.5),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "seed": SMALL_INTS,
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "user": TEXT,
    "top_k": SMALL_INTS,
    "min_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.floats(-1, 3),
    "min_tokens": SMALL_INTS,
    "ignore_eos": st.booleans(),
    "stop_token_ids": TOKEN_IDS,
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "logit_bias": st.one_of(st.just({}), st.dictionaries(TEXT, st.floats(), max_size=2)),
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=2), st.lists(TOKEN_IDS, max_size=2)),
    "logprobs": SMALL_INTS, "echo": st.booleans(), "best_of": SMALL_INTS, "suffix": TEXT,
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), TEXT),
     "content": st.one_of(TEXT, st.none(), st.lists(st.one_of(
         st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXT, JSON)}), JSON), max_size=2))},
    optional={"name": TEXT, "tool_call_id": JSON},
)
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON),
    "max_completion_tokens": SMALL_INTS, "logprobs": st.booleans(), "top_logprobs": SMALL_INTS,
    "add_generation_prompt": st.booleans(), "response_format": st.one_of(st.just({"type": "text"}), JSON),
    "tools": JSON, "tool_choice": JSON, "parallel_tool_calls": JSON,
}
ENDPOINTS = {
    "/v1/completions": (COMPLETION_FIELDS, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    "/v1/chat/completions": (CHAT_FIELDS, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                           "max_tokens": 2}),
}
# Fields a case never drops: without them a valid request could run to the end of the context.
KEPT = ("max_tokens",)


@st.composite
def case(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    fields, base = ENDPOINTS[path]
    kind = draw(st.sampled_from(["edit", "edit", "edit", "edit", "junk body", "raw bytes"]))
    if kind == "junk body":
        return path, json.dumps(draw(JSON)).encode()
    if kind == "raw bytes":
        return path, draw(st.one_of(st.binary(max_size=40), st.just(b"[" * 5000 + b"]" * 5000),
                                    st.just(b'{"model": "tiny", "prompt": "\xed\xa0\x80"}')))
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(st.one_of(fields[name], fields[name], JSON))
    for name in draw(st.lists(st.sampled_from(sorted(set(body) - set(KEPT))), max_size=1)):
        del body[name]
    if draw(st.integers(0, 9)) == 0:
        body[draw(TEXT)] = draw(JSON)  # an unknown field (or a surrogate key)
    # ensure_ascii writes every lone surrogate as a \ud800 escape: valid JSON text that decodes to it.
    return path, json.dumps(body, ensure_ascii=True).encode()


def check_response(response: httpx.Response, streaming: bool) -> None:
    assert response.status_code < 500, response.text
    assert response.headers.get("connection") != "close", "the server closed the connection"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"], error
        assert error["param"] is None or isinstance(error["param"], str)
        return
    assert response.status_code == 200, response.text
    if streaming:
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", response.text
        assert all("error" not in json.loads(event) for event in events[:-1]), response.text
    else:
        assert response.json()["choices"], response.text


class LiveStreams:
    """Normal streaming completions kept in flight in background threads, each checked as it ends."""

    def __init__(self, url: str):
        self.url = url
        self.stop = threading.Event()
        self.finished = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(LIVE_STREAMS)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, index: int) -> None:
        body = dict(model=MODEL, prompt=f"live stream {index}", max_tokens=LIVE_TOKENS, stream=True,
                    ignore_eos=True, stream_options={"include_usage": True})
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                try:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
                    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
                    reasons = [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", ())]
                    usage = chunks[-1]["usage"]
                    if response.status_code != 200 or lines[-1] != "data: [DONE]" or "length" not in reasons or (
                            usage["completion_tokens"] != LIVE_TOKENS):
                        self.failures.append(f"{response.status_code}: {lines[-3:]}")
                    self.finished += 1
                except Exception as error:  # noqa: BLE001 (every failure of a live stream is reported)
                    self.failures.append(repr(error))


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.url, timeout=120) as http:
        yield http


def fuzz_cases(live_server, http, max_examples: int) -> None:
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(case())
    def one(path_and_body):
        path, body = path_and_body
        try:
            streaming = json.loads(body).get("stream") is True
        except (ValueError, AttributeError, RecursionError):
            streaming = False
        check_response(http.post(path, content=body, headers={"content-type": "application/json"}), streaming)

    with LiveStreams(live_server.url) as live:
        one()
    assert not live.failures, live.failures[:3]
    assert live.finished >= LIVE_STREAMS
    live_server.wait_idle()
    stats = live_server.engine_stats(check_invariants=True)
    assert_engine_empty(stats)
    assert stats["invariants"] == "ok", stats["invariants"]
    assert live_server.client.alive

def test_fuzz_every_field_while_streams_run(live_server, http):
    fuzz_cases(live_server, http, max_examples=150)


@pytest.mark.slow
def test_fuzz_every_field_while_streams_run_long(live_server, http):
    fuzz_cases(live_server, http, max_examples=3000)
