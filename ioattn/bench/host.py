"""`ioattn bench host`: the serving engine's host work per decode step, per sequence.

    ioattn bench host --batch 64 256                      # this machine's device (CUDA if there is one)
    ioattn bench host --device cpu --async-scheduling off # the synchronous engine on a CPU

The model is a preset (`--model`, default `tiny`) with its layers removed: embedding, final norm and LM head, so a
decode step is almost only host work (scheduling, the batch's layout and copies, kernel launches, sampling
bookkeeping, stop checks, detokenization, outputs). On a CPU the attention backend is "triton": the code path
CUDA takes on the host (with no layers no attention kernel runs, so Triton's interpreter never does).

B requests with random `--prompt-len` prompts decode greedily with ignore_eos; once every one of them has
decoded a token, `--steps` consecutive `step()` calls are timed (wall clock, no device synchronization in
between). On a CPU the model's forward pass and logits run on the host as well: their time (timers around
them) is subtracted; the sampler's few vocabulary-wide ops stay in (tens of microseconds for `tiny`), and torch
runs on one thread (these small ops gain nothing from more, and a thread waiting for a busy core stalls them
for milliseconds). On CUDA nothing is subtracted: the device's share of such a step takes microseconds, so
the step is the host's time (and, overlapped, its period). Reported per batch: the median host time of a step
and that over B, with the outputs built as `--output-kind` asks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import ioattn.kernels  # noqa: F401,I001  (first: on a CPU-only machine it selects the interpreter before triton loads)
import torch

from ioattn.bench.workload import PROMPT_ID_RANGE


def _engine(args, batch: int):
    from ioattn.engine.config import EngineConfig
    from ioattn.engine.llm_engine import LLMEngine
    from ioattn.models import build_model
    from ioattn.models.loader import LoadedModel, resolve_dtype
    from ioattn.models.presets import PRESETS, randomize_weights
    from ioattn.models.tokenizer import ByteTokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = PRESETS[args.model].config
    config = preset.replace(num_layers=0, layer_sliding_windows=())
    model = build_model(config, resolve_dtype("auto", preset, device), device)
    randomize_weights(model, seed=0, draw_device=device)
    tokenizer = ByteTokenizer()
    loaded = LoadedModel(model, tokenizer, config, tokenizer.eos_token_ids)
    max_model_len = args.prompt_len + 2 * args.steps + 64
    blocks_per_seq = -(-max_model_len // 16)
    config = EngineConfig(device=device, attention_backend="triton", max_model_len=max_model_len,
                          max_num_seqs=batch, num_blocks=2 * batch * blocks_per_seq,
                          async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
    return LLMEngine(loaded, config)


def measure(args, batch: int) -> dict:
    from ioattn.engine.sampling import SamplingParams

    engine = _engine(args, batch)
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2 * args.steps + 32,
                            output_kind=args.output_kind, logprobs=args.logprobs)
    for i in range(batch):
        engine.add_request(f"h{i}", params=params,
                           prompt_token_ids=[rng.randrange(PROMPT_ID_RANGE) for _ in range(args.prompt_len)])
    while not all(seq.num_tokens > args.prompt_len + 1 for r in engine.requests.values() for seq in r.seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    model, on_host = engine.model, engine.runner.device.type != "cuda"
    modelled = [0.0]

    def timed(fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                modelled[0] += time.perf_counter() - start
        return call

    if on_host:
        model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    overlapped_before = engine.num_overlapped_steps
    times = []
    for _ in range(args.steps):
        before, start = modelled[0], time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start - (modelled[0] - before))
    step_us = statistics.median(times) * 1e6
    return {"batch": batch, "host_us_per_step": step_us, "host_us_per_seq": step_us / batch,
            "steps_timed": len(times), "overlapped_steps": engine.num_overlapped_steps - overlapped_before,
            "device": str(engine.runner.device), "model_time_subtracted": on_host}


def to_markdown(rows: list[dict]) -> str:
    from ioattn.bench.harness import markdown_table

    keys = ["batch", "host_us_per_step", "host_us_per_seq", "overlapped_steps", "steps_timed"]
    return markdown_table(keys, [[row[key] for key in keys] for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ioattn bench host", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=700, help="tokens per prompt (the decode context)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per batch size")
    parser.add_argument("--model", default="tiny", choices=("tiny", "llama3-8b-shape"),
                        help="the preset whose vocabulary and hidden size are kept")
    parser.add_argument("--device", default=None)
    parser.add_argument("--output-kind", default="cumulative", choices=("cumulative", "final_only"))
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                        help="auto: the engine's default (on)")
    parser.add_argument("--json", help="write the results as JSON here")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
        torch.set_num_threads(1)
    try:
        rows = [measure(args, batch) for batch in args.batch]
    finally:
        torch.set_num_threads(threads)
    print(to_markdown(rows))
    if args.json:
        from ioattn.bench.harness import collect_disclosure, write_text

        disclosure = collect_disclosure(rows[0]["device"], "ioattn bench host " + " ".join(argv or sys.argv[1:]))
        write_text(args.json, json.dumps({"disclosure": disclosure, "settings": vars(args), "rows": rows},
                                         indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
