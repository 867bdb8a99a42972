"""`ioattn eval`: perplexity through the engine's paged path against transformers on smollm2, StreamingLLM eviction
on tiny against a float64 dense sink+window reference (and the blocks it releases), the experiment's three runs,
and the command line (outputs, argparse-style errors)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ioattn.cli import main
from ioattn.eval import Streaming, paged_logits, perplexity, streaming_experiment
from ioattn.eval.perplexity import pool_blocks
from ioattn.intmath import cdiv
from ioattn.models import load_model
from ioattn.models.presets import PRESETS
from ioattn.reference import attention_ref, rel_error

SEEDS_SLICE = Path(__file__).parent / "data" / "seeds_slice.txt"  # the first 5.5k characters of a seed document
PERPLEXITY_RTOL = 5e-3
FLOAT64_RTOL = 1e-10
NLL_ATOL = 1e-3  # per token, nats: the same weights, float32 on both sides


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny64():
    """The tiny preset in float64, so that the paged path and the dense reference agree to rounding."""
    loaded = load_model("tiny", dtype="float32", device="cpu")
    loaded.model.double().reset_rope()
    return loaded


def tiny_text(n: int) -> list[int]:
    text = SEEDS_SLICE.read_text(encoding="utf-8")
    return load_model("tiny", device="cpu").tokenizer.encode(text)[:n]


def test_perplexity_matches_transformers_on_smollm2():
    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2", dtype="float32", device="cpu")
    ids = loaded.tokenizer.encode(SEEDS_SLICE.read_text(encoding="utf-8"))
    assert 1000 <= len(ids) <= 2000
    # 300 a step: chunk boundaries fall inside blocks of 16.
    ours = perplexity(loaded, ids, chunk=300)
    folder, _, name = PRESETS["smollm2"].path().rpartition("/")
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
    theirs = F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]), reduction="none")
    expected = math.exp(theirs.mean().item())
    worst = (torch.from_numpy(ours.nll) - theirs).abs().max().item()
    print(f"smollm2 on {len(ids)} tokens: perplexity ours {ours.perplexity:.5f}, transformers {expected:.5f}, "
          f"max per-token |dNLL| {worst:.2e}, {ours.tokens_per_s:.0f} tokens/s")
    assert ours.tokens_scored == len(ids) - 1
    assert abs(ours.perplexity / expected - 1) <= PERPLEXITY_RTOL
    assert worst <= NLL_ATOL
    assert ours.blocks_held == ours.peak_blocks == cdiv(len(ids), 16)


class SinkWindowAttention:
    """Test-only attention context: one whole sequence, float64, every query seeing the first `sinks` keys and the
    last `window` (itself included) — `ioattn.reference.visible`'s rule through `attention_ref`."""

    def __init__(self, window: int, sinks: int):
        self.window_size, self.sinks = (window - 1, 0), sinks

    def attend(self, q, k, v, layer_idx):
        out, _ = attention_ref(q[None], k[None], v[None], causal=True, window_size=self.window_size,
                               sink_tokens=self.sinks)
        return out[0].to(q.dtype)


