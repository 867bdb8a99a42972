"""Runs fuzz cases of the public ops in a process of its own, so that a crash fails the case that caused it.

Protocol: one JSON case per stdin line; one JSON result per stdout line, {"outcome": "ok" | "refused" | "wrong",
"detail": ...}. "refused" is a ValueError/TypeError (its message is checked by the parent), "wrong" a result that
differs from the float64 reference, holds NaN, or another exception. A case that kills the process gets no line.
Imported without the test suite's conftest on purpose: ioattn must set itself up whatever was imported first.

A case names its op and its arguments as plain values (`build_*` turns them into tensors, seeded); each also
says how to corrupt one argument, so that valid and hostile calls come from one description.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback

import torch

import ioattn
from attention_grad_ref import attention_grads_ref, gradient_error, gradient_magnitudes
from ioattn.ops.fp8 import KV_CACHE_DTYPES, dequantize, quantize
from ioattn.ops.mla import MLAConfig
from ioattn.ops.paged import PagedConfig
from ioattn.reference import TOLERANCE, attention_ref, rel_error

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
          "int32": torch.int32, "bool": torch.bool}


def _random(shape, dtype, gen, device):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype).to(device)
    if dtype == torch.bool:
        return (torch.rand(shape, generator=gen) > 0.5).to(device)
    return torch.randint(-3, 3, shape, generator=gen).to(dtype).to(device)


def _in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `t` (B, N, H, D) held in another memory layout."""
    if layout == "transposed":  # (B, H, N, D) storage
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":  # every other row of a larger buffer
        big = torch.zeros(t.shape[0], 2 * t.shape[1], *t.shape[2:], dtype=t.dtype, device=t.device)
        big[:, ::2] = t
        return big[:, ::2]
    if layout == "last_dim_strided":  # stride(-1) == 2
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        big[..., ::2] = t
        return big[..., ::2]
    if layout == "expanded" and t.shape[0] > 1:  # batch entries alias one buffer
        return t[:1].expand_as(t)
    return t


def _packed(tensors):
    """Views of one packed (B, N, len(tensors), H, D) buffer, as flash-attn's qkvpacked / kvpacked layouts."""
    buffer = torch.stack(tensors, dim=2).contiguous()
    return list(buffer.unbind(2))


def _tolerance(dtype):
    return TOLERANCE.get(dtype, 1e-5)


def _compare(name, out, ref, dtype):
    if out is None:
        return None
    err = rel_error(out, ref)
    if not err <= _tolerance(dtype):  # NaN and inf fail
        return f"{name} rel error {err:.3g} > {_tolerance(dtype):.0e}"
    return None


def _dense_views(case, q, k, v):
    """q, k, v (B, N, H, D) in the case's memory layout, built by differentiable ops (gradients reach q, k, v)."""
    layout = case["layout"]
    if layout == "qkv_packed" and q.shape == k.shape:
        return _packed([q, k, v])
    if layout == "kv_packed":
        return [q, *_packed([k, v])]
    return [_in_layout(t, layout) for t in (q, k, v)]


