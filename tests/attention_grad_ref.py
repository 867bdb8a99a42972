"""Float64 reference gradients of attention (autograd through `ioattn.reference.attention_ref(...,
differentiable=True)`) and the random problems the backward tests share."""

from __future__ import annotations

import dataclasses
import math

import torch

from ioattn.reference import TOLERANCE, attention_ref


def attention_grads_ref(q, k, v, do, *, scale, causal=False, bottom_right=True, window_size=(-1, -1),
                        attn_mask=None, mask_grad=False, cu_seqlens_q=None, cu_seqlens_k=None, saved_o=None):
    """(dq, dk, dv, dmask) in float64 for the same arguments as the backward launchers.

    saved_o: the forward output the backward is given, rounded to the input dtype. The backward forms
    delta = rowsum(dO * O) from it, so its dS is P * (dP - delta) with O rounded, not the true P * (dP - delta):
    the difference, -P * rowsum(dO * (O_saved - O)), is the lse's gradient weighted by that row sum, and taking
    it off gives the exact float64 value of what the algorithm computes. Without it a check measures the rounding
    of O through a cancelling difference (dP - delta), not the kernel: seen on tiny random problems, fp16 dmask
    3.7e-3 > 2e-3 and fp32 dq 1.02e-5 > 1e-5, each about once in 500.
    """
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.detach().double().requires_grad_(mask_grad)
    out, lse = attention_ref(q64, k64, v64, causal=causal, causal_align="bottom_right" if bottom_right else "top_left",
                             window_size=window_size, attn_mask=attn_mask, softmax_scale=scale,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, differentiable=True)
    wrt = [q64, k64, v64] + ([attn_mask] if mask_grad else [])
    if saved_o is None:
        grads = torch.autograd.grad(out, wrt, do.double(), allow_unused=True)
    else:
        rounding = (do.double() * (saved_o.double() - out.detach())).sum(-1)  # (B, Nq, Hq) or (total, Hq)
        rounding = rounding.transpose(1, 2) if rounding.dim() == 3 else rounding.t()  # the lse layout
        grads = torch.autograd.grad((out, lse), wrt, (do.double(), -rounding), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt)]
    return (*grads[:3], grads[3] if mask_grad else None)


