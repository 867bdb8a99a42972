"""`ioattn eval perplexity | streaming`: score a text through the engine's paged path (`ioattn.eval.perplexity`),
or run the StreamingLLM experiment (`ioattn.eval.streaming`).

Several `--text` files are joined with a blank line between them, in the order given. Bad flags end the command
argparse-style (exit status 2, no traceback), before the model loads where the flags alone decide; the output
folders of `--json` / `--plot` and matplotlib are checked first too, so a long run cannot fail at its end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ioattn.cli_args import DEFAULT_MODEL, MODEL_HELP, add_kv_cache_flags, fail, nonnegative_int, positive_int


def _common_flags(parser: argparse.ArgumentParser) -> None:
    from ioattn.eval.perplexity import DEFAULT_BUCKET, DEFAULT_CHUNK

    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    parser.add_argument("--text", action="append", required=True, metavar="FILE",
                        help="a UTF-8 text file; repeat to join several (a blank line between them)")
    parser.add_argument("--chunk", type=positive_int, default=DEFAULT_CHUNK,
                        help=f"tokens per prefill step (default {DEFAULT_CHUNK})")
    parser.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                        help="use only the text's first N tokens (N - 1 are scored: the first predicts the second)")
    parser.add_argument("--bucket", type=positive_int, default=DEFAULT_BUCKET,
                        help=f"positions per point of the plot and the JSON's buckets (default {DEFAULT_BUCKET})")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    add_kv_cache_flags(parser)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the settings and results as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write perplexity against position (matplotlib)")


def add_eval_command(subparsers) -> argparse.ArgumentParser:
    evaluate = subparsers.add_parser("eval", help="perplexity of a text through the engine's paged path; the "
                                     "StreamingLLM experiment (window, window + sinks, full attention)")
    kinds = evaluate.add_subparsers(dest="eval_command", required=True)
    ppl = kinds.add_parser("perplexity", help="perplexity of a text, prefilled in chunks as the engine serves")
    _common_flags(ppl)
    ppl.add_argument("--kv-window", type=positive_int, default=None, metavar="W",
                     help="StreamingLLM: every query sees the last W tokens (itself included); older blocks are "
                     "released after each chunk, so the text may run past the model's context")
    ppl.add_argument("--kv-sinks", type=nonnegative_int, default=0, metavar="S",
                     help="with --kv-window: the first S tokens stay visible too (attention sinks)")
    streaming = kinds.add_parser("streaming", help="perplexity by position for (a) a window, (b) the window + "
                                 "attention sinks, (c) full attention up to the context; a markdown table")
    _common_flags(streaming)
    streaming.add_argument("--window", type=positive_int, required=True, metavar="W", help="tokens each query sees")
    streaming.add_argument("--sinks", type=positive_int, default=4, metavar="S", help="sink tokens of run (b)")
    streaming.add_argument("--table-bucket", type=positive_int, default=1024, metavar="N",
                           help="positions per row of the printed table (default 1024)")
    return evaluate


def run_eval(args: argparse.Namespace) -> int:
    command = f"eval {args.eval_command}"
    try:
        problem = _check_outputs(args)
        if problem is None and args.eval_command == "perplexity" and args.kv_sinks and args.kv_window is None:
            problem = f"--kv-sinks {args.kv_sinks} needs --kv-window (without a window every token is kept)"
        if problem is None and args.kv_cache_scales is not None and args.kv_cache_dtype == "auto":
            problem = "--kv-cache-scales needs an fp8 --kv-cache-dtype (scales quantize an fp8 cache)"
        if problem is not None:
            return fail(command, problem)
        text = _read_texts(args.text)
    except (OSError, UnicodeDecodeError) as error:
        return fail(command, f"--text: {error}")
    from ioattn.models.loader import load_model

    try:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    except (ValueError, OSError, RuntimeError) as error:  # RuntimeError: a device torch cannot use
        return fail(command, str(error))
    token_ids = loaded.tokenizer.encode(text)
    if args.max_tokens is not None:
        token_ids = token_ids[: args.max_tokens]
    if len(token_ids) < 2:
        given = f" (--max-tokens {args.max_tokens})" if args.max_tokens is not None else ""
        return fail(command, f"--text holds {len(token_ids)} token(s){given}: scoring needs at least 2")
    run = _perplexity if args.eval_command == "perplexity" else _streaming
    return run(args, loaded, token_ids, text, command)


def _check_outputs(args: argparse.Namespace) -> str | None:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            return f"{flag} {path}: its folder does not exist"
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib (pip install 'ioattn[bench]')"
    return None


def _read_texts(paths: list[str]) -> str:
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    return "\n\n".join(texts)


class _Progress:
    """A tqdm bar on stderr per run (hidden when stderr is not a terminal; nothing without tqdm)."""

    def __init__(self):
        self.bar, self.label = None, None

    def __call__(self, label: str, done: int, total: int) -> None:
        if label != self.label:
            self.close()
            self.label = label
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="tok", desc=label, file=sys.stderr, disable=None, leave=False)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _disclosure(args: argparse.Namespace, loaded, text: str, num_tokens: int) -> dict:
    import torch

    from ioattn.bench.harness import collect_disclosure

    device = str(loaded.model.inv_freq.device)
    info = collect_disclosure(device, _command_line(args))
    info.update(timing="wall clock of the scoring loop (model loading excluded)", torch_threads=torch.get_num_threads(),
                commit=_commit())
    settings = {"model": args.model, "dtype": str(loaded.model.model.embed_tokens.weight.dtype).removeprefix("torch."),
                "text": list(args.text), "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                "tokens": num_tokens, "context": loaded.max_model_len, "chunk": args.chunk, "bucket": args.bucket,
                "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_scales": args.kv_cache_scales}
    return {"disclosure": info, "settings": settings}


def _command_line(args: argparse.Namespace) -> str:
    """The flags of this run as one command line (every flag, defaults included)."""
    words = ["ioattn", "eval", args.eval_command]
    for name, value in vars(args).items():
        if name in ("command", "eval_command") or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            words += ["--" + name.replace("_", "-"), str(item)]
    return shlex.join(words)


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                             text=True, timeout=10, check=True, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _write_json(path: str, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")


# -- perplexity ------------------------------------------------------------------------------------------------


def _perplexity(args, loaded, token_ids, text, command) -> int:
    from ioattn.eval.perplexity import Streaming, perplexity

    try:
        streaming = Streaming(args.kv_window, args.kv_sinks)
    except ValueError as error:
        return fail(command, str(error))
    context = loaded.max_model_len
    if streaming.window is None and len(token_ids) > context:
        return fail(command, f"--text is {len(token_ids)} tokens, longer than the model's context ({context}): "
                     f"pass --max-tokens {context} to score its first {context}, or --kv-window W to stream past it")
    bar = _Progress()
    try:
        result = perplexity(loaded, token_ids, chunk=args.chunk, streaming=streaming,
                            progress=lambda done: bar("perplexity", done, len(token_ids)),
                            kv_cache_dtype=args.kv_cache_dtype, kv_cache_scales=args.kv_cache_scales)
    except ValueError as error:  # a device without fp8, or scales that do not fit the model
        return fail(command, str(error))
    bar.close()
    dtype = str(loaded.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    print(f"{args.model} ({dtype}, {loaded.model.inv_freq.device}), {streaming.describe()}, chunks of {args.chunk}")
    if result.kv_scales is not None:
        print(f"  KV cache {result.kv_cache_dtype}, scales {result.kv_scales['source']}: {result.kv_scales['detail']}")
    print(f"  perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.5f} nats) over {result.tokens_scored} "
          f"tokens scored of {result.num_tokens}")
    print(f"  {result.tokens_per_s:.1f} tokens/s ({result.seconds:.2f} s)")
    print(f"  KV blocks of {result.block_size} tokens: {result.blocks_held} held at the end, peak {result.peak_blocks}"
          f" of a {result.num_blocks}-block pool, {result.window_evicted_blocks} released by the window")
    buckets = result.buckets(args.bucket)
    if args.json is not None:
        _write_json(args.json, {"command": "eval perplexity", **_disclosure(args, loaded, text, len(token_ids)),
                                "result": result.summary(), "buckets": buckets})
    if args.plot is not None:
        from ioattn.eval.streaming import plot_curves

        marks = {} if streaming.window is None else {f"window {streaming.window}": streaming.window}
        if result.num_tokens > context:
            marks[f"context {context}"] = context
        plot_curves({streaming.describe(): buckets}, args.plot, marks=marks,
                    title=f"{args.model}: perplexity by position, {streaming.describe()}, per {args.bucket} tokens")
    return 0


# -- streaming -----------------------------------------------------------------------------------------------


def _streaming(args, loaded, token_ids, text, command) -> int:
    from ioattn.bench.harness import markdown_table
    from ioattn.eval.streaming import plot_curves, streaming_experiment

    bar = _Progress()
    try:
        result = streaming_experiment(loaded, token_ids, window=args.window, sinks=args.sinks, chunk=args.chunk,
                                      progress=bar, kv_cache_dtype=args.kv_cache_dtype,
                                      kv_cache_scales=args.kv_cache_scales)
    except ValueError as error:
        return fail(command, str(error))
    bar.close()
    for name, run in result.runs.items():
        print(f"{result.label(name)}: perplexity {run.perplexity:.4f} over {run.tokens_scored} tokens, "
              f"{run.tokens_per_s:.1f} tokens/s ({run.seconds:.1f} s), KV blocks peak {run.peak_blocks}, "
              f"{run.blocks_held} at the end")
    header, rows = result.table(args.table_bucket)
    print()
    print(markdown_table(header, rows))
    if args.json is not None:
        runs = {name: {"summary": run.summary(), "buckets": run.buckets(args.bucket)}
                for name, run in result.runs.items()}
        _write_json(args.json, {"command": "eval streaming", **_disclosure(args, loaded, text, len(token_ids)),
                                "window": args.window, "sinks": args.sinks, "runs": runs,
                                "table": {"bucket": args.table_bucket, "header": header, "rows": rows}})
    if args.plot is not None:
        curves = {result.label(name): run.buckets(args.bucket) for name, run in result.runs.items()}
        marks = {f"window {args.window}": args.window}
        if len(token_ids) > result.context:
            marks[f"context {result.context}"] = result.context
        plot_curves(curves, args.plot, marks=marks, reference=result.label("full"),
                    title=f"StreamingLLM on {args.model}: perplexity by position, per {args.bucket} tokens")
    return 0