def run_dense(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    b, nq, nk, hq, hkv, d = (case[k] for k in ("B", "Nq", "Nk", "Hq", "Hkv", "D"))
    base = [_random((b, nq, hq, d), dtype, gen, device), _random((b, nk, hkv, d), dtype, gen, device),
            _random((b, nk, hkv, d), dtype, gen, device)]
    grad = case["grad"] and dtype.is_floating_point
    leaves = [t.clone().requires_grad_() for t in base] if grad else base
    rules = dict(causal=case["causal"], window_size=tuple(case["window"]), softmax_scale=case["scale"])
    out = ioattn.flash_attn_func(*_dense_views(case, *leaves), **rules, backend=case["backend"],
                                 deterministic=case["deterministic"])
    refs = [t.detach().double().requires_grad_(grad) for t in base]
    ref_out, _ = attention_ref(*_dense_views(case, *refs), **rules)
    problem = _compare("out", out, ref_out, dtype)
    if problem or not grad or out.numel() == 0:
        return problem
    do = _in_layout(_random(out.shape, dtype, gen, device), case["do_layout"])
    out.backward(do)
    # The reference gradients of the views (exact for the saved, rounded O the backward is given), carried back
    # to q, k, v through the same view construction.
    views = _dense_views(case, *refs)
    scale = case["scale"] if case["scale"] is not None else d ** -0.5
    view_grads = attention_grads_ref(*views, do, scale=scale, causal=case["causal"],
                                     window_size=tuple(case["window"]), saved_o=out.detach())[:3]
    ref_grads = torch.autograd.grad(views, refs, view_grads, allow_unused=True, retain_graph=True)
    magnitudes = gradient_magnitudes(*views, do, out, scale=scale, causal=case["causal"],
                                     window_size=tuple(case["window"]))[:3]
    leaf_magnitudes = torch.autograd.grad(views, refs, magnitudes, allow_unused=True)
    for name, leaf, ref, magnitude in zip(("dq", "dk", "dv"), leaves, ref_grads, leaf_magnitudes):
        problem = leaf.grad is not None and gradient_error(name, leaf.grad, ref, magnitude, dtype)
        if problem:
            return problem
    return None


def _cu(lengths, device, corruption, total):
    values = [0]
    for n in lengths:
        values.append(values[-1] + n)
    if corruption == "decreasing" and len(values) > 2:
        values[1], values[2] = values[2], values[1] - 1
    elif corruption == "short_end":
        values[-1] -= 1
    elif corruption == "long_end":
        values[-1] += 1
    elif corruption == "nonzero_start":
        values[0] = 1
    elif corruption == "huge":
        values[-1] = 2**31 - 1
    cu = torch.tensor(values, dtype=torch.int32)
    if corruption == "strided":  # the case: the checks must not read through the stride
        cu = torch.stack([cu, torch.full_like(cu, 99)], dim=1).reshape(-1)[::2]
    elif corruption == "int64":
        cu = cu.long()
    return cu.to(device)


def run_varlen(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    lq, lk = case["lens_q"], case["lens_k"]
    hq, hkv, d = case["Hq"], case["Hkv"], case["D"]
    base = [_random((sum(lq), hq, d), dtype, gen, device), _random((sum(lk), hkv, d), dtype, gen, device),
            _random((sum(lk), hkv, d), dtype, gen, device)]
    grad = case.get("grad", False) and dtype.is_floating_point
    leaves = [t.clone().requires_grad_() for t in base] if grad else base

    def views(q, k, v):  # flash-attn's packed varlen layouts: (total, 3, H, D) or (total, 2, Hkv, D)
        layout = case.get("layout", "contiguous")
        if layout == "qkv_packed" and q.shape == k.shape:
            return list(torch.stack([q, k, v], dim=1).unbind(1))
        if layout == "kv_packed":
            return [q, *torch.stack([k, v], dim=1).unbind(1)]
        return [q, k, v]

    cu_q = _cu(lq, device, case["cu_q"], base[0].shape[0])
    cu_k = _cu(lk, device, case["cu_k"], base[1].shape[0])
    max_q = {"exact": max(lq, default=0), "small": max(max(lq, default=0) - 1, 0), "huge": 2**40,
             "negative": -1, "float": 3.0}[case["max_q"]]
    rules = dict(causal=case["causal"], window_size=tuple(case["window"]), softmax_scale=case["scale"])
    out = ioattn.flash_attn_varlen_func(*views(*leaves), cu_q, cu_k, max_q, max(lk, default=0), **rules,
                                        backend=case["backend"], deterministic=case.get("deterministic"))
    refs = [t.detach().double().requires_grad_(grad) for t in base]
    ref, _ = attention_ref(*views(*refs), **rules, cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k.cpu())
    problem = _compare("out", out, ref, dtype)
    if problem or not grad or out.numel() == 0:
        return problem
    do = _random(out.shape, dtype, gen, device)
    out.backward(do)
    ref_views = views(*refs)
    scale = case["scale"] if case["scale"] is not None else d ** -0.5
    view_grads = attention_grads_ref(*ref_views, do, scale=scale, causal=case["causal"],
                                     window_size=tuple(case["window"]), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     saved_o=out.detach())[:3]
    ref_grads = torch.autograd.grad(ref_views, refs, view_grads, allow_unused=True, retain_graph=True)
    magnitudes = gradient_magnitudes(*ref_views, do, out, scale=scale, causal=case["causal"],
                                     window_size=tuple(case["window"]), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)[:3]
    leaf_magnitudes = torch.autograd.grad(ref_views, refs, magnitudes, allow_unused=True)
    for name, leaf, ref_grad, magnitude in zip(("dq", "dk", "dv"), leaves, ref_grads, leaf_magnitudes):
        problem = leaf.grad is not None and gradient_error(name, leaf.grad, ref_grad, magnitude, dtype)
        if problem:
            return problem
    return None


def run_sdpa(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    b, nq, nk, hq, hkv, d = (case[k] for k in ("B", "Nq", "Nk", "Hq", "Hkv", "D"))
    q = _random((b, hq, nq, d), dtype, gen, device)
    k = _random((b, hkv, nk, d), dtype, gen, device)
    v = _random((b, hkv, nk, d), dtype, gen, device)
    mask = None
    if case["mask"] is not None:
        mask = _random(tuple(case["mask_shape"]), DTYPES[case["mask"]], gen, device)
    out = ioattn.sdpa(q, k, v, attn_mask=mask, is_causal=case["causal"], scale=case["scale"],
                      enable_gqa=case["gqa"], backend=case["backend"])
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=case["causal"],
                           causal_align="top_left", attn_mask=mask, softmax_scale=case["scale"])
    return _compare("out", out, ref.transpose(1, 2), dtype)


def _table(case, gen, num_blocks, width, device):
    table = torch.randperm(num_blocks, generator=gen)[: case["batch"] * width]
    table = table.reshape(case["batch"], width).to(torch.int32)
    corruption = case["table"]
    if corruption == "oob":
        table[0, 0] = num_blocks + 5
    elif corruption == "num_blocks":
        table[0, 0] = num_blocks
    elif corruption == "negative":
        table[0, 0] = -7
    elif corruption == "evicted":
        table[0, 0] = -1
    elif corruption == "transposed":
        return table.t().contiguous().t().to(device)
    return table.to(device)


def _fp8_caches(case, gen, shape, device):
    """For case["kv"] an fp8 format: k/v caches of random values quantized with per-head scales, the scales as
    the case passes them (maybe corrupted), and the float64 dequantized caches the reference reads."""
    fp8 = KV_CACHE_DTYPES[case["kv"]]
    heads = shape[2]
    scales = [(torch.rand(heads, generator=gen) + 0.1).to(device) for _ in range(2)]
    caches = [quantize(torch.randn(shape, generator=gen).to(device) * s[:, None] * 40, s, fp8) for s in scales]
    refs = [dequantize(c, s, torch.float64) for c, s in zip(caches, scales)]
    return caches, _corrupt_scales(case.get("scales", "ok"), scales), refs


def _corrupt_scales(corruption: str, scales):
    k_scale, v_scale = scales
    if corruption == "missing":
        return None, v_scale
    if corruption == "shape":
        return k_scale[:1] if k_scale.numel() > 1 else torch.cat([k_scale, k_scale]), v_scale
    if corruption == "zero":
        return torch.zeros_like(k_scale), v_scale
    if corruption == "nan":
        return k_scale, torch.full_like(v_scale, float("nan"))
    if corruption == "float64":
        return k_scale.double(), v_scale
    return k_scale, v_scale


# paged_attention's config=: the default, an explicit Triton tile, the Gluon decode (sm_90, head dims 64/128/256
# only), and a Gluon tile it cannot build
PAGED_CONFIGS = {
    None: None,
    "triton": PagedConfig(block_m=16, block_n=32, num_warps=4, num_stages=2),
    "gluon": PagedConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, maxnreg=96, kernel="gluon"),
    "gluon_block_n_16": PagedConfig(block_m=16, block_n=16, kernel="gluon"),
}


def run_paged(case, device):
    """paged_attention (decode, or multi-token with cu_seqlens_q) against the float64 reference over each
    sequence's gathered cache (for an fp8 cache, the dequantized one)."""
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    page, hkv, d = case["page"], case["Hkv"], case["D"]
    hq = hkv * case["group"]
    lens = case["seq_lens"]
    width = max(1, max((n + page - 1) // page for n in lens))
    num_blocks = case["batch"] * width
    scales = {}
    if case.get("kv"):
        (k_cache, v_cache), (k_scale, v_scale), (k_ref, v_ref) = _fp8_caches(case, gen, (num_blocks, page, hkv, d),
                                                                             device)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    else:
        k_cache = _random((num_blocks, page, hkv, d), dtype, gen, device)
        v_cache = _random((num_blocks, page, hkv, d), dtype, gen, device)
        k_ref, v_ref = k_cache, v_cache
        if case.get("scales") == "extra":  # scales beside a cache that is not fp8
            scales = dict(k_scale=torch.ones(hkv, device=device), v_scale=torch.ones(hkv, device=device))
    table = _table(case, gen, num_blocks, width, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if case["lens"] == "past_capacity":
        seq_lens[0] = width * page + 1
    elif case["lens"] == "negative":
        seq_lens[0] = -3
    seq_lens = seq_lens.to(device)
    decode = case["q_lens"] is None
    q_lens = [1] * len(lens) if decode else case["q_lens"]
    q = _random((sum(q_lens), hq, d), dtype, gen, device)
    cu = None if decode else _cu(q_lens, device, case["cu_q"], q.shape[0])
    window = tuple(case["window"])
    config = PAGED_CONFIGS[case.get("config")]
    out = ioattn.paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q=cu, causal=True,
                                 window_size=window, sink_tokens=case["sinks"], num_splits=case["splits"],
                                 gather=case["gather"], backend=case.get("backend", "auto"), config=config, **scales)
    outs, start = [], 0
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        blocks = table[b].long().cpu()
        rows = torch.arange(n)
        key_rows = blocks[rows // page] * page + rows % page
        keys = k_ref.reshape(-1, hkv, d).cpu()[key_rows]
        values = v_ref.reshape(-1, hkv, d).cpu()[key_rows]
        o, _ = attention_ref(q[start : start + m].cpu()[None], keys[None], values[None], causal=True,
                             window_size=window, sink_tokens=case["sinks"])
        outs.append(o[0])
        start += m
    return _compare("out", out, torch.cat(outs), dtype)


def run_cache_write(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    num_blocks, page, hkv, d = 4, case["page"], case["Hkv"], case["D"]
    fp8 = KV_CACHE_DTYPES.get(case.get("kv") or "auto")
    k_cache = torch.zeros(num_blocks, page, hkv, d, dtype=fp8 or torch.float32, device=device)
    v_cache = torch.zeros_like(k_cache)
    true_scales = [(torch.rand(hkv, generator=gen) + 0.05).to(device) for _ in range(2)]
    scales = dict(zip(("k_scale", "v_scale"), _corrupt_scales(case.get("scales", "ok"), true_scales))) if fp8 else {}
    tokens = case["tokens"]
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    corruption = case["slots"]
    if tokens and corruption == "oob":
        slots[0] = num_blocks * page
    elif tokens and corruption == "huge":
        slots[0] = 2**40
    elif tokens and corruption == "padding":
        slots[0] = -1
    elif tokens and corruption == "below_padding":
        slots[0] = -2
    elif tokens > 1 and corruption == "duplicate":
        slots[1] = slots[0]
    key = _random((tokens, hkv, d), dtype, gen, device)
    value = _random((tokens, hkv, d), dtype, gen, device)
    if fp8 is not None and key.dtype.is_floating_point:
        key, value = key * 500, value * 500  # past the format's range with small scales: saturation
    slot_mapping = slots.to(DTYPES.get(case["slot_dtype"], torch.int64)).to(device)
    ioattn.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, backend=case.get("backend", "auto"),
                             **scales)
    slots = slot_mapping.long().cpu()  # as passed (a cast to int32 may have wrapped it)
    keep = slots >= 0
    if fp8 is not None:  # bit for bit: the quantized values, never NaN from finite ones
        written = k_cache.view(torch.uint8).reshape(-1, hkv, d)[slots[keep].to(device)].view(fp8)
        expected = quantize(key[keep.to(device)], true_scales[0], fp8)
        if not torch.equal(written.view(torch.uint8), expected.view(torch.uint8)) or written.float().isnan().any():
            return "fp8 k_cache differs from the saturating round-to-nearest-even quantization"
        return None
    expected = torch.zeros(num_blocks * page, hkv, d)
    expected[slots[keep]] = key.cpu().float()[keep]
    return _compare("k_cache", k_cache.reshape(-1, hkv, d).cpu(), expected, torch.float32) if keep.any() else None


def run_block_copy(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    caches = [torch.randn(6, 2, 1, 8, generator=gen).to(device) for _ in range(2)]
    fp8 = KV_CACHE_DTYPES.get(case.get("kv") or "auto")
    if fp8 is not None:  # fp8 blocks move as bytes; compared through their float values (exact)
        caches = [c.to(fp8) for c in caches]
    expected = [c.float().clone() for c in caches]
    pairs = case["pairs"]
    mapping = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    if case["op"] == "copy_blocks":
        ioattn.copy_blocks(caches[:1], caches[1:], mapping.to(device))
        for c in expected:
            c[mapping[:, 1]] = c[mapping[:, 0]]
        return _compare("caches", torch.stack([c.float() for c in caches]), torch.stack(expected), torch.float32)
    dst = torch.zeros(3, 2, 1, 8, device=device, dtype=caches[0].dtype)
    ioattn.swap_blocks(caches[0], dst, mapping)
    want = torch.zeros_like(dst, dtype=torch.float32)
    want[mapping[:, 1]] = caches[0].float()[mapping[:, 0]]
    return _compare("dst", dst.float(), want, torch.float32)


# mla_paged_attention's config=: the default, an explicit Triton tile (also split for half the SMs), the Gluon
# decode at 16 and at 64 heads per program (sm_90, latent a multiple of 64 with a RoPE part of 64 only), and a
# Gluon tile it cannot build
MLA_CONFIGS = {
    None: None,
    "triton": MLAConfig(block_h=16, block_m=16, block_n=16, num_warps=4, num_stages=1),
    # the split heuristic aiming at one program per two SMs
    "triton_half_grid": MLAConfig(block_h=16, block_m=16, block_n=16, num_warps=4, num_stages=1, sms_per_program=2),
    "gluon": MLAConfig(block_h=16, block_m=16, block_n=64, num_warps=4, num_stages=2, kernel="gluon"),
    "gluon_wgmma": MLAConfig(block_h=64, block_m=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon"),
    "gluon_block_n_16": MLAConfig(block_h=16, block_m=16, block_n=16, kernel="gluon"),
    "gluon_seesaw": MLAConfig(block_h=64, block_m=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon",
                              seesaw=True),
    "gluon_staged": MLAConfig(block_h=16, block_m=16, block_n=64, num_warps=4, num_stages=2, kernel="gluon",
                              stage_out=True),
    "gluon_seesaw_block_n_32": MLAConfig(block_h=64, block_m=64, block_n=32, num_warps=8, num_stages=2,
                                         kernel="gluon", seesaw=True),
}


def run_mla(case, device):
    """mla_paged_attention (decode, or multi-token with cu_seqlens_q) against the float64 reference: one shared
    KV head whose K is each whole latent row and V its first v_head_dim columns."""
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    page, latent, rope, heads = case["page"], case["latent"], case["rope"], case["heads"]
    lens = case["seq_lens"]
    width = max(1, max((n + page - 1) // page for n in lens))
    num_blocks = case["batch"] * width
    cache = _random((num_blocks, page, 1, latent + rope), dtype, gen, device)
    table = _table(case, gen, num_blocks, width, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if case["lens"] == "past_capacity":
        seq_lens[0] = width * page + 1
    elif case["lens"] == "negative":
        seq_lens[0] = -3
    seq_lens = seq_lens.to(device)
    decode = case["q_lens"] is None
    q_lens = [1] * len(lens) if decode else case["q_lens"]
    q = _random((sum(q_lens), heads, latent + rope + case["q_extra"]), dtype, gen, device)
    cu = None if decode else _cu(q_lens, device, case["cu_q"], q.shape[0])
    out = ioattn.mla_paged_attention(q, cache, table, seq_lens, v_head_dim=case["v_head_dim"], cu_seqlens_q=cu,
                                     softmax_scale=case["scale"], num_splits=case["splits"],
                                     backend=case.get("backend", "auto"), config=MLA_CONFIGS[case.get("config")])
    rows_of = cache.reshape(-1, latent + rope).cpu()
    outs, start = [], 0
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        blocks = table[b].long().cpu()
        positions = torch.arange(n)
        rows = rows_of[blocks[positions // page] * page + positions % page][:, None]
        o, _ = attention_ref(q[start : start + m].cpu()[None], rows[None], rows[None, ..., :latent], causal=True,
                             softmax_scale=case["scale"])
        outs.append(o[0])
        start += m
    return _compare("out", out, torch.cat(outs), dtype)


# The fp8 forward rounds the probabilities to e4m3 (~2% of the output on random inputs, more on a handful of rows):
# judged against float64 on its dequantized inputs with this much room.
FP8_FORWARD_TOL = 6e-2


# GluonConfig fields over the fp8 forward's D 128 tiles (`config=` with backend="gluon"): 256-key tiles (scale blocks
# of a multiple of 256 only), the rescale threshold, and two the op refuses
FP8_GLUON_CONFIGS = {"wide": dict(consumers=2, block_n=256, stages=2, maxnreg=168, consumer_regs=240),
                     "threshold": dict(rescale_threshold=2.0), "block_n_32": dict(block_n=32),
                     "threshold_8": dict(rescale_threshold=8.0)}


def run_fp8_forward(case, device):
    from ioattn.ops import fp8_attention as fa8
    from ioattn.ops.gluon_forward import fp8_gluon_config

    gen = torch.Generator().manual_seed(case["seed"])
    config = None
    if case.get("config") is not None:
        config = dataclasses.replace(fp8_gluon_config(128), **FP8_GLUON_CONFIGS[case["config"]])
    dtype = DTYPES[case["dtype"]]
    b, nq, nk, hq, hkv, d = (case[k] for k in ("B", "Nq", "Nk", "Hq", "Hkv", "D"))
    q, k, v = (_random(shape, dtype, gen, device) for shape in ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d)))
    rules = dict(causal=case["causal"], window_size=tuple(case["window"]), softmax_scale=case["scale"])
    if case["mode"] != "e4m3":
        hadamard, block = case["mode"] == "hadamard", case["scale_block"]
        out = ioattn.flash_attn_fp8_func(q, k, v, **rules, hadamard=hadamard, scale_block=block,
                                         backend=case["backend"], config=config)
        rotation = fa8.hadamard_rotation(d, q.device) if hadamard else None
        deq = [fa8.dequantize_blocks(*fa8.quantize_blocks(t, block, rot), block)
               for t, rot in ((q, rotation), (k, rotation), (v, None))]
    elif hkv <= 0 or hq % hkv:  # hostile head counts: unit descales (B, Hkv); the op refuses the heads
        codes = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
        descales = [torch.ones(b, max(hkv, 0), device=device) for _ in range(3)]
        descales = [descales[0], *_corrupt_scales(case["descales"], descales[1:])]
        out = ioattn.flash_attn_fp8_func(*codes, **rules, q_descale=descales[0], k_descale=descales[1],
                                         v_descale=descales[2], backend=case["backend"], config=config)
        return f"hostile heads ({hq}, {hkv}) were not refused"
    else:  # e4m3 inputs with per-(sequence, KV head) descales, one of them possibly corrupted
        descales, codes = [], []
        for t, group in zip((q, k, v), (hq // hkv, 1, 1)):
            heads = t.shape[2] // group
            amax = t.float().reshape(b, t.shape[1], heads, -1).abs().amax(dim=(1, 3)) if t.numel() else \
                torch.ones(b, heads, device=device)
            scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            descales.append(scale)
            codes.append((t.float() / scale.repeat_interleave(group, 1)[:, None, :, None]).to(torch.float8_e4m3fn))
        descales = [descales[0], *_corrupt_scales(case["descales"], descales[1:])]
        out = ioattn.flash_attn_fp8_func(*codes, **rules, q_descale=descales[0], k_descale=descales[1],
                                         v_descale=descales[2], backend=case["backend"], config=config)
        deq = [c.double() * s.double().repeat_interleave(c.shape[2] // s.shape[1], 1)[:, None, :, None]
               for c, s in zip(codes, descales)]
    ref, _ = attention_ref(*deq, **rules)
    if out.numel() == 0:
        return None if out.shape == ref.shape else f"out shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_error(out, ref)
    return None if err <= FP8_FORWARD_TOL else f"out rel error {err:.3g} > {FP8_FORWARD_TOL:.0e}"


RUNNERS = {"flash_attn_func": run_dense, "flash_attn_fp8_func": run_fp8_forward, "flash_attn_varlen_func": run_varlen, "sdpa": run_sdpa,
           "paged_attention": run_paged, "reshape_and_cache": run_cache_write, "copy_blocks": run_block_copy,
           "swap_blocks": run_block_copy, "mla_paged_attention": run_mla}


def run(case: dict) -> dict:
    device = case.get("device", "cpu")
    try:
        problem = RUNNERS[case["op"]](case, device)
        if device == "cuda":
            torch.cuda.synchronize()  # an asynchronous fault belongs to this case
    except (ValueError, TypeError) as error:
        return {"outcome": "refused", "detail": f"{type(error).__name__}: {error}"}
    except Exception as error:  # noqa: BLE001 - any other exception is a finding, reported with its trace
        return {"outcome": "wrong", "detail": f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"}
    return {"outcome": "wrong", "detail": problem} if problem else {"outcome": "ok", "detail": ""}


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        result = run(json.loads(line))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
