"""Exact attention in float64: the ground truth every kernel is tested against.

Conventions (flash-attn): q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D) or packed varlen (total, H, D) with int32
`cu_seqlens`; LSE in natural log of the *scaled* scores, (B, Hq, Nq) or (Hq, total_q). Query row i of a
sequence sits at key position `i + Nk - Nq` (bottom-right, flash-attn >= 2.1) or `i` (top-left, PyTorch SDPA).
A row that can see no key returns output 0 and LSE -inf.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def visible(
    n_q: int,
    n_k: int,
    *,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    sink_tokens: int = 0,
    causal_align: str = "bottom_right",
    q_pos_offset: int | None = None,
    device=None,
) -> torch.Tensor:
    """Bool (n_q, n_k): which keys each query may see under causal / sliding-window / sink rules.

    `q_pos_offset` overrides the alignment: query i sits at key position `q_pos_offset + i`.
    Sinks (the first `sink_tokens` keys) ignore the left window bound but never the causal/right bound.
    """
    if q_pos_offset is None:
        if causal_align not in ("bottom_right", "top_left"):
            raise ValueError(f"causal_align must be 'bottom_right' or 'top_left', got {causal_align!r}")
        q_pos_offset = n_k - n_q if causal_align == "bottom_right" else 0
    pos = torch.arange(n_q, device=device)[:, None] + q_pos_offset
    key = torch.arange(n_k, device=device)[None, :]
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    ok = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= key <= pos + right
    if left >= 0:
        ok &= (key >= pos - left) | (key < sink_tokens)
    return ok


def _dense_attention(q, k, v, allowed, bias, scale):
    """q (Hq, Nq, D), k/v (Hkv, Nk, D) in float64; allowed broadcastable bool (.., Nq, Nk); bias additive.

    Rows that see no key get their scores replaced by zeros before the softmax (and P = 0 after it), so
    autograd through this function gives them zero gradient instead of NaN from logsumexp(-inf, ..., -inf).
    """
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    s = torch.einsum("hqd,hkd->hqk", q, k) * scale
    if bias is not None:
        s = s + bias
    allowed = allowed.expand(s.shape)
    empty = ~allowed.any(dim=-1, keepdim=True)
    s = torch.where(allowed, s, NEG_INF).masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse).masked_fill(empty, 0.0)
    return torch.einsum("hqk,hkd->hqd", p, v), lse.masked_fill(empty, NEG_INF).squeeze(-1)


def _check_heads(hq: int, hkv: int) -> None:
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"number of query heads ({hq}) must be a multiple of key/value heads ({hkv})")


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    causal_align: str = "bottom_right",
    window_size: tuple[int, int] = (-1, -1),
    sink_tokens: int = 0,
    attn_mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    differentiable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention with every option the kernels have; returns (out float64, lse float64).

    attn_mask: bool (True = attend, as PyTorch) or additive float, broadcastable to (B, Hq, Nq, Nk); it is
    combined with causal/window. Not supported with varlen (as in flash-attn).
    differentiable: keep q, k, v and an additive attn_mask in the autograd graph (they are detached
    otherwise), so float64 autograd gives the reference gradients; pass float64 leaves to get float64
    gradients. Rows that see no key get zero gradient, never NaN.
    """
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale

    def as_float64(t: torch.Tensor) -> torch.Tensor:
        return (t if differentiable else t.detach()).to(torch.float64)

    q64, k64, v64 = (as_float64(t) for t in (q, k, v))
    _check_heads(q.shape[-2], k.shape[-2])
    rules = dict(causal=causal, window_size=window_size, sink_tokens=sink_tokens, causal_align=causal_align)

    if cu_seqlens_q is not None:
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported with varlen (cu_seqlens) inputs")
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for b in range(len(cq) - 1):
            qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
            allowed = visible(qe - qs, ke - ks, device=q.device, **rules)
            o_b, l_b = _dense_attention(
                q64[qs:qe].transpose(0, 1), k64[ks:ke].transpose(0, 1), v64[ks:ke].transpose(0, 1), allowed, None, scale
            )
            outs.append(o_b.transpose(0, 1))
            lses.append(l_b)
        # rows past cu_seqlens_q[-1] belong to no sequence: output 0, LSE -inf
        tail = q.shape[0] - cq[-1]
        outs.append(torch.zeros(tail, q.shape[1], v.shape[-1], dtype=torch.float64, device=q.device))
        lses.append(torch.full((q.shape[1], tail), NEG_INF, dtype=torch.float64, device=q.device))
        return torch.cat(outs), torch.cat(lses, dim=1)

    batch, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    allowed = visible(n_q, n_k, device=q.device, **rules).expand(batch, 1, n_q, n_k)
    bias = None
    if attn_mask is not None:
        mask = attn_mask.expand(batch, q.shape[2], n_q, n_k) if attn_mask.dim() == 4 else attn_mask
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            bias = as_float64(mask).expand(batch, q.shape[2], n_q, n_k)
            allowed = allowed & ~torch.isneginf(bias)
    allowed = allowed.expand(batch, q.shape[2], n_q, n_k)
    outs, lses = [], []
    for b in range(batch):
        o_b, l_b = _dense_attention(
            q64[b].transpose(0, 1), k64[b].transpose(0, 1), v64[b].transpose(0, 1),
            allowed[b], None if bias is None else bias[b], scale,
        )
        outs.append(o_b.transpose(0, 1))
        lses.append(l_b)
    if not batch:
        return (torch.zeros(0, n_q, q.shape[2], v.shape[-1], dtype=torch.float64, device=q.device),
                torch.zeros(0, q.shape[2], n_q, dtype=torch.float64, device=q.device))
    return torch.stack(outs), torch.stack(lses)


def sdpa_ref(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Reference with torch.nn.functional.scaled_dot_product_attention's semantics: (B, H, N, D), top-left causal."""
    out, lse = attention_ref(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        causal=is_causal, causal_align="top_left", attn_mask=attn_mask, softmax_scale=scale,
    )
    return out.transpose(1, 2), lse


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖_F / ‖ref‖_F in float64; NaN/inf anywhere in `out` gives inf so it can never pass."""
    out64 = out.detach().to(torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    ref64 = ref.detach().to(torch.float64).to(out64.device)
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff if denom == 0.0 else diff / denom


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute error of a log-sum-exp against the reference; -inf must match -inf exactly, NaN never passes."""
    lse64 = lse.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    if torch.isnan(lse64).any() or not torch.equal(torch.isneginf(lse64), torch.isneginf(ref64)):
        return float("inf")
    finite = torch.isfinite(ref64)
    if not finite.any():
        return 0.0
    return (lse64[finite] - ref64[finite]).abs().max().item()
