"""`ioattn bench serve` end to end on a tiny workload: it completes every request and reports every field (the
numbers themselves are not checked: unit tests never time anything); its datasets and flags."""

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from ioattn.bench import datasets, serve, serve_online, workload
from ioattn.models.tokenizer import ByteTokenizer

from server_helpers import MAX_MODEL_LEN


def test_percentile_nearest_rank():
    values = list(range(1, 101))
    assert workload.percentile(values, 50) == 50 and workload.percentile(values, 99) == 99
    assert workload.percentile(values, 100) == 100 and workload.percentile([3.0], 99) == 3.0
    assert workload.percentile([], 50) is None


def test_workload_is_reproducible_and_in_range():
    work = workload.make_workload(20, (5, 9), (2, 3), seed=4)
    assert work == workload.make_workload(20, (5, 9), (2, 3), seed=4)
    assert all(5 <= len(w.prompt_token_ids) <= 9 and 2 <= w.output_len <= 3 for w in work)
    assert all(0 <= t < workload.PROMPT_ID_RANGE for w in work for t in w.prompt_token_ids)


def test_bench_against_live_server_and_offline(live_server, tmp_path):
    out = tmp_path / "serve.json"
    argv = ["--url", live_server.url, "--offline", "--model", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-requests", "6", "--input-len", "4", "12", "--output-len", "3", "--concurrency", "4",
            "--decode-batch", "0", "--json", str(out)]
    assert serve.main(argv) == 0
    result = json.loads(out.read_text())
    for run in (result["server"], result["systems"]["ioattn"]):
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["output_tokens"] == 18
        for key in ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
            assert run[key] is not None and run[key] > 0
    assert "decode_step" not in result
    # Counted after the warm-up workload (one request per measured one, up to WARMUP_REQUESTS, WARMUP_OUTPUT_LEN
    # tokens each; the server's own total shows it ran): the measured requests alone.
    server = result["server"]
    assert server["server_counters"]["generation_tokens_total"] == 18
    total = serve_online.server_metrics(live_server.url)["ioattn_generation_tokens_total"]
    assert total >= 18 + 6 * workload.WARMUP_OUTPUT_LEN
    assert server["steps"] >= 3 and 0 < server["step_ms_mean"] and 0 <= server["step_token_wait_share"] <= 1
    offline = result["systems"]["ioattn"]
    assert offline["steps"] >= 3 and 0 < offline["step_time_share"] <= 1 and 0 <= offline["step_token_wait_share"] <= 1
    assert result["server_over_offline"] > 0
    assert result["disclosure"]["command"].startswith("ioattn bench serve")


def test_bench_client_records_refused_requests_and_streams_the_rest(live_server):
    # The streaming client (aiohttp): a request the server refuses is a failed result naming the status; accepted
    # ones stream to completion.
    work = workload.make_workload(3, (4, 6), (2, 2), seed=1)
    results, _ = asyncio.run(serve_online._drive(live_server.url, "no-such-model", work, float("inf"), None, 0.0, 0,
                                                 {}))
    assert all(not r.ok and r.error.startswith("HTTP 404") for r in results)
    results, _ = asyncio.run(serve_online._drive(live_server.url, "tiny", work, float("inf"), 2, 0.0, 0, {}))
    assert all(r.ok and r.output_tokens == 2 and r.ttft > 0 for r in results)


SHAREGPT = Path(__file__).parents[1] / "data" / "sharegpt_sample.json"


def test_sharegpt_sampling_follows_vllm():
    """Shuffled by the seed; the first two turns; the reply's token count as output length; pairs under 4 tokens
    on a side skipped (a one-turn entry too); too few left: some drawn again, and a note says so."""
    tokenizer = ByteTokenizer()
    work, notes = datasets.sharegpt_workload(str(SHAREGPT), 10, tokenizer, seed=3)
    assert len(work) == 10 and not notes
    assert work == datasets.sharegpt_workload(str(SHAREGPT), 10, tokenizer, seed=3)[0]
    assert work != datasets.sharegpt_workload(str(SHAREGPT), 10, tokenizer, seed=4)[0]
    entries = json.loads(SHAREGPT.read_text())
    replies = {e["conversations"][0]["value"]: e["conversations"][1]["value"] for e in entries
               if len(e["conversations"]) >= 2}
    for item in work:
        assert item.prompt_token_ids == tokenizer.encode(item.prompt)
        assert item.output_len == len(replies[item.prompt].encode()) >= datasets.SHAREGPT_MIN_TOKENS
    everything, notes = datasets.sharegpt_workload(str(SHAREGPT), 100, tokenizer, seed=3, output_len=5)
    valid = {item.prompt for item in everything}
    assert len(everything) == 100 and notes and "drawn again" in notes[0]
    assert "hi" not in valid and "Please say ok." in valid  # a fixed output length skips the reply's check
    assert "A question nobody answered." not in valid and all(item.output_len == 5 for item in everything)


