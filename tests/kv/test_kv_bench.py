"""`ioattn bench kv` at a toy size: it runs end to end, writes its JSON, and its simulators are consistent."""

from __future__ import annotations

import json
import random

from ioattn.bench import kv as bench_kv


def test_bench_kv_small(tmp_path, capsys):
    out = tmp_path / "kv.json"
    args = ["--requests", "40", "--num-blocks", "300", "--shared-max-len", "4096", "--seconds", "0.05",
            "--json", str(out)]
    assert bench_kv.main(args) == 0
    assert "contiguous-max" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["disclosure"]["cpu"]
    rows = {(r["workload"], r["policy"]): r for r in result["utilization"]}
    for workload in ("sharegpt", "uniform"):
        paged, worst = rows[workload, "paged"], rows[workload, "contiguous-max"]
        assert paged["utilization"] > rows[workload, "contiguous-oracle"]["utilization"] > worst["utilization"]
        assert paged["resident"] > worst["resident"]
    shared = result["shared_prefix"]
    assert 0 < shared["prefill_tokens_saved"] <= shared["ideal_tokens_saved"]


def test_first_fit_arena_merges_neighbours():
    arena = bench_kv.FirstFitArena(10)
    a, b, c = arena.reserve(3), arena.reserve(3), arena.reserve(3)
    assert (a, b, c) == (0, 3, 6) and arena.reserve(2) is None
    arena.release(a, 3)
    arena.release(c, 3)
    assert arena.reserve(4) == 6  # 6..9 merged with the tail; 0..2 too small
    arena.release(b, 3)
    assert (arena.starts, arena.lengths) == ([0], [6])


def test_contiguous_max_wastes_what_it_must():
    """Two requests of final length 10 in a 40-slot budget with 20-slot slabs: exact utilization by hand."""
    requests = [bench_kv.Request(rid, [1] * 5, 5) for rid in range(3)]
    result = bench_kv.simulate_contiguous(requests, 40, lambda r: 20)
    # Saturated steps: the first 5 (request 2 waits); tokens 2 * (6..10) over 40 reserved slots each step.
    assert result["saturated_steps"] == 5
    assert result["utilization"] == sum(2 * t for t in range(6, 11)) / (40 * 5)
    assert result["resident"] == 2


def test_workload_means_are_near_the_published_ones():
    requests = bench_kv.make_workload("sharegpt", 4000, 100_000, random.Random(0))
    mean_prompt = sum(len(r.prompt) for r in requests) / len(requests)
    mean_output = sum(r.output_len for r in requests) / len(requests)
    assert abs(mean_prompt / bench_kv.SHAREGPT_MEAN_PROMPT - 1) < 0.1
    assert abs(mean_output / bench_kv.SHAREGPT_MEAN_OUTPUT - 1) < 0.1
