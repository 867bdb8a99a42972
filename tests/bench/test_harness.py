"""The benchmark harness on CPU: FLOP counting, tables, JSON, statuses, the command-line helpers, and
`ioattn bench prefill` / `decode` end to end.

Nothing here times anything against a threshold: the timings only have to exist and be positive.
"""

import argparse
import json
import math
import time
import warnings

import pytest
import torch

from ioattn.bench import harness, prefill
from ioattn.bench.harness import Row
from ioattn.reference import TOLERANCE

SMALL = ["--dims", "32", "--seqlens", "32,64", "--tokens", "128", "--model-dim", "64", "--warmup-ms", "0",
         "--rep-ms", "1"]


def test_attention_flops_follow_the_flash_attention_convention():
    forward = 4 * 2 * 8 * 1024 * 1024 * 64
    assert harness.attention_flops(2, 8, 1024, 1024, 64, causal=False) == forward
    assert harness.attention_flops(2, 8, 1024, 1024, 64, causal=True) == forward / 2
    # not halved when Nq != Nk (as flash-attn's benchmarks)
    assert harness.attention_flops(2, 8, 512, 1024, 64, causal=True) == forward / 2
    assert harness.attention_flops(2, 8, 1024, 1024, 64, causal=False, pass_="backward") == 2.5 * forward
    assert harness.attention_flops(2, 8, 1024, 1024, 64, causal=True, pass_="forward+backward") == 3.5 * forward / 2
    with pytest.raises(ValueError, match="pass_"):
        harness.attention_flops(1, 1, 1, 1, 1, causal=False, pass_="sideways")
    assert harness.tflops(2e12, 1000.0) == pytest.approx(2.0)


def test_cases_of_the_default_sweep():
    d = prefill._defaults(cuda=True, quick=False, backward=False)
    cases = prefill.build_cases(
        d["dims"], d["seqlens"], [False, True], d["dtypes"], d["gqa"], d["tokens"], d["model_dim"]
    )
    assert len(cases) == 3 * 6 * 2 + 6 * 2  # MHA at D 64/128/256, GQA 4:1 at D 128
    assert all(c.batch * c.seqlen == 16384 and c.heads_q * c.head_dim == 2048 for c in cases)
    assert {c.head_dim for c in cases if c.group == 4} == {128}
    first_gqa = next(i for i, c in enumerate(cases) if c.group > 1)
    assert all(c.group == 1 for c in cases[:first_gqa])  # a time budget cuts GQA before the bar's rows
    assert {c.seqlen for c in cases} == {512, 1024, 2048, 4096, 8192, 16384}


def _rows():
    case = {"N": 1024, "D": 64}
    return [
        Row(case=case, backend="ours", used="kernel A", ms=1.0, rate=300.0, ceiling_pct=40.0, peak_mib=12.5, error=3e-3,
            extra={"fwd_tflops": 250.0}),
        Row(case=case, backend="peer", used="x|y", ms=2.0, rate=150.0, ceiling_pct=20.0, peak_mib=None, error=1e-3),
        Row(case=case, backend="refuser", status="unsupported: no kernel for D=64"),
    ]


def test_rows_table_shows_numbers_statuses_and_extra_columns():
    table = harness.rows_table(_rows(), [("N", "N"), ("D", "D")], "TFLOP/s", [("fwd TFLOP/s", "fwd_tflops")])
    lines = table.splitlines()
    assert lines[0] == "| N | D | backend | used | ms | TFLOP/s | % ceiling | peak MiB | error | fwd TFLOP/s |"
    assert len(lines) == 2 + 3 and all(line.count(" | ") == lines[0].count(" | ") for line in lines[2:])
    assert "| 1024 | 64 | ours | kernel A | 1 | 300 | 40 | 12.5 | 3.00e-03 | 250 |" in table
    assert "x\\|y" in table  # a pipe in a cell cannot break the table
    assert "| refuser | unsupported: no kernel for D=64 | — |" in table


def test_ratio_table_divides_our_rate_by_each_peer():
    table = harness.ratio_table(_rows(), [("N", "N")], "ours", ["peer", "refuser"])
    assert table.splitlines()[0] == "| N | ours / peer | ours / refuser |"
    assert "| 1024 | 2.00× | — |" in table


