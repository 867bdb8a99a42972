"""The offline half of `ioattn bench serve`: one workload through several systems in this process, side by side.

Systems (`--compare`, any of them, run one after the other so they never share the device):

- `ioattn`: `ioattn.LLM` with continuous batching; its engine is stepped here (`add_request` every request at
  once, then `step()` until done: the loop of `LLM.generate`) so the KV manager can be read after every step.
- `static`: the same with `scheduling="static"`, the seeds' baseline: a new batch starts only when the last one
  has finished, and admission reserves `max_model_len` tokens per sequence.
- `hf`: transformers' continuous batching (the manager behind `generate_batch`, with its defaults and the same
  workload hints `generate_batch` gives it) on a transformers model built from our config (`ModelConfig.to_hf()`)
  holding a copy of the SAME weights as ours (bit for bit). Requests are added one by one so each gets its own
  `max_new_tokens`; EOS is disabled (`eos_token_id=-1`, i.e. ignore_eos). On a CPU, transformers can only size its
  cache through psutil, and would take 90% of the free RAM: the bench then gives it an explicit cache that holds
  the whole workload at once and says so.
- `hf-generate`: transformers' plain `generate` on the model transformers loads itself from the same file as ours
  (`from_pretrained(folder, gguf_file=name)` for a GGUF, the folder for a checkpoint; a random-weight preset gets
  the `hf` twin), in the same dtype: static batches of up to `--max-num-seqs` requests in their order, left-padded
  with the attention mask, each batch run to its longest output with EOS disabled; a request's tokens are counted
  up to its own length and timed by its batch's steps. The peer the CPU bar compares with (>= 1.5x, at the same
  `torch.get_num_threads()`, which a CPU run reports).

Every system first runs a warm-up workload (`WARMUP_REQUESTS` other random prompts of the same length range, a few
output tokens each: it compiles every Triton specialization and torch path the real run will take, without
seeding the prefix cache with the measured prompts), after its own warm-up (our CUDA graphs, transformers' graph
capture). Timing starts when the measured requests are added and ends when the last one finishes; TTFT and
latency count from when a request was added.

Per system: output tok/s, TTFT / TPOT / latency percentiles, and for ours preemptions, prefix-cache hit rate and
KV utilization: per step, the share of committed KV slots that hold a token (committed = allocated blocks for
continuous batching; the max-length reservations of running sequences for static), averaged over steps, plus the
peak share of the whole pool in use.

Roofline (`--decode-batch B`, default 64): on the continuous engine, B requests whose prompts have the workload's
mean context (mean prompt length + half the mean output length) are prefilled, then DECODE_STEPS consecutive
engine steps with those B decodes running are timed as the engine runs them, the device synchronized only before
the first and after the last: the step period is the total over the steps (see `time_decode_step`). The bound
of such a step is (weight bytes read + KV bytes read) / the device-copy bandwidth measured in this run; on a
CPU: n/a. Under tensor parallelism the bytes are rank 0's shard (every rank reads its own share at once).

Beyond one process (`--tp 1,2`, `--disagg`): the workload is paced as the server run is (`Pacing`: Poisson
arrivals at `--request-rate`, or at most `--concurrency` unfinished, else all at once); a request's TTFT counts
from its arrival time (its Poisson time, or when its concurrency slot freed), also when it waits for a step to
end before being added. `run_tp_sweep` runs our continuous engine at each TP size, all eager (TP steps have no
CUDA graphs, so TP 1 is eager too: the ratio is TP's alone). `run_disaggregated` runs the colocated `LLMEngine`,
then the `DisaggregatedEngine` pair (prefill worker on GPU 1, decode on GPU 0) with the same settings. Rows are
compared with the first one (ours / it) and, when greedy, by first-token agreement (1.0 expected: the same
weights and the same exact arithmetic up to the all-reduce order).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import random
import statistics
import time
from dataclasses import dataclass
from math import ceil

import torch

from ioattn.bench.workload import (PROMPT_ID_RANGE, Result, WorkItem, arrival_offsets, step_times, summarize,
                                   warmup_workload)

SYSTEMS = ("ioattn", "static", "hf", "hf-generate")
# Timed engine steps for the batch-B decode measurement, after as many untimed ones.
DECODE_STEPS = 20


def _llm(args, scheduling: str, tensor_parallel_size: int, enforce_eager: bool = False):
    from ioattn.llm import LLM

    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_blocks=args.num_blocks,
               gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
               device=args.device, scheduling=scheduling, tensor_parallel_size=tensor_parallel_size,
               enforce_eager=enforce_eager, async_scheduling=_async_scheduling(args),
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def _async_scheduling(args) -> bool | None:
    """--no-async-scheduling: False; else the engine's default (on for a single-process CUDA engine)."""
    return False if getattr(args, "no_async_scheduling", False) else None


