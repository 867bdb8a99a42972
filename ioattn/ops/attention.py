"""Public attention ops: flash-attn's `flash_attn_func` / `flash_attn_varlen_func` and PyTorch's `sdpa`.

Each checks its arguments first (ValueError naming the argument and the supported set), asks
`ioattn.ops.dispatch` for a plan, and runs it inside a torch.autograd.Function whose forward saves only
q, k, v, out and lse; the backward recomputes the score tiles from them (FlashAttention-2), so the memory of
forward + backward grows linearly in N.

Gradients: q, k, v (dK/dV of a GQA group summed over its query heads) and an additive float attn_mask that
requires grad (in its own, possibly broadcast, shape and dtype); a bool mask has none. The LSE returned by
return_lse=True is not differentiable: it does not require grad, and no gradient flows back through it.

Deterministic backward (`deterministic=True`, or `None` with IOATTN_DETERMINISTIC=1 or
torch.use_deterministic_algorithms(True)): no atomics, bitwise-identical gradients across runs. On the Triton
path it turns off a config's fused dQ (`BwdConfig.atomic_dq`: dQ added with fp32 atomics inside the dK/dV
kernel, 5 tile matmuls per (Q, K) tile pair) in favour of the separate dQ kernel (7 matmuls: S and dP are
recomputed), and it reduces the gradient of an additive mask that broadcasts over batch or heads through an
fp32 (B, Hq, Nq, Nk) buffer summed by torch instead of atomics. With a table config whose atomic_dq is off
and no mask gradient it costs nothing. The torch path is always deterministic. `explain()` shows the mode.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd.function import once_differentiable

from ioattn.ops.backward import BwdConfig, attention_bwd
from ioattn.ops.forward import FwdConfig, launch_prefill_fwd
from ioattn.ops import checks, dispatch, torch_backend
from ioattn.ops.checks import AttentionInputs
from ioattn.ops.torch_backward import attention_bwd_torch


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _forward(inputs: AttentionInputs, plan: dispatch.Plan, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill out / lse following the plan."""
    if plan.backend == "torch":
        if plan.torch_tiles is None:
            torch_backend.sdpa_forward(inputs, out, lse)
        else:
            torch_backend.attention_forward(inputs, out, lse, *plan.torch_tiles)
        return
    if plan.backend == "gluon":  # the call passed dispatch.gluon_unsupported: unmasked, 16-bit, sm_90
        from ioattn.ops.gluon_forward import launch_dense, launch_packed

        if inputs.varlen:
            launch_packed(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.max_seqlen_q,
                          inputs.window_left, inputs.window_right, inputs.softmax_scale, out, lse, plan.config)
        else:
            launch_dense(inputs.q, inputs.k, inputs.v, inputs.window_left, inputs.window_right, inputs.softmax_scale,
                         out, lse, plan.config)
        return
    if plan.upcast:
        out32 = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        _forward(_upcast(inputs), dataclasses.replace(plan, upcast=False), out32, lse)
        out.copy_(out32)
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
                       attn_mask=inputs.attn_mask, k_descale=inputs.k_descale, v_descale=inputs.v_descale)


def descaled_varlen_forward(q, k_codes, v_codes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size,
                            softmax_scale, k_descale, v_descale):
    """The Triton varlen forward (no autograd) over K/V that hold fp8 codes converted exactly to q's dtype, the
    per-KV-head float32 descales folded into the softmax scale and the output: what the paged gather path of an
    fp8 cache runs, so the dequantized values are never rounded to 16 bits. Bottom-right windows as given
    (causal folded in); returns (out, lse (Hq, total_q)). The caller has checked every argument."""
    inputs = checks.validate_varlen(q, k_codes, v_codes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    False, window_size, softmax_scale, False)
    inputs = dataclasses.replace(inputs, k_descale=k_descale, v_descale=v_descale)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    _forward(inputs, dispatch.plan(inputs, "triton"), out, lse)
    return out, lse


def _upcast(inputs: AttentionInputs) -> AttentionInputs:
    """The same call on float32 copies of q, k, v (an additive bf16 mask is read in float32 by the kernel)."""
    return dataclasses.replace(inputs, q=inputs.q.float(), k=inputs.k.float(), v=inputs.v.float())