def test_json_round_trip(tmp_path):
    meta = {"disclosure": harness.collect_disclosure("cpu", "ioattn bench test"), "settings": {"mode": "forward"}}
    path = tmp_path / "sub" / "run.json"
    harness.write_json(path, meta, _rows())
    meta_back, rows_back = harness.read_json(path)
    assert rows_back == _rows()
    assert meta_back == json.loads(json.dumps(meta))
    assert meta_back["disclosure"]["torch"] == torch.__version__ and meta_back["disclosure"]["gpu"] == "none"


def test_disclosure_paths_and_tags():
    disclosure = harness.collect_disclosure("cpu", "cmd")
    for key in ("torch", "triton", "python", "cpu", "date_utc", "command", "timing"):
        assert disclosure[key]
    assert harness.device_tag(disclosure) == "cpu"
    assert harness.device_tag({"gpu": "NVIDIA H200"}) == "h200"
    paths = harness.dated_paths("out", "prefill", "h200")
    assert paths["json"].name.endswith("-prefill-h200.json") and paths["png"].suffix == ".png"
    assert "bf16" in harness.disclosure_markdown({"settings": {"dtypes": "bf16"}})
    with pytest.raises(ValueError, match="dtype must be one of"):
        harness.parse_dtype("int8")


def test_cpu_timing_memory_and_ceilings():
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        assert x.grad is None  # grad_to_none clears it before every repetition
        (x * 2).sum().backward()

    timing = harness.time_ms(step, "cpu", warmup_ms=0, rep_ms=1, grad_to_none=[x])
    assert timing.ms > 0 and timing.reps >= 3
    assert harness.peak_memory_mib(lambda: x * 2, "cpu") is None
    ceilings = harness.measure_ceilings("cpu", [torch.float32])
    assert ceilings["matmul_tflops"]["float32"] > 0 and ceilings["copy_tbps"] is None


def _raiser(exc):
    def work():
        raise exc

    return work


def test_guarded_turns_refusals_into_statuses():
    def refuse_with_warning():
        warnings.warn("Flash attention does not support this head dim")
        raise RuntimeError("No available kernel. Aborting execution.")

    def ours_breaks():
        raise RuntimeError("boom")

    assert harness.guarded(lambda: None, ours=True) == "ok"
    assert harness.guarded(_raiser(harness.Skip("skipped: memory")), ours=False) == "skipped: memory"
    status = harness.guarded(refuse_with_warning, ours=False)
    assert status.startswith("unsupported: RuntimeError: No available kernel") and "head dim" in status
    assert harness.guarded(ours_breaks, ours=True) == "failed: RuntimeError: boom"
    assert harness.guarded(_raiser(NotImplementedError("later")), ours=True) == "unsupported: later"
    assert harness.guarded(_raiser(torch.OutOfMemoryError("oom")), ours=False) == "skipped: out of memory"


def test_plot_writes_a_png(tmp_path):
    from ioattn.bench.plot import plot_rates

    rows = [Row(case={"N": n, "D": 64}, backend=b, rate=float(n) / s, status="ok")
            for n in (512, 1024) for b, s in (("ours", 10), ("peer", 20))]
    rows.append(Row(case={"N": 2048, "D": 64}, backend="peer", status="unsupported: x"))
    path = tmp_path / "plot.png"
    plot_rates(rows, path, x_key="N", facet_keys=["D"], ylabel="TFLOP/s", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _stand_in_api():
    """SDPA math in ioattn's flash-attn layout, so the benchmark is tested whatever state the kernels are in."""

    def flash_attn_func(q, k, v, causal=False, backend="auto"):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)

    return flash_attn_func, lambda q, k, v, **kwargs: "stand-in: SDPA math"