def test_streaming_logits_equal_a_dense_sink_window_reference_and_blocks_are_released(tiny64):
    ids, window, sinks, chunk, block = tiny_text(300), 40, 4, 24, 8
    streaming = Streaming(window, sinks)
    steps = list(paged_logits(tiny64, ids, chunk=chunk, streaming=streaming, block_size=block))
    logits = torch.cat([step.logits for step in steps])
    model = tiny64.model
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), SinkWindowAttention(window, sinks))
        reference = model.compute_logits(hidden)
        full, no_sinks = (model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), SinkWindowAttention(*rule)))
                          for rule in ((len(ids), 0), (window, 0)))
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    assert rel_error(logits, reference) <= FLOAT64_RTOL
    # The reference is sensitive to the mask: past the window, full attention and the window alone differ.
    for other in (full, no_sinks):
        assert rel_error(other[window + block :], reference[window + block :]) > 1e-2
    assert rel_error(full[:window], reference[:window]) <= FLOAT64_RTOL
    # Memory: after each step the sink block and the blocks covering the last `window` tokens, nothing more.
    for step in steps:
        end = step.start + len(step.logits)
        kept = cdiv(end, block) - max((end - window) // block, cdiv(sinks, block))
        assert step.kv.blocks_used == cdiv(sinks, block) + kept
        assert step.blocks_in_step <= pool_blocks(len(ids), chunk, streaming, block) < cdiv(len(ids), block)
    assert steps[-1].kv.window_evicted_blocks == (len(ids) - window) // block - cdiv(sinks, block)


def test_a_window_past_the_text_scores_as_full_attention(tiny64):
    ids = tiny_text(200)
    full = perplexity(tiny64, ids, chunk=64)
    wide = perplexity(tiny64, ids, chunk=64, streaming=Streaming(len(ids), 4))
    assert wide.window_evicted_blocks == 0 and wide.peak_blocks == full.peak_blocks == cdiv(len(ids), 16)
    assert torch.equal(torch.from_numpy(wide.nll), torch.from_numpy(full.nll))
    # Chunk sizes change nothing but the steps.
    one_step = perplexity(tiny64, ids, chunk=len(ids))
    assert abs(one_step.mean_nll / full.mean_nll - 1) <= FLOAT64_RTOL


def test_streaming_experiment_runs_a_and_b_past_the_context_c_up_to_it(tiny64):
    loaded = dataclasses.replace(tiny64, config=dataclasses.replace(tiny64.config, max_position_embeddings=160))
    ids = tiny_text(260)
    result = streaming_experiment(loaded, ids, window=48, sinks=4, chunk=40)
    runs = result.runs
    assert list(runs) == ["window", "window+sinks", "full"]
    assert [run.num_tokens for run in runs.values()] == [260, 260, 160]
    assert runs["window"].streaming == Streaming(48, 0) and runs["window+sinks"].streaming == Streaming(48, 4)
    header, rows = result.table(64)
    assert len(header) == 4 and [row[0] for row in rows[-2:]] == ["all < 160", "all ≥ 160"]
    assert rows[-1][3] is None and rows[0][1] == pytest.approx(runs["window"].buckets(64)[0]["perplexity"])
    with pytest.raises(ValueError, match="sinks must be an int >= 1"):
        streaming_experiment(loaded, ids, window=48, sinks=0, chunk=40)


def test_bad_arguments_name_themselves(tiny64):
    with pytest.raises(ValueError, match="kv_sinks .* needs a kv_window"):
        Streaming(None, 4)
    with pytest.raises(ValueError, match="kv_window must be None or an int >= 1"):
        Streaming(0)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        next(paged_logits(tiny64, [1, 2, 3], chunk=0))
    with pytest.raises(ValueError, match=r"token_ids must be ints in \[0, 512\)"):
        next(paged_logits(tiny64, [1, 512]))
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(tiny64, [1])
    with pytest.raises(ValueError, match=r"token_ids is 4097 tokens, longer than the model's context \(4096\)"):
        perplexity(tiny64, [1] * 4097)


# -- the command line ----------------------------------------------------------------------------------------


def test_cli_perplexity_and_streaming_write_json_and_plots(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(SEEDS_SLICE.read_text(encoding="utf-8")[:400], encoding="utf-8")
    out, png = tmp_path / "ppl.json", tmp_path / "ppl.png"
    assert main(["eval", "perplexity", "--model", "tiny", "--text", str(text), "--chunk", "96", "--kv-window", "64",
                 "--kv-sinks", "4", "--json", str(out), "--plot", str(png), "--bucket", "100"]) == 0
    printed = capsys.readouterr().out
    assert "window 64 + 4 sinks" in printed and "tokens/s" in printed and "held at the end" in printed
    doc = json.loads(out.read_text())
    assert doc["result"]["tokens"] == 401 and doc["result"]["tokens_scored"] == 400
    assert doc["result"]["kv_window"] == 64 and doc["result"]["kv_window_evicted_blocks"] > 0
    assert [b["start"] for b in doc["buckets"]] == [0, 100, 200, 300, 400]
    assert doc["disclosure"]["torch"] == torch.__version__ and "--kv-window 64" in doc["disclosure"]["command"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out, png = tmp_path / "streaming.json", tmp_path / "streaming.png"
    assert main(["eval", "streaming", "--model", "tiny", "--text", str(text), "--text", str(text), "--window", "96",
                 "--max-tokens", "500", "--chunk", "128", "--table-bucket", "250", "--json", str(out),
                 "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "| positions | (a) window 96, no sinks | (b) window 96 + 4 sinks | (c) full attention |" in printed
    assert "| 250–500 |" in printed
    doc = json.loads(out.read_text())
    assert list(doc["runs"]) == ["window", "window+sinks", "full"] and doc["settings"]["tokens"] == 500
    assert png.stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    (["--kv-sinks", "4"], "--kv-sinks 4 needs --kv-window"),
    (["--text", "/nonexistent/file.txt"], "--text: "),
    (["--json", "/nonexistent/out.json"], "--json /nonexistent/out.json: its folder does not exist"),
    (["--max-tokens", "1"], "--text holds 1 token(s) (--max-tokens 1): scoring needs at least 2"),
    (["--model", "no-such-model"], "model 'no-such-model' is neither a preset"),
])
def test_cli_errors_are_argparse_style(tmp_path, capsys, flags, message):
    text = tmp_path / "text.txt"
    text.write_text("a short text", encoding="utf-8")
    assert main(["eval", "perplexity", "--model", "tiny", "--text", str(text), *flags]) == 2
    assert f"ioattn eval perplexity: error: {message}" in capsys.readouterr().err


def test_cli_refuses_full_attention_past_the_context_naming_both_lengths(tmp_path, capsys):
    text = tmp_path / "long.txt"
    text.write_text("x" * 4200, encoding="utf-8")
    assert main(["eval", "perplexity", "--model", "tiny", "--text", str(text)]) == 2
    assert ("--text is 4201 tokens, longer than the model's context (4096): pass --max-tokens 4096"
            in capsys.readouterr().err)
    for argv in (["perplexity", "--kv-window", "0"], ["streaming", "--window", "8", "--sinks", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", *argv, "--model", "tiny", "--text", str(text)])
        assert exit_info.value.code == 2
    assert "must be >= 1, got 0" in capsys.readouterr().err
