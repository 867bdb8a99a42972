"""FP8 attention forward (FlashAttention-3's recipe): Q·Kᵀ and P·V both run on e4m3 operands with fp32
accumulation, for inference.

Two ways in, both through `flash_attn_fp8_func`:
- 16-bit q, k, v: quantized here to e4m3 with one float32 scale per `scale_block` positions of each head (amax
  of the block / 448, so the block's largest element lands on e4m3's largest); with `hadamard=True`, Q and K are
  first rotated by the same signed Hadamard matrix M / sqrt(D) (`ioattn.ops.fp8.kv_rotation`), which leaves every
  score q·k unchanged and spreads an outlier channel over all of them before rounding (incoherent processing).
- e4m3 q, k, v already quantized, with flash-attn 3's `q_descale`, `k_descale`, `v_descale`: float32
  (batch, num_heads_k), one scale per sequence and KV head (`q_descale` applies to the KV head's query group).

Both kernels (below) multiply each score tile by its row's Q scale and the tile's K scale, round the
probabilities to e4m3 after x 256, and add each tile's P·V, computed in a fresh accumulator, to the fp32 output
with the tile's V scale (two-level accumulation, so no fp8 accumulation spans more than one tile). Error: the
inputs' rounding, plus the probabilities' (3 mantissa bits: a few percent of the output on random data, as in
FlashAttention-3); `quantization_error` reports both against float64.

Kernels: on sm_90 (full or causal) the warp-specialized Gluon forward (`ioattn.kernels.gluon_fwd`, FP8 mode; auto
takes it at D 64 and 128: FP8_GLUON_AUTO, FP8_GLUON_AUTO_HEAD_DIMS), else the Triton forward; V is handed to both
transposed (keys contiguous: fp8 wgmma reads only K-major operands; for the Gluon kernel's P from registers, its
keys permuted: KEY_ORDER).
Speed (an H100, e4m3 inputs, bench/results/2026-12-08-fp8-dims-h100): at D 128 1.12-1.39x our bf16 forward at N
4k-16k (49-66% of the e4m3 matmul ceiling); at D 64 0.67-0.78x and at D 256 (the Triton kernel) 0.50-0.54x: there
fp8 is slower than bf16.

Supported: the dense layout (B, N, H, D), D in 64, 128, 256, GQA, causal and windows (bottom-right), no
gradient. CUDA needs compute capability 8.9+ (fp8 tensor cores); on the CPU the same kernel runs under Triton's
interpreter (whose fp8 products are exact). Anything else raises a ValueError naming the argument.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import triton

from ioattn.kernels import interpreted
from ioattn.ops import checks
from ioattn.ops.capability import HOPPER, device_capability
from ioattn.ops.forward import FwdConfig, FwdProblem, launch_prefill_fwd, tuned_config
from ioattn.ops.fp8 import FP8_MIN_CAPABILITY, fp8_max, kv_rotation

FP8_FORWARD_DTYPE = torch.float8_e4m3fn
FP8_HEAD_DIMS = (64, 128, 256)
DEFAULT_SCALE_BLOCK = 128
# Scale blocks are whole K/V tiles of the kernel: the Triton kernel's BLOCK_N is at most 128; a Gluon config with
# 256-key tiles needs scale blocks of a multiple of 256 (`scale_block`; e4m3 inputs have one block per sequence).
SCALE_BLOCK_MULTIPLE = 128
FP8_GLUON_BLOCK_N = (64, 128, 256)


def hadamard_rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """The orthogonal float32 (D, D) matrix M / sqrt(D) that Q and K are rotated by (D a power of two)."""
    return (kv_rotation(head_dim) / math.sqrt(head_dim)).to(device)


def quantize_blocks(x: torch.Tensor, block: int, rotation: torch.Tensor | None = None, *, transpose: bool = False,
                    permute_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, H, D) 16-bit -> (e4m3 codes (B, N, H, D), float32 scales (B, H, ceil(N / block))), rotated first
    when `rotation` is given: each block of `block` positions of a head divided by its amax / 448, rounded to
    nearest even. An all-zero block gets scale 1; a NaN stays NaN (its block's scale too). transpose: the codes
    as `transposed` lays them out (B, H, D, whole blocks; zeros past N), written in the one pass, with
    permute_keys in `KEY_ORDER` (block a multiple of 16)."""
    batch, n, heads, dim = x.shape
    values = x.float() if rotation is None else x.float() @ rotation
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(values, (0, 0, 0, 0, 0, blocks * block - n)).view(batch, blocks, block, heads, dim)
    amax = padded.abs().amax(dim=(2, 4))  # (B, blocks, H)
    limit = fp8_max(FP8_FORWARD_DTYPE)
    scales = torch.where(amax > 0, amax / limit, torch.where(amax.isnan(), amax, 1.0))
    scaled = padded / scales[:, :, None, :, None]
    clamped = torch.where(scaled.isnan(), scaled, scaled.clamp(-limit, limit))
    if transpose and permute_keys:  # (B, blocks, groups, b, t, e, H, D) -> (B, H, D, blocks, groups, t, b, e)
        grouped = clamped.view(batch, blocks, block // 16, 2, 4, 2, heads, dim)
        codes = grouped.permute(0, 6, 7, 1, 2, 4, 3, 5).reshape(batch, heads, dim, blocks * block)
        codes = codes.to(FP8_FORWARD_DTYPE)
    elif transpose:  # (B, blocks, block, H, D) -> (B, H, D, blocks x block)
        codes = clamped.permute(0, 3, 4, 1, 2).reshape(batch, heads, dim, blocks * block).to(FP8_FORWARD_DTYPE)
    else:
        codes = clamped.to(FP8_FORWARD_DTYPE).view(batch, blocks * block, heads, dim)[:, :n]
    return codes.contiguous(), scales.permute(0, 2, 1).contiguous()


def quantize_per_head(x: torch.Tensor, heads_per_scale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, H, D) -> (e4m3 codes (B, N, H, D), float32 descales (B, H / heads_per_scale)): flash-attn 3's
    inputs, one scale per sequence and group of `heads_per_scale` heads (Q: its KV head's query group), amax / 448
    (1 for an all-zero group), rounded to nearest even, saturated."""
    batch, n, heads, dim = x.shape
    if heads_per_scale < 1 or heads % heads_per_scale:
        raise ValueError(f"heads_per_scale must divide the {heads} heads, got {heads_per_scale}")
    groups = heads // heads_per_scale
    limit = fp8_max(FP8_FORWARD_DTYPE)
    grouped = x.float().reshape(batch, n, groups, heads_per_scale * dim)
    amax = grouped.abs().amax(dim=(1, 3)) if n else torch.zeros(batch, groups, device=x.device)
    scales = torch.where(amax > 0, amax / limit, torch.where(amax.isnan(), amax, 1.0))
    scaled = grouped / scales[:, None, :, None]
    codes = torch.where(scaled.isnan(), scaled, scaled.clamp(-limit, limit)).to(FP8_FORWARD_DTYPE)
    return codes.reshape(batch, n, heads, dim), scales


# The Gluon kernel's P·V (P from registers, `ioattn.kernels.gluon_fwd._fp8_operand`) takes the keys of each group of
# 16 in this order: position 4t + 2b + e holds key 8b + 2t + e.
KEY_ORDER = tuple(8 * b + 2 * t + e for t in range(4) for b in range(2) for e in range(2))


def transposed(codes: torch.Tensor, permute_keys: bool = False) -> torch.Tensor:
    """V's codes (B, N, H, D) as (B, H, D, N') with N' the next multiple of 16 (a tensor descriptor's row stride is
    16-byte aligned), keys contiguous: the operand layout of the kernel's fp8 P·V; with permute_keys, each group of
    16 keys in `KEY_ORDER` (zeros past N). One launch of `transpose_keys_kernel` (D contiguous)."""
    from ioattn.kernels.fp8_layout import transpose_keys_kernel

    batch, n, heads, dim = codes.shape
    width = -(-n // 16) * 16
    out = torch.empty(batch, heads, dim, width, dtype=codes.dtype, device=codes.device)
    if out.numel() == 0:
        return out
    if codes.stride(3) != 1:
        codes = codes.contiguous()
    block = 128 if width >= 128 else 16
    src, dst = codes.view(torch.uint8), out.view(torch.uint8)
    transpose_keys_kernel[(triton.cdiv(width, block) * batch * heads,)](
        src, dst, n, heads, width, src.stride(0), src.stride(1), src.stride(2), HEAD_DIM=dim, BLOCK_K=block,
        PERMUTE=permute_keys, num_warps=4)
    return out


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The float64 values e4m3 codes (B, N, H, D) with scales (B, H, blocks) stand for."""
    per_position = scales.double().repeat_interleave(block, dim=2)[:, :, : codes.shape[1]]  # (B, H, N)
    return codes.double() * per_position.permute(0, 2, 1)[..., None]


