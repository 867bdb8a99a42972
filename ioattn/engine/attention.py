"""The engine's attention seam: the paged KV cache of every layer, the plans that move its blocks, and the attention
the model's layers call for one step.

`PagedAttention` owns each layer's K and V cache (and the CPU swap pool), executes the KV manager's plans
(copy-on-write copies, swaps, block export/import for disaggregated serving), turns a step's layout into a
`StepAttention` and warms up by asking `ioattn.ops.paged` which variants exist. The model receives the
`StepAttention` with its inputs and calls `ctx.attend(q, k, v, layer_idx)` in each layer: new K/V into their cache
slots, then attention over each sequence's blocks. Rows of one token (the scheduler puts running decodes first)
attend through the decode path; the packed chunks after them as multi-token queries, each call seeing only its own
rows' widest table (the split heuristic and the gathered path size themselves from the table width).

MLA models (DeepSeek-V2/V3, `config.mla`): one latent cache per layer, (num_blocks, block_size, 1, kv_lora_rank +
qk_rope_head_dim) in the model's dtype, each token's [latent ‖ k_rope] row, and no V cache; the layers call
`ctx.attend_mla(q_nope, q_rope, latent, k_rope, layer_idx, projection)`. Decode rows attend in the absorbed form
(`projection.absorb` folds W_UK into the query, `ioattn.ops.mla.mla_paged_attention` reads only the latent rows,
`projection.output` applies W_UV), and so do the multi-token rows of a step whose longest row has at most
`absorbed_max_query` tokens (speculative verification, short prompt chunks: the kernel's multi-token queries);
longer ones gather their whole context's latent rows from the cache, expand them to per-head K/V and run
`expanded_attention`, as the model's own dense path does: past that length expanding the context once costs fewer
FLOPs than attending over the 576-wide rows (170 tokens for DeepSeek-V2/V3's shapes). No window, sinks or fp8 for
MLA yet.

FP8 caches (`kv_cache_dtype`): the caches hold fp8, each layer's K and V scales (float32, one per KV head, see
`ioattn.engine.kv_scales`) live here on the device and go to every cache write and attention call; blocks move
as bytes (copies, swaps, export/import); `prefix_key()` is the identity of the cache's dtype and scales, which the
engine puts into every prefix-cache key, so blocks written in another dtype or with other scales are never hit.
Calibrated scales come with a rotation (`KVScales.rotation`): the cache then holds K and V rotated, and `attend`
rotates q and the output to match (three small matmuls and one for the output per layer, in the model's dtype).

Backends: "triton" (the paged kernels; CUDA, or Triton's interpreter on the CPU for tests) and "torch" (the exact
CPU path of `ioattn.ops.torch_paged`). The tables come from the KV manager's plans and are valid by construction;
when index contents are checked (CPU tensors, or IOATTN_VALIDATE=1, see `ioattn.ops.checks`) each step's tables,
lengths and slots are checked once on the host, before they reach the device, instead of in every layer's call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ioattn.engine.transfer import to_device
from ioattn.engine.kv_scales import KVScales
from ioattn.models.deepseek import expanded_attention
from ioattn.ops.cache import copy_blocks, reshape_and_cache, swap_blocks
from ioattn.ops import torch_paged
from ioattn.ops.checks import (
    HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, checks_contents, normalized_window, softmax_scale_or_default,
)
from ioattn.ops.fp8 import KV_ROTATION, bytes_view, is_fp8, kv_cache_dtype_name, kv_rotation
from ioattn.ops.mla import compile_mla_variants, mla_paged_attention, mla_workspace
from ioattn.ops.paged import compile_variants, paged_attention, paged_workspace
from ioattn.ops.paged_checks import check_slot_contents, check_table_contents

BACKENDS = ("auto", "triton", "torch")
# The expanded MLA prefill's backend for each of ours: the varlen kernel's entry point, or torch SDPA.
EXPANDED_BACKEND = {"triton": "ioattn", "torch": "torch"}


def caches_per_layer(config) -> int:
    """Caches a layer holds: K and V, or an MLA model's single latent cache."""
    return 1 if config.mla is not None else 2


