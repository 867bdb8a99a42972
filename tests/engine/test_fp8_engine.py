"""The engine with an FP8 KV cache: pool sizing in bytes, where the scales come from (checkpoint, user, calibration)
and how bad ones are refused at start-up, the prefix-cache key, block moves (copy-on-write, swap, disaggregated
export/import) on fp8 blocks, and what stats() / explain report. CPU, the tiny preset and tiny HF checkpoints; the
real model's quality figures are in bench/results/2026-12-02-fp8-kv-smollm2-cpu.md (lab/fp8_smollm2_cpu.py)."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import pytest
import torch

from ioattn import LLM
from ioattn.engine.config import EngineConfig, resolve_settings
from ioattn.engine.kv_scales import HEADROOM, KVScales, calibrate, checkpoint_scales, resolve_kv_scales
from ioattn.engine.llm_engine import LLMEngine
from ioattn.engine.sampling import SamplingParams
from ioattn.eval import perplexity
from ioattn.kv import KVCacheManager
from ioattn.models.loader import load_model
from ioattn.ops.fp8 import KV_ROTATION, kv_rotation

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(20 + 5 * i)] for i in range(4)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the CPU path's many small ops run faster alone on shared cores (as tests/test_eval.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", device="cpu")


def engine(loaded, **kwargs) -> LLMEngine:
    settings = dict(device="cpu", num_blocks=96, block_size=4, max_model_len=128, max_num_seqs=4,
                    max_num_batched_tokens=32)
    return LLMEngine(loaded, EngineConfig(**{**settings, **kwargs}))


def run(eng: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[list[int]]]:
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}-{eng.num_steps}", params=params, prompt_token_ids=ids)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return [done[k] for k in sorted(done)]


def test_fp8_pool_holds_more_tokens_in_the_same_bytes(tiny):
    # The CPU default pool is a byte budget: fp8 holds 4x the blocks of float32 (2x those of a 16-bit cache).
    auto = resolve_settings(EngineConfig(device="cpu"), tiny)
    fp8 = resolve_settings(EngineConfig(device="cpu", kv_cache_dtype="fp8_e4m3"), tiny)
    assert auto.block_bytes == 4 * fp8.block_bytes
    assert fp8.num_blocks == 4 * auto.num_blocks
    assert fp8.cache_dtype == torch.float8_e4m3fn and auto.cache_dtype == torch.float32
    assert fp8.kv_scales.source == "calibrated" and auto.kv_scales is None


def test_fp8_engine_reports_its_cache_and_scales(tiny):
    eng = engine(tiny, kv_cache_dtype="fp8_e5m2")
    described = eng.stats()["attention"]
    assert described["cache_dtype"] == "fp8_e5m2"
    assert described["kv_scales"]["source"] == "calibrated" and "random token ids" in described["kv_scales"]["detail"]
    assert eng.attention.k_caches[0].dtype == torch.float8_e5m2
    assert eng.prefix_key == ("kv_cache", "fp8_e5m2", described["kv_scales"]["identity"])
    assert engine(tiny).stats()["attention"]["cache_dtype"] == "float32" and engine(tiny).prefix_key is None
    # Every layer's scales in an allocation of their own, 16-byte aligned like layer 0's (Triton specialises
    # kernels on pointer alignment: an odd layer's would compile a kernel of its own, mid-serving on CUDA).
    for scales in (eng.attention.k_scales, eng.attention.v_scales):
        assert len({t.data_ptr() for t in scales}) == len(scales) and all(t.data_ptr() % 16 == 0 for t in scales)


def test_calibration_rule_is_a_power_of_two_above_amax(tiny):
    scales = calibrate(tiny, torch.float8_e4m3fn)
    for s in (scales.k, scales.v):
        assert s.shape == (tiny.config.num_layers, tiny.config.num_kv_heads)
        exponents = torch.log2(s)
        assert torch.equal(exponents, exponents.round())  # powers of two: dequantization is exact
    # Recompute amax the same way the pass does: 448 / (2 x HEADROOM) < amax / scale <= 448 / HEADROOM.
    from ioattn.engine.kv_scales import _Recorder, calibration_tokens
    from ioattn.models.llama import DenseCausalAttention

    sequences, _ = calibration_tokens(tiny, tiny.max_model_len)
    ids = torch.tensor([t for seq in sequences for t in seq])
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences])
    assert scales.rotation == KV_ROTATION  # amax of the rotated values, which the cache holds
    recorder = _Recorder(DenseCausalAttention.build([len(s) for s in sequences], tiny.config, "cpu", backend="torch"),
                         tiny.config.num_layers, tiny.config.num_kv_heads, kv_rotation(tiny.config.head_dim))
    with torch.inference_mode():
        tiny.model(ids, positions, recorder)
    for amax, s in ((recorder.k_amax, scales.k), (recorder.v_amax, scales.v)):
        ratio = amax / s
        assert (ratio <= 448 / HEADROOM).all() and (ratio > 448 / (2 * HEADROOM)).all()


def test_user_scales_number_file_and_unit_warning(tiny, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        half = engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=0.5)
    assert half.attention.kv_scales.source == "user" and torch.all(half.attention.kv_scales.k == 0.5)
    with pytest.warns(UserWarning, match="uncalibrated"):
        unit = engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=1.0)
    assert unit.stats()["attention"]["kv_scales"]["source"] == "unit"
    layers, heads = tiny.config.num_layers, tiny.config.num_kv_heads
    good = tmp_path / "scales.json"
    good.write_text(json.dumps({"k_scale": [[0.25] * heads] * layers, "v_scale": [0.125] * layers}))
    from_file = engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(good))
    assert torch.all(from_file.attention.kv_scales.v == 0.125) and from_file.attention.kv_scales.source == "user"
    assert from_file.attention.kv_scales.rotation is None and from_file.attention.rotation is None
    rotated_file = tmp_path / "rotated.json"
    rotated_file.write_text(json.dumps({"k_scale": [0.25] * layers, "v_scale": [0.125] * layers,
                                        "rotation": KV_ROTATION}))
    assert engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(rotated_file)).attention.rotation is not None
    ones = torch.ones(layers, heads)
    for scales, message in ((KVScales(torch.ones(1, 1), ones, "user", ""), r"kv_cache_scales.k must be \(num_layers"),
                            (KVScales(ones, -ones, "user", ""), "finite and > 0"),
                            (KVScales(ones, ones, "user", "", "hadamard"), "kv_cache_scales.rotation must be")):
        with pytest.raises(ValueError, match=message):
            engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=scales)
    bad_cases = [
        ({"k_scale": [[0.25] * (heads + 1)] * layers, "v_scale": [1.0] * layers}, r"k_scale\[0\] must be a number "
                                                                                   f"or a list of {heads}"),
        ({"k_scale": [0.25] * (layers - 1), "v_scale": [1.0] * layers}, f"one entry per layer \\({layers}\\)"),
        ({"k_scale": [0.25] * layers, "v_scale": [1.0] * (layers - 1) + [-1.0]}, "finite and > 0"),
        ({"k_scale": [0.25] * layers}, "'k_scale' and 'v_scale'"),
        ({"k_scale": [0.25] * layers, "v_scale": [1.0] * layers, "rotation": "hadamard"}, "'rotation' must be null "
                                                                                            "or 'hadamard-signed'"),
    ]
    for data, message in bad_cases:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(bad))
    for setting, message in ((0.0, "kv_cache_scales must be"), (math.inf, "kv_cache_scales must be"),
                             (str(tmp_path / "missing.json"), "No such file")):
        with pytest.raises(ValueError, match=message):
            engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=setting)
    with pytest.raises(ValueError, match="kv_cache_scales must be None unless"):
        EngineConfig(kv_cache_scales=0.5)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="checkpoint carries no"):
        engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales="checkpoint")


def _checkpoint_with_scales(path, k_scales, v_scales):
    """A tiny HF llama folder whose model.safetensors also holds per-layer self_attn.k_scale / v_scale."""
    pytest.importorskip("transformers")
    from hf_checkpoints import save_hf_model
    from safetensors.torch import load_file, save_file

    save_hf_model("llama", path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for layer, (k, v) in enumerate(zip(k_scales, v_scales)):
        if k is not None:
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


def test_checkpoint_scales_are_loaded_and_mismatches_refused(tmp_path):
    # The tiny HF llama: 2 layers, 2 KV heads. Per-head K scales, per-tensor V scales (shape (1,)).
    path = _checkpoint_with_scales(tmp_path / "good", [[0.5, 0.25], [0.125, 1.0]], [[0.0625], [2.0]])
    loaded = load_model(path, dtype="float32", device="cpu")
    eng = engine(loaded, kv_cache_dtype="fp8_e4m3", max_model_len=64)
    scales = eng.attention.kv_scales
    assert scales.source == "checkpoint"
    assert scales.k.tolist() == [[0.5, 0.25], [0.125, 1.0]] and scales.v.tolist() == [[0.0625, 0.0625], [2.0, 2.0]]
    assert len(run(eng, [[1, 5, 9, 13, 17, 21, 25]])) == 1
    # "calibrate" overrides them; the auto engine ignores them.
    assert engine(loaded, kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
                  max_model_len=64).attention.kv_scales.source == "calibrated"
    assert engine(loaded, max_model_len=64).attention.kv_scales is None
    wrong_heads = load_model(_checkpoint_with_scales(tmp_path / "heads", [[0.5, 0.25, 1.0], [1.0]], [[1.0], [1.0]]),
                             dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale has shape \(3,\).*per KV head \(2"):
        engine(wrong_heads, kv_cache_dtype="fp8_e4m3", max_model_len=64)
    missing_layer = load_model(_checkpoint_with_scales(tmp_path / "layers", [[1.0], None], [[1.0], [1.0]]),
                               dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"do not match the model's 2 layers: missing \['model.layers.1.self_attn"):
        engine(missing_layer, kv_cache_dtype="fp8_e4m3", max_model_len=64)
    with pytest.raises(ValueError, match="finite and > 0"):
        checkpoint_scales({f"model.layers.0.self_attn.{k}": torch.tensor([0.0]) for k in ("k_scale", "v_scale")}, 1, 2)


def test_prefix_cache_key_separates_formats_and_scales():
    kv = KVCacheManager(16, 4)
    tokens = list(range(1, 14))
    key_a = ("kv_cache", "fp8_e4m3", "aaaa")
    assert kv.allocate("a", tokens, key_a) == 0
    kv.mark_computed("a", len(tokens))
    kv.free("a")
    assert kv.allocate("same", tokens, key_a) == 12  # three full blocks, the last token's block excluded
    assert kv.allocate("other-scales", tokens, ("kv_cache", "fp8_e4m3", "bbbb")) == 0
    assert kv.allocate("other-dtype", tokens, None) == 0


def test_fp8_prefix_hits_cow_and_swap_match_a_plain_run(tiny):
    # Prefix-cache hits, copy-on-write forks (n=2) and swap preemption move fp8 blocks as bytes: the tokens are
    # those of a run with none of them (a pool large enough, nothing cached yet).
    params = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=8, ignore_eos=True)
    roomy = engine(tiny, kv_cache_dtype="fp8_e4m3")
    plain = run(roomy, PROMPTS, params)
    busy = engine(tiny, kv_cache_dtype="fp8_e4m3", num_blocks=24, max_model_len=48, preemption_mode="swap",
                  swap_space=0.01)
    assert run(busy, PROMPTS, params) == plain
    assert busy.kv.stats().swap_out_blocks > 0 and busy.kv.stats().cow_copies > 0
    assert roomy.kv.stats().prefix_hit_tokens == 0
    assert run(roomy, PROMPTS, params) == plain  # now from the prefix cache's fp8 blocks
    assert roomy.kv.stats().prefix_hit_tokens > 0


def test_fp8_with_tensor_parallelism_is_refused(tiny):
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        resolve_settings(EngineConfig(device="cpu", kv_cache_dtype="fp8_e4m3"), tiny, agree_num_blocks=lambda n: n)


def test_llm_keyword_and_explain(tiny):
    llm = LLM(tiny, kv_cache_dtype="fp8_e4m3", num_blocks=64, max_model_len=128, device="cpu")
    out = llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    attention = llm.engine.attention
    plan = attention.describe()
    assert plan["cache_dtype"] == "fp8_e4m3"
    import ioattn

    q = torch.zeros(1, tiny.config.num_heads, tiny.config.head_dim)
    text = str(ioattn.explain(q, attention.k_caches[0], attention.v_caches[0],
                              block_table=torch.zeros(1, 1, dtype=torch.int32),
                              seq_lens=torch.ones(1, dtype=torch.int32), k_scale=attention.k_scales[0],
                              v_scale=attention.v_scales[0]))
    assert "fp8_e4m3 KV cache" in text


def test_disaggregated_fp8_ships_fp8_blocks(tmp_path):
    pytest.importorskip("transformers")
    from hf_checkpoints import save_hf_model
    from ioattn.distributed import DisaggregatedEngine

    save_hf_model("llama", tmp_path)
    config = EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=64, max_model_len=64,
                          max_num_seqs=4, max_num_batched_tokens=8, kv_cache_dtype="fp8_e4m3")
    prompts = [[1, 4, 9, 16, 25, 36, 49, 64, 81, 3, 5], list(range(20, 32))]
    colocated = run(LLMEngine(str(tmp_path), config), prompts)
    with DisaggregatedEngine(str(tmp_path), config, timeout_s=60) as disagg:
        assert run(disagg, prompts) == colocated
        assert disagg.shipped_blocks == 4 and disagg.attention.k_caches[0].dtype == torch.float8_e4m3fn


def test_kvscales_identity_follows_the_values():
    a = KVScales(torch.ones(2, 3), torch.ones(2, 3), "user", "")
    b = KVScales(torch.ones(2, 3), torch.ones(2, 3) * 2, "user", "")
    assert a.identity() == KVScales(torch.ones(2, 3), torch.ones(2, 3), "calibrated", "x").identity()
    assert a.identity() != b.identity()


def test_junk_kv_cache_scales_fail_naming_the_setting(tiny, tmp_path):
    layers, heads = tiny.config.num_layers, tiny.config.num_kv_heads
    ones = torch.ones(layers, heads)
    not_json = tmp_path / "scales.txt"
    not_json.write_text("k_scale = 1")
    junk = [True, -1.0, math.nan, [], {}, object(), b"x", "", str(not_json), str(tmp_path),
            KVScales("k", ones, "user", ""), KVScales(ones, None, "user", ""),
            KVScales(ones * math.nan, ones, "user", ""), KVScales(ones, ones, "user", "", rotation=1)]
    for value in junk:
        with pytest.raises(ValueError, match="kv_cache_scales"):
            EngineConfig(kv_cache_dtype="fp8_e4m3", kv_cache_scales=value)
            resolve_kv_scales(tiny, torch.float8_e4m3fn, value)


def test_kv_rotation_matrix():
    for dim in (1, 2, 16, 64, 128, 256):
        m = kv_rotation(dim)
        assert m.dtype == torch.float32 and set(m.abs().unique().tolist()) == {1.0}  # exact in every dtype
        assert torch.equal(m @ m.T, dim * torch.eye(dim)) and torch.equal(m.T @ m, dim * torch.eye(dim))
        assert torch.equal(m, kv_rotation(dim))  # fixed: the prefix-cache key and exported blocks rely on it
    assert not torch.equal(kv_rotation(64)[:, 0].abs(), kv_rotation(64)[:, 0])  # signed: not all ones
    assert kv_rotation(48) is None and kv_rotation(0) is None


def test_rotated_cache_holds_rotated_values_and_matches_the_unrotated_run(tiny):
    # Calibrated scales rotate; the cache then holds K M / D quantized, and attention is rotated back: the logits
    # match an fp8 run without rotation to fp8's precision, and the prefix key tells the two apart.
    rotated = engine(tiny, kv_cache_dtype="fp8_e4m3")
    scales = rotated.attention.kv_scales
    assert scales.rotation == KV_ROTATION and rotated.stats()["attention"]["kv_scales"]["rotation"] == KV_ROTATION
    plain_scales = calibrate(tiny, torch.float8_e4m3fn, rotate=False)
    assert plain_scales.rotation is None and plain_scales.identity() != scales.identity()
    assert KVScales(scales.k, scales.v, "user", "").identity() != scales.identity()
    plain = engine(tiny, kv_cache_dtype="fp8_e4m3", kv_cache_scales=plain_scales)
    assert rotated.prefix_key != plain.prefix_key

    from ioattn.engine.attention import PagedAttention
    from ioattn.ops.fp8 import dequantize

    captured = {}

    class Capture:  # the model's K and V of layer 0 for the prompt, as the engine's attention receives them
        def __init__(self, attention):
            self.attention = attention

        def attend(self, q, k, v, layer_idx, ctx):
            if layer_idx == 0 and "k" not in captured:
                captured.update(k=k.clone(), v=v.clone())
            return PagedAttention.attend(self.attention, q, k, v, layer_idx, ctx)

    attention = rotated.attention
    original = attention.attend
    attention.attend = Capture(attention).attend
    try:
        run(rotated, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        attention.attend = original
    m, d = kv_rotation(tiny.config.head_dim), tiny.config.head_dim
    tokens = captured["k"].shape[0]
    for cache, scale, values in ((attention.k_caches[0], attention.k_scales[0], captured["k"]),
                                 (attention.v_caches[0], attention.v_scales[0], captured["v"])):
        expected = values @ m / d
        stored = dequantize(cache, scale, torch.float32).reshape(-1, *expected.shape[1:])
        # The prompt's rows sit somewhere in the pool: every expected row is found among the stored ones.
        distance = torch.cdist(expected.reshape(tokens, -1), stored.reshape(stored.shape[0], -1))
        nearest = distance.min(dim=1).values / expected.reshape(tokens, -1).norm(dim=1)
        assert (nearest < 0.07).all()  # e4m3's rounding (2^-4 relative at most), nothing more
    ids = [t for prompt in PROMPTS for t in prompt][:96]
    exact = perplexity(tiny, ids, chunk=32).perplexity
    for kv_scales in (scales, plain_scales):
        fp8 = perplexity(tiny, ids, chunk=32, kv_cache_dtype="fp8_e4m3", kv_cache_scales=kv_scales)
        assert fp8.kv_scales["rotation"] == kv_scales.rotation
        assert abs(fp8.perplexity / exact - 1) < 0.01, (kv_scales.rotation, fp8.perplexity, exact)


@pytest.mark.gpu
def test_fp8_engine_on_gpu_graphs_match_eager_and_compile_nothing_while_serving():
    from ioattn.kernels.paged_attention import paged_attention_kernel

    loaded = load_model("tiny", dtype="float32", device="cuda")  # float32 queries: graphs and eager round alike
    prompts = [[(5 * i + j) % 250 + 1 for j in range(40 + 30 * i)] for i in range(6)]
    settings = dict(device="cuda", kv_cache_dtype="fp8_e4m3", max_model_len=512, num_blocks=256)
    graphed = LLMEngine(loaded, EngineConfig(**settings))
    kernels = paged_attention_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(kernels)
    tokens = run(graphed, prompts)
    assert len(kernels) == compiled, "a paged kernel compiled while serving"
    assert graphed.stats()["attention"]["cache_dtype"] == "fp8_e4m3"
    assert run(LLMEngine(loaded, EngineConfig(**settings, enforce_eager=True)), prompts) == tokens
