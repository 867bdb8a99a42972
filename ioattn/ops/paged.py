"""The paged attention kernel family: Flash-Decoding attention over block tables, its configs, tuned defaults,
candidates, split heuristic and launchers, the exact merge of partial states, and the CPU backend's dispatch.

Layout (vLLM / flash-attn): `k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)`, `block_table:
(batch, max_blocks_per_seq) int32`, `seq_lens: (batch,) int32`, slot = block_id * block_size + offset. The cache
writes and block copies are in `ioattn.ops.cache`.

All launches are CUDA-graph safe when the caller passes `max_seqlen_q` (multi-token queries) and, if splits are
used, a `workspace` sized for its largest batch: nothing here reads device data on the host (unless contents are
checked, see `ioattn.ops.checks`), and every allocation depends on shapes only. The measurements behind the
constants below are in lab/README.md ("paged decode" and "chunked prefill").

FP8 caches (`float8_e4m3fn` / `float8_e5m2`, see `ioattn.ops.fp8`) take per-KV-head float32 `k_scale` and
`v_scale`: the paged kernel loads fp8 and folds the scales in (K into the softmax scale, V into the output), the
gathered path dequantizes in its gather, the torch path in its own. Queries and outputs stay in the model's dtype.
The scales are read by the kernels from device memory, so a captured CUDA graph stays valid while they are fixed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

import ioattn.kernels  # noqa: F401,I001  (first: on a CPU-only machine it selects the interpreter before triton loads)
from ioattn.kernels.combine import combine_splits_kernel, merge_states_kernel
from ioattn.kernels.paged_attention import paged_attention_kernel
from ioattn.intmath import cdiv, next_power_of_2
from ioattn.ops import torch_paged
from ioattn.ops.cache import gather_cache, resolve_backend
from ioattn.ops.capability import MAX_GRID_Y, device_capability, interpreter_upcast
from ioattn.ops.launch_config import check_launch_config
from ioattn.ops.fp8 import (
    check_fp8_supported, check_scale_values, check_scales, is_fp8, kv_cache_dtype_name,
)
from ioattn.ops.checks import (
    SUPPORTED_DTYPES, check_cu_seqlens, check_heads, check_max_seqlen, check_tensor, checks_contents,
    is_int, normalized_window, softmax_scale_or_default, unbounded_past,
)
from ioattn.ops.paged_checks import (
    check_block_table, check_cache_pair, check_int_vector, check_table_contents, dtypes_of, require,
)

# Split heuristic (num_splits=0): split the key axis until PROGRAMS_PER_SM programs share each SM (resident programs
# hide each other's load latency), never below one 64-key decode tile per split, never past MAX_SPLITS.
PROGRAMS_PER_SM = 4
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 64
# Columns of the head per split-combine program: a 512-wide MLA head at one sequence and 64 splits is a 128 KB
# float32 block for one program (16 programs at 16 heads); in blocks of 128 columns four programs share it.
COMBINE_COLUMNS = 128

# Multi-token calls gather their context and run the dense varlen forward once the mean query tokens per sequence
# times the GQA group reach this: the gather's cost then falls under the page gathers it saves.
GATHER_MIN_GROUP_ROWS = 1024


@dataclass(frozen=True)
class PagedConfig:
    """Tile and launch parameters of the paged attention kernel (the lead tunes these on the GPU).

    block_m: rows of a multi-token query tile (tokens x query heads of one KV head); decode always uses the
    query-head group padded to 16 rows. block_n: keys per K/V tile (may span several cache blocks).
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # register cap per thread (more resident programs per SM, a few spills)
    paired_tiles: bool = False  # whole K/V tiles two per loop step: twice the bytes in flight per program
    kernel: str = "triton"  # "gluon": the sm_90 decode of `ioattn.kernels.gluon_paged` (TMA pages, a producer warp)
    # gluon: > 0 moves the running max only when some probability would pass 2**threshold (exact either way;
    # no cross-warp row max per tile); the Gluon defaults take 8 (bench/results/2026-12-06-gluon-threshold-h100)
    rescale_threshold: float = 0.0

    def __post_init__(self):
        check_launch_config(self)
        if self.kernel not in ("triton", "gluon"):
            raise ValueError(f"PagedConfig.kernel must be 'triton' or 'gluon', got {self.kernel!r}")
        threshold = self.rescale_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < math.inf:
            raise ValueError(f"PagedConfig.rescale_threshold must be a finite number >= 0, got {threshold!r}")
        if threshold and self.kernel != "gluon":
            raise ValueError("PagedConfig.rescale_threshold is the Gluon kernel's (kernel='gluon'); the Triton "
                             f"kernel rescales every tile, got {threshold!r}")


