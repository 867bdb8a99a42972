"""Llama-family models (Llama 2/3, Mistral, Qwen2, Qwen3) and all-dense DeepSeek-V2/V3 (multi-head latent attention)
on ioattn's attention, and their loading: presets, GGUF files, Hugging Face checkpoint folders."""

from ioattn.models.checkpoint import build_model
from ioattn.models.config import MLAConfig, ModelConfig
from ioattn.models.deepseek import DeepseekForCausalLM, MLAProjection, expanded_attention
from ioattn.models.llama import DenseCausalAttention, LlamaForCausalLM, dense_causal_attention
from ioattn.models.loader import ChatTemplateSource, LoadedModel, load_model
from ioattn.models.presets import PRESETS
from ioattn.models.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "ChatTemplateSource",
    "DeepseekForCausalLM",
    "DenseCausalAttention",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "MLAConfig",
    "MLAProjection",
    "ModelConfig",
    "build_model",
    "dense_causal_attention",
    "expanded_attention",
    "load_model",
]
