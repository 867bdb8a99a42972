"""`ioattn bench serve --compare ioattn,static,hf` on `tiny` (CPU): every system completes the same workload and
every field of the report exists; the roofline arithmetic is checked by hand. Numbers are never compared with
thresholds: unit tests never time anything."""

import argparse
import importlib.util
import json

import pytest

from ioattn.bench import serve, serve_offline, workload
from ioattn.models.presets import PRESETS

MAX_MODEL_LEN = 512
HAS_PSUTIL = importlib.util.find_spec("psutil") is not None


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One N=8 run of all three systems (plus the batch-4 decode step), written with --json and --out."""
    out = tmp_path_factory.mktemp("serve")
    argv = ["--compare", "ioattn,static,hf", "--model", "tiny", "--num-requests", "8", "--input-len", "16", "64",
            "--output-len", "2", "9", "--decode-batch", "4", "--max-model-len", str(MAX_MODEL_LEN),
            "--json", str(out / "serve.json"), "--out", str(out)]
    assert serve.main(argv) == 0
    work = workload.make_workload(8, (16, 64), (2, 9), seed=0)
    return json.loads((out / "serve.json").read_text()), out, work


def test_ours_and_static_complete_the_workload(compared):
    result, _, work = compared
    for name in ("ioattn", "static"):
        run = result["systems"][name]
        assert run["completed"] == 8 and run["failed"] == 0, run
        assert run["output_tokens"] == sum(w.output_len for w in work)
        for key in ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
            assert run[key] is not None and run[key] > 0, (name, key)
        assert run["preemptions"] == 0 and run["prefix_hit_rate"] == 0.0
        assert 0 < run["kv_utilization_mean"] <= 1 and 0 < run["kv_pool_usage_peak"] <= 1
        assert 1 <= run["running_peak"] <= 8
        mean_request = sum(len(w.prompt_token_ids) + w.output_len for w in work) / len(work)
        assert run["requests_in_pool"] == pytest.approx(run["kv_pool_tokens"] / mean_request)
    tiny = PRESETS["tiny"].config  # float32 K and V per KV head and layer
    per_token = tiny.num_layers * 2 * tiny.num_kv_heads * tiny.head_dim * 4
    assert result["systems"]["ioattn"]["kv_bytes_per_token"] == per_token
    # Static commits max_model_len per running sequence; these prompts hold at most 73 tokens of it.
    assert result["systems"]["static"]["kv_utilization_mean"] < 73 / MAX_MODEL_LEN
    assert result["systems"]["ioattn"]["kv_utilization_mean"] > 73 / MAX_MODEL_LEN
    assert result["ioattn_over_static"] > 0
    # Same model, same greedy rule: the static baseline starts every completion with the same token.
    assert result["systems"]["static"]["first_token_agreement"] == 1.0


def test_hf_runs_the_same_weights_or_says_why_not(compared):
    result, _, work = compared
    hf = result["systems"]["hf"]
    if not HAS_PSUTIL:
        assert hf["status"].startswith("unsupported:") and "psutil" in hf["status"]
        assert "ioattn_over_hf" not in result
        return
    assert hf["completed"] == 8 and hf["output_tokens"] == sum(w.output_len for w in work), hf
    assert hf["ttft_ms_p50"] > 0 and hf["tpot_ms_p50"] > 0 and result["ioattn_over_hf"] > 0
    # Float32 and a copy of our weights: transformers' greedy first tokens are ours.
    assert hf["first_token_agreement"] == 1.0


def test_decode_step_and_roofline_on_cpu(compared):
    result, _, work = compared
    step = result["decode_step"]
    assert step["batch"] == 4 and step["steps_timed"] == serve_offline.DECODE_STEPS
    assert step["step_ms"] > 0 and step["step_ms_median"] > 0 and not step["preempted"]
    assert step["overlapped_steps"] == step["steps_timed"]  # asynchronous scheduling is on by default
    assert step["context_mean"] >= serve_offline.mean_context(work)  # early prefills decode longer
    assert step["bound_ms"] is None and step["bound_note"].startswith("n/a")  # no copy bandwidth on a CPU
    config = PRESETS["tiny"].config
    params = sum(p.numel() for p in _tiny_model().parameters())
    assert step["weight_bytes"] == 4 * (params - (config.vocab_size - 4) * config.hidden_size)  # float32
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert step["kv_bytes"] == round(4 * step["context_mean"] * kv_per_token)


def test_report_files_and_markdown(compared):
    result, out, _ = compared
    assert result["disclosure"]["command"].startswith("ioattn bench serve --compare")
    assert result["settings"]["compare"] == ["ioattn", "static", "hf"] and result["disclosure"]["transformers"]
    (json_file,) = out.glob("*-serve-cpu.json")
    (md_file,) = out.glob("*-serve-cpu.md")
    assert json.loads(json_file.read_text())["systems"].keys() == {"ioattn", "static", "hf"}
    text = md_file.read_text()
    assert "| metric | ioattn | static | hf |" in text and "ioattn / static output throughput" in text
    assert "batch-4 decode step" in text and "n/a" in text


def test_roofline_arithmetic():
    step = {"weight_bytes": 16e9, "kv_bytes": 4e9, "step_ms": 6.0, "step_ms_median": 6.5}
    serve_offline.add_roofline(step, copy_tbps=4.0)
    assert step["bound_ms"] == pytest.approx(5.0) and step["step_over_bound"] == pytest.approx(1.2)


def test_mean_context_and_warmup_workload():
    work = [workload.WorkItem([1] * 100, 10), workload.WorkItem([1] * 300, 30)]
    assert serve_offline.mean_context(work) == 200 + 10
    work = workload.make_workload(40, (20, 50), (3, 3), seed=5)
    warmup = workload.warmup_workload(work, seed=5)
    assert len(warmup) == workload.WARMUP_REQUESTS
    assert all(20 <= len(w.prompt_token_ids) <= 50 and w.output_len == workload.WARMUP_OUTPUT_LEN
               for w in warmup)
    # No warm-up prompt is a measured one, here or at any rate of a sweep (rate i draws with seed + i).
    measured = {tuple(w.prompt_token_ids) for i in range(8) for w in workload.make_workload(40, (20, 50), (3, 3), 5 + i)}
    assert not {tuple(w.prompt_token_ids) for w in warmup} & measured


@pytest.mark.parametrize("text", ["ioattn,vllm", "", "hf,hf"])
def test_compare_rejects_unknown_or_repeated_systems(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--compare"):
        serve._systems(text)


def test_decode_batch_larger_than_max_num_seqs_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--compare", "ioattn", "--max-num-seqs", "4"])
    assert "--decode-batch (64) must be <= --max-num-seqs (4)" in capsys.readouterr().err


def _tiny_model():
    from ioattn.models.loader import load_model

    return load_model("tiny", device="cpu").model


@pytest.mark.gpu
def test_compare_on_cuda_has_a_roofline_bound(tmp_path):
    """On a GPU: the copy bandwidth is measured in the run, so the decode step gets its bound; transformers sizes
    its own cache (no psutil needed) and runs the same workload."""
    argv = ["--compare", "ioattn,static,hf", "--model", "tiny", "--num-requests", "8", "--input-len", "16", "64",
            "--output-len", "8", "--decode-batch", "8", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
            "--gpu-memory-utilization", "0.3", "--json", str(tmp_path / "serve.json")]
    assert serve.main(argv) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    for name in ("ioattn", "static", "hf"):
        assert result["systems"][name]["completed"] == 8 and result["systems"][name]["output_tokens"] == 64, name
    assert result["ceilings"]["copy_tbps"] > 0
    step = result["decode_step"]
    assert step["bound_ms"] > 0 and step["step_over_bound"] > 0 and not step["preempted"]
    assert step["overlapped_steps"] == step["steps_timed"]  # asynchronous scheduling, on by default on CUDA
    assert result["ioattn_over_hf"] > 0 and result["ioattn_over_static"] > 0
    assert result["disclosure"]["transformers"]


def test_hf_generate_peer_completes_the_same_workload(tmp_path):
    """The CPU bar's peer: transformers' plain generate, static left-padded batches, on a copy of our weights;
    every request's tokens counted, greedy first tokens ours, the ratio and the thread count reported."""
    out = tmp_path / "serve.json"
    argv = ["--compare", "ioattn,hf-generate", "--model", "tiny", "--num-requests", "6", "--input-len", "8", "40",
            "--output-len", "2", "7", "--max-num-seqs", "4", "--decode-batch", "0", "--max-model-len", str(MAX_MODEL_LEN),
            "--json", str(out)]
    assert serve.main(argv) == 0
    result = json.loads(out.read_text())
    work = workload.make_workload(6, (8, 40), (2, 7), seed=0)
    peer = result["systems"]["hf-generate"]
    assert peer["completed"] == 6 and peer["failed"] == 0, peer
    assert peer["output_tokens"] == sum(w.output_len for w in work)
    assert peer["ttft_ms_p50"] > 0 and peer["tpot_ms_p50"] > 0
    assert "hf_twin" in peer["attention"] and "up to 4 requests" in peer["cache"]
    assert peer["first_token_agreement"] == 1.0
    assert result["ioattn_over_hf-generate"] > 0
    assert any("bar on a CPU" in note for note in result["notes"])
    assert any("CPU threads" in note for note in result["notes"])


def test_run_engine_reports_an_mla_pool():
    """tiny-mla's latent row (DeepSeek's 512 + 64) on two layers: the bytes per token and the requests the pool
    holds are those of one latent cache per layer, not of K and V per head."""
    from ioattn.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine("tiny-mla", EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=32,
                                                max_model_len=128))
    work = workload.make_workload(4, (16, 40), (2, 5), seed=0)
    run = serve_offline.run_engine(engine, work, 0.0, serve_offline.Pacing.all_at_once(work))
    assert run["completed"] == 4 and run["failed"] == 0
    assert run["kv_bytes_per_token"] == 2 * (512 + 64) * 4 and run["kv_pool_tokens"] == 32 * 16
    assert run["kv_cache_layout"] == "latent 512 + rope 64 per token per layer, one cache"
    assert 1 <= run["running_peak"] <= 4
    empty = serve_offline.run_engine(engine, [], 0.0, serve_offline.Pacing([]))  # no request: no mean length
    assert empty["completed"] == 0 and empty["requests_in_pool"] is None and empty["running_peak"] == 0