@pytest.mark.parametrize("backward", [False, True])
def test_prefill_runs_end_to_end_with_a_stand_in(tmp_path, monkeypatch, backward):
    monkeypatch.setattr(prefill, "_ioattn_api", _stand_in_api)
    argv = SMALL + ["--gqa", "1,2", "--out", str(tmp_path)] + (["--backward"] if backward else ["--rounds", "2"])
    assert prefill.main(argv) == 0
    (json_path,) = tmp_path.glob("*-prefill*-cpu.json")
    meta, rows = harness.read_json(json_path)
    assert meta["settings"]["mode"] == ("backward" if backward else "forward")
    assert len(rows) == 2 * 2 * 2 * 3  # N × causal × GQA × backends
    assert all(r.status == "ok" and r.ms > 0 and r.rate > 0 for r in rows), [r.status for r in rows if r.status != "ok"]
    assert all(r.error < TOLERANCE[torch.float32] for r in rows)
    if backward:
        assert all({"error_dq", "error_dk", "error_dv", "fwd_bwd_tflops"} <= r.extra.keys() for r in rows)
    else:  # two timing rounds, the backends taking turns: the row reports their median
        assert all(len(r.extra["round_ms"]) == 2 and r.ms == pytest.approx(sum(r.extra["round_ms"]) / 2) for r in rows)
        assert meta["settings"]["rounds"].startswith("2,")
    report = json_path.with_suffix(".md").read_text()
    assert "## ioattn / peer" in report and "stand-in: SDPA math" in report
    assert json_path.with_suffix(".png").exists()
    from ioattn.bench import plot

    assert plot.main([str(json_path), str(tmp_path / "redrawn.png")]) == 0  # the PNG can be drawn from the JSON
    assert (tmp_path / "redrawn.png").stat().st_size > 0


def test_prefill_report_checks_the_forward_bars():
    def row(backend, rate, n=4096, d=128, causal=False, status="ok"):
        case = dict(dtype="bfloat16", B=1, Hq=16, Hkv=16, N=n, D=d, causal=causal)
        return Row(case=case, backend=backend, rate=rate if status == "ok" else None, status=status)

    rows = [row("ioattn", 600), row("torch-cudnn", 580), row("ioattn-fp8", 1000),  # both bars met
            row("ioattn", 500, causal=True), row("torch-cudnn", 550, causal=True), row("ioattn-fp8", 700, causal=True),
            row("ioattn", 400, n=2048), row("torch-cudnn", 390, n=2048), row("ioattn-fp8", 400, n=2048),  # N < 4k
            row("ioattn", 300, d=64), row("torch-cudnn", 200, d=64, status="failed: x")]  # no cuDNN rate
    cudnn, fp8 = prefill.bar_lines(rows)
    assert cudnn == ("Bar: ioattn / torch-cudnn ≥ 1.0× (every row): 2 of 3 rows, missed on 1: "
                     "D128 N4096 H16/16 causal 0.91×.")
    assert fp8.startswith("Bar: ioattn-fp8 / ioattn ≥ 1.6× (D 128, N ≥ 4096): 1 of 2 rows, missed on 1: D128 N4096")
    assert prefill.bar_lines([row("ioattn", 1.0)]) == []


def test_backward_rows_of_a_case_share_one_timing_method():
    def row(backend, alone_ms, by_difference_ms):
        extra = {"fwd_bwd_minus_fwd_ms": by_difference_ms}
        if alone_ms is None:
            extra.update(backward_timing=prefill.BACKWARD_BY_DIFFERENCE, backward_alone_refused="RuntimeError: x")
        else:
            extra.update(backward_timing=prefill.BACKWARD_ALONE, backward_alone_ms=alone_ms)
        ms = by_difference_ms if alone_ms is None else alone_ms
        return Row(case={"dtype": "bfloat16"}, backend=backend, ms=ms, rate=harness.tflops(2e12, ms), extra=extra)

    ceilings = {"matmul_tflops": {"bfloat16": 800.0}}
    every_one_alone = [row("ioattn", 1.0, 1.1), row("peer", 2.0, 2.1)]
    prefill.uniform_backward_timing(every_one_alone, ceilings)
    assert [r.ms for r in every_one_alone] == [1.0, 2.0]
    one_refuses = [row("ioattn", 1.0, 1.1), row("flex", None, 2.1), Row(case={}, backend="naive", status="skipped: x")]
    prefill.uniform_backward_timing(one_refuses, ceilings)
    assert [r.ms for r in one_refuses[:2]] == [1.1, 2.1] and one_refuses[0].extra["backward_alone_ms"] == 1.0
    assert one_refuses[0].rate == pytest.approx(harness.tflops(2e12, 1.1))
    assert one_refuses[0].ceiling_pct == pytest.approx(100 * one_refuses[0].rate / 800.0)
    assert all("flex refused a second backward" in r.extra["backward_timing"] for r in one_refuses[:2])
    assert one_refuses[2].ms is None


