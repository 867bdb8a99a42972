"""Fused elementwise ops of the decoder: RMSNorm (with the residual add folded in), RoPE in place, SiLU-and-mul.

Each returns what the unfused PyTorch code in `ioattn.models.llama` returns, rounded at the same points (see
`ioattn.kernels.fused_ops`; RMSNorm reduces its sum of squares in another order, so its last bits may differ).
They run several times per layer per step, so the checks are cheap and build their messages only when they fail;
nothing here synchronises with the device or allocates beyond the output, so all three are CUDA-graph safe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import ioattn.kernels  # noqa: F401,I001  (first: on a CPU-only machine it selects the interpreter before triton loads)
from ioattn.kernels import interpreted
from ioattn.kernels.fused_ops import rms_norm_kernel, rotary_embedding_kernel, silu_and_mul_kernel
from ioattn.intmath import cdiv, next_power_of_2
from ioattn.ops.checks import SUPPORTED_DTYPES

# RMSNorm keeps a whole row in registers (x and residual are read once). Every Llama-family hidden size fits
# (405B: 16384); wider rows are refused rather than served by a second, multi-pass code path that would need
# validating on its own.
MAX_HIDDEN = 16384
SILU_BLOCK = 1024
ROTARY_HEADS_PER_PROGRAM = 8

# Read once: ioattn.kernels has chosen compiled kernels or the interpreter by the time this module loads.
_LIBDEVICE = not interpreted()


def _require(ok: bool, message: Callable[[], str]) -> None:
    if not ok:
        raise ValueError(message())


def _check_activation(name: str, t: torch.Tensor) -> None:
    _require(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dtype in SUPPORTED_DTYPES, lambda: f"{name} dtype must be one of {SUPPORTED_DTYPES}, got {t.dtype}")
    _require(t.stride(-1) == 1, lambda: f"{name} must be contiguous in its last dimension (stride(-1) == 1)")


def _check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    _require(t.dtype == ref.dtype, lambda: f"{name} dtype ({t.dtype}) must equal {ref_name} dtype ({ref.dtype})")
    _require(t.device == ref.device, lambda: f"{name} is on {t.device} but {ref_name} is on {ref.device}")



def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(token, row) strides of a (T, H) or (T, N, H) tensor; (T, H) is launched as (T, 1, H)."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def _launch_options(num_warps: int) -> dict:
    # No FMA contraction: torch runs each multiply and add as its own kernel, rounding in between.
    return {"num_warps": num_warps, "enable_fp_fusion": False}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of the last dimension of x (T, H) or (T, N, H), scaled by weight (H,).

    Without `residual`, returns the normed tensor. With it (same shape as x), normalises h = x + residual,
    writes h into `residual` in place and returns (normed, residual): the fused "add the sublayer's output to
    the residual stream, then norm" of a pre-norm decoder.
    """
    _check_activation("x", x)
    _require(x.dim() in (2, 3), lambda: f"x must be (T, H) or (T, N, H), got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    _require(hidden <= MAX_HIDDEN,
             lambda: f"x rows of {hidden} elements are wider than rms_norm supports ({MAX_HIDDEN})")
    _require(isinstance(weight, torch.Tensor) and weight.shape == (hidden,) and weight.stride(0) == 1,
             lambda: f"weight must be a contiguous ({hidden},) tensor, got {getattr(weight, 'shape', weight)}")
    _check_like("weight", weight, "x", x)
    if residual is not None:
        _check_activation("residual", residual)
        _require(residual.shape == x.shape,
                 lambda: f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
        _check_like("residual", residual, "x", x)
        _require(residual.data_ptr() != x.data_ptr() or x.numel() == 0,
                 lambda: "residual must not share x's memory (it is overwritten)")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out if residual is None else (out, residual)
    residual_or_x = x if residual is None else residual  # x: a placeholder, never read without HAS_RESIDUAL
    block = next_power_of_2(hidden)
    rms_norm_kernel[(x.shape[0], x.shape[1] if x.dim() == 3 else 1)](
        x, residual_or_x, weight, out, *_row_strides(x), *_row_strides(residual_or_x), *_row_strides(out), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, LIBDEVICE=_LIBDEVICE,
        **_launch_options(max(1, min(8, block // 512))),
    )
    return out if residual is None else (out, residual)


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by RoPE at `positions` (T,) int32/int64, with frequencies
    `inv_freq` (D/2,) float32; halves convention (HF checkpoints). q and k may be strided views (of one qkv
    buffer, say) as long as head_dim is contiguous. One launch covers both."""
    _check_activation("q", q)
    _check_activation("k", k)
    _require(q.dim() == 3 and k.dim() == 3, lambda: f"q and k must be (T, heads, D), got {tuple(q.shape)} and "
                                                    f"{tuple(k.shape)}")
    tokens, num_q_heads, head_dim = q.shape
    _require(k.shape[0] == tokens and k.shape[2] == head_dim and head_dim % 2 == 0,
             lambda: f"k {tuple(k.shape)} must match q {tuple(q.shape)} in tokens and (even) head_dim")
    _check_like("k", k, "q", q)
    _require(isinstance(positions, torch.Tensor) and positions.dtype in (torch.int32, torch.int64)
             and positions.shape == (tokens,) and positions.stride(0) == 1,
             lambda: f"positions must be a contiguous int32/int64 ({tokens},) tensor, got "
                     f"{getattr(positions, 'dtype', positions)} {tuple(getattr(positions, 'shape', ()))}")
    _require(positions.device == q.device, lambda: f"positions is on {positions.device} but q is on {q.device}")
    half = head_dim // 2
    _require(isinstance(inv_freq, torch.Tensor) and inv_freq.dtype == torch.float32 and inv_freq.shape == (half,)
             and inv_freq.stride(0) == 1,
             lambda: f"inv_freq must be a contiguous float32 ({half},) tensor, got "
                     f"{getattr(inv_freq, 'dtype', inv_freq)} {tuple(getattr(inv_freq, 'shape', ()))}")
    _require(inv_freq.device == q.device, lambda: f"inv_freq is on {inv_freq.device} but q is on {q.device}")
    if tokens == 0:
        return
    num_kv_heads = k.shape[1]
    block_heads = min(ROTARY_HEADS_PER_PROGRAM, next_power_of_2(max(num_q_heads, num_kv_heads)))
    q_blocks = cdiv(num_q_heads, block_heads)
    grid = (tokens, q_blocks + cdiv(num_kv_heads, block_heads))
    block_half = next_power_of_2(half)
    rotary_embedding_kernel[grid](
        q, k, positions, inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_q_heads, num_kv_heads, q_blocks,
        HALF=half, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, LIBDEVICE=_LIBDEVICE,
        **_launch_options(max(1, min(4, block_heads * block_half // 256))),
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) -> silu(gate) * up (T, I), gate and up being its first and second halves (SwiGLU)."""
    _check_activation("gate_up", gate_up)
    _require(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
             lambda: f"gate_up must be (T, 2 * intermediate), got shape {tuple(gate_up.shape)}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(SILU_BLOCK, next_power_of_2(inter))
    silu_and_mul_kernel[(tokens, cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter,
        BLOCK=block, LIBDEVICE=_LIBDEVICE, **_launch_options(4),
    )
    return out
