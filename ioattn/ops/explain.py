"""`ioattn.explain(...)`: the plan a call would run, for every attention entry point, without running anything."""

from __future__ import annotations

import torch

from ioattn.ops import checks
from ioattn.ops.dispatch import Plan, plan
from ioattn.ops.mla import MLAPlan, explain_mla
from ioattn.ops.paged import PagedPlan, explain_paged


def explain(q, k, v=None, *, api: str | None = None, backend: str = "auto", **kwargs) -> Plan | PagedPlan | MLAPlan:
    """The plan a call with these arguments would run (nothing runs). str() of the result reads well.

    `api` is "flash_attn" (q/k/v (B, N, H, D); kwargs of flash_attn_func), "varlen" (packed; kwargs of
    flash_attn_varlen_func), "sdpa" ((B, H, N, D); kwargs of sdpa) or "paged" (k, v are the caches; kwargs of
    paged_attention: block_table, seq_lens, ...; returns the `PagedPlan`) or "mla" (k is the latent cache, v None;
    kwargs of mla_paged_attention: block_table, seq_lens, v_head_dim, ...; returns the `MLAPlan`) or "fp8" (kwargs of
    flash_attn_fp8_func, or flash_attn_func's fp8=; returns the `FP8Plan`). When omitted it
    is inferred: mla when v_head_dim is given, paged when block_table is given, fp8 when fp8= is given or q is
    e4m3, varlen when cu_seqlens_q is given, sdpa when any of attn_mask / is_causal / scale / enable_gqa is given.
    """
    if api is None and "block_table" in kwargs:
        api = "mla" if "v_head_dim" in kwargs else "paged"
    if api is None and (kwargs.get("fp8") or getattr(q, "dtype", None) == torch.float8_e4m3fn):
        api = "fp8"
    if api == "fp8":  # flash_attn_fp8_func's arguments (fp8=True / "hadamard" as flash_attn_func takes them)
        from ioattn.ops.fp8_attention import plan_fp8

        fp8 = kwargs.pop("fp8", True)
        kwargs.pop("return_lse", None)
        if fp8 == "hadamard":
            kwargs["hadamard"] = True
        return plan_fp8(q, k, v, backend=backend, **kwargs)
    if api == "mla":
        missing = [name for name in ("block_table", "seq_lens", "v_head_dim") if name not in kwargs]
        if missing:
            raise ValueError(f"api='mla' needs {' and '.join(missing)} (the arguments of mla_paged_attention)")
        if v is not None:
            raise ValueError("api='mla' reads V from the latent cache (k): pass v=None")
        return explain_mla(q, k, kwargs.pop("block_table"), kwargs.pop("seq_lens"), backend=backend, **kwargs)
    if api == "paged":
        missing = [name for name in ("block_table", "seq_lens") if name not in kwargs]
        if missing:
            raise ValueError(f"api='paged' needs {' and '.join(missing)} (the arguments of paged_attention)")
        return explain_paged(q, k, v, backend=backend, **kwargs)
    if api is None:
        if "cu_seqlens_q" in kwargs:
            api = "varlen"
        elif {"attn_mask", "is_causal", "scale", "enable_gqa"} & kwargs.keys():
            api = "sdpa"
        else:
            api = "flash_attn"
    kwargs.pop("return_lse", None)
    deterministic = kwargs.pop("deterministic", None) if api in ("flash_attn", "varlen") else None
    if api == "flash_attn":
        inputs = checks.validate_dense(q, k, v, kwargs.pop("causal", False), kwargs.pop("window_size", (-1, -1)),
                                       kwargs.pop("softmax_scale", None))
    elif api == "varlen":
        inputs = checks.validate_varlen(
            q, k, v, kwargs.pop("cu_seqlens_q", None), kwargs.pop("cu_seqlens_k", None),
            kwargs.pop("max_seqlen_q", None), kwargs.pop("max_seqlen_k", None), kwargs.pop("causal", False),
            kwargs.pop("window_size", (-1, -1)), kwargs.pop("softmax_scale", None), kwargs.pop("validate", None))
    elif api == "sdpa":
        inputs = checks.validate_sdpa(q, k, v, kwargs.pop("attn_mask", None), kwargs.pop("is_causal", False),
                                      kwargs.pop("scale", None), kwargs.pop("enable_gqa", False))
    else:
        raise ValueError(f"api must be one of 'flash_attn', 'varlen', 'sdpa', 'paged', 'mla', 'fp8' (or None to "
                         f"infer), got {api!r}")
    if kwargs:
        raise ValueError(f"unexpected keyword arguments for api={api!r}: {sorted(kwargs)}")
    return plan(inputs, backend, deterministic=deterministic)
