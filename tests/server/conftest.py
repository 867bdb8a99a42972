"""Fixtures: one `tiny` engine process behind a real uvicorn server for the whole session, and an openai client.

Without the server's packages (fastapi, uvicorn, openai, prometheus-client, jinja2, pyzmq, msgspec) these tests
are not collected.
"""

import importlib.util

import pytest

SERVER_PACKAGES = ("fastapi", "uvicorn", "openai", "prometheus_client", "jinja2", "httpx", "zmq", "msgspec")
if any(importlib.util.find_spec(name) is None for name in SERVER_PACKAGES):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def live_server():
    from server_helpers import LiveServer, scripted_app

    with LiveServer(scripted_app()) as server:
        yield server


@pytest.fixture
def client(live_server):
    import openai

    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
