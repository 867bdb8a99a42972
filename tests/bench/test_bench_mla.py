"""`ioattn bench decode --mla` on the CPU: its rows and columns, the byte and FLOP counts, the bar verdicts."""

import json

import pytest

from ioattn.bench import decode, mla
from ioattn.bench.harness import Row


def test_quick_run_writes_every_row_and_column(tmp_path):
    assert decode.main(["--mla", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("*-decode-mla-cpu.json")).read_text())
    rows = result["rows"]
    assert {(r["case"]["B"], r["backend"]) for r in rows} == {(b, n) for b in (1, 2) for n in mla.BACKENDS}
    for row in rows:
        assert row["status"] == "ok", row
        assert row["error"] < 1e-5  # float32 on the CPU
        case = mla.Case(row["case"]["dtype"], row["case"]["B"], row["case"]["H"], row["case"]["L"])
        assert row["extra"]["bytes"] == case.bytes and row["extra"]["flops"] == case.flops
        assert row["rate"] == pytest.approx(case.bytes / (row["ms"] * 1e-3) / 1e9)
        assert row["extra"]["matmul_pct"] > 0 and row["ceiling_pct"] is None  # no copy ceiling on a CPU
    attempts = next(r for r in rows if r["backend"] == "torch-absorbed-sdpa")["extra"]["attempts"]
    assert len(attempts) == len(mla.SDPA_BACKENDS) * len(mla.SDPA_LAYOUTS)
    assert "µs" in attempts["MATH heads-as-queries"] and attempts["MATH gqa"].startswith("skipped")
    report = next(tmp_path.glob("*-decode-mla-cpu.md")).read_text()
    for column in ("µs", "GB/s", "% copy", "TFLOP/s", "% matmul", "error", "bar"):
        assert f"| {column} |" in report
    assert "Bar ≥ 85% of copy at 16 heads" in report and "Bar ≥ 60% of matmul at 128 heads" in report
    assert "SDPA attempts" in report


def test_bytes_and_flops_of_a_known_case():
    case = mla.Case("bfloat16", 2, 16, 1024)
    assert case.kv_bytes == 2 * 1024 * 576 * 2  # each latent row read once
    assert case.bytes == case.kv_bytes + 2 * 16 * (576 + 512) * 2  # + query read, output written
    assert case.flops == 2 * 2 * 16 * 1024 * (576 + 512)
    assert case.flops / case.bytes == pytest.approx(2 * 16 * 1088 / (576 * 2), rel=0.03)


def _row(heads, batch, seqlen, copy_pct=None, matmul_pct=None, status="ok"):
    return Row({"H": heads, "B": batch, "L": seqlen}, "ioattn-mla", ceiling_pct=copy_pct,
               extra={"matmul_pct": matmul_pct}, status=status)


@pytest.mark.parametrize("row, verdict", [
    (_row(16, 64, 1024, copy_pct=86.0), "met (≥ 85% copy)"),  # B·L = 64k exactly
    (_row(16, 64, 1024, copy_pct=84.9), "missed (≥ 85% copy)"),
    (_row(16, 8, 4096, copy_pct=10.0), None),  # B·L 32k: below the bar's reach
    (_row(128, 64, 1024, matmul_pct=60.0), "met (≥ 60% matmul)"),
    (_row(128, 128, 32768, copy_pct=99.0, matmul_pct=59.0), "missed (≥ 60% matmul)"),
    (_row(128, 32, 32768, matmul_pct=5.0), None),  # B < 64
    (_row(16, 64, 1024, status="failed: boom"), None),
    (_row(16, 64, 1024), "no copy ceiling measured"),
])
def test_bar_verdict(row, verdict):
    assert mla.bar_verdict(row) == verdict


def test_bar_lines_count_each_backend():
    rows = [_row(16, 64, 1024, copy_pct=90.0), _row(16, 128, 1024, copy_pct=80.0), _row(16, 1, 1024, copy_pct=1.0)]
    peer = _row(16, 64, 1024, copy_pct=50.0)
    peer.backend = "torch-absorbed-sdpa"
    copy_line, matmul_line = mla.bar_lines(rows + [peer])
    assert "ioattn-mla met 1/2 (missed: H16 B128 L1024 80%)" in copy_line
    assert "torch-absorbed-sdpa met 0/1" in copy_line
    assert "no case measured" in matmul_line


def test_latent_pool_holds_each_sequence_through_its_table_row():
    import torch

    latent = torch.randn(3, 128, 576)
    pool, table = mla.latent_pool(latent, 64)
    assert pool.shape == (6, 64, 1, 576) and table.shape == (3, 2) and table.dtype == torch.int32
    for b in range(3):
        assert torch.equal(pool[table[b].long()].reshape(128, 576), latent[b])
