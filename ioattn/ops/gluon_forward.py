"""Launcher of the Gluon warp-specialized forward (`ioattn.kernels.gluon_fwd`), sm_90 only.

`gluon_forward(q, k, v, causal=..., softmax_scale=...)` takes flash-attn's dense layout (B, N, H, D), returns
(out, lse) as `ioattn.flash_attn_func(..., return_lse=True)` does: out like q, LSE float32 (B, Hq, Nq) in natural
log. `ioattn.ops.dispatch` picks it for `flash_attn_func` / `sdpa` on sm_90 where it takes the call and
`GLUON_FASTER` says it was measured faster than the Triton forward; `backend="gluon"` asks for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from ioattn.ops.capability import HOPPER_SHARED_MEMORY, SIXTEEN_BIT, device_capability
from ioattn.ops.compiled_launch import CompiledLaunches
from ioattn.ops.launch_config import check_launch_config

BLOCK_M = 64  # query rows per consumer warpgroup: the wgmma atom (see the kernel's docstring)
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned bases and strides


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    block_n: int
    stages: int  # depth of the K/V shared-memory ring
    num_warps: int = 4  # the default partition: consumer warpgroup 0
    consumer_regs: int = 240  # setmaxnreg of consumer warpgroup 1 (the default partition gets what is left)
    producer_regs: int = 24  # the producer warp only issues TMA copies
    maxnreg: int = 168  # 3 warpgroups x 128 threads x 168 = 64512 registers: one program per SM
    # log2 units: > 0 rescales O only when some row max grows by more (FA4); 0 rescales every tile, which the
    # 2026-12-05 H100 run measured faster on 15 of 19 rows, within 1% on the rest (the skip costs a cross-warp max)
    rescale_threshold: float = 0.0
    pingpong: bool = True  # the consumer warpgroups issue their wgmmas in turn
    persistent: bool = True  # one program per SM walks the work tiles (else one program per work tile)
    # the work tiles' order: bands of this many query blocks, each (batch, head)'s next to each other (the kernel's
    # _tile_coords), so the running tiles share K/V in L2; 1 (every (batch, head) of one query block before the
    # next) was 0.64x cuDNN at D128 N2k on an H100, 16 0.97x (bench/results/2026-12-07-mla-seesaw-fwd-band-h100)
    band: int = 16
    # consumer warpgroups, each with its own 64-row Q tile sharing every K/V tile: 3 (192 query rows per work tile,
    # as FA3 at D 64) reads K/V through shared memory a third less often per row; registers allow it at D <= 64
    consumers: int = 2
    # the persistent loop's order: every other round of work tiles from its far end (the kernel's _snake), so
    # programs that drew a long causal tile draw a short one next; a permutation of the same static assignment
    snake: bool = False
    # the fp8 forward: P to the P·V wgmma through shared memory (a store and a fence per tile), else from registers
    # with V's keys permuted in groups of 16 so that S's accumulator layout is the operand's (the kernel's
    # _fp8_operand). On two ping-pong warpgroups from registers measured 1.03-1.05x at D 128 N 8k-16k without a
    # mask but 0.86x at 4k and 0.90-0.97x causal (bench/results/2026-12-07-snake-fp8-regs-h100); the D 128 fp8
    # tiles (three warpgroups without the overlap) take P from registers
    fp8_p_shared: bool = True
    # FA3's intra-warpgroup overlap: tile j + 1's S wgmma beside tile j's softmax and P·V (two accumulators live
    # beside O). Without it (the kernel's _serial_key_loop) each tile runs in turn and the consumers take no turns:
    # the registers of three consumer warpgroups hold the fp8 forward's fresh P·V accumulator at D 128
    overlap: bool = True
    # the persistent loop's order at run time: after its first work tile each program takes the next one no program
    # has taken (an atomic counter, zeroed per launch), so that programs whose tiles ran slow take fewer
    dynamic: bool = False

    def __post_init__(self):
        check_launch_config(self)
        def whole(value):
            return isinstance(value, int) and not isinstance(value, bool)

        if not (whole(self.stages) and 2 <= self.stages <= 8):  # ping-pong and the P·V lag need two stages
            raise ValueError(f"GluonConfig.stages must be an int in 2..8, got {self.stages!r}")
        for name in ("consumer_regs", "producer_regs"):  # setmaxnreg takes multiples of 8 in 24..256
            value = getattr(self, name)
            if not (whole(value) and 24 <= value <= 256 and value % 8 == 0):
                raise ValueError(f"GluonConfig.{name} must be a multiple of 8 in 24..256, got {value!r}")
        if self.consumers not in (2, 3) or not whole(self.consumers):
            raise ValueError(f"GluonConfig.consumers must be 2 or 3 (consumer warpgroups), got {self.consumers!r}")
        if not self.overlap and self.pingpong:
            raise ValueError("GluonConfig.overlap=False needs pingpong=False (the turns follow the overlapped loop)")
        if self.dynamic and (self.snake or not self.persistent):
            raise ValueError("GluonConfig.dynamic takes the work tiles in order on a persistent grid: it needs "
                             f"snake=False and persistent=True, got snake={self.snake}, persistent={self.persistent}")
        if not (whole(self.band) and self.band >= 1):
            raise ValueError(f"GluonConfig.band must be an int >= 1 (query blocks per band), got {self.band!r}")


# Shared memory per program: 2 Q tiles + stages x (K + V) tiles, under the 227 KB an sm_90 block may take.
_CONFIGS = {
    64: GluonConfig(block_n=128, stages=3),  # 16 KB + 3 x 32 KB
    128: GluonConfig(block_n=128, stages=2),  # 32 KB + 2 x 64 KB
    256: GluonConfig(block_n=64, stages=2),  # 64 KB + 2 x 64 KB
}
# Masked (causal, windows), every other round of the persistent loop runs from its far end (the kernel's _snake): on
# an H100 1.23x at D 128 N 2k causal, 1.01-1.03x at 8k-16k, D 256 1.08x at 16k and 2k, 0.99x at 8k
# (bench/results/2026-12-07-snake-fp8-regs-h100).
_MASKED_CONFIGS = {d: dataclasses.replace(cfg, snake=True) for d, cfg in _CONFIGS.items()}
# Without a causal mask or window, D 64 takes three consumer warpgroups (FA3's 192-row tiles): 1.09-1.13x the
# two-warpgroup kernel and 0.99-1.05x cuDNN at N 2k-16k (bench/results/2026-12-07-stage-out-c3-h100). 24 KB Q +
# 24 KB O + 3 x 32 KB.
_UNMASKED_CONFIGS = {64: GluonConfig(block_n=128, stages=3, consumers=3, maxnreg=128, consumer_regs=160)}
# D 64 masked: three consumer warpgroups without the intra-warpgroup overlap (whose masked loop copies spill at 160
# registers): causal 1.05-1.07x the two-warpgroup kernel at N 2k-4k and 1.05x three overlapped warpgroups at 16k
# (bench/results/2026-12-07-serial-c3-h100); on the dynamic schedule, whose tiles are short enough here for the
# static one's tail to show: causal 1.04-1.09x snake order at N 2k-16k; at D 128 N 2k it lost 0.84x, at D 256
# 0.96-1.01x, so those keep snake order (bench/results/2026-12-07-dynamic-h100)
_MASKED_CONFIGS[64] = dataclasses.replace(_UNMASKED_CONFIGS[64], dynamic=True, pingpong=False, overlap=False)
HEAD_DIMS = tuple(_CONFIGS)
# The FP8 forward (`ioattn.ops.fp8_attention`): half the bytes per K/V tile, plus a 16-bit O staging buffer.
_FP8_CONFIGS = {
    64: GluonConfig(block_n=128, stages=3),  # 8 KB Q + 3 x 16 KB + 16 KB O
    # three consumer warpgroups without the overlap, P from registers: the kernel alone 1.04-1.17x two ping-pong
    # warpgroups at N 4k-16k, causal and not (bench/results/2026-12-07-serial-c3-h100): 24 KB Q + 3 x 32 KB + 48 KB
    # O. Not in snake order: causal 1.01-1.04x at 16/16 heads, but 0.65x at GQA 16/4 N 4k (that folder, call6-snake).
    # On the dynamic schedule: 0.98-1.09x the static one over two runs at N 4k-16k, 10 of 12 rows ahead, causal
    # 1.02-1.09x, the same output bit for bit (bench/results/2026-12-07-fp8-fold-h100)
    128: GluonConfig(block_n=128, stages=3, consumers=3, maxnreg=128, consumer_regs=160, pingpong=False,
                     overlap=False, fp8_p_shared=False, dynamic=True),
    # D 256: two serial consumer warpgroups, each tile's P·V added to O a quarter of its columns at a time (the
    # overlapped loop holds O and a fresh 64 x 256 float32 accumulator: 144 spill reloads a 64-key tile in the sm_90
    # build, this one 4-7). 32 KB Q + 3 x 32 KB + 64 KB O + 8 KB P
    256: GluonConfig(block_n=64, stages=3, pingpong=False, overlap=False),
}


# The fp8 forward rounds P x 2**(8 - threshold) to e4m3: each bit of threshold takes one from the small end of the
# probabilities' range (e4m3's subnormals end at 2**-9; with 2 bits, P below 2**-15 of the running max rounds to 0)
FP8_MAX_RESCALE_THRESHOLD = 4.0
BARRIER_BYTES = 1024  # the mbarriers and the allocator's alignment, with room to spare


def separate_o(head_dim: int, cfg: GluonConfig, element_bytes: int = 2, fp8: bool = False) -> bool:
    """Whether O gets a staging buffer of its own beside Q, the K/V ring (and fp8's P buffers), so that the next
    work tile's Q loads while O is stored; the fp8 forward always has one (its O is 16-bit, its Q is not)."""
    if fp8:
        return True
    tiles = 2 * cfg.consumers * BLOCK_M * head_dim + cfg.stages * 2 * cfg.block_n * head_dim  # Q, O, the ring
    return tiles * element_bytes + BARRIER_BYTES <= HOPPER_SHARED_MEMORY


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(cfg: GluonConfig, device: torch.device, work_tiles: int) -> tuple[int]:
    """Persistent: one program per SM (168 registers x 384 threads fill one), else one per work tile."""
    return (min(work_tiles, _sm_count(device.index)) if cfg.persistent else work_tiles,)


def _schedule(cfg: GluonConfig, device: torch.device) -> dict:
    """The launch's arguments for the work tiles' schedule: the dynamic one's tile counter (none for static)."""
    if not cfg.dynamic:
        return {}
    return dict(Tile_counter=torch.zeros(1, dtype=torch.int32, device=device), DYNAMIC=True)


def gluon_config(head_dim: int, masked: bool = False) -> GluonConfig:
    """The head dim's tiles; masked: a causal mask or a sliding window bounds the keys a row sees."""
    if not masked:
        return _UNMASKED_CONFIGS.get(head_dim, _CONFIGS[head_dim])
    return _MASKED_CONFIGS[head_dim]


def fp8_gluon_config(head_dim: int) -> GluonConfig:
    """The fp8 forward's tiles (D 128: three serial consumers, P from registers; the others P through shared
    memory: GluonConfig.fp8_p_shared)."""
    return _FP8_CONFIGS[head_dim]


# Where `backend="auto"` takes the Gluon forward over the Triton one: (head dim, causal) -> the fewest query and key
# tokens per sequence from which it was measured faster (bf16, B·N = 16k, H·D = 2048, persistent, bands of 16:
# bench/results/2026-12-07-mla-seesaw-fwd-band-h100, H100): 1.14-1.28x the Triton forward at D128 (N 2k-16k, causal
# and not, GQA 16/4), 1.21-1.38x at D256; D64 without a mask on three consumer warpgroups: 1.09-1.13x
# (bench/results/2026-12-07-stage-out-c3-h100). Causal D64 in snake order: 1.08x the Triton forward at N 2k (two
# warpgroups), 1.10-1.16x at 8k-16k (three; bench/results/2026-12-07-snake-fp8-regs-h100).
GLUON_FASTER: dict[tuple[int, bool], int] = {(64, False): 2048, (64, True): 2048, (128, False): 2048,
                                             (128, True): 2048, (256, False): 2048, (256, True): 2048}


def gluon_faster(head_dim: int, causal: bool, n_q: int, n_k: int) -> str | None:
    """Why the Gluon forward is the faster one for this shape (None when the Triton forward is, or unmeasured)."""
    least = GLUON_FASTER.get((head_dim, causal))
    if least is None or min(n_q, n_k) < least:
        return None
    return (f"Gluon forward measured faster than the Triton one at D={head_dim} {'causal' if causal else 'non-causal'}"
            f" from {least} tokens (GLUON_FASTER)")


def tensors_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why `gluon_forward` cannot take q, k, v (None when it can): the message of the ValueError it would raise."""
    try:
        _check(q, k, v, None)
    except ValueError as exc:
        return str(exc)
    return None


def tile_layout(rows: int, head_dim: int, dtype_name: str):
    """The shared-memory layout of a [1, rows, 1, head_dim] TMA box (128-byte swizzle for D >= 64)."""
    return box_layout((1, rows, 1, head_dim), dtype_name)


@functools.lru_cache(maxsize=None)
def box_layout(box: tuple[int, ...], dtype_name: str):
    """The shared-memory layout of a TMA box of `dtype_name` (a Gluon dtype's name); built once per box, as Gluon's
    constructor costs several us of host time a call."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(box), getattr(gl, dtype_name))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen, nheads, headdim)")
        if t.dtype not in SIXTEEN_BIT:
            raise ValueError(f"{name}.dtype must be torch.float16 or torch.bfloat16, got {t.dtype}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    major, minor = device_capability(q.device)
    if major != 9:
        raise ValueError(f"q.device must be an sm_90 GPU (Hopper), got compute capability {major}.{minor}")
    batch, _, hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"q head dim must be one of {HEAD_DIMS}, got {d}")
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != d:
        raise ValueError(f"k and v must both be (batch={batch}, seqlen_k, nheads_k, headdim={d}), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] == 0 or hq % k.shape[2] != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k/v's heads ({k.shape[2]})")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
                             f"{out.dtype} on {out.device}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t is None or t.numel() == 0:
            continue
        problem = _tma_layout_problem(t.shape, t.stride(), t.element_size())
        if problem is None and t.data_ptr() % TMA_ALIGN:
            problem = "unaligned"
        if problem == "head dim":
            raise ValueError(f"{name} must be contiguous in its head dim (stride 1), got strides {t.stride()}")
        if problem == "expanded":
            raise ValueError(f"{name} must not be expanded (a stride of 0, which TMA cannot step), got strides "
                             f"{t.stride()}: pass a contiguous copy")
        if problem == "unaligned":
            raise ValueError(f"{name} must have a {TMA_ALIGN}-byte aligned base and strides for TMA, got data_ptr "
                             f"{t.data_ptr():#x} and strides {t.stride()} ({t.element_size()}-byte elements)")


@functools.lru_cache(maxsize=4096)
def _tma_layout_problem(shape: tuple[int, ...], stride: tuple[int, ...], element_size: int) -> str | None:
    """What TMA cannot step in a (B, N, H, D) layout: "head dim" (not contiguous), "expanded" (a stride of 0) or
    "unaligned" (a stride not a multiple of 16 bytes); None when it can. By layout: checked on every call."""
    if stride[3] != 1:
        return "head dim"
    if any(step == 0 and n > 1 for n, step in zip(shape, stride)):
        return "expanded"
    if any(step * element_size % TMA_ALIGN for step in _tma_strides(shape, stride)[:3]):
        return "unaligned"
    return None


def _window(window_size, causal: bool) -> tuple[int, int]:
    """(left, right) from flash-attn's window_size and causal flag; -1 is unbounded."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and -1 <= w < 2**31 for w in window_size)):
        raise ValueError(f"window_size must be two ints >= -1 (left, right; -1 unbounded), got {window_size!r}")
    left, right = window_size
    return left, 0 if causal else right


def _strides(t: torch.Tensor) -> list[int]:
    """t's strides with those of size-1 dims (never stepped over, but TMA checks them) set to the span of the
    dims inside them."""
    return list(_tma_strides(t.shape, t.stride()))


@functools.lru_cache(maxsize=4096)
def _tma_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """`_strides` by shape and strides: seven of them a public call (host time), for a handful of layouts."""
    strides, span = [], 1
    for size, step in reversed(list(zip(shape, stride))):
        strides.append(span if size == 1 else step)
        span = max(span, abs(strides[-1]) * size)
    return tuple(strides[::-1])


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv"}


def _descriptor(t: torch.Tensor, rows: int, checked: bool = False):
    """t's TMA descriptor, boxes [1, rows, 1, D]. checked: `_check` (or the dispatch's `gluon_unsupported`) has
    passed t, so TensorDescriptor's own checks of the same alignment, strides and shape are skipped (host time
    paid on every call, four descriptors a launch)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = t.shape[3]
    fields = dict(base=t, shape=list(t.shape), strides=_strides(t), block_shape=[1, rows, 1, d],
                  layout=tile_layout(rows, d, _GL_DTYPES[t.dtype]), padding="zero")
    if not checked:
        return TensorDescriptor(**fields)
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__.update(fields)
    return descriptor


