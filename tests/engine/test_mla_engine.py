"""DeepSeek-V2/V3 (MLA) served on the latent paged cache: the engine's greedy tokens equal transformers' `generate`
on tiny random all-dense checkpoints (fp32) whatever the batching (batched requests and forks, chunked prefill,
prefix-cache hits, preemption by recompute and by swap, the Triton backend), every block comes back free, the cache
holds one [latent ‖ k_rope] row per token per layer, and what MLA does not support yet is refused by name."""

import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))

from engine_helpers import greedy, make_engine, run_all
from hf_checkpoints import save_hf_model
from ioattn.distributed import DisaggregatedEngine
from ioattn.distributed.tp import ShardPlan, load_tensor_parallel
from ioattn.engine.attention import PagedAttention, absorbed_max_query, latent_row_split
from ioattn.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
from ioattn.engine.llm_engine import LLMEngine
from ioattn.llm import LLM
from ioattn.models import LoadedModel, MLAProjection, expanded_attention, load_model
from ioattn.models.presets import PRESETS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("deepseek_v3", "deepseek_v2")
# At HF's init scale the tiny V2 model greedily repeats one token after most prompts; a wider init gives varied
# continuations, so that the comparison sees every step.
OVERRIDES = {"deepseek_v3": {}, "deepseek_v2": {"initializer_range": 0.25}}
STEPS = 8


@dataclass(eq=False)  # hashed by identity, for the cache of `expected`
class Checkpoint:
    family: str
    path: Path
    hf_model: object
    loaded: LoadedModel

    @functools.cache
    def expected(self, ids: tuple[int, ...], steps: int = STEPS) -> list[int]:
        """transformers' greedy continuation of one prompt, run alone."""
        out = self.hf_model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
        return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf_model = save_hf_model(request.param, path, **OVERRIDES[request.param])
    return Checkpoint(request.param, path, hf_model, load_model(path, dtype=torch.float32, device="cpu"))


def prompt(length: int, salt: int) -> list[int]:
    """Deterministic ids in [3, 96): past the tiny tokenizer's special tokens."""
    return [(salt * 37 + i * 11) % 93 + 3 for i in range(length)]


def route(engine, multi_token: str):
    """Send the engine's multi-token rows down one path: "absorbed" (the MLA kernel's multi-token queries) or
    "expanded" (the context's latents expanded, the varlen forward), whatever their length."""
    engine.attention.absorbed_max_query = {"absorbed": 1 << 30, "expanded": 0}[multi_token]
    return engine


@pytest.fixture(params=["absorbed", "expanded"])
def multi_token(request) -> str:
    return request.param


def serve(ckpt: Checkpoint, prompts: dict[str, list[int]], n: int = 1, multi_token: str = "absorbed",
          **engine_kwargs):
    """Run every prompt to STEPS greedy tokens (n samples each) on one engine whose multi-token rows take the
    `multi_token` path, check every sample against transformers and that every block is free afterwards; returns
    the engine."""
    engine = route(make_engine(model=engine_kwargs.pop("model", ckpt.loaded), **engine_kwargs), multi_token)
    for request_id, ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(STEPS, n=n))
    outputs = run_all(engine)
    for request_id, ids in prompts.items():
        got = [c.token_ids for c in outputs[request_id].outputs]
        assert got == [ckpt.expected(tuple(ids))] * n, (ckpt.family, request_id)
    return engine


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_greedy_matches_hf_generate(checkpoint, batched, multi_token):
    """One request alone, or four of different lengths and a fork (n=2, its shared partial block copied on write)
    in one batch."""
    prompts = {"alone": prompt(9, 1)}
    if batched:
        prompts.update({"short": prompt(3, 2), "mid": prompt(6, 3), "long": prompt(14, 4)})
    engine = serve(checkpoint, prompts, n=2 if batched else 1, multi_token=multi_token)
    assert (engine.kv.stats().cow_copies > 0) == batched


