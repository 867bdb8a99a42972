"""Backend selection, the tuned tile table, and the diagnostics that make every choice visible.

backend="auto" picks the Triton kernel for CUDA tensors and the exact tiled torch path for CPU tensors.
On CUDA nothing falls back silently: an input the Triton kernel cannot take raises. `explain(q, k, v, ...)`
returns the plan (kernel, tile configuration, backend, copies, reason) without running anything, and
IOATTN_LOG=1 logs each distinct plan once (logger "ioattn"). The plan covers the backward too: its kernel,
tiles and whether it is deterministic.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from ioattn.kernels import interpreted
from ioattn.kernels.prefill_bwd import BwdConfig, default_config, deterministic_default
from ioattn.kernels.prefill_fwd import FwdConfig, FwdProblem, head_dim_padded
from ioattn.ops import checks, torch_backend, torch_backward
from ioattn.ops.capability import MAX_GRID_Y, device_capability, interpreter_upcast
from ioattn.ops.checks import AttentionInputs

logger = logging.getLogger("ioattn")

TRITON_KERNEL = "ioattn.kernels.prefill_fwd.prefill_fwd_kernel"
TORCH_KERNEL = "ioattn.ops.torch_backend.attention_forward"
TRITON_BWD_KERNEL = "ioattn.kernels.prefill_bwd.attention_bwd (dQ kernel with the row statistics, then dK/dV kernel)"
TORCH_BWD_KERNEL = "ioattn.ops.torch_backward.attention_bwd_torch"
HOPPER = (9, 0)
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

# Hopper (H100/H200) table for 16-bit inputs, keyed by (padded head dim, causal): the winners of
# `ioattn bench tune` on an H200 (bench/results/2026-11-29-tune-fwd-h200.json). 4 warps with a 128-row tile
# leave room for two programs per SM, whose softmax and matmuls then overlap.
_HOPPER_16BIT: dict[tuple[int, bool], FwdConfig] = {
    (16, False): FwdConfig(128, 128, 4, 3), (16, True): FwdConfig(64, 128, 4, 2),
    (32, False): FwdConfig(128, 128, 4, 3), (32, True): FwdConfig(64, 128, 4, 2),
    (64, False): FwdConfig(128, 128, 4, 3), (64, True): FwdConfig(64, 128, 4, 2),
    (128, False): FwdConfig(128, 64, 4, 2), (128, True): FwdConfig(128, 64, 4, 2),
    (256, False): FwdConfig(128, 64, 8, 2), (256, True): FwdConfig(128, 64, 8, 2),
}
# Short queries at small head dims: few K/V tiles per program, so its fixed costs weigh more and a third
# resident program per SM pays. Causal ones take narrower tiles (H200, D=64, N=2048: 64x64 306 TFLOP/s against
# 286 for 64x128; bench/results/2026-11-29-fwd-fma.md). At D=64, N=2048 (bench/results/2026-12-01-explore5-h200.json,
# FlexAttention 396 / 311 in the same run): non-causal 128x64 tiles capped at 168 registers (three programs per
# SM, no spills) 407 against 379 for the long-query entry; causal 64x64 tiles with pointer loads (no
# per-program descriptor set-up) capped at 128 registers 331 against 304 with descriptors.
SHORT_SEQLEN = 2048
_HOPPER_16BIT_SHORT: dict[tuple[int, bool], FwdConfig] = {
    (16, True): FwdConfig(64, 64, 4, 2), (32, True): FwdConfig(64, 64, 4, 2),
    (64, False): FwdConfig(128, 64, 4, 3, maxnreg=168), (64, True): FwdConfig(64, 64, 4, 3, tma=False, maxnreg=128),
}
_INTERPRETER_CONFIG = FwdConfig(32, 32, 4, 1)  # small tiles keep the CPU interpreter quick

# Hopper backward table for 16-bit inputs, keyed by padded head dim: the fastest candidates of H200 timings
# (bench/results/2026-11-29-tune-bwd-h200.json; D=128 re-timed in bench/results/2026-12-01-s4-explore6-h200.json:
# 64-row dK/dV tiles on 4 warps, two programs per SM, beside 128-row dQ tiles on 8 warps, fastest at N = 2k, 4k
# and 16k, causal or not; D=256 not timed yet, its first register-checked candidate).
_HOPPER_BWD_16BIT: dict[int, BwdConfig] = {
    16: BwdConfig(64, 64, 64, 64, 4, 3, False), 32: BwdConfig(64, 64, 64, 64, 4, 3, False),
    64: BwdConfig(64, 64, 64, 64, 4, 3, False), 128: BwdConfig(64, 64, 128, 64, 4, 2, False, 8, 3),
    256: BwdConfig(64, 32, 64, 32, 8, 2, False),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a call will run and why; str() is the human-readable explanation."""

    backend: str  # "triton" | "torch"
    kernel: str
    config: FwdConfig | None  # Triton tile configuration (None for the torch backend)
    problem: FwdProblem
    copies: tuple[tuple[str, str], ...]  # (input name, why) for inputs copied to contiguous before the kernel
    reason: str
    torch_tiles: tuple[int, int] | None = None  # (block_m, block_n) of the torch backend
    bwd_kernel: str = ""
    bwd_config: BwdConfig | None = None  # Triton backward tiles (None for the torch backend)
    deterministic: bool = False  # the backward avoids atomics and is bitwise reproducible
    # Triton's CPU interpreter computes bf16 tl.dot wrongly (errors ~1e8): the kernels run on float32 copies.
    upcast: bool = False

    def __str__(self) -> str:
        if self.config is not None:
            tiles = str(self.config)
        else:
            tiles = f"BLOCK_M={self.torch_tiles[0]} BLOCK_N={self.torch_tiles[1]}"
        p = self.problem
        lines = [
            f"backend: {self.backend}",
            f"kernel:  {self.kernel}",
            f"tiles:   {tiles}",
            f"options: scale={p.softmax_scale:.6g} window=({p.window_left}, {p.window_right}) "
            f"align={'bottom-right' if p.bottom_right else 'top-left'} pack_gqa={p.pack_gqa} "
            f"input_precision={p.input_precision}",
            f"inputs:  {self._copies_text()}",
            f"reason:  {self.reason}",
            f"backward: {self.bwd_kernel}",
            f"bwd tiles: {self.bwd_config if self.bwd_config is not None else f'block={torch_backward.BLOCK}'}",
            f"bwd mode: {self._bwd_mode_text()}",
        ]
        return "\n".join(lines)

    def _bwd_mode_text(self) -> str:
        if self.bwd_config is None:
            return "deterministic (tiled torch, fixed summation order)"
        if self.deterministic:
            return "deterministic (separate dQ kernel, no atomics anywhere; bitwise reproducible)"
        if self.bwd_config.atomic_dq:
            return "not deterministic (dQ added with fp32 atomics inside the dK/dV kernel)"
        return ("separate dQ kernel, no atomics on dQ (a broadcast additive mask's gradient is still "
                "reduced with atomics)")

    def _copies_text(self) -> str:
        if self.upcast:
            return "bfloat16 copied to float32 (Triton's interpreter computes bf16 dots wrongly), results cast back"
        if not self.copies:
            return "used in place through their strides (no copy)"
        return "; ".join(f"{name} copied to contiguous ({why})" for name, why in self.copies)


