"""ModelConfig: the shape of a model, read from a Hugging Face `config.json`.

One dataclass covers Llama 2/3, Mistral, Qwen2 and Qwen3; the families differ only in a few switches (QKV bias,
per-head q/k RMSNorm, sliding-window layers, Llama-3 RoPE scaling). DeepSeek-V2/V3 add `mla` (multi-head latent
attention, with DeepSeek's YaRN RoPE); only their all-dense form is supported (no MoE layers). Both config
spellings are read: the one checkpoints on disk use (`rope_theta` + `rope_scaling`, `torch_dtype`) and the one
transformers >= 5 writes (`rope_parameters` holding `rope_theta`, `dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MLA_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
MLA_ROPE_TYPES = ("default", "yarn")

_MODEL_TYPE_OF_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnRopeScaling:
    """DeepSeek's YaRN RoPE scaling (HF `rope_type: "yarn"`): frequencies between the beta_fast and beta_slow
    rotation counts over the original context are interpolated by `factor`, cos/sin are scaled by
    `attention_factor`, and mscale_all_dim also scales the softmax (`MLAConfig.softmax_scale`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # None: derived from factor and the mscales (`cos_sin_scale`), as transformers does.
    attention_factor: float | None = None
    truncate: bool = True  # round the interpolation band's ends outward to whole dimensions

    @property
    def cos_sin_scale(self) -> float:
        """The factor transformers multiplies cos and sin by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: each token caches one latent (kv_lora_rank) and one rotary key
    (qk_rope_head_dim) shared by all heads; kv_b_proj expands the latent into per-head k_nope and v.

    q_lora_rank None: queries come from q_proj (DeepSeek-V2-Lite); else q_a_proj -> q_a_layernorm -> q_b_proj.
    rope_interleave: the rotary dimensions are adjacent pairs (x0, x1), (x2, x3), ... (V2 always, V3 by
    default); False: the two halves, as Llama. yarn: None for plain RoPE.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    yarn: YarnRopeScaling | None = None

    def __post_init__(self):
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set (HF's
        yarn_apply_mscale): the scale of q·k whether K is expanded or the query absorbs W_UK."""
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale


@dataclass(frozen=True)
class ModelConfig:
    """A model's shape. For an MLA model (`mla` set) num_kv_heads is 1 and head_dim is kv_lora_rank +
    qk_rope_head_dim: what the paged cache holds per token per layer is one "KV head" of the latent followed by
    the rotary key (576 values for DeepSeek-V2/V3); the per-head query/value sizes live in `mla`. qkv_bias and
    o_bias are then HF's attention_bias (on q_a_proj, kv_a_proj_with_mqa and o_proj; q_proj never has one)."""

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
    mla: MLAConfig | None = None

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
        if self.mla is not None:
            cached = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
            if (self.num_kv_heads, self.head_dim) != (1, cached):
                raise ValueError(
                    f"an MLA config caches one head of kv_lora_rank + qk_rope_head_dim = {cached}: num_kv_heads "
                    f"must be 1 and head_dim {cached}, got {self.num_kv_heads} and {self.head_dim}"
                )
            if self.rope_scaling is not None or any(w is not None for w in self.layer_sliding_windows):
                raise ValueError("an MLA config takes its RoPE scaling in mla.yarn and has no sliding windows")

    @property
    def softmax_scale(self) -> float:
        """The attention softmax scale: head_dim^-0.5, or `MLAConfig.softmax_scale` for an MLA model."""
        return self.head_dim ** -0.5 if self.mla is None else self.mla.softmax_scale

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
        hf = dict(
            model_type=self.model_type, architectures=[_ARCHITECTURE_OF_MODEL_TYPE[self.model_type]],
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads, hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) or None,
        )
        if self.dtype is not None:
            hf["dtype"] = str(self.dtype).removeprefix("torch.")
        if self.mla is not None:
            return {**hf, **self._mla_to_hf()}
        windows = {w for w in self.layer_sliding_windows if w is not None}
        if len(windows) > 1 or (windows and self.model_type == "llama"):
            raise ValueError(
                f"layer_sliding_windows {self.layer_sliding_windows} has no {self.model_type} config.json form"
            )
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dataclasses.asdict(self.rope_scaling), "rope_type": "llama3", "rope_theta": self.rope_theta}
        hf.update(
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, rope_parameters=rope,
            attention_bias=self.o_bias if self.model_type == "qwen2" else self.qkv_bias, mlp_bias=self.mlp_bias,
        )
        window = windows.pop() if windows else None
        if self.model_type == "mistral":
            hf["sliding_window"] = window
        elif self.model_type in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=window is not None, sliding_window=window, layer_types=[
                "full_attention" if w is None else "sliding_attention" for w in self.layer_sliding_windows
            ])
        return hf

    def _mla_to_hf(self) -> dict:
        mla = self.mla
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if mla.yarn is not None:
            yarn = {k: v for k, v in dataclasses.asdict(mla.yarn).items() if v is not None}
            rope = {**yarn, "rope_type": "yarn", "rope_theta": self.rope_theta}
        hf = dict(
            num_key_value_heads=self.num_heads, kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim, rope_parameters=rope, attention_bias=self.qkv_bias,
            first_k_dense_replace=self.num_layers,  # every layer dense
        )
        if self.model_type == "deepseek_v3":
            hf["rope_interleave"] = mla.rope_interleave
        else:
            hf["mlp_bias"] = self.mlp_bias
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
        common = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=_dtype(hf.get("torch_dtype") or hf.get("dtype")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids(hf.get("eos_token_id")),
        )
        if model_type in MLA_MODEL_TYPES:
            return cls(**common, **_mla_fields(hf, model_type))
        rope_theta, rope_scaling = _rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            **common,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # Qwen2 always has q/k/v biases and never an o_proj bias; Llama and Qwen3 put `attention_bias` on all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            layer_sliding_windows=_sliding_windows(hf, model_type, num_layers),
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