def gradient_magnitudes(q, k, v, do, saved_o, *, scale, causal=False, bottom_right=True, window_size=(-1, -1),
                        attn_mask=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """(dq, dk, dv, dmask) with every sum taken over absolute values, in float64: dS = P * (dP - delta) bounded by
    P * (|dP| + |delta|), then |dS| @ |K|, |dS|^T @ |Q|, P^T @ |dO| (delta from `saved_o`, as the backward forms it),
    and |dS| summed to the shape of an additive `attn_mask` (dmask is None for no mask or a bool one).

    Float32 rounding inside any backward (dP, delta, the products) is proportional to these, not to the gradient
    itself: where dP - delta cancels (a softmax row that is almost one-hot) the true dq can be far below them, and
    a check relative to it alone would measure float32 arithmetic, not the kernel. Dense (B, N, H, D) or packed
    varlen (total, H, D) inputs, as `attention_grads_ref` takes them (masks dense only); computed on the CPU,
    returned on q's device."""
    packed = q.dim() == 3
    q64, k64, v64, do64, o64 = (t.detach().double().cpu() for t in (q, k, v, do, saved_o))
    if packed:
        q64, k64, v64, do64, o64 = (t.unsqueeze(0) for t in (q64, k64, v64, do64, o64))
    keys, group = k64.shape[1], q64.shape[2] // k64.shape[2]
    # P itself, as attention with one-hot values: row i of the output is query i's probabilities over the keys.
    eye = torch.eye(keys, dtype=torch.float64)[None, :, None, :].expand(1, keys, k64.shape[2], keys)
    rules = dict(causal=causal, causal_align="bottom_right" if bottom_right else "top_left", window_size=window_size,
                 softmax_scale=scale)
    if packed:
        probs, _ = attention_ref(q64[0], k64[0], eye[0], cu_seqlens_q=cu_seqlens_q.cpu(),
                                 cu_seqlens_k=cu_seqlens_k.cpu(), **rules)
        probs = probs[None]
    else:
        mask = None if attn_mask is None else attn_mask.detach().cpu()
        probs = torch.cat([attention_ref(q64[b:b + 1], k64[b:b + 1], eye, **rules,
                                         attn_mask=None if mask is None else mask[b % mask.shape[0]][None])[0]
                           for b in range(q64.shape[0])])
    k_e, v_e = (t.repeat_interleave(group, dim=2) for t in (k64, v64))
    d_p = torch.einsum("bihd,bjhd->bihj", do64, v_e).abs()
    delta = (do64 * o64).sum(-1).abs()[..., None]
    weight = probs * (d_p + delta)
    dq = scale * torch.einsum("bihj,bjhd->bihd", weight, k_e.abs())
    dk, dv = (torch.einsum("bihj,bihd->bjhd", w, t.abs()) for w, t in ((weight * scale, q64), (probs, do64)))
    dk, dv = (t.unflatten(2, (-1, group)).sum(3) for t in (dk, dv))
    dmask = None
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        dmask = weight.transpose(1, 2)  # (B, H, Nq, Nk), then summed over the mask's broadcast dimensions
        dmask = dmask.sum([i for i, n in enumerate(attn_mask.shape) if n == 1 and dmask.shape[i] != 1], keepdim=True)
    # on the inputs' device, as torch.autograd.grad wants them to carry these back through q, k, v's views
    dmask = None if dmask is None else dmask.to(q.device)
    return (*((t[0] if packed else t).to(q.device) for t in (dq, dk, dv)), dmask)


def gradient_error(name, grad, ref, magnitude, dtype):
    """None when `grad` is within the dtype's tolerance of the float64 reference plus float32's tolerance of its
    summands' magnitude (`gradient_magnitudes`), else what is wrong: float32 rounds inside every backward, and
    where the reference cancels to far below its summands that rounding, not the kernel, would decide the check."""
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    err = (grad.double().cpu() - ref.double().cpu()).norm().item()
    bound = tolerance * ref.norm().item() + TOLERANCE[torch.float32] * magnitude.norm().item()
    if not err <= bound:  # NaN and inf fail
        return (f"{name} error {err:.3g} > {bound:.3g} ({tolerance:.0e} of |ref| + {TOLERANCE[torch.float32]:.0e} "
                f"of the summands' magnitude; rel error {err / max(ref.norm().item(), 1e-300):.3g})")
    return None


def _random_mask(kind, batch, hq, n_q, n_k, dtype, device):
    if kind is None:
        return None
    if kind == "bool":  # broadcast over heads
        return torch.rand(batch, 1, n_q, n_k, device=device) > 0.3
    if kind == "additive":  # full shape, with some -inf entries
        mask = torch.randn(batch, hq, n_q, n_k, dtype=dtype, device=device)
        return mask.masked_fill_(torch.rand(mask.shape, device=device) < 0.2, -math.inf)
    assert kind == "additive_broadcast", kind  # broadcast over batch and heads
    return torch.randn(n_q, n_k, dtype=dtype, device=device)


@dataclasses.dataclass
class Problem:
    """A random backward problem: inputs, the forward's o/lse (from the float64 reference) and dO."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    do: torch.Tensor
    kwargs: dict


def make_problem(*, batch=1, n_q=16, n_k=16, hq=2, hkv=1, head_dim=16, dtype=torch.float32, device="cpu",
                 causal=False, bottom_right=True, window_size=(-1, -1), mask=None, seqlens=None) -> Problem:
    """`mask`: None | "bool" | "additive" | "additive_broadcast" | a mask tensor; `seqlens`: list of (n_q, n_k)
    per sequence for the packed varlen layout."""
    scale = 1.0 / math.sqrt(head_dim)
    kwargs = dict(scale=scale, causal=causal, bottom_right=bottom_right, window_size=window_size)
    if seqlens is not None:
        cu_q = torch.tensor([0] + [n for n, _ in seqlens], dtype=torch.int32).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + [n for _, n in seqlens], dtype=torch.int32).cumsum(0).to(torch.int32)
        q_shape, k_shape = (int(cu_q[-1]), hq, head_dim), (int(cu_k[-1]), hkv, head_dim)
        kwargs.update(cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
                      max_seqlen_q=max([n for n, _ in seqlens], default=0),
                      max_seqlen_k=max([n for _, n in seqlens], default=0))
    else:
        q_shape, k_shape = (batch, n_q, hq, head_dim), (batch, n_k, hkv, head_dim)
    q, k, v = (torch.randn(s, dtype=dtype, device=device) for s in (q_shape, k_shape, k_shape))
    if isinstance(mask, torch.Tensor):
        attn_mask = mask.to(device)
    else:
        attn_mask = _random_mask(mask, batch, hq, n_q, n_k, dtype, device)
    if attn_mask is not None:
        kwargs["attn_mask"] = attn_mask
    ref_kwargs = {"cu_seqlens_q": kwargs.get("cu_seqlens_q"), "cu_seqlens_k": kwargs.get("cu_seqlens_k")}
    o, lse = attention_ref(q, k, v, causal=causal, window_size=window_size, attn_mask=attn_mask, softmax_scale=scale,
                           causal_align="bottom_right" if bottom_right else "top_left",
                           **{n: t.cpu() if t is not None else None for n, t in ref_kwargs.items()})
    do = torch.randn(q_shape, dtype=dtype, device=device)
    return Problem(q, k, v, o.to(dtype).to(device), lse.float().to(device), do, kwargs)


def reference_grads(problem: Problem, mask_grad: bool = False):
    kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in problem.kwargs.items()
          if n not in ("max_seqlen_q", "max_seqlen_k")}
    return attention_grads_ref(problem.q.cpu(), problem.k.cpu(), problem.v.cpu(), problem.do.cpu(),
                               mask_grad=mask_grad, saved_o=problem.o.cpu(), **kw)


def problem_gradient_magnitudes(problem: Problem):
    """`gradient_magnitudes` of a `make_problem` problem (what its float32 rounding is proportional to)."""
    kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in problem.kwargs.items()
          if n not in ("max_seqlen_q", "max_seqlen_k")}
    return gradient_magnitudes(problem.q, problem.k, problem.v, problem.do, problem.o, **kw)
