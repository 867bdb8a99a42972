"""The exact torch backend of `ioattn.ops.paged.paged_attention`, for CPU tensors (and anywhere Triton cannot run).

Visibility is the kernel's: key k is visible to a query at position p iff k < seq_len, k <= p + right, and
k >= p - left or k < sink_tokens; a key in an evicted block (table entry -1) never is (the contents checks ensure
that no visible position lies in one).

Where a call's rows read the cache is worked out once from its tables (`CacheReads.build`): the engine's attention
seam builds it once per step and window, and every layer of the step reuses it, so that a layer costs a few large
torch ops instead of a few per sequence. Without LSE (`attend`):

- every call attends over its sequence's length rounded up to WIDTH_STEP keys, the keys past the length hidden (a
  hidden key adds exactly 0): SDPA's rounding depends on the width it is given, and a width that follows from the
  sequence alone keeps a token's result independent of the rows it is batched with, and the same whether it is a
  decode or the last token of a chunk (the synchronous and the overlapping engine batch the same tokens
  differently and agree bit for bit) — on one torch thread: with more, torch's CPU SDPA shares a small batch's work
  out differently, and a row can move by an ulp or two with its batch;
- the one-query rows (decodes, and one-token chunks) attend in one SDPA call per width: their keys gathered by one
  index_select into a (rows, width, Hkv, D) buffer; a width's rows split into several calls where that buffer
  would pass GATHER_BYTES; with 16-bit inputs in float32 (`decode_dtype`: torch's CPU SDPA takes ~4x as long for
  one bf16 query as for one float32 query), rounded to the inputs' dtype once at the end;
- each multi-token sequence attends in an SDPA call of its own, over a view of the cache when its slots are one run
  (a prompt's blocks usually are), else over gathered keys, under a mask (never SDPA's is_causal: see
  `_sequence_reads`).

PyTorch's CPU SDPA kernels are tiled and exact; rows that see no key return 0 (SDPA would give NaN). With LSE, each
sequence goes through the tiled float32 online softmax of `ioattn.ops.torch_backend`. An fp8 cache (`k_scale`,
`v_scale` given) is dequantized into the queries' dtype as its keys are gathered (`ioattn.ops.fp8`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ioattn.ops import torch_backend
from ioattn.ops.checks import AttentionInputs
from ioattn.ops.fp8 import bytes_view, dequantize, is_fp8, quantize

DESCRIPTION = ("one-query rows batched into one SDPA call per padded width over keys gathered through their tables "
               "(in float32 for 16-bit inputs); each multi-token sequence an SDPA call over a cache view or its "
               "gathered keys (the tiled torch forward when LSE is asked for)")
# Largest K (and as large a V) buffer one decode group gathers; a longer batch is split into several groups.
GATHER_BYTES = 64 << 20
# Every call attends over its sequence's length rounded up to a multiple of this (see the module docstring).
WIDTH_STEP = 128


def decode_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype one-query rows attend in: float32 for 16-bit inputs, else their own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _visible(num_queries: int, seq_len: int, window: tuple[int, int], sink_tokens: int) -> torch.Tensor:
    """Bool (num_queries, seq_len): the keys each query (at positions seq_len - num_queries ..) may see."""
    positions = torch.arange(seq_len - num_queries, seq_len)[:, None]
    keys = torch.arange(seq_len)[None, :]
    left, right = window
    visible = keys <= positions + (right if right >= 0 else seq_len)
    if left >= 0:
        visible &= (keys >= positions - left) | (keys < sink_tokens)
    return visible


def context_slots(table_row: torch.Tensor, seq_len: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slot of each position 0..seq_len-1 of a sequence, and whether its block is present (an evicted
    block's positions get slot-sized placeholders, never visible)."""
    positions = torch.arange(seq_len, device=table_row.device)
    blocks = table_row.long()[positions // page]
    return blocks.clamp(min=0) * page + positions % page, blocks >= 0


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows attending in one SDPA call: `rows` (a slice of the batch, or an index) read `slots` (rows x width
    flat cache slots, padding slot 0), the keys they may not see hidden by `bias` (rows, 1, 1, width), 0 or -inf
    (None: every row sees all its width). The bias is what SDPA would make of the bool mask in every call."""

    rows: slice | torch.Tensor
    width: int
    slots: torch.Tensor
    bias: torch.Tensor | None
    seen: torch.Tensor | None  # (rows,) bool: the row sees some key; None when every row does


@dataclass(frozen=True)
class SequenceReads:
    """One multi-token sequence: query rows start..end read `keys` (the padded width's range of the flat cache, or
    its slots) under `bias` (q_len, width) 0 / -inf (None: nothing hidden)."""

    start: int
    end: int
    keys: slice | torch.Tensor
    bias: torch.Tensor | None
    seen: torch.Tensor | None  # (q_len,) bool; None when every query sees some key


@dataclass(frozen=True)
class CacheReads:
    """Where every row of one paged call (or one engine step: decode rows first, then packed multi-token rows)
    reads the cache; build it once, use it for every layer that shares the tables and the window."""

    decode_groups: tuple[DecodeGroup, ...]
    sequences: tuple[SequenceReads, ...]
    complete: bool  # every output row is written by a group or a sequence (else the output starts zeroed)

    @classmethod
    def build(cls, block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
              window: tuple[int, int], sink_tokens: int, k_cache: torch.Tensor,
              decode_rows: int | None = None, dtype: torch.dtype | None = None) -> CacheReads:
        """Rows 0..decode_rows-1 of the table are decodes (all of them when cu_seqlens_q is None); cu_seqlens_q
        (int32, rebased to 0) packs the rows after them. window is normalised (left, right), right -1 unbounded.
        k_cache gives the geometry (page, token bytes, slots); its contents are not read. dtype: the queries'
        (default the cache's; an fp8 cache's keys are gathered in it)."""
        dtype = dtype or k_cache.dtype
        page, num_slots = k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1]
        row_bytes = k_cache[0, 0].numel() * decode_dtype(dtype).itemsize if k_cache.shape[0] else 0
        lens = seq_lens.tolist()
        if decode_rows is None:
            decode_rows = len(lens) if cu_seqlens_q is None else 0
        single = [(row, row, lens[row]) for row in range(decode_rows)]  # (table row, output row, seq_len)
        sequences = []
        starts = [] if cu_seqlens_q is None else cu_seqlens_q.tolist()
        for i, seq_len in enumerate(lens[decode_rows:]):
            start, end = decode_rows + starts[i], decode_rows + starts[i + 1]
            if end - start == 1:
                single.append((decode_rows + i, start, seq_len))
            elif end > start:  # None: a sequence with no keys at all, its rows stay 0
                sequences.append(_sequence_reads(block_table[decode_rows + i], seq_len, start, end, window,
                                                 sink_tokens, page, num_slots, dtype) if seq_len else None)
        groups = tuple(_decode_group(block_table, members, window, sink_tokens, page, decode_dtype(dtype))
                       for members in _width_groups(single, row_bytes))
        complete = (all(n for _, _, n in single) and all(s is not None and s.seen is None for s in sequences)
                    and all(g.seen is None for g in groups))
        return cls(groups, tuple(s for s in sequences if s is not None), complete)


@dataclass(frozen=True)
class CacheWrites:
    """Where a call's new tokens go in the cache: the int64 slots written, and the token rows they come from when
    some slots are -1 (skipped; None when every token is written). The engine builds it once per step."""

    slots: torch.Tensor
    rows: torch.Tensor | None

    @classmethod
    def build(cls, slot_mapping: torch.Tensor) -> CacheWrites:
        written = slot_mapping >= 0
        if bool(written.all()):
            return cls(slot_mapping.long(), None)
        return cls(slot_mapping[written].long(), written.nonzero().squeeze(1))


def write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          writes: CacheWrites, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """New tokens' K/V (tokens, Hkv, D) into their slots by index copies, quantized into an fp8 cache (scales
    given), else cast to the cache's dtype."""
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = new if writes.rows is None else new.index_select(0, writes.rows)
        rows = quantize(rows, scale, cache.dtype) if is_fp8(cache.dtype) else rows.to(cache.dtype)
        bytes_view(cache).view(-1, *cache.shape[2:]).index_copy_(0, writes.slots, bytes_view(rows))