def tuned_config(head_dim: int, dtype: torch.dtype, causal: bool, capability,
                 max_seqlen_q: int | None = None) -> tuple[FwdConfig, str]:
    """The table entry for (head dim, dtype, causal, device capability, short or long queries), and its source."""
    if capability is None:
        return _INTERPRETER_CONFIG, "Triton interpreter on CPU: small tiles"
    d_pad = head_dim_padded(head_dim)
    if capability == HOPPER and dtype in _SIXTEEN_BIT:
        short = max_seqlen_q is not None and max_seqlen_q <= SHORT_SEQLEN
        if short and (d_pad, causal) in _HOPPER_16BIT_SHORT:
            return (_HOPPER_16BIT_SHORT[(d_pad, causal)],
                    f"tuned table sm90 (D_pad={d_pad}, causal={causal}, Nq <= {SHORT_SEQLEN})")
        return _HOPPER_16BIT[(d_pad, causal)], f"tuned table sm90 (D_pad={d_pad}, causal={causal})"
    # fp32 tiles take twice the shared memory; other GPUs get conservative Ampere-class sizes
    block = 64 if d_pad <= 128 else 32
    if dtype == torch.float32:
        block = max(16, block // 2) if d_pad > 64 else block
    return FwdConfig(block, block, 4, 2), f"default rule (no tuned entry for sm{capability[0]}{capability[1]} {dtype})"


def tuned_bwd_config(head_dim: int, dtype: torch.dtype, capability) -> tuple[BwdConfig, str]:
    """The backward table entry for (head dim, dtype, device capability), and where it came from."""
    if capability is None:
        return default_config(head_dim, dtype), "backward: Triton interpreter on CPU, small tiles"
    d_pad = head_dim_padded(head_dim)
    if capability == HOPPER and dtype in _SIXTEEN_BIT:
        return _HOPPER_BWD_16BIT[d_pad], f"backward: table sm90 (D_pad={d_pad})"
    device = f"sm{capability[0]}{capability[1]}"
    return default_config(head_dim, dtype), f"backward: prefill_bwd default (no table entry for {device} {dtype})"


def resolve_deterministic(deterministic) -> bool:
    """None (the default) means deterministic when IOATTN_DETERMINISTIC=1 or
    torch.use_deterministic_algorithms(True) is in effect."""
    if deterministic is None:
        return deterministic_default() or torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be True, False or None (IOATTN_DETERMINISTIC / "
                         f"torch.are_deterministic_algorithms_enabled()), got {deterministic!r}")
    return deterministic


HOPPER_SHARED_MEMORY = 227 * 1024  # opt-in dynamic shared memory per block on H100/H200


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


def candidate_configs(head_dim: int, dtype: torch.dtype, mask_dtype: torch.dtype | None = None) -> list[FwdConfig]:
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


def _fit_shared_memory(config: FwdConfig, inputs: AttentionInputs) -> tuple[FwdConfig, str]:
    """Drop pipeline stages until a dense mask's extra buffers fit; the note says so in explain()."""
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


def _descriptor_ready(t: torch.Tensor) -> str | None:
    """Why `t` cannot back a TMA descriptor as it is (None when it can)."""
    elem = t.element_size()
    if t.stride(-1) != 1:
        return f"last stride {t.stride(-1)} != 1"
    if any((s * elem) % 16 for s in t.stride()[:-1]):
        return f"strides {tuple(t.stride())} not 16-byte multiples"
    if t.data_ptr() % 16:
        return "base address not 16-byte aligned"
    return None


def _pack_gqa(inputs: AttentionInputs, config: FwdConfig) -> bool:
    """Pack a GQA group into one query tile when a single head would fill under half a tile (decode-like)."""
    group = inputs.group
    return (group > 1 and group & (group - 1) == 0 and group <= config.block_m
            and inputs.max_seqlen_q * 2 <= config.block_m)


def plan(inputs: AttentionInputs, backend: str = "auto", config: FwdConfig | None = None,
         deterministic: bool | None = None, bwd_config: BwdConfig | None = None) -> Plan:
    """Choose backend and tiles; an explicit `config` / `bwd_config` (tuning, benchmarks) replaces the table
    lookup of the forward / backward."""
    checks.check_backend(backend)
    deterministic = resolve_deterministic(deterministic)
    q = inputs.q
    precision = "tf32" if q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" else "torch"
        why = f"auto: {q.device.type} tensors"
    else:
        why = f"backend={backend!r} requested"
    if backend == "torch":
        problem = FwdProblem(inputs.softmax_scale, inputs.window_left, inputs.window_right, inputs.bottom_right,
                             "ieee", False)
        return Plan("torch", TORCH_KERNEL, None, problem, (), why + "; exact tiled torch forward",
                    (torch_backend.DEFAULT_BLOCK_M, torch_backend.DEFAULT_BLOCK_N), bwd_kernel=TORCH_BWD_KERNEL,
                    deterministic=True)
    if q.device.type != "cuda" and not interpreted():
        raise ValueError(f"backend='triton' needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 set before import")
    batch = inputs.cu_seqlens_q.numel() - 1 if inputs.varlen else q.shape[0]
    if batch * q.shape[-2] > MAX_GRID_Y:
        raise ValueError(f"batch x query heads ({batch} x {q.shape[-2]}) exceeds {MAX_GRID_Y}, the second grid "
                         "dimension of the Triton kernels: split the batch into several calls")
    capability = device_capability(q.device)
    causal = inputs.window_right == 0 and inputs.window_left < 0
    if config is None:
        config, source = tuned_config(q.shape[-1], q.dtype, causal, capability, inputs.max_seqlen_q)
        if capability is not None:
            config, note = _fit_shared_memory(config, inputs)
            source += note
    else:
        source = "explicit config from the caller"
    unusable = (("q", _descriptor_ready(inputs.q)), ("k", _descriptor_ready(inputs.k)), ("v", _descriptor_ready(inputs.v)))
    copies = tuple((name, issue) for name, issue in unusable if issue)
    pack_gqa = _pack_gqa(inputs, config)
    problem = FwdProblem(inputs.softmax_scale, inputs.window_left, inputs.window_right, inputs.bottom_right,
                         precision, pack_gqa)
    if bwd_config is None:
        bwd_config, bwd_source = tuned_bwd_config(q.shape[-1], q.dtype, capability)
    else:
        bwd_source = "backward: explicit config from the caller"
    return Plan("triton", TRITON_KERNEL, config, problem, copies, f"{why}; {source}; {bwd_source}",
                bwd_kernel=TRITON_BWD_KERNEL, bwd_config=bwd_config, deterministic=deterministic,
                upcast=interpreter_upcast(q.dtype))


def describe_inputs(inputs: AttentionInputs) -> str:
    q, k = inputs.q, inputs.k
    mask = "none" if inputs.attn_mask is None else ("bool" if inputs.attn_mask.dtype == torch.bool else "additive")
    kind = "varlen" if inputs.varlen else "dense"
    return f"{kind} {q.dtype} D={q.shape[-1]} Hq={q.shape[-2]} Hkv={k.shape[-2]} mask={mask} on {q.device.type}"


_LOGGED: set[tuple] = set()


def log_once(inputs: AttentionInputs, chosen: Plan) -> None:
    """IOATTN_LOG=1: log each distinct (inputs signature, plan) once on the "ioattn" logger."""
    if os.environ.get("IOATTN_LOG", "0") != "1":
        return
    key = (describe_inputs(inputs), str(chosen))
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(logging.StreamHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.info("ioattn dispatch: %s\n%s", key[0], chosen)


def explain(q, k, v, *, api: str | None = None, backend: str = "auto", **kwargs) -> Plan:
    """The plan a call with these arguments would run (nothing runs). str() of the result reads well.

    `api` is "flash_attn" (q/k/v (B, N, H, D); kwargs of flash_attn_func), "varlen" (packed; kwargs of
    flash_attn_varlen_func), "sdpa" ((B, H, N, D); kwargs of sdpa) or "paged" (k, v are the caches; kwargs of
    paged_attention: block_table, seq_lens, ...; returns the `PagedPlan`). When omitted it is inferred: paged when
    block_table is given, varlen when cu_seqlens_q is given, sdpa when any of attn_mask / is_causal / scale /
    enable_gqa is given.
    """
    if api is None and "block_table" in kwargs:
        api = "paged"
    if api == "paged":
        from ioattn.ops.paged import explain_paged

        if backend != "auto":
            raise ValueError(f"backend={backend!r}: paged attention has one implementation (leave backend='auto')")
        missing = [name for name in ("block_table", "seq_lens") if name not in kwargs]
        if missing:
            raise ValueError(f"api='paged' needs {' and '.join(missing)} (the arguments of paged_attention)")
        return explain_paged(q, k, v, **kwargs)
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
        raise ValueError(f"api must be one of 'flash_attn', 'varlen', 'sdpa', 'paged' (or None to infer), got {api!r}")
    if kwargs:
        raise ValueError(f"unexpected keyword arguments for api={api!r}: {sorted(kwargs)}")
    return plan(inputs, backend, deterministic=deterministic)