def test_chunked_prefill_matches_hf_generate(checkpoint, multi_token):
    """Prompts of 13 and 21 tokens prefill in chunks of a budget of 8, mixed with the other requests' decodes."""
    prompts = {"a": prompt(5, 5), "b": prompt(13, 6), "c": prompt(21, 7)}
    serve(checkpoint, prompts, max_num_batched_tokens=8, multi_token=multi_token)


def test_prefix_cache_hits_match_hf_generate(checkpoint, multi_token):
    system = prompt(16, 99)
    prompts = {f"s{i}": system + prompt(3 + i, 50 + i) for i in range(3)}
    engine = route(make_engine(model=checkpoint.loaded), multi_token)
    engine.add_request("warm", prompt_token_ids=prompts["s0"], params=greedy(STEPS))
    run_all(engine)
    for request_id, ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids=ids, params=greedy(STEPS))
    outputs = run_all(engine)
    assert engine.kv.stats().prefix_hit_tokens >= 3 * len(system)
    for request_id, ids in prompts.items():
        assert outputs[request_id].outputs[0].token_ids == checkpoint.expected(tuple(ids)), request_id


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_matches_hf_generate(checkpoint, preemption_mode, multi_token):
    # 5 sequences of up to 26 tokens want ~30 blocks of 4; the pool has 14.
    prompts = {f"p{i}": prompt(10 + 2 * i, 20 + i) for i in range(5)}
    engine = serve(checkpoint, prompts, num_blocks=14, max_model_len=32, max_num_batched_tokens=12,
                   preemption_mode=preemption_mode, swap_space=0.002, multi_token=multi_token)
    assert engine.scheduler.num_preemptions > 0
    assert (engine.kv.stats().swap_out_blocks > 0) == (preemption_mode == "swap")


def test_triton_backend_matches_hf_generate(checkpoint, device, multi_token):
    """reshape_and_cache into the latent cache, the MLA kernel (decode and multi-token queries) and the varlen entry
    point (Triton's interpreter on a CPU-only machine: a small batch), with a chunked prompt, decodes and swap
    preemption."""
    loaded = checkpoint.loaded if device == "cpu" else load_model(checkpoint.path, dtype=torch.float32, device=device)
    prompts = {"t0": prompt(11, 8), "t1": prompt(6, 9)}
    engine = serve(checkpoint, prompts, model=loaded, device=device, attention_backend="triton", num_blocks=6,
                   max_model_len=24, max_num_batched_tokens=8, preemption_mode="swap", swap_space=0.002,
                   multi_token=multi_token)
    assert engine.attention.backend == "triton" and engine.kv.stats().swap_out_blocks > 0


