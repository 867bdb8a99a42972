"""Launcher of the Gluon paged decode (`ioattn.kernels.gluon_paged`), sm_90 only: `PagedConfig(kernel="gluon")`.

It takes what the Triton paged kernel's decode takes except windows and sinks, query-head groups over 16 and
head dims other than 64, 128 and 256; `gluon_decode_unsupported` names the first argument it cannot take.
"""

from __future__ import annotations

import functools
import math

import torch

from ioattn.ops.capability import device_capability
from ioattn.ops.fp8 import is_fp8

HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16


def gluon_decode_unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, decode: bool,
                             window_left: int, sink_tokens: int) -> str | None:
    """Why the Gluon decode cannot take this call (None when it can); the device is checked last, so every other
    reason shows on any machine. A decode query sits at the last position, so a window's right bound never hides a
    key: only its left bound and sinks matter."""
    group = q.shape[1] // k_cache.shape[2]
    if not decode:
        return "the Gluon paged kernel is decode only (cu_seqlens_q must be None)"
    if window_left >= 0 or sink_tokens:
        return "the Gluon paged kernel takes no left window or sinks (window_size[0] == -1, sink_tokens == 0)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the Gluon paged kernel takes float16 or bfloat16 q, got {q.dtype}"
    if q.shape[2] not in HEAD_DIMS:
        return f"the Gluon paged kernel takes head_dim in {HEAD_DIMS}, got {q.shape[2]}"
    if k_cache.shape[1] < 16:
        return f"the Gluon paged kernel takes cache blocks of 16 or more tokens, got {k_cache.shape[1]}"
    if group > MAX_GROUP:
        return f"the Gluon paged kernel takes at most {MAX_GROUP} query heads per KV head, got {group}"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # TMA views the cache as rows of slots: (blocks * PAGE, Hkv * D), 16-byte aligned
        blocks, page, kv_heads, head_dim = cache.shape
        row = cache.stride(1)
        if (cache.stride(3) != 1 or cache.stride(2) != head_dim or (blocks > 1 and cache.stride(0) != page * row)
                or row * cache.element_size() % 16 or cache.data_ptr() % 16):
            return (f"the Gluon paged kernel reads {name} as rows of slots (stride(0) == block_size * stride(1), "
                    f"stride(2) == head_dim, stride(3) == 1, 16-byte aligned rows), got strides {cache.stride()}")
    if not (q.is_cuda and device_capability(q.device) == (9, 0)):
        return f"the Gluon paged kernel needs an sm_90 GPU, q is on {q.device}"
    return None


def gluon_config_unsupported(config) -> str | None:
    """Why the Gluon decode cannot build `config` (a PagedConfig with kernel="gluon"), None when it can: the
    consumer warps split a tile's keys 8 per mma column block, and a tile's rings must fit shared memory."""
    if not 32 <= config.block_n <= 128 or config.block_n < 8 * config.num_warps:
        return (f"config.block_n must be in 32..128 and at least 8 x num_warps for the Gluon paged kernel, got "
                f"block_n={config.block_n}, num_warps={config.num_warps}")
    if config.paired_tiles:
        return "config.paired_tiles is the Triton kernel's; the Gluon paged kernel keeps a ring of num_stages tiles"
    if config.rescale_threshold > 15:  # P up to 2**threshold must stay finite in float16
        return f"config.rescale_threshold must be at most 15 for the Gluon paged kernel, got {config.rescale_threshold}"
    return None


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv",
              torch.float8_e5m2: "float8e5"}


@functools.cache
def _box_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """The shared-memory layout of a [rows, head_dim] TMA box, built once (8 of the 11 µs of a descriptor here)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], getattr(gl, _GL_DTYPES[dtype]))


def cache_descriptor(cache: torch.Tensor, rows: int, width: int | None = None):
    """A TMA descriptor over a (blocks, PAGE, Hkv, D) cache viewed as (blocks * PAGE, Hkv * D) rows of slots,
    with boxes [rows, width] (default D: one KV head of `rows` consecutive slots); see `gluon_decode_unsupported`
    for the strides this view needs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    blocks, page, kv_heads, head_dim = cache.shape
    width = head_dim if width is None else width
    return TensorDescriptor(cache, [blocks * page, kv_heads * head_dim], [cache.stride(1), 1], [rows, width],
                            _box_layout(rows, width, cache.dtype))


def launch_gluon_decode(q, k_cache, v_cache, block_table, seq_lens, part_out, part_lse, k_scale, v_scale,
                        scale: float, splits: int, config, release_dependents: bool = False) -> None:
    """One launch over grid (batch, num_kv_heads, splits), writing the Triton kernel's partials (or the output);
    release_dependents: the split combine follows by programmatic dependent launch."""
    from ioattn.kernels.gluon_paged import gluon_paged_decode_kernel

    batch, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    fp8 = is_fp8(k_cache.dtype)
    rows = min(k_cache.shape[1], config.block_n)
    gluon_paged_decode_kernel[(batch, num_kv_heads, splits)](
        cache_descriptor(k_cache, rows), cache_descriptor(v_cache, rows), q, block_table, seq_lens, part_out,
        part_lse, k_scale if fp8 else None, v_scale if fp8 else None,
        q.stride(0), q.stride(1), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        scale * math.log2(math.e), splits,
        GROUP=num_heads // num_kv_heads, BLOCK_N=config.block_n, PAGE=k_cache.shape[1], STAGES=config.num_stages,
        RESCALE_THRESHOLD=float(config.rescale_threshold), RELEASE_DEPENDENTS=release_dependents,
        num_warps=config.num_warps, maxnreg=config.maxnreg,
    )