def test_prefill_reports_an_unsupported_backward_and_goes_on(tmp_path, monkeypatch):
    def api():
        forward, explain = _stand_in_api()

        class NoBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                return forward(q, k, v)

            @staticmethod
            def backward(ctx, grad):
                raise NotImplementedError("ioattn backward lands with issue 3")

        return (lambda q, k, v, **kw: NoBackward.apply(q, k, v)), explain

    monkeypatch.setattr(prefill, "_ioattn_api", api)
    json_path = tmp_path / "run.json"
    assert prefill.main(SMALL + ["--backward", "--causal", "yes", "--json", str(json_path)]) == 0
    _, rows = harness.read_json(json_path)
    ours = [r for r in rows if r.backend == "ioattn"]
    assert ours and all(r.status == "unsupported: ioattn backward lands with issue 3" and r.ms is None for r in ours)
    assert all(r.status == "ok" for r in rows if r.backend != "ioattn")


def test_decode_runs_end_to_end_on_cpu(tmp_path):
    from ioattn.bench import decode

    argv = ["--quick", "--batches", "1", "--seqlens", "64", "--heads", "2/1", "--backends", "ioattn-paged",
            "--out", str(tmp_path)]
    assert decode.main(argv) == 0
    (json_path,) = tmp_path.glob("*-decode-cpu.json")
    _, rows = harness.read_json(json_path)
    assert rows and all(r.status == "ok" and r.ms > 0 and r.error < TOLERANCE[torch.float32] for r in rows)
    assert json_path.with_suffix(".md").exists()


def test_prefill_rejects_unknown_backends():
    with pytest.raises(SystemExit):
        prefill.parse_args(["--backends", "ioattn,cudnn-9000"])


def _ioattn_importable() -> bool:
    try:
        import ioattn

        ioattn.flash_attn_func  # noqa: B018
        return True
    except (ImportError, AttributeError):
        return False


@pytest.mark.skipif(not _ioattn_importable(), reason="ioattn.flash_attn_func is not importable yet")
def test_bench_prefill_quick_runs_on_cpu_through_the_torch_backend(tmp_path):
    from ioattn.cli import main

    json_path = tmp_path / "quick.json"
    assert main(["bench", "prefill", "--quick", "--json", str(json_path)]) == 0
    _, rows = harness.read_json(json_path)
    ours = [r for r in rows if r.backend == "ioattn"]
    assert ours and all(r.status == "ok" and r.error < TOLERANCE[torch.float32] for r in ours)
    assert all("torch" in r.used for r in ours)  # auto picks the exact tiled torch path for CPU tensors


def test_bench_prefill_fp8_backends_on_cpu(tmp_path):
    # The FP8 forward's two rows (e4m3 inputs with descales; quantized in the call) on the interpreter: measured,
    # with the error against float64 on the original bf16 inputs; the backward is refused by name.
    json_path = tmp_path / "fp8.json"
    argv = ["--dims", "64", "--seqlens", "64", "--tokens", "64", "--model-dim", "128", "--gqa", "1", "--causal",
            "yes", "--dtype", "bfloat16", "--backends", "ioattn-fp8,ioattn-fp8-quant", "--warmup-ms", "0",
            "--rep-ms", "1", "--json", str(json_path)]
    assert prefill.main(argv) == 0
    _, rows = harness.read_json(json_path)
    assert {r.backend for r in rows} == {"ioattn-fp8", "ioattn-fp8-quant"}
    assert all(r.status == "ok" and 0 < r.error < 8e-2 for r in rows)
    assert all(r.ceiling_pct is None for r in rows)  # the CPU has no e4m3 matmul ceiling: no share is made up
    assert prefill.main(argv[:-2] + ["--backward", "--json", str(json_path)]) == 0
    _, rows = harness.read_json(json_path)
    assert all("no backward" in r.status for r in rows)


