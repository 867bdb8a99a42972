"""Argument checks of the paged-cache ops (`ioattn.ops.paged`): ValueError naming the argument, before any kernel
runs or any cache is written. The two levels of `ioattn.ops.checks` apply: shapes, dtypes, devices and strides
always; the values of block tables, seq_lens, cu_seqlens, slot mappings and block mappings when contents are
checked (CPU tensors, `validate=True`, or IOATTN_VALIDATE=1).
"""

from __future__ import annotations

import torch

from ioattn.ops.checks import SUPPORTED_DTYPES, check_head_dim, check_tensor
from ioattn.ops.fp8 import FP8_DTYPES

MAX_BLOCK_SIZE = 256
EVICTED = -1  # a table entry an eviction policy released (`ioattn.kv.EVICTED`)
TORCH_DTYPES = (*SUPPORTED_DTYPES, torch.float64)  # the torch backend computes in any float type


def dtypes_of(backend: str) -> tuple[torch.dtype, ...]:
    """The dtypes a resolved backend takes: the kernels' three, or float64 besides on the torch path."""
    return TORCH_DTYPES if backend == "torch" else SUPPORTED_DTYPES


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_cache(name: str, cache, dtypes=SUPPORTED_DTYPES) -> None:
    check_tensor(name, cache)
    require(cache.dim() == 4, f"{name} must be (num_blocks, block_size, num_kv_heads, head_dim), got {tuple(cache.shape)}")
    require(cache.dtype in dtypes, f"{name} dtype must be one of {dtypes}, got {cache.dtype}")
    block_size = cache.shape[1]
    require(block_size & (block_size - 1) == 0 and 1 <= block_size <= MAX_BLOCK_SIZE,
            f"{name} block_size must be a power of two in 1..{MAX_BLOCK_SIZE}, got {block_size}")
    check_head_dim(cache.shape[3], name)
    require(cache.shape[2] >= 1, f"{name} must have at least one KV head, got shape {tuple(cache.shape)}")
    require(cache.stride(-1) == 1, f"{name} must be contiguous in head_dim (stride(-1) == 1)")


def check_cache_pair(k_cache, v_cache, dtypes=SUPPORTED_DTYPES) -> None:
    """Two caches of one shape, dtype and device: a compute dtype of the backend (`dtypes`) or an fp8 format."""
    dtypes = (*dtypes, *FP8_DTYPES)
    check_cache("k_cache", k_cache, dtypes)
    check_cache("v_cache", v_cache, dtypes)
    require(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype and k_cache.device == v_cache.device,
            f"k_cache ({k_cache.dtype} {tuple(k_cache.shape)} on {k_cache.device}) and v_cache ({v_cache.dtype} "
            f"{tuple(v_cache.shape)} on {v_cache.device}) must match")


