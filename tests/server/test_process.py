"""The engine in its own process, as users run it: `ioattn serve` as a real subprocess (start-up log, API key,
limits, the engine process killed mid-stream and restarted, SIGTERM drain; the exit status when the engine process
dies without --restart-engine), and a stuck step that /health and /metrics do not wait for."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from server_helpers import HANG_S, HANG_STEP, MAX_MODEL_LEN, MODEL

KEY = "sekrit-test-key"
STREAM = dict(model=MODEL, max_tokens=200, stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": True})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServeProcess:
    """`python -m ioattn.cli serve --model tiny` with its log in a file."""

    def __init__(self, tmp_path, *flags, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "serve.log"
        command = [sys.executable, "-m", "ioattn.cli", "serve", "--model", MODEL, "--port", str(self.port),
                   "--max-model-len", str(MAX_MODEL_LEN), *flags]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def engine_process(self) -> psutil.Process:
        (child,) = [p for p in psutil.Process(self.process.pid).children()
                    if "multiprocessing.spawn" in " ".join(p.cmdline())]
        return child

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def read_stream(url: str, prompt: str, api_key: str, events: list, started: threading.Event) -> None:
    """A streaming completion; every SSE payload appended to `events` (the first one sets `started`)."""
    body = {**STREAM, **STREAM["extra_body"], "prompt": prompt}
    del body["extra_body"]
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {api_key}"} if api_key else {}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
    except httpx.HTTPError as error:
        events.append(f"transport error: {error!r}")
    started.set()


def test_serve_key_limits_engine_restart_and_graceful_sigterm(tmp_path):
    serve = ServeProcess(tmp_path, "--max-request-bytes", "4096", "--max-prompts-per-request", "2",
                         "--restart-engine", "--log-level", "info", env={"IOATTN_API_KEY": KEY})
    try:
        # Start-up names the model, dtype, device, KV pool and the address.
        line = next(line for line in serve.log().splitlines() if "serving tiny" in line)
        for words in ("float32 on cpu", "KV pool", "blocks x 16 tokens", "GiB", serve.url, "API key required"):
            assert words in line, line
        check_key_and_limits(serve.url)
        check_engine_killed_and_restarted(serve)
        # SIGTERM drains: a stream in flight finishes in full, then the server and its engine process exit, 0.
        engine = serve.engine_process()
        events, started = [], threading.Event()
        reader = threading.Thread(target=read_stream, args=(serve.url, "drain me", KEY, events, started))
        reader.start()
        assert started.wait(60)
        serve.process.send_signal(signal.SIGTERM)
        reader.join(timeout=120)
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 200
        assert serve.wait(timeout=60) == 0, serve.log()
        engine.wait(timeout=30)
        assert "Traceback" not in serve.log()
    finally:
        serve.close()


def check_key_and_limits(url: str) -> None:
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for headers, why in (({}, "didn't provide an API key"), ({"Authorization": "Bearer wrong"}, "incorrect"),
                         ({"Authorization": KEY}, "incorrect")):
        response = httpx.post(url + "/v1/completions", json=good, headers=headers)
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert why in error["message"] and error["code"] == "invalid_api_key" and error["param"] is None
    assert httpx.get(url + "/v1/models").status_code == 401
    for open_path in ("/health", "/metrics", "/version"):  # probes and scrapers need no key
        assert httpx.get(url + open_path).status_code == 200
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(**good)
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
        assert client.completions.create(**good).usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError, match="batch of 3 prompts"):
            client.completions.create(**{**good, "prompt": ["a", "b", "c"]})
        assert len(client.completions.create(**{**good, "prompt": ["a", "b"]}).choices) == 2
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {**good, "prompt": "x" * 5000}
    response = httpx.post(url + "/v1/completions", json=big, headers=auth)
    assert response.status_code == 413 and "4096 bytes" in response.json()["error"]["message"]
    chunked = httpx.post(url + "/v1/completions", headers={**auth, "content-type": "application/json"},
                         content=iter([json.dumps(big).encode()]))  # no Content-Length: counted as it comes
    assert chunked.status_code == 413


def check_engine_killed_and_restarted(serve: ServeProcess) -> None:
    """SIGKILL the engine process: streams and a non-streaming request in flight end with errors within seconds
    (never a hang), /health fails and new requests get 503 while it is gone, then a new one serves."""
    first = serve.engine_process()
    with openai.OpenAI(base_url=serve.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        streams = [client.completions.create(**STREAM, prompt=f"stream {i}") for i in range(3)]
        for stream in streams:
            next(iter(stream))
        outcome = {}
        waiting = threading.Thread(target=lambda: outcome.setdefault("error", _error_of(
            lambda: client.completions.create(model=MODEL, prompt="waiting", max_tokens=300,
                                              extra_body={"ignore_eos": True}))))
        waiting.start()
        time.sleep(0.3)
        first.kill()
        killed_at = time.monotonic()
        for stream in streams:
            with pytest.raises(openai.APIError, match="was killed by SIGKILL"):
                for _ in stream:
                    pass
        waiting.join(timeout=30)
        assert isinstance(outcome["error"], openai.InternalServerError), outcome
        assert time.monotonic() - killed_at < 15
        health = httpx.get(serve.url + "/health")
        if health.status_code == 503:  # the new engine is still loading (it usually is)
            assert "restarting" in health.json()["error"]["message"]
            with pytest.raises(openai.APIStatusError) as caught:
                client.completions.create(model=MODEL, prompt="too early", max_tokens=2)
            assert caught.value.status_code == 503
        deadline = time.monotonic() + 120
        while httpx.get(serve.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, serve.log()
            time.sleep(0.1)
        assert serve.engine_process().pid != first.pid
        assert client.completions.create(model=MODEL, prompt="again", max_tokens=3).usage.completion_tokens >= 1
    assert "was killed by SIGKILL" in serve.log() and "ready again" in serve.log()


def test_serve_exits_nonzero_when_the_engine_process_dies(tmp_path):
    """SIGKILL the engine process mid-stream: the stream ends with an error event within seconds, /health fails,
    the log says why, and `ioattn serve` exits with status 1."""
    serve = ServeProcess(tmp_path, "--log-level", "warning")
    try:
        events, started = [], threading.Event()
        reader = threading.Thread(target=read_stream, args=(serve.url, "doomed", None, events, started))
        reader.start()
        assert started.wait(60)
        serve.engine_process().kill()
        killed_at = time.monotonic()
        reader.join(timeout=30)
        assert not reader.is_alive()
        errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
        assert errors and "was killed by SIGKILL" in errors[0]["message"] and errors[0]["type"] == "server_error"
        assert serve.wait(timeout=30) == 1
        assert time.monotonic() - killed_at < 30
        log = serve.log()
        assert "was killed by SIGKILL" in log and "stopping the server" in log, log
    finally:
        serve.close()


def _error_of(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the test inspects it)
        return error
    return None


def test_a_stuck_step_blocks_neither_health_nor_metrics(live_server):
    """HANG_STEP stalls one engine step for 2 s: the HTTP process answers meanwhile."""
    done = threading.Event()

    def hang():
        httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": HANG_STEP + "x",
                                                              "max_tokens": 2}, timeout=60)
        done.set()

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(0.5)  # the step is running now
    for path in ("/health", "/metrics", "/v1/models", "/version"):
        start = time.monotonic()
        assert httpx.get(live_server.url + path, timeout=10).status_code == 200
        assert time.monotonic() - start < HANG_S / 4, path
    assert not done.is_set()
    thread.join(timeout=60)
    assert done.is_set()