def release_device() -> None:
    """Free what a finished system left on the device (garbage, the caching allocator's blocks) before the next one
    starts (a benchmark hook: `lab/` uses it too)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Pacing:
    """When requests are added: at these offsets (seconds after the start), at most `concurrency` unfinished."""

    offsets: list[float]
    concurrency: int | None = None

    @classmethod
    def all_at_once(cls, work: list[WorkItem]) -> Pacing:
        return cls([0.0] * len(work))

    @classmethod
    def from_args(cls, work: list[WorkItem], args) -> Pacing:
        return cls(arrival_offsets(len(work), args.request_rate, args.seed), args.concurrency)


# -- ioattn (continuous and static) -------------------------------------------------------------------------------


def run_ioattn(work: list[WorkItem], warmup: list[WorkItem], args, scheduling: str, decode_batch: int = 0, *,
               tensor_parallel_size: int = 1, enforce_eager: bool = False, pacing: Pacing | None = None) -> dict:
    """The workload through `LLM(..., scheduling=scheduling)` (all at once unless paced); with `decode_batch`, then
    the batch-B decode step."""
    llm = _llm(args, scheduling, tensor_parallel_size, enforce_eager)
    try:
        run_engine(llm.engine, warmup, args.temperature, Pacing.all_at_once(warmup))
        result = run_engine(llm.engine, work, args.temperature, pacing or Pacing.all_at_once(work))
        if decode_batch:
            result["decode_step"] = time_decode_step(llm, work, decode_batch)
        return result
    finally:
        llm.shutdown()
        del llm
        release_device()


def run_engine(engine, work: list[WorkItem], temperature: float, pacing: Pacing) -> dict:
    """Add each request when its pacing allows (its arrival time: its offset, or when a concurrency slot freed),
    step until all finished; the KV manager is read after every step. Returns the `summarize` figures plus
    preemptions, prefix hit rate, KV utilization and pool usage, steps, overlapped steps and each request's first
    token, and the KV pool's size (tokens, bytes per token, the workload's requests it holds whole, the most
    that ran at once). A benchmark hook: any `LLMEngine` (`LLM(...).engine`) runs through it, as `lab/explore9.py`
    does."""
    from ioattn.engine.sampling import SamplingParams

    before = engine.kv.stats()
    preemptions_before = engine.scheduler.num_preemptions
    overlapped_before = engine.num_overlapped_steps
    timed_before = (engine.step_seconds, engine.device_wait_seconds)
    static = engine.scheduler_config.mode == "static"
    reserved_slots_per_seq = ceil(engine.max_model_len / engine.kv.block_size) * engine.kv.block_size
    pool_slots = engine.kv.num_blocks * engine.kv.block_size
    utilization, pool_usage, running = [], [], []
    outputs = {}
    added = 0
    start = time.monotonic()
    while added < len(work) or engine.has_unfinished_requests():
        now = time.monotonic()
        while (added < len(work) and start + pacing.offsets[added] <= now
               and (pacing.concurrency is None or added - len(outputs) < pacing.concurrency)):
            item = work[added]
            params = SamplingParams(max_tokens=item.output_len, ignore_eos=True, temperature=temperature,
                                    output_kind="final_only")
            arrival = start + pacing.offsets[added] if pacing.concurrency is None else now
            engine.add_request(f"bench-{added}", params=params, prompt_token_ids=item.prompt_token_ids,
                               arrival_time=arrival)
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pacing.offsets[added] - time.monotonic()))
            continue
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
        stats = engine.kv.stats()
        committed = stats.sequences_running * reserved_slots_per_seq if static else stats.slots_allocated
        if committed:
            utilization.append(stats.tokens_held / committed)
        pool_usage.append(stats.blocks_used / engine.kv.num_blocks)
        running.append(stats.sequences_running)
    duration = time.monotonic() - start

    results = []
    for i in range(len(work)):
        output = outputs[f"bench-{i}"]
        if output.error is not None:
            results.append(Result(False, error=output.error))
            continue
        m = output.metrics
        results.append(Result(True, ttft=m.time_to_first_token, latency=m.finished_time - m.arrival_time,
                              output_tokens=len(output.outputs[0].token_ids)))
    after = engine.kv.stats()
    queried = after.prefix_query_tokens - before.prefix_query_tokens
    return {
        **summarize(results, duration),
        "preemptions": engine.scheduler.num_preemptions - preemptions_before,
        "prefix_hit_rate": (after.prefix_hit_tokens - before.prefix_hit_tokens) / queried if queried else 0.0,
        "kv_utilization_mean": statistics.fmean(utilization) if utilization else None,
        "kv_pool_usage_peak": max(pool_usage, default=0.0),
        "kv_pool_tokens": pool_slots,
        "kv_bytes_per_token": engine.settings.block_bytes / engine.kv.block_size,
        # the pool's tokens over a request's whole length (prompt + output), at this workload's mean
        "requests_in_pool": pool_slots / statistics.fmean(len(w.prompt_token_ids) + w.output_len for w in work)
        if work else None,
        "running_peak": max(running, default=0),
        "kv_cache_dtype": engine.attention.describe()["cache_dtype"],
        "kv_cache_layout": engine.attention.cache_layout,
        "overlapped_steps": engine.num_overlapped_steps - overlapped_before,
        **step_times(len(pool_usage), engine.step_seconds - timed_before[0],
                     engine.device_wait_seconds - timed_before[1], duration),
        "first_tokens": [_first(outputs[f"bench-{i}"].outputs[0].token_ids) if outputs[f"bench-{i}"].outputs
                         else None for i in range(len(work))],
    }


def _first(token_ids: list[int]) -> int | None:
    return token_ids[0] if token_ids else None


# -- the batch-B decode step and its roofline bound ---------------------------------------------------------------


def mean_context(work: list[WorkItem]) -> int:
    """The mean number of tokens a decode attends over in this workload: mean prompt + half the mean output."""
    prompt = statistics.fmean(len(w.prompt_token_ids) for w in work)
    return round(prompt + statistics.fmean(w.output_len for w in work) / 2)


def time_decode_step(llm, work: list[WorkItem], batch: int) -> dict:
    """The steady-state period of engine steps with `batch` decodes running at about the workload's mean context.

    Timed: DECODE_STEPS consecutive `step()` calls (after as many untimed ones), the device synchronized once
    before the first call and once after the last, never in between: an asynchronously scheduled engine queues
    step t+1 before it finishes step t on the host, and a synchronization around each step would hide that
    overlap (for a synchronous engine both ways time the same). `step_ms` is that total over DECODE_STEPS: the
    period at which the engine completes decode steps. `step_ms_median` is the median wall time of one `step()`
    call in that run (from its start to its return, no synchronization); in the steady state the two agree, and
    `step_over_bound` uses the period.

    Prompts are shorter than that context by the tokens generated before mid-measurement, so the timed steps
    straddle it. The requests never stop by themselves (they are aborted after the timing), so the batch cannot
    shrink while it is timed; prompts prefilled early decode while later ones prefill, so the context actually
    measured is the mean over the requests, reported as such."""
    from ioattn.engine.attention import PagedAttention
    from ioattn.engine.sampling import SamplingParams

    engine = llm.engine
    context = mean_context(work)
    prompt_len = max(1, context - 1 - DECODE_STEPS - DECODE_STEPS // 2)
    if batch > engine.scheduler_config.max_num_seqs:
        raise ValueError(f"decode_batch ({batch}) must be <= max_num_seqs ({engine.scheduler_config.max_num_seqs})")
    rng = random.Random(len(work))
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(f"decode-{i}", params=params,
                              prompt_token_ids=[rng.randrange(PROMPT_ID_RANGE) for _ in range(prompt_len)])
           for i in range(batch)]
    preemptions_before = engine.scheduler.num_preemptions
    generated: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                raise ValueError(f"max_model_len ({engine.max_model_len}) is too short to time decodes at context "
                                 f"{context}: a request reached it")
            generated[out.request_id] = len(out.outputs[0].token_ids) if out.outputs else 0

    while sum(n > 0 for n in generated.values()) < batch:  # prefill every prompt: then each step is `batch` decodes
        step()
    for _ in range(DECODE_STEPS):
        step()
    start_mean = statistics.fmean(generated.values())
    cuda = engine.runner.device.type == "cuda"
    overlapped_before = engine.num_overlapped_steps
    times = []
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    period_ms = (time.perf_counter() - start) * 1e3 / DECODE_STEPS
    measured_context = prompt_len + (start_mean + statistics.fmean(generated.values())) / 2
    for request_id in ids:
        engine.abort_request(request_id)
    model = engine.model
    dtype = model.model.embed_tokens.weight.dtype
    weight_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    if not model.config.tie_word_embeddings:  # a decode step reads only its B rows of the embedding table
        rows = model.model.embed_tokens.weight.shape[0]  # this rank's share under tensor parallelism
        weight_bytes -= (rows - min(batch, rows)) * model.config.hidden_size * dtype.itemsize
    kv_bytes = round(batch * measured_context * PagedAttention.block_bytes(model.config, 1,
                                                                           engine.attention.cache_dtype))
    return {"batch": batch, "context_mean": measured_context, "step_ms": period_ms,
            "step_ms_median": statistics.median(times), "steps_timed": len(times),
            "overlapped_steps": engine.num_overlapped_steps - overlapped_before, "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes, "preempted": engine.scheduler.num_preemptions != preemptions_before}


def add_roofline(decode_step: dict, copy_tbps: float | None) -> None:
    """The bound (weight + KV bytes) / bandwidth and the measured step's ratio to it; n/a without a bandwidth."""
    if copy_tbps is None:
        decode_step.update(bound_ms=None, step_over_bound=None, bound_note="n/a: no device-copy bandwidth on a CPU")
        return
    bound_ms = (decode_step["weight_bytes"] + decode_step["kv_bytes"]) / (copy_tbps * 1e12) * 1e3
    decode_step.update(bound_ms=bound_ms, step_over_bound=decode_step["step_ms"] / bound_ms,
                       bound_note=f"(weight + KV bytes) / {copy_tbps:.3g} TB/s device copy measured in this run")


