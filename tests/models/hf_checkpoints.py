"""Tiny random Hugging Face checkpoints of each supported family, written with `save_pretrained`, for tests."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    # HF's default 0.02 leaves a near-linear model whose logits barely depend on attention; 1/sqrt(hidden)
    # keeps activations at unit scale so every layer matters to the comparison.
    initializer_range=0.125, bos_token_id=1, eos_token_id=2,
)

# One small config per family, each exercising what is special about it.
FAMILIES = {
    # Llama 3.1 RoPE scaling with a short original context so all three frequency bands occur in head_dim 16;
    # attention and MLP biases (Llama's optional ones).
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
        attention_bias=True, mlp_bias=True,
    ),
    # Every layer slides over a window shorter than the test sequences.
    "mistral": dict(sliding_window=5),
    # QKV bias; sliding window only on layers >= max_window_layers; tied embeddings.
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, tie_word_embeddings=True),
    # q/k RMSNorm per head; head_dim 32 != hidden / heads = 16.
    "qwen3": dict(head_dim=32),
}

# DeepSeek (MLA), all layers dense. HF's attention only runs with num_key_value_heads == num_attention_heads.
# rms_norm_eps 1e-2 tells the config's eps apart from the 1e-6 HF gives q_a_layernorm / kv_a_layernorm; V's
# head dim differs from Q/K's (dn + dr = 24) as the varlen kernel's V padding must handle.
DEEPSEEK_COMMON = {
    **COMMON, "num_key_value_heads": 4, "first_k_dense_replace": 2, "rms_norm_eps": 1e-2, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "bos_token_id": 1, "eos_token_id": 2,
}
DEEPSEEK_FAMILIES = {
    # V3-style: q LoRA, interleaved RoPE pairs, YaRN with mscale != mscale_all_dim (so both the cos/sin factor and
    # the softmax scale move); the original context puts RoPE's 4 frequencies in all three YaRN bands.
    "deepseek_v3": dict(
        q_lora_rank=48, rope_interleave=True, v_head_dim=8, max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
        },
    ),
    # V2-Lite-style: plain q_proj, complex-pair RoPE without scaling; attention and MLP biases; tied embeddings.
    "deepseek_v2": dict(q_lora_rank=None, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}


def family_fields(family: str) -> dict:
    """The config fields of `family`'s tiny test model."""
    if family in DEEPSEEK_FAMILIES:
        return {**DEEPSEEK_COMMON, **DEEPSEEK_FAMILIES[family]}
    return {**COMMON, **FAMILIES[family]}


def hf_classes(family: str):
    import transformers

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "deepseek_v2": "DeepseekV2",
              "deepseek_v3": "DeepseekV3"}[family]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def save_hf_model(family: str, path: str | os.PathLike, max_shard_size: str | None = None, **overrides):
    """A random HF model of `family`, saved (safetensors) with a tokenizer.json; returns the HF model (fp32)."""
    config_cls, model_cls = hf_classes(family)
    config = config_cls(**{**family_fields(family), **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():
        # HF initialises norms to 1 and biases to 0, which would hide a norm or bias loaded into the wrong place.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    write_word_tokenizer(path, VOCAB)
    return model


def write_word_tokenizer(path: str | os.PathLike, vocab_size: int) -> dict[str, int]:
    """A WordLevel tokenizer.json: <unk>=0, <s>=1, </s>=2, then words w3, w4, ...; BOS added on encode."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return vocab


def write_generation_config(path: str | os.PathLike, **fields) -> None:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(fields, f)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """HF logits (len, vocab) for one sequence, run on its own."""
    return model(input_ids=torch.tensor([ids])).logits[0]
