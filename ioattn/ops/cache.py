"""Cache writes and block movement for the paged KV cache: `reshape_and_cache` (new tokens' K/V into their slots),
`gather_cache` (sequences' cached K/V through their tables into a packed buffer), copy-on-write `copy_blocks` and
`swap_blocks` between pools. Layout and the two checking levels as in `ioattn.ops.paged` / `ioattn.ops.checks`.

FP8 caches (`ioattn.ops.fp8`) come with float32 per-KV-head scales: `reshape_and_cache` quantizes in its own
launch, `gather_cache` dequantizes into the packed buffers, and the block moves copy fp8 bytes as they are.
"""

from __future__ import annotations

import torch

import ioattn.kernels  # noqa: F401,I001  (first: on a CPU-only machine it selects the interpreter before triton loads)
from ioattn.kernels.cache_ops import gather_cache_kernel, reshape_and_cache_kernel
from ioattn.intmath import cdiv, next_power_of_2
from ioattn.ops import torch_paged
from ioattn.ops.checks import check_backend, check_tensor, checks_contents
from ioattn.ops.fp8 import (
    FORMAT_BITS, bytes_view, check_fp8_supported, check_scale_values, check_scales, fp8_max, is_fp8,
)
from ioattn.ops.paged_checks import (
    check_block_mapping, check_cache_pair, check_int_vector, check_slot_contents, dtypes_of, require,
)