def latent_row_split(width: int) -> int:
    """How many equal "heads" a latent row of `width` values is written as: the fewest whose width
    `reshape_and_cache` takes (a multiple of 8, at most 256; 576 -> 3 x 192). The row is contiguous, so any split
    writes the same bytes."""
    for parts in range(1, width // HEAD_DIM_MULTIPLE + 1):
        if width % parts == 0 and width // parts <= MAX_HEAD_DIM and (width // parts) % HEAD_DIM_MULTIPLE == 0:
            return parts
    raise ValueError(f"an MLA cache row of {width} values (kv_lora_rank + qk_rope_head_dim) must be a multiple of "
                     f"{HEAD_DIM_MULTIPLE} for the Triton cache writes")


def absorbed_max_query(mla) -> int:
    """The longest multi-token row whose attention costs fewer FLOPs absorbed than expanded (DeepSeek-V2/V3: 170).
    Expanded, every context token goes through kv_b_proj once (rank·(dn + dv) multiply-adds a head) and each
    query-key pair costs (dn + dr) + dv; absorbed, nothing is expanded and a pair costs (rank + dr) + rank."""
    rank, dn, dr, dv = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    return rank * (dn + dv) // max(1, (rank + dr + rank) - (dn + dr + dv))


@dataclass(frozen=True)
class LatentContext:
    """Where a step's multi-token rows find their whole context in a latent cache: the flat slot of each context
    position (the rows' contexts back to back), their prefix sums, and a bound on the longest (the table width)."""

    slots: torch.Tensor  # (context tokens,) int64
    cu_seqlens_k: torch.Tensor  # (rows + 1,) int32
    max_seqlen_k: int

    @classmethod
    def build(cls, block_table: torch.Tensor, seq_lens: torch.Tensor, total: int, block_size: int) -> LatentContext:
        """block_table (rows, width) int32, seq_lens (rows,): the multi-token rows'; total = seq_lens.sum(), known on
        the host (so that no device value is read back)."""
        lens = seq_lens.long()
        cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int64, device=lens.device)
        torch.cumsum(lens, 0, out=cu[1:])
        rows = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
        positions = torch.arange(total, device=lens.device) - cu[rows]
        blocks = block_table[rows, positions // block_size].long()
        return cls(blocks * block_size + positions % block_size, cu.to(torch.int32), block_table.shape[1] * block_size)


@dataclass
class StepAttention:
    """One step's attention inputs (device tensors), handed to the model with the step's tokens."""

    owner: PagedAttention
    slot_mapping: torch.Tensor  # (T,) int64
    block_table: torch.Tensor  # (B, width) int32
    seq_lens: torch.Tensor  # (B,) int32: context length after this step
    cu_seqlens_q: torch.Tensor | None  # (B - decode_rows + 1,) int32; None for a decode-only step
    max_seqlen_q: int
    # Rows 0..decode_rows-1 hold one token each and attend as decodes; cu_seqlens_q / max_seqlen_q describe the
    # rows after them (rebased to 0).
    decode_rows: int = 0
    # The table columns the decode rows and the other rows use.
    table_widths: tuple[int, int] | None = None
    # MLA: the multi-token rows' context tokens (the host's sum of their seq_lens), and where those tokens sit in
    # the latent cache, worked out at the first layer and shared by all.
    chunk_context_tokens: int = 0
    latent_context: LatentContext | None = field(default=None, repr=False)
    # torch backend: where the rows read the cache, per window, worked out at the first layer and shared by all.
    cache_reads: dict[tuple[int, int], torch_paged.CacheReads] = field(default_factory=dict, repr=False)
    cache_writes: torch_paged.CacheWrites | None = field(default=None, repr=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.owner.attend(q, k, v, layer_idx, self)

    def attend_mla(self, q_nope, q_rope, latent, k_rope, layer_idx: int, projection) -> torch.Tensor:
        return self.owner.attend_mla(q_nope, q_rope, latent, k_rope, layer_idx, projection, self)


class PagedAttention:
    def __init__(self, config, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_cpu_blocks: int = 0, max_num_seqs: int = 256, backend: str = "auto",
                 kv_window: int | None = None, kv_sinks: int = 0, kv_cache_dtype: torch.dtype | None = None,
                 kv_scales: KVScales | None = None):
        """config: the model's `ModelConfig` (layers, KV heads, head dim, per-layer windows). dtype: the model's.
        backend: "triton", "torch" or "auto" (triton on CUDA, torch elsewhere). kv_window / kv_sinks: StreamingLLM
        attention, every layer seeing the first kv_sinks tokens and the last kv_window (itself included), so that
        the KV manager's `evict_window(seq, kv_sinks, kv_window)` may release the blocks in between (None: the
        model's own windows). kv_cache_dtype: None (the model's dtype) or an fp8 format, which needs `kv_scales`
        ((num_layers, num_kv_heads) for K and V). An MLA config (`config.mla`) gets one latent cache per layer and
        takes none of kv_window, kv_sinks or an fp8 kv_cache_dtype."""
        self.mla = config.mla
        if self.mla is not None:
            refused = (("kv_window", kv_window is not None, kv_window), ("kv_sinks", kv_sinks != 0, kv_sinks),
                       ("kv_cache_dtype", kv_cache_dtype not in (None, dtype), kv_cache_dtype))
            for name, given, value in refused:
                if given:
                    raise ValueError(f"{name}={value!r} is not supported for MLA models ({config.model_type}) yet: "
                                     "their latent cache is kept whole, in the model's dtype")
        if backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
        if kv_window is not None and not (isinstance(kv_window, int) and kv_window >= 1):
            raise ValueError(f"kv_window must be None or an int >= 1 (tokens a query sees, itself included), got "
                             f"{kv_window!r}")
        if not (isinstance(kv_sinks, int) and kv_sinks >= 0) or (kv_sinks and kv_window is None):
            raise ValueError(f"kv_sinks must be an int >= 0, and > 0 only with a kv_window, got {kv_sinks!r}")
        self.device = torch.device(device)
        self.backend = backend if backend != "auto" else ("triton" if self.device.type == "cuda" else "torch")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.window_sizes = tuple(config.window_size(i) if kv_window is None else (kv_window - 1, 0)
                                  for i in range(config.num_layers))
        self.sink_tokens = kv_sinks
        self.dtype = dtype
        self.cache_dtype = kv_cache_dtype or dtype
        self.kv_scales = kv_scales
        self.k_scales = self.v_scales = [None] * config.num_layers
        self.rotation = None
        if is_fp8(self.cache_dtype):
            expected = (config.num_layers, config.num_kv_heads)
            if kv_scales is None or kv_scales.k.shape != expected or kv_scales.v.shape != expected:
                raise ValueError(f"kv_scales must hold (num_layers, num_kv_heads) = {expected} K and V scales for an "
                                 f"fp8 cache, got {None if kv_scales is None else tuple(kv_scales.k.shape)}")
            # One allocation per layer: rows of one (layers, heads) tensor would sit at offsets that are not all
            # 16-byte aligned, and Triton specialises on that (a kernel compiled mid-serving for the odd layers).
            self.k_scales = [row.clone() for row in kv_scales.k.to(self.device, torch.float32).unbind(0)]
            self.v_scales = [row.clone() for row in kv_scales.v.to(self.device, torch.float32).unbind(0)]
            if kv_scales.rotation is not None:
                rotation = kv_rotation(config.head_dim)
                if kv_scales.rotation != KV_ROTATION or rotation is None:
                    raise ValueError(f"kv_scales.rotation {kv_scales.rotation!r} does not apply to head_dim "
                                     f"{config.head_dim} (only {KV_ROTATION!r}, for power-of-two head dims)")
                # q M, x M / D and o' M^T (see kv_rotation); ±1 and ±1/D are exact in the model's dtype.
                self.rotation = (rotation.to(self.device, dtype), (rotation / config.head_dim).to(self.device, dtype),
                                 rotation.t().contiguous().to(self.device, dtype))
        elif kv_scales is not None:
            raise ValueError(f"kv_scales apply to fp8 caches only, not {self.cache_dtype}")
        # MLA: num_kv_heads is 1 and head_dim kv_lora_rank + qk_rope_head_dim, so k_caches are the latent caches.
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.caches_per_layer = caches_per_layer(config)
        # Zeroed, not empty: a kernel tile may load (masked) slots no token wrote yet; they must not be NaN.
        self.k_caches = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in range(config.num_layers)]
        self.v_caches = [] if self.mla is not None else [
            torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in range(config.num_layers)]
        self.absorbed_max_query = 0 if self.mla is None else absorbed_max_query(self.mla)
        self.cache_layout = (
            f"latent {self.mla.kv_lora_rank} + rope {self.mla.qk_rope_head_dim} per token per layer, one cache"
            if self.mla is not None else
            f"K and V per KV head ({config.num_kv_heads} heads x {config.head_dim}) per token per layer")
        # The swap pool is only ever read where a swap-out wrote; pinned on CUDA so that copies are asynchronous.
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = self.device.type == "cuda"
        self.cpu_k_caches = [torch.empty(cpu_shape, dtype=self.cache_dtype, pin_memory=pin) for _ in self.k_caches]
        self.cpu_v_caches = [torch.empty(cpu_shape, dtype=self.cache_dtype, pin_memory=pin) for _ in self.v_caches]
        self.workspace = None
        if self.backend == "triton" and self.mla is not None:  # split scratch for the largest decode batch
            self.workspace = mla_workspace(max(max_num_seqs, 1), config.num_heads, self.mla.kv_lora_rank,
                                           device=self.device)
            self.row_split = latent_row_split(config.head_dim)
        elif self.backend == "triton":
            self.workspace = paged_workspace(max(max_num_seqs, 1), config.num_heads, config.head_dim,
                                             device=self.device)
        self.checks_tables = checks_contents(None, self.device)

    @staticmethod
    def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V (MLA: the latent cache alone), in the cache's dtype (fp8: one
        byte per element)."""
        per_cache = block_size * config.num_kv_heads * config.head_dim * dtype.itemsize
        return caches_per_layer(config) * config.num_layers * per_cache

    def describe(self) -> dict:
        """What `engine.stats()` reports about attention: backend, cache geometry and dtype (and, for fp8, where
        its scales came from), how inputs are checked."""
        checks = ("every step's tables, lengths and slots checked on the host (CPU, or IOATTN_VALIDATE=1)"
                  if self.checks_tables else
                  "tables built from the KV manager's plans, trusted (IOATTN_VALIDATE=1 checks every step)")
        return {"backend": self.backend, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "cache_layout": self.cache_layout, "windows": sorted(set(self.window_sizes)),
                "sink_tokens": self.sink_tokens,
                "cache_dtype": kv_cache_dtype_name(self.cache_dtype),
                "kv_scales": None if self.kv_scales is None else self.kv_scales.describe(),
                "kernel_inputs": checks}

    def prefix_key(self):
        """What the prefix-cache key holds of this cache's format: None for a cache in the model's dtype (keys as
        before), else the fp8 format and the scales' identity."""
        if self.kv_scales is None:
            return None
        return ("kv_cache", kv_cache_dtype_name(self.cache_dtype), self.kv_scales.identity())

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The caches of one layer: (K, V), or (latent,) for an MLA model."""
        return (self.k_caches[layer], self.v_caches[layer]) if self.v_caches else (self.k_caches[layer],)

    # -- plans: copies, swaps and block transfers ---------------------------------------------------------------

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: every layer's block dst <- block src, before the step writes into dst."""
        if copies:
            mapping = to_device(copies, torch.int64, self.device)
            copy_blocks(self.k_caches, self.v_caches, mapping, validate=self.checks_tables)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Swap-outs (gpu, cpu) first: a block they empty may be the destination of a swap-in (cpu, gpu)."""
        for moves, to_cpu in ((swap_out, True), (swap_in, False)):
            if not moves:
                continue
            mapping = torch.tensor(moves, dtype=torch.int64)
            pools = zip((*self.k_caches, *self.v_caches), (*self.cpu_k_caches, *self.cpu_v_caches))
            for device_cache, cpu_cache in pools:
                src, dst = (device_cache, cpu_cache) if to_cpu else (cpu_cache, device_cache)
                swap_blocks(src, dst, mapping)

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """(layers, caches_per_layer, len(blocks), block_size, kv_heads, head_dim): the blocks' K and V (MLA: latent)
        in the cache's dtype (prefix export)."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        kv = torch.stack([torch.stack([bytes_view(cache).index_select(0, index) for cache in self.layer_caches(layer)])
                          for layer in range(len(self.k_caches))])
        return kv.view(self.cache_dtype)  # an fp8 cache's blocks gathered as bytes

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """The reverse of `read_blocks`: kv[:, :, i] lands in block blocks[i] of every layer (prefix import). An fp8
        cache takes only blocks of its own format (quantized with its scales: the prefix key checked that)."""
        if is_fp8(self.cache_dtype) and kv.dtype != self.cache_dtype:
            raise ValueError(f"kv: blocks for a {kv_cache_dtype_name(self.cache_dtype)} cache must be in that format, "
                             f"got {kv.dtype}")
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        for layer in range(len(self.k_caches)):
            for i, cache in enumerate(self.layer_caches(layer)):
                bytes_view(cache).index_copy_(0, index, bytes_view(kv[layer, i].to(cache.dtype)))

    # -- one step ---------------------------------------------------------------------------------------------

    def check_step(self, tables: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
                   slots: torch.Tensor) -> None:
        """The host copies of a step's inputs, checked before they reach the device (see the module docstring)."""
        for window in sorted(set(self.window_sizes)):
            check_table_contents(tables, seq_lens, q_lens, self.num_blocks, self.block_size, window[0],
                                 self.sink_tokens)
        check_slot_contents(slots, self.num_blocks * self.block_size)

    def step(self, slot_mapping, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, decode_rows,
             table_widths=None, chunk_context_tokens=0) -> StepAttention:
        return StepAttention(self, slot_mapping, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, decode_rows,
                             table_widths, chunk_context_tokens)

    def attend(self, q, k, v, layer_idx: int, ctx: StepAttention) -> torch.Tensor:
        """New tokens' K and V into the layer's cache, then attention for q over the cache -> (T, Hq, D). A rotated
        fp8 cache (see `ioattn.engine.kv_scales`) gets K and V rotated and q and the output rotated to match."""
        if self.rotation is None:
            return self._attend(q, k, v, layer_idx, ctx)
        forward, scaled, back = self.rotation
        return self._attend(q @ forward, k @ scaled, v @ scaled, layer_idx, ctx) @ back

    def _attend(self, q, k, v, layer_idx: int, ctx: StepAttention) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        window = self.window_sizes[layer_idx]
        scales = dict(k_scale=self.k_scales[layer_idx], v_scale=self.v_scales[layer_idx])
        common = dict(causal=True, window_size=window, sink_tokens=self.sink_tokens, backend=self.backend,
                      validate=False, **scales)
        if self.backend == "torch":
            if ctx.cache_writes is None:
                ctx.cache_writes = torch_paged.CacheWrites.build(ctx.slot_mapping)
            torch_paged.write(k, v, k_cache, v_cache, ctx.cache_writes, **scales)
            return torch_paged.attend(q, k_cache, v_cache, self._cache_reads(ctx, window, k_cache),
                                      softmax_scale_or_default(None, q.shape[-1]), **scales)
        reshape_and_cache(k, v, k_cache, v_cache, ctx.slot_mapping, backend=self.backend, validate=False, **scales)
        if ctx.cu_seqlens_q is None:
            return paged_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, workspace=self.workspace,
                                   **common)
        n = ctx.decode_rows
        out = torch.empty_like(q)
        decode_width, chunk_width = ctx.table_widths or (ctx.block_table.shape[1],) * 2
        if n:
            paged_attention(q[:n], k_cache, v_cache, ctx.block_table[:n, :decode_width], ctx.seq_lens[:n],
                            workspace=self.workspace, out=out[:n], **common)
        paged_attention(q[n:], k_cache, v_cache, ctx.block_table[n:, :chunk_width], ctx.seq_lens[n:],
                        cu_seqlens_q=ctx.cu_seqlens_q, max_seqlen_q=ctx.max_seqlen_q, out=out[n:], **common)
        return out

    def attend_mla(self, q_nope, q_rope, latent, k_rope, layer_idx: int, projection,
                   ctx: StepAttention) -> torch.Tensor:
        """New tokens' [latent ‖ k_rope] rows into the layer's latent cache, then decode rows (and short multi-token
        rows) absorbed, longer multi-token rows expanded (see the module docstring) -> (T, H, v_head_dim)."""
        cache, rank = self.k_caches[layer_idx], self.mla.kv_lora_rank
        rows = torch.cat((latent, k_rope), dim=-1)[:, None, :]  # (T, 1, rank + rope): one "KV head"
        # The row is both key and value, so one tensor is both; the Triton write takes it as row_split narrower heads.
        if self.backend == "torch":
            if ctx.cache_writes is None:
                ctx.cache_writes = torch_paged.CacheWrites.build(ctx.slot_mapping)
            torch_paged.write(rows, rows, cache, cache, ctx.cache_writes)
        else:
            parts = self.row_split
            split_rows = rows.view(rows.shape[0], parts, -1)
            split_cache = cache.view(*cache.shape[:2], parts, -1)
            reshape_and_cache(split_rows, split_rows, split_cache, split_cache, ctx.slot_mapping, backend=self.backend,
                              validate=False)
        n = q_nope.shape[0] if ctx.cu_seqlens_q is None else ctx.decode_rows
        decode_width, chunk_width = ctx.table_widths or (ctx.block_table.shape[1],) * 2
        # Decode rows, and multi-token rows short enough that expanding their context would cost more, absorbed.
        absorbed = q_nope.shape[0] if ctx.cu_seqlens_q is None or ctx.max_seqlen_q <= self.absorbed_max_query else n
        query = torch.cat((projection.absorb(q_nope[:absorbed]), q_rope[:absorbed]), dim=-1)
        common = dict(v_head_dim=rank, softmax_scale=projection.softmax_scale, backend=self.backend, validate=False)
        o_latent = query.new_empty(absorbed, q_nope.shape[1], rank)
        if n:
            mla_paged_attention(query[:n], cache, ctx.block_table[:n, :decode_width], ctx.seq_lens[:n],
                                workspace=self.workspace, out=o_latent[:n], **common)
        if absorbed > n:  # split scratch of its own, as the paged path's chunks: the workspace is the decode rows'

            mla_paged_attention(query[n:], cache, ctx.block_table[n:, :chunk_width], ctx.seq_lens[n:],
                                cu_seqlens_q=ctx.cu_seqlens_q, max_seqlen_q=ctx.max_seqlen_q, out=o_latent[n:],
                                **common)
        decoded = projection.output(o_latent) if absorbed else None
        if absorbed == q_nope.shape[0]:
            return decoded
        context = ctx.latent_context
        if context is None:
            assert ctx.chunk_context_tokens > 0, "a step with multi-token rows needs their chunk_context_tokens"
            context = ctx.latent_context = LatentContext.build(ctx.block_table[n:, :chunk_width], ctx.seq_lens[n:],
                                                               ctx.chunk_context_tokens, self.block_size)
        cached = cache.view(-1, cache.shape[-1]).index_select(0, context.slots)  # (context tokens, rank + rope)
        k_nope, v = projection.expand(cached[:, :rank])
        chunks = expanded_attention(q_nope[n:], q_rope[n:], k_nope, cached[:, rank:], v, ctx.cu_seqlens_q,
                                    context.cu_seqlens_k, ctx.max_seqlen_q, context.max_seqlen_k,
                                    projection.softmax_scale, backend=EXPANDED_BACKEND[self.backend])
        return torch.cat((decoded, chunks)) if n else chunks

    def _cache_reads(self, ctx: StepAttention, window: tuple[int, int], k_cache) -> torch_paged.CacheReads:
        """The torch backend's reads for this step and window, built once: every layer of the step shares the
        tables, so the gathers' indices and masks are not rebuilt per layer."""
        reads = ctx.cache_reads.get(window)
        if reads is None:
            reads = ctx.cache_reads[window] = torch_paged.CacheReads.build(
                ctx.block_table, ctx.seq_lens, ctx.cu_seqlens_q, normalized_window(window, True), self.sink_tokens,
                k_cache, decode_rows=ctx.decode_rows, dtype=self.dtype)
        return reads

    @torch.inference_mode()
    def warm_up(self, num_heads: int, max_tokens: int) -> None:
        """Compile every variant a step can take before serving, not during it (lab/README.md "compiles during
        serving"): `ioattn.ops.paged.compile_variants` for each window of the model; for MLA the MLA kernel's
        decode and multi-token variants (`ioattn.ops.mla.compile_mla_variants`) and the expanded path's varlen
        forward at one query token and at `max_tokens`."""
        if self.backend != "triton":
            return
        if self.mla is not None:
            self._warm_up_mla(num_heads, max_tokens)
            return
        for window in sorted(set(self.window_sizes)):
            compile_variants(num_heads, self.k_caches[0], self.v_caches[0], window_size=window,
                             max_tokens=max_tokens, workspace=self.workspace, dtype=self.dtype,
                             k_scale=self.k_scales[0], v_scale=self.v_scales[0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up_mla(self, num_heads: int, max_tokens: int) -> None:
        mla, cache = self.mla, self.k_caches[0]
        compile_mla_variants(num_heads, cache, mla.kv_lora_rank, workspace=self.workspace,
                             max_seqlen_q=min(self.absorbed_max_query, max_tokens))
        q_nope, k_nope = (cache.new_zeros(1, num_heads, mla.qk_nope_head_dim) for _ in range(2))
        q_rope, k_rope = cache.new_zeros(1, num_heads, mla.qk_rope_head_dim), cache.new_zeros(1, mla.qk_rope_head_dim)
        v = cache.new_zeros(1, num_heads, mla.v_head_dim)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        for max_seqlen_q in sorted({1, max_tokens}):  # the forward's table tells short from long queries
            expanded_attention(q_nope, q_rope, k_nope, k_rope, v, cu, cu, max_seqlen_q, max_seqlen_q, 1.0,
                               backend=EXPANDED_BACKEND[self.backend])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