def padded_width(seq_len: int) -> int:
    """The key width a sequence of this length attends over: rounded up to a multiple of WIDTH_STEP."""
    return -(-seq_len // WIDTH_STEP) * WIDTH_STEP


def _width_groups(single: list[tuple[int, int, int]], row_bytes: int) -> list[list[tuple[int, int, int]]]:
    """One-query rows by padded width, in their order, each width's rows split where a group's K buffer would pass
    GATHER_BYTES; rows of length 0 join no group (they see no key)."""
    by_width: dict[int, list] = {}
    for member in single:
        if member[2]:
            by_width.setdefault(padded_width(member[2]), []).append(member)
    groups = []
    for width, members in by_width.items():
        per_group = max(1, GATHER_BYTES // (width * row_bytes)) if row_bytes else len(members)
        groups += [members[i:i + per_group] for i in range(0, len(members), per_group)]
    return groups


def _decode_group(block_table, members, window, sink_tokens, page, dtype) -> DecodeGroup:
    table_rows, out_rows, lens = (list(column) for column in zip(*members))
    width = padded_width(max(lens))
    device = block_table.device
    positions = torch.arange(width)
    group_lens = torch.tensor(lens)
    tables = block_table.index_select(0, torch.tensor(table_rows, device=device)).long().cpu()
    # Columns past a row's table (its padding) read the last column: masked, like every position past seq_len.
    blocks = tables[:, (positions // page).clamp(max=tables.shape[1] - 1)]
    present = (positions[None, :] < group_lens[:, None]) & (blocks >= 0)
    visible = present.clone()
    query = group_lens[:, None] - 1
    if window[1] >= 0:
        visible &= positions[None, :] <= query + window[1]
    if window[0] >= 0:
        visible &= (positions[None, :] >= query - window[0]) | (positions[None, :] < sink_tokens)
    slots = torch.where(present, blocks.clamp(min=0) * page + positions % page, 0)
    seen = visible.any(dim=1)
    first = out_rows[0]
    rows = (slice(first, first + len(out_rows)) if out_rows == list(range(first, first + len(out_rows)))
            else torch.tensor(out_rows, device=device))
    return DecodeGroup(rows=rows, width=width, slots=slots.reshape(-1).to(device),
                       bias=None if bool(visible.all()) else _bias(visible[:, None, None], device, dtype),
                       seen=None if bool(seen.all()) else seen.to(device))


def _bias(visible: torch.Tensor, device, dtype) -> torch.Tensor:
    """0 where visible, -inf elsewhere, in the cache's dtype: torch 2.13's CPU SDPA misreads a float32 mask on
    float64 inputs (results off by O(1)); in the inputs' dtype it is exactly what SDPA makes of the bool mask."""
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible.to(device), float("-inf"))


def _sequence_reads(table_row, seq_len, start, end, window, sink_tokens, page, num_slots,
                    dtype) -> SequenceReads:
    width = padded_width(seq_len)
    slots, present = context_slots(table_row.cpu(), seq_len, page)
    visible = torch.zeros(end - start, width, dtype=torch.bool)
    visible[:, :seq_len] = _visible(end - start, seq_len, window, sink_tokens) & present[None, :]
    device = table_row.device
    first = int(slots[0])
    if bool(present.all()) and bool((slots[1:] - slots[:-1] == 1).all()) and first + width <= num_slots:
        keys = slice(first, first + width)
    else:  # padding reads slot 0, hidden
        keys = torch.cat([torch.where(present, slots, 0), torch.zeros(width - seq_len, dtype=torch.long)]).to(device)
    seen = visible.any(dim=1)
    seen = None if bool(seen.all()) else seen.to(device)
    # Never SDPA's is_causal for a fresh prompt: it cuts each query tile's keys short, so the prompt's tokens would
    # round otherwise than the same tokens chunked after a prefix-cache hit.
    return SequenceReads(start, end, keys, None if bool(visible.all()) else _bias(visible, device, dtype), seen)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, reads: CacheReads, scale: float,
           out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (tokens, Hq, D) over the cache as `reads` says; into `out` when given, else a new tensor.
    k_scale / v_scale: an fp8 cache's (the reads built with dtype=q.dtype)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k, flat_v = _Gathered(k_cache, k_scale, q.dtype), _Gathered(v_cache, v_scale, q.dtype)
    one_query = decode_dtype(q.dtype)
    group_k, group_v = _Gathered(k_cache, k_scale, one_query), _Gathered(v_cache, v_scale, one_query)
    result = torch.empty_like(q) if out is None else out
    if not reads.complete:
        result.zero_()
    for group in reads.decode_groups:
        count = group.slots.numel() // group.width
        keys, values = (flat.index_select(0, group.slots).view(count, group.width, num_kv_heads, head_dim)
                        .transpose(1, 2) for flat in (group_k, group_v))
        # (rows, Hq, 1, D) against (rows, Hkv, width, D); GQA through enable_gqa, no copies per query head.
        queries = q[group.rows].unsqueeze(2).to(one_query)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.bias, scale=scale,
                                                  enable_gqa=True).squeeze(2).to(q.dtype)
        if group.seen is not None:
            attended = torch.where(group.seen[:, None, None], attended, 0.0)
        if isinstance(group.rows, slice):
            result[group.rows] = attended
        else:
            result.index_copy_(0, group.rows, attended)
    for seq in reads.sequences:
        if isinstance(seq.keys, slice):
            keys, values = flat_k[seq.keys], flat_v[seq.keys]
        else:
            keys, values = flat_k.index_select(0, seq.keys), flat_v.index_select(0, seq.keys)
        # (1, H, N, D) views
        attended = F.scaled_dot_product_attention(
            q[seq.start:seq.end].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=seq.bias, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        if seq.seen is not None:
            attended = torch.where(seq.seen[:, None, None], attended, 0.0)
        result[seq.start:seq.end] = attended
    return result


class _Gathered:
    """One cache's rows as `attend` reads them (flat (slots, Hkv, D)): slices and index_selects in `dtype`,
    dequantized into it when the cache is fp8 (a scale given)."""

    def __init__(self, cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype):
        self.flat, self.scale, self.dtype = cache.view(-1, *cache.shape[2:]), scale, dtype

    def _out(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            return dequantize(rows, self.scale, self.dtype)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self._out(self.flat[rows])

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        return self._out(self.flat.index_select(dim, index))


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, window, sink_tokens, scale, out,
                    return_lse, k_scale=None, v_scale=None):
    """Arguments as checked by `ioattn.ops.paged.paged_attention` (window already normalised, causal folded in)."""
    page = k_cache.shape[1]
    if not return_lse:
        reads = CacheReads.build(block_table, seq_lens, cu_seqlens_q, window, sink_tokens, k_cache, dtype=q.dtype)
        return attend(q, k_cache, v_cache, reads, scale, out, k_scale, v_scale)
    decode = cu_seqlens_q is None
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    lens = seq_lens.tolist()
    starts = list(range(len(lens) + 1)) if decode else cu_seqlens_q.tolist()
    result = torch.zeros_like(q) if out is None else out.zero_()
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    flat_k, flat_v = _Gathered(k_cache, k_scale, q.dtype), _Gathered(v_cache, v_scale, q.dtype)
    for row, seq_len in enumerate(lens):
        start, end = starts[row], starts[row + 1]
        if start == end or seq_len == 0:
            continue
        slots, present = context_slots(block_table[row], seq_len, page)
        keys, values = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
        visible = _visible(end - start, seq_len, window, sink_tokens).to(q.device) & present[None, :]
        _with_lse(q[start:end], keys, values, visible, scale, result[start:end], lse[start:end])
    return result, lse if decode else lse.t()


def _with_lse(q, keys, values, visible, scale, out, lse):
    """One sequence through the tiled float32 forward, with its visibility as a dense bool mask."""
    inputs = AttentionInputs(q[None], keys[None], values[None], scale, -1, -1, True,
                             attn_mask=visible[None, None].expand(1, q.shape[1], *visible.shape),
                             max_seqlen_q=q.shape[0], max_seqlen_k=keys.shape[0])
    torch_backend.attention_forward(inputs, out[None], lse.t()[None])
