"""Perplexity of a text through the engine's own paged path: the serving kernels, cache and block tables.

The text is one sequence, prefilled `chunk` tokens a step exactly as the engine prefills a long prompt: the KV
manager reserves each chunk's slots (`allocate`, then `append`), the runner executes a one-row `Batch` built from
the manager's block table and returns every token's logits (`ModelRunner.execute(every_token=True)`), and
`mark_computed` records the written KV. Row i of a chunk starting at `start` predicts token start + i + 1, so the
last token of the text is never a target and a text of N tokens scores N - 1.

StreamingLLM (`kv_window=W`, `kv_sinks=S`): every layer attends to the first S tokens and the last W (itself
included; `PagedAttention(kv_window=W, kv_sinks=S)`), and after each chunk `evict_window(seq, S, W)` releases the
blocks wholly between them. The next chunk's queries sit at or past the computed length, so they never need a
released block; a block only partly outside the window stays and its hidden slots are masked. The scores are
those of the sink+window mask whatever the chunk size; only memory and speed depend on it. The KV pool is sized
for the worst step (sinks, window and one chunk), so a leak in eviction fails the run instead of passing unseen.

An fp8 KV cache (`kv_cache_dtype`, `kv_cache_scales` as the engine takes them, see `ioattn.engine.kv_scales`)
scores the text through the same fp8 writes and kernels as serving; the result says which scales it used.

Positions stay those of the text (RoPE does not move when blocks are released), unlike StreamingLLM's own
implementation, which numbers positions within the cache: past the model's context a sink's distance to the
query exceeds anything the model was trained on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ioattn.engine.attention import PagedAttention
from ioattn.engine.kv_scales import KVScales, resolve_kv_scales
from ioattn.engine.runner import Batch, ModelRunner
from ioattn.engine.sampling import is_int
from ioattn.intmath import cdiv
from ioattn.kv import KVCacheManager, KVStats
from ioattn.models.loader import LoadedModel
from ioattn.ops.fp8 import check_fp8_supported, kv_cache_dtype_name, parse_kv_cache_dtype

BLOCK_SIZE = 16
DEFAULT_CHUNK = 512
DEFAULT_BUCKET = 256
SEQ_ID = "text"


@dataclass(frozen=True)
class Streaming:
    """Which keys every query sees: all earlier ones (window None), or the first `sinks` and the last `window`."""

    window: int | None = None
    sinks: int = 0

    def __post_init__(self):
        if self.window is not None and not (is_int(self.window) and self.window >= 1):
            raise ValueError(f"kv_window must be None or an int >= 1 (tokens a query sees, itself included), "
                             f"got {self.window!r}")
        if not (is_int(self.sinks) and self.sinks >= 0):
            raise ValueError(f"kv_sinks must be an int >= 0, got {self.sinks!r}")
        if self.sinks and self.window is None:
            raise ValueError(f"kv_sinks ({self.sinks}) needs a kv_window: without one every token is kept anyway")

    def describe(self) -> str:
        if self.window is None:
            return "full attention"
        return f"window {self.window}" + (f" + {self.sinks} sinks" if self.sinks else ", no sinks")


@dataclass
class ChunkLogits:
    """One prefill step: `logits` (num_tokens, vocab) float32, row i predicting token start + i + 1; the blocks
    the sequence held during the step, and the manager's snapshot after the step's eviction."""

    start: int
    logits: torch.Tensor
    blocks_in_step: int
    kv: KVStats


def pool_blocks(num_tokens: int, chunk: int, streaming: Streaming, block_size: int) -> int:
    """Blocks the sequence can hold at once: the whole text, or (streaming) the sink blocks plus, after an
    eviction left the last `window` tokens (one partial block on each end), one chunk more."""
    whole = cdiv(num_tokens, block_size)
    if streaming.window is None:
        return whole
    return min(whole, cdiv(streaming.sinks, block_size) + cdiv(streaming.window + chunk, block_size) + 1)


def kv_cache_format(loaded: LoadedModel, kv_cache_dtype: str = "auto",
                    kv_cache_scales=None) -> tuple[torch.dtype | None, KVScales | None]:
    """(the cache dtype, its scales) for these settings, as the engine resolves them (None, None: the model's
    dtype). kv_cache_scales may be resolved `KVScales` already (several runs sharing one calibration)."""
    kv_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    if kv_dtype is None:
        if kv_cache_scales is not None:
            raise ValueError("kv_cache_scales applies to an fp8 kv_cache_dtype only")
        return None, None
    check_fp8_supported(loaded.model.inv_freq.device, "kv_cache_dtype")
    if isinstance(kv_cache_scales, KVScales):
        return kv_dtype, kv_cache_scales
    return kv_dtype, resolve_kv_scales(loaded, kv_dtype, kv_cache_scales)


def paged_logits(loaded: LoadedModel, token_ids: Sequence[int], *, chunk: int = DEFAULT_CHUNK,
                 streaming: Streaming = Streaming(), block_size: int = BLOCK_SIZE,
                 backend: str = "auto", kv_cache_dtype: torch.dtype | None = None,
                 kv_scales: KVScales | None = None) -> Iterator[ChunkLogits]:
    """Prefill `token_ids` as one sequence, `chunk` tokens a step, through the KV manager, `PagedAttention` and
    the runner; yields every step's logits. backend: PagedAttention's ("auto": triton on CUDA, torch elsewhere).
    kv_cache_dtype / kv_scales: as `kv_cache_format` returns them."""
    if not (is_int(chunk) and chunk >= 1):
        raise ValueError(f"chunk must be an int >= 1 (tokens per prefill step), got {chunk!r}")
    token_ids = list(token_ids)
    if not token_ids:
        raise ValueError("token_ids is empty: there is nothing to score")
    vocab = loaded.config.vocab_size
    bad = [t for t in token_ids if type(t) is not int or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token_ids must be ints in [0, {vocab}), got {bad[:5]}")
    model = loaded.model
    num_blocks = pool_blocks(len(token_ids), chunk, streaming, block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0.0)
    attention = PagedAttention(
        loaded.config, num_blocks=num_blocks, block_size=block_size, dtype=model.model.embed_tokens.weight.dtype,
        device=model.inv_freq.device, max_num_seqs=1, backend=backend, kv_window=streaming.window,
        kv_sinks=streaming.sinks, kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales,
    )
    runner = ModelRunner(model, attention, max_model_len=len(token_ids), max_num_seqs=1, use_cuda_graphs=False,
                         max_num_batched_tokens=chunk)
    try:
        for start in range(0, len(token_ids), chunk):
            piece = token_ids[start : start + chunk]
            reserved = kv.allocate(SEQ_ID, piece) if start == 0 else kv.append(SEQ_ID, piece)
            if reserved is None:
                raise RuntimeError(f"the KV pool of {num_blocks} blocks cannot hold tokens [{start}, "
                                   f"{start + len(piece)}): evict_window released fewer blocks than it should")
            tables, table_lens = kv.block_tables([SEQ_ID])
            batch = Batch(piece, [start], [len(piece)], [True], tables, table_lens)
            logits = runner.execute(batch, every_token=True)
            blocks_in_step = kv.stats().blocks_used
            kv.mark_computed(SEQ_ID, start + len(piece))
            if streaming.window is not None:
                kv.evict_window(SEQ_ID, streaming.sinks, streaming.window)
            yield ChunkLogits(start, logits, blocks_in_step, kv.stats())
    finally:
        if SEQ_ID in kv.seqs:
            kv.free(SEQ_ID)


@dataclass
class Perplexity:
    """A text's score: per-token negative log-likelihoods (nats; `nll[i]` is token i + 1's), how fast, and the
    KV memory it took (blocks of `block_size` tokens)."""

    nll: np.ndarray = field(repr=False)  # float64 (num_tokens - 1,)
    num_tokens: int
    chunk: int
    streaming: Streaming
    block_size: int
    num_blocks: int  # the pool
    peak_blocks: int  # the most the sequence held during a step
    blocks_held: int  # after the last step's eviction
    window_evicted_blocks: int
    seconds: float
    kv_cache_dtype: str = "auto"
    kv_scales: dict | None = None  # `KVScales.describe()` of an fp8 cache

    @property
    def tokens_scored(self) -> int:
        return len(self.nll)

    @property
    def mean_nll(self) -> float:
        return math.fsum(self.nll.tolist()) / len(self.nll) if len(self.nll) else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else math.inf

    def buckets(self, size: int = DEFAULT_BUCKET) -> list[dict]:
        """Mean NLL and perplexity of the predicted tokens at positions [start, end), every `size` positions."""
        return bucket_means(self.nll, size)

    def summary(self) -> dict:
        """Plain data for JSON (per-token NLLs left out)."""
        return {
            "perplexity": self.perplexity, "mean_nll": self.mean_nll, "tokens": self.num_tokens,
            "tokens_scored": self.tokens_scored, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
            "chunk": self.chunk, "kv_window": self.streaming.window, "kv_sinks": self.streaming.sinks,
            "block_size": self.block_size, "kv_pool_blocks": self.num_blocks, "kv_peak_blocks": self.peak_blocks,
            "kv_blocks_held_at_end": self.blocks_held, "kv_window_evicted_blocks": self.window_evicted_blocks,
            "kv_cache_dtype": self.kv_cache_dtype, "kv_scales": self.kv_scales,
        }


def bucket_means(nll: np.ndarray, size: int) -> list[dict]:
    """nll[i] belongs to position i + 1: buckets [0, size), [size, 2 size), ... of predicted positions."""
    if not (is_int(size) and size >= 1):
        raise ValueError(f"bucket must be an int >= 1 (positions per bucket), got {size!r}")
    out = []
    for start in range(0, len(nll) + 1, size):
        values = nll[max(start - 1, 0) : start + size - 1]
        if len(values):
            mean = math.fsum(values.tolist()) / len(values)
            out.append({"start": start, "end": start + size, "tokens": len(values), "mean_nll": mean,
                        "perplexity": math.exp(mean)})
    return out


def perplexity(loaded: LoadedModel, token_ids: Sequence[int], *, chunk: int = DEFAULT_CHUNK,
               streaming: Streaming = Streaming(), block_size: int = BLOCK_SIZE, backend: str = "auto",
               progress=None, kv_cache_dtype: str = "auto", kv_cache_scales=None) -> Perplexity:
    """Score `token_ids` (at least 2) through `paged_logits`. progress: called with the tokens done after each
    step. kv_cache_dtype / kv_cache_scales: the engine's settings (`kv_cache_format`). Full attention past the model's context would silently score positions RoPE was never trained on, so
    without a window a longer text is an error naming both lengths; with one it runs past (StreamingLLM's point)."""
    if len(token_ids) < 2:
        raise ValueError(f"token_ids holds {len(token_ids)} token(s): scoring needs at least 2 (the first only "
                         "conditions the second)")
    context = loaded.max_model_len
    if streaming.window is None and len(token_ids) > context:
        raise ValueError(f"token_ids is {len(token_ids)} tokens, longer than the model's context ({context}): score "
                         f"its first {context}, or pass a kv_window to stream past the context")
    kv_dtype, kv_scales = kv_cache_format(loaded, kv_cache_dtype, kv_cache_scales)
    targets = torch.tensor(list(token_ids[1:]), dtype=torch.int64)
    nll = np.empty(len(token_ids) - 1, dtype=np.float64)
    peak, last = 0, None
    begin = time.perf_counter()
    for step in paged_logits(loaded, token_ids, chunk=chunk, streaming=streaming, block_size=block_size,
                             backend=backend, kv_cache_dtype=kv_dtype, kv_scales=kv_scales):
        rows = step.logits[: len(nll) - step.start]  # the text's last token predicts nothing
        picked = targets[step.start : step.start + len(rows)].to(rows.device)
        nll[step.start : step.start + len(rows)] = F.cross_entropy(rows, picked, reduction="none").double().cpu()
        peak, last = max(peak, step.blocks_in_step), step.kv
        if progress is not None:
            progress(step.start + len(step.logits))
    seconds = time.perf_counter() - begin
    return Perplexity(nll, len(token_ids), chunk, streaming, block_size, last.num_blocks, peak, last.blocks_used,
                      last.window_evicted_blocks, seconds,
                      "auto" if kv_dtype is None else kv_cache_dtype_name(kv_dtype),
                      None if kv_scales is None else kv_scales.describe())