def test_random_and_sonnet_like_lengths():
    args = argparse.Namespace(num_requests=50, input_len=[1, 2], output_len=[1, 1], seed=0, random_input_len=100,
                              random_output_len=10, random_range_ratio=0.5)
    work = datasets.random_workload(args)
    assert all(50 <= len(w.prompt_token_ids) <= 150 and 5 <= w.output_len <= 15 for w in work)
    assert len({len(w.prompt_token_ids) for w in work}) > 10
    tokenizer = ByteTokenizer()
    work = datasets.sonnet_like_workload(8, 300, 120, 7, tokenizer, seed=1)
    prefix = min(len(w.prompt) for w in work)
    shared = work[0].prompt[:prefix]
    while not all(w.prompt.startswith(shared) for w in work):
        shared = shared[:-1]
    assert shared.startswith(datasets.SONNET_INSTRUCTION) and 80 <= len(tokenizer.encode(shared)) <= 120
    assert all(250 <= len(w.prompt_token_ids) <= 300 and w.output_len == 7 for w in work)
    assert len({w.prompt for w in work}) == 8


def test_rate_sweep_with_sharegpt_and_goodput(live_server, tmp_path):
    """Two request rates against the live server: one run each with vLLM's metric names, goodput, a markdown
    table and the latency-throughput PNG."""
    argv = ["--url", live_server.url, "--model", "tiny", "--dataset-name", "sharegpt", "--dataset-path",
            str(SHAREGPT), "--sharegpt-output-len", "3", "--num-prompts", "6", "--request-rate", "40,inf",
            "--goodput", "ttft:0.001", "tpot:60000", "--out", str(tmp_path)]
    assert serve.main(argv) == 0
    (result_file,) = tmp_path.glob("*-serve-sweep-tiny-cpu.json")
    result = json.loads(result_file.read_text())
    assert [run["request_rate"] for run in result["sweep"]] == [40.0, float("inf")]
    for run in result["sweep"]:
        assert run["completed"] == 6 and run["output_tokens"] == 18 and run["total_input_tokens"] > 6
        for stat in ("mean", "median", "std", "p99"):
            for metric in ("ttft", "tpot", "itl", "e2el"):
                assert run[f"{stat}_{metric}_ms"] is not None, (stat, metric)
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        assert run["request_goodput"] == 0  # no request has its first token within a microsecond
    markdown = result_file.with_suffix(".md").read_text()
    assert "median TTFT (ms)" in markdown
    assert "goodput: requests per second within ttft <= 0.001 ms, tpot <= 60000 ms" in markdown
    png = result_file.with_suffix(".png")
    assert png.stat().st_size > 10_000
    png.unlink()  # as written where matplotlib was missing: drawn later from the JSON
    assert serve.main(["--replot", str(result_file)]) == 0 and png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, words", [
    (["--launch", "--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--launch", "--dataset-path", "x.json"], "only with --dataset-name sharegpt"),
    (["--launch", "--random-input-len", "100", "--input-len", "1", "2"], "give one"),
    (["--launch", "--goodput", "ttft:fast"], "METRIC:MS"),
    (["--launch", "--goodput", "latency:5"], "METRIC:MS"),
    (["--launch", "--request-rate", "2,0"], "rate > 0"),
    (["--launch", "--offline", "--request-rate", "2,4"], "a run of its own"),
    (["--offline", "--request-rate", "2,4"], "give --url or --launch"),
    (["--launch", "--random-range-ratio", "1"], "[0, 1)"),
    (["--launch", "--num-prompts", "0"], "must be >= 1"),
])
def test_bench_serve_flags_are_checked(argv, words, capsys):
    with pytest.raises(SystemExit) as caught:
        serve.main(argv)
    assert caught.value.code == 2 and words in capsys.readouterr().err


def test_bench_serve_without_aiohttp_says_how_to_get_it(monkeypatch, capsys):
    real = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None if name == "aiohttp" else real(name))
    with pytest.raises(SystemExit):
        serve.main(["--url", "http://127.0.0.1:9", "--num-requests", "1"])
    assert "pip install 'ioattn[bench]'" in capsys.readouterr().err
