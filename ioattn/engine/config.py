"""Engine settings: what the user asks for (`EngineConfig`, the `LLM(...)` keyword arguments) and, resolved once
against the loaded model and its device, every value derived from it (`EngineSettings`: context length, token
budget, KV pool and CPU swap pool sizes, the KV cache's dtype and, for fp8, its scales). The single-process engine,
the tensor-parallel ranks and the disaggregated workers all take what `resolve_settings` returns, so no two places
derive a default differently.

The pool is sized in bytes: `kv_cache_dtype="fp8_e4m3"` / `"fp8_e5m2"` store one byte per element, so the same
memory holds twice the tokens of a 16-bit cache (four times those of a float32 one). An MLA model (DeepSeek-V2/V3)
caches one latent row per token per layer instead of K and V per KV head, so its blocks are smaller still
(`PagedAttention.block_bytes`); fp8 is refused for it at resolution, before anything is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ioattn.engine.attention import PagedAttention
from ioattn.engine.kv_scales import KVScales, check_kv_cache_scales_setting, resolve_kv_scales
from ioattn.engine.runner import ModelRunner
from ioattn.engine.sampling import as_real, is_int
from ioattn.engine.scheduler import MODES, POLICIES, PREEMPTION_MODES, SchedulerConfig
from ioattn.intmath import cdiv
from ioattn.kv.manager import watermark_blocks
from ioattn.models.loader import LoadedModel
from ioattn.ops.fp8 import KV_CACHE_DTYPES, check_fp8_supported, parse_kv_cache_dtype

# KV pool on a CPU device when num_blocks is not given (there is no device memory to profile).
CPU_KV_CACHE_BYTES = 256 << 20
GiB = 1 << 30
# The token budget of a chunked-prefill step when max_num_batched_tokens is not given (at least max_num_seqs).
DEFAULT_CHUNKED_BUDGET = 2048


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs besides the model; `LLM(...)` keyword arguments land here."""

    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    num_blocks: int | None = None  # default: from gpu_memory_utilization (CUDA) or CPU_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_num_seqs), or max_model_len unchunked
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    scheduling: str = "continuous"  # or "static": the contiguous-reservation baseline
    swap_space: float = 4.0  # GiB of CPU blocks for preemption_mode="swap"
    watermark: float = 0.01
    enforce_eager: bool = False  # True: no CUDA graphs
    # Schedule step t+1 while step t runs (see the module docstring); None: on (True and None differ only in
    # engines that cannot overlap: tensor parallelism refuses True).
    async_scheduling: bool | None = None
    attention_backend: str = "auto"  # "triton" paged kernels (CUDA default), "torch" exact path (CPU default)
    device: str | torch.device | None = None
    # "auto" (the model's dtype), "fp8_e4m3" or "fp8_e5m2": one byte per cached element (`ioattn.ops.fp8`).
    kv_cache_dtype: str = "auto"
    # fp8 only: None (the checkpoint's scales, else calibrated at start-up: K and V then stored rotated),
    # "checkpoint", "calibrate", a number (every layer and head; 1.0 warns), a JSON file or resolved KVScales (see
    # `ioattn.engine.kv_scales`).
    kv_cache_scales: str | float | KVScales | None = None

    def __post_init__(self):
        def require(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("max_model_len", "num_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            require(value is None or (is_int(value) and value >= 1), name, "None or an int >= 1")
        require(is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", "an int >= 1")
        require(0 < as_real(self.gpu_memory_utilization) <= 1, "gpu_memory_utilization", "in (0, 1]")
        block_size = self.block_size
        require(is_int(block_size) and block_size >= 1 and block_size & (block_size - 1) == 0, "block_size",
                "a power of two >= 1")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
            require(isinstance(getattr(self, name), bool), name, "True or False")
        for name, allowed in (("preemption_mode", PREEMPTION_MODES), ("policy", POLICIES), ("scheduling", MODES)):
            require(isinstance(getattr(self, name), str) and getattr(self, name) in allowed, name, f"one of {allowed}")
        require(0 <= as_real(self.swap_space) < math.inf, "swap_space", "a finite number of GiB >= 0")
        # Swap preemption with no CPU pool would fail at the first preemption, inside a step.
        require(self.preemption_mode != "swap" or self.swap_space > 0, "swap_space",
                '> 0 GiB with preemption_mode="swap" (the CPU pool swapped-out blocks go to)')
        require(0 <= as_real(self.watermark) < 1, "watermark", "in [0, 1)")
        require(self.async_scheduling is None or isinstance(self.async_scheduling, bool), "async_scheduling",
                "None, True or False")
        require(isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                f"one of {tuple(KV_CACHE_DTYPES)}")
        check_kv_cache_scales_setting(self.kv_cache_scales)
        require(self.kv_cache_scales is None or self.kv_cache_dtype != "auto", "kv_cache_scales",
                'None unless kv_cache_dtype is an fp8 format (scales quantize an fp8 cache)')


@dataclass(frozen=True)
class EngineSettings:
    """Every derived value of an engine, resolved once (`resolve_settings`)."""

    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    block_bytes: int  # one block across all layers, K and V (MLA: the latent cache)
    num_blocks: int
    num_cpu_blocks: int
    watermark_blocks: int  # kept free by admission (`KVCacheManager`'s rule)
    dtype: torch.dtype
    device: torch.device
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype
    kv_scales: KVScales | None = None  # fp8 caches only

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @property
    def admissible_blocks(self) -> int:
        return self.num_blocks - self.watermark_blocks

    def scheduler_config(self, config: EngineConfig) -> SchedulerConfig:
        return SchedulerConfig(
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode, policy=config.policy, mode=config.scheduling,
        )


def resolve_settings(config: EngineConfig, loaded: LoadedModel,
                     agree_num_blocks: Callable[[int], int] | None = None) -> EngineSettings:
    """The settings of an engine serving `loaded` with `config`.

    - max_model_len: config's, else the model's context (never longer);
    - max_num_batched_tokens: config's, else max(DEFAULT_CHUNKED_BUDGET, max_num_seqs), or max_model_len without
      chunked prefill (a whole prompt must then fit one step);
    - num_blocks: config's, else on CUDA what `gpu_memory_utilization` leaves after the weights and a peak
      activation pass (`ModelRunner.profile_num_blocks`), on the CPU CPU_KV_CACHE_BYTES of blocks — never fewer than
      one max_model_len sequence needs above the admission watermark; `agree_num_blocks` (tensor parallelism:
      the least over the ranks) has the last word;
    - num_cpu_blocks: swap_space GiB of blocks with preemption_mode="swap", else none;
    - kv_cache_dtype and, for fp8, kv_scales (`ioattn.engine.kv_scales.resolve_kv_scales`: the checkpoint's, a
      user's, or a calibration pass over the model now). Block sizes in bytes follow the cache dtype.
    ValueError when the pool cannot hold one max_model_len sequence above the watermark, swap has no block, the
    device cannot convert fp8, or the scales do not fit the model.
    """
    max_model_len = config.max_model_len or loaded.max_model_len
    if max_model_len > loaded.max_model_len:
        raise ValueError(f"max_model_len ({max_model_len}) must be <= the model's max_position_embeddings "
                         f"({loaded.max_model_len})")
    least = DEFAULT_CHUNKED_BUDGET if config.enable_chunked_prefill else max_model_len
    batched = config.max_num_batched_tokens or max(least, config.max_num_seqs)
    model = loaded.model
    device, dtype = model.inv_freq.device, model.model.embed_tokens.weight.dtype
    kv_dtype = parse_kv_cache_dtype(config.kv_cache_dtype)
    kv_scales = None
    if kv_dtype is not None:
        if loaded.config.mla is not None:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported for MLA models yet "
                             f"({loaded.config.model_type}: the latent cache stays in the model's dtype)")
        check_fp8_supported(device, "kv_cache_dtype")
        if agree_num_blocks is not None:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported with tensor parallelism yet "
                             "(each rank would need its heads' share of the scales)")
        kv_scales = resolve_kv_scales(loaded, kv_dtype, config.kv_cache_scales)
    block_bytes = PagedAttention.block_bytes(loaded.config, config.block_size, kv_dtype or dtype)
    num_blocks = config.num_blocks
    if num_blocks is None:
        if device.type == "cuda":
            num_blocks = ModelRunner.profile_num_blocks(
                model, block_size=config.block_size, gpu_memory_utilization=config.gpu_memory_utilization,
                max_num_batched_tokens=batched, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len)
            # The profile counts blocks of the model's dtype; the same bytes hold more blocks of a narrower cache.
            num_blocks = num_blocks * PagedAttention.block_bytes(loaded.config, config.block_size, dtype) // block_bytes
        else:
            num_blocks = max(CPU_KV_CACHE_BYTES // block_bytes,
                             least_blocks(max_model_len, config.block_size, config.watermark))
    if agree_num_blocks is not None:
        num_blocks = agree_num_blocks(num_blocks)
    reserved = watermark_blocks(num_blocks, config.watermark)
    if (num_blocks - reserved) * config.block_size < max_model_len:
        raise ValueError(
            f"num_blocks ({num_blocks}, {reserved} of them the admission watermark) x block_size "
            f"({config.block_size}) must hold one max_model_len ({max_model_len}) sequence")
    num_cpu_blocks = int(config.swap_space * GiB) // block_bytes if config.preemption_mode == "swap" else 0
    if config.preemption_mode == "swap" and num_cpu_blocks == 0:
        raise ValueError(f"swap_space ({config.swap_space!r} GiB) holds no KV block of {block_bytes} bytes: "
                         'preemption_mode="swap" needs at least one (raise swap_space, or use "recompute")')
    return EngineSettings(max_model_len, batched, config.block_size, block_bytes, num_blocks, num_cpu_blocks,
                          reserved, dtype, device, kv_dtype, kv_scales)


def least_blocks(max_model_len: int, block_size: int, watermark: float) -> int:
    """The smallest pool that holds one max_model_len sequence above the admission watermark."""
    blocks = cdiv(max_model_len, block_size)
    while blocks - watermark_blocks(blocks, watermark) < cdiv(max_model_len, block_size):
        blocks += 1
    return blocks


def build_attention(model_config, settings: EngineSettings, config: EngineConfig) -> PagedAttention:
    """The attention seam (caches, swap pool) these settings describe."""
    return PagedAttention(model_config, num_blocks=settings.num_blocks, block_size=settings.block_size,
                          dtype=settings.dtype, device=settings.device, num_cpu_blocks=settings.num_cpu_blocks,
                          max_num_seqs=config.max_num_seqs, backend=config.attention_backend,
                          kv_cache_dtype=settings.kv_cache_dtype, kv_scales=settings.kv_scales)


def build_runner(model, attention: PagedAttention, settings: EngineSettings, config: EngineConfig,
                 use_cuda_graphs: bool) -> ModelRunner:
    return ModelRunner(model, attention, max_model_len=settings.max_model_len, max_num_seqs=config.max_num_seqs,
                       use_cuda_graphs=use_cuda_graphs, max_num_batched_tokens=settings.max_num_batched_tokens)