# -- transformers -------------------------------------------------------------------------------------------------


def hf_twin(loaded):
    """A transformers model of our config holding a copy of our model's weights (HF names from our layout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = loaded.model
    hf_config = loaded.config.to_hf()
    config = AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    dtype = ours.model.embed_tokens.weight.dtype
    with torch.device(ours.inv_freq.device):
        twin = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = dict(ours.named_parameters())
    twin.load_state_dict({name: params[param][start:end] for name, (param, start, end)
                          in ours.checkpoint_layout().items()}, strict=True)
    return twin.eval()


def run_hf(work: list[WorkItem], warmup: list[WorkItem], args) -> dict:
    """The workload through transformers' continuous batching; {"status": why} when it cannot run here."""
    from ioattn.models.loader import load_model

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    cpu = loaded.model.inv_freq.device.type == "cpu"
    if cpu and importlib.util.find_spec("psutil") is None:
        return {"status": "unsupported: transformers' continuous batching needs psutil to size its cache on a CPU "
                          "(not installed)"}
    model = None
    try:
        model = hf_twin(loaded)
        del loaded  # the twin holds its own copy: our model's memory goes back before the twin sizes its cache
        release_device()
        return _run_hf(model, work, warmup, args, cpu)
    except Exception as error:  # noqa: BLE001 — a peer that cannot run is reported, not fatal
        return {"status": f"unsupported: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"}
    finally:
        del model
        release_device()