def fp8_config(head_dim: int, causal: bool, capability, n_q: int) -> FwdConfig:
    """Hopper: 64 query rows x 128 keys, one warpgroup, up to D 128 (the fastest of six tiles on every D 128 row,
    bench/results/2026-12-06-fp8-forward-h100/); D 256: 128 x 64 over two warpgroups (it spills in every sm_90
    build tried); elsewhere the 16-bit forward's entry."""
    if capability == HOPPER:
        return FwdConfig(64, 128, 4, 3) if head_dim <= 128 else FwdConfig(128, 64, 8, 2)
    return tuned_config(head_dim, torch.bfloat16, causal, capability, n_q)[0]


FP8_BACKENDS = ("auto", "triton", "gluon")
# auto takes the Gluon kernel at D 128, where an H100 measured it 1.01-1.19x the Triton one at N 4k-16k, causal and
# not, but 0.97x at 4k causal (bench/results/2026-12-07-snake-fp8-regs-h100), and at D 64, where it has not yet
# been timed against the Triton one; D 256 (column quarters) takes it only with backend="gluon" until measured
FP8_GLUON_AUTO = True
FP8_GLUON_AUTO_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class FP8Plan:
    """What `flash_attn_fp8_func` runs for a call (`ioattn.explain(..., api="fp8")` returns it)."""

    kernel: str  # "gluon" (warp-specialized, sm_90) or "triton"
    config: object  # GluonConfig or FwdConfig
    reason: str
    scales: str
    softmax_scale: float
    window: tuple[int, int]  # (left, right), -1 unbounded, bottom-right

    def __str__(self) -> str:
        kernel = ("ioattn.kernels.gluon_fwd.gluon_fwd_kernel (FP8 mode)" if self.kernel == "gluon"
                  else "ioattn.kernels.prefill_fwd.prefill_fwd_kernel (FP8=True)")
        p_path, p_scale = "", "256"
        if self.kernel == "gluon":
            p_scale = f"2**{8 - self.config.rescale_threshold:g}"
            p_path = (", P through shared memory" if self.config.fp8_p_shared
                      else ", P from registers (V's keys permuted in groups of 16)")
        return (f"fp8 forward: {kernel} {self.config}; {self.reason}; scales: {self.scales}; e4m3 Q·Kᵀ and P·V "
                f"(P x {p_scale} rounded to e4m3{p_path}), two-level accumulation; window {self.window}")


