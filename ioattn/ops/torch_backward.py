"""Exact attention backward by recomputation in plain torch: the CPU path behind the autograd Functions.

The same algorithm as the Triton kernels (`ioattn.kernels.prefill_bwd`): only o and the natural-log lse were
saved; P is recomputed one (query block, key block) tile at a time, so memory stays linear in N (the largest
temporary is B x Hq x block x block). Blocks that no query can see under causal / window rules are skipped.
Sums run in a fixed order, so the result is always deterministic. Computes in float32 (float64 for float32
inputs: dS = P * (dP - delta) cancels, and float32 arithmetic there left gradients 1.05e-5 off on tiny random
problems, past the fp32 tolerance of 1e-5) and returns gradients in the input dtypes.
"""

from __future__ import annotations

import torch

from ioattn.ops.backward import check_bwd_args, fold_causal

BLOCK = 128


def _block_visibility(rows, cols, diag, left, right):
    """Bool (len(rows), len(cols)): key j visible to query i (positions inside the sequence)."""
    key_pos = rows[:, None] + diag
    ok = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
    if right >= 0:
        ok &= cols[None, :] <= key_pos + right
    if left >= 0:
        ok &= cols[None, :] >= key_pos - left
    return ok


def _sequence_bwd(do, q, k, v, o, lse, bias, bool_mask, dbias, scale, diag, left, right, block):
    """One batch of equal-length sequences. q/o/do (B, Nq, Hq, D), k/v (B, Nk, Hkv, D), lse (B, Hq, Nq);
    bias / bool_mask (B, Hq, Nq, Nk) views or None; dbias None or a buffer in the mask's 4-d broadcast shape.
    Returns dq, dk, dv in the inputs' (compute) dtype."""
    batch, n_q, hq, head_dim = q.shape
    n_k, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    heads = (batch, hkv, group)  # query head h = kv_head * group + member
    qh = q.permute(0, 2, 1, 3).reshape(*heads, n_q, head_dim)
    doh = do.permute(0, 2, 1, 3).reshape(*heads, n_q, head_dim)
    kh = k.permute(0, 2, 1, 3)[:, :, None]
    vh = v.permute(0, 2, 1, 3)[:, :, None]
    delta = (do * o).sum(-1).permute(0, 2, 1).reshape(*heads, n_q)
    lse = lse.reshape(*heads, n_q)
    lse = torch.where(torch.isneginf(lse), torch.inf, lse)  # rows that saw no key: P = 0, zero gradient
    dq = torch.zeros_like(qh)
    dk = torch.zeros(batch, hkv, n_k, head_dim, dtype=q.dtype, device=q.device)
    dv = torch.zeros_like(dk)
    rows_all = torch.arange(n_q, device=q.device)
    cols_all = torch.arange(n_k, device=q.device)
    for i0 in range(0, n_q, block):
        rows = rows_all[i0:i0 + block]
        q_i, do_i = qh[..., i0:i0 + block, :], doh[..., i0:i0 + block, :]
        lse_i, delta_i = lse[..., i0:i0 + block], delta[..., i0:i0 + block]
        for j0 in range(0, n_k, block):
            cols = cols_all[j0:j0 + block]
            allowed = _block_visibility(rows, cols, diag, left, right)
            if not allowed.any():
                continue
            tile = (slice(None), slice(None), slice(i0, i0 + block), slice(j0, j0 + block))
            s = q_i @ kh[..., j0:j0 + block, :].transpose(-1, -2) * scale
            if bias is not None:
                s = s + bias[tile].reshape(*heads, len(rows), len(cols))
            if bool_mask is not None:
                allowed = allowed & bool_mask[tile].reshape(*heads, len(rows), len(cols))
            p = torch.exp(s.masked_fill(~allowed, -torch.inf) - lse_i[..., None])
            dv[:, :, j0:j0 + block] += (p.transpose(-1, -2) @ do_i).sum(2)
            ds = p * (do_i @ vh[..., j0:j0 + block, :].transpose(-1, -2) - delta_i[..., None])
            dq[..., i0:i0 + block, :] += ds @ kh[..., j0:j0 + block, :] * scale
            dk[:, :, j0:j0 + block] += (ds.transpose(-1, -2) @ q_i).sum(2) * scale
            if dbias is not None:  # reduce over the dims the mask broadcasts along, tile by tile
                ds = ds.reshape(batch, hq, len(rows), len(cols))
                broadcast = [d for d in range(4) if dbias.shape[d] == 1 and ds.shape[d] != 1]
                dbias[tuple(slice(None) if d in broadcast else tile[d] for d in range(4))] += (
                    ds.sum(dim=broadcast, keepdim=True) if broadcast else ds)
    dq = dq.reshape(batch, hq, n_q, head_dim).permute(0, 2, 1, 3)
    return dq, dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


def attention_bwd_torch(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    bottom_right: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    attn_mask: torch.Tensor | None = None,
    mask_grad: bool = False,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dmask) with the arguments, layouts and argument checks of
    `ioattn.kernels.prefill_bwd.attention_bwd` (max_seqlen_* are only checked: the torch path reads lengths from
    cu_seqlens). dmask, the gradient of an additive mask in its own (broadcast) shape, only when `mask_grad`; a
    bool mask gets none."""
    check_bwd_args(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, mask_grad)
    compute = torch.float64 if q.dtype == torch.float32 else torch.float32
    do_c, q_c, k_c, v_c, o_c, lse_c = (t.to(compute) for t in (do, q, k, v, o, lse))
    left, right = fold_causal(causal, window_size)

    if cu_seqlens_q is not None:
        dq, dk, dv = torch.zeros_like(q_c), torch.zeros_like(k_c), torch.zeros_like(v_c)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
            if qe == qs or ke == ks:
                continue  # no query or no key: every gradient of this sequence is zero
            diag = (ke - ks) - (qe - qs) if bottom_right else 0
            grads = _sequence_bwd(
                do_c[None, qs:qe], q_c[None, qs:qe], k_c[None, ks:ke], v_c[None, ks:ke], o_c[None, qs:qe],
                lse_c[None, :, qs:qe], None, None, None, scale, diag, left, right, block,
            )
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = (g[0] for g in grads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None

    batch, n_q, hq, _ = q.shape
    n_k = k.shape[1]
    full_shape = (batch, hq, n_q, n_k)
    bias = bool_mask = dbias = None
    if attn_mask is not None:
        mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if attn_mask.dtype == torch.bool:
            bool_mask = mask4.expand(full_shape)
        else:
            bias = mask4.to(compute).expand(full_shape)
    if mask_grad:
        dbias = torch.zeros(mask4.shape, dtype=compute, device=q.device)
    diag = n_k - n_q if bottom_right else 0
    dq, dk, dv = _sequence_bwd(do_c, q_c, k_c, v_c, o_c, lse_c, bias, bool_mask, dbias, scale, diag, left, right, block)
    dmask = dbias.reshape(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask
