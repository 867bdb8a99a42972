"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3), readable top to bottom.

The model works on a *flat, packed* batch: `input_ids (T,)` and `positions (T,)` hold the tokens of every
sequence in the batch back to back (prefill chunks and decode tokens alike), so no padding is ever computed.
Attention is the one place that needs to know where sequences start and what they have cached; the caller hands
the model a context for the batch with its inputs, and every layer calls `ctx.attend(q, k, v, layer_idx)` with
q (T, Hq, D), k/v (T, Hkv, D) after RoPE (the engine passes its paged-attention step, `ioattn.engine.attention`;
tests and simple generation pass `DenseCausalAttention`). On CUDA the elementwise work runs as fused Triton kernels
(`ioattn.ops.fused`, rounding where the torch code here rounds; RMSNorm's sum of squares is reduced in
another order, so its outputs may differ in the last bits) and each residual add is folded into the norm that
follows it, so every layer passes on (sublayer output, residual stream); elsewhere the plain torch code runs
(the same operations, so its results are bit for bit unchanged, except that few-row float32 products on the CPU
run as W @ x^T, see `linear`). Parameter names are those of Hugging Face
checkpoints, except that q/k/v and gate/up projections are fused into one matmul each (`qkv_proj`,
`gate_up_proj`); `checkpoint_layout` says where each checkpoint tensor goes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ioattn.models.config import ModelConfig

