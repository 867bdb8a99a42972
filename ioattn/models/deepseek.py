"""DeepSeek-V2 / V3 decoder with multi-head latent attention (MLA), readable top to bottom.

Only all-dense checkpoints are supported (no MoE layers; `ModelConfig.from_hf` refuses the others). The model works
on the same flat, packed batch as `ioattn.models.llama` and reuses its RMSNorm, SwiGLU MLP, residual folding and LM
head; what differs is attention. Each token's K/V are compressed into one latent c (kv_lora_rank, after
kv_a_layernorm) plus one rotary key k_rope (qk_rope_head_dim) shared by every head; kv_b_proj expands c into each
head's k_nope and v. Every layer computes

    q_nope (T, H, dn), q_rope (T, H, dr) rotated, latent (T, dl), k_rope (T, dr) rotated

and calls `ctx.attend_mla(q_nope, q_rope, latent, k_rope, layer_idx, projection)` -> (T, H, dv), where
`projection` is the layer's kv_b_proj as an `MLAProjection`. A context chooses the form: expand the latent into
K/V and run ordinary attention (`MLAProjection.expand` + `expanded_attention`, which lives in ioattn.models.llama
beside `DenseCausalAttention`, its user; the cheap form for long prefills), or cache only [latent ‖ k_rope]
and fold W_UK into the query and W_UV after attention (`absorb` / `output`), so decode reads dl + dr values per
cached token instead of H·(dn + dr + dv).

RoPE covers the dr rotary dimensions only. Checkpoints store them as adjacent pairs (rope_interleave; V2 always):
they are de-interleaved into halves before Llama's rotation, which is exactly V3's HF code; V2's HF code leaves
its result interleaved, the same values permuted the same way in q and k, so every score is the same dot product.
YaRN frequencies and its cos/sin factor are computed in float32 and cast, as transformers does. On CUDA the norms
and the MLP run as Llama's fused kernels; RoPE runs as the torch code everywhere. Parameter names are HF's, with
gate/up fused into `gate_up_proj` (`checkpoint_layout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ioattn.models.config import MLAConfig, ModelConfig, YarnRopeScaling
from ioattn.models.llama import (
    DecoderLayer, LlamaForCausalLM, Linear, RMSNorm, SwiGLU, apply_rotary, expanded_attention, rotary_cos_sin,
)

# HF builds q_a_layernorm and kv_a_layernorm with their own default eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def rope_frequencies(config: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dr / 2,) float32, the factor cos/sin are scaled by) for an MLA config's RoPE."""
    mla = config.mla
    dim, base = mla.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if mla.yarn is None:
        return 1.0 / pos_freqs, 1.0
    yarn = mla.yarn
    # Dimensions turning fewer than beta_slow times over the original context are interpolated (divided by
    # factor), those turning more than beta_fast times are kept, and a linear ramp blends the band between.
    low, high = _yarn_band(yarn, dim, base)
    ramp = ((torch.arange(dim // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    inv_freq = 1.0 / (yarn.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept
    return inv_freq, yarn.cos_sin_scale


def _yarn_band(yarn: YarnRopeScaling, dim: int, base: float) -> tuple[float, float]:
    def dimension_of(rotations: float) -> float:
        wavelengths = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(base))

    low, high = dimension_of(yarn.beta_fast), dimension_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    return low, (high + 0.001 if low == high else high)  # a zero-width band would divide by zero


@dataclass
class LatentRotary:
    """One batch's RoPE over the rotary dims, called as `rotary(q_rope (T, H, dr), k_rope (T, dr))`; the
    cos/sin tables (T, dr) are built once per batch for all layers, already scaled by YaRN's factor."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool

    @classmethod
    def build(cls, inv_freq, scale: float, positions, dtype, interleaved: bool) -> LatentRotary:
        cos, sin = rotary_cos_sin(inv_freq, positions, torch.float32)
        return cls((cos * scale).to(dtype), (sin * scale).to(dtype), interleaved)

    def __call__(self, q_rope: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotate(q_rope), self._rotate(k_rope[:, None, :])[:, 0, :]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, self.cos, self.sin)


class MLAProjection(Linear):
    """kv_b_proj, weight (H·(dn + dv), dl): per head, dn rows of W_UK then dv rows of W_UV over the latent.

    `w_uk` (H, dn, dl) and `w_uv` (H, dv, dl) are views of the weight (no copies, so they follow loading and
    dtype casts). `softmax_scale` is the model's q·k scale, the same in the expanded and the absorbed form.
    """

    def __init__(self, num_heads: int, mla: MLAConfig):
        super().__init__(mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.num_heads, self.qk_nope_head_dim, self.v_head_dim = num_heads, mla.qk_nope_head_dim, mla.v_head_dim
        self.softmax_scale = mla.softmax_scale

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.in_features)

    @property
    def w_uk(self) -> torch.Tensor:
        return self._per_head()[:, : self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        return self._per_head()[:, self.qk_nope_head_dim :]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent (N, dl) -> (k_nope (N, H, dn), v (N, H, dv)), views of one (N, H, dn + dv) product (the
        prefill form: K/V expanded from the latent, as HF computes them)."""
        kv = self(latent).view(latent.shape[0], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope (T, H, dn) -> q_latent (T, H, dl) = q_nope @ W_UK per head, so that q_latent · latent equals
        q_nope · k_nope (a (T, H, dl) view of an (H, T, dl) product)."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """o_latent (T, H, dl), attention's output with the latent as V -> (T, H, dv) = o_latent @ W_UV^T per
        head (a (T, H, dv) view of an (H, T, dv) product)."""
        return torch.bmm(o_latent.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        mla = config.mla
        self.layer_idx = layer_idx
        self.num_heads, self.mla = config.num_heads, mla
        q_size = config.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(config.hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = Linear(config.hidden_size, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                         bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = MLAProjection(config.num_heads, mla)
        self.o_proj = Linear(config.num_heads * mla.v_head_dim, config.hidden_size, bias=config.o_bias)

    @property
    def projection(self) -> MLAProjection:
        return self.kv_b_proj

    def forward(self, x, rotary: LatentRotary, ctx) -> torch.Tensor:
        tokens, mla = x.shape[0], self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, self.num_heads, mla.qk_head_dim).split(
            (mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = rotary(q_rope, k_rope)
        out = ctx.attend_mla(q_nope, q_rope, latent, k_rope, self.layer_idx, self.projection)
        return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    # Llama's pre-norm layer with its residual folding; only the attention module differs.
    forward = DecoderLayer.forward


class DeepseekStack(nn.Module):
    """Everything but the LM head: HF's `model.` prefix."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    # Fused parameter -> the checkpoint projections stacked in it (read by Llama's checkpoint_layout).
    FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.mla is None:
            raise ValueError(f"DeepseekForCausalLM needs an MLA config (model_type {config.model_type!r} has none)")
        self.config = config
        self.model = DeepseekStack(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Packed tokens (T,) at their positions (T,) -> final hidden states (T, hidden), normed; `ctx` is the
        batch's attention context (`ctx.attend_mla(q_nope, q_rope, latent, k_rope, layer_idx, projection)`)."""
        x = self.model.embed_tokens(input_ids)
        rotary = LatentRotary.build(self.inv_freq, self.rope_scale, positions, x.dtype, self.config.mla.rope_interleave)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rotary, ctx)
        if residual is None:  # a model with no layers: nothing was added to the residual stream
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

    # The same embedding / LM head and gate_up fusion as Llama's.
    compute_logits = LlamaForCausalLM.compute_logits
    checkpoint_layout = LlamaForCausalLM.checkpoint_layout

    def reset_rope(self) -> None:
        """Recompute the float32 RoPE frequencies on the model's device (after `to_empty` or a dtype cast)."""
        self.inv_freq, self.rope_scale = rope_frequencies(self.config, device=self.model.norm.weight.device)