def _run_hf(model, work: list[WorkItem], warmup: list[WorkItem], args, cpu: bool) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": None, "top_p": 1.0} \
        if args.temperature > 0 else {"do_sample": False}
    max_new = max(w.output_len for w in work)
    generation_config = GenerationConfig(max_new_tokens=max_new, eos_token_id=-1, **sampling)
    hints = WorkloadHints(max_prompt_length=max(len(w.prompt_token_ids) for w in work),
                          max_generated_length=max_new, num_requests=len(work))
    cb_config, note = None, "transformers' defaults"
    if cpu:
        block = ContinuousBatchingConfig().block_size
        blocks = sum(ceil((len(w.prompt_token_ids) + w.output_len) / block) for w in work)
        cb_config = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=2048)
        note = f"CPU: explicit cache of {blocks} blocks of {block} (the whole workload), max_batch_tokens 2048"
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config, block=True, timeout=5,
        workload_hints=hints,
    ) as manager:
        attention = model.config._attn_implementation
        _hf_outputs(manager, warmup, "warmup")
        start = time.perf_counter()
        outputs = _hf_outputs(manager, work, "bench")
        duration = time.perf_counter() - start
    results = []
    for i in range(len(work)):
        output = outputs.get(f"bench-{i}")
        if output is None or output.error is not None:
            results.append(Result(False, error="no result" if output is None else str(output.error)))
            continue
        stamps = output.timestamps or [output.lifespan[1]]
        results.append(Result(True, ttft=stamps[0] - output.created_time,
                              latency=output.lifespan[1] - output.created_time,
                              output_tokens=len(output.generated_tokens)))
    first_tokens = [_first(outputs[f"bench-{i}"].generated_tokens) if f"bench-{i}" in outputs else None
                    for i in range(len(work))]
    return {**summarize(results, duration), "attention": attention, "cache": note, "first_tokens": first_tokens}