# Float32 products of at most this many rows on the CPU run as W @ x^T: MKL takes 15% less time per batch-16
# decode step of smollm2 that way (bench/results/2026-12-02-cpu-serve-smollm2.md); the same sums, which may round
# otherwise in the last bit.
SKINNY_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, but few float32 rows on the CPU as (weight @ x^T)^T."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= SKINNY_ROWS:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normed x; given `residual`, (normed (x + residual), x + residual): the sum is the new residual stream
        (on CUDA written into `residual` in place)."""
        if _fused(x):
            return _fused_ops().rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._normed(x)
        residual = x + residual
        return self._normed(residual), residual

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale after casting back, in the order transformers uses, so that bf16/fp16
        # models round exactly as their reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig, device=None) -> torch.Tensor:
    """Inverse rotary frequencies (head_dim / 2,) in float32, with Llama-3 scaling when the config has it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: wavelengths longer than the pre-training context are stretched by `factor`, short ones are kept,
    # and the band between is interpolated smoothly.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin (T, head_dim) for each token's position, computed in float32 then cast (as transformers does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) by its token's angles; halves (not interleaved pairs), the HF checkpoint convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class Rotary:
    """One batch's RoPE, called as `rotary(q, k) -> (q, k)` rotated. On CUDA the fused kernel rotates q and k in
    place and computes its angles itself; elsewhere the cos/sin tables are built once per batch for all layers."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    @classmethod
    def build(cls, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        if _fused(positions):
            return cls(positions, inv_freq)
        return cls(positions, inv_freq, *rotary_cos_sin(inv_freq, positions, dtype))

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None:
            _fused_ops().rotary_embedding_(q, k, self.positions, self.inv_freq)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, sum(self.qkv_sizes), bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x, rotary: Rotary, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k)
        out = ctx.attend(q, k, v, self.layer_idx)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if _fused(gate_up):
            return self.down_proj(_fused_ops().silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, residual, rotary: Rotary, ctx):
        """(previous layer's MLP output, residual stream before it) -> the same pair for this layer; the first
        layer gets (embeddings, None). Adding x to the residual happens inside the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """Everything but the LM head: HF's `model.` prefix."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Fused parameter -> the checkpoint projections stacked in it, in row order.
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # Tied models read their logits off the embedding matrix; no second parameter to keep in sync.
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Packed tokens (T,) at their positions (T,) -> final hidden states (T, hidden), normed; `ctx` is the
        batch's attention context (`ctx.attend(q, k, v, layer_idx)`)."""
        x = self.model.embed_tokens(input_ids)
        rotary = Rotary.build(self.inv_freq, positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rotary, ctx)
        if residual is None:  # a model with no layers: nothing was added to the residual stream
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (N, hidden) -> float32 logits (N, vocab); the caller picks the rows it samples from."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

    def reset_rope(self) -> None:
        """Recompute the float32 RoPE frequencies on the model's device (after `to_empty` or a dtype cast)."""
        self.inv_freq = rope_inv_freq(self.config, device=self.model.norm.weight.device)

    def checkpoint_layout(self) -> dict[str, tuple[str, int, int]]:
        """HF checkpoint tensor name -> (parameter name, first row, end row) of the rows it fills."""
        layout = {}
        for name, param in self.named_parameters():
            module_path, _, kind = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            parts = self.FUSED.get(leaf)
            if parts is None:
                layout[name] = (name, 0, param.shape[0])
                continue
            c = self.config
            kv_rows = c.num_kv_heads * c.head_dim
            sizes = (c.num_heads * c.head_dim, kv_rows, kv_rows) if leaf == "qkv_proj" else (c.intermediate_size,) * 2
            start = 0
            for part, size in zip(parts, sizes, strict=True):
                layout[f"{parent}.{part}.{kind}"] = (name, start, start + size)
                start += size
        return layout


def build_model(config: ModelConfig, dtype: torch.dtype, device, model_class: type[nn.Module] | None = None):
    """A model (`model_class`, default LlamaForCausalLM) whose parameters are allocated on `device` in `dtype` but
    not initialised (the caller fills them)."""
    with torch.device("meta"):
        model = (model_class or LlamaForCausalLM)(config)
    model = model.to(dtype).to_empty(device=device)
    model.reset_rope()
    return model.eval().requires_grad_(False)


@dataclass
class DenseCausalAttention:
    """Attention context for batches with no KV cache: each packed sequence attends causally to itself only.

    `backend` "ioattn" runs `ioattn.flash_attn_varlen_func`, "torch" runs PyTorch SDPA one sequence at a time,
    "auto" picks ioattn when its kernels import. Build one per batch with `DenseCausalAttention.build`.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    window_sizes: tuple[tuple[int, int], ...]
    backend: str = "auto"

    BACKENDS = ("auto", "ioattn", "torch")

    @classmethod
    def build(cls, seq_lens: Sequence[int], config: ModelConfig, device, backend: str = "auto") -> DenseCausalAttention:
        if backend not in cls.BACKENDS:
            raise ValueError(f"backend must be one of {cls.BACKENDS}, got {backend!r}")
        if not seq_lens or min(seq_lens) <= 0:
            raise ValueError(f"seq_lens must be a non-empty list of positive lengths, got {list(seq_lens)}")
        cu = torch.tensor([0, *seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        windows = tuple(config.window_size(i) for i in range(config.num_layers))
        return cls(cu_seqlens=cu, max_seqlen=max(seq_lens), window_sizes=windows, backend=backend)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return dense_causal_attention(q, k, v, layer_idx, self)

    def attend_mla(self, q_nope, q_rope, latent, k_rope, layer_idx: int, projection) -> torch.Tensor:
        """Multi-head latent attention with no cache: each token's K/V expanded from its latent, `backend` as
        `expanded_attention` takes it ("auto": the varlen kernel on CUDA only); an MLA layer has no window."""
        k_nope, v = projection.expand(latent)
        return expanded_attention(q_nope, q_rope, k_nope, k_rope, v, self.cu_seqlens, self.cu_seqlens,
                                  self.max_seqlen, self.max_seqlen, projection.softmax_scale, backend=self.backend)


def dense_causal_attention(q, k, v, layer_idx: int, ctx: DenseCausalAttention) -> torch.Tensor:
    """`DenseCausalAttention.attend`: causal (optionally windowed) attention within each packed sequence."""
    window = ctx.window_sizes[layer_idx]
    varlen = _ioattn_varlen() if ctx.backend != "torch" else None
    if ctx.backend == "ioattn" and varlen is None:
        raise ValueError("backend 'ioattn' needs ioattn.ops.attention.flash_attn_varlen_func, which did not import")
    if varlen is not None:
        return varlen(
            q, k, v, cu_seqlens_q=ctx.cu_seqlens, cu_seqlens_k=ctx.cu_seqlens,
            max_seqlen_q=ctx.max_seqlen, max_seqlen_k=ctx.max_seqlen, causal=True, window_size=window,
        )
    out = torch.empty_like(q)
    bounds = ctx.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        # (1, H, L, D) views of one sequence; GQA through enable_gqa, no copies of K/V per query head.
        q_s, k_s, v_s = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if window == (-1, -1):
            o_s = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, enable_gqa=True)
        else:
            pos = torch.arange(end - start, device=q.device)
            offset = pos[:, None] - pos[None, :]
            mask = (offset >= 0) & (offset <= window[0])
            o_s = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, enable_gqa=True)
        out[start:end] = o_s.squeeze(0).transpose(0, 1)
    return out


def _fused(t: torch.Tensor) -> bool:
    """Whether the fused CUDA kernels run: they are inference-only (no autograd, the residual is updated in
    place), so with gradients enabled the torch ops run instead and backpropagate correctly."""
    return t.is_cuda and not torch.is_grad_enabled()


@functools.cache
def _fused_ops():
    """ioattn.ops.fused, imported on first use: it loads Triton, which CPU-only installs may lack."""
    from ioattn.ops import fused

    return fused


EXPANDED_BACKENDS = ("auto", "ioattn", "torch")


def expanded_attention(q_nope, q_rope, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                       max_seqlen_k: int, softmax_scale: float, backend: str = "auto") -> torch.Tensor:
    """Attention with K/V expanded from the latent: packed q_nope (Tq, H, dn), q_rope (Tq, H, dr), k_nope
    (Tk, H, dn), k_rope (Tk, dr) shared by all heads, v (Tk, H, dv) -> (Tq, H, dv).

    Q = [q_nope ‖ q_rope], K = [k_nope ‖ k_rope] per head. cu_seqlens_q/k: int32 (batch + 1,) prefix sums; causal
    bottom-right per sequence: query i of sequence b sits at key position len_k_b - len_q_b + i (len_q <= len_k).
    backend "auto": ioattn's `flash_attn_varlen_func` on CUDA, torch SDPA one sequence at a time elsewhere;
    "ioattn" / "torch" force one. The varlen kernel needs V's head dim equal to Q/K's, so V is padded with
    zeros to dn + dr and the output sliced: V's bytes and the P·V FLOPs grow by (dn + dr) / dv (1.5x for
    V2/V3's 192 / 128), Q·K^T's do not.
    """
    if backend not in EXPANDED_BACKENDS:
        raise ValueError(f"backend must be one of {EXPANDED_BACKENDS}, got {backend!r}")
    heads, value_dim = q_nope.shape[1], v.shape[-1]
    q = torch.cat((q_nope, q_rope), dim=-1)
    k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, heads, -1)), dim=-1)
    varlen = _ioattn_varlen() if backend == "ioattn" or (backend == "auto" and q.is_cuda) else None
    if backend == "ioattn" and varlen is None:
        raise ValueError("backend 'ioattn' needs ioattn.ops.attention.flash_attn_varlen_func, which did not import")
    if varlen is not None:
        width = max(q.shape[-1], value_dim)
        q, k, v = (_zero_padded(t, width) for t in (q, k, v))
        out = varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, causal=True, softmax_scale=softmax_scale)
        return out[..., :value_dim]
    out = q.new_empty(q.shape[0], heads, value_dim)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q_start, q_end, k_start, k_end in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        len_q, len_k = q_end - q_start, k_end - k_start
        if len_q == 0:
            continue
        if len_q > len_k:
            raise ValueError(f"a sequence has {len_q} queries but only {len_k} keys (causal needs len_q <= len_k)")
        q_s = q[q_start:q_end].transpose(0, 1).unsqueeze(0)
        k_s, v_s = (t[k_start:k_end].transpose(0, 1).unsqueeze(0) for t in (k, v))
        if len_q == len_k:
            o_s = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=softmax_scale)
        else:
            key_pos = torch.arange(len_k, device=q.device)
            query_pos = torch.arange(len_q, device=q.device) + (len_k - len_q)
            mask = key_pos[None, :] <= query_pos[:, None]
            o_s = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, scale=softmax_scale)
        out[q_start:q_end] = o_s.squeeze(0).transpose(0, 1)
    return out


def _zero_padded(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


@functools.cache
def _ioattn_varlen():
    """ioattn's varlen kernel entry point, or None when it cannot be imported (checked once)."""
    try:
        from ioattn.ops.attention import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func
