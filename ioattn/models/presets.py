"""Built-in models with seeded random weights: nothing to download.

- `tiny`: a small Llama (4 layers, hidden 256, 8 query / 2 KV heads) with a byte-level tokenizer; weights are drawn
  on the CPU so they are the same bits on every machine and device, in well under a second.
- `llama3-8b-shape`: Meta-Llama-3-8B's exact shapes (32 layers, hidden 4096, 32 / 8 heads of 128, vocab 128256)
  for GPU benchmarks; weights are drawn on the target device directly in the target dtype (16 GB in bf16 would
  take minutes through the CPU). Its tokenizer is the byte-level one too: prompts encode to ids < 258, and
  sampled ids past the byte range decode to nothing.
Linear weights are drawn with std 1/sqrt(fan_in) and embeddings with std 1, so activations keep unit scale
through the layers and logits spread over a few units: greedy choices are not near-ties decided by rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ioattn.models.config import ModelConfig
from ioattn.models.llama import LlamaForCausalLM, build_model
from ioattn.models.tokenizer import ByteTokenizer

_BYTES = ByteTokenizer()


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
    seed: int
    draw_on_cpu: bool  # True: reproducible across devices; False: fast for multi-GB models


PRESETS = {
    "tiny": Preset(
        ModelConfig(
            model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4,
            num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=4096, bos_token_id=_BYTES.bos_token_id, eos_token_ids=_BYTES.eos_token_ids,
        ),
        seed=0,
        draw_on_cpu=True,
    ),
    "llama3-8b-shape": Preset(
        ModelConfig(
            model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=8192, dtype=torch.bfloat16,
            bos_token_id=_BYTES.bos_token_id, eos_token_ids=_BYTES.eos_token_ids,
        ),
        seed=0,
        draw_on_cpu=False,
    ),
}


def load_preset(name: str, dtype="auto", device=None):
    """A preset's model with its random weights, as a `LoadedModel`."""
    from ioattn.models.loader import LoadedModel, resolve_dtype

    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    preset = PRESETS[name]
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_model(preset.config, resolve_dtype(dtype, preset.config, device), device)
    randomize_weights(model, preset.seed, draw_device="cpu" if preset.draw_on_cpu else model.inv_freq.device)
    tokenizer = ByteTokenizer()
    return LoadedModel(model, tokenizer, preset.config, tokenizer.eos_token_ids)


@torch.no_grad()
def randomize_weights(model: LlamaForCausalLM, seed: int, draw_device) -> None:
    """Seeded random weights: norms 1, embeddings N(0, 1), linear weights and biases N(0, 1/fan_in)."""
    draw_device = torch.device(draw_device)
    generator = torch.Generator(device=draw_device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(_fan_in(model, name, param))
        if draw_device.type == "cpu":
            # Drawn in float32 whatever the target dtype, so every dtype and device starts from the same values.
            param.copy_(torch.empty(param.shape).normal_(0.0, std, generator=generator))
        else:
            param.normal_(0.0, std, generator=generator)


def _fan_in(model: LlamaForCausalLM, name: str, param: torch.Tensor) -> int:
    if param.dim() == 2:
        return param.shape[1]
    # A bias: the fan-in of the weight it belongs to.
    return model.get_parameter(name.removesuffix("bias") + "weight").shape[1]