@functools.cache
def _launches() -> CompiledLaunches:
    from ioattn.kernels.gluon_fwd import gluon_fwd_kernel

    return CompiledLaunches(gluon_fwd_kernel)


def _aligned(*tensors) -> tuple[bool, ...]:
    """Which pointer arguments are 16-byte aligned (Triton specializes the kernel on it); None: no tensor."""
    return tuple(None if t is None else t.data_ptr() % 16 == 0 for t in tensors)


def _transposed_descriptor(vt: torch.Tensor, keys: int):
    """V transposed (B, Hkv, D, N'): boxes [1, 1, D, keys]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    box = (1, 1, vt.shape[2], keys)
    return TensorDescriptor(vt, list(vt.shape), list(vt.stride()), list(box), box_layout(box, _GL_DTYPES[vt.dtype]))


def gluon_forward_fp8(q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, scales, *, causal: bool,
                      softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
                      config: GluonConfig | None = None) -> None:
    """The FP8 forward through the warp-specialized kernel (`ioattn.ops.fp8_attention` checked everything):
    q (B, Nq, Hq, D), k (B, Nk, Hkv, D) e4m3, vt V's codes transposed (B, Hkv, D, Nk' >= Nk, a multiple of 16),
    scales (q (B, Hq, nq), k (B, Hkv, nk), v (B, Hkv, nk), block) float32, block a multiple of the config's
    block_n; writes out (16-bit, like q's shape) and lse (B, Hq, Nq)."""
    from ioattn.kernels.gluon_fwd import LOG2E

    batch, n_q, hq, d = q.shape
    n_k, hkv = k.shape[1], k.shape[2]
    cfg = fp8_gluon_config(d) if config is None else config
    if not 0 <= cfg.rescale_threshold <= FP8_MAX_RESCALE_THRESHOLD:
        raise ValueError(f"config.rescale_threshold must be in 0..{FP8_MAX_RESCALE_THRESHOLD} for the fp8 forward, got "
                         f"{cfg.rescale_threshold}")
    q_scale, k_scale, v_scale, block = scales
    if block % cfg.block_n:
        raise ValueError(f"scales: blocks of {block} positions are not whole {cfg.block_n}-key tiles (config.block_n)")
    # one K and V scale per key tile: the kernel indexes them without a division
    tiles = block // cfg.block_n
    if tiles > 1:
        k_scale, v_scale = (t[..., None].expand(*t.shape, tiles).reshape(*t.shape[:-1], -1) for t in (k_scale, v_scale))
    q_scale, k_scale, v_scale = (t.contiguous() for t in (q_scale, k_scale, v_scale))
    m_blocks = triton.cdiv(n_q, cfg.consumers * BLOCK_M)
    key = ("fp8", q.device.index, q.dtype, out.dtype, vt.shape[2], cfg, bool(causal),
           *_aligned(lse, q_scale, k_scale, v_scale))
    _launches()(
        key, _grid(cfg, q.device, batch * hq * m_blocks),
        _descriptor(q, BLOCK_M), _descriptor(k, cfg.block_n), _transposed_descriptor(vt, cfg.block_n),
        _descriptor(out, BLOCK_M), lse, n_q, n_k, hq, hq // hkv, batch * hq, m_blocks, 0, 0, softmax_scale * LOG2E,
        LEFT=False, RIGHT=bool(causal), BLOCK_N=cfg.block_n, STAGES=cfg.stages, RESCALE_THRESHOLD=cfg.rescale_threshold,
        PINGPONG=cfg.pingpong, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, SEPARATE_O=True,
        BAND=cfg.band, CONSUMERS=cfg.consumers, SNAKE=cfg.snake, P_SHARED=cfg.fp8_p_shared, OVERLAP=cfg.overlap,
        **_schedule(cfg, q.device),
        Q_scale=q_scale, K_scale=k_scale, V_scale=v_scale, scale_block=block, scale_blocks_q=q_scale.shape[-1],
        scale_tiles_k=k_scale.shape[-1], num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
    )


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                  out: torch.Tensor | None = None, lse: torch.Tensor | None = None, config: GluonConfig | None = None):
    """Exact attention forward on sm_90 through the warp-specialized Gluon kernel. q: (B, Nq, Hq, D); k, v:
    (B, Nk, Hkv, D) with Hq a multiple of Hkv; fp16 or bf16; D in HEAD_DIMS; causal and the sliding window
    (left, right) aligned bottom-right as flash-attn's (-1: unbounded; causal sets right to 0). Returns
    (out, lse): out like q (written into `out` when given), lse float32 (B, Hq, Nq), natural log (written into
    `lse` when given: contiguous); rows that see no key give 0 and -inf. `config` overrides the head dim's
    `gluon_config` (the lab's variants). Raises ValueError naming the argument for inputs the kernel does not
    take."""
    window_left, window_right = _window(window_size, causal)
    _check(q, k, v, out)
    batch, n_q, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not scale > 0.0 or not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty(batch, hq, n_q, dtype=torch.float32, device=q.device)
    elif lse.shape != (batch, hq, n_q) or lse.dtype != torch.float32 or not lse.is_contiguous() \
            or lse.device != q.device:
        raise ValueError(f"lse must be a contiguous float32 ({batch}, {hq}, {n_q}) tensor on {q.device}, got "
                         f"{tuple(lse.shape)} {lse.dtype} on {lse.device}")
    launch_dense(q, k, v, window_left, window_right, scale, out, lse, config)
    return out, lse