def test_real_latent_width_through_the_triton_path(device):
    """DeepSeek-V2-Lite's 512 + 64 latent row (written as 3 x 192, past reshape_and_cache's 256 head dim limit): a
    6-token prefill and one decode step of one layer against expanded attention over the same inputs."""
    config = PRESETS["deepseek-v2-lite-shape"].config.replace(num_layers=1, layer_sliding_windows=(None,), num_heads=2,
                                                               dtype=torch.float32)
    mla = config.mla
    assert latent_row_split(config.head_dim) == 3
    generator = torch.Generator().manual_seed(0)
    projection = MLAProjection(config.num_heads, mla).requires_grad_(False)
    projection.weight.copy_(torch.randn(projection.weight.shape, generator=generator) / mla.kv_lora_rank ** 0.5)
    projection = projection.to(device)
    tokens, heads = 7, config.num_heads
    inputs = [torch.randn(*shape, generator=generator).to(device) for shape in
              ((tokens, heads, mla.qk_nope_head_dim), (tokens, heads, mla.qk_rope_head_dim),
               (tokens, mla.kv_lora_rank), (tokens, mla.qk_rope_head_dim))]
    k_nope, v = projection.expand(inputs[2])
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    expected = expanded_attention(*inputs[:2], k_nope, inputs[3], v, cu, cu, tokens, tokens, projection.softmax_scale,
                                  backend="torch")
    attention = PagedAttention(config, num_blocks=4, block_size=4, dtype=torch.float32, device=device,
                               backend="triton")
    blocks = [2, 0]
    table = torch.tensor([blocks], dtype=torch.int32, device=device)

    def attend(rows: slice, cu_seqlens_q):
        """The step computing tokens `rows` of the sequence (a prefill chunk with cu_seqlens_q, else a decode)."""
        slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(rows.start, rows.stop)], device=device)
        seq_lens = torch.tensor([rows.stop], dtype=torch.int32, device=device)
        decode = cu_seqlens_q is None
        ctx = attention.step(slots, table, seq_lens, cu_seqlens_q, rows.stop - rows.start, decode_rows=int(decode),
                             table_widths=(2, 2), chunk_context_tokens=0 if decode else rows.stop)
        return ctx.attend_mla(*(t[rows] for t in inputs), 0, projection)

    prefill = attend(slice(0, 6), torch.tensor([0, 6], dtype=torch.int32, device=device))
    decode = attend(slice(6, 7), None)
    torch.testing.assert_close(prefill, expected[:6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode, expected[6:], rtol=1e-4, atol=1e-4)


def test_latent_layout_and_block_bytes(checkpoint):
    config = checkpoint.loaded.config
    mla = config.mla
    row = mla.kv_lora_rank + mla.qk_rope_head_dim
    engine = make_engine(model=checkpoint.loaded, preemption_mode="swap", swap_space=0.002)
    attention = engine.attention
    assert attention.caches_per_layer == 1 and attention.v_caches == [] and attention.cpu_v_caches == []
    assert len(attention.k_caches) == config.num_layers
    assert all(c.shape == (64, 4, 1, row) and c.dtype == torch.float32 for c in attention.k_caches)
    assert [c.shape[1:] for c in attention.cpu_k_caches] == [(4, 1, row)] * config.num_layers
    assert engine.settings.block_bytes == config.num_layers * 4 * row * 4  # layers x block x row x float32
    assert engine.stats()["attention"]["cache_layout"] == (
        f"latent {mla.kv_lora_rank} + rope {mla.qk_rope_head_dim} per token per layer, one cache")
    # The CPU pool, sized in bytes, holds as many blocks of these.
    pooled = LLMEngine(checkpoint.loaded, EngineConfig(device="cpu", block_size=4, max_model_len=64))
    assert pooled.settings.num_blocks == CPU_KV_CACHE_BYTES // engine.settings.block_bytes


def test_short_multi_token_rows_attend_absorbed_up_to_the_flop_crossover():
    """DeepSeek-V2/V3's shapes: expanding a context token costs 512 x (128 + 128) multiply-adds a head, a
    query-key pair 320 expanded against 1088 absorbed, so rows of up to 170 queries are cheaper absorbed."""
    assert absorbed_max_query(PRESETS["deepseek-v2-lite-shape"].config.mla) == 170
    engine = make_engine(model="tiny-mla")
    assert engine.attention.absorbed_max_query == 170


def test_latent_cache_holds_more_tokens_than_k_and_v():
    """DeepSeek-V2-Lite's 27 layers x 576 bf16 values per token against Llama-3.2-3B's 28 x 2 x 8 x 128."""
    deepseek, llama = PRESETS["deepseek-v2-lite-shape"].config, PRESETS["llama3.2-3b-shape"].config
    latent = PagedAttention.block_bytes(deepseek, 1, torch.bfloat16)
    assert latent == 27 * 576 * 2
    assert round(PagedAttention.block_bytes(llama, 1, torch.bfloat16) / latent, 2) == 3.69


def test_block_moves_cover_the_one_latent_cache(checkpoint):
    """Copy-on-write, swap out and in, and the export / import of disaggregated serving, on caches without a V."""
    config = checkpoint.loaded.config
    kwargs = dict(num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    source = PagedAttention(config, num_cpu_blocks=2, **kwargs)
    for cache in source.k_caches:
        cache.copy_(torch.randn_like(cache))
    before = [cache.clone() for cache in source.k_caches]
    source.copy_blocks([(3, 6)])
    source.swap([(5, 1)], [])
    source.swap([], [(1, 0)])
    for cache, old in zip(source.k_caches, before):
        assert torch.equal(cache[6], old[3]) and torch.equal(cache[0], old[5])
    kv = source.read_blocks([3, 5])
    assert kv.shape == (config.num_layers, source.caches_per_layer, 2, *source.k_caches[0].shape[1:])
    target = PagedAttention(config, **kwargs)
    target.write_blocks([7, 2], kv)
    for layer in range(config.num_layers):
        assert torch.equal(target.k_caches[layer][7], before[layer][3])
        assert torch.equal(target.k_caches[layer][2], before[layer][5])


def test_disaggregated_prefill_ships_latent_blocks(checkpoint):
    """A prefill worker process ships each prompt's full blocks (one latent cache per layer) to the decode side."""
    config = EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=64, max_model_len=64)
    prompts = [prompt(11, 12), prompt(9, 13)]
    with DisaggregatedEngine(str(checkpoint.path), config, timeout_s=60) as engine:
        for i, ids in enumerate(prompts):
            engine.add_request(f"d{i}", prompt_token_ids=ids, params=greedy(STEPS))
        outputs = run_all(engine)
        assert engine.shipped_blocks == 2 + 2
    for i, ids in enumerate(prompts):
        assert outputs[f"d{i}"].outputs[0].token_ids == checkpoint.expected(tuple(ids))


def test_llm_from_the_checkpoint_folder(checkpoint):
    llm = LLM(str(checkpoint.path), dtype="float32", device="cpu", block_size=4, num_blocks=64, max_model_len=64)
    prompts = [prompt(7, 10), prompt(4, 11)]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(STEPS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [checkpoint.expected(tuple(ids)) for ids in prompts]


def test_fp8_cache_is_refused_before_anything_is_built(checkpoint):
    config = EngineConfig(device="cpu", block_size=4, num_blocks=64, max_model_len=64, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=re.escape("kv_cache_dtype='fp8_e4m3' is not supported for MLA models yet")):
        LLMEngine(checkpoint.loaded, config)


@pytest.mark.parametrize("argument, value", [("kv_window", 8), ("kv_sinks", 4),
                                             ("kv_cache_dtype", torch.float8_e4m3fn)])
def test_attention_refuses_what_mla_lacks_naming_the_argument(checkpoint, argument, value):
    with pytest.raises(ValueError, match=f"{argument}=.*not supported for MLA models"):
        PagedAttention(checkpoint.loaded.config, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu",
                       **{argument: value})


def test_tensor_parallelism_is_refused(checkpoint):
    expected = r"tensor parallelism \(tensor_parallel_size=2\) is not supported for MLA models"
    with pytest.raises(ValueError, match=expected):
        ShardPlan(checkpoint.loaded.config, 0, 2)
    with pytest.raises(ValueError, match=expected):
        load_tensor_parallel(checkpoint.path, 0, 2, dtype="float32", device="cpu")


def test_warm_up_runs_every_mla_variant(device):
    """The start-up warm-up (on CUDA before serving; here called directly, under the interpreter on a CPU-only
    machine): the MLA kernel's decode and multi-token variants at every split count and the expanded path's
    forward, on the cache of one tiny-mla layer, which it only reads."""
    config = PRESETS["tiny-mla"].config.replace(num_layers=1, layer_sliding_windows=(None,))
    attention = PagedAttention(config, num_blocks=4, block_size=4, dtype=torch.float32, device=device,
                               backend="triton", max_num_seqs=2)
    attention.k_caches[0].copy_(torch.randn_like(attention.k_caches[0]))
    before = attention.k_caches[0].clone()
    attention.warm_up(config.num_heads, max_tokens=8)
    assert torch.equal(attention.k_caches[0], before)
