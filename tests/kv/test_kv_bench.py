"""`ioattn bench kv` at a toy size: it runs end to end, writes its JSON, and its simulators are consistent."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from ioattn.bench import kv as bench_kv


def test_bench_kv_small(tmp_path, capsys):
    out = tmp_path / "kv.json"
    args = ["--requests", "40", "--num-blocks", "300", "--max-lens", "2048,1024", "--shared-max-len", "4096",
            "--seconds", "0.05", "--json", str(out)]
    assert bench_kv.main(args) == 0
    assert "contiguous-max" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["disclosure"]["cpu"]
    rows = {(r["workload"], r["policy"], r["max_len"]): r for r in result["utilization"]}
    for workload in ("sharegpt", "uniform"):
        paged, oracle = rows[workload, "paged", None], rows[workload, "contiguous-oracle", None]
        worst = rows[workload, "contiguous-max", 1024]
        assert paged["utilization"] > oracle["utilization"] > worst["utilization"]
        assert paged["resident"] > worst["resident"] == 300 * 16 // 1024
        assert rows[workload, "contiguous-max", 2048]["resident"] == 300 * 16 // 2048
        by_max_len = [r for r in result["by_max_len"] if r["workload"] == workload]
        assert [r["max_len"] for r in by_max_len] == [1024, 2048]
        for row in by_max_len:  # paged's ratio is its occupancy times the bound, so never above it
            assert row["paged_vs_max"] == pytest.approx(paged["occupancy"] * row["bound_vs_max"])
        assert by_max_len[1]["paged_vs_max"] > by_max_len[0]["paged_vs_max"]
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


def test_max_lens_are_parsed_sorted_and_checked():
    assert bench_kv._max_lens("8192,2048,4096,2048") == (2048, 4096, 8192)
    for bad in ("2048,x", "1,2048"):
        with pytest.raises(argparse.ArgumentTypeError, match="--max-lens"):
            bench_kv._max_lens(bad)