def plan_fp8(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, *, q_descale=None, k_descale=None,
             v_descale=None, hadamard=False, scale_block=DEFAULT_SCALE_BLOCK, config: FwdConfig | None = None,
             backend="auto") -> FP8Plan:
    """Check a `flash_attn_fp8_func` call (ValueError naming the argument) and choose its kernel."""
    fp8_inputs = q.dtype == FP8_FORWARD_DTYPE if isinstance(q, torch.Tensor) else False
    _check_inputs(q, k, v, fp8_inputs, q_descale, k_descale, v_descale, hadamard, scale_block)
    if backend not in FP8_BACKENDS:
        raise ValueError(f"backend must be one of {FP8_BACKENDS}, got {backend!r}")
    gluon_config = _gluon_config_or_none(config, backend)
    if gluon_config is None and config is not None and (not isinstance(config, FwdConfig)
                                                         or SCALE_BLOCK_MULTIPLE % config.block_n):
        raise ValueError(f"config must be a FwdConfig whose block_n divides {SCALE_BLOCK_MULTIPLE} (or a GluonConfig "
                         f"with backend='gluon'), got {config!r}")
    window = checks.unbounded_past(checks.normalized_window(window_size, causal), q.shape[1] + k.shape[1])
    scale = checks.softmax_scale_or_default(softmax_scale, q.shape[3])
    if not scale > 0:
        raise ValueError(f"softmax_scale must be > 0 with fp8 attention, got {scale}")
    dim = q.shape[3]
    scales = ("one per (sequence, KV head): q_descale / k_descale / v_descale" if fp8_inputs else
              f"one per {scale_block} positions of each head, quantized here"
              + (" after the signed Hadamard rotation of Q and K" if hadamard else ""))
    why_not = _why_not_gluon(q.device, dim, window, config if gluon_config is None else None, gluon_config)
    if backend == "gluon" and why_not:
        raise ValueError(f"backend='gluon' cannot take this call: {why_not}")
    auto_gluon = backend == "auto" and FP8_GLUON_AUTO and dim in FP8_GLUON_AUTO_HEAD_DIMS
    if why_not is None and (backend == "gluon" or auto_gluon):
        from ioattn.ops.gluon_forward import fp8_gluon_config

        chosen = gluon_config or fp8_gluon_config(dim)
        if not fp8_inputs and scale_block % chosen.block_n:
            raise ValueError(f"scale_block={scale_block} must be a multiple of the Gluon config's block_n "
                             f"({chosen.block_n}): each K/V tile takes one scale")
        return FP8Plan("gluon", chosen, f"backend={backend!r}: sm_90, D {dim}, "
                       f"{'causal' if window[1] == 0 else 'full'} attention"
                       + ("" if gluon_config is None else "; config= given"), scales, scale, window)
    if backend == "triton":
        reason = "backend='triton'"
    elif why_not is not None:
        reason = f"the Gluon kernel does not take it: {why_not}"
    elif not FP8_GLUON_AUTO:
        reason = "auto: the Gluon kernel is switched off (FP8_GLUON_AUTO)"
    else:
        reason = (f"auto: at head dim {dim} the Gluon kernel is not measured faster than the Triton one "
                  f"(FP8_GLUON_AUTO_HEAD_DIMS {FP8_GLUON_AUTO_HEAD_DIMS}; backend='gluon' takes it)")
    chosen = config or fp8_config(dim, window[1] == 0, device_capability(q.device), q.shape[1])
    return FP8Plan("triton", chosen, reason + ("" if config is None else "; config= given"), scales, scale, window)


