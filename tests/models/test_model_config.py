"""ModelConfig from config.json: both spellings of RoPE settings, sliding-window layers, clear errors."""

import pytest
import torch

pytest.importorskip("transformers")

from ioattn.models.config import Llama3RopeScaling, ModelConfig
from ioattn.models import build_model
from ioattn.models.llama import rope_inv_freq

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024,
)


def config(**fields):
    return ModelConfig.from_hf({**BASE, **fields})


def test_llama3_rope_scaling_from_released_and_transformers5_spellings():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    released = config(model_type="llama", rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    written = config(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling})
    assert released == written
    assert released.rope_theta == 500000.0
    assert released.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    assert config(model_type="llama", rope_scaling={"type": "llama3", **scaling}).rope_scaling is not None


def test_llama3_scaling_matches_transformers_frequencies():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_config = LlamaConfig(**BASE, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(config(model_type="llama", rope_parameters=rope))
    assert torch.equal(ours, expected)
    unscaled = rope_inv_freq(config(model_type="llama", rope_theta=500000.0))
    # All three bands occur: kept (high frequency), divided by factor (low) and interpolated (between).
    ratio = unscaled / ours
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_family_switches():
    qwen2 = config(model_type="qwen2")
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = config(model_type="qwen3", head_dim=48, attention_bias=True)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm, qwen3.head_dim) == (True, True, True, 48)
    llama = config(model_type="llama", mlp_bias=True, torch_dtype="bfloat16", tie_word_embeddings=True)
    assert (llama.qkv_bias, llama.mlp_bias, llama.head_dim, llama.dtype) == (False, True, 16, torch.bfloat16)
    assert llama.tie_word_embeddings
    assert config(architectures=["MistralForCausalLM"]).model_type == "mistral"


def test_sliding_window_layers_and_flash_attn_window_size():
    mistral = config(model_type="mistral", sliding_window=4096)
    assert mistral.layer_sliding_windows == (4096,) * 4
    assert mistral.window_size(0) == (4095, 0)
    assert config(model_type="mistral", sliding_window=None).window_size(0) == (-1, -1)
    # Qwen2 configs written before `layer_types`: layers >= max_window_layers slide, only with use_sliding_window.
    qwen2 = config(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert qwen2.layer_sliding_windows == (None, None, 8, 8)
    assert config(model_type="qwen2", use_sliding_window=False, sliding_window=8).layer_sliding_windows == (None,) * 4
    explicit = config(model_type="qwen3", use_sliding_window=True, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"] * 2)
    assert explicit.layer_sliding_windows == (8, None, 8, None)
    assert config(model_type="llama", sliding_window=8).layer_sliding_windows == (None,) * 4


def test_eos_token_id_int_or_list():
    assert config(model_type="llama", eos_token_id=2).eos_token_ids == (2,)
    assert config(model_type="llama", eos_token_id=[128001, 128009]).eos_token_ids == (128001, 128009)
    assert config(model_type="llama", eos_token_id=None).eos_token_ids == ()


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(model_type="gpt2"), "model_type"),
        (dict(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (dict(model_type="llama", hidden_act="gelu"), "hidden_act"),
        (dict(model_type="llama", num_key_value_heads=3), "num_key_value_heads"),
        (dict(model_type="llama", torch_dtype="float64"), "torch_dtype"),
        (dict(model_type="llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4,
              layer_types=["chunked_attention"] * 4), "layer_types"),
    ],
)
def test_unsupported_config_raises_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        config(**fields)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_to_hf_round_trips_through_transformers(family, tmp_path):
    from hf_checkpoints import COMMON, FAMILIES, hf_classes

    config_cls, _ = hf_classes(family)
    config_cls(**COMMON, **FAMILIES[family]).save_pretrained(tmp_path)
    ours = ModelConfig.from_json(tmp_path)
    assert ModelConfig.from_hf(ours.to_hf()) == ours
    # transformers reads our fields back to the same model.
    config_cls(**ours.to_hf()).save_pretrained(tmp_path / "again")
    assert ModelConfig.from_json(tmp_path / "again") == ours


def test_presets_have_a_transformers_twin():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

    from ioattn.models.presets import PRESETS

    for name, preset in PRESETS.items():
        config_cls, model_cls = ((DeepseekV2Config, DeepseekV2ForCausalLM) if preset.config.mla is not None
                                 else (LlamaConfig, LlamaForCausalLM))
        with torch.device("meta"):
            twin = model_cls(config_cls(**preset.config.to_hf()))
        ours = build_model(preset.config, torch.float32, "meta")
        assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in ours.parameters()), name
