"""The forward kernel family: its launch configuration, the tuned tables (each entry from a committed tuning run
under bench/results/), the candidates `ioattn bench tune` times, and the launcher of
`ioattn.kernels.prefill_fwd.prefill_fwd_kernel`. `ioattn.ops.dispatch` picks a configuration from here for each
call; `ioattn.ops.attention` launches it.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from triton.runtime import _allocation  # the allocator's ContextVar (pinned triton 3.6)

from ioattn.kernels import interpreted
from ioattn.kernels.prefill_fwd import MASK_ADDITIVE, MASK_BOOL, MASK_NONE, prefill_fwd_kernel
from ioattn.ops.capability import HOPPER, HOPPER_SHARED_MEMORY, SIXTEEN_BIT
from ioattn.ops.launch_config import check_launch_config

@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Launch configuration of the forward kernel (what the tuning table stores)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    loop_stages: int | None = None  # tl.range(num_stages=...) of the K/V loops; None keeps the launch default
    tma: bool = True  # tiles move through device-side tensor descriptors; False: pointer loads (cp.async)
    maxnreg: int | None = None  # register cap per thread: one more resident program per SM where it fits

    def __post_init__(self):
        check_launch_config(self)

    def __str__(self) -> str:
        extra = "" if self.loop_stages is None else f" loop_stages={self.loop_stages}"
        extra += "" if self.tma else " loads=pointers"
        extra += "" if self.maxnreg is None else f" maxnreg={self.maxnreg}"
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} num_warps={self.num_warps} "
                f"num_stages={self.num_stages}{extra}")


@dataclasses.dataclass(frozen=True)
class FwdProblem:
    """Everything the kernel needs to know besides the tensors; all decided by the caller."""

    softmax_scale: float
    window_left: int  # -1: unbounded (causal is already folded in as window_right = 0)
    window_right: int
    bottom_right: bool  # query i sits at key position i + Nk - Nq (flash-attn) instead of i (PyTorch SDPA)
    input_precision: str  # "ieee" | "tf32" for fp32 inputs; ignored by fp16/bf16 dots
    pack_gqa: bool  # one program loads a whole GQA query group, so each K/V tile is read once per group


# Hopper table for 16-bit inputs, keyed by (padded head dim, causal): two programs per SM overlap each other's
# softmax and matmuls (bench/results/2026-11-29-tune-fwd-h200.json).
_HOPPER_16BIT: dict[tuple[int, bool], FwdConfig] = {
    (16, False): FwdConfig(128, 128, 4, 3), (16, True): FwdConfig(64, 128, 4, 2),
    (32, False): FwdConfig(128, 128, 4, 3), (32, True): FwdConfig(64, 128, 4, 2),
    (64, False): FwdConfig(128, 128, 4, 3), (64, True): FwdConfig(64, 128, 4, 2),
    (128, False): FwdConfig(128, 64, 4, 2), (128, True): FwdConfig(128, 64, 4, 2),
    (256, False): FwdConfig(128, 64, 8, 2), (256, True): FwdConfig(128, 64, 8, 2),
}
# Short queries at small head dims: a program's fixed costs weigh more, so a third resident program per SM pays
# (bench/results/2026-11-29-fwd-fma.md, 2026-12-01-explore5-h200.json; lab/README.md "short-query forward").
SHORT_SEQLEN = 2048
_HOPPER_16BIT_SHORT: dict[tuple[int, bool], FwdConfig] = {
    (16, True): FwdConfig(64, 64, 4, 2), (32, True): FwdConfig(64, 64, 4, 2),
    (64, False): FwdConfig(128, 64, 4, 3, maxnreg=168), (64, True): FwdConfig(64, 64, 4, 3, tma=False, maxnreg=128),
}
_INTERPRETER_CONFIG = FwdConfig(32, 32, 4, 1)  # small tiles keep the CPU interpreter quick


def default_config(head_dim: int, dtype: torch.dtype, *, mask_dtype: torch.dtype | None = None) -> FwdConfig:
    """The rule for devices without a tuned entry: conservative Ampere-class tiles, halved for fp32 (twice the
    shared memory per element). `mask_dtype` is the family's variant (see `ioattn.ops.tuning`); stages are fitted
    to a mask by `fit_shared_memory`."""
    block = 64 if head_dim_padded(head_dim) <= 128 else 32
    if dtype == torch.float32 and head_dim_padded(head_dim) > 64:
        block = max(16, block // 2)
    return FwdConfig(block, block, 4, 2)


def tuned_config(head_dim: int, dtype: torch.dtype, causal: bool, capability,
                 max_seqlen_q: int | None = None) -> tuple[FwdConfig, str]:
    """The table entry for (head dim, dtype, causal, device capability, short or long queries), and its source."""
    if capability is None:
        return _INTERPRETER_CONFIG, "Triton interpreter on CPU: small tiles"
    d_pad = head_dim_padded(head_dim)
    if capability == HOPPER and dtype in SIXTEEN_BIT:
        short = max_seqlen_q is not None and max_seqlen_q <= SHORT_SEQLEN
        if short and (d_pad, causal) in _HOPPER_16BIT_SHORT:
            return (_HOPPER_16BIT_SHORT[(d_pad, causal)],
                    f"tuned table sm90 (D_pad={d_pad}, causal={causal}, Nq <= {SHORT_SEQLEN})")
        return _HOPPER_16BIT[(d_pad, causal)], f"tuned table sm90 (D_pad={d_pad}, causal={causal})"
    return (default_config(head_dim, dtype),
            f"default rule (no tuned entry for sm{capability[0]}{capability[1]} {dtype})")




def shared_memory_estimate(config: FwdConfig, head_dim: int, dtype: torch.dtype,
                           mask_dtype: torch.dtype | None = None) -> int:
    """Bytes of shared memory the compiled kernel takes (matches Triton 3.6's sm90 builds within ~1 KB).

    The Q tile, a K and a V tile per pipeline stage, and, with a dense mask, a mask tile per extra stage
    (Triton pipelines the mask's pointer loads through shared memory too), plus barriers.
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = config.block_m + 2 * config.num_stages * config.block_n
    tiles = rows * head_dim_padded(head_dim) * elem
    mask_bytes = 0
    if mask_dtype is not None:
        mask_elem = torch.tensor([], dtype=mask_dtype).element_size()
        mask_bytes = (config.num_stages - 1) * config.block_m * config.block_n * mask_elem
    return tiles + mask_bytes + 1024


def candidate_configs(head_dim: int, dtype: torch.dtype, *, mask_dtype: torch.dtype | None = None) -> list[FwdConfig]:
    """Configurations worth timing on Hopper for one head dim and dtype (the tuning script sweeps them all).

    At most 16 (so one device call can time them all), pruned by the shared-memory estimate and by
    score-tile registers (at most 128 fp32 scores per thread).
    """
    found = []
    for block_m in (64, 128):
        for block_n in (64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3):
                    config = FwdConfig(block_m, block_n, num_warps, num_stages)
                    if (shared_memory_estimate(config, head_dim, dtype, mask_dtype) <= HOPPER_SHARED_MEMORY
                            and block_m * block_n // (32 * num_warps) <= 128):
                        found.append(config)
    return found


def fit_shared_memory(config: FwdConfig, inputs) -> tuple[FwdConfig, str]:
    """Drop pipeline stages until a dense mask's extra buffers fit (`inputs`: the call's `AttentionInputs`); the
    note says so in explain()."""
    if inputs.attn_mask is None:
        return config, ""
    mask_dtype = inputs.attn_mask.dtype
    fitted = config
    while (fitted.num_stages > 1 and
           shared_memory_estimate(fitted, inputs.q.shape[-1], inputs.q.dtype, mask_dtype) > HOPPER_SHARED_MEMORY):
        fitted = dataclasses.replace(fitted, num_stages=fitted.num_stages - 1)
    if fitted == config:
        return config, ""
    return fitted, f"; num_stages {config.num_stages} -> {fitted.num_stages} so the dense mask tiles fit in shared memory"


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side tensor descriptors live in global scratch memory that Triton asks the host to allocate.

    Triton keeps its allocator in a ContextVar, so every thread needs its own (autograd runs the backward in a
    thread of its own); an allocator the caller set is left in place.
    """
    if not interpreted() and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)


def head_dim_padded(head_dim: int) -> int:
    """Register tile width: next power of two, at least 16 (the smallest tl.dot reduction size)."""
    return max(16, triton.next_power_of_2(head_dim))


def launch_prefill_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    problem: FwdProblem,
    config: FwdConfig,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    attn_mask: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    fp8_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """Run the kernel with an explicit configuration; writes `out` and `lse` in place.

    Layouts: q/out (B, Nq, Hq, D), k/v (B, Nk, Hkv, D), lse (B, Hq, Nq); varlen: (total, H, D) and lse
    (Hq, total_q) with int32 cu_seqlens. `attn_mask` (dense only) must already be broadcast to 4 dims
    (B, Hq, Nq, Nk) through stride-0 views. Inputs must meet the descriptor rules (last stride 1, 16-byte
    aligned base and strides): the caller checks them and copies when they do not. k_descale / v_descale: float32
    (Hkv,) factors of the scores and the output per KV head (k/v hold fp8 codes; both or neither). fp8_scales:
    q, k and v all hold e4m3 codes and both products run in fp8 (dense layout only; v transposed, (B, Hkv, D, Nk')
    with Nk' >= Nk a multiple of 16, keys contiguous): (q_scale (B, Hq, nq),
    k_scale (B, Hkv, nk), v_scale (B, Hkv, nk), block) float32 contiguous, one scale per `block` positions,
    `block` a multiple of config.block_n.
    """
    ensure_allocator()
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        (_, hq, d), hkv = q.shape, k.shape[1]
        seqlen_q, seqlen_k = 0, 0
        strides_q = (0, q.stride(0), q.stride(1))
        strides_k = (0, k.stride(0), k.stride(1))
        strides_v = (0, v.stride(0), v.stride(1))
        strides_o = (0, out.stride(0), out.stride(1))
        strides_l = (0, lse.stride(0), lse.stride(1))
    else:
        batch, seqlen_q, hq, d = q.shape
        seqlen_k, hkv = k.shape[1], k.shape[2]
        max_seqlen_q = seqlen_q
        strides_q = (q.stride(0), q.stride(1), q.stride(2))
        strides_k = (k.stride(0), k.stride(1), k.stride(2))
        strides_v = (v.stride(0), v.stride(1), v.stride(2))
        if fp8_scales is not None:  # v transposed (B, Hkv, D, keys): (batch, head-dim row, head) strides
            strides_v = (v.stride(0), v.stride(2), v.stride(1))
        strides_o = (out.stride(0), out.stride(1), out.stride(2))
        strides_l = (lse.stride(0), lse.stride(1), lse.stride(2))
    group = hq // hkv
    if attn_mask is None:
        mask_kind, mask_arg, strides_m = MASK_NONE, q, (0, 0, 0, 0)
    else:
        mask_kind = MASK_BOOL if attn_mask.dtype == torch.bool else MASK_ADDITIVE
        mask_arg = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
        strides_m = attn_mask.stride()
    rows = config.block_m // group if problem.pack_gqa else config.block_m
    grid = (triton.cdiv(max_seqlen_q, rows), batch * (hkv if problem.pack_gqa else hq))
    if grid[0] == 0 or grid[1] == 0:
        return
    dummy_cu = cu_seqlens_q if varlen else lse
    if fp8_scales is not None:
        q_scale, k_descale, v_descale, scale_block = fp8_scales
        scale_blocks = (q_scale.shape[-1], k_descale.shape[-1])
    else:
        q_scale, scale_block, scale_blocks = lse, 1, (1, 1)
    prefill_fwd_kernel[grid](
        q, k, v, out, lse, mask_arg, dummy_cu, cu_seqlens_k if varlen else lse,
        lse if k_descale is None else k_descale, lse if v_descale is None else v_descale, q_scale,
        seqlen_q, seqlen_k, hq, hkv,
        *strides_q, *strides_k, *strides_v, *strides_o, *strides_l, *strides_m,
        problem.softmax_scale, problem.window_left, problem.window_right, scale_block, *scale_blocks,
        HEAD_DIM=d, HEAD_DIM_PAD=head_dim_padded(d), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP=group, PACK_GQA=problem.pack_gqa, VARLEN=varlen, BOTTOM_RIGHT=problem.bottom_right,
        LEFT_BOUNDED=problem.window_left >= 0, RIGHT_BOUNDED=problem.window_right >= 0, MASK_KIND=mask_kind,
        INPUT_PRECISION=problem.input_precision, LOOP_STAGES=config.loop_stages,
        SCALE_POSITIVE=problem.softmax_scale > 0, TMA=config.tma,
        **({"FP8": True, "ROUND_P": interpreted()} if fp8_scales is not None
           else {"DESCALE": True} if k_descale is not None else {}),
        num_warps=config.num_warps,
        num_stages=config.num_stages, maxnreg=config.maxnreg,
    )
