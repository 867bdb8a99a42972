"""The attention forward on CPU tensors: torch's own CPU SDPA kernel where its semantics match exactly, else the exact
tiled forward in plain torch.

`sdpa_forward` runs `aten._scaled_dot_product_flash_attention_for_cpu`, the kernel behind PyTorch's SDPA on the CPU:
tiled with an online softmax (memory linear in the sequence length), float32 accumulation, grouped-query heads
read in place, and it returns the natural-log LSE the backward needs. It runs a call when `sdpa_mismatch` finds
nothing it would compute differently:

- no mask, a mask of `sdpa()` (a bool mask as 0 / -inf in q's dtype; an additive one as given in float32 or q's
  dtype, else in float32), or a causal rule: top-left as is; bottom-right with Nq > Nk as top-left on the last Nk
  queries, the first Nq - Nk seeing no key; with one query as no rule at all (it sees every key); with
  1 < Nq < Nk as two calls merged by their LSE (the Nk - Nq keys every query sees, then the causal square), so
  the outputs round twice;
- rows that see no key get 0 and LSE -inf (the kernel gives 0 and LSE 0);
- not a sliding window (left >= 0, or right > 0): the tiled forward visits only the tiles a window can see;
- not causal with softmax_scale <= 0: the kernel masks scores to -inf before scaling them, which gives NaN.

`attention_forward` is the tiled forward: the Triton kernel's algorithm (online softmax over K/V tiles, float32
accumulation, only the tiles a causal/window rule can see), memory linear in the sequence length (the largest
temporary is one (Hq, block_m, block_n) score tile), every option of the Triton kernel.
"""

from __future__ import annotations

import torch

from ioattn.ops.checks import AttentionInputs

DEFAULT_BLOCK_M = 256
DEFAULT_BLOCK_N = 512
_SDPA_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def sdpa_mismatch(inputs: AttentionInputs) -> str | None:
    """Why torch's CPU SDPA kernel would not compute this call exactly as specified (None: it would)."""
    if _SDPA_CPU is None:
        return "this torch has no aten._scaled_dot_product_flash_attention_for_cpu"
    if inputs.q.device.type != "cpu":
        return f"{inputs.q.device.type} tensors"
    left, right = _effective_window(inputs)
    if left >= 0 or right > 0:
        return f"sliding window ({left}, {right}): the tiled forward visits only the tiles it can see"
    if right == 0 and inputs.softmax_scale <= 0:
        return (f"causal with softmax_scale {inputs.softmax_scale:g} <= 0: torch's CPU kernel masks scores to -inf "
                "before it scales them (NaN)")
    return None


def sdpa_case(inputs: AttentionInputs) -> str:
    """How `sdpa_forward` maps the call onto the kernel (for explain), given that `sdpa_mismatch` found nothing."""
    if _effective_window(inputs)[1] < 0:
        case = "one call, " + ("no mask" if inputs.attn_mask is None else "the mask as an additive bias")
    elif not inputs.bottom_right:
        case = "one call, is_causal (top-left)"
    elif inputs.varlen:
        case = ("bottom-right causal per sequence: is_causal when Nq == Nk, on the last Nk queries when Nq > Nk, "
                "two calls merged by their LSE when Nq < Nk")
    elif inputs.q.shape[1] == inputs.k.shape[1]:
        case = "one call, is_causal (Nq == Nk: bottom-right is top-left)"
    elif inputs.q.shape[1] == 1:
        case = "one call, no mask (one bottom-right query sees every key)"
    elif inputs.q.shape[1] > inputs.k.shape[1]:
        case = "bottom-right causal, Nq > Nk: is_causal on the last Nk queries, the first Nq - Nk see no key"
    else:
        case = ("bottom-right causal, Nq < Nk: the Nk - Nq keys every query sees, then the causal square, two calls "
                "merged by their LSE")
    strided = [name for name, t in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v)) if t.stride(-1) != 1]
    return case + (f"; {', '.join(strided)} copied (last stride != 1)" if strided else "")


def _effective_window(inputs: AttentionInputs) -> tuple[int, int]:
    """The window with bounds no query and key can lie apart by made -1 (unbounded)."""
    span = inputs.max_seqlen_q + inputs.max_seqlen_k
    return tuple(-1 if w >= span else w for w in (inputs.window_left, inputs.window_right))


