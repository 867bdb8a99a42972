"""Shared by the engine tests: the tiny model, a full-recompute greedy reference, and an engine driver."""

import contextlib
import dataclasses
import functools

import torch

from ioattn.engine.llm_engine import EngineConfig, LLMEngine
from ioattn.engine.sampling import BeamSearch, BeamSearchParams, SamplingParams
from ioattn.models import DenseCausalAttention, LoadedModel, build_model, dense_causal_attention, load_model
from ioattn.models.presets import randomize_weights


@functools.cache
def tiny(device="cpu", num_layers: int | None = None, sliding_window: int | None = None,
         dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The tiny preset in float32; `num_layers` cuts it down (for tests of slow paths such as the interpreter),
    `sliding_window` makes every layer attend to that many last positions (Mistral). float64 keeps the rounding
    of batch-shape-dependent matmuls far below float32's (the logits are float32 either way)."""
    loaded = load_model("tiny", dtype="float32", device=device)
    if num_layers is None and sliding_window is None and dtype == torch.float32:
        return loaded
    num_layers = num_layers or loaded.config.num_layers
    config = loaded.config.replace(num_layers=num_layers, layer_sliding_windows=(sliding_window,) * num_layers)
    model = build_model(config, dtype, device)
    randomize_weights(model, seed=0, draw_device="cpu")
    return dataclasses.replace(loaded, model=model, config=config)


def prompt(length: int, salt: int) -> list[int]:
    """A deterministic prompt of byte ids, different for each salt."""
    return [(salt * 37 + i * 11) % 250 + 1 for i in range(length)]


@torch.inference_mode()
def next_token_logits(ids: list[int], device="cpu", loaded: LoadedModel | None = None) -> torch.Tensor:
    """(vocab,) logits after `ids`, recomputing the whole sequence with dense causal attention (no KV cache)."""
    loaded = loaded or tiny(device)
    model = loaded.model
    model.attention = dense_causal_attention
    ctx = DenseCausalAttention.build([len(ids)], loaded.config, device, backend="torch")
    hidden = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ctx)
    return model.compute_logits(hidden[-1:])[0]


def reference_greedy(prompt_ids: list[int], max_tokens: int, device="cpu", loaded: LoadedModel | None = None):
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(next_token_logits(ids, device, loaded).argmax()))
    return ids[len(prompt_ids) :]


def reference_beam_search(prompt_ids: list[int], params: BeamSearchParams, max_model_len: int) -> list:
    """The n best beams of `BeamSearch` driven by full recomputation."""
    search = BeamSearch(params, eos_token_ids=tiny().eos_token_ids, prompt_len=len(prompt_ids),
                        max_model_len=max_model_len)
    while not search.done:
        search.step(torch.stack([next_token_logits(prompt_ids + beam.token_ids) for beam in search.running]))
    return search.best()


@functools.cache
def cached_reference(prompt_ids: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference_greedy(list(prompt_ids), max_tokens)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def make_engine(device="cpu", model: LoadedModel | None = None, **kwargs) -> LLMEngine:
    defaults = dict(block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    return LLMEngine(model or tiny(device), EngineConfig(device=device, **{**defaults, **kwargs}))


def run_all(engine: LLMEngine) -> dict:
    """Step until done; request id -> final RequestOutput. Checks that every block is free afterwards."""
    finished = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert_all_free(engine)
    return finished


def assert_all_free(engine: LLMEngine) -> None:
    engine.kv.check_invariants()
    stats = engine.kv.stats()
    assert stats.blocks_used == 0 and stats.cpu_blocks_used == 0, stats
    assert not engine.kv.seqs and not engine.scheduler.has_unfinished()


@contextlib.contextmanager
def kernels_compiled():
    """Yields the list of Triton kernels compiled inside the block, by name (GPU tests: none may compile while
    serving, since one compiled mid-step stalls it for seconds)."""
    from triton import knobs

    compiled = []
    previous = knobs.runtime.jit_cache_hook

    def record(*, fn, **_):
        compiled.append(fn.name)
        return False

    knobs.runtime.jit_cache_hook = record
    try:
        yield compiled
    finally:
        knobs.runtime.jit_cache_hook = previous