def flash_attn_fp8_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, return_lse=False, *,
                        q_descale=None, k_descale=None, v_descale=None, hadamard=False,
                        scale_block=DEFAULT_SCALE_BLOCK, config: FwdConfig | None = None, backend="auto"):
    """FP8 attention forward with flash-attn's dense layout: q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D), causal and
    window_size bottom-right as in `flash_attn_func`. q, k, v either all 16-bit (quantized here per
    `scale_block` positions of each head, a multiple of 128; `hadamard=True` rotates Q and K first; output in
    q's dtype) or all float8_e4m3fn with q_descale / k_descale / v_descale float32 (B, Hkv) (output bfloat16;
    their values must be finite and > 0, read once per tensor and in-place version: a tensor rewritten by a raw
    kernel store, which torch's version counter does not see, is not read again). Returns out, or (out, lse) with
    lse float32 natural log (B, Hq, Nq). Inference only: no gradient.
    config: a FwdConfig for the Triton launch (block_n a divisor of 128), else `fp8_config`'s; or with
    backend="gluon" a GluonConfig (`ioattn.ops.gluon_forward`) for the Gluon one. backend: "gluon"
    (sm_90: the warp-specialized kernel; full or causal attention), "triton", or "auto" (Gluon where it takes
    the call, at D 64 and 128). `ioattn.explain(q, k, v, api="fp8", ...)` says which runs and why."""
    chosen = plan_fp8(q, k, v, causal, window_size, softmax_scale, q_descale=q_descale, k_descale=k_descale,
                      v_descale=v_descale, hadamard=hadamard, scale_block=scale_block, config=config,
                      backend=backend)
    batch, n_q, heads_q, dim = q.shape
    n_k, heads_kv = k.shape[1], k.shape[2]
    permute_keys = chosen.kernel == "gluon" and not chosen.config.fp8_p_shared  # P·V from registers
    if q.dtype == FP8_FORWARD_DTYPE:
        out_dtype = torch.bfloat16
        # One scale per sequence: a single block spanning both lengths, a whole number of kernel tiles.
        tile = max(SCALE_BLOCK_MULTIPLE, chosen.config.block_n if chosen.kernel == "gluon" else 0)
        block = max(tile, -(-max(n_q, n_k) // tile) * tile)
        group = heads_q // heads_kv
        # (B, Hq, 1) and (B, Hkv, 1) contiguous copies of the descales (the kernels index them as such), each query
        # head reading its KV head's. An expanded view would not do: under MQA it reshapes with a head stride of 0
        q_scales = q_descale.repeat_interleave(group, dim=1)[..., None]
        k_scales, v_scales = k_descale[..., None].contiguous(), v_descale[..., None].contiguous()
        q_codes, k_codes, v_codes = q.contiguous(), k.contiguous(), transposed(v, permute_keys)
    else:
        out_dtype, block = q.dtype, scale_block
        rotation = hadamard_rotation(dim, q.device) if hadamard else None
        q_codes, q_scales = quantize_blocks(q, block, rotation)
        k_codes, k_scales = quantize_blocks(k, block, rotation)
        v_codes, v_scales = quantize_blocks(v, block, transpose=True, permute_keys=permute_keys)
    # Triton's interpreter stores bfloat16 by truncation: it writes float32 there, rounded to nearest by torch.
    kernel_dtype = torch.float32 if interpreted() and out_dtype == torch.bfloat16 else out_dtype
    out = torch.empty(batch, n_q, heads_q, dim, dtype=kernel_dtype, device=q.device)
    lse = torch.empty(batch, heads_q, n_q, dtype=torch.float32, device=q.device)
    scales = (q_scales, k_scales, v_scales, block)
    if n_k == 0:  # no keys: every row is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
    elif n_q > 0 and batch > 0 and chosen.kernel == "gluon":
        from ioattn.ops.gluon_forward import gluon_forward_fp8

        gluon_forward_fp8(q_codes, k_codes, v_codes, scales, causal=chosen.window[1] == 0,
                          softmax_scale=chosen.softmax_scale, out=out, lse=lse, config=chosen.config)
    elif n_q > 0 and batch > 0:
        problem = FwdProblem(softmax_scale=chosen.softmax_scale, window_left=chosen.window[0],
                             window_right=chosen.window[1], bottom_right=True, input_precision="ieee",
                             pack_gqa=False)
        launch_prefill_fwd(q_codes, k_codes, v_codes, out, lse, problem, chosen.config, fp8_scales=scales)
    out = out.to(out_dtype)
    return (out, lse) if return_lse else out


def _why_not_gluon(device: torch.device, head_dim: int, window: tuple[int, int], config, gluon_config) -> str | None:
    """Why the warp-specialized kernel cannot take the call (it takes sm_90, full or causal attention, its own
    tiles; beyond D 128 only the serial key loop), or None."""
    from ioattn.ops.gluon_forward import fp8_gluon_config

    if device_capability(device) != HOPPER:
        return f"it runs on sm_90 only ({device})"
    if head_dim > 128 and (gluon_config or fp8_gluon_config(head_dim)).overlap:
        return (f"head dim {head_dim} with overlap=True: O and each tile's P·V (two 64 x {head_dim} fp32 "
                "accumulators) spill at the consumers' registers; beyond D 128 the config needs overlap=False")
    if window[0] >= 0 or window[1] not in (-1, 0):
        return "it takes full or causal attention only, not a window"
    if config is not None:
        return "config= sets the Triton kernel's tiles"
    return None


def _gluon_config_or_none(config, backend):
    """config when it is a GluonConfig for the Gluon kernel (backend='gluon' only; its block_n must divide the
    scale blocks and rescale_threshold be at most FP8_MAX_RESCALE_THRESHOLD), else None."""
    from ioattn.ops.gluon_forward import FP8_MAX_RESCALE_THRESHOLD, GluonConfig

    if not isinstance(config, GluonConfig):
        return None
    if backend != "gluon":
        raise ValueError(f"config: a GluonConfig needs backend='gluon', got backend={backend!r}")
    if config.block_n not in FP8_GLUON_BLOCK_N or not 0 <= config.rescale_threshold <= FP8_MAX_RESCALE_THRESHOLD:
        raise ValueError(f"config must have block_n in {FP8_GLUON_BLOCK_N} and rescale_threshold in "
                         f"0..{FP8_MAX_RESCALE_THRESHOLD} for the fp8 forward, got {config!r}")
    return config


class _CheckedTensors:
    """Tensors whose values passed a check, by identity and torch's in-place version counter (`Tensor._version`),
    so that a tensor passed again unchanged (static, calibrated descales) is not read again: reading values from
    the GPU waits for all queued work. Writes that bypass torch's counter (a kernel's raw stores) go unseen."""

    def __init__(self):
        self._seen: dict[int, tuple[weakref.ref, int]] = {}

    def holds(self, t: torch.Tensor) -> bool:
        entry = self._seen.get(id(t))
        return entry is not None and entry[0]() is t and entry[1] == t._version

    def add(self, t: torch.Tensor) -> None:
        key = id(t)
        self._seen[key] = (weakref.ref(t, lambda _, key=key: self._seen.pop(key, None)), t._version)


_CHECKED_DESCALES = _CheckedTensors()


def _check_inputs(q, k, v, fp8_inputs, q_descale, k_descale, v_descale, hadamard, scale_block) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t)
        checks.check_ndim(name, t, 4, "(batch, seqlen, nheads, headdim)")
        if t.requires_grad:
            raise ValueError(f"{name} requires grad: the fp8 forward is for inference (no backward); use "
                             "flash_attn_func to train")
    allowed = (FP8_FORWARD_DTYPE,) if fp8_inputs else (torch.float16, torch.bfloat16)
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in allowed or t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype ({q.dtype}): q, k and v are all float16 / bfloat16 "
                             f"(quantized here) or all float8_e4m3fn (with descales), got {t.dtype}")
    if q.dtype not in (FP8_FORWARD_DTYPE, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be float16, bfloat16 or float8_e4m3fn for the fp8 forward, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all must be on one device")
    if q.shape[0] != k.shape[0] or k.shape != v.shape or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, and "
                         "share q's batch and head dim")
    if q.shape[3] not in FP8_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[3]} is not supported by the fp8 forward: one of {FP8_HEAD_DIMS}")
    checks.check_heads(q.shape[2], k.shape[2])
    if q.device.type == "cuda":
        capability = device_capability(q.device)
        if capability < FP8_MIN_CAPABILITY:
            raise ValueError(f"q: the fp8 forward needs fp8 tensor cores (compute capability 8.9+); {q.device} has "
                             f"{'.'.join(map(str, capability))}")
    elif not interpreted():
        raise ValueError(f"q is on {q.device}: the fp8 forward runs on CUDA, or on the CPU under Triton's "
                         "interpreter (TRITON_INTERPRET=1)")
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if fp8_inputs:
        if hadamard:
            raise ValueError("hadamard=True rotates 16-bit inputs before quantizing them; q, k, v are already e4m3")
        shape = (q.shape[0], k.shape[2])
        for name, t in descales.items():
            if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape
                    or t.device != q.device):
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
                raise ValueError(f"{name} must be a float32 tensor (batch, num_heads_k) = {shape} on {q.device} "
                                 f"with e4m3 inputs, got {got}")
        unchecked = {name: t for name, t in descales.items() if not _CHECKED_DESCALES.holds(t)}
        if unchecked:  # reading the values waits for the GPU: once per tensor and version, for all of them at once
            stacked = torch.stack(list(unchecked.values()))
            good = ((stacked > 0) & stacked.isfinite()).flatten(1).all(1).tolist()
            for (name, t), ok in zip(unchecked.items(), good):
                if not ok:
                    raise ValueError(f"{name} must hold finite scales > 0")
                _CHECKED_DESCALES.add(t)
        return
    for name, t in descales.items():
        if t is not None:
            raise ValueError(f"{name} applies to float8_e4m3fn inputs only; q is {q.dtype} (quantized here)")
    if type(hadamard) is not bool:
        raise ValueError(f"hadamard must be True or False, got {hadamard!r}")
    if not checks.is_int(scale_block) or scale_block < SCALE_BLOCK_MULTIPLE or scale_block % SCALE_BLOCK_MULTIPLE:
        raise ValueError(f"scale_block must be a positive multiple of {SCALE_BLOCK_MULTIPLE} positions, got "
                         f"{scale_block!r}")


