"""Server-test helpers: a real uvicorn server on a free loopback port, in a background thread, in front of a real
engine-core process; and the test engine that process builds.

The engine process cannot be monkeypatched from a test, so `ScriptedSpec` builds a `tiny` engine that misbehaves
for marked prompts (a prompt that starts with one of the MARKS): a step that raises, a slow step, a step that
hangs for a while, an add_request that raises something other than ValueError. Only tests send such prompts.
"""

import asyncio
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from ioattn.models.tokenizer import ByteTokenizer
from ioattn.server.core import EngineSpec

MODEL = "tiny"
MAX_MODEL_LEN = 512
MAX_QUEUED_REQUESTS = 1024
MAX_PROMPTS = 16

FAIL_STEP = "\x01fail-step "  # the second step this request is in raises RuntimeError("injected failure")
SLOW_STEP = "\x01slow-step "  # every step this request is in takes 20 ms more
HANG_STEP = "\x01hang-step "  # the first step this request is in takes 2 s more
FAIL_ADD = "\x01fail-add "  # add_request raises TypeError("injected add failure")
HANG_S = 2.0


def engine_config():
    from ioattn.engine.config import EngineConfig

    return EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=256)


@dataclass(frozen=True)
class ScriptedSpec(EngineSpec):
    def build(self):
        engine = super().build()
        encode = ByteTokenizer().encode
        marks = {name: encode(name) for name in (FAIL_STEP, SLOW_STEP, HANG_STEP, FAIL_ADD)}
        steps_seen: dict[str, int] = {}
        real_step, real_add = engine.step, engine.add_request

        def marked(token_ids, mark: str) -> bool:
            return list(token_ids[: len(marks[mark])]) == marks[mark]

        def step():
            for request in list(engine.requests.values()):
                seen = steps_seen[request.request_id] = steps_seen.get(request.request_id, 0) + 1
                if marked(request.prompt_token_ids, SLOW_STEP):
                    time.sleep(0.02)
                if marked(request.prompt_token_ids, HANG_STEP) and seen == 1:
                    time.sleep(HANG_S)
                if marked(request.prompt_token_ids, FAIL_STEP) and seen == 2:
                    raise RuntimeError("injected failure")
            return real_step()

        def add_request(*args, prompt_token_ids=None, **kwargs):
            if prompt_token_ids is not None and marked(prompt_token_ids, FAIL_ADD):
                raise TypeError("injected add failure")
            return real_add(*args, prompt_token_ids=prompt_token_ids, **kwargs)

        engine.step, engine.add_request = step, add_request
        return engine


def scripted_app(**kwargs):
    """The app the tests serve: tiny behind ScriptedSpec, the test limits unless kwargs say otherwise."""
    from ioattn.server.app import create_app
    from ioattn.server.security import ServerLimits

    limits = kwargs.pop("limits", ServerLimits(max_queued_requests=MAX_QUEUED_REQUESTS, max_prompts=MAX_PROMPTS))
    return create_app(ScriptedSpec(MODEL, engine_config(), log_level="warning"), served_model_name=MODEL,
                      limits=limits, **kwargs)


class LiveServer:
    def __init__(self, app):
        self.app = app
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, backlog=4096)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.uvicorn.serve(sockets=[self.socket])),
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=60)
        self.socket.close()

    @property
    def server(self):
        return self.app.state.server

    @property
    def client(self):
        return self.server.client

    def engine_stats(self, check_invariants: bool = False) -> dict:
        """The engine process's `stats()` (with what its scheduler holds), asked over the transport."""
        future = asyncio.run_coroutine_threadsafe(self.client.stats(check_invariants), self.client.loop)
        return future.result(timeout=60)

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Until the server holds no request and the engine none; returns the engine's stats then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = None if self.client.num_unfinished else self.engine_stats()
            if stats is not None and stats["unfinished_requests"] == 0:
                return stats
            assert time.monotonic() < deadline, "requests still unfinished"
            time.sleep(0.05)


def assert_engine_empty(stats: dict) -> None:
    """No request, sequence or used block is left in the engine; every block is free or cached."""
    kv = stats["kv"]
    assert stats["unfinished_requests"] == 0, stats
    assert kv["blocks_used"] == 0 and kv["sequences_running"] == 0 and kv["sequences_swapped"] == 0, kv
    assert kv["blocks_free"] + kv["blocks_cached"] == kv["num_blocks"], kv
    assert stats["scheduler"] == {"running": 0, "waiting": 0, "swapped": 0}, stats["scheduler"]
