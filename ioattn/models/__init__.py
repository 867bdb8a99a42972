"""Llama-family models (Llama 2/3, Mistral, Qwen2, Qwen3) on ioattn's attention, and their loading: presets, GGUF
files, Hugging Face checkpoint folders."""

from ioattn.models.config import ModelConfig
from ioattn.models.llama import DenseCausalAttention, LlamaForCausalLM, build_model, dense_causal_attention
from ioattn.models.loader import ChatTemplateSource, LoadedModel, load_model
from ioattn.models.presets import PRESETS
from ioattn.models.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "ChatTemplateSource",
    "DenseCausalAttention",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "build_model",
    "dense_causal_attention",
    "load_model",
]
