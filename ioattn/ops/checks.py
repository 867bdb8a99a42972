"""Argument validation shared by the public ops: every unsupported input raises a ValueError that names the
argument and the supported set, before any kernel runs or any state changes.

Two levels, so that checking never costs a CUDA call a host synchronisation unless asked to:

- **Always** (no device data is read): types, dtypes, devices, shapes, strides and contiguity of every tensor
  (index tensors must be contiguous: the kernels read them by raw offsets), scalar arguments (`max_seqlen_*`,
  windows, scales, split counts) and the relations between them that the host knows (batch sizes, head counts,
  head dims, cache geometry).
- **Contents** (`validate=True`; the default for CPU tensors, whose contents are read without any device sync,
  and for CUDA tensors when `IOATTN_VALIDATE=1`, as the test suite sets it; never inside a CUDA graph capture,
  which cannot read device data): also every index tensor's values —
  cu_seqlens start at 0, never decrease and end at the packed length; `max_seqlen_*` covers the longest
  sequence; seq_lens lie in [0, table capacity] with q_len <= seq_len; every block id a call reads lies in
  [0, num_blocks), and -1 (an evicted block) appears only where a window and the sinks leave it unread; slots
  lie in [-1, num_blocks * block_size) and are distinct; copy/swap mappings stay inside both pools with
  distinct destinations. With contents checked, no kernel reads or writes outside a tensor.
- With contents not checked (CUDA by default, as in flash-attn and vLLM), index values are trusted: a wrong
  one is undefined behaviour (it may read or write out of bounds). The engine builds its tables only from the
  KV manager's plans; under `IOATTN_VALIDATE=1` every step's are checked too.

The validated attention inputs are normalised into an `AttentionInputs`: tensors in the flash-attn layout
((B, N, H, D) or packed (total, H, D)), causal folded into the window, a dense mask broadcast to
(B, Hq, Nq, Nk) through stride-0 views (never an expanded copy).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 8, 256, 8
VALIDATE_ENV = "IOATTN_VALIDATE"
INT32_MAX = 2**31 - 1  # lengths and offsets the kernels hold in int32


def checks_contents(validate, device: torch.device) -> bool:
    """Whether a call checks its index tensors' values (see the module docstring): `validate` when True/False;
    None means always for CPU tensors and for CUDA ones when IOATTN_VALIDATE=1. Never while a CUDA graph is being
    captured: a capture cannot read device data (the same call is checked when it runs eagerly)."""
    if not (validate is None or isinstance(validate, bool)):
        raise ValueError(f"validate must be True, False or None (contents checked on CPU, or with {VALIDATE_ENV}=1), "
                         f"got {validate!r}")
    if validate is None:
        validate = device.type != "cuda" or os.environ.get(VALIDATE_ENV, "0") == "1"
    return validate and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """One validated attention call, in the flash-attn layout, ready for any backend."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float
    window_left: int  # -1: unbounded; causal is folded in as window_right = 0
    window_right: int
    bottom_right: bool  # causal/window alignment: flash-attn bottom-right, or PyTorch SDPA top-left
    attn_mask: torch.Tensor | None = None  # (B, Hq, Nq, Nk) view, bool (True = attend) or additive float
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # k/v hold fp8 codes; these float32 (Hkv,) factors scale the scores and the output per KV head (Triton only)
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def group(self) -> int:
        return self.q.shape[-2] // self.k.shape[-2]


