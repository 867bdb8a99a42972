"""Fixtures: one `tiny` engine behind a real uvicorn server for the whole session, and an openai client.

Without the server's packages (fastapi, uvicorn, openai, prometheus-client, jinja2) these tests are not collected.
"""

import importlib.util

import pytest

SERVER_PACKAGES = ("fastapi", "uvicorn", "openai", "prometheus_client", "jinja2", "httpx")
if any(importlib.util.find_spec(name) is None for name in SERVER_PACKAGES):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def live_server():
    from ioattn.engine.llm_engine import LLMEngine
    from ioattn.server.app import create_app
    from server_helpers import MAX_MODEL_LEN, MAX_QUEUED_REQUESTS, MODEL, LiveServer

    engine = LLMEngine(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=256)
    app = create_app(engine, served_model_name=MODEL, max_queued_requests=MAX_QUEUED_REQUESTS)
    with LiveServer(app) as server:
        yield server


@pytest.fixture
def client(live_server):
    import openai

    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