def _hf_outputs(manager, work: list[WorkItem], prefix: str) -> dict:
    """Add every request (its own max_new_tokens, no EOS) and wait for all; finished outputs by request id."""
    for i, item in enumerate(work):
        manager.add_request(item.prompt_token_ids, request_id=f"{prefix}-{i}", max_new_tokens=item.output_len,
                            record_timestamps=True, eos_token_id=-1)
    outputs = {}
    while len(outputs) < len(work):
        output = manager.get_result(timeout=1)
        if output is not None and output.is_finished():
            outputs[output.request_id] = output
        elif output is None and not manager.is_running():
            break  # the generation thread died: the missing requests are reported as failed
    return outputs


def run_hf_generate(work: list[WorkItem], warmup: list[WorkItem], args) -> dict:
    """The workload through transformers' `generate`: static batches of up to max_num_seqs requests in their order
    (left-padded, attention_mask given), each run to its longest output (EOS disabled), on a model transformers
    loads from the same file as ours (`_generate_model`); {"status": why} when it cannot run."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model, source = _generate_model(args, device)
    except Exception as error:  # noqa: BLE001 — a peer that cannot run is reported, not fatal
        return {"status": f"unsupported: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"}
    try:
        _generate_batches(model, warmup, args, time.perf_counter())
        start = time.perf_counter()
        results, first_tokens = _generate_batches(model, work, args, start)
        duration = time.perf_counter() - start
        attention = model.config._attn_implementation
    finally:
        del model
        release_device()
    return {**summarize(results, duration), "attention": f"{attention}; {source}",
            "cache": f"DynamicCache; static batches of up to {args.max_num_seqs} requests, left-padded",
            "first_tokens": first_tokens}


def _generate_model(args, device: torch.device):
    """(model, how it was loaded): transformers' own loading of our model's file, a GGUF (a packaged preset or a
    path, `from_pretrained(folder, gguf_file=name)`) or a checkpoint folder, in the dtype ours resolves; a
    random-weight preset has no file, so it gets `hf_twin` (a copy of our weights)."""
    from transformers import AutoModelForCausalLM

    from ioattn.models.checkpoint import resolve_dtype
    from ioattn.models.config import ModelConfig
    from ioattn.models.gguf import GGUFFile, read_config
    from ioattn.models.loader import load_model
    from ioattn.models.presets import PRESETS, PackagedGGUF

    name = args.model
    preset = PRESETS.get(name) if not os.path.exists(name) else None
    if isinstance(preset, PackagedGGUF):
        name = preset.path()
    elif preset is not None:
        return hf_twin(load_model(name, dtype=args.dtype, device=device)), "a copy of our random weights (hf_twin)"
    if os.path.isfile(name):
        folder, file = os.path.split(os.path.abspath(name))
        dtype = resolve_dtype(args.dtype, read_config(GGUFFile(name)), device)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype)
        how = f"from_pretrained(gguf_file={file!r}), {dtype}"
    else:
        dtype = resolve_dtype(args.dtype, ModelConfig.from_json(name), device)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        how = f"from_pretrained(checkpoint folder), {dtype}"
    return model.to(device).eval(), how


def _generate_batches(model, work: list[WorkItem], args, start: float) -> tuple[list[Result], list[int | None]]:
    """Every request through `generate`, batch after batch; a request's tokens arrive with its batch's steps (each
    step's time taken by a stopping criterion that never stops), from `start`, when all requests arrived."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepTimes(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = model.device
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": None, "top_p": 1.0} \
        if args.temperature > 0 else {"do_sample": False}
    results, first_tokens = [], []
    for offset in range(0, len(work), args.max_num_seqs):
        batch = work[offset:offset + args.max_num_seqs]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(batch):
            ids[row, width - len(item.prompt_token_ids):] = torch.tensor(item.prompt_token_ids)
            mask[row, width - len(item.prompt_token_ids):] = 1
        steps = StepTimes()
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), pad_token_id=0,
                                 max_new_tokens=max(w.output_len for w in batch), eos_token_id=-1,
                                 stopping_criteria=StoppingCriteriaList([steps]), **sampling)
        for row, item in enumerate(batch):
            results.append(Result(True, ttft=steps.times[0] - start, latency=steps.times[item.output_len - 1] - start,
                                  output_tokens=item.output_len))
            first_tokens.append(int(out[row, width]))
    return results, first_tokens