def default_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, *, decode: bool,
                   cache_dtype: torch.dtype | None = None) -> PagedConfig:
    """The tuned defaults (H200, bf16; other devices share them: the kernel is bandwidth-bound and its tiles small).
    cache_dtype fp8 (decode): whole tiles paired, 3.3-6.2% faster on an H200 (bench/results/2026-12-06-fp8-tiles-h200)."""
    if dtype == torch.float32:  # exact fp32 dots are FMA loops: small tiles keep registers and compile time sane
        return PagedConfig(block_m=16 if decode else 32, block_n=32, num_warps=4, num_stages=2)
    if decode:
        # capped at 128 registers: four programs per SM (bench/results/2026-12-01-explore2-h200.json, -explore4)
        return PagedConfig(block_m=16, block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2,
                           maxnreg=128, paired_tiles=cache_dtype is not None and is_fp8(cache_dtype))
    if head_dim <= 128:
        # 8 warps capped at 128 registers: two programs per SM (bench/results/2026-12-01-explore2-h200.json)
        return PagedConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, maxnreg=128)
    return PagedConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


# The Gluon decode (`PagedConfig(kernel="gluon")`, sm_90) where it was measured at least as fast as the Triton
# kernel: head dim 128; fp8 caches 0-7% faster from an H100's HBM and 17% from L2 (the ceiling an H200's HBM
# exposes), 16-bit caches equal to 2% faster (bench/results/2026-12-06-gluon-decode-h100); with conditional
# rescale (threshold 8) fp8 1-3% faster again from HBM and 4% from L2 (bench/results/2026-12-06-gluon-threshold-h100).
# Other head dims run the Triton kernel by default; config= asks for either.
GLUON_DECODE_DEFAULTS = {
    ("fp8", 128): PagedConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, maxnreg=96, kernel="gluon",
                              rescale_threshold=8.0),
    ("16-bit", 128): PagedConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, maxnreg=96, kernel="gluon",
                                 rescale_threshold=8.0),
}


def gluon_decode_default(q, k_cache, v_cache, *, decode: bool, window_left: int, sink_tokens: int
                         ) -> tuple[PagedConfig | None, str]:
    """(the Gluon decode's config, why) where the default plan takes it, else (None, why not)."""
    from ioattn.ops.gluon_paged import gluon_decode_unsupported

    why_not = gluon_decode_unsupported(q, k_cache, v_cache, decode=decode, window_left=window_left,
                                       sink_tokens=sink_tokens)
    if why_not is not None:
        return None, why_not
    kind = "fp8" if is_fp8(k_cache.dtype) else "16-bit"
    config = GLUON_DECODE_DEFAULTS.get((kind, q.shape[2]))
    if config is None:
        return None, f"the Gluon decode is not measured for {kind} caches at head_dim {q.shape[2]}"
    return config, (f"sm_90, {kind} cache, head_dim {q.shape[2]}: the Gluon decode (measured at least as fast as "
                    "the Triton kernel)")


def candidate_configs(head_dim: int, dtype: torch.dtype = torch.bfloat16, *, decode: bool,
                      cache_dtype: torch.dtype | None = None) -> list[PagedConfig]:
    """Configurations worth timing for one shape on the GPU (pass each as `config=` to paged_attention).
    cache_dtype fp8: decode tiles up to twice as many keys (the same bytes per tile as 16-bit caches), and paired."""
    stage_options = (1, 2, 3, 4)
    if decode:
        fp8 = cache_dtype is not None and is_fp8(cache_dtype)
        return [
            PagedConfig(block_m=16, block_n=n, num_warps=w, num_stages=s, maxnreg=r, paired_tiles=paired)
            for n in ((16, 32, 64, 128, 256) if fp8 else (16, 32, 64, 128)) for w in (2, 4, 8)
            for s in stage_options for r in (None, 96, 128) for paired in ((False, True) if fp8 else (False,))
            if n * head_dim <= (32768 if fp8 else 16384)
        ]
    return [
        PagedConfig(block_m=m, block_n=n, num_warps=w, num_stages=s, maxnreg=r)
        for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in stage_options[1:] for r in (None, 128)
        if n * head_dim <= 16384 and m * head_dim <= 32768
    ]


@functools.cache
def _dependent_launch_supported(device: torch.device) -> bool:
    """sm_90+: the split combine's programs can start while the split kernel drains (griddepcontrol)."""
    return device.type == "cuda" and device_capability(device)[0] >= 9


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any small number keeps CPU tests fast


