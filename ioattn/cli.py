"""`ioattn demo | generate | serve | eval | bench NAME | explain` — the command-line front of the library.

`ioattn bench NAME ...` runs `ioattn.bench.NAME.main(argv)`: each benchmark is one module with its own flags.
Bad arguments end a command with argparse's message and exit status 2, never a traceback: flags are checked
by their types, and values only the library can judge (a model path, a dtype) by its ValueError/OSError.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time

from ioattn.cli_args import DEFAULT_MODEL, MODEL_HELP, add_kv_cache_flags, fail, positive_int

EXPLAIN_DTYPES = ("float32", "float16", "bfloat16")


def _benchmarks() -> list[str]:
    import ioattn.bench

    # parts of benchmarks; mla runs as `ioattn bench decode --mla`
    skip = {"harness", "plot", "serve_offline", "serve_online", "workload", "datasets", "mla"}
    return sorted(m.name for m in pkgutil.iter_modules(ioattn.bench.__path__) if m.name not in skip)


def _add_generate_command(subparsers) -> None:
    generate = subparsers.add_parser(
        "generate", help="offline batched generation with the engine (text, finish reason, timings per request)")
    generate.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    generate.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    generate.add_argument("--chat", action="store_true",
                          help="send each prompt as a user message through the model's chat template")
    generate.add_argument("--prompts-file", default=None, help="one prompt per non-empty line ('-': stdin)")
    # Sampling flags default to None so that SamplingParams' own defaults (vLLM's) apply when a flag is absent.
    generate.add_argument("--n", type=int, default=None, help="completions per prompt (beam search: best beams)")
    generate.add_argument("--temperature", type=float, default=None, help="0: greedy (default 1.0)")
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--min-p", type=float, default=None)
    generate.add_argument("--max-tokens", type=int, default=None, help="default 16")
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", nargs="+", default=None, metavar="STR", help="stop strings")
    generate.add_argument("--ignore-eos", action="store_true", default=None)
    generate.add_argument("--beam-width", type=int, default=None, help="beam search with this many beams")
    generate.add_argument("--logprobs", type=int, default=None, metavar="K", help="top-K logprobs per token")
    generate.add_argument("--dtype", default="auto")
    generate.add_argument("--device", default=None)
    generate.add_argument("--num-blocks", type=int, default=None)
    generate.add_argument("--max-model-len", type=int, default=None)
    add_kv_cache_flags(generate)
    generate.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _add_explain_command(subparsers) -> None:
    explain = subparsers.add_parser("explain", help="which kernel runs for a shape, and why")
    explain.add_argument("--batch", type=positive_int, default=1)
    explain.add_argument("--seqlen-q", type=positive_int, default=4096)
    explain.add_argument("--seqlen-k", type=positive_int, default=None)
    explain.add_argument("--heads-q", type=positive_int, default=16)
    explain.add_argument("--heads-kv", type=positive_int, default=None)
    explain.add_argument("--head-dim", type=positive_int, default=128)
    explain.add_argument("--dtype", default="bfloat16", choices=EXPLAIN_DTYPES)
    explain.add_argument("--causal", action="store_true")
    explain.add_argument("--device", default=None)


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the `bench` subparser (whose help lists the benchmarks)."""
    # The server module imports its web dependencies only when serving, so `ioattn --help` works without them.
    from ioattn.eval.cli import add_eval_command
    from ioattn.server.cli import add_serve_command

    parser = argparse.ArgumentParser(prog="ioattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the README's main job: exactness of every kernel path, then chat requests "
                          "served by the engine on a real model (SmolLM2-135M-Instruct)")
    demo.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    _add_generate_command(sub)
    add_serve_command(sub)
    add_eval_command(sub)
    benchmarks = ", ".join(_benchmarks())
    # No help flag of its own: `ioattn bench NAME --help` reaches the benchmark's parser.
    bench = sub.add_parser("bench", help="run a benchmark: " + benchmarks, add_help=False,
                           description=f"ioattn bench NAME [flags]; NAME is one of: {benchmarks}. "
                           "`ioattn bench NAME --help` shows a benchmark's flags.")
    bench.add_argument("name", nargs="?", choices=_benchmarks())
    _add_explain_command(sub)
    return parser, bench


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, bench = _parser()
    args, rest = parser.parse_known_args(argv)

    if args.command == "bench":
        if args.name is None:
            asked_for_help = bool({"-h", "--help"} & set(rest))
            (sys.stdout if asked_for_help else sys.stderr).write(bench.format_help())
            return 0 if asked_for_help else 2
        return importlib.import_module(f"ioattn.bench.{args.name}").main(rest) or 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from ioattn.demo import main as demo_main

        return demo_main(args.model) or 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        from ioattn.server.cli import run_serve

        return run_serve(args)
    if args.command == "eval":
        from ioattn.eval.cli import run_eval

        return run_eval(args)
    return _explain(args)


def _explain(args: argparse.Namespace) -> int:
    import torch

    import ioattn

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    n_k = args.seqlen_k or args.seqlen_q
    h_kv = args.heads_kv or args.heads_q
    try:
        q = torch.empty(args.batch, args.seqlen_q, args.heads_q, args.head_dim, dtype=dtype, device=device)
        k = torch.empty(args.batch, n_k, h_kv, args.head_dim, dtype=dtype, device=device)
        text = ioattn.explain(q, k, k, causal=args.causal)
    except (ValueError, RuntimeError) as error:  # a bad --device, or a shape the kernels refuse
        return fail("explain", str(error))
    print(text)
    return 0


