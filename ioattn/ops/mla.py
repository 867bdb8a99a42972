"""Multi-head latent attention (MLA) over a paged latent cache, weights absorbed: the decode kernel's launcher,
plan, split heuristic and CPU path.

Layout: `latent_cache: (num_blocks, block_size, 1, D)` with D = v_head_dim + rope_dim (DeepSeek-V3: 512 + 64),
each row a token's latent followed by its RoPE key; `block_table`, `seq_lens` and `cu_seqlens_q` as in
`ioattn.ops.paged`. The query is the absorbed one (W_UK folded in, the RoPE part appended): q (T, H, D). The
output is softmax(scale · q · rowsᵀ) · rows[:, :v_head_dim], (T, H, v_head_dim), to which the model applies W_UV.

Launches are CUDA-graph safe when the caller passes `max_seqlen_q` (multi-token queries) and, if splits are used, a
`workspace` (see `mla_workspace`): no device data is read on the host unless contents are checked.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

import ioattn.kernels  # noqa: F401,I001  (first: on a CPU-only machine it selects the interpreter before triton loads)
from ioattn.kernels.mla_attention import mla_attention_kernel
from ioattn.intmath import cdiv, next_power_of_2
from ioattn.ops import torch_paged
from ioattn.ops.capability import MAX_GRID_Y, interpreter_upcast
from ioattn.ops.launch_config import check_launch_config
from ioattn.ops.cache import resolve_backend
from ioattn.ops.checks import (
    check_cu_seqlens, check_max_seqlen, check_tensor, checks_contents, is_int,
    softmax_scale_or_default,
)
from ioattn.ops.paged import (
    MAX_SPLITS, PagedWorkspace, _dependent_launch_supported, _sm_count, choose_num_splits, combine_splits,
    paged_workspace, split_partials,
)
from ioattn.ops.paged_checks import (
    MAX_BLOCK_SIZE, check_block_table, check_int_vector, check_table_contents, dtypes_of, require,
)

MAX_LATENT_DIM = 1024  # the accumulator holds BLOCK_H x v_head_dim float32 values per program
MAX_ROPE_DIM = 256


@dataclass(frozen=True)
class MLAConfig:
    """Tiles and launch parameters of the MLA kernel. block_h: query heads per program (the rest of the grid's
    second axis); block_m: rows of a multi-token tile (tokens x block_h); block_n: keys per latent tile."""

    block_h: int = 16
    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None
    programs_per_sm: int = 1  # how many an SM holds (shared memory, registers): the split heuristic fills them
    sms_per_program: int = 1  # the split heuristic fills one program per this many SMs (2: half the SMs)
    kernel: str = "triton"  # "gluon": the sm_90 decode of `ioattn.kernels.gluon_mla` (TMA latent rows, a producer warp)
    seesaw: bool = False  # kernel "gluon" at 64 heads: the two warpgroups on two tiles at once (FlashMLA's schedule)
    stage_out: bool = False  # kernel "gluon" at 64 heads: O stored through the ring's stages, whole rows per warp

    def __post_init__(self):
        check_launch_config(self)
        if self.kernel not in ("triton", "gluon"):
            raise ValueError(f"MLAConfig.kernel must be 'triton' or 'gluon', got {self.kernel!r}")
        for name in ("seesaw", "stage_out"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"MLAConfig.{name} must be a bool, got {value!r}")
            if value and self.kernel != "gluon":
                raise ValueError(f"MLAConfig.{name} is an option of kernel='gluon', got kernel={self.kernel!r}")


def default_config(num_heads: int, v_head_dim: int, dtype: torch.dtype, *, decode: bool) -> MLAConfig:
    """Defaults: every head of a small group in one program (the latent tile is read once per sequence); 64 heads
    per program beyond 16, eight warps holding their 64 x v_head_dim accumulator. Decode takes 3 stages: the
    sm_90 build then double-buffers the latent tile (2 stages give one buffer: lab/aot.py --mla), and the H100
    tuning run of 2026-12-05 (bench/results/2026-12-05-w2-tune-h100) found it fastest at 16 and 128 heads.
    programs_per_sm from those builds: 93 KB of shared memory at 16 heads (2 per SM), 184 KB at 64 (1)."""
    block_h = min(max(16, next_power_of_2(num_heads)), 64)
    if dtype == torch.float32:  # exact fp32 dots are FMA loops: small tiles keep registers and compile time sane
        return MLAConfig(block_h=16, block_m=16, block_n=16, num_warps=4, num_stages=1)
    wide = block_h > 16 or not decode
    latent_fits = v_head_dim <= 512  # wider latents take 16-key tiles, built and timed with 2 stages only
    tuned_decode = decode and latent_fits
    return MLAConfig(block_h=block_h, block_m=max(64, block_h), block_n=32 if latent_fits else 16,
                     num_warps=8 if wide else 4, num_stages=3 if tuned_decode else 2,
                     programs_per_sm=2 if tuned_decode and not wide else 1)


# The Gluon MLA decode (`MLAConfig(kernel="gluon")`, sm_90) where it was measured faster than the Triton kernel,
# over DeepSeek's latent 512 + RoPE 64 (bench/results/2026-12-06-gluon-mla-h100): up to 16 heads, one program per
# sequence and split on mma.sync (1.0-1.37x; the split heuristic filling one program per SM: 4-29% faster than two);
# 128 heads, 64 per program on wgmma (1.47-1.98x), from 8 sequences: a lone sequence's programs are too short for
# the wgmma kernel's fixed cost (0.64-0.91x torch's bmm at B1 L <= 8k, where the Triton kernel did better).
# The 64-head kernels store O through the ring's stages in whole rows (stage_out): 8-12% faster at B64 L 1k-8k
# and 6 µs less fixed cost per program; the 16-head kernel's 16 x 512 O gains nothing from it (within 1%;
# bench/results/2026-12-07-stage-out-c3-h100).
GLUON_MLA_DEFAULTS = {
    (16, 512): MLAConfig(block_h=16, block_m=16, block_n=64, num_warps=4, num_stages=2, kernel="gluon"),
    (128, 512): MLAConfig(block_h=64, block_m=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon",
                          stage_out=True),
}
GLUON_MLA_MIN_BATCH = {(16, 512): 1, (128, 512): 8}
# The 64-head kernel takes the seesaw schedule where each program walks at least this many keys (the table's
# capacity over the split count): 1.06-1.20x the lockstep schedule from 4096, equal at 2048, 0.76-0.96x below
# (its fixed cost per program over few tiles; bench/results/2026-12-07-mla-seesaw-fwd-band-h100, H100).
SEESAW_MIN_KEYS = 2048
# The 16-head Gluon default splits for one program per two SMs where each program then walks at most this many keys:
# there 64 programs stream the latent as fast as 128 and write half the partials (B64 L1k, no split: 35.8 -> 32.5
# µs; B8 L1k-8k 3-10% faster); longer programs lose 1-2% on half the SMs (B32-64 L 4k-32k). H100 sweep in
# bench/results/2026-12-07-aligned-floor-h100 (call4).
HALF_GRID_MAX_KEYS = 1024


def gluon_mla_default(q, latent_cache, v_head_dim: int, *, decode: bool) -> tuple[MLAConfig | None, str]:
    """(the Gluon MLA decode's config, why) where the default plan takes it, else (None, why not)."""
    from ioattn.ops.gluon_mla import gluon_mla_unsupported

    why_not = gluon_mla_unsupported(q, latent_cache, v_head_dim, decode=decode)
    if why_not is not None:
        return None, why_not
    key = (max(16, next_power_of_2(q.shape[1])), v_head_dim)
    config = GLUON_MLA_DEFAULTS.get(key)
    if config is None:
        return None, f"the Gluon MLA decode is not the default for {q.shape[1]} heads at v_head_dim {v_head_dim}"
    if q.shape[0] < GLUON_MLA_MIN_BATCH[key]:
        return None, (f"the Gluon MLA decode at {q.shape[1]} heads is the default from {GLUON_MLA_MIN_BATCH[key]} "
                      f"sequences, got {q.shape[0]}")
    return config, f"sm_90, {q.shape[1]} heads, latent {v_head_dim}: the Gluon MLA decode"


def candidate_configs(num_heads: int, *, decode: bool) -> list[MLAConfig]:
    """Configurations worth timing for one shape on the GPU (pass each as `config=`): the sm_90 builds of the
    Triton ones hold their accumulator without spills (lab/aot.py --mla); decode adds the Gluon decode's."""
    if num_heads <= 16:
        shapes = [(16, n, w) for n in (16, 32, 64) for w in (4, 8)]
    else:
        shapes = [(16, 32, 4), *((h, n, 8) for h in (32, 64) for n in (16, 32))]
    triton_configs = [MLAConfig(block_h=h, block_m=h if decode else max(64, h), block_n=n, num_warps=w, num_stages=s)
                      for h, n, w in shapes for s in (1, 2, 3)]
    return triton_configs + (gluon_candidate_configs(num_heads) if decode else [])


def gluon_candidate_configs(num_heads: int, v_head_dim: int = 512) -> list[MLAConfig]:
    """The Gluon MLA decode's configurations worth timing on sm_90 (`launch_gluon_mla` refuses them elsewhere):
    16 heads per program on mma.sync, and from 64 heads 64 per program on wgmma (in lockstep, or on the seesaw
    schedule); 32- or 64-key tiles, 2-4 stages where shared memory holds them, registers uncapped or (16 heads)
    capped at 128."""
    from ioattn.ops.gluon_mla import gluon_mla_config_unsupported

    shapes = [(16, 4, None), (16, 4, 128)] + ([(64, 8, None)] if num_heads >= 64 else [])
    configs = [MLAConfig(block_h=h, block_m=h, block_n=n, num_warps=w, num_stages=s, maxnreg=r, kernel="gluon",
                         seesaw=seesaw)
               for h, w, r in shapes for n in (32, 64) for s in (2, 3, 4) for seesaw in (False, h == 64)]
    return list(dict.fromkeys(c for c in configs if gluon_mla_config_unsupported(c, v_head_dim) is None))


@dataclass(frozen=True)
class MLAPlan:
    """What an mla_paged_attention call launches; str() explains it."""

    config: MLAConfig
    num_splits: int
    block_h: int
    tokens_per_tile: int
    q_tiles_per_seq: int
    head_blocks: int
    dependent_combine: bool = False
    backend: str = "triton"
    reason: str = ""

    def __str__(self) -> str:
        if self.backend == "torch":
            return (f"torch MLA: {torch_paged.DESCRIPTION}; V is the latent part of the same rows"
                    + (f" ({self.reason})" if self.reason else ""))
        cfg = self.config
        mma = ("wgmma, seesaw" if cfg.seesaw else "wgmma") if cfg.block_h == 64 else "mma.sync"
        name = (f"gluon_mla_decode_kernel (sm_90: TMA latent rows by a producer warp, {mma})"
                if cfg.kernel == "gluon" else "mla_attention_kernel")
        launch = (f"{name} BLOCK_H={self.block_h} TOKENS={self.tokens_per_tile} BLOCK_N={cfg.block_n} "
                  f"num_warps={cfg.num_warps} num_stages={cfg.num_stages}"
                  + ("" if cfg.maxnreg is None else f" maxnreg={cfg.maxnreg}"))
        combine = " (programmatic dependent launch)" if self.dependent_combine else ""
        splits = f", {self.num_splits} splits + combine{combine}" if self.num_splits > 1 else ", no split"
        heads = f", {self.head_blocks} head blocks per query tile (each reads the latent rows)"
        return ("absorbed MLA over the paged latent cache (one shared KV head; V = the latent part of the rows "
                "K came from): " + launch + heads + splits + (f" ({self.reason})" if self.reason else ""))


def mla_workspace(max_tokens: int, num_heads: int, v_head_dim: int, *, max_splits: int = MAX_SPLITS,
                  device=None) -> PagedWorkspace:
    """Split scratch (`ioattn.ops.paged.paged_workspace` over v_head_dim), allocated once for the largest batch
    (tokens = batch for decode) and reused every step."""
    return paged_workspace(max_tokens, num_heads, v_head_dim, max_splits=max_splits, device=device)


def plan_mla(q, latent_cache, block_table, *, decode: bool, max_seqlen_q: int, v_head_dim: int, num_splits: int = 0,
             config: MLAConfig | None = None, workspace: PagedWorkspace | None = None,
             dependent_combine: bool | None = None, backend: str = "auto") -> MLAPlan:
    """Path, tiles and split count for a call (host arithmetic on shapes only)."""
    num_heads = q.shape[1]
    backend, why = resolve_backend(backend, q.device)
    if backend == "torch":
        return MLAPlan(config or default_config(num_heads, v_head_dim, q.dtype, decode=decode), 1, 0, 0, 0, 0,
                       backend="torch", reason=why)
    default_gluon = False
    if config is None and decode and q.is_cuda:
        config, gluon_why = gluon_mla_default(q, latent_cache, v_head_dim, decode=decode)
        why = f"{why}; {gluon_why}" if config is not None else f"{why}; Triton kernel: {gluon_why}"
        default_gluon = config is not None
    elif config is not None and config.kernel == "gluon":
        from ioattn.ops.gluon_mla import gluon_mla_config_unsupported, gluon_mla_unsupported

        why_not = (gluon_mla_config_unsupported(config, v_head_dim)
                   or gluon_mla_unsupported(q, latent_cache, v_head_dim, decode=decode))
        require(why_not is None, f"config.kernel='gluon': {why_not}")
    config = config or default_config(num_heads, v_head_dim, q.dtype, decode=decode)
    block_h = config.block_h
    tokens = 1 if decode else max(1, config.block_m // block_h)
    q_tiles = 1 if decode else max(1, cdiv(max_seqlen_q, tokens))
    head_blocks = cdiv(num_heads, block_h)
    if num_splits == 0:
        programs = block_table.shape[0] * q_tiles * head_blocks
        capacity = block_table.shape[1] * latent_cache.shape[1]
        sms = _sm_count(q.device)
        num_splits = choose_num_splits(programs, capacity, max(1, sms // config.sms_per_program),
                                       programs_per_sm=config.programs_per_sm)
        if default_gluon and block_h == 16:
            half = choose_num_splits(programs, capacity, max(1, sms // 2), programs_per_sm=config.programs_per_sm)
            if half < num_splits and capacity // half <= HALF_GRID_MAX_KEYS:
                num_splits = half
                why += (f"; one program per two SMs: {capacity // half} keys per program (up to "
                        f"{HALF_GRID_MAX_KEYS}: HALF_GRID_MAX_KEYS)")
        if workspace is not None:  # stay within the caller's scratch: fewer splits, or none for a larger batch
            fits = q.shape[0] <= workspace.partial_out.shape[1]
            num_splits = min(num_splits, workspace.partial_out.shape[0]) if fits else 1
    keys_per_program = block_table.shape[1] * latent_cache.shape[1] // num_splits
    if default_gluon and block_h == 64 and keys_per_program >= SEESAW_MIN_KEYS:
        config = dataclasses.replace(config, seesaw=True)
        why += f"; the seesaw schedule: {keys_per_program} keys per program (from {SEESAW_MIN_KEYS}: SEESAW_MIN_KEYS)"
    dependent = num_splits > 1 and dependent_combine is not False and _dependent_launch_supported(q.device)
    return MLAPlan(config, num_splits, block_h, tokens, q_tiles, head_blocks, dependent, reason=why)


def _check_latent_cache(latent_cache, v_head_dim, dtypes) -> None:
    check_tensor("latent_cache", latent_cache)
    require(latent_cache.dim() == 4 and latent_cache.shape[2] == 1,
            f"latent_cache must be (num_blocks, block_size, 1, v_head_dim + rope_dim), got {tuple(latent_cache.shape)}")
    require(latent_cache.dtype in dtypes, f"latent_cache dtype must be one of {dtypes}, got {latent_cache.dtype} "
            "(an fp8 latent cache is not supported yet)")
    block_size = latent_cache.shape[1]
    require(block_size & (block_size - 1) == 0 and 1 <= block_size <= MAX_BLOCK_SIZE,
            f"latent_cache block_size must be a power of two in 1..{MAX_BLOCK_SIZE}, got {block_size}")
    require(latent_cache.stride(-1) == 1, "latent_cache must be contiguous in its last dim (stride(-1) == 1)")
    require(is_int(v_head_dim) and 16 <= v_head_dim <= MAX_LATENT_DIM and v_head_dim % 8 == 0,
            f"v_head_dim must be a multiple of 8 in [16, {MAX_LATENT_DIM}], got {v_head_dim!r}")
    rope = latent_cache.shape[3] - v_head_dim
    require(8 <= rope <= MAX_ROPE_DIM and rope % 8 == 0,
            f"latent_cache's last dim {latent_cache.shape[3]} must be v_head_dim ({v_head_dim}) + a RoPE part that "
            f"is a multiple of 8 in [8, {MAX_ROPE_DIM}]")


def _check_call(q, latent_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, v_head_dim, num_splits,
                softmax_scale, out, workspace, config, dependent_combine, backend, validate):
    """Every argument check of `mla_paged_attention`, before anything runs: (max_seqlen_q, scale, contents)."""
    decode = cu_seqlens_q is None
    check_tensor("q", q)
    require(q.dim() == 3, f"q must be (batch, heads, D) or (total_q, heads, D), got {tuple(q.shape)}")
    dtypes = dtypes_of(resolve_backend(backend, q.device)[0])
    require(q.dtype in dtypes, f"q dtype must be one of {dtypes}, got {q.dtype}")
    require(q.stride(-1) == 1, "q must be contiguous in its last dim (stride(-1) == 1)")
    _check_latent_cache(latent_cache, v_head_dim, dtypes)
    require(latent_cache.dtype == q.dtype,
            f"q and latent_cache must share a dtype, got {q.dtype}, {latent_cache.dtype}")
    require(q.shape[2] == latent_cache.shape[3], f"q's last dim {q.shape[2]} != latent_cache's {latent_cache.shape[3]}")
    require(q.shape[1] >= 1, f"q must have at least one head, got shape {tuple(q.shape)}")
    require(q.device == latent_cache.device, f"q is on {q.device} but latent_cache is on {latent_cache.device}")
    check_block_table(block_table, q.device)
    batch = block_table.shape[0]
    require(batch <= MAX_GRID_Y * 1024, f"block_table has {batch} sequences, more than a launch grid takes")
    check_int_vector("seq_lens", seq_lens, batch, q.device)
    contents = checks_contents(validate, q.device)
    if decode:
        require(q.shape[0] == batch, f"decode q has {q.shape[0]} rows but block_table has {batch} sequences")
        max_seqlen_q = 1
    else:
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, batch, q.shape[0], q.device, contents=contents)
        if max_seqlen_q is None:  # a host sync: pass max_seqlen_q to avoid it (and to capture CUDA graphs)
            max_seqlen_q = int(cu_seqlens_q.diff().max().item()) if batch else 0
        max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, contents=contents)
    require(is_int(num_splits) and 0 <= num_splits <= MAX_SPLITS,
            f"num_splits must be an int in [0, {MAX_SPLITS}] (0 = heuristic, 1 = no split), got {num_splits!r}")
    scale = softmax_scale_or_default(softmax_scale, q.shape[2])
    require(dependent_combine in (None, True, False),
            f"dependent_combine must be None, True or False, got {dependent_combine!r}")
    require(config is None or isinstance(config, MLAConfig),
            f"config must be an MLAConfig or None, got {type(config).__name__}")
    if config is not None:
        require(config.block_h in (16, 32, 64) and config.block_m % config.block_h == 0
                and config.block_n in (16, 32, 64, 128), f"config {config} needs block_h in 16/32/64, block_m a "
                "multiple of it and block_n in 16..128")
        require(is_int(config.programs_per_sm) and 1 <= config.programs_per_sm <= 32,
                f"config.programs_per_sm must be an int in [1, 32], got {config.programs_per_sm!r}")
        require(is_int(config.sms_per_program) and 1 <= config.sms_per_program <= 32,
                f"config.sms_per_program must be an int in [1, 32], got {config.sms_per_program!r}")
    require(workspace is None or isinstance(workspace, PagedWorkspace), "workspace must come from mla_workspace or "
            f"be None, got {type(workspace).__name__}")
    if out is not None:
        check_tensor("out", out)
        shape = (*q.shape[:2], v_head_dim)
        require(tuple(out.shape) == shape and out.dtype == q.dtype and out.device == q.device and out.stride(-1) == 1,
                f"out must be {shape} {q.dtype} on {q.device} with stride(-1) == 1, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}")
    if contents:
        check_table_contents(block_table, seq_lens, None if decode else cu_seqlens_q.diff(), latent_cache.shape[0],
                             latent_cache.shape[1], -1, 0)
    return max_seqlen_q, scale


def explain_mla(q, latent_cache, block_table, seq_lens, *, v_head_dim, cu_seqlens_q=None, max_seqlen_q=None,
                num_splits=0, workspace=None, config=None, dependent_combine=None, backend="auto",
                softmax_scale=None, validate=False, out=None, return_lse=False) -> MLAPlan:
    """The plan `mla_paged_attention` would run with these arguments (nothing runs)."""
    max_seqlen_q, _ = _check_call(q, latent_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, v_head_dim,
                                  num_splits, softmax_scale, None, workspace, config, dependent_combine, backend,
                                  validate)
    return plan_mla(q, latent_cache, block_table, decode=cu_seqlens_q is None, max_seqlen_q=max_seqlen_q,
                    v_head_dim=v_head_dim, num_splits=num_splits, config=config, workspace=workspace,
                    dependent_combine=dependent_combine, backend=backend)


def mla_paged_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    v_head_dim: int,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    num_splits: int = 0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    workspace: PagedWorkspace | None = None,
    config: MLAConfig | None = None,
    dependent_combine: bool | None = None,
    backend: str = "auto",
    validate: bool | None = None,
):
    """Absorbed MLA attention of new queries against a paged latent cache.

    Decode: q (B, H, D), one token per sequence at position seq_lens[b] - 1. Multi-token (speculative verify,
    chunked prefill over a cache): packed q (total_q, H, D) with int32 `cu_seqlens_q` (B + 1,), query i of
    sequence b at position seq_lens[b] - q_len_b + i, causal (its own row already in the cache). D = v_head_dim +
    the RoPE part; softmax_scale defaults to 1/sqrt(D) — pass the model's (DeepSeek's is over the unabsorbed
    head dim, with YaRN's mscale). num_splits, workspace, config, dependent_combine and validate as in
    `ioattn.ops.paged.paged_attention`. Returns (T, H, v_head_dim) in q's dtype and, with return_lse, the
    natural-log LSE in float32: (B, H) for decode, (H, total_q) packed. Rows that see no key give 0 and -inf.
    backend: "auto" (Triton on CUDA and under the CPU interpreter, else torch), "triton" or "torch".
    """
    decode = cu_seqlens_q is None
    max_seqlen_q, scale = _check_call(q, latent_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, v_head_dim,
                                      num_splits, softmax_scale, out, workspace, config, dependent_combine, backend,
                                      validate)
    plan = plan_mla(q, latent_cache, block_table, decode=decode, max_seqlen_q=max_seqlen_q, v_head_dim=v_head_dim,
                    num_splits=num_splits, config=config, workspace=workspace, dependent_combine=dependent_combine,
                    backend=backend)
    num_tokens, num_heads, _ = q.shape
    if plan.backend == "torch":
        # V = the rows themselves: the attention over all D columns, of which the first v_head_dim are the output.
        result = torch_paged.paged_attention(q, latent_cache, latent_cache, block_table, seq_lens, cu_seqlens_q,
                                             (-1, 0), 0, scale, None, return_lse)
        result, lse = result if return_lse else (result, None)
        result = result[..., :v_head_dim]
        out = result.contiguous() if out is None else out.copy_(result)
        return (out, lse) if return_lse else out
    if interpreter_upcast(q.dtype):  # the interpreter's bf16 dots are wrong: compute on float32 copies
        result = mla_paged_attention(
            q.float(), latent_cache.float(), block_table, seq_lens, v_head_dim=v_head_dim, softmax_scale=scale,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, num_splits=num_splits, return_lse=return_lse,
            workspace=workspace, dependent_combine=dependent_combine, backend="triton", validate=False)
        result, lse = result if return_lse else (result, None)
        out = result.to(q.dtype) if out is None else out.copy_(result)
        return (out, lse) if return_lse else out

    if out is None:
        out = torch.empty(num_tokens, num_heads, v_head_dim, dtype=q.dtype, device=q.device)
    batch = block_table.shape[0]
    # LSE is stored [token, head]; the packed layout (H, total_q) is the same buffer read transposed.
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if decode else \
        torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device).t()
    if num_tokens == 0 or batch == 0:
        return (out, lse if decode else lse.t()) if return_lse else out
    splits = plan.num_splits
    part_out, part_lse = split_partials(out, lse, splits, workspace)
    cfg = plan.config
    if cfg.kernel == "gluon":  # the plan checked that it can take this call
        from ioattn.ops.gluon_mla import launch_gluon_mla

        launch_gluon_mla(q, latent_cache, block_table, seq_lens, part_out, part_lse, v_head_dim, scale, splits, cfg,
                         plan.dependent_combine)
        if splits > 1:
            combine_splits(part_out, part_lse, out, lse, plan.dependent_combine)
        return (out, lse) if return_lse else out
    rope = latent_cache.shape[3] - v_head_dim
    grid = (batch * plan.q_tiles_per_seq, plan.head_blocks, splits)
    mla_attention_kernel[grid](
        q, latent_cache, block_table, seq_lens, seq_lens if decode else cu_seqlens_q, part_out, part_lse,
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        scale * math.log2(math.e), num_heads, splits, plan.q_tiles_per_seq,
        LATENT=v_head_dim, ROPE=rope, BLOCK_L=next_power_of_2(v_head_dim), BLOCK_R=max(16, next_power_of_2(rope)),
        BLOCK_H=plan.block_h, TOKENS=plan.tokens_per_tile, BLOCK_N=cfg.block_n, PAGE=latent_cache.shape[1],
        DECODE=decode, IEEE=q.dtype == torch.float32, NUM_STAGES=cfg.num_stages,
        RELEASE_DEPENDENTS=plan.dependent_combine,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    if splits > 1:
        combine_splits(part_out, part_lse, out, lse, plan.dependent_combine)
    if not return_lse:
        return out
    return out, lse if decode else lse.t()


def compile_mla_variants(num_heads: int, latent_cache: torch.Tensor, v_head_dim: int, *,
                         workspace: PagedWorkspace | None = None, max_seqlen_q: int = 1) -> None:
    """Run (so compile) every variant of `mla_paged_attention` a serving step can take with this cache, so that
    no kernel compiles mid-serving: decode, and multi-token queries of up to `max_seqlen_q` tokens, unsplit and at
    each power-of-two split count (the combine is specialised on the count), the multi-token ones at one, two and
    sixteen query tiles per sequence (Triton specialises an int argument on being 1 or a multiple of 16). The
    queries are contiguous (tokens, heads, D), as the engine's absorbed query is; the cache is only read."""
    device, width = latent_cache.device, latent_cache.shape[3]
    tile = plan_mla(torch.empty(1, num_heads, width, dtype=latent_cache.dtype, device=device), latent_cache,
                    torch.zeros(1, 1, dtype=torch.int32, device=device), decode=False, max_seqlen_q=1,
                    v_head_dim=v_head_dim, backend="triton").tokens_per_tile
    lengths = sorted({1, *(n for n in (2 * tile, 16 * tile) if n <= max_seqlen_q)})
    q = torch.zeros(lengths[-1], num_heads, width, dtype=latent_cache.dtype, device=device)
    # Every position of the longest query in block 0 (read only): the table covers all of them.
    table = torch.zeros(1, cdiv(lengths[-1], latent_cache.shape[1]), dtype=torch.int32, device=device)
    common = dict(v_head_dim=v_head_dim, backend="triton", validate=None)  # checked where checks are on
    # decode at one sequence and at the batch from which the default kernel changes (GLUON_MLA_MIN_BATCH)
    batches = sorted({1, *GLUON_MLA_MIN_BATCH.values()})
    decode_q = torch.zeros(batches[-1], num_heads, width, dtype=latent_cache.dtype, device=device)
    decode_table = torch.zeros(batches[-1], 1, dtype=torch.int32, device=device)
    for splits in (1 << i for i in range(MAX_SPLITS.bit_length())):
        for batch in batches:
            if workspace is None or batch <= workspace.partial_out.shape[1]:
                mla_paged_attention(decode_q[:batch], latent_cache, decode_table[:batch],
                                    torch.ones(batch, dtype=torch.int32, device=device), num_splits=splits,
                                    workspace=workspace, **common)
        for length in lengths:  # the engine's multi-token calls take split scratch of their own
            cu_seqlens_q = torch.tensor([0, length], dtype=torch.int32, device=device)
            mla_paged_attention(q[:length], latent_cache, table, cu_seqlens_q.new_tensor([length]),
                                cu_seqlens_q=cu_seqlens_q, max_seqlen_q=length, num_splits=splits, **common)