def choose_num_splits(programs: int, max_context: int, sm_count: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """The num_splits=0 heuristic (see the constants above). Rounds down: programs of equal length that spill
    into a second wave leave the GPU mostly idle for it (B=8 L=32k: 4.09 TB/s at 8 splits, 3.5 at 9); a grid
    that already fills programs_per_sm slots per SM gets 1 (the MLA kernel's programs are larger: its config
    says how many an SM holds)."""
    wanted = programs_per_sm * sm_count // max(programs, 1)
    by_length = max(1, max_context // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def choose_gather(num_tokens: int, batch: int, group: int, window_left: int, sink_tokens: int) -> tuple[bool, str]:
    """Whether a multi-token call gathers its context and runs the dense forward (see GATHER_MIN_GROUP_ROWS)."""
    if window_left >= 0 or sink_tokens > 0:
        return False, "a window or sinks (evicted blocks must stay unread): paged kernel"
    if batch > MAX_GRID_Y:
        return False, f"{batch} sequences exceed the gather kernel's grid ({MAX_GRID_Y}): paged kernel"
    rows = num_tokens * group / max(batch, 1)
    if rows >= GATHER_MIN_GROUP_ROWS:
        return True, (f"{num_tokens / max(batch, 1):.0f} query tokens per sequence x group {group} >= "
                      f"{GATHER_MIN_GROUP_ROWS}: gather + dense forward")
    return False, (f"{num_tokens / max(batch, 1):.0f} query tokens per sequence x group {group} < "
                   f"{GATHER_MIN_GROUP_ROWS}: paged kernel")


@dataclass
class PagedWorkspace:
    """Float32 scratch for split partials: out (splits, tokens, heads, D), lse (splits, tokens, heads)."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def paged_workspace(max_tokens: int, num_heads: int, head_dim: int, *, max_splits: int = MAX_SPLITS,
                    device=None) -> PagedWorkspace:
    """Allocate split scratch once for the largest batch (tokens = batch for decode) and reuse it every step."""
    return PagedWorkspace(
        torch.empty(max_splits, max_tokens, num_heads, head_dim, dtype=torch.float32, device=device),
        torch.empty(max_splits, max_tokens, num_heads, dtype=torch.float32, device=device),
    )


@dataclass(frozen=True)
class PagedPlan:
    """What a paged_attention call launches: the config, the split count and the query tiling."""

    config: PagedConfig
    num_splits: int
    rows: int  # BLOCK_M
    tokens_per_tile: int
    q_tiles_per_seq: int
    gather: bool = False  # multi-token only: gather the context, then the dense varlen forward
    reason: str = ""
    dependent_combine: bool = False  # the split combine by programmatic dependent launch (sm_90+)
    backend: str = "triton"  # or "torch": the exact CPU path (`ioattn.ops.torch_paged`)
    kv_cache: str = ""  # the cache's dtype and, for fp8, how its scales are applied

    def __str__(self) -> str:
        cache = f"; {self.kv_cache}" if self.kv_cache else ""
        if self.backend == "torch":
            return f"torch: {torch_paged.DESCRIPTION}" + (f" ({self.reason})" if self.reason else "") + cache
        if self.gather:
            return f"gather the paged context + dense varlen forward ({self.reason})" + cache
        name = ("gluon_paged_decode_kernel (sm_90: TMA page loads by a producer warp, mma.sync)"
                if self.config.kernel == "gluon" else "paged_attention_kernel")
        launch = (f"{name} BLOCK_M={self.rows} BLOCK_N={self.config.block_n} "
                  f"num_warps={self.config.num_warps} num_stages={self.config.num_stages}"
                  + ("" if self.config.maxnreg is None else f" maxnreg={self.config.maxnreg}")
                  + (" paired tiles" if self.config.paired_tiles else ""))
        combine = " (programmatic dependent launch)" if self.dependent_combine else ""
        splits = f", {self.num_splits} splits + combine{combine}" if self.num_splits > 1 else ", no split"
        return launch + splits + (f" ({self.reason})" if self.reason else "") + cache


def describe_cache(k_cache: torch.Tensor, backend: str, gather: bool, float16_dots: bool = False) -> str:
    """What a plan says about the cache: its dtype, and for fp8 where the scales go and (the paged kernel) how the
    tiles meet the queries (`fp16_dots`)."""
    return _cache_words(k_cache.dtype, backend, gather, float16_dots)


@functools.cache
def _cache_words(dtype: torch.dtype, backend: str, gather: bool, float16_dots: bool) -> str:
    name = kv_cache_dtype_name(dtype)
    if not is_fp8(dtype):
        return f"{name} KV cache"
    if backend == "torch":
        how = "dequantized (x scale per KV head) as each sequence's keys are gathered"
    elif gather:
        how = "gathered as exact fp8 codes; the forward folds K scale into the softmax scale, V scale into the output"
    else:
        how = "loaded as fp8; K scale folded into the softmax scale, V scale into the output, per KV head; " + (
            "float16 dots: tiles converted two codes per instruction, bf16 queries scaled into float16 by a power "
            "of two per row" if float16_dots else "tiles converted to the queries' dtype")
    return f"{name} KV cache, {how}"


def plan_paged_attention(q, k_cache, block_table, *, decode: bool, max_seqlen_q: int, num_splits: int = 0,
                         config: PagedConfig | None = None, workspace: PagedWorkspace | None = None,
                         window_left: int = -1, sink_tokens: int = 0, gather: bool | None = None,
                         dependent_combine: bool | None = None, backend: str = "auto",
                         v_cache: torch.Tensor | None = None) -> PagedPlan:
    """Choose the path, tiles and split count for a call (pure host arithmetic on shapes); str() explains it.
    Decode on sm_90 takes the Gluon kernel where `GLUON_DECODE_DEFAULTS` has an entry for the cache (v_cache: its
    strides are checked too; None takes k_cache's).

    gather (multi-token queries): None decides by `choose_gather` (never with an explicit `config`, which is for
    tuning the paged kernel), True / False force it. dependent_combine: None launches the split combine by
    programmatic dependent launch where the device has it (sm_90+), False always in stream order (A/B runs)."""
    head_dim, group = q.shape[-1], q.shape[-2] // k_cache.shape[2]
    backend, backend_why = resolve_backend(backend, q.device)
    if backend == "torch":
        return PagedPlan(config or default_config(head_dim, q.dtype, decode=decode), 1, 0, 0, 0, reason=backend_why,
                         backend="torch", kv_cache=describe_cache(k_cache, "torch", False))
    if not decode:
        if gather is None and config is None and num_splits <= 1:
            use, why = choose_gather(q.shape[0], block_table.shape[0], group, window_left, sink_tokens)
        elif gather is None:
            use, why = False, "explicit config or num_splits > 1: paged kernel"
        else:
            use, why = bool(gather), f"gather={bool(gather)} requested"
        if use:
            require(window_left < 0 and sink_tokens == 0,
                    "gather=True needs window_size[0] == -1 and sink_tokens == 0 (evicted blocks must stay unread)")
            require(block_table.shape[0] <= MAX_GRID_Y,
                    f"gather=True takes at most {MAX_GRID_Y} sequences (the gather kernel's grid), got {block_table.shape[0]}")
            return PagedPlan(config or default_config(decode=False, head_dim=head_dim, dtype=q.dtype), 1, 0, 0, 0,
                             True, why, kv_cache=describe_cache(k_cache, "triton", True))
    else:
        why = ""
    v_cache = k_cache if v_cache is None else v_cache
    if config is None and decode and q.is_cuda:
        config, why = gluon_decode_default(q, k_cache, v_cache, decode=decode, window_left=window_left,
                                           sink_tokens=sink_tokens)
        why = why if config is not None else f"Triton kernel: {why}"
    elif config is not None and config.kernel == "gluon":
        from ioattn.ops.gluon_paged import gluon_config_unsupported, gluon_decode_unsupported

        why_not = gluon_config_unsupported(config) or gluon_decode_unsupported(
            q, k_cache, v_cache, decode=decode, window_left=window_left, sink_tokens=sink_tokens)
        require(why_not is None, f"config.kernel='gluon': {why_not}")
    config = config or default_config(decode=decode, head_dim=head_dim, dtype=q.dtype, cache_dtype=k_cache.dtype)
    if decode:
        rows, tokens = max(16, next_power_of_2(group)), 1
    else:
        rows = max(config.block_m, next_power_of_2(group))
        tokens = rows // group
    q_tiles = 1 if decode else max(1, cdiv(max_seqlen_q, tokens))
    if num_splits == 0:
        programs = block_table.shape[0] * k_cache.shape[2] * q_tiles
        max_context = block_table.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(programs, max_context, _sm_count(q.device))
        if workspace is not None:  # stay within the caller's scratch: fewer splits, or none for a larger batch
            fits = q.shape[0] <= workspace.partial_out.shape[1]
            num_splits = min(num_splits, workspace.partial_out.shape[0]) if fits else 1
    dependent = num_splits > 1 and dependent_combine is not False and _dependent_launch_supported(q.device)
    return PagedPlan(config, num_splits, rows, tokens, q_tiles, False, why, dependent,
                     kv_cache=describe_cache(k_cache, "triton", False, fp16_dots(q)))


def explain_paged(q, k_cache, v_cache, block_table, seq_lens, *, cu_seqlens_q=None, max_seqlen_q=None, causal=True,
                  window_size=(-1, -1), sink_tokens=0, num_splits=0, workspace=None, config=None,
                  gather=None, dependent_combine=None, backend="auto", k_scale=None, v_scale=None) -> PagedPlan:
    """The plan `paged_attention` would run with these arguments (nothing runs); str() says what and why, the
    cache's dtype included. `ioattn.explain(q, k_cache, v_cache, block_table=..., seq_lens=..., ...)` lands here."""
    check_scales(k_cache, k_scale, v_scale)
    decode = cu_seqlens_q is None
    if not decode and max_seqlen_q is None:
        max_seqlen_q = int(cu_seqlens_q.diff().max().item()) if cu_seqlens_q.numel() > 1 else 0
    left, _ = normalized_window(window_size, causal)
    return plan_paged_attention(q, k_cache, block_table, decode=decode, max_seqlen_q=1 if decode else max_seqlen_q,
                                num_splits=num_splits, config=config, workspace=workspace, window_left=left,
                                sink_tokens=sink_tokens, gather=gather, dependent_combine=dependent_combine,
                                backend=backend, v_cache=v_cache)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    sink_tokens: int = 0,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    workspace: PagedWorkspace | None = None,
    config: PagedConfig | None = None,
    gather: bool | None = None,
    dependent_combine: bool | None = None,
    backend: str = "auto",
    validate: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """Attention of new queries against a paged KV cache (split-KV / Flash-Decoding).

    Decode: q (B, Hq, D), one token per sequence at position seq_lens[b] - 1, seeing its seq_lens[b] cached keys.
    Multi-token (prefill, append, chunked prefill, prefix-cache hit, speculative verify): packed q (total_q, Hq, D)
    with int32 `cu_seqlens_q` (B + 1,); query i of sequence b sits at position seq_lens[b] - q_len_b + i (its own
    K/V must already be in the cache), causal relative to it. Pass `max_seqlen_q` (the largest q_len_b) to stay
    free of host synchronisation; without it it is read from cu_seqlens_q.

    window_size (left, right) and sink_tokens act on logical positions: key k is visible to a query at p iff
    k < seq_len, k <= p + right (right = 0 when causal) and (k >= p - left or k < sink_tokens); -1 is unbounded.
    num_splits: 0 picks it (see `choose_num_splits`), 1 disables splitting. Splits > 1 need float32 scratch:
    `workspace` (see `paged_workspace`), else it is allocated for this call. `out` receives the output if given.
    `config` (a `PagedConfig`) overrides the tiles and launch parameters of `default_config`, for tuning.
    Multi-token calls with many query tokens per sequence gather the context into a packed buffer and run the
    dense varlen forward (see `choose_gather`; `gather=True/False` forces it, `plan_paged_attention` says which
    path a call takes; num_splits, workspace and config apply to the paged kernel only). The gathered buffer
    holds batch x block_table.shape[1] x block_size rows of K and V.
    FP8 caches (float8_e4m3fn / float8_e5m2) need `k_scale` and `v_scale`, float32 (num_kv_heads,): the cache
    holds K / k_scale and V / v_scale (see `ioattn.ops.fp8`), and attention runs over the dequantized values; q,
    out and the result are in the model's dtype (any of the supported three). On CUDA, fp8 needs compute
    capability 8.9+. Other caches share q's dtype and take no scales.
    Returns out shaped like q, and with return_lse the natural-log LSE in float32: (B, Hq) for decode,
    (Hq, total_q) for packed queries (flash-attn varlen). Rows that see no key (e.g. seq_len 0) give 0 and -inf.
    validate: check the values of block_table, seq_lens and cu_seqlens_q (every block id read in
    [0, num_blocks), -1 only where the window and sinks hide it, 0 <= q_len <= seq_len <= the table's capacity);
    None does so for CPU tensors and, with IOATTN_VALIDATE=1, for CUDA ones (a host sync). Unchecked values are
    trusted: see `ioattn.ops.checks` for what each mode promises.
    dependent_combine: None launches the split combine by programmatic dependent launch on sm_90+, False in stream
    order. backend: "auto" (Triton on CUDA and under the CPU interpreter, else torch), "triton", or "torch" (the
    exact CPU path: each sequence's keys gathered through its table; the tiling arguments do not apply).
    """
    decode = cu_seqlens_q is None
    check_tensor("q", q)
    require(q.dim() == 3, f"q must be (batch, heads, head_dim) or (total_q, heads, head_dim), got {tuple(q.shape)}")
    dtypes = dtypes_of(resolve_backend(backend, q.device)[0])
    require(q.dtype in dtypes, f"q dtype must be one of {dtypes}, got {q.dtype}")
    require(q.stride(-1) == 1, "q must be contiguous in head_dim (stride(-1) == 1)")
    check_cache_pair(k_cache, v_cache, dtypes)
    fp8 = is_fp8(k_cache.dtype)
    require(fp8 or k_cache.dtype == q.dtype, f"q, k_cache and v_cache must share a dtype (or the caches be fp8), got "
            f"{q.dtype}, {k_cache.dtype}")
    check_scales(k_cache, k_scale, v_scale)
    if fp8:
        check_fp8_supported(q.device)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    require(head_dim == k_cache.shape[3], f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    check_heads(num_heads, num_kv_heads)
    require(q.device == k_cache.device, f"q is on {q.device} but k_cache and v_cache are on {k_cache.device}")
    check_block_table(block_table, q.device)
    batch = block_table.shape[0]
    check_int_vector("seq_lens", seq_lens, batch, q.device)
    contents = checks_contents(validate, q.device)
    if decode:
        require(num_tokens == batch, f"decode q has {num_tokens} rows but block_table has {batch} sequences")
        max_seqlen_q = 1
    else:
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, batch, num_tokens, q.device, contents=contents)
        if max_seqlen_q is None:  # a host sync: pass max_seqlen_q to avoid it (and to capture CUDA graphs)
            max_seqlen_q = int(cu_seqlens_q.diff().max().item()) if batch else 0
        max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, contents=contents)
    # Positions lie below the table's capacity: a wider bound is no bound (and cannot overflow int32 positions).
    left, right = unbounded_past(normalized_window(window_size, causal), 2 * block_table.shape[1] * k_cache.shape[1])
    require(is_int(sink_tokens) and 0 <= sink_tokens < 2**31, f"sink_tokens must be an int in [0, 2**31), got "
            f"{sink_tokens!r}")
    require(is_int(num_splits) and 0 <= num_splits <= MAX_SPLITS,
            f"num_splits must be an int in [0, {MAX_SPLITS}] (0 = heuristic, 1 = no split), got {num_splits!r}")
    scale = softmax_scale_or_default(softmax_scale, head_dim)
    require(gather in (None, True, False), f"gather must be None, True or False, got {gather!r}")
    require(dependent_combine in (None, True, False),
            f"dependent_combine must be None, True or False, got {dependent_combine!r}")
    require(config is None or isinstance(config, PagedConfig), f"config must be a PagedConfig or None, got "
            f"{type(config).__name__}")
    require(workspace is None or isinstance(workspace, PagedWorkspace), "workspace must be a PagedWorkspace (see "
            f"paged_workspace) or None, got {type(workspace).__name__}")
    if out is not None:
        check_tensor("out", out)
        require(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.stride(-1) == 1,
                f"out must match q's shape, dtype and device with stride(-1) == 1, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}")
    if contents:
        check_table_contents(block_table, seq_lens, None if decode else cu_seqlens_q.diff(), k_cache.shape[0],
                             k_cache.shape[1], left, sink_tokens)
        if fp8:
            check_scale_values("k_scale", k_scale)
            check_scale_values("v_scale", v_scale)
    plan = plan_paged_attention(q, k_cache, block_table, decode=decode, max_seqlen_q=max_seqlen_q,
                                num_splits=num_splits, config=config, workspace=workspace, window_left=left,
                                sink_tokens=sink_tokens, gather=gather, dependent_combine=dependent_combine,
                                backend=backend, v_cache=v_cache)
    if plan.backend == "torch":
        return torch_paged.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, (left, right),
                                           sink_tokens, scale, out, return_lse, k_scale, v_scale)
    if interpreter_upcast(q.dtype):  # the interpreter's bf16 dots are wrong: compute on float32 copies
        k_up, v_up = (k_cache, v_cache) if fp8 else (k_cache.float(), v_cache.float())
        result = paged_attention(
            q.float(), k_up, v_up, block_table, seq_lens, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, causal=causal, window_size=window_size, sink_tokens=sink_tokens,
            softmax_scale=scale, num_splits=num_splits, return_lse=return_lse, workspace=workspace, config=config,
            gather=gather, dependent_combine=dependent_combine, backend="triton", validate=False,
            k_scale=k_scale, v_scale=v_scale)
        result, lse = result if return_lse else (result, None)
        out = result.to(q.dtype) if out is None else out.copy_(result)
        return (out, lse) if return_lse else out
    if plan.gather and num_tokens and batch:
        return _gathered_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q,
                                   (left, right), scale, out, return_lse, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    # LSE is stored [token, head]; the packed layout (Hq, total_q) is the same buffer read transposed.
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if decode else \
        torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device).t()
    if num_tokens == 0 or batch == 0:
        return (out, lse if decode else lse.t()) if return_lse else out

    splits = plan.num_splits
    part_out, part_lse = split_partials(out, lse, splits, workspace)

    cfg = plan.config
    if cfg.kernel == "gluon":  # the plan checked that it can take this call
        from ioattn.ops.gluon_paged import launch_gluon_decode

        launch_gluon_decode(q, k_cache, v_cache, block_table, seq_lens, part_out, part_lse, k_scale, v_scale, scale,
                            splits, cfg, plan.dependent_combine)
        if splits > 1:
            combine_splits(part_out, part_lse, out, lse, plan.dependent_combine)
        return (out, lse) if return_lse else out
    grid = (batch * plan.q_tiles_per_seq, num_kv_heads, splits)
    paged_attention_kernel[grid](
        q, k_cache, v_cache, block_table, seq_lens, seq_lens if decode else cu_seqlens_q, part_out, part_lse,
        k_scale, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        scale * math.log2(math.e), left, right, sink_tokens, splits, plan.q_tiles_per_seq,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(max(head_dim, 16)), GROUP=num_heads // num_kv_heads,
        TOKENS=plan.tokens_per_tile, BLOCK_M=plan.rows, BLOCK_N=cfg.block_n, PAGE=k_cache.shape[1],
        DECODE=decode, IEEE=q.dtype == torch.float32, NUM_STAGES=cfg.num_stages, PAIRED=cfg.paired_tiles,
        RELEASE_DEPENDENTS=plan.dependent_combine,
        **({"FP8": True, "FP16_DOTS": fp16_dots(q)} if fp8 else {}),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    if splits > 1:
        combine_splits(part_out, part_lse, out, lse, plan.dependent_combine)
    if not return_lse:
        return out
    return out, lse if decode else lse.t()


def fp16_dots(q: torch.Tensor) -> bool:
    """Whether the paged kernel computes with fp8 K/V tiles in float16 (bf16 queries on CUDA; see
    `paged_attention_kernel`), not by Triton's conversion to the queries' dtype (fp16 queries: already two codes per
    instruction)."""
    return q.is_cuda and q.dtype == torch.bfloat16


def split_partials(out: torch.Tensor, lse: torch.Tensor, splits: int, workspace: PagedWorkspace | None):
    """Where a launch of `splits` splits writes its partials for out (tokens, heads, D) and lse (tokens, heads):
    the outputs themselves for one split, else the workspace (allocated for this call when None)."""
    if splits == 1:
        return out.unsqueeze(0), lse.unsqueeze(0)
    num_tokens, num_heads, head_dim = out.shape
    if workspace is None:
        workspace = paged_workspace(num_tokens, num_heads, head_dim, max_splits=splits, device=out.device)
    ws_out, ws_lse = workspace.partial_out, workspace.partial_lse
    require(ws_out.shape[0] >= splits and ws_out.shape[1] >= num_tokens and ws_out.shape[2:] == (num_heads, head_dim)
            and ws_lse.shape[:3] == ws_out.shape[:3] and ws_out.dtype == ws_lse.dtype == torch.float32
            and ws_out.device == out.device,
            f"workspace {tuple(ws_out.shape)} on {ws_out.device} cannot hold {splits} splits x {num_tokens} tokens x "
            f"{num_heads} heads x {head_dim} on {out.device}")
    return ws_out[:splits, :num_tokens], ws_lse[:splits, :num_tokens]


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dependent: bool) -> None:
    """The exact LSE merge of split partials into out / lse; dependent: by programmatic dependent launch."""
    splits, num_tokens, num_heads, head_dim = part_out.shape
    block_d = min(next_power_of_2(head_dim), COMBINE_COLUMNS)
    combine_splits_kernel[(num_tokens, num_heads, cdiv(head_dim, block_d))](
        part_out, part_lse, out, lse, splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_power_of_2(splits),
        AFTER_PRIMARY=dependent, **({"launch_pdl": True} if dependent else {}),
    )