def sdpa_forward(inputs: AttentionInputs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill out (shaped like q) and lse float32 (B, Hq, Nq) or (Hq, total_q), as `attention_forward` does."""
    q, k, v = inputs.q, inputs.k, inputs.v
    if inputs.varlen:
        cq, ck = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
            _sdpa_sequences(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], None, out[None, qs:qe],
                            lse[None, :, qs:qe], inputs)
        return
    _sdpa_sequences(q, k, v, inputs.attn_mask, out, lse, inputs)


def _sdpa_sequences(q, k, v, mask, out, lse, inputs: AttentionInputs) -> None:
    """q/out (B, Nq, Hq, D), k/v (B, Nk, Hkv, D), mask (B, Hq, Nq, Nk) view or None, lse (B, Hq, Nq)."""
    n_q, n_k = q.shape[1], k.shape[1]
    if n_q == 0:
        return
    if n_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    # bottom-right with one query: it sits at the last key and sees them all
    causal = _effective_window(inputs)[1] == 0 and not (inputs.bottom_right and n_q == 1)
    # (B, H, N, D) views; the kernel reads any strides but the last (a non-unit one gives wrong results, silently)
    q_t, k_t, v_t = (_unit_last_stride(t.transpose(1, 2)) for t in (q, k, v))
    out_t = out.transpose(1, 2)
    scale = inputs.softmax_scale
    if not causal or not inputs.bottom_right or n_q == n_k:
        bias = None if mask is None else _additive(mask, q.dtype)
        o, l = _SDPA_CPU(q_t, k_t, v_t, 0.0, causal, attn_mask=bias, scale=scale)
        out_t.copy_(o)
        lse.copy_(l)
        if mask is not None:
            _empty_rows_to_zero(mask, out_t, lse)
        return
    if n_q > n_k:  # bottom-right: query i sits at key position i - (Nq - Nk); the first Nq - Nk see nothing
        skip = n_q - n_k
        out[:, :skip].zero_()
        lse[:, :, :skip].fill_(float("-inf"))
        o, l = _SDPA_CPU(q_t[:, :, skip:], k_t, v_t, 0.0, True, scale=scale)
        out_t[:, :, skip:].copy_(o)
        lse[:, :, skip:].copy_(l)
        return
    # Nq < Nk: every query sees the first Nk - Nq keys, and the last Nq keys causally (a square, top-left).
    shift = n_k - n_q
    o_all, l_all = _SDPA_CPU(q_t, k_t[:, :, :shift], v_t[:, :, :shift], 0.0, False, scale=scale)
    o_diag, l_diag = _SDPA_CPU(q_t, k_t[:, :, shift:], v_t[:, :, shift:], 0.0, True, scale=scale)
    top = torch.maximum(l_all, l_diag)  # both finite: every query sees keys of both parts
    w_all, w_diag = torch.exp(l_all - top), torch.exp(l_diag - top)
    total = w_all + w_diag
    merged = o_all.float() * (w_all / total)[..., None] + o_diag.float() * (w_diag / total)[..., None]
    out_t.copy_(merged)
    lse.copy_(top + torch.log(total))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask as the kernel takes it: a bool mask as 0 / -inf in q's dtype, an additive one in float32 or q's
    dtype (other float dtypes widened to float32, exactly)."""
    mask = _compact(mask)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return _unit_last_stride(mask if mask.dtype in (torch.float32, dtype) else mask.float())


def _compact(mask: torch.Tensor) -> torch.Tensor:
    """The broadcast (stride-0) dimensions of a (B, Hq, Nq, Nk) mask view narrowed to one entry."""
    for dim in range(mask.dim()):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    return mask


def _empty_rows_to_zero(mask: torch.Tensor, out_t: torch.Tensor, lse: torch.Tensor) -> None:
    """Rows whose mask hides every key: output 0 and LSE -inf (the kernel leaves LSE 0 there)."""
    compact = _compact(mask)
    empty = ~compact.any(dim=-1) if compact.dtype == torch.bool else torch.isneginf(compact).all(dim=-1)
    if bool(empty.any()):
        empty = empty.expand(lse.shape)
        lse.masked_fill_(empty, float("-inf"))
        out_t.masked_fill_(empty[..., None], 0.0)


def attention_forward(inputs: AttentionInputs, out: torch.Tensor, lse: torch.Tensor,
                      block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N) -> None:
    """Writes out (shaped like q, any strides) and lse float32 (B, Hq, Nq) or (Hq, total_q)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    if inputs.varlen:
        cq, ck = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            _sequence_forward(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], None,
                              out[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]], inputs, block_m, block_n)
        return
    for b in range(q.shape[0]):
        mask = None if inputs.attn_mask is None else inputs.attn_mask[b]
        _sequence_forward(q[b], k[b], v[b], mask, out[b], lse[b], inputs, block_m, block_n)


def _visible_key_range(first_pos: int, last_pos: int, n_k: int, inputs: AttentionInputs) -> tuple[int, int]:
    lo = 0 if inputs.window_left < 0 else max(first_pos - inputs.window_left, 0)
    hi = n_k if inputs.window_right < 0 else min(last_pos + inputs.window_right + 1, n_k)
    return lo, hi


def _sequence_forward(q, k, v, mask, out, lse, inputs: AttentionInputs, block_m: int, block_n: int) -> None:
    """One sequence: q (Nq, Hq, D), k/v (Nk, Hkv, D), mask (Hq, Nq, Nk) view or None; writes out, lse (Hq, Nq)."""
    n_q, h_q, d = q.shape
    n_k, h_kv = k.shape[0], k.shape[1]
    group = h_q // h_kv
    shift = n_k - n_q if inputs.bottom_right else 0
    # (Hkv, D, Nk) and (Hkv, Nk, D) float32, with a broadcast group axis for GQA
    k_t = k.permute(1, 2, 0).float()[:, None]
    v_f = v.permute(1, 0, 2).float()[:, None]
    for qs in range(0, n_q, block_m):
        qe = min(qs + block_m, n_q)
        rows = qe - qs
        q_tile = q[qs:qe].permute(1, 0, 2).float().reshape(h_kv, group, rows, d)
        key_pos = torch.arange(qs, qe, device=q.device)[:, None] + shift
        m_i = torch.full((h_kv, group, rows), float("-inf"), device=q.device)
        l_i = torch.zeros((h_kv, group, rows), device=q.device)
        acc = torch.zeros((h_kv, group, rows, d), device=q.device)
        lo, hi = _visible_key_range(qs + shift, qe - 1 + shift, n_k, inputs)
        for ks in range((lo // block_n) * block_n, hi, block_n):
            ke = min(ks + block_n, n_k)
            s = torch.matmul(q_tile, k_t[..., ks:ke]) * inputs.softmax_scale
            cols = torch.arange(ks, ke, device=q.device)[None, :]
            ok = torch.ones(rows, ke - ks, dtype=torch.bool, device=q.device)
            if inputs.window_right >= 0:
                ok &= cols <= key_pos + inputs.window_right
            if inputs.window_left >= 0:
                ok &= cols >= key_pos - inputs.window_left
            if mask is not None:
                mask_tile = mask[:, qs:qe, ks:ke].reshape(h_kv, group, rows, ke - ks)
                if mask_tile.dtype == torch.bool:
                    ok = ok & mask_tile
                else:
                    s = s + mask_tile.float()
            s = s.masked_fill(~ok, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # rows that have seen no visible key keep max -inf: subtract 0 instead so exp gives 0, not NaN
            m_base = torch.where(torch.isneginf(m_new), 0.0, m_new)
            p = torch.exp(s - m_base[..., None])
            alpha = torch.exp(m_i - m_base)
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v_f[:, :, ks:ke])
            m_i = m_new
        empty = l_i == 0
        l_safe = torch.where(empty, 1.0, l_i)
        out[qs:qe] = (acc / l_safe[..., None]).reshape(h_q, rows, d).permute(1, 0, 2).to(out.dtype)
        lse[:, qs:qe] = torch.where(empty, float("-inf"), m_i + torch.log(l_safe)).reshape(h_q, rows)
