"""The command line: `ioattn generate` on tiny, defaults, help texts, argparse-style errors of `generate`, `serve`
and `explain`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ioattn.cli import _benchmarks, _parser, main


def test_generate_greedy_n2_prints_each_completion_with_timings(capsys):
    status = main(["generate", "--model", "tiny", "--prompt", "The sky is", "--prompt", "Hello",
                   "--temperature", "0", "--n", "2", "--max-tokens", "5"])
    stdout = capsys.readouterr().out
    assert status == 0
    for name in ("[0.0]", "[0.1]", "[1.0]", "[1.1]", "finish_reason=length", "5 tokens", "TTFT", "end-to-end"):
        assert name in stdout
    assert "2 request(s), 20 output tokens" in stdout


def test_generate_json_greedy_samples_agree_and_match_a_single_run(capsys):
    argv = ["generate", "--model", "tiny", "--prompt", "abc", "--temperature", "0", "--max-tokens", "6",
            "--logprobs", "2", "--json"]
    assert main(argv + ["--n", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (result,) = doc["results"]
    first, second = result["completions"]
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 6
    assert first["finish_reason"] == "length" and result["error"] is None
    assert len(first["logprobs"]) == 6 and all(len(step) in (2, 3) for step in first["logprobs"])
    assert result["time_to_first_token_s"] > 0 and result["end_to_end_s"] >= result["time_to_first_token_s"]
    assert doc["summary"]["output_tokens"] == 12
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["completions"][0]["token_ids"] == first["token_ids"]


def test_generate_beam_search_and_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    assert main(["generate", "--model", "tiny", "--prompts-file", str(prompts), "--beam-width", "2",
                 "--max-tokens", "3", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["prompt"] for r in results] == ["first prompt", "second prompt"]
    assert all(len(r["completions"]) == 2 for r in results)


def test_generate_a_refused_prompt_fails_alone_with_exit_1(capsys):
    status = main(["generate", "--model", "tiny", "--max-model-len", "8", "--prompt", "a prompt past eight tokens",
                   "--prompt", "hi", "--temperature", "0", "--max-tokens", "3"])
    stdout = capsys.readouterr().out
    assert status == 1
    assert "error: prompt is 27 tokens, longer than max_model_len (8)" in stdout
    assert "[1.0] finish_reason=length" in stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--beam-width", "2", "--temperature", "0.5"], "--temperature cannot be used with --beam-width"),
        (["--model", "/no/such/model"], "neither a preset, a GGUF file nor a checkpoint folder"),
        (["--model", "tiny", "--dtype", "float64"], "dtype must be 'auto' or one of"),
    ],
)
def test_generate_bad_values_exit_2_with_the_message(flags, message, capsys):
    assert main(["generate", "--prompt", "hi", *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_generate_bad_temperature_from_the_console_exits_2_without_traceback():
    result = subprocess.run([sys.executable, "-m", "ioattn.cli", "generate", "--prompt", "hi", "--temperature", "-0.5"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 2
    assert "ioattn generate: error: temperature must be >= 0, got -0.5" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_commands_and_benchmarks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    top = capsys.readouterr().out
    for command in ("demo", "generate", "serve", "bench", "explain"):
        assert command in top
    assert main(["bench", "--help"]) == 0
    bench_help = capsys.readouterr().out
    assert set(_benchmarks()) >= {"prefill", "decode", "kv"}
    assert all(name in top and name in bench_help for name in _benchmarks())
    assert main(["bench"]) == 2


@pytest.mark.parametrize("command", [["demo"], ["generate"], ["serve"], ["eval"], ["explain"],
                                     *(["bench", name] for name in _benchmarks())])
def test_every_command_renders_its_help(command, capsys):
    """argparse formats each help text with %: a stray one in any flag's help breaks that command's --help."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: ioattn " + " ".join(command) in capsys.readouterr().out


def test_help_needs_no_server_dependencies():
    """`ioattn --help` must work where fastapi/uvicorn are not installed: block their import and ask for help."""
    code = ("import sys\n"
            "for name in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client'): sys.modules[name] = None\n"
            "from ioattn.cli import main\n"
            "main(['--help'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "generate" in result.stdout


def test_serve_subcommand_is_wired(monkeypatch):
    import ioattn.server.cli as server_cli

    seen = {}

    def run_serve(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(server_cli, "run_serve", run_serve)
    assert main(["serve", "--model", "tiny", "--port", "8123"]) == 0
    assert seen["args"].port == 8123 and seen["args"].model == "tiny"


def test_explain_prints_the_kernel(capsys):
    assert main(["explain", "--seqlen-q", "128", "--head-dim", "64", "--dtype", "float32", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "kernel:" in text and "reason:" in text and "window=(-1, 0)" in text


def test_the_real_model_is_the_default_everywhere():
    parser, _ = _parser()
    for command in (["demo"], ["generate"], ["serve"]):
        assert parser.parse_args(command).model == "smollm2", command


def test_generate_chat_renders_the_template_and_keeps_the_prompt_text(capsys):
    """`--chat` on tiny: its plain template wraps the prompt (longer than the bare text), the output names it."""
    assert main(["generate", "--model", "tiny", "--chat", "--prompt", "hi", "--max-tokens", "2", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["prompt"] == "hi" and result["num_prompt_tokens"] > len("hi") + 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
        (["serve", "--model", "/no/such/model"], "model '/no/such/model' is neither a preset, a GGUF file nor"),
        (["serve", "--model", "tiny", "--block-size", "3"], "block_size must be a power of two"),
        (["explain", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["explain", "--head-dim", "0"], "argument --head-dim: must be >= 1, got 0"),
        (["explain", "--head-dim", "1000", "--seqlen-q", "4"], "q head dim must be a multiple of 8"),
    ],
)
def test_serve_and_explain_bad_arguments_exit_2_without_traceback(argv, message, capsys):
    """argparse's own errors and the library's ValueErrors alike end in one line on stderr and status 2."""
    try:
        status = main(argv)
    except SystemExit as exit_info:  # argparse exits by itself
        status = exit_info.code
    captured = capsys.readouterr()
    assert status == 2
    assert f"ioattn {argv[0]}: error: {message}" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_generate_on_the_default_model_answers(capsys):
    status = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0",
                   "--max-tokens", "12"])
    assert status == 0, capsys.readouterr().err
    assert "The capital of France is Paris." in capsys.readouterr().out