def resolve_backend(backend: str, device: torch.device) -> tuple[str, str]:
    """"auto": Triton on CUDA and under Triton's CPU interpreter (the kernels' own test path), else torch."""
    check_backend(backend)
    if backend != "auto":
        return backend, f"backend={backend!r} requested"
    if device.type == "cuda" or ioattn.kernels.interpreted():
        return "triton", ""
    return "torch", "auto: CPU tensors without Triton's interpreter"


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, backend: str = "auto", validate: bool | None = None) -> None:
    """Write new tokens' key/value (tokens, num_kv_heads, D) into their cache slots; slot -1 is skipped (padding).

    Values are cast to the cache's dtype; into an fp8 cache they are quantized in the same launch: key / k_scale
    and value / v_scale per KV head (float32 (num_kv_heads,), required with fp8 and only then), saturated to
    the format's ±max, rounded to nearest even (NaN stays NaN; see `ioattn.ops.fp8`). slot_mapping: (tokens,) int32 or int64, slot = block_id * block_size +
    offset, each in [-1, num_blocks * block_size) and distinct (two tokens writing one slot is a race): checked
    when `validate` is True, or None for CPU tensors or with IOATTN_VALIDATE=1, else trusted. backend: "auto"
    (the Triton kernel on CUDA and under the CPU interpreter, else torch), "triton" or "torch" (index copies).
    """
    check_tensor("key", key)
    check_tensor("value", value)
    dtypes = dtypes_of(resolve_backend(backend, key.device)[0])
    check_cache_pair(k_cache, v_cache, dtypes)
    check_scales(k_cache, k_scale, v_scale)
    expected = (key.shape[0], k_cache.shape[2], k_cache.shape[3]) if key.dim() == 3 else "(tokens, heads, head_dim)"
    require(key.shape == value.shape == expected,
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be (tokens, num_kv_heads, head_dim) = {expected}")
    require(key.dtype in dtypes and value.dtype in dtypes,
            f"key/value dtype must be one of {dtypes}, got {key.dtype}, {value.dtype}")
    require(key.stride(-1) == 1 and value.stride(-1) == 1, "key and value must be contiguous in head_dim")
    require(key.device == value.device == k_cache.device, f"key ({key.device}), value ({value.device}) and the "
            f"caches ({k_cache.device}) must be on one device")
    check_int_vector("slot_mapping", slot_mapping, key.shape[0], key.device, (torch.int32, torch.int64))
    fp8 = is_fp8(k_cache.dtype)
    if fp8:
        check_fp8_supported(k_cache.device)
    if checks_contents(validate, key.device):
        check_slot_contents(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
        if fp8:
            check_scale_values("k_scale", k_scale)
            check_scale_values("v_scale", v_scale)
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    if resolve_backend(backend, key.device)[0] == "torch":
        torch_paged.write(key, value, k_cache, v_cache, torch_paged.CacheWrites.build(slot_mapping), k_scale, v_scale)
        return
    block_h = min(next_power_of_2(kv_heads), 16)
    quant = {}
    if fp8:
        mantissa, min_exp = FORMAT_BITS[k_cache.dtype]
        quant = dict(QUANT=True, FP8_MAX=fp8_max(k_cache.dtype), MANTISSA=mantissa, MIN_EXP=min_exp)
    reshape_and_cache_kernel[(tokens, cdiv(kv_heads, block_h))](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=next_power_of_2(head_dim), PAGE=k_cache.shape[1],
        **quant,
    )


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor, *,
                validate: bool | None = None) -> None:
    """Copy-on-write: for every layer's caches, block dst <- block src for each [src, dst] row of block_mapping.
    v_caches is one cache per layer, or empty for caches without a V (an MLA model's latent caches).

    block_mapping: int64 (pairs, 2) on the caches' device, blocks in [0, num_blocks), destinations distinct
    (checked as `validate` says, see reshape_and_cache). All sources are read before any destination is
    written. Two gathers per layer (torch index ops): copies are rare and small, a dedicated kernel would not pay.
    fp8 caches are copied as their bytes (torch has no fp8 index_copy_ on the CPU).
    """
    require(isinstance(k_caches, (list, tuple)) and isinstance(v_caches, (list, tuple))
            and len(v_caches) in (0, len(k_caches)),
            "k_caches and v_caches must be lists of one cache per layer, of equal length (v_caches may be empty)")
    caches = (*k_caches, *v_caches)
    for i, cache in enumerate(caches):
        check_tensor(f"cache {i}", cache)
        require(cache.dim() >= 1 and cache.shape[0] == caches[0].shape[0] and cache.device == caches[0].device,
                "every cache of copy_blocks must hold the same number of blocks on one device")
    if not caches:
        return
    check_block_mapping(block_mapping, caches[0].device, caches[0].shape[0], caches[0].shape[0],
                        checks_contents(validate, caches[0].device))
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in caches:
        cache = bytes_view(cache)
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between two pools (GPU <-> pinned CPU, or GPU <-> GPU): dst[d] <- src[s] per row [s, d].

    One cache tensor per call (call it for each layer's K and V). block_mapping: int64 (pairs, 2) on the CPU
    (it is read on the host, no device sync, so its blocks are always checked against both pools). Copies are
    asynchronous on the current stream when the CPU side is pinned: synchronise that stream before reading a CPU
    destination or reusing a CPU source.
    """
    check_tensor("src", src)
    check_tensor("dst", dst)
    require(src.dim() >= 1 and src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype,
            f"src {src.dtype} {tuple(src.shape)} and dst {dst.dtype} {tuple(dst.shape)} must share block shape and dtype")
    check_block_mapping(block_mapping, torch.device("cpu"), src.shape[0], dst.shape[0], contents=True)
    src, dst = bytes_view(src), bytes_view(dst)
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s], non_blocking=True)


def gather_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, capacity: int, *, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 dequantize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first seq_lens[b] cached K/V, through its block table, packed at rows cu_seqlens_k[b]...
    of two new (capacity, num_kv_heads, D) tensors (rows past the last sequence are left unwritten). A table
    entry < 0 is never read; its positions come out as zeros. The buffers are in `dtype` (default the cache's);
    an fp8 cache is dequantized on the way (times k_scale / v_scale per KV head, in float32, then rounded to
    `dtype`, which an fp8 cache requires); with dequantize=False its codes are converted to `dtype` unscaled (exact
    in float16 / bfloat16 / float32: the caller applies the scales, as the gathered paged path does)."""
    batch, width = block_table.shape
    page, kv_heads, head_dim = k_cache.shape[1:]
    fp8 = is_fp8(k_cache.dtype)
    require(not fp8 or (dtype is not None and not is_fp8(dtype)),
            f"dtype: gathering an fp8 cache needs the (non-fp8) dtype to convert into, got {dtype}")
    require(isinstance(dequantize, bool), f"dequantize must be a bool, got {dequantize!r}")
    dequant = fp8 and dequantize
    require(not dequant or (k_scale is not None and v_scale is not None),
            "k_scale and v_scale are required to dequantize an fp8 cache (dequantize=False gathers its codes)")
    k_out = torch.empty(capacity, kv_heads, head_dim, dtype=dtype or k_cache.dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    block_d = next_power_of_2(head_dim)
    block_t = 32
    block_h = max(1, min(next_power_of_2(kv_heads), 4096 // (block_t * block_d)))
    if capacity == 0 or width == 0 or batch == 0:
        return k_out, v_out
    gather_cache_kernel[(cdiv(width * page, block_t), batch)](
        k_cache, v_cache, block_table, seq_lens, cu_seqlens_k, k_out, v_out, k_scale, v_scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), k_out.stride(0), k_out.stride(1), kv_heads,
        HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, PAGE=page,
        **({"DEQUANT": True} if dequant else {}),
    )
    return k_out, v_out