# -- all of them -----------------------------------------------------------------------------------------------


def run_systems(work: list[WorkItem], args, systems: list[str]) -> dict:
    """Each system's summary, the ratios of ours to the others, and the batch-B decode step with its roofline."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out: dict = {"systems": {}}
    copy_tbps = None
    if device.startswith("cuda") and "ioattn" in systems and args.decode_batch:
        from ioattn.bench.harness import measure_ceilings, parse_dtype

        dtype = torch.bfloat16 if args.dtype == "auto" else parse_dtype(args.dtype)
        out["ceilings"] = measure_ceilings(device, [dtype])
        copy_tbps = out["ceilings"]["copy_tbps"]
    warmup = warmup_workload(work, args.seed)
    for name in systems:
        if name == "hf":
            out["systems"][name] = run_hf(work, warmup, args)
        elif name == "hf-generate":
            out["systems"][name] = run_hf_generate(work, warmup, args)
        else:
            decode_batch = args.decode_batch if name == "ioattn" else 0
            out["systems"][name] = run_ioattn(work, warmup, args, "continuous" if name == "ioattn" else "static",
                                              decode_batch, tensor_parallel_size=args.tp[0])
    ours = out["systems"].get("ioattn", {})
    if "decode_step" in ours:
        out["decode_step"] = ours.pop("decode_step")
        add_roofline(out["decode_step"], copy_tbps)
    first_tokens = {name: result.pop("first_tokens", None) for name, result in out["systems"].items()}
    for peer in ("hf", "hf-generate", "static"):
        theirs = out["systems"].get(peer, {})
        if ours.get("output_tokens_per_s") and theirs.get("output_tokens_per_s"):
            out[f"ioattn_over_{peer}"] = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        if args.temperature == 0:
            _add_agreement(theirs, first_tokens.get("ioattn"), first_tokens.get(peer))
    if "ioattn_over_hf-generate" in out:
        out["notes"] = [f"ioattn / hf-generate output throughput: {out['ioattn_over_hf-generate']:.2f}x (bar on a "
                        f"CPU: >= 1.5)"]
    if device == "cpu":
        out.setdefault("notes", []).append(f"CPU threads: {torch.get_num_threads()} (torch.get_num_threads(), the "
                                           "same for every system of this run)")
    return out


def _add_agreement(run: dict, reference: list | None, tokens: list | None) -> None:
    """Same weights, same greedy rule: the first generated tokens agree but for rounding near-ties."""
    pairs = [(a, b) for a, b in zip(reference or [], tokens or []) if None not in (a, b)]
    if pairs:
        run["first_token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)


def _ratios(ours: dict, base: dict) -> dict:
    """ours / base for throughput and the latency percentiles (None where either is missing)."""
    keys = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")
    return {key: ours[key] / base[key] if ours.get(key) and base.get(key) else None for key in keys}


# -- tensor parallelism: TP 1 vs TP N, and disaggregated vs colocated -------------------------------------------


TP_NOTE = ("tensor-parallel steps run without CUDA graphs (the forward pass holds collectives), so every TP size, "
           "TP 1 included, runs eager here: the ratio is TP's own effect, not graphs vs no graphs")


def run_tp_sweep(work: list[WorkItem], args) -> dict:
    """The workload (paced by --request-rate / --concurrency) through our continuous engine at each `args.tp`
    size, eager; rows `ioattn-tpN`, ratios against the first size, greedy first-token agreement with it."""
    warmup, pacing = warmup_workload(work, args.seed), Pacing.from_args(work, args)
    systems = {f"ioattn-tp{size}": run_ioattn(work, warmup, args, "continuous", tensor_parallel_size=size,
                                              enforce_eager=True, pacing=pacing) for size in args.tp}
    return _side_by_side(systems, args.temperature, TP_NOTE)


DISAGG_NOTE = ("disaggregated: the prefill worker on its own process (GPU 1 on CUDA) ships each prompt's full KV "
               "blocks to the decode engine (GPU 0), whose prefix cache takes them in; colocated: one engine (GPU 0) "
               "with chunked prefill mixed into decode steps; TTFT counts from the request's arrival")


def run_disaggregated(work: list[WorkItem], args) -> dict:
    """The workload (paced by --request-rate / --concurrency) through the colocated `LLMEngine` and the
    `DisaggregatedEngine` pair, same settings; rows `colocated` and `disaggregated`, ratios disaggregated /
    colocated, and the KV blocks the prefill worker shipped.

    With Poisson arrivals, TTFT of the disaggregated pair is an upper bound: while its decode side has nothing to
    run, `step()` blocks until a transfer arrives, so requests arriving meanwhile reach the prefill worker late
    (their TTFT still counts from their arrival). `--concurrency` alone has no such wait: no slot frees then."""
    from ioattn.distributed import DisaggregatedEngine
    from ioattn.engine.config import EngineConfig
    from ioattn.engine.llm_engine import LLMEngine

    config = EngineConfig(dtype=args.dtype, max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                          device=args.device, async_scheduling=_async_scheduling(args),
                          kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    warmup, pacing = warmup_workload(work, args.seed), Pacing.from_args(work, args)
    systems = {}
    engine = LLMEngine(args.model, config)
    try:
        run_engine(engine, warmup, args.temperature, Pacing.all_at_once(warmup))
        systems["colocated"] = run_engine(engine, work, args.temperature, pacing)
    finally:
        del engine
        release_device()
    with DisaggregatedEngine(args.model, config) as engine:
        run_engine(engine, warmup, args.temperature, Pacing.all_at_once(warmup))
        shipped_before = engine.shipped_blocks
        systems["disaggregated"] = run_engine(engine, work, args.temperature, pacing)
        systems["disaggregated"]["shipped_blocks"] = engine.shipped_blocks - shipped_before
    del engine
    release_device()
    return _side_by_side(systems, args.temperature, DISAGG_NOTE)


def _side_by_side(systems: dict, temperature: float, note: str) -> dict:
    """Rows, each row's ratios to the first and (greedy) its first-token agreement with it, and the note."""
    first_tokens = {name: run.pop("first_tokens") for name, run in systems.items()}
    base, *others = systems
    ratios = {}
    for name in others:
        ratios[f"{name} / {base}"] = _ratios(systems[name], systems[base])
        if temperature == 0:
            _add_agreement(systems[name], first_tokens[base], first_tokens[name])
    return {"systems": systems, "ratios": ratios, "notes": [note]}
