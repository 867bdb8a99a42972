"""ModelConfig: the shape of a Llama-family model, read from a Hugging Face `config.json`.

One dataclass covers Llama 2/3, Mistral, Qwen2 and Qwen3; the families differ only in a few switches (QKV bias,
per-head q/k RMSNorm, sliding-window layers, Llama-3 RoPE scaling). Both config spellings are read: the one
checkpoints on disk use (`rope_theta` + `rope_scaling`, `torch_dtype`) and the one transformers >= 5 writes
(`rope_parameters` holding `rope_theta`, `dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

_MODEL_TYPE_OF_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_ARCHITECTURE_OF_MODEL_TYPE = {model_type: arch for arch, model_type in _MODEL_TYPE_OF_ARCHITECTURE.items()}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (HF `rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Llama3RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: the HF sliding window W (a query sees itself and the W - 1 keys before it) or None (full causal).
    layer_sliding_windows: tuple[int | None, ...] = ()
    tie_word_embeddings: bool = False
    dtype: torch.dtype | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (None,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_sliding_windows)} entries, num_hidden_layers is {self.num_layers}"
            )

    def window_size(self, layer_idx: int) -> tuple[int, int]:
        """flash-attn `window_size=(left, right)` for this layer under causal attention: HF's sliding window W
        keeps keys with `q - W < k <= q`, i.e. (W - 1, 0); (-1, -1) when the layer attends to the full prefix."""
        window = self.layer_sliding_windows[layer_idx]
        return (-1, -1) if window is None else (window - 1, 0)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_hf(self) -> dict:
        """config.json fields (transformers 5 spelling) describing this model, e.g. to build the same-shaped
        transformers model as a benchmark peer; `ModelConfig.from_hf(c.to_hf()) == c`."""
        windows = {w for w in self.layer_sliding_windows if w is not None}
        if len(windows) > 1 or (windows and self.model_type == "llama"):
            raise ValueError(
                f"layer_sliding_windows {self.layer_sliding_windows} has no {self.model_type} config.json form"
            )
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dataclasses.asdict(self.rope_scaling), "rope_type": "llama3", "rope_theta": self.rope_theta}
        hf = dict(
            model_type=self.model_type, architectures=[_ARCHITECTURE_OF_MODEL_TYPE[self.model_type]],
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps, rope_parameters=rope, max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.o_bias if self.model_type == "qwen2" else self.qkv_bias, mlp_bias=self.mlp_bias,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) or None,
        )
        if self.dtype is not None:
            hf["dtype"] = str(self.dtype).removeprefix("torch.")
        window = windows.pop() if windows else None
        if self.model_type == "mistral":
            hf["sliding_window"] = window
        elif self.model_type in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=window is not None, sliding_window=window, layer_types=[
                "full_attention" if w is None else "sliding_attention" for w in self.layer_sliding_windows
            ])
        return hf

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ModelConfig:
        """Read `config.json` (a file, or the checkpoint folder holding it)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_hf(json.load(f))

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        model_type = _model_type(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU MLP), got {hf['hidden_act']!r}")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        rope_theta, rope_scaling = _rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_scaling=rope_scaling,
            # Qwen2 always has q/k/v biases and never an o_proj bias; Llama and Qwen3 put `attention_bias` on all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            layer_sliding_windows=_sliding_windows(hf, model_type, num_layers),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=_dtype(hf.get("torch_dtype") or hf.get("dtype")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids(hf.get("eos_token_id")),
        )


def eos_token_ids(value) -> tuple[int, ...]:
    """HF writes `eos_token_id` as an int, a list of ints or null."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _model_type(hf: dict) -> str:
    model_type = hf.get("model_type")
    if model_type is None:
        for architecture in hf.get("architectures") or ():
            model_type = _MODEL_TYPE_OF_ARCHITECTURE.get(architecture, model_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    return model_type


def _rope(hf: dict) -> tuple[float, Llama3RopeScaling | None]:
    # transformers >= 5 folds rope_theta into `rope_parameters`; released checkpoints keep it top-level.
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    if "layer_types" in hf and set(params) & set(hf["layer_types"]):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    rope_theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor must be 1.0 (rotary embedding over the whole head)")
    if rope_type == "default":
        return float(rope_theta), None
    scaling = Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )
    return float(rope_theta), scaling


def _sliding_windows(hf: dict, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if model_type == "llama":
        return (None,) * num_layers
    if model_type == "mistral":
        return (window,) * num_layers
    # Qwen2/Qwen3: the window only exists with use_sliding_window, on the layers `layer_types` (or, in configs
    # written before layer_types existed, `max_window_layers`) marks as sliding — as transformers decides.
    if not hf.get("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", num_layers) else "full_attention"
        for i in range(num_layers)
    ]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types entries must be 'sliding_attention' or 'full_attention', got {sorted(unknown)}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _dtype(name) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"torch_dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]
