"""Backend selection, the tuned tile table, and the diagnostics that make every choice visible.

backend="auto" picks the Triton kernel for CUDA tensors (on sm_90 the Gluon warp-specialized forward where it
takes the call and `GLUON_FASTER` says it was measured faster) and the torch backend for CPU tensors: torch's
own CPU SDPA kernel where its semantics match exactly, else the exact tiled torch forward
(`ioattn.ops.torch_backend` says which calls take which; the plan's kernel and reason name the one chosen and why).
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
from ioattn.ops import checks, torch_backend, torch_backward
from ioattn.ops.backward import BwdConfig, deterministic_default, tuned_bwd_config
from ioattn.ops.capability import MAX_GRID_Y, device_capability, interpreter_upcast
from ioattn.ops.forward import FwdConfig, FwdProblem, fit_shared_memory, tuned_config
from ioattn.ops import gluon_forward
from ioattn.ops.checks import AttentionInputs

logger = logging.getLogger("ioattn")

TRITON_KERNEL = "ioattn.kernels.prefill_fwd.prefill_fwd_kernel"
TORCH_KERNEL = "ioattn.ops.torch_backend.attention_forward"
TORCH_SDPA_KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu (torch's CPU SDPA, via torch_backend.sdpa_forward)"
TRITON_BWD_KERNEL = ("ioattn.kernels.prefill_bwd.attention_bwd_dq_kernel (with the row statistics), then "
                     "attention_bwd_dkdv_kernel (launched by ioattn.ops.backward.attention_bwd)")
TORCH_BWD_KERNEL = "ioattn.ops.torch_backward.attention_bwd_torch"
GLUON_KERNEL = ("ioattn.kernels.gluon_fwd.gluon_fwd_kernel (sm_90 warp-specialized: a TMA producer warp, two or "
                "three consumer warpgroups, ping-pong or not as its tiles say)")
@dataclasses.dataclass(frozen=True)
class Plan:
    """What a call will run and why; str() is the human-readable explanation."""

    backend: str  # "triton" | "gluon" | "torch"
    kernel: str
    config: FwdConfig | gluon_forward.GluonConfig | None  # the kernel's tiles (None for the torch backend)
    problem: FwdProblem
    copies: tuple[tuple[str, str], ...]  # (input name, why) for inputs copied to contiguous before the kernel
    reason: str
    torch_tiles: tuple[int, int] | None = None  # (block_m, block_n) of the tiled torch forward (None: torch's SDPA)
    bwd_kernel: str = ""
    bwd_config: BwdConfig | None = None  # Triton backward tiles (None for the torch backend)
    deterministic: bool = False  # the backward avoids atomics and is bitwise reproducible
    # Triton's CPU interpreter computes bf16 tl.dot wrongly (errors ~1e8): the kernels run on float32 copies.
    upcast: bool = False

    def __str__(self) -> str:
        if self.config is not None:
            tiles = str(self.config)
        elif self.torch_tiles is not None:
            tiles = f"BLOCK_M={self.torch_tiles[0]} BLOCK_N={self.torch_tiles[1]}"
        else:
            tiles = "chosen by torch's CPU SDPA kernel"
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


def resolve_deterministic(deterministic) -> bool:
    """None (the default) means deterministic when IOATTN_DETERMINISTIC=1 or
    torch.use_deterministic_algorithms(True) is in effect."""
    if deterministic is None:
        return deterministic_default() or torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be True, False or None (IOATTN_DETERMINISTIC / "
                         f"torch.are_deterministic_algorithms_enabled()), got {deterministic!r}")
    return deterministic


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


def gluon_unsupported(inputs: AttentionInputs, capability: tuple[int, int] | None) -> str | None:
    """Why the Gluon forward cannot take this call (None when it can)."""
    if capability is None or capability[0] != 9:
        return f"it is sm_90 only (this device: {'CPU' if capability is None else 'sm_%d%d' % capability})"
    if inputs.attn_mask is not None:
        return "it takes no attn_mask"
    if inputs.k_descale is not None or inputs.v_descale is not None:
        return "it takes no fp8 descales"
    bounded = inputs.window_left >= 0 or inputs.window_right >= 0
    if bounded and not inputs.bottom_right and inputs.q.shape[1] != inputs.k.shape[1]:
        return "its causal mask and windows are aligned bottom-right, this call's top-left with Nq != Nk"
    if not inputs.softmax_scale > 0.0:
        return f"it takes a positive softmax_scale only, got {inputs.softmax_scale}"
    if inputs.varlen:  # packed (total, H, D): the kernel sees them as one (1, total, H, D) batch
        return gluon_forward.tensors_unsupported(*(t.unsqueeze(0) for t in (inputs.q, inputs.k, inputs.v)))
    return gluon_forward.tensors_unsupported(inputs.q, inputs.k, inputs.v)


def plan(inputs: AttentionInputs, backend: str = "auto", config: FwdConfig | None = None,
         deterministic: bool | None = None, bwd_config: BwdConfig | None = None) -> Plan:
    """Choose backend and tiles; an explicit `config` / `bwd_config` (tuning, benchmarks) replaces the table
    lookup of the forward / backward."""
    checks.check_backend(backend, checks.ATTENTION_BACKENDS)
    deterministic = resolve_deterministic(deterministic)
    q = inputs.q
    precision = "tf32" if q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    auto = backend == "auto"
    if auto:
        backend = "triton" if q.device.type == "cuda" else "torch"
        why = f"auto: {q.device.type} tensors"
    else:
        why = f"backend={backend!r} requested"
    if backend == "torch":
        problem = FwdProblem(inputs.softmax_scale, inputs.window_left, inputs.window_right, inputs.bottom_right,
                             "ieee", False)
        mismatch = torch_backend.sdpa_mismatch(inputs)
        if mismatch is None:
            return Plan("torch", TORCH_SDPA_KERNEL, None, problem, (),
                        f"{why}; torch's CPU SDPA kernel, exact here ({torch_backend.sdpa_case(inputs)}; LSE from it)",
                        bwd_kernel=TORCH_BWD_KERNEL, deterministic=True)
        return Plan("torch", TORCH_KERNEL, None, problem, (), f"{why}; exact tiled torch forward (not torch's "
                    f"SDPA: {mismatch})", (torch_backend.DEFAULT_BLOCK_M, torch_backend.DEFAULT_BLOCK_N),
                    bwd_kernel=TORCH_BWD_KERNEL, deterministic=True)
    if q.device.type != "cuda" and not interpreted():
        raise ValueError(f"backend={backend!r} needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 set before "
                         "import")
    batch = inputs.cu_seqlens_q.numel() - 1 if inputs.varlen else q.shape[0]
    if batch * q.shape[-2] > MAX_GRID_Y:
        raise ValueError(f"batch x query heads ({batch} x {q.shape[-2]}) exceeds {MAX_GRID_Y}, the second grid "
                         "dimension of the Triton kernels: split the batch into several calls")
    capability = device_capability(q.device)
    causal = inputs.window_right == 0 and inputs.window_left < 0
    if bwd_config is None:
        bwd_config, bwd_source = tuned_bwd_config(q.shape[-1], q.dtype, capability)
    else:
        bwd_source = "backward: explicit config from the caller"
    if backend == "gluon" or (auto and capability is not None and capability[0] == 9):
        unsupported = gluon_unsupported(inputs, capability)
        if backend == "gluon" and unsupported:
            raise ValueError(f"backend='gluon' cannot take this call: {unsupported}")
        if backend == "gluon" and config is not None:
            raise ValueError(f"config is a Triton forward configuration ({config}); backend='gluon' takes none")
        windowed = inputs.window_left >= 0 or inputs.window_right > 0
        unmeasured = "sliding windows" if windowed else "varlen batches" if inputs.varlen else None
        faster = None if unsupported or unmeasured else gluon_forward.gluon_faster(q.shape[-1], causal, q.shape[1],
                                                                                   inputs.k.shape[1])
        if backend == "gluon" or (faster and config is None):
            problem = FwdProblem(inputs.softmax_scale, inputs.window_left, inputs.window_right, True, "ieee", False)
            masked = inputs.window_left >= 0 or inputs.window_right >= 0  # causal is window_right 0
            return Plan("gluon", GLUON_KERNEL, gluon_forward.gluon_config(q.shape[-1], masked), problem, (),
                        f"{why}; {faster or 'the Gluon forward as asked'}; {bwd_source} (the Triton backward)",
                        bwd_kernel=TRITON_BWD_KERNEL, bwd_config=bwd_config, deterministic=deterministic)
        if unsupported:
            not_gluon = unsupported
        elif unmeasured:
            not_gluon = f"{unmeasured} not measured on it (GLUON_FASTER)"
        elif gluon_forward.GLUON_FASTER:
            not_gluon = "not measured faster for this shape (GLUON_FASTER)"
        else:
            not_gluon = "not measured since its 2026-12-06 rewrite (GLUON_FASTER is empty)"
        why += f"; not the Gluon forward: {not_gluon}"
    if config is None:
        config, source = tuned_config(q.shape[-1], q.dtype, causal, capability, inputs.max_seqlen_q)
        if capability is not None:
            config, note = fit_shared_memory(config, inputs)
            source += note
    else:
        source = "explicit config from the caller"
    unusable = (("q", _descriptor_ready(inputs.q)), ("k", _descriptor_ready(inputs.k)), ("v", _descriptor_ready(inputs.v)))
    copies = tuple((name, issue) for name, issue in unusable if issue)
    pack_gqa = _pack_gqa(inputs, config)
    problem = FwdProblem(inputs.softmax_scale, inputs.window_left, inputs.window_right, inputs.bottom_right,
                         precision, pack_gqa)
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