def _rope_parameters(hf: dict, supported: tuple[str, ...]) -> tuple[dict, float, str]:
    """(RoPE parameters, rope_theta, rope_type) from either spelling, the type checked against `supported`."""
    # transformers >= 5 folds rope_theta into `rope_parameters`; released checkpoints keep it top-level.
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    if "layer_types" in hf and set(params) & set(hf["layer_types"]):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    rope_theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise ValueError(f"rope_scaling.rope_type must be one of {supported}, got {rope_type!r}")
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor must be 1.0 (rotary embedding over the whole head)")
    return params, float(rope_theta), rope_type


def _rope(hf: dict) -> tuple[float, Llama3RopeScaling | None]:
    params, rope_theta, rope_type = _rope_parameters(hf, SUPPORTED_ROPE_TYPES)
    if rope_type == "default":
        return rope_theta, None
    scaling = Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )
    return rope_theta, scaling


def _mla_fields(hf: dict, model_type: str) -> dict:
    """The ModelConfig fields particular to a DeepSeek-V2/V3 config; refuses MoE layers."""
    num_layers = hf["num_hidden_layers"]
    # HF builds an MoE block on every layer from first_k_dense_replace on (the original remote code only when
    # n_routed_experts is set).
    first_dense_end = hf.get("first_k_dense_replace") or 0
    if hf.get("n_routed_experts") and first_dense_end < num_layers:
        raise ValueError(
            f"first_k_dense_replace ({first_dense_end}) < num_hidden_layers ({num_layers}) with n_routed_experts "
            f"({hf['n_routed_experts']}): layers {first_dense_end}..{num_layers - 1} are MoE layers, which are not "
            "supported yet; ioattn runs DeepSeek checkpoints whose layers are all dense "
            "(first_k_dense_replace >= num_hidden_layers)"
        )
    params, rope_theta, rope_type = _rope_parameters(hf, MLA_ROPE_TYPES)
    yarn = None
    if rope_type == "yarn":
        if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
            raise ValueError("rope_scaling: yarn needs factor and original_max_position_embeddings")
        optional = {key: float(params[key]) for key in ("mscale", "mscale_all_dim", "attention_factor")
                    if params.get(key) is not None}
        yarn = YarnRopeScaling(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            # transformers reads a missing or zero beta as its default.
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            **optional,
        )
    mla = MLAConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        q_lora_rank=hf.get("q_lora_rank"),
        # V2 always rotates adjacent pairs (as complex numbers); V3 makes it a switch.
        rope_interleave=model_type == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
        yarn=yarn,
    )
    attention_bias = bool(hf.get("attention_bias", False))
    # num_key_value_heads is not read: every head's K/V comes from kv_b_proj over the one cached latent.
    return dict(
        num_kv_heads=1,
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        rope_theta=rope_theta,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=model_type == "deepseek_v2" and bool(hf.get("mlp_bias", False)),
        mla=mla,
    )


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
