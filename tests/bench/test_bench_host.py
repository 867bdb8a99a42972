"""`ioattn bench host` on a CPU: it runs both schedulings and reports every field (never compared with a
threshold: unit tests do not time anything)."""

import json

import pytest

from ioattn.bench import host


@pytest.mark.parametrize("flags", [[], ["--async-scheduling", "off", "--output-kind", "final_only", "--logprobs", "2"]])
def test_host_bench_reports_each_batch(tmp_path, flags):
    out = tmp_path / "host.json"
    argv = ["--batch", "2", "5", "--prompt-len", "20", "--steps", "3", "--device", "cpu", "--json", str(out), *flags]
    assert host.main(argv) == 0
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [2, 5]
    for row in result["rows"]:
        assert row["steps_timed"] == 3 and row["host_us_per_step"] > 0 and row["model_time_subtracted"]
        assert row["host_us_per_seq"] == pytest.approx(row["host_us_per_step"] / row["batch"])
        assert row["overlapped_steps"] == (0 if flags else 3)
    assert result["disclosure"]["command"].startswith("ioattn bench host")