# -- generate ------------------------------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    from ioattn import LLM, BeamSearchParams, SamplingParams
    from ioattn.models.loader import load_model

    prompts = list(args.prompt)
    if args.prompts_file is not None:
        try:
            stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")
        except OSError as error:
            return fail("generate", f"--prompts-file: {error}")
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        return fail("generate", "give at least one --prompt or a --prompts-file")

    # Checked before the model loads, so a bad value fails in a fraction of a second.
    stop_flags = _given(dict(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos))
    sampling_flags = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, logprobs=args.logprobs)
    try:
        if args.beam_width is not None:
            # Beam search picks deterministically: sampling flags would be silently ignored, so refuse them.
            given = ["--" + name.replace("_", "-") for name in _given(sampling_flags)]
            if given:
                return fail("generate", f"{', '.join(given)} cannot be used with --beam-width "
                             "(beam search does not sample)")
            params = BeamSearchParams(beam_width=args.beam_width, n=args.n, **stop_flags)
        else:
            params = SamplingParams(**_given(dict(n=args.n, **sampling_flags)), **stop_flags)
    except ValueError as error:
        return fail("generate", str(error))

    try:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        llm = LLM(loaded, num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                  kv_cache_dtype=args.kv_cache_dtype, kv_cache_scales=args.kv_cache_scales)
    except (ValueError, OSError) as error:
        return fail("generate", str(error))
    inputs = {"prompts": prompts}
    if args.chat:
        from ioattn.server.chat_template import ChatTemplate

        chat = ChatTemplate.for_model(loaded)
        inputs = {"prompt_token_ids": [chat.token_ids(loaded.tokenizer, [{"role": "user", "content": prompt}])
                                       for prompt in prompts]}
    start = time.perf_counter()
    if isinstance(params, BeamSearchParams):
        outputs = llm.beam_search(params=params, **inputs)
    else:
        outputs = llm.generate(sampling_params=params, **inputs)
    elapsed = time.perf_counter() - start

    results = [{**_request_result(output), "prompt": prompt} for output, prompt in zip(outputs, prompts)]
    num_output_tokens = sum(len(c["token_ids"]) for r in results for c in r["completions"])
    summary = {"requests": len(results), "output_tokens": num_output_tokens, "elapsed_s": round(elapsed, 4),
               "output_tokens_per_s": round(num_output_tokens / elapsed, 2) if elapsed > 0 else None,
               "preemptions": llm.engine.stats()["preemptions"],
               "kv_cache_dtype": llm.engine.stats()["attention"]["cache_dtype"]}
    if args.json:
        print(json.dumps({"model": args.model, "results": results, "summary": summary}, indent=2, ensure_ascii=False))
    else:
        for index, result in enumerate(results):
            _print_result(index, result)
        print(f"{summary['requests']} request(s), {num_output_tokens} output tokens in {elapsed:.2f} s "
              f"({summary['output_tokens_per_s']} tok/s), {summary['preemptions']} preemption(s)")
    return 1 if any(r["error"] for r in results) else 0


def _given(values: dict) -> dict:
    return {name: value for name, value in values.items() if value is not None}


def _request_result(output) -> dict:
    """One request as plain data: its completions and timings (seconds, None when not reached)."""
    metrics = output.metrics
    end_to_end = None if metrics.finished_time is None else metrics.finished_time - metrics.arrival_time
    completions = [
        {
            "index": c.index,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "cumulative_logprob": c.cumulative_logprob,
            # JSON object keys are strings: token ids become "123".
            "logprobs": None if c.logprobs is None else [{str(t): lp for t, lp in step.items()} for step in c.logprobs],
            "time_per_output_token_s": metrics.time_per_output_token(len(c.token_ids)),
        }
        for c in output.outputs
    ]
    return {
        "prompt": output.prompt,
        "num_prompt_tokens": len(output.prompt_token_ids),
        "completions": completions,
        "error": output.error,
        "time_to_first_token_s": metrics.time_to_first_token,
        "end_to_end_s": end_to_end,
        "num_preemptions": metrics.num_preemptions,
    }


def _printable(text: str) -> str:
    """Control characters escaped (a random model's bytes must not drive the terminal); newlines and tabs kept."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else ch.encode("unicode_escape").decode() for ch in text)


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.1f} ms"


def _print_result(index: int, result: dict) -> None:
    if result["error"]:
        print(f"[{index}] prompt {result['prompt']!r}\n    error: {result['error']}")
        return
    print(f"[{index}] prompt ({result['num_prompt_tokens']} tokens): {result['prompt']!r}")
    for c in result["completions"]:
        logprob = "" if c["cumulative_logprob"] is None else f", cumulative logprob {c['cumulative_logprob']:.3f}"
        print(f"  [{index}.{c['index']}] finish_reason={c['finish_reason']}, {len(c['token_ids'])} tokens{logprob}")
        print("    " + _printable(c["text"]).replace("\n", "\n    "))
    print(f"    TTFT {_seconds(result['time_to_first_token_s'])}, end-to-end {_seconds(result['end_to_end_s'])}, "
          f"TPOT {_seconds(result['completions'][0]['time_per_output_token_s'] if result['completions'] else None)}, "
          f"{result['num_preemptions']} preemption(s)")


if __name__ == "__main__":
    sys.exit(main())
