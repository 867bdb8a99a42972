"""The backward kernel family: its launch configuration, the tuned table (from committed tuning runs under
bench/results/), the candidates `ioattn bench tune` times, the argument checks shared with the torch backward,
and the launcher of the kernels in `ioattn.kernels.prefill_bwd` (read there for the algorithm: a dQ kernel that
writes the row statistics, then a dK/dV kernel; or fused atomic dQ).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton

from ioattn.kernels import interpreted
from ioattn.kernels.prefill_bwd import (
    DMASK_ATOMIC, DMASK_NONE, DMASK_STORE, attention_bwd_dkdv_kernel, attention_bwd_dq_kernel,
    attention_bwd_preprocess_kernel,
)
from ioattn.kernels.prefill_fwd import MASK_ADDITIVE, MASK_BOOL, MASK_NONE
from ioattn.ops.capability import HOPPER, SIXTEEN_BIT
from ioattn.ops.launch_config import check_launch_config
from ioattn.ops.forward import ensure_allocator, head_dim_padded

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_GROUP = 8  # (batch, head) pairs whose tiles the grid walks together (the kernels' `_longest_first`)


def deterministic_default() -> bool:
    """The `deterministic=` a caller passes when the user did not choose: True when `IOATTN_DETERMINISTIC=1`."""
    return os.environ.get("IOATTN_DETERMINISTIC", "0") == "1"


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Launch configuration of the backward kernels (what the tuning table stores)."""

    kv_block_n: int  # K/V rows resident per dK/dV program
    kv_block_m: int  # Q/dO rows streamed per step of the dK/dV program
    q_block_m: int  # Q rows resident per dQ program
    q_block_n: int  # K/V rows streamed per step of the dQ program
    num_warps: int
    num_stages: int
    atomic_dq: bool  # fuse dQ into the dK/dV kernel with fp32 atomics (ignored when deterministic)
    dq_num_warps: int | None = None  # the dQ kernel's own warps and stages; None: as the dK/dV kernel
    dq_num_stages: int | None = None

    def __post_init__(self):
        check_launch_config(self)

    @property
    def dq_launch(self) -> tuple[int, int]:
        """(num_warps, num_stages) of the dQ kernel."""
        return (self.dq_num_warps or self.num_warps, self.dq_num_stages or self.num_stages)

    def __str__(self) -> str:
        text = (f"dkdv={self.kv_block_n}x{self.kv_block_m} dq={self.q_block_m}x{self.q_block_n} "
                f"num_warps={self.num_warps} num_stages={self.num_stages} atomic_dq={self.atomic_dq}")
        if self.dq_launch != (self.num_warps, self.num_stages):
            text += f" dq_num_warps={self.dq_launch[0]} dq_num_stages={self.dq_launch[1]}"
        return text


def candidate_configs(head_dim: int, dtype: torch.dtype) -> list[BwdConfig]:
    """Configurations worth timing on a GPU for this head dim and dtype, fastest first (the first is the default).

    Each fits sm_90's 255 registers without spills, or nearly (ptxas reports); they are ordered by H200 timings
    (bench/results/2026-11-29-tune-bwd-h200.json, 2026-12-01-explore1-h200.json, 2026-12-01-s4-explore6-h200.json;
    lab/README.md "backward tiles"). The fused atomic dQ was slower than the separate dQ kernel on every shape, so
    the default backward is also the deterministic one."""
    if interpreted():
        return [BwdConfig(16, 16, 16, 16, 4, 1, False), BwdConfig(16, 16, 16, 16, 4, 1, True)]
    row_bytes = head_dim_padded(head_dim) * dtype.itemsize
    if row_bytes <= 128:  # 16-bit D <= 64, fp32 D <= 32
        return [BwdConfig(64, 64, 64, 64, 4, 3, False), BwdConfig(128, 64, 128, 64, 8, 3, False),
                BwdConfig(128, 32, 128, 32, 8, 3, True)]
    if row_bytes <= 256:  # 16-bit D <= 128
        return [BwdConfig(64, 64, 128, 64, 4, 2, False, 8, 3),
                BwdConfig(128, 64, 128, 64, 8, 3, False), BwdConfig(128, 64, 128, 64, 8, 2, False),
                BwdConfig(128, 32, 128, 32, 8, 3, True)]
    if row_bytes <= 512:  # 16-bit D <= 256, fp32 D <= 128
        return [BwdConfig(64, 32, 64, 32, 8, 2, False), BwdConfig(64, 64, 64, 64, 8, 2, False),
                BwdConfig(64, 32, 64, 32, 8, 2, True)]
    return [BwdConfig(32, 16, 32, 16, 4, 1, False)]  # fp32 D > 128: correctness, not speed