def check_dtypes_and_devices(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    for name, t in zip(names, tensors):
        check_tensor(name, t)
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype must be one of float16, bfloat16, float32; got {t.dtype}")
    first = tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first.dtype:
            raise ValueError(f"{name}.dtype ({t.dtype}) must equal {names[0]}.dtype ({first.dtype})")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {names[0]} is on {first.device}; all must share a device")


def check_tensor(name: str, t) -> None:
    """A dense (strided) tensor on the CPU or a CUDA device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be a dense (strided) tensor on the CPU or a CUDA device, got {t.layout} on "
                         f"{t.device}")


def check_head_dim(head_dim: int, name: str = "q") -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(
            f"{name} head dim must be a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}"
        )


def check_heads(num_heads_q: int, num_heads_kv: int) -> None:
    if num_heads_kv == 0 or num_heads_q % num_heads_kv != 0:
        raise ValueError(
            f"number of query heads ({num_heads_q}) must be a positive multiple of key/value heads ({num_heads_kv})"
        )


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_b}.shape {tuple(b.shape)} must equal {name_a}.shape {tuple(a.shape)}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def softmax_scale_or_default(scale: float | None, head_dim: int, name: str = "softmax_scale") -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"{name} must be a finite float or None (1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def normalized_window(window_size, causal: bool, causal_name: str = "causal") -> tuple[int, int]:
    """(left, right) with -1 unbounded; causal caps the right bound at 0."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(is_int(w) and -1 <= w <= INT32_MAX for w in window_size)):
        raise ValueError(f"window_size must be a pair (left, right) of ints in [-1, {INT32_MAX}] (-1 = unbounded), "
                         f"got {window_size!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"{causal_name} must be True or False, got {causal!r}")
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def unbounded_past(window: tuple[int, int], span: int) -> tuple[int, int]:
    """The window with each bound of at least `span` (the most positions a query and a key can lie apart) made
    -1: the same keys are visible, and the kernels' int32 position arithmetic cannot overflow on it."""
    return tuple(-1 if w >= span else w for w in window)


def check_cu_seqlens(name: str, cu_seqlens, batch: int | None, total: int, device: torch.device, *,
                     contents: bool, exact_end: bool = True) -> None:
    """int32 (batch + 1,) prefix sums, contiguous, on `device`; with `contents`, also its values: 0 first, never
    decreasing, ending at `total` (exact_end: every packed row belongs to a sequence, so none is left unwritten)
    or at most there."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        if isinstance(cu_seqlens, torch.Tensor):
            got = f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        else:
            got = type(cu_seqlens).__name__
        raise ValueError(f"{name} must be a 1-D torch.int32 tensor (batch + 1,), got {got}")
    if cu_seqlens.numel() < 1 or (batch is not None and cu_seqlens.numel() != batch + 1):
        expected = "batch + 1" if batch is None else str(batch + 1)
        raise ValueError(f"{name} must have batch + 1 entries ({expected}), got {cu_seqlens.numel()}")
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read it by offset), got stride {cu_seqlens.stride()}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device} but the packed tensors are on {device}")
    if total > INT32_MAX:
        raise ValueError(f"{name}: {total} packed rows exceed the int32 offsets of the kernels ({INT32_MAX})")
    if contents:
        values = cu_seqlens.tolist()
        end_ok = values[-1] == total if exact_end else values[-1] <= total
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or not end_ok:
            end = f"end at {total}" if exact_end else f"end at most at {total}"
            raise ValueError(f"{name} must start at 0, never decrease and {end} (the packed length), got "
                             f"{_preview(values)}")


def check_max_seqlen(name: str, max_seqlen, cu_seqlens: torch.Tensor, *, contents: bool) -> int:
    """A non-negative int (the kernels size their grids from it); with `contents`, at least the longest
    sequence of cu_seqlens."""
    if not is_int(max_seqlen) or not 0 <= max_seqlen <= INT32_MAX:
        raise ValueError(f"{name} must be a non-negative int (at most {INT32_MAX}), got {max_seqlen!r}")
    if contents and cu_seqlens.numel() > 1:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > max_seqlen:
            raise ValueError(f"{name} ({max_seqlen}) is smaller than the longest sequence ({longest})")
    return max_seqlen


def _preview(values: list, limit: int = 8) -> str:
    return str(values) if len(values) <= limit else f"[{', '.join(map(str, values[:limit]))}, ...] ({len(values)} entries)"


def broadcast_mask(attn_mask, batch: int, heads: int, n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    """A (B, H, Nq, Nk) stride-0 view of a bool or float mask broadcastable to that shape (no copy)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise ValueError(
            f"attn_mask.dtype must be torch.bool (True = attend) or a float type (additive), got {attn_mask.dtype}")
    if attn_mask.device != device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {device}")
    target = (batch, heads, n_q, n_k)
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1])):
        raise ValueError(f"attn_mask.shape {shape} must be broadcastable to (B, H, Nq, Nk) = {target}")
    return attn_mask.expand(target) if len(shape) == 4 else attn_mask[(None,) * (4 - len(shape))].expand(target)