def check_int_vector(name: str, t, length: int, device: torch.device, dtypes=(torch.int32,)) -> None:
    check_tensor(name, t)
    require(t.dtype in dtypes, f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    require(t.dim() == 1 and t.shape[0] == length, f"{name} must have shape ({length},), got {tuple(t.shape)}")
    require(t.is_contiguous(), f"{name} must be contiguous (the kernels read it by offset), got stride {t.stride()}")
    require(t.device == device, f"{name} must be on {device}, got {t.device}")


def check_block_table(block_table, device: torch.device) -> None:
    check_tensor("block_table", block_table)
    require(block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.stride(1) == 1,
            f"block_table must be int32 (batch, max_blocks_per_seq) with unit column stride, got "
            f"{block_table.dtype} {tuple(block_table.shape)} with strides {block_table.stride()}")
    require(block_table.device == device, f"block_table must be on {device}, got {block_table.device}")


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_table_contents(block_table: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor | None,
                         num_blocks: int, block_size: int, window_left: int, sink_tokens: int) -> None:
    """Values of one call's tables: seq_lens in [0, table capacity], q_len <= seq_len (q_lens None: decode, one
    query per sequence, where seq_len 0 is an empty padding row), every entry of a position below seq_len a block id in [0, num_blocks), or EVICTED where the window
    and the sinks hide the whole block from every query of its sequence (those entries are never read)."""
    table = block_table.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    width = table.shape[1]
    capacity = width * block_size
    bad = (lens < 0) | (lens > capacity)
    if bad.any():
        (b,) = _first(bad)
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} must lie in [0, {capacity}] (block_table holds {width} "
                         f"blocks of {block_size} per sequence)")
    queries = lens.clamp(max=1) if q_lens is None else q_lens.to("cpu", torch.int64)
    bad = queries > lens
    if bad.any():
        (b,) = _first(bad)
        raise ValueError(f"sequence {b} has {int(queries[b])} query tokens but seq_lens[{b}] = {int(lens[b])}: its "
                         "queries' own keys must be in the cache (q_len <= seq_len)")
    cols = torch.arange(width)
    read = cols[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad = read & ((table >= num_blocks) | (table < EVICTED))
    if bad.any():
        b, j = _first(bad)
        raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} is not a block id in [0, {num_blocks}) "
                         f"(num_blocks of the cache)")
    evicted = read & (table == EVICTED)
    if evicted.any():
        # Key k is visible to the first (hence every) query p0 = seq_len - q_len iff k >= p0 - left or k < sinks.
        hidden_from = (lens - queries - window_left)[:, None] if window_left >= 0 else torch.zeros_like(lens)[:, None]
        hidden = ((cols[None, :] + 1) * block_size <= hidden_from) & (cols[None, :] * block_size >= sink_tokens)
        bad = evicted & ~hidden
        if bad.any():
            b, j = _first(bad)
            window = f"window_size[0] = {window_left}" if window_left >= 0 else "no window"
            raise ValueError(f"block_table[{b}, {j}] = -1 (an evicted block) holds keys that sequence {b} still sees "
                             f"({window}, sink_tokens = {sink_tokens}, seq_len {int(lens[b])}, "
                             f"{int(queries[b])} queries)")


def check_slot_contents(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Slots in [-1, num_slots) (-1: padding, skipped), each non-negative one written by one token only."""
    slots = slot_mapping.to("cpu", torch.int64)
    bad = (slots < -1) | (slots >= num_slots)
    if bad.any():
        (t,) = _first(bad)
        raise ValueError(f"slot_mapping[{t}] = {int(slots[t])} is not a slot in [-1, {num_slots}) "
                         "(num_blocks x block_size; -1 skips the token)")
    written = slots[slots >= 0]
    if written.numel() != written.unique().numel():
        values, counts = written.unique(return_counts=True)
        raise ValueError(f"slot_mapping writes slot {int(values[counts > 1][0])} more than once (two tokens writing "
                         "one slot is a race)")


def check_block_mapping(block_mapping, device: torch.device, src_blocks: int, dst_blocks: int, contents: bool) -> None:
    """int64 (pairs, 2) of [src, dst] on `device`; with `contents`, sources in [0, src_blocks), destinations in
    [0, dst_blocks) and distinct."""
    check_tensor("block_mapping", block_mapping)
    require(block_mapping.dim() == 2 and block_mapping.shape[1] == 2 and block_mapping.dtype == torch.int64,
            f"block_mapping must be int64 (pairs, 2) of [src, dst], got {block_mapping.dtype} "
            f"{tuple(block_mapping.shape)}")
    require(block_mapping.device == device, f"block_mapping must be on {device}, got {block_mapping.device}")
    if not contents or block_mapping.numel() == 0:
        return
    pairs = block_mapping.cpu()
    for column, name, limit in ((0, "source", src_blocks), (1, "destination", dst_blocks)):
        bad = (pairs[:, column] < 0) | (pairs[:, column] >= limit)
        if bad.any():
            (row,) = _first(bad)
            raise ValueError(f"block_mapping[{row}] = {pairs[row].tolist()}: {name} block outside [0, {limit})")
    if pairs[:, 1].unique().numel() != pairs.shape[0]:
        raise ValueError("block_mapping has a destination block twice (each destination is written once)")