def _mask_for_backward(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The user's mask in a dtype the backward kernels read (bool, float32 or the inputs' dtype)."""
    if attn_mask is None or attn_mask.dtype in (torch.bool, torch.float32, dtype):
        return attn_mask
    return attn_mask.to(torch.float32)


def _outputs_and_forward(q, inputs: AttentionInputs, plan: dispatch.Plan, sdpa_layout: bool):
    """(out as the caller's layout, lse) allocated and filled following the plan."""
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
    return out_user, lse


class AttentionFunction(torch.autograd.Function):
    """Autograd wrapper of one attention call; `sdpa_layout` means q/k/v/out are (B, H, N, D) instead of
    (B, N, H, D). `attn_mask` is the user's mask as given (any broadcastable shape), an input so that an
    additive mask requiring grad gets its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, inputs: AttentionInputs, plan: dispatch.Plan, sdpa_layout: bool):
        out_user, lse = _outputs_and_forward(q, inputs, plan, sdpa_layout)
        ctx.save_for_backward(q, k, v, out_user, lse, attn_mask)
        ctx.inputs, ctx.plan, ctx.sdpa_layout = inputs, plan, sdpa_layout
        ctx.mark_non_differentiable(lse)
        return out_user, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        inputs, plan = ctx.inputs, ctx.plan
        if ctx.sdpa_layout:
            q, k, v, out, grad_out = (t.transpose(1, 2) for t in (q, k, v, out, grad_out))
        mask_grad = ctx.needs_input_grad[3]
        options = dict(
            scale=inputs.softmax_scale, bottom_right=inputs.bottom_right,
            window_size=(inputs.window_left, inputs.window_right),  # causal is already folded in
            cu_seqlens_q=inputs.cu_seqlens_q, cu_seqlens_k=inputs.cu_seqlens_k, max_seqlen_q=inputs.max_seqlen_q,
            max_seqlen_k=inputs.max_seqlen_k, attn_mask=_mask_for_backward(attn_mask, q.dtype), mask_grad=mask_grad,
        )
        if plan.backend == "torch":
            dq, dk, dv, dmask = attention_bwd_torch(grad_out, q, k, v, out, lse, **options)
        elif plan.upcast:
            dq, dk, dv, dmask = attention_bwd(grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                              deterministic=plan.deterministic, config=plan.bwd_config,
                                              **dict(options, attn_mask=_mask_for_backward(attn_mask, torch.float32)))
            dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        else:
            dq, dk, dv, dmask = attention_bwd(grad_out, q, k, v, out, lse, deterministic=plan.deterministic,
                                              config=plan.bwd_config, **options)
        if ctx.sdpa_layout:
            dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
        if dmask is not None:
            dmask = dmask.to(attn_mask.dtype)
        return dq, dk, dv, dmask, None, None, None


def _apply(q, k, v, inputs: AttentionInputs, backend: str, sdpa_layout: bool, deterministic: bool | None,
           attn_mask=None, config: FwdConfig | None = None, bwd_config: BwdConfig | None = None):
    plan = dispatch.plan(inputs, backend, config, deterministic, bwd_config)
    dispatch.log_once(inputs, plan)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask))):
        # inference: no autograd node to build (its bookkeeping is host time paid on every call)
        return _outputs_and_forward(q, inputs, plan, sdpa_layout)
    return AttentionFunction.apply(q, k, v, attn_mask, inputs, plan, sdpa_layout)


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, return_lse=False,
                    deterministic=None, backend="auto", *, fp8=False, q_descale=None, k_descale=None,
                    v_descale=None):
    """Exact attention with flash-attn's signature and layout.

    q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D); Hq a multiple of Hkv (GQA/MQA); D a multiple of 8 up to 256;
    float16 / bfloat16 / float32 with float32 accumulation. Causal and window masks are aligned
    **bottom-right** as in flash-attn >= 2.1: query i sits at key position i + Nk - Nq. window_size is
    (left, right) with -1 unbounded; softmax_scale defaults to 1/sqrt(D). Rows that see no key return 0 and
    LSE -inf. Returns out (B, Nq, Hq, D), or (out, lse) with lse float32 natural log (B, Hq, Nq) when
    return_lse=True (not differentiable). Differentiable in q, k, v; deterministic: True for a bitwise
    reproducible backward (no atomics; see the module docstring for the cost), None for IOATTN_DETERMINISTIC=1
    or torch.are_deterministic_algorithms_enabled(). backend: "auto" (on CUDA the Triton forward, or on sm_90
    the Gluon warp-specialized forward where it takes the call and was measured faster; on CPU torch's CPU SDPA
    kernel where it is exact, else the tiled torch forward; `explain` says which and why), "triton", "gluon"
    (sm_90 only; raises naming what it does not take) or "torch".

    FP8 forward (inference, `ioattn.ops.fp8_attention`): fp8=True quantizes 16-bit q, k, v to e4m3 per 128
    positions of each head, fp8="hadamard" rotates Q and K first; or e4m3 q, k, v with flash-attn 3's
    q_descale / k_descale / v_descale, float32 (B, Hkv). backend then picks its kernel ("auto", "triton" or
    "gluon", as `flash_attn_fp8_func` takes them).
    """
    if fp8 is not False or (isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn):
        if fp8 not in (False, True, "hadamard"):
            raise ValueError(f"fp8 must be False, True or 'hadamard', got {fp8!r}")
        from ioattn.ops.fp8_attention import FP8_BACKENDS, flash_attn_fp8_func

        if deterministic or backend not in FP8_BACKENDS:
            raise ValueError(f"the fp8 forward has no backward and no torch path: backend must be one of "
                             f"{FP8_BACKENDS} and deterministic unset, got backend={backend!r}, "
                             f"deterministic={deterministic!r}")
        return flash_attn_fp8_func(q, k, v, causal, window_size, softmax_scale, return_lse, q_descale=q_descale,
                                   k_descale=k_descale, v_descale=v_descale, hadamard=fp8 == "hadamard",
                                   backend=backend)
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise ValueError("q_descale / k_descale / v_descale go with float8_e4m3fn q, k, v (the fp8 forward)")
    checks.check_backend(backend, checks.ATTENTION_BACKENDS)
    inputs = checks.validate_dense(q, k, v, causal, window_size, softmax_scale)
    out, lse = _apply(q, k, v, inputs, backend, False, deterministic)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           window_size=(-1, -1), softmax_scale=None, return_lse=False, deterministic=None,
                           backend="auto", validate=None):
    """Variable-length attention on packed sequences, flash-attn's signature.

    q (total_q, Hq, D), k/v (total_k, Hkv, D); cu_seqlens_q/k int32 (batch + 1,) prefix sums of the
    sequence lengths (zero-length sequences allowed), cu_seqlens_q ending at total_q and cu_seqlens_k at most at
    total_k; max_seqlen_q/k at least the longest sequence. Their values are checked when `validate` is True, or
    None on CPU tensors or with IOATTN_VALIDATE=1 (on CUDA that costs a host sync); otherwise they are trusted,
    as in flash-attn (see `ioattn.ops.checks`). Causal/window aligned bottom-right per sequence. Returns out
    (total_q, Hq, D), or (out, lse) with lse float32 (Hq, total_q) when return_lse=True (not differentiable).
    Differentiable in q, k, v; `deterministic` and `backend` as in flash_attn_func.
    """
    checks.check_backend(backend, checks.ATTENTION_BACKENDS)
    inputs = checks.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    window_size, softmax_scale, validate)
    out, lse = _apply(q, k, v, inputs, backend, False, deterministic)
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
    Differentiable in query, key, value and an additive attn_mask that requires grad (its gradient comes back
    in the mask's own shape). PyTorch's sdpa has no `deterministic` argument: the backward is deterministic
    when IOATTN_DETERMINISTIC=1 or torch.use_deterministic_algorithms(True) is in effect.
    """
    checks.check_backend(backend, checks.ATTENTION_BACKENDS)
    inputs = checks.validate_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    out, _ = _apply(query, key, value, inputs, backend, True, None, attn_mask)
    return out


def flash_attn_with_config(q, k, v, config: FwdConfig | None, causal=False, window_size=(-1, -1), softmax_scale=None,
                           bwd_config: BwdConfig | None = None, deterministic=None):
    """flash_attn_func on the Triton kernels with explicit tile configurations instead of the tuned tables
    (None keeps the table's choice).

    `ioattn bench tune` times every `forward.candidate_configs(D, dtype)` entry through it; a `bwd_config` from
    `backward.candidate_configs(D, dtype)` applies to the backward of this call. Returns (out, lse).
    """
    inputs = checks.validate_dense(q, k, v, causal, window_size, softmax_scale)
    return _apply(q, k, v, inputs, "triton", False, deterministic, config=config, bwd_config=bwd_config)
