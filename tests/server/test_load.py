"""Many concurrent streams over loopback, clients that disconnect, and /metrics that moves with them."""

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import MODEL, SLOW_STEP, assert_engine_empty

NUM_STREAMS = 500
NUM_DISCONNECTS = 100
LONG = 400  # tokens the disconnecting clients ask for: far more than they wait for


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (with labels folded in as name{k=v})."""
    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            key = sample.name + (f"{{{labels}}}" if labels else "")
            if "le" not in sample.labels:
                samples[key] = sample.value
    return samples


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def _load(url: str) -> tuple[list[str], list[int]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:

        async def complete(i: int) -> str:
            stream = await client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=4, stream=True,
                                                     temperature=0, extra_body={"ignore_eos": True})
            reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
            return reasons[-1]

        async def disconnect(i: int) -> int:
            stream = await client.completions.create(model=MODEL, prompt=f"leaving {i}", max_tokens=LONG,
                                                     stream=True, extra_body={"ignore_eos": True})
            chunks = 0
            async for _ in stream:
                chunks += 1
                break
            await stream.close()
            return chunks

        # The leavers go first, so they are mid-stream while the others still run.
        leavers = [asyncio.create_task(disconnect(i)) for i in range(NUM_DISCONNECTS)]
        finishers = [asyncio.create_task(complete(i)) for i in range(NUM_STREAMS)]
        return await asyncio.gather(*finishers), await asyncio.gather(*leavers)


def test_concurrent_streams_and_disconnects(live_server):
    before = scrape(live_server.url)
    start = time.monotonic()
    reasons, chunks = asyncio.run(asyncio.wait_for(_load(live_server.url), timeout=240))
    assert reasons == ["length"] * NUM_STREAMS
    assert chunks == [1] * NUM_DISCONNECTS
    assert_engine_empty(live_server.wait_idle())
    after = scrape(live_server.url)
    assert delta(after, before, 'ioattn_request_finished_total{finish_reason=length}') == NUM_STREAMS
    # Every leaver was aborted mid-stream, none ran to its LONG tokens.
    assert delta(after, before, 'ioattn_request_finished_total{finish_reason=abort}') == NUM_DISCONNECTS
    generated = delta(after, before, "ioattn_generation_tokens_total")
    assert 4 * NUM_STREAMS <= generated < 4 * NUM_STREAMS + NUM_DISCONNECTS * LONG // 4
    assert after["ioattn_num_requests_running"] == after["ioattn_num_requests_waiting"] == 0
    assert after["ioattn_kv_cache_blocks_used"] == 0 and after["ioattn_kv_cache_usage_perc"] == 0
    print(f"{NUM_STREAMS} streams + {NUM_DISCONNECTS} disconnects in {time.monotonic() - start:.1f} s")


def test_non_streaming_client_timeout_aborts(live_server):
    """A client that gives up on a non-streaming request (the server gets no cancel, only a closed socket)."""
    before = scrape(live_server.url)
    # SLOW_STEP: each step takes 20 ms more, so the request cannot finish before the client's timeout, however
    # fast the device.
    body = dict(model=MODEL, prompt=SLOW_STEP + "patience", max_tokens=LONG, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    assert_engine_empty(live_server.wait_idle())
    after = scrape(live_server.url)
    assert delta(after, before, "ioattn_request_finished_total{finish_reason=abort}") == 1
    assert delta(after, before, "ioattn_generation_tokens_total") < LONG


def test_metrics_parse_and_move(live_server, client):
    before = scrape(live_server.url)
    out = client.completions.create(model=MODEL, prompt="Count me", max_tokens=5, n=2, extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL, prompt="Count me", max_tokens=5)  # same prompt: a prefix-cache lookup
    live_server.wait_idle()
    after = scrape(live_server.url)
    assert delta(after, before, "ioattn_generation_tokens_total") >= out.usage.completion_tokens + 1
    assert delta(after, before, "ioattn_prompt_tokens_total") == 2 * out.usage.prompt_tokens
    assert delta(after, before, "ioattn_prefix_cache_queries_total") > 0
    # Two requests of 5 tokens: at least 5 steps, their time measured, the device wait a part of it.
    assert delta(after, before, "ioattn_engine_steps_total") >= 5
    step_seconds = delta(after, before, "ioattn_engine_step_seconds_total")
    assert 0 < step_seconds and 0 <= delta(after, before, "ioattn_engine_device_wait_seconds_total") <= step_seconds
    for histogram in ("ioattn_time_to_first_token_seconds", "ioattn_e2e_request_latency_seconds"):
        assert delta(after, before, histogram + "_count") == 2
        assert delta(after, before, histogram + "_sum") > 0
    assert delta(after, before, "ioattn_time_per_output_token_seconds_count") >= 2
    for gauge in ("ioattn_num_requests_swapped", "ioattn_kv_cache_blocks_total", "ioattn_prefix_cache_hit_rate",
                  "ioattn_num_preemptions_total"):
        assert gauge in after
    assert after["ioattn_kv_cache_blocks_total"] == live_server.engine_stats()["kv"]["num_blocks"]