def launch_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int,
                 softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, config: GluonConfig | None) -> None:
    """`gluon_forward` once its arguments are checked (as `dispatch.gluon_unsupported` checks them for the public
    calls, so that a call pays for them once): windows -1 unbounded, out like q and lse (B, Hq, Nq) float32
    contiguous given."""
    batch, n_q, hq, d = q.shape
    n_k, hkv = k.shape[1], k.shape[2]
    if batch == 0 or n_q == 0 or hq == 0:
        return
    if n_k == 0:  # TMA boxes need a non-empty tensor; no key: O = 0, LSE = -inf
        out.zero_()
        lse.fill_(float("-inf"))
        return

    from ioattn.kernels.gluon_fwd import LOG2E

    masked = window_left >= 0 or window_right >= 0
    cfg = gluon_config(d, masked) if config is None else config
    m_blocks = triton.cdiv(n_q, cfg.consumers * BLOCK_M)
    key = ("dense", q.device.index, q.dtype, d, cfg, window_left >= 0, window_right >= 0, *_aligned(lse))
    _launches()(
        key, _grid(cfg, q.device, batch * hq * m_blocks),
        _descriptor(q, BLOCK_M, True), _descriptor(k, cfg.block_n, True), _descriptor(v, cfg.block_n, True),
        _descriptor(out, BLOCK_M, True), lse, n_q, n_k, hq, hq // hkv, batch * hq, m_blocks, max(window_left, 0),
        max(window_right, 0), softmax_scale * LOG2E, LEFT=window_left >= 0, RIGHT=window_right >= 0,
        BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        RESCALE_THRESHOLD=cfg.rescale_threshold, PINGPONG=cfg.pingpong, CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs, SEPARATE_O=separate_o(d, cfg, q.element_size()), BAND=cfg.band,
        CONSUMERS=cfg.consumers, SNAKE=cfg.snake, OVERLAP=cfg.overlap, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
        **_schedule(cfg, q.device),
    )