def _gathered_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, window, scale,
                        out, return_lse, k_scale=None, v_scale=None):
    """The gather path of a multi-token call: packed context, then the dense varlen forward (bottom-right
    causal per sequence: query i of sequence b at position seq_lens[b] - q_len_b + i, as the paged kernel).
    An fp8 context is gathered as its codes (exact in q's dtype) and the forward folds the scales in per KV head,
    as the paged kernel does: rounding K * scale to 16 bits would add error beyond the quantization."""
    from ioattn.ops.attention import descaled_varlen_forward, flash_attn_varlen_func

    batch, width = block_table.shape
    capacity = batch * width * k_cache.shape[1]  # a host bound on sum(seq_lens): no synchronisation
    cu_seqlens_k = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
    keys, values = gather_cache(k_cache, v_cache, block_table, seq_lens, cu_seqlens_k, capacity, dtype=q.dtype,
                                dequantize=False)
    # causal=False: the window (left, right) already carries the causal bound (right = 0), bottom-right aligned.
    # validate=False: the call's own arguments were checked, and cu_seqlens_k is built here from them.
    max_seqlen_k = width * k_cache.shape[1]
    if is_fp8(k_cache.dtype):
        result, lse = descaled_varlen_forward(q, keys, values, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              window, scale, k_scale, v_scale)
    else:
        result, lse = flash_attn_varlen_func(q, keys, values, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             causal=False, window_size=window, softmax_scale=scale, return_lse=True,
                                             backend="triton", validate=False)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Exact merge of two partial attentions over disjoint key sets (cascade attention over a shared prefix).

    o_a, o_b: (tokens, heads, D), each normalised over its own keys; lse_a, lse_b: (tokens, heads) natural log
    (for paged_attention's packed LSE (heads, tokens) pass `lse.t()`). A side with LSE -inf is empty and ignored
    whatever its output holds; both empty gives output 0 and LSE -inf. Returns (out in o_a's dtype, lse float32).
    """
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        check_tensor(name, t)
    require(o_a.dim() == 3 and o_a.shape == o_b.shape, f"o_a {tuple(o_a.shape)} and o_b {tuple(o_b.shape)} must "
             "be equal (tokens, heads, head_dim)")
    require(lse_a.shape == lse_b.shape == o_a.shape[:2],
             f"lse_a {tuple(lse_a.shape)} and lse_b {tuple(lse_b.shape)} must be (tokens, heads) = {tuple(o_a.shape[:2])}")
    require(o_a.dtype in SUPPORTED_DTYPES and o_b.dtype in SUPPORTED_DTYPES,
             f"o_a/o_b dtype must be one of {SUPPORTED_DTYPES}, got {o_a.dtype}, {o_b.dtype}")
    require(lse_a.dtype == lse_b.dtype == torch.float32, f"lse_a/lse_b must be float32, got {lse_a.dtype}, {lse_b.dtype}")
    require(o_a.stride(-1) == 1 and o_b.stride(-1) == 1, "o_a and o_b must be contiguous in head_dim")
    require(len({t.device for t in (o_a, lse_a, o_b, lse_b)}) == 1, "all inputs must be on one device")
    tokens, heads, head_dim = o_a.shape
    out = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=o_a.device)
    if out.numel() == 0:
        return out, lse
    merge_states_kernel[(tokens, heads)](
        o_a, lse_a, o_b, lse_b, out, lse,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1), lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
    )
    return out, lse


@torch.inference_mode()
def compile_variants(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, *, window_size=(-1, -1),
                     max_tokens: int = 1, workspace: PagedWorkspace | None = None, dtype: torch.dtype | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Run (so compile) every variant of `paged_attention` a serving step can take with these caches, so that no
    kernel compiles mid-serving: decode and multi-token queries on the paged kernel, unsplit (output in the cache
    dtype) and at each power-of-two split count (float32 partials; the combine is specialised on the count),
    and, without a window, the gathered path at one query token and at `max_tokens` (the forward's table tells
    short from long queries). Queries are a view of a fused qkv row, as a model passes them; the caches are only
    read. dtype: the queries' (default the caches'; required for fp8 caches, which also take their scales)."""
    device, head_dim, kv_heads = k_cache.device, k_cache.shape[3], k_cache.shape[2]
    qkv = torch.zeros(2, num_heads + 2 * kv_heads, head_dim, dtype=dtype or k_cache.dtype, device=device)
    q = qkv[:1, :num_heads]
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    common = dict(window_size=window_size, backend="triton", validate=False, k_scale=k_scale, v_scale=v_scale)
    for splits in (1 << i for i in range(MAX_SPLITS.bit_length())):
        paged_attention(q, k_cache, v_cache, table, seq_lens, num_splits=splits, workspace=workspace, **common)
        paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1,
                        num_splits=splits, gather=False, **common)
    if window_size[0] < 0:  # a window never takes the gathered path
        for max_seqlen_q in sorted({1, max_tokens}):
            paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                            gather=True, **common)
