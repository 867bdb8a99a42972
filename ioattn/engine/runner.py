"""Model runner: stages one flat, packed batch per step, runs the model on it and replays CUDA graphs.

A `Batch` holds one entry per scheduled chunk — prefill chunks and decode tokens alike — column by column, built
by the engine from the scheduler's chunks and the KV manager's block tables. The runner lays their tokens out as
one `(T,)` vector with positions and cache slots (slot = table[position // block_size] * block_size + offset,
computed for the whole batch at once), asks the engine's `PagedAttention` (`ioattn.engine.attention`) for the
step's attention context, and runs the model, whose layers call it. Decode-only batches on CUDA replay graphs
captured per batch size (rows padded to the captured size: slot -1 is not written, seq_len 0 reads nothing).

`run` executes a whole step plan: the attention seam's swaps (swap-outs first: a block a swap-out empties may be
refilled by a swap-in of the same step) and copy-on-write copies, then the forward pass.

The step's inputs are written into persistent host buffers (`HostStaging`, pinned on CUDA) and copied to the
device asynchronously: building a step costs the host no allocation and never waits for the GPU. Input tokens
the host does not know yet (asynchronous scheduling: the previous step's samples, still on the device) come
with a `TokenFeed` and are copied into the step's input ids on the device, after the host's copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ioattn.engine.attention import PagedAttention
from ioattn.intmath import cdiv
from ioattn.models.llama import DenseCausalAttention, LlamaForCausalLM

# Decode batch sizes captured as CUDA graphs (up to max_num_seqs): small ones exactly, then multiples of 8.
GRAPH_BATCH_SIZES = (1, 2, 4, *range(8, 513, 8))


class HostStaging:
    """Host buffers a step's inputs are written into (through numpy views) and copied to the device from.

    Each buffer is allocated once per name and regrown only when a batch outgrows it; on CUDA it is pinned, so
    its copy is asynchronous. That makes reuse a race: a step must not overwrite a buffer whose copy of the
    previous step has not run yet. `reuse()` waits on the event recorded after the last step's copies
    (`copies_issued()`). A synchronous engine has read the previous step's tokens, so that event has passed;
    one that schedules asynchronously has read the tokens of the step before, and the copies wait only for the
    last kernels of that step to drain: they are the first work of the next one.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._copied = torch.cuda.Event() if self.pin else None
        self._pending = False

    def reuse(self) -> None:
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def copies_issued(self) -> None:
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
            self._pending = True

    def host(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `numel` entries of buffer `name` (1-D); their content is whatever was written last."""
        buffer = self._host.get(name)
        if buffer is None or buffer.numel() < numel:
            # A regrown buffer drops the old one; the caching host allocator keeps pinned memory that an
            # in-flight copy still reads until that copy has run.
            size = numel if buffer is None else max(numel, 2 * buffer.numel())
            buffer = torch.zeros(size, dtype=dtype, pin_memory=self.pin)
            self._host[name] = buffer
        return buffer[:numel]

    def array(self, name: str, numel: int, dtype: torch.dtype) -> np.ndarray:
        return self.host(name, numel, dtype).numpy()

    def upload(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device copy of the first `numel` entries of buffer `name` (the same memory on a CPU device)."""
        return self.host(name, numel, dtype).to(self.device, non_blocking=True)


@dataclass
class Batch:
    """One step, one entry per chunk: chunk i computes `num_tokens[i]` tokens at positions `starts[i]`.. of its
    sequence (all chunks' tokens back to back in `token_ids`), over its sequence's whole block table (int32,
    all tables back to back in `tables`, `table_lens[i]` entries each); `samples[i]`: logits for its last token."""

    token_ids: list[int]
    starts: list[int]
    num_tokens: list[int]
    samples: list[bool]
    tables: bytes
    table_lens: list[int]

    def __len__(self) -> int:
        return len(self.starts)


@dataclass
class Layout:
    """A batch's per-token positions and slots, its rows' context lengths and block tables (views of staging)."""

    positions: np.ndarray  # (T,) int64
    slots: np.ndarray  # (T,) int64
    seq_lens: np.ndarray  # (B,) int64
    tables: np.ndarray  # (B, width) int32; columns past a row's table hold stale ids (see `lay_out`)


def lay_out(batch: Batch, tables: np.ndarray, block_size: int) -> Layout:
    """Fill `tables` (B, width >= every table) with the batch's block tables and place every token. Columns past a
    row's table keep stale ids: the kernels read table entries only for positions below the row's seq_len, so no
    padding needs writing."""
    num_rows = len(batch)
    starts = np.array(batch.starts, dtype=np.int64)
    lengths = np.array(batch.table_lens, dtype=np.int64)
    width = int(lengths.max())
    used = tables[:, :width]
    used[np.arange(width) < lengths[:, None]] = np.frombuffer(batch.tables, dtype=np.int32)
    if len(batch.token_ids) == num_rows:  # one token per chunk: a decode batch
        rows, positions, seq_lens = np.arange(num_rows), starts, starts + 1
    else:
        counts = np.array(batch.num_tokens, dtype=np.int64)
        ends = np.cumsum(counts)
        rows = np.repeat(np.arange(num_rows), counts)
        positions = np.arange(ends[-1]) - np.repeat(ends - counts - starts, counts)
        seq_lens = starts + counts
    blocks = used[rows, positions // block_size]
    if (blocks < 0).any():
        raise ValueError("a token of the batch falls in an evicted block (EVICTED table entry): it has no slot")
    return Layout(positions, blocks.astype(np.int64) * block_size + positions % block_size, seq_lens, used)


def _leading_single_tokens(num_tokens: list[int]) -> int:
    """How many chunks at the front of the batch compute one token each."""
    for i, n in enumerate(num_tokens):
        if n != 1:
            return i
    return len(num_tokens)


@dataclass
class TokenFeed:
    """Input tokens still on the device: packed-batch token `rows[i]` is `source[source_rows[i]]` (the batch holds
    a placeholder there)."""

    rows: list[int]
    source_rows: list[int]
    source: torch.Tensor  # int64, on the runner's device

    def apply(self, input_ids: torch.Tensor, staging: HostStaging) -> None:
        staging.array("feed_rows", len(self.rows), torch.int64)[:] = self.rows
        staging.array("feed_source_rows", len(self.rows), torch.int64)[:] = self.source_rows
        rows = staging.upload("feed_rows", len(self.rows), torch.int64)
        source_rows = staging.upload("feed_source_rows", len(self.rows), torch.int64)
        input_ids.index_copy_(0, rows, self.source.index_select(0, source_rows))


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: PagedAttention,
        *,
        max_model_len: int,
        max_num_seqs: int = 256,
        use_cuda_graphs: bool = True,
        max_num_batched_tokens: int | None = None,
    ):
        """attention: the engine's paged-attention seam (caches, plans, the step context the model calls).
        max_num_batched_tokens (default max_model_len): the most query tokens of one step, for the warm-up."""
        self.model = model
        self.attention = attention
        self.config = model.config
        self.device = model.inv_freq.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.block_size = attention.block_size
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._staging = HostStaging(self.device)
        if self.device.type == "cuda":
            attention.warm_up(self.config.num_heads, max_num_batched_tokens or max_model_len)
            if use_cuda_graphs and attention.backend == "triton":
                self._capture_graphs(max_num_seqs)

    def run(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], copies: list[tuple[int, int]],
            batch: Batch, feed: TokenFeed | None = None) -> torch.Tensor:
        """One step plan: the swaps and copy-on-write copies, then the forward pass (see `execute`)."""
        self.attention.swap(swap_out, swap_in)
        self.attention.copy_blocks(copies)
        return self.execute(batch, feed)

    # -- the forward pass ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: Batch, feed: TokenFeed | None = None, every_token: bool = False) -> torch.Tensor:
        """Run one packed batch; float32 logits (number of sampling chunks, vocab), in chunk order, or with
        `every_token` one row per token of the batch (scoring a text: `ioattn eval perplexity`)."""
        if not len(batch):
            return torch.empty(0, self.config.vocab_size, device=self.device)
        decode = len(batch.token_ids) == len(batch)
        graph_size = next((s for s in self.graphs if s >= len(batch)), None) if decode else None
        self._staging.reuse()
        if graph_size is not None:
            hidden = self._replay(graph_size, batch, feed)
        else:
            hidden = self._eager(batch, decode, feed)
        if every_token:
            self._staging.copies_issued()
            return self.model.compute_logits(hidden)
        if decode and all(batch.samples):
            self._staging.copies_issued()
            return self.model.compute_logits(hidden)
        last_rows = np.cumsum(batch.num_tokens)[np.array(batch.samples, dtype=bool)] - 1
        self._staging.array("sample_rows", len(last_rows), torch.int64)[:] = last_rows
        rows = self._staging.upload("sample_rows", len(last_rows), torch.int64)
        self._staging.copies_issued()
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _eager(self, batch: Batch, decode: bool, feed: TokenFeed | None) -> torch.Tensor:
        staging, num_rows, num_tokens = self._staging, len(batch), len(batch.token_ids)
        # A table exactly as wide as the longest one: the kernels size their key splits from its width.
        width = max(batch.table_lens)
        tables = staging.array("block_table", num_rows * width, torch.int32).reshape(num_rows, width)
        layout = lay_out(batch, tables, self.block_size)
        staging.array("input_ids", num_tokens, torch.int64)[:] = batch.token_ids
        staging.array("positions", num_tokens, torch.int64)[:] = layout.positions
        staging.array("slot_mapping", num_tokens, torch.int64)[:] = layout.slots
        staging.array("seq_lens", num_rows, torch.int32)[:] = layout.seq_lens
        # The leading one-token rows (the scheduler puts running decodes first) attend through the decode path;
        # the rest as packed multi-token queries, whose grid then spans only their own query tiles.
        decode_rows = num_rows if decode else _leading_single_tokens(batch.num_tokens)
        if not decode:
            cu_seqlens = staging.array("cu_seqlens_q", num_rows - decode_rows + 1, torch.int32)
            cu_seqlens[0] = 0
            np.cumsum(batch.num_tokens[decode_rows:], out=cu_seqlens[1:])
        if self.attention.checks_tables:
            q_lens = torch.tensor(batch.num_tokens)
            self.attention.check_step(torch.from_numpy(layout.tables), torch.from_numpy(layout.seq_lens), q_lens,
                                      torch.from_numpy(layout.slots))
        ctx = self.attention.step(
            slot_mapping=staging.upload("slot_mapping", num_tokens, torch.int64),
            block_table=staging.upload("block_table", num_rows * width, torch.int32).view(num_rows, width),
            seq_lens=staging.upload("seq_lens", num_rows, torch.int32),
            cu_seqlens_q=None if decode else staging.upload("cu_seqlens_q", num_rows - decode_rows + 1, torch.int32),
            max_seqlen_q=max(batch.num_tokens[decode_rows:] or [1]),
            decode_rows=decode_rows,
            table_widths=(max(batch.table_lens[:decode_rows] or [1]), max(batch.table_lens[decode_rows:] or [1])),
            # MLA gathers the multi-token rows' whole contexts; counted here, that gather reads no device value back.
            chunk_context_tokens=int(layout.seq_lens[decode_rows:].sum()),
        )
        input_ids = staging.upload("input_ids", num_tokens, torch.int64)
        positions = staging.upload("positions", num_tokens, torch.int64)
        if feed is not None:
            feed.apply(input_ids, staging)
        return self.model(input_ids, positions, ctx)

    # -- CUDA graphs for decode ------------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_graphs(self, max_num_seqs: int) -> None:
        """Capture one decode step per batch size; the static buffers are shared by all graphs."""
        max_bs = max(s for s in GRAPH_BATCH_SIZES if s <= max(max_num_seqs, 1))
        to = dict(device=self.device)
        self._graph_ids = torch.zeros(max_bs, dtype=torch.int64, **to)
        self._graph_positions = torch.zeros(max_bs, dtype=torch.int64, **to)
        self._graph_slots = torch.full((max_bs,), -1, dtype=torch.int64, **to)
        self._graph_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, **to)
        self._graph_lens = torch.zeros(max_bs, dtype=torch.int32, **to)
        pool = None
        for size in sorted((s for s in GRAPH_BATCH_SIZES if s <= max_bs), reverse=True):
            ctx = self.attention.step(
                slot_mapping=self._graph_slots[:size], block_table=self._graph_tables[:size],
                seq_lens=self._graph_lens[:size], cu_seqlens_q=None, max_seqlen_q=1, decode_rows=size,
            )
            ids, positions = self._graph_ids[:size], self._graph_positions[:size]
            self.model(ids, positions, ctx)  # warm-up: compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, ctx)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        self.graphs = dict(sorted(self.graphs.items()))

    def _replay(self, size: int, batch: Batch, feed: TokenFeed | None) -> torch.Tensor:
        """Stage the decode rows into the graph's static inputs and replay the graph captured for `size` rows.
        Padding rows n..size get slot -1 (nothing written) and seq_len 0 (nothing read: their stale table rows
        and token ids are never used)."""
        n, staging, max_blocks = len(batch), self._staging, self.max_blocks_per_seq
        layout = lay_out(batch, staging.array("graph_tables", n * max_blocks, torch.int32).reshape(n, max_blocks),
                         self.block_size)
        if self.attention.checks_tables:
            self.attention.check_step(torch.from_numpy(layout.tables), torch.from_numpy(layout.seq_lens), torch.ones(n, dtype=torch.int64),
                                      torch.from_numpy(layout.slots))
        staging.array("graph_ids", n, torch.int64)[:] = batch.token_ids
        staging.array("graph_positions", n, torch.int64)[:] = layout.positions
        slots = staging.array("graph_slots", size, torch.int64)
        slots[:n] = layout.slots
        slots[n:] = -1
        lens = staging.array("graph_lens", size, torch.int32)
        lens[:n] = layout.seq_lens
        lens[n:] = 0
        self._graph_ids[:n].copy_(staging.host("graph_ids", n, torch.int64), non_blocking=True)
        self._graph_positions[:n].copy_(staging.host("graph_positions", n, torch.int64), non_blocking=True)
        self._graph_slots[:size].copy_(staging.host("graph_slots", size, torch.int64), non_blocking=True)
        self._graph_lens[:size].copy_(staging.host("graph_lens", size, torch.int32), non_blocking=True)
        self._graph_tables[:n].copy_(staging.host("graph_tables", n * max_blocks, torch.int32).view(n, max_blocks),
                                     non_blocking=True)
        if feed is not None:
            feed.apply(self._graph_ids, staging)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n]

    # -- sizing ------------------------------------------------------------------------------------------

    @staticmethod
    @torch.inference_mode()
    def profile_num_blocks(model: LlamaForCausalLM, *, block_size: int, gpu_memory_utilization: float,
                           max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the device after weights and a peak-activation pass.

        The peak is measured on a dense forward over `max_num_batched_tokens` tokens (the largest step the
        scheduler builds), so the KV pool never starves a full prefill step of activation memory.
        """
        device = model.inv_freq.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        lens = [max_model_len] * (max_num_batched_tokens // max_model_len)
        if max_num_batched_tokens % max_model_len:
            lens.append(max_num_batched_tokens % max_model_len)
        ids = torch.zeros(sum(lens), dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        ctx = DenseCausalAttention.build(lens, model.config, device)
        # Logits of one row per running sequence: the sampler's share of the peak.
        model.compute_logits(model(ids, positions, ctx)[:max_num_seqs])
        torch.cuda.synchronize(device)
        peak_activation = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()  # else the activations' cached memory would count as used twice
        free, total = torch.cuda.mem_get_info(device)
        usable = int(total * gpu_memory_utilization) - (total - free) - peak_activation
        num_blocks = usable // PagedAttention.block_bytes(model.config, block_size, model.model.embed_tokens.weight.dtype)
        if num_blocks < cdiv(max_model_len, block_size):
            raise ValueError(
                f"gpu_memory_utilization {gpu_memory_utilization} leaves room for {max(num_blocks, 0)} KV blocks, "
                f"fewer than one max_model_len ({max_model_len}) sequence needs; raise it, or lower "
                "max_model_len / max_num_batched_tokens"
            )
        return num_blocks
