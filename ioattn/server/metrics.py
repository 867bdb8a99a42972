"""Prometheus metrics of one server: engine state, and per-request latencies.

Gauges are set from the state the engine process sends after its steps (at most every 50 ms while busy, and
once it is idle), so /metrics never waits for a step; counters move by the difference from the engine's
cumulative counters; histograms observe each finished request's TTFT, TPOT and end-to-end latency from the
engine's timings (arrival = when the HTTP process received the request, so time queued in the server counts).
Each app has its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ioattn.engine.outputs import RequestOutput
from ioattn.server.transport import EngineInfo, EngineState

# Seconds; chosen to resolve both a CPU test model (seconds) and a GPU server (milliseconds).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
# The engine's cumulative counters before its first state (and after a restart): the counters move by differences.
_ZERO_STATE = EngineState(requests_running=0, requests_waiting=0, requests_swapped=0, blocks_used=0, num_blocks=1,
                          prefix_query_tokens=0, prefix_hit_tokens=0, preemptions=0)


class ServerMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests_running = Gauge("ioattn_num_requests_running", "Requests with sequences in the running batch",
                                      registry=registry)
        self.requests_waiting = Gauge("ioattn_num_requests_waiting", "Requests queued for admission (or preempted "
                                      "by recompute), including those not yet handed to the engine", registry=registry)
        self.requests_swapped = Gauge("ioattn_num_requests_swapped", "Requests preempted to CPU blocks",
                                      registry=registry)
        self.kv_usage = Gauge("ioattn_kv_cache_usage_perc", "Used KV blocks, percent of the pool", registry=registry)
        self.kv_blocks_used = Gauge("ioattn_kv_cache_blocks_used", "KV blocks held by sequences", registry=registry)
        self.kv_blocks_total = Gauge("ioattn_kv_cache_blocks_total", "KV blocks in the pool", registry=registry)
        self.kv_tokens_total = Gauge("ioattn_kv_cache_tokens_total", "Token slots in the KV pool (blocks x block "
                                     "size)", registry=registry)
        self.kv_cache_info = Gauge("ioattn_kv_cache_info", "The KV cache's element type and, for fp8, where its "
                                   "scales came from and the rotation its K and V are stored in (1 for the "
                                   "engine's)", ["cache_dtype", "kv_scales", "kv_rotation"], registry=registry)
        self.prefix_hit_rate = Gauge("ioattn_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache, "
                                     "fraction of those looked up since start", registry=registry)
        self.prefix_queries = Counter("ioattn_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=registry)
        self.prefix_hits = Counter("ioattn_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=registry)
        self.preemptions = Counter("ioattn_num_preemptions", "Sequences preempted (recompute or swap)",
                                   registry=registry)
        self.engine_steps = Counter("ioattn_engine_steps", "Engine steps run", registry=registry)
        self.engine_step_seconds = Counter("ioattn_engine_step_seconds", "Wall time inside engine steps",
                                           registry=registry)
        self.engine_device_wait_seconds = Counter(
            "ioattn_engine_device_wait_seconds", "Part of the engine steps' time spent waiting for the device's "
            "sampled tokens to reach the host",
            registry=registry)
        self.prompt_tokens = Counter("ioattn_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter("ioattn_generation_tokens", "Tokens generated", registry=registry)
        self.requests_finished = Counter(
            "ioattn_request_finished", "Requests finished, by reason of their first sample (stop, length; abort: "
            "cancelled or disconnected clients; error: a failed engine step)", ["finish_reason"], registry=registry)
        self.ttft = Histogram("ioattn_time_to_first_token_seconds", "Arrival to first token", registry=registry,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram("ioattn_time_per_output_token_seconds", "Mean gap between a request's output tokens "
                              "after the first", registry=registry, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("ioattn_e2e_request_latency_seconds", "Arrival to last token", registry=registry,
                             buckets=E2E_BUCKETS)
        self._last = _ZERO_STATE

    def update_engine(self, state: EngineState, num_not_admitted: int) -> None:
        """The engine's state as the engine process last sent it (after a step), and requests it has not taken."""
        self.requests_running.set(state.requests_running)
        self.requests_waiting.set(state.requests_waiting + num_not_admitted)
        self.requests_swapped.set(state.requests_swapped)
        self.kv_usage.set(100.0 * state.blocks_used / state.num_blocks)
        self.kv_blocks_used.set(state.blocks_used)
        self.kv_blocks_total.set(state.num_blocks)
        queried, hits, last = state.prefix_query_tokens, state.prefix_hit_tokens, self._last
        self.prefix_hit_rate.set(hits / queried if queried else 0.0)
        self.prefix_queries.inc(queried - last.prefix_query_tokens)
        self.prefix_hits.inc(hits - last.prefix_hit_tokens)
        self.preemptions.inc(state.preemptions - last.preemptions)
        self.engine_steps.inc(state.steps - last.steps)
        self.engine_step_seconds.inc(state.step_seconds - last.step_seconds)
        self.engine_device_wait_seconds.inc(state.device_wait_seconds - last.device_wait_seconds)
        self._last = state

    def engine_ready(self, info: EngineInfo) -> None:
        """What the engine process loaded: its KV cache's capacity and format."""
        self.kv_tokens_total.set(info.kv_tokens)
        self.kv_cache_info.clear()
        self.kv_cache_info.labels(cache_dtype=info.cache_dtype or "", kv_scales=info.kv_scales or "",
                                  kv_rotation=info.kv_rotation or "").set(1)

    def engine_restarted(self) -> None:
        """A new engine process counts from zero again."""
        self._last = _ZERO_STATE

    def request_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def tokens_generated(self, count: int) -> None:
        self.generation_tokens.inc(count)

    def request_finished(self, output: RequestOutput) -> None:
        metrics = output.metrics
        reason = output.outputs[0].finish_reason if output.outputs else "error"
        self.requests_finished.labels(finish_reason=reason or "unknown").inc()
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        for completion in output.outputs:
            tpot = metrics.time_per_output_token(len(completion.token_ids))
            if tpot is not None:
                self.tpot.observe(tpot)

    def request_aborted(self) -> None:
        self.requests_finished.labels(finish_reason="abort").inc()

    def request_failed(self) -> None:
        self.requests_finished.labels(finish_reason="error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
