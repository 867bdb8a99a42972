"""`ioattn bench serve --tp` and `--disagg` on `tiny` (CPU, gloo, two processes): every row completes the same
workload and reports every field; greedy first tokens agree across TP sizes and between disaggregated and
colocated. Numbers are never compared with thresholds: unit tests never time anything."""

import argparse
import json

import pytest

from ioattn.bench import serve, serve_online, workload

WORKLOAD = ["--model", "tiny", "--dtype", "float32", "--max-model-len", "128", "--num-requests", "4"]
RATIO_KEYS = {"output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"}


def bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "serve.json"
    assert serve.main([*WORKLOAD, *argv, "--json", str(out), "--out", str(tmp_path)]) == 0
    return json.loads(out.read_text())


def assert_complete(run: dict, output_tokens: int) -> None:
    assert run["completed"] == 4 and run["failed"] == 0, run
    assert run["output_tokens"] == output_tokens
    for key in ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
        assert run[key] is not None and run[key] > 0, key


def test_tp_sweep_rows_ratios_and_agreement(tmp_path):
    # Poisson arrivals: the paced path, with its waits between arrivals.
    result = bench(tmp_path, "--tp", "1,2", "--input-len", "16", "40", "--output-len", "3", "--request-rate", "50")
    assert result["systems"].keys() == {"ioattn-tp1", "ioattn-tp2"}
    for run in result["systems"].values():
        assert_complete(run, 4 * 3)
    assert result["systems"]["ioattn-tp2"]["first_token_agreement"] == 1.0
    (ratios,) = result["ratios"].values()
    assert "ioattn-tp2 / ioattn-tp1" in result["ratios"] and ratios.keys() == RATIO_KEYS
    assert all(value > 0 for value in ratios.values())
    assert any("eager" in note for note in result["notes"])
    assert result["disclosure"]["tensor_parallel_size"] == [1, 2]
    assert "decode_step" not in result
    (md_file,) = tmp_path.glob("*-serve-tp-cpu.md")
    assert "| metric | ioattn-tp1 | ioattn-tp2 |" in md_file.read_text()


def test_disaggregated_vs_colocated(tmp_path):
    # Prefill-heavy: prompts of several blocks, short outputs, a fixed concurrency.
    result = bench(tmp_path, "--disagg", "--input-len", "40", "80", "--output-len", "2", "--concurrency", "2")
    systems = result["systems"]
    assert systems.keys() == {"colocated", "disaggregated"}
    for run in systems.values():
        assert_complete(run, 4 * 2)
    # Every prompt has full blocks before its last token: they were shipped and found by the prefix lookup.
    assert systems["disaggregated"]["shipped_blocks"] > 0 and systems["disaggregated"]["prefix_hit_rate"] > 0
    assert systems["colocated"]["prefix_hit_rate"] == 0.0
    assert systems["disaggregated"]["first_token_agreement"] == 1.0
    assert result["ratios"]["disaggregated / colocated"].keys() == RATIO_KEYS
    assert result["disclosure"]["tensor_parallel_size"] == 1
    (md_file,) = tmp_path.glob("*-serve-disagg-cpu.md")
    assert "disaggregated / colocated: output_tokens_per_s" in md_file.read_text()


def test_offline_at_tp2_with_the_decode_step(tmp_path):
    result = bench(tmp_path, "--offline", "--tp", "2", "--input-len", "16", "24", "--output-len", "2",
                   "--decode-batch", "2")
    assert_complete(result["systems"]["ioattn"], 4 * 2)
    step = result["decode_step"]
    assert step["batch"] == 2 and step["step_ms_median"] > 0 and not step["preempted"]
    # The bytes rank 0 reads: its shard's weights (float32), of the embedding only its 2 rows when untied.
    from ioattn.distributed import load_tensor_parallel

    shard = load_tensor_parallel("tiny", 0, 2, dtype="float32", device="cpu").model
    embedding_rows = shard.model.embed_tokens.weight.shape[0]
    skipped = 0 if shard.config.tie_word_embeddings else (embedding_rows - 2) * shard.config.hidden_size
    assert step["weight_bytes"] == 4 * (sum(p.numel() for p in shard.parameters()) - skipped)
    assert result["disclosure"]["tensor_parallel_size"] == 2


def test_launch_forwards_tp_to_the_server():
    args = argparse.Namespace(dtype="auto", max_num_seqs=8, gpu_memory_utilization=0.5, max_model_len=None,
                              num_blocks=None, device=None, tp=[2])
    flags = serve_online._engine_flags(args)
    assert flags[flags.index("--tp") + 1] == "2"
    assert "--tp" not in serve_online._engine_flags(argparse.Namespace(**{**vars(args), "tp": [1]}))


def test_arrival_offsets():
    assert workload.arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    offsets = workload.arrival_offsets(50, 10.0, seed=2)
    assert offsets == workload.arrival_offsets(50, 10.0, seed=2) and offsets[0] == 0.0
    assert all(a < b for a, b in zip(offsets, offsets[1:]))


@pytest.mark.parametrize("argv", [["--tp", "1,1"], ["--tp", "0"], ["--tp", "two"], ["--tp", "1,2", "--offline"],
                                  ["--tp", "1,2", "--launch"], ["--disagg", "--tp", "2"], ["--tp", "2"]])
def test_rejected_flag_combinations(argv):
    with pytest.raises(SystemExit):
        serve.main([*WORKLOAD, *argv])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [["--tp", "1,2"], ["--disagg", "--concurrency", "4"]], ids=["tp", "disagg"])
def test_two_gpus(tmp_path, mode):
    """On two GPUs (NCCL): both modes complete every request with every field; the TP ranks and the prefill
    worker take GPU 1."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path / "serve.json"
    argv = [*mode, "--model", "tiny", "--num-requests", "8", "--input-len", "64", "160", "--output-len", "4",
            "--max-model-len", "512", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.3", "--json", str(out)]
    assert serve.main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["systems"]) == 2
    for run in result["systems"].values():
        assert run["completed"] == 8 and run["output_tokens"] == 32 and run["tpot_ms_p50"] > 0, run
    (ratios,) = result["ratios"].values()
    assert all(value > 0 for value in ratios.values())
