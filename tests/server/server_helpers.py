"""Server-test helpers: a real uvicorn server on a free loopback port, in a background thread."""

import asyncio
import socket
import threading
import time

import uvicorn

MODEL = "tiny"
MAX_MODEL_LEN = 512
MAX_QUEUED_REQUESTS = 1024


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
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()

    @property
    def server(self):
        return self.app.state.server

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine holds no request and the server none unfinished (reads only: the loop is parked)."""
        deadline = time.monotonic() + timeout
        while self.server.loop.num_unfinished or self.server.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "requests still unfinished"
            time.sleep(0.05)
