"""Public attention ops: flash-attn's `flash_attn_func` / `flash_attn_varlen_func` and PyTorch's `sdpa`.

Each checks its arguments first (ValueError naming the argument and the supported set), asks
`ioattn.ops.dispatch` for a plan, and runs it inside a torch.autograd.Function whose forward saves only
q, k, v, out and lse (the backward recomputes the rest).
"""

from __future__ import annotations

import torch

from ioattn.kernels.prefill_fwd import FwdConfig, launch_prefill_fwd
from ioattn.ops import checks, dispatch, torch_backend
from ioattn.ops.checks import AttentionInputs


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _forward(inputs: AttentionInputs, plan: dispatch.Plan, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill out / lse following the plan."""
    if plan.backend == "torch":
        torch_backend.attention_forward(inputs, out, lse, *plan.torch_tiles)
        return
    q, k, v = inputs.q, inputs.k, inputs.v
    copied = {name for name, _ in plan.copies}
    q, k, v = (_contiguous_copy(t) if name in copied else t for name, t in (("q", q), ("k", k), ("v", v)))
    if k.shape[-3] == 0:  # no keys at all: every row is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return
    launch_prefill_fwd(q, k, v, out, lse, plan.problem, plan.config, cu_seqlens_q=inputs.cu_seqlens_q,
                       cu_seqlens_k=inputs.cu_seqlens_k, max_seqlen_q=inputs.max_seqlen_q,
                       attn_mask=inputs.attn_mask)


class AttentionFunction(torch.autograd.Function):
    """Autograd wrapper of one attention forward; `sdpa_layout` returns out as (B, H, N, D) instead of (B, N, H, D)."""

    @staticmethod
    def forward(ctx, q, k, v, inputs: AttentionInputs, plan: dispatch.Plan, sdpa_layout: bool):
        if sdpa_layout:  # (B, H, N, D) storage, so the returned tensor is contiguous as PyTorch's is
            out_user = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            out_flash = out_user.transpose(1, 2)
        else:
            out_user = out_flash = torch.empty(inputs.q.shape, dtype=q.dtype, device=q.device)
        if inputs.varlen:
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        else:
            lse = torch.empty(inputs.q.shape[0], inputs.q.shape[2], inputs.q.shape[1], dtype=torch.float32,
                              device=q.device)
        _forward(inputs, plan, out_flash, lse)
        ctx.save_for_backward(q, k, v, out_user, lse)
        ctx.inputs, ctx.plan, ctx.sdpa_layout = inputs, plan, sdpa_layout
        ctx.mark_non_differentiable(lse)
        return out_user, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        raise NotImplementedError("backward lands with issue 3")


def _apply(q, k, v, inputs: AttentionInputs, backend: str, sdpa_layout: bool, config=None):
    plan = dispatch.plan(inputs, backend, config)
    dispatch.log_once(inputs, plan)
    return AttentionFunction.apply(q, k, v, inputs, plan, sdpa_layout)


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, return_lse=False,
                    backend="auto"):
    """Exact attention with flash-attn's signature and layout.

    q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D); Hq a multiple of Hkv (GQA/MQA); D a multiple of 8 up to 256;
    float16 / bfloat16 / float32 with float32 accumulation. Causal and window masks are aligned
    **bottom-right** as in flash-attn >= 2.1: query i sits at key position i + Nk - Nq. window_size is
    (left, right) with -1 unbounded; softmax_scale defaults to 1/sqrt(D). Rows that see no key return 0 and
    LSE -inf. Returns out (B, Nq, Hq, D), or (out, lse) with lse float32 natural log (B, Hq, Nq) when
    return_lse=True. backend: "auto" (Triton on CUDA, exact tiled torch on CPU), "triton" or "torch".
    """
    checks.check_backend(backend)
    inputs = checks.validate_dense(q, k, v, causal, window_size, softmax_scale)
    out, lse = _apply(q, k, v, inputs, backend, sdpa_layout=False)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           window_size=(-1, -1), softmax_scale=None, return_lse=False, backend="auto"):
    """Variable-length attention on packed sequences, flash-attn's signature.

    q (total_q, Hq, D), k/v (total_k, Hkv, D); cu_seqlens_q/k int32 (batch + 1,) prefix sums of the
    sequence lengths (zero-length sequences allowed); max_seqlen_q/k at least the longest sequence (on CUDA
    it is trusted, as in flash-attn). Causal/window aligned bottom-right per sequence. Returns out
    (total_q, Hq, D), or (out, lse) with lse float32 (Hq, total_q) when return_lse=True.
    """
    checks.check_backend(backend)
    inputs = checks.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    window_size, softmax_scale)
    out, lse = _apply(q, k, v, inputs, backend, sdpa_layout=False)
    return (out, lse) if return_lse else out


def sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, backend="auto"):
    """torch.nn.functional.scaled_dot_product_attention semantics on (B, H, N, D) tensors.

    is_causal uses PyTorch's **top-left** alignment (query i sees keys 0..i, whatever Nq and Nk are).
    attn_mask: bool (True = attend) or additive float, broadcastable to (B, H, Nq, Nk). The mask is streamed
    tile by tile inside the kernel through stride-0 broadcast views, never expanded or rewritten into
    is_causal: each program reads the (BLOCK_M, BLOCK_N) mask tile of every K/V tile it visits, so the extra
    traffic is one mask element per score (B*H*Nq*Nk elements; broadcast dimensions mostly hit in cache),
    comparable to reading K and V again when D is small. attn_mask with is_causal=True raises, as PyTorch's
    fused backends do. Grouped-query key/value heads need enable_gqa=True. Dropout is not supported.
    A row whose mask allows no key (bool all False, or additive all -inf) returns 0 here, never NaN; PyTorch
    returns NaN there on some backends and versions.
    """
    checks.check_backend(backend)
    inputs = checks.validate_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    out, _ = _apply(query, key, value, inputs, backend, sdpa_layout=True)
    return out


def flash_attn_with_config(q, k, v, config: FwdConfig, causal=False, window_size=(-1, -1), softmax_scale=None):
    """flash_attn_func on the Triton kernel with an explicit tile configuration instead of the tuned table.

    For tuning and benchmarks: time every `dispatch.candidate_configs(D, dtype)` entry with it. Returns (out, lse).
    """
    inputs = checks.validate_dense(q, k, v, causal, window_size, softmax_scale)
    return _apply(q, k, v, inputs, "triton", sdpa_layout=False, config=config)