ATTENTION_BACKENDS = ("auto", "triton", "torch", "gluon")


def check_backend(backend, allowed: tuple[str, ...] = ("auto", "triton", "torch")) -> None:
    if backend not in allowed:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in allowed)}; got {backend!r}")


def check_dense_qkv(names: tuple[str, str, str], tensors, layout: str) -> None:
    """q, k, v as 4-D tensors of one dtype and device in `layout`, k and v alike, batch (dim 0) and head dim
    (dim 3) as q's."""
    check_dtypes_and_devices(names, tensors)
    for name, t in zip(names, tensors):
        check_ndim(name, t, 4, layout)
    (q_name, k_name, v_name), (q, k, v) = names, tensors
    check_same_shape(k_name, k, v_name, v)
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{k_name}.shape {tuple(k.shape)} must match {q_name}.shape {tuple(q.shape)} in batch and "
                         "head dim")


def validate_dense(q, k, v, causal, window_size, softmax_scale) -> AttentionInputs:
    """flash_attn_func: q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D), causal aligned bottom-right."""
    check_dense_qkv(("q", "k", "v"), (q, k, v), "(batch, seqlen, nheads, headdim)")
    check_head_dim(q.shape[3])
    check_heads(q.shape[2], k.shape[2])
    left, right = unbounded_past(normalized_window(window_size, causal), q.shape[1] + k.shape[1])
    return AttentionInputs(q, k, v, softmax_scale_or_default(softmax_scale, q.shape[3]), left, right, True,
                           max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1])


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
                    softmax_scale, validate=None) -> AttentionInputs:
    """flash_attn_varlen_func: packed q (total_q, Hq, D), k/v (total_k, Hkv, D), int32 cu_seqlens."""
    check_dtypes_and_devices(("q", "k", "v"), (q, k, v))
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_ndim(name, t, 3, "(total_tokens, nheads, headdim)")
    check_same_shape("k", k, "v", v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k head dim ({k.shape[2]}) must equal q head dim ({q.shape[2]})")
    check_head_dim(q.shape[2])
    check_heads(q.shape[1], k.shape[1])
    contents = checks_contents(validate, q.device)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.shape[0], q.device, contents=contents)
    # Keys past the last sequence are never read (the paged gather hands over a buffer with spare rows).
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.numel() - 1, k.shape[0], q.device,
                     contents=contents, exact_end=False)
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, contents=contents)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k, contents=contents)
    left, right = unbounded_past(normalized_window(window_size, causal), max_q + max_k)
    return AttentionInputs(q, k, v, softmax_scale_or_default(softmax_scale, q.shape[2]), left, right, True,
                           cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


def validate_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> AttentionInputs:
    """sdpa: (B, H, N, D) like torch.nn.functional.scaled_dot_product_attention, causal aligned top-left."""
    check_dense_qkv(("query", "key", "value"), (query, key, value), "(batch, nheads, seqlen, headdim)")
    check_head_dim(query.shape[3], "query")
    if key.shape[1] != query.shape[1]:
        if not enable_gqa:
            raise ValueError(f"key/value heads ({key.shape[1]}) differ from query heads ({query.shape[1]}): "
                             "pass enable_gqa=True for grouped-query attention")
        check_heads(query.shape[1], key.shape[1])
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True are mutually exclusive (as in PyTorch's fused SDPA backends)")
    batch, heads, n_q, d = query.shape
    mask = None if attn_mask is None else broadcast_mask(attn_mask, batch, heads, n_q, key.shape[2], query.device)
    left, right = normalized_window((-1, -1), is_causal, "is_causal")
    return AttentionInputs(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           softmax_scale_or_default(scale, d, "scale"), left, right, False, attn_mask=mask,
                           max_seqlen_q=n_q, max_seqlen_k=key.shape[2])