def default_config(head_dim: int, dtype: torch.dtype) -> BwdConfig:
    return candidate_configs(head_dim, dtype)[0]


# Hopper backward table for 16-bit inputs, keyed by padded head dim: the fastest candidates of H200 timings
# (bench/results/2026-11-29-tune-bwd-h200.json, D=128 2026-12-01-s4-explore6-h200.json); D=256 is its first
# register-checked candidate, not timed yet.
_HOPPER_BWD_16BIT: dict[int, BwdConfig] = {
    16: BwdConfig(64, 64, 64, 64, 4, 3, False), 32: BwdConfig(64, 64, 64, 64, 4, 3, False),
    64: BwdConfig(64, 64, 64, 64, 4, 3, False), 128: BwdConfig(64, 64, 128, 64, 4, 2, False, 8, 3),
    256: BwdConfig(64, 32, 64, 32, 8, 2, False),
}


def tuned_bwd_config(head_dim: int, dtype: torch.dtype, capability) -> tuple[BwdConfig, str]:
    """The backward table entry for (head dim, dtype, device capability), and where it came from."""
    if capability is None:
        return default_config(head_dim, dtype), "backward: Triton interpreter on CPU, small tiles"
    d_pad = head_dim_padded(head_dim)
    if capability == HOPPER and dtype in SIXTEEN_BIT:
        return _HOPPER_BWD_16BIT[d_pad], f"backward: table sm90 (D_pad={d_pad})"
    device = f"sm{capability[0]}{capability[1]}"
    return default_config(head_dim, dtype), f"backward: prefill_bwd default (no table entry for {device} {dtype})"


def check_bwd_args(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask,
                   mask_grad) -> None:
    """ValueError naming the argument for anything neither backward (this one or
    `ioattn.ops.torch_backward.attention_bwd_torch`) supports."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    for name, t in (("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse)):
        if t.dtype != q.dtype and name != "lse":
            raise ValueError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all must share a device")
    if lse.dtype != torch.float32:
        raise ValueError(f"lse.dtype must be torch.float32, got {lse.dtype}")
    head_dim = q.shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= 256 or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"head dims of q/k/v must be equal multiples of 8 in [8, 256], got "
                         f"{q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]}")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"number of query heads ({q.shape[-2]}) must be a multiple of key/value heads ({k.shape[-2]})")
    if o.shape != q.shape or do.shape != q.shape or v.shape != k.shape:
        raise ValueError(f"o and do must have q's shape {tuple(q.shape)} and v k's shape {tuple(k.shape)}")
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if varlen:
        if q.dim() != 3 or k.dim() != 3:
            raise ValueError(f"varlen q/k/v must be packed (total, heads, head_dim), got q {tuple(q.shape)}")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32 or cu.dim() != 1:
                raise ValueError(f"{name} must be a 1-D torch.int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)")
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("max_seqlen_q and max_seqlen_k are required with cu_seqlens")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported with varlen (cu_seqlens) inputs")
        expected_lse = (q.shape[1], q.shape[0])
    else:
        if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0]:
            raise ValueError(f"q must be (B, Nq, Hq, D) and k/v (B, Nk, Hkv, D), got {tuple(q.shape)} {tuple(k.shape)}")
        expected_lse = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != expected_lse:
        raise ValueError(f"lse must have shape {expected_lse}, got {tuple(lse.shape)}")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype, torch.float32):
        raise ValueError(f"attn_mask.dtype must be torch.bool, torch.float32 or q.dtype, got {attn_mask.dtype}")
    if mask_grad and (attn_mask is None or attn_mask.dtype == torch.bool):
        raise ValueError("mask_grad needs an additive (floating-point) attn_mask")


def _tma_ready(t: torch.Tensor) -> bool:
    """Descriptor rules: last stride 1, 16-byte aligned base and strides."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1]))


