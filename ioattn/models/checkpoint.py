"""What a loaded model is (`LoadedModel`, its chat template), the model class a config builds (`build_model`) and
the Hugging Face checkpoint folder's files: weights (`model.safetensors` or the shards
`model.safetensors.index.json` lists), `generation_config.json` and `tokenizer_config.json`.
`ioattn.models.loader` dispatches between presets, GGUF files and folders; presets and the GGUF reader build on
the types here.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import torch

from ioattn.models.config import ModelConfig
from ioattn.models.deepseek import DeepseekForCausalLM
from ioattn.models.llama import LlamaForCausalLM
from ioattn.models.llama import build_model as build_llama_model
from ioattn.models.tokenizer import ByteTokenizer, HFTokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Checkpoint tensors with no parameter behind them: RoPE tables some older exports saved (recomputed here), and
# the attention quantization scales llm-compressor writes (K/V ones are read by `read_kv_scales` for an fp8 KV cache).
KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", *KV_SCALE_SUFFIXES, ".self_attn.q_scale")


CausalLM = LlamaForCausalLM | DeepseekForCausalLM


def build_model(config: ModelConfig, dtype: torch.dtype, device) -> CausalLM:
    """The model class for `config` (DeepSeek's for an MLA config, else the Llama family's), its parameters
    allocated on `device` in `dtype` but not initialised (the caller fills them)."""
    return build_llama_model(config, dtype, device, DeepseekForCausalLM if config.mla is not None else None)


@dataclass(frozen=True)
class ChatTemplateSource:
    """A model's jinja chat template and the BOS/EOS strings it may write (`bos_token` / `eos_token`)."""

    template: str
    bos_token: str = ""
    eos_token: str = ""


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: ByteTokenizer | HFTokenizer
    config: ModelConfig
    eos_token_ids: tuple[int, ...]
    generation_config: dict = field(default_factory=dict)
    chat_template: ChatTemplateSource | None = None  # None: the model has none (random-weight presets)
    # The checkpoint's `...self_attn.k_scale` / `v_scale` tensors by name, as found (checked against the model only
    # when an fp8 KV cache uses them: `ioattn.engine.kv_scales`).
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings


def folder_chat_template(path: str | os.PathLike) -> ChatTemplateSource | None:
    """A checkpoint folder's chat template, as transformers reads it from `tokenizer_config.json`."""
    config_file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        return None
    bos, eos = (_special_token(config.get(key)) for key in ("bos_token", "eos_token"))
    return ChatTemplateSource(template, bos, eos)


def _special_token(value) -> str:
    """tokenizer_config.json spells a special token as its text or as {"content": text, ...}."""
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


def resolve_dtype(dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype == "auto":
        if config.dtype is not None:
            return config.dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)} (or the torch dtype), got {dtype!r}")


def load_generation_config(path: str | os.PathLike) -> dict:
    """`generation_config.json` as a dict; {} when the checkpoint has none."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint folder: the shards its index lists, or its single file(s)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(glob.escape(os.fspath(path)), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (PyTorch .bin checkpoints are not supported)")
    return files


def load_weights(model: CausalLM, path: str | os.PathLike) -> None:
    """Fill every parameter of `model` from the checkpoint, converting dtype; check the names first, so a
    mismatched checkpoint fails before anything is read."""
    from safetensors import safe_open

    layout = model.checkpoint_layout()
    files = checkpoint_files(path)
    names_by_file = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names_by_file[file] = list(f.keys())
    found = {name for names in names_by_file.values() for name in names}
    # A tied model's logits come from the embedding; a duplicate lm_head in the file is not a second weight.
    ignorable = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    unexpected = sorted(n for n in found - layout.keys() - ignorable if not n.endswith(_IGNORED_SUFFIXES))
    missing = sorted(layout.keys() - found)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint {path} does not match the {model.config.model_type} model: "
            f"missing tensors {_preview(missing)}, unexpected tensors {_preview(unexpected)}"
        )
    params = dict(model.named_parameters())
    device = model.model.norm.weight.device
    # Reading straight onto the GPU lets the dtype cast run there too.
    read_device = str(device) if device.type == "cuda" else "cpu"
    for file, names in names_by_file.items():
        with safe_open(file, framework="pt", device=read_device) as f:
            for name in names:
                if name not in layout:
                    continue
                param_name, start, end = layout[name]
                target = params[param_name].data[start:end]
                tensor = f.get_tensor(name)
                if tensor.shape != target.shape:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                target.copy_(tensor)


def read_kv_scales(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint's KV cache scale tensors (names ending in KV_SCALE_SUFFIXES), float32 on the CPU."""
    from safetensors import safe_open

    found = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith(KV_SCALE_SUFFIXES):
                    found[name] = f.get_tensor(name).to(torch.float32)
    return found


def _preview(names: list[str], limit: int = 6) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
