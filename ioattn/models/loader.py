"""Loading a model: a built-in preset (`ioattn.models.presets`), a GGUF file or a local Hugging Face checkpoint
folder (Llama family, or all-dense DeepSeek-V2/V3; GGUF files are Llama family only).

A checkpoint folder holds `config.json`, weights in `model.safetensors` or shards listed by
`model.safetensors.index.json`, `tokenizer.json`, and optionally `generation_config.json` (whose `eos_token_id`,
an int or a list, wins over config.json's: Llama-3-Instruct stops on <|eot_id|> as well as <|end_of_text|>) and
`tokenizer_config.json` (its chat template). A GGUF file holds all of it (`ioattn.models.gguf`).
"""

from __future__ import annotations

import os

import torch

from ioattn.models.checkpoint import (  # noqa: F401  (re-exported: the loader is where users look for them)
    ChatTemplateSource, LoadedModel, build_model, checkpoint_files, folder_chat_template, load_generation_config,
    load_weights, read_kv_scales, resolve_dtype,
)
from ioattn.models.config import ModelConfig, eos_token_ids
from ioattn.models.gguf import GGUFFile, load_gguf, read_chat_template, read_config, read_tokenizer
from ioattn.models.presets import PRESETS
from ioattn.models.tokenizer import ByteTokenizer, HFTokenizer


def load_model(path_or_preset: str | os.PathLike, dtype="auto", device=None) -> LoadedModel:
    """A preset name, a GGUF file or a checkpoint folder -> model (eval mode, no grad), tokenizer, config, stop
    ids and chat template.

    dtype: a torch dtype, "float32" / "float16" / "bfloat16", or "auto" (the checkpoint's `torch_dtype`, else
    bfloat16 on CUDA and float32 on the CPU). device: default CUDA when present.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    preset, name = _preset_or_path(path_or_preset)
    if preset is not None:
        return preset.load(dtype=dtype, device=device)
    if os.path.isfile(name):
        return load_gguf(name, dtype=dtype, device=device)
    config = ModelConfig.from_json(name)
    generation_config = load_generation_config(name)
    tokenizer, stop_ids = _folder_tokenizer(name, config, generation_config)
    model = build_model(config, resolve_dtype(dtype, config, device), device)
    load_weights(model, name)
    return LoadedModel(model, tokenizer, config, stop_ids, generation_config, folder_chat_template(name),
                       read_kv_scales(name))


def load_tokenizer(path_or_preset: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """The tokenizer `load_model(path_or_preset)` would carry, read without building the model or its weights
    (what a front end that only encodes and decodes text needs)."""
    preset, name = _preset_or_path(path_or_preset)
    if preset is not None:
        return preset.tokenizer()
    if os.path.isfile(name):
        file = GGUFFile(name)
        return read_tokenizer(file, read_config(file))
    return _folder_tokenizer(name, ModelConfig.from_json(name), load_generation_config(name))[0]


def _folder_tokenizer(name: str, config: ModelConfig, generation_config: dict) -> tuple[HFTokenizer, tuple[int, ...]]:
    stop_ids = eos_token_ids(generation_config.get("eos_token_id")) or config.eos_token_ids
    bos = generation_config.get("bos_token_id", config.bos_token_id)
    return HFTokenizer(name, bos_token_id=bos, eos_token_ids=stop_ids), stop_ids


def chat_template_source(path_or_preset: str | os.PathLike) -> ChatTemplateSource | None:
    """The chat template `load_model(path_or_preset)` would carry, read from metadata alone (no weights)."""
    preset, name = _preset_or_path(path_or_preset)
    if preset is not None:
        return preset.chat_template()
    if os.path.isfile(name):
        return read_chat_template(GGUFFile(name))
    return folder_chat_template(name)


def _preset_or_path(path_or_preset: str | os.PathLike):
    """(the preset, None) for a preset name that is not also a path, else (None, the existing path)."""
    name = os.fspath(path_or_preset)
    if name in PRESETS and not os.path.exists(name):
        return PRESETS[name], None
    if not os.path.exists(name):
        raise FileNotFoundError(f"model {name!r} is neither a preset, a GGUF file nor a checkpoint folder "
                                f"(presets: {', '.join(PRESETS)})")
    return None, name