def _dense(t: torch.Tensor) -> bool:
    """True when t fills its memory span exactly (a permutation of a contiguous tensor), so that a tensor
    allocated with its strides holds no gaps and no element twice."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` as it is when the kernels can read it and new tensors can be allocated in its strides (SDPA's
    (B, H, N, D) storage seen as (B, N, H, D) is such a permutation); else a contiguous copy, explicitly. A view
    into a packed qkv / kv tensor is not dense: gradients allocated in its strides would run past their end."""
    if _tma_ready(t) and _dense(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _empty_in(layout: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor with the strides of `layout`, which must be dense (empty_like keeps a dense tensor's strides;
    those of size-1 dims may differ, and no index ever multiplies them)."""
    out = torch.empty_like(layout, dtype=dtype)
    assert all(a == b for a, b, n in zip(out.stride(), layout.stride(), layout.shape) if n > 1), layout.stride()
    return out


def _in_layout(t: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """`t` in the strides of `layout` (q, o, do and dq share one set of strides, k, v, dk and dv another): as it
    is when it has them, else copied (e.g. a dO with other strides than q, or an expanded one)."""
    if t.stride() == layout.stride() and _tma_ready(t):
        return t
    return _empty_in(layout).copy_(t)


def fold_causal(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """Fold causal into the right window bound; -1 means unbounded."""
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def attention_bwd(
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
    deterministic: bool = False,
    config: BwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients (dq, dk, dv, dmask) of attention from the saved o and lse (float32, natural log).

    Layouts: q/o/do (B, Nq, Hq, D), k/v (B, Nk, Hkv, D), lse (B, Hq, Nq); varlen: packed (total, H, D),
    lse (Hq, total_q), int32 cu_seqlens. Masking as `ioattn.reference.attention_ref`: causal (aligned
    bottom-right, query i at key i + Nk - Nq, or top-left), window (left, right) with -1 unbounded, a dense
    bool (True = attend) or additive mask broadcastable to (B, Hq, Nq, Nk). dmask (the gradient of an additive
    mask, in the mask's shape and dtype) is computed only when `mask_grad`, else None. `deterministic` forces
    the separate dQ kernel and no atomics anywhere (see the module docstring for the cost).
    """
    check_bwd_args(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, mask_grad)
    ensure_allocator()
    head_dim = q.shape[-1]
    config = config or default_config(head_dim, q.dtype)
    atomic_dq = config.atomic_dq and not deterministic
    q, k = _kernel_layout(q), _kernel_layout(k)
    o, do, v = _in_layout(o, q), _in_layout(do, q), _in_layout(v, k)
    lse = lse.contiguous()
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = 0, 0
        strides_q = (0, q.stride(0), q.stride(1))
        strides_k = (0, k.stride(0), k.stride(1))
        strides_l = (0, lse.stride(0))
        stats = torch.empty(q.shape[0], q.shape[-2], 4, dtype=torch.float32, device=q.device)
        strides_s = (0, stats.stride(0), stats.stride(1))
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        max_seqlen_q, max_seqlen_k = seqlen_q, seqlen_k
        strides_q = q.stride()[:3]
        strides_k = k.stride()[:3]
        strides_l = lse.stride()[:2]
        stats = torch.empty(batch, seqlen_q, q.shape[-2], 4, dtype=torch.float32, device=q.device)
        strides_s = stats.stride()[:3]
        cu_q = cu_k = lse  # unused placeholders
    num_heads, num_kv_heads = q.shape[-2], k.shape[-2]
    left, right = fold_causal(causal, window_size)
    common = dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), VARLEN=varlen, BOTTOM_RIGHT=bottom_right,
        LEFT_BOUNDED=left >= 0, RIGHT_BOUNDED=right >= 0,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    dkdv_launch = dict(LOOP_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
                       HEAD_GROUP=HEAD_GROUP)
    dq_warps, dq_stages = config.dq_launch
    dq_launch = dict(LOOP_STAGES=dq_stages, num_warps=dq_warps, num_stages=dq_stages, HEAD_GROUP=HEAD_GROUP)

    mask_kind, mask_arg, strides_m = MASK_NONE, q, (0, 0, 0, 0)
    dmask_mode, dmask_buffer, strides_dm = DMASK_NONE, q, (0, 0, 0, 0)
    if attn_mask is not None:
        full_shape = (batch, num_heads, seqlen_q, seqlen_k)
        mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        expanded = mask4.expand(full_shape)
        mask_kind = MASK_BOOL if attn_mask.dtype == torch.bool else MASK_ADDITIVE
        mask_arg = expanded.view(torch.uint8) if mask_kind == MASK_BOOL else expanded
        strides_m = expanded.stride()
        if mask_grad:
            broadcast = tuple(mask4.shape) != full_shape
            if broadcast and not deterministic:  # one fp32 element per mask element, atomics reduce
                dmask_mode = DMASK_ATOMIC
                dmask_buffer = torch.zeros(mask4.shape, dtype=torch.float32, device=q.device)
                strides_dm = dmask_buffer.expand(full_shape).stride()
            else:  # one element per (b, h, i, j): plain stores, torch reduces
                dmask_mode = DMASK_STORE
                dmask_buffer = torch.zeros(full_shape, dtype=torch.float32, device=q.device)
                strides_dm = dmask_buffer.stride()

    dq, dk, dv = _empty_in(q), _empty_in(k), _empty_in(k)
    dq_accum = _empty_in(q, torch.float32).zero_() if atomic_dq else dq
    if k.shape[-3] == 0:  # no keys at all: nothing is visible, every gradient is zero
        dq.zero_()
    elif batch * num_kv_heads > 0:
        if atomic_dq:  # the row statistics from their own pass
            rows = max(16, 4096 // head_dim_padded(head_dim))  # O and dO tiles of 16 KB in registers
            attention_bwd_preprocess_kernel[(max(1, triton.cdiv(max_seqlen_q, rows)), batch * num_heads)](
                o, do, lse, stats, cu_q, seqlen_q, num_heads, *strides_q, *strides_l, *strides_s,
                HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), BLOCK_M=rows, VARLEN=varlen,
            )
        else:  # the dQ kernel first: it writes the row statistics the dK/dV kernel reads
            attention_bwd_dq_kernel[(max(1, triton.cdiv(max_seqlen_q, config.q_block_m)), batch * num_heads)](
                q, k, v, o, do, lse, stats, dq, mask_arg, cu_q, cu_k,
                seqlen_q, seqlen_k, num_heads, *strides_q, *strides_k, *strides_l, *strides_s, *strides_m,
                scale, left, right, BLOCK_M=config.q_block_m, BLOCK_N=config.q_block_n,
                GROUP=num_heads // num_kv_heads, MASK_KIND=mask_kind, **common, **dq_launch,
            )
        attention_bwd_dkdv_kernel[(max(1, triton.cdiv(max_seqlen_k, config.kv_block_n)), batch * num_kv_heads)](
            q, k, v, do, stats, dk, dv, dq_accum, mask_arg, dmask_buffer, cu_q, cu_k,
            seqlen_q, seqlen_k, num_kv_heads, *strides_q, *strides_k, *strides_s, *strides_m, *strides_dm,
            scale, left, right, BLOCK_M=config.kv_block_m, BLOCK_N=config.kv_block_n,
            GROUP=num_heads // num_kv_heads, MASK_KIND=mask_kind, ATOMIC_DQ=atomic_dq, DMASK_MODE=dmask_mode,
            **common, **dkdv_launch,
        )
        if atomic_dq:
            dq.copy_(dq_accum)
    dmask = None
    if mask_grad:
        dims = [d for d in range(4) if mask4.shape[d] == 1 and full_shape[d] != 1]
        reduced = dmask_buffer.sum(dim=dims, keepdim=True) if dmask_mode == DMASK_STORE and dims else dmask_buffer
        dmask = reduced.reshape(attn_mask.shape).to(attn_mask.dtype)
    return dq, dk, dv, dmask
