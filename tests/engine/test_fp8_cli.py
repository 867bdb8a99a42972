"""--kv-cache-dtype on generate, serve, eval and bench; /metrics and the bench disclosure name the cache."""

from __future__ import annotations

import json

import pytest

from ioattn.cli import main


def test_generate_with_an_fp8_cache(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "The sky is", "--max-tokens", "4", "--temperature", "0",
                 "--num-blocks", "300", "--kv-cache-dtype", "fp8_e4m3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["summary"]["kv_cache_dtype"] == "fp8_e4m3"
    assert len(result["results"][0]["completions"][0]["token_ids"]) == 4


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-scales", "0.5"], "kv_cache_scales must be None unless kv_cache_dtype is an fp8 format"),
    (["--kv-cache-dtype", "fp8_e5m2", "--kv-cache-scales", "-1"], "kv_cache_scales must be"),
])
def test_generate_bad_kv_cache_flags_exit_2(flags, message, capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--num-blocks", "300", *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_eval_perplexity_with_fp8_and_unit_scales(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 12)
    out = tmp_path / "fp8.json"
    assert main(["eval", "perplexity", "--model", "tiny", "--text", str(text), "--max-tokens", "96", "--chunk", "64",
                 "--kv-cache-dtype", "fp8_e4m3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KV cache fp8_e4m3, scales calibrated" in printed
    result = json.loads(out.read_text())
    assert result["result"]["kv_cache_dtype"] == "fp8_e4m3" and result["result"]["kv_scales"]["source"] == "calibrated"
    assert result["settings"]["kv_cache_dtype"] == "fp8_e4m3"
    with pytest.warns(UserWarning, match="uncalibrated"):
        assert main(["eval", "perplexity", "--model", "tiny", "--text", str(text), "--max-tokens", "96",
                     "--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scales", "1.0"]) == 0
    assert "scales unit" in capsys.readouterr().out
    assert main(["eval", "perplexity", "--model", "tiny", "--text", str(text), "--kv-cache-scales", "0.5"]) == 2
    assert "--kv-cache-scales needs an fp8 --kv-cache-dtype" in capsys.readouterr().err


def test_bench_decode_fp8_rows_count_one_byte_per_element(tmp_path):
    assert main(["bench", "decode", "--quick", "--kv-cache-dtype", "fp8_e5m2", "--batches", "2", "--seqlens", "64",
                 "--backends", "ioattn-paged", "--no-prefill", "--warmup-ms", "1", "--rep-ms", "1",
                 "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("*-decode-cpu.json")).read_text())
    rows = {r["backend"]: r for r in result["rows"]}
    fp8, bf16 = rows["ioattn-paged-fp8"], rows["ioattn-paged"]
    assert fp8["status"] == "ok" and fp8["extra"]["kv_cache_dtype"] == "fp8_e5m2"
    assert bf16["extra"]["kv_bytes"] == 4 * fp8["extra"]["kv_bytes"]  # float32 on the CPU against one byte
    assert fp8["error"] < 1e-5 and fp8["extra"]["error_vs_bf16"] < 0.2
    assert result["settings"]["kv_cache_dtype"] == "fp8_e5m2"
    report = next(tmp_path.glob("*-decode-cpu.md")).read_text()
    assert "ioattn-paged-fp8 / ioattn-paged" in report and "Bar (" in report


def test_serve_takes_the_kv_cache_flags(monkeypatch):
    import ioattn.server.cli as serve_cli

    seen = {}
    monkeypatch.setattr(serve_cli, "run_serve", lambda args: seen.update(vars(args)) or 0)
    assert main(["serve", "--model", "tiny", "--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scales", "calibrate"]) == 0
    assert seen["kv_cache_dtype"] == "fp8_e4m3" and seen["kv_cache_scales"] == "calibrate"


def test_metrics_name_the_kv_cache():
    pytest.importorskip("prometheus_client")
    pytest.importorskip("msgspec")
    from ioattn.server.metrics import ServerMetrics
    from ioattn.server.transport import EngineInfo

    metrics = ServerMetrics()
    info = EngineInfo(model="tiny", dtype="float32", device="cpu", vocab_size=258, max_model_len=128, max_num_seqs=4,
                      eos_token_ids=[2], block_size=16, num_blocks=10, kv_cache_bytes=1, cache_dtype="fp8_e4m3",
                      attention_backend="torch", tensor_parallel_size=1, pid=1, kv_scales="calibrated",
                      kv_rotation="hadamard-signed")
    metrics.engine_ready(info)
    text = metrics.render().decode()
    assert ('ioattn_kv_cache_info{cache_dtype="fp8_e4m3",kv_rotation="hadamard-signed",kv_scales="calibrated"} 1.0'
            in text)
    assert "ioattn_kv_cache_tokens_total 160.0" in text