@pytest.mark.gpu
def test_fp8_matmul_ceiling_on_the_gpu():
    ceilings = harness.measure_ceilings("cuda", [torch.bfloat16], fp8=True)
    rates = ceilings["matmul_tflops"]
    if torch.cuda.get_device_capability() >= (8, 9):  # measured beside bf16, not compared with it here
        assert math.isfinite(rates["float8_e4m3fn"]) and rates["float8_e4m3fn"] > 0
    else:
        assert "float8_e4m3fn" not in rates


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True])
def test_bench_prefill_on_the_gpu_with_every_peer(tmp_path, backward):
    """One small case per mask through every CUDA peer: the do_bench / peak-memory / FlexAttention paths."""
    json_path = tmp_path / "gpu.json"
    argv = ["--dims", "64", "--seqlens", "256", "--tokens", "512", "--model-dim", "256", "--gqa", "1,2",
            "--rep-ms", "5", "--warmup-ms", "1", "--json", str(json_path)] + (["--backward"] if backward else [])
    assert prefill.main(argv) == 0
    meta, rows = harness.read_json(json_path)
    assert meta["ceilings"]["matmul_tflops"]["bfloat16"] > 50 and meta["ceilings"]["copy_tbps"] > 0.5
    assert {r.backend for r in rows} == set(prefill.DEFAULT_BACKENDS["cuda"])
    for row in rows:
        must_run = row.backend in ("flex", "naive") or (row.backend == "ioattn" and not backward)
        if must_run or (row.backend == "torch-flash" and row.case["Hq"] == row.case["Hkv"]):
            assert row.status == "ok", (row.backend, row.case, row.status)
        if row.status == "ok":
            assert row.ms > 0 and row.peak_mib > 0 and row.error < TOLERANCE[torch.bfloat16]
        else:
            assert row.status.startswith(("unsupported: ", "skipped: ")), row.status
    if backward:
        assert {e["backend"] for e in meta["memory_growth"]} == set(prefill.DEFAULT_BACKENDS["cuda"])


def test_command_line_helpers(tmp_path, capsys):
    assert harness.int_list("1, 8,,64") == [1, 8, 64]
    assert harness.name_list(("a", "b"))("b,a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown backends \['c'\]"):
        harness.name_list(("a", "b"))("a,c")

    class Case:
        def __init__(self, n):
            self.n = n

        def label(self):
            return f"N{self.n}"

    meta = {"settings": {}, "disclosure": {"gpu": "none", "cpu": "x"}}
    assert not harness.budget_spent(time.monotonic(), 60.0, meta, [Case(1)])
    assert harness.budget_spent(time.monotonic() - 2.0, 1.0, meta, [Case(1), Case(2)])
    assert meta["settings"]["not_run"] == ["N1", "N2"] and "2 cases not run" in capsys.readouterr().out

    def run_case(case):
        yield Row(case={"N": case.n}, backend="ours", ms=float(case.n))
        yield Row(case={"N": case.n}, backend="peer", status="unsupported: x")

    swept = harness.sweep([Case(1), Case(2)], run_case, lambda row: f"{row.ms:.0f} ms", started=time.monotonic(),
                          budget_s=60.0, meta=meta, device="cpu")
    assert [(row.case["N"], row.backend) for row in swept] == [(1, "ours"), (1, "peer"), (2, "ours"), (2, "peer")]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("[1/2] N1") and printed[0].endswith("1 ms") and printed[1].endswith("unsupported: x")
    assert harness.sweep([Case(3)], run_case, str, started=time.monotonic() - 2.0, budget_s=1.0, meta=meta,
                         device="cpu") == []
    assert meta["settings"]["not_run"] == ["N3"]

    rows = [Row(case={"N": 1}, backend="b", used="u", ms=1.0, rate=2.0)]
    parser = argparse.ArgumentParser()
    harness.add_run_args(parser, budget_s=5.0, out_help="directory")
    args = parser.parse_args(["--out", str(tmp_path), "--md", str(tmp_path / "explicit.md")])
    assert args.budget_s == 5.0 and harness.default_device(args.device) in ("cpu", "cuda")
    paths = harness.write_outputs(args, "probe", meta, rows, "# report\n")
    assert paths["md"] == str(tmp_path / "explicit.md") and (tmp_path / "explicit.md").read_text() == "# report\n"
    assert paths["json"].name.endswith("-probe-cpu.json") and paths["png"].suffix == ".png"
    assert harness.read_json(paths["json"])[1] == rows and not paths["png"].exists()


def test_bench_prefill_quick_from_a_fresh_interpreter():
    """No earlier import of ioattn.kernels here (unlike this test session): the harness must not load triton
    before ioattn selects the CPU interpreter, or every ioattn row fails on a machine without CUDA."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ioattn.cli", "bench", "prefill", "--quick", "--backends", "ioattn"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert rows and all("failed" not in line and "unsupported" not in line for line in rows), result.stdout[-2000:]