def quantization_error(q, k, v, *, causal=False, hadamard=False, scale_block=DEFAULT_SCALE_BLOCK) -> dict:
    """Relative Frobenius errors of the fp8 forward on 16-bit q, k, v against float64 attention on the original
    inputs (`total`) and on the dequantized ones (`kernel`: what the kernel adds, the probabilities' rounding),
    plus the RMSE against the original reference (FlashAttention-3's figure)."""
    out = flash_attn_fp8_func(q, k, v, causal=causal, hadamard=hadamard, scale_block=scale_block).double()
    rotation = hadamard_rotation(q.shape[3], q.device) if hadamard else None
    deq = [dequantize_blocks(*quantize_blocks(t, scale_block, rot), scale_block)
           for t, rot in ((q, rotation), (k, rotation), (v, None))]
    exact = _reference(q.double(), k.double(), v.double(), causal)
    on_dequantized = _reference(*deq, causal)
    return {"total": float((out - exact).norm() / exact.norm()),
            "kernel": float((out - on_dequantized).norm() / on_dequantized.norm()),
            "rmse": float((out - exact).pow(2).mean().sqrt())}


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """float64 attention, (B, N, H, D), GQA by repetition, causal bottom-right."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = (t.repeat_interleave(group, 2).transpose(1, 2) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[3])
    if causal:
        n_q, n_k = q.shape[1], k.shape[1]
        visible = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
        scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.nan_to_num(torch.softmax(scores, -1)) @ vh).transpose(1, 2)
