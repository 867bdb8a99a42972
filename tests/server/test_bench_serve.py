"""`ioattn bench serve` end to end on a tiny workload: it completes every request and reports every field
(the numbers themselves are not checked: unit tests never time anything)."""

import json

from ioattn.bench import serve, workload

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
    assert result["server"]["server_counters"]["generation_tokens_total"] == 18 + 4  # + the warm-up request
    assert result["server_over_offline"] > 0
    assert result["disclosure"]["command"].startswith("ioattn bench serve")