def gluon_forward_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, *, window_left: int, window_right: int,
                         softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
                         config: GluonConfig | None = None) -> None:
    """The varlen forward through the Gluon kernel: packed q (total_q, Hq, D), k, v (total_k, Hkv, D), cu_seqlens
    int32 (B + 1,) as `checks.validate_varlen` takes them, windows (-1 unbounded) aligned bottom-right per sequence.
    Writes out (like q) and lse (Hq, total_q) float32, contiguous. Raises ValueError naming the tensor the kernel
    cannot take (the public call checks them once, in dispatch, and runs `launch_packed`)."""
    _check(*(t.unsqueeze(0) for t in (q, k, v, out)))
    launch_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, window_left, window_right, softmax_scale, out,
                  lse, config)


def launch_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int, window_left: int, window_right: int,
                  softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, config: GluonConfig | None) -> None:
    """`gluon_forward_packed` once its tensors are checked (`dispatch.gluon_unsupported`; out allocated like q)."""
    q4, k4, v4, out4 = (t.unsqueeze(0) for t in (q, k, v, out))  # (1, total, H, D): one TMA batch coordinate
    batch, hq, d = cu_seqlens_q.numel() - 1, q.shape[1], q.shape[2]
    if batch == 0 or q.shape[0] == 0 or hq == 0:
        return
    if k.shape[0] == 0:  # TMA boxes need a non-empty tensor; no key: O = 0, LSE = -inf
        out.zero_()
        lse.fill_(float("-inf"))
        return

    from ioattn.kernels.gluon_fwd import LOG2E

    cfg = gluon_config(d, masked=window_left >= 0 or window_right >= 0) if config is None else config
    m_blocks = max(triton.cdiv(max_seqlen_q, cfg.consumers * BLOCK_M), 1)
    key = ("packed", q.device.index, q.dtype, d, cfg, window_left >= 0, window_right >= 0,
           *_aligned(lse, cu_seqlens_q, cu_seqlens_k, out))
    _launches()(
        key, _grid(cfg, q.device, batch * hq * m_blocks),
        _descriptor(q4, BLOCK_M, True), _descriptor(k4, cfg.block_n, True), _descriptor(v4, cfg.block_n, True),
        _descriptor(out4, BLOCK_M, True), lse, max_seqlen_q, 0, hq, hq // k.shape[1], batch * hq, m_blocks,
        max(window_left, 0), max(window_right, 0), softmax_scale * LOG2E,
        LEFT=window_left >= 0, RIGHT=window_right >= 0, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        RESCALE_THRESHOLD=cfg.rescale_threshold, PINGPONG=cfg.pingpong, CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs, SEPARATE_O=separate_o(d, cfg, q.element_size()),
        Cu_seqlens_q=cu_seqlens_q, Cu_seqlens_k=cu_seqlens_k, O=out, stride_o_row=out.stride(0),
        stride_o_head=out.stride(1), lse_stride=lse.stride(0), VARLEN=True, BAND=cfg.band, CONSUMERS=cfg.consumers,
        SNAKE=cfg.snake, OVERLAP=cfg.overlap, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
        **_schedule(cfg, q.device),
    )
