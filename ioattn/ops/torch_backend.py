"""The exact tiled attention forward in plain torch: the CPU backend.

Same algorithm as the Triton kernel (online softmax over K/V tiles, float32 accumulation, only the tiles a
causal/window rule can see), with memory linear in the sequence length: the largest temporary is one
(Hq, block_m, block_n) score tile. Every option of the Triton kernel is supported.
"""

from __future__ import annotations

import torch

from ioattn.ops.checks import AttentionInputs

DEFAULT_BLOCK_M = 256
DEFAULT_BLOCK_N = 512


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
