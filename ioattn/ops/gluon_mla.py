"""Launcher of the Gluon MLA decode (`ioattn.kernels.gluon_mla`), sm_90 only: `MLAConfig(kernel="gluon")`.

It takes what the Triton MLA kernel's decode takes except float32, latents that are not a multiple of 64 up to
512, RoPE parts other than 64 and pages under 16 slots. `MLAConfig(block_h=16, num_warps=4)` runs 16 heads per
program on mma.sync, `MLAConfig(block_h=64, num_warps=8)` 64 on wgmma (two warpgroups, in lockstep or, `seesaw=True`,
on two tiles at once); `gluon_mla_unsupported` names the first argument it cannot take,
`gluon_mla_config_unsupported` the first field of a config it cannot build.
"""

from __future__ import annotations

import math

import torch

from ioattn.ops.capability import HOPPER_SHARED_MEMORY, MAX_GRID_Y, device_capability
from ioattn.ops.gluon_paged import cache_descriptor

ROPE_DIM = 64
MAX_LATENT = 512
REGISTERS = 65536


def gluon_mla_unsupported(q: torch.Tensor, latent_cache: torch.Tensor, v_head_dim: int, *, decode: bool
                          ) -> str | None:
    """Why the Gluon MLA decode cannot take this call (None when it can); the device is checked last, so every
    other reason shows on any machine."""
    if not decode:
        return "the Gluon MLA kernel is decode only (cu_seqlens_q must be None)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the Gluon MLA kernel takes float16 or bfloat16 q, got {q.dtype}"
    if v_head_dim % 64 or v_head_dim > MAX_LATENT:
        return f"the Gluon MLA kernel takes v_head_dim a multiple of 64 up to {MAX_LATENT}, got {v_head_dim}"
    if latent_cache.shape[3] - v_head_dim != ROPE_DIM:
        return (f"the Gluon MLA kernel takes a RoPE part of {ROPE_DIM} values, got "
                f"{latent_cache.shape[3] - v_head_dim}")
    if q.shape[0] > MAX_GRID_Y:
        return f"the Gluon MLA kernel takes at most {MAX_GRID_Y} sequences (its grid's second axis), got {q.shape[0]}"
    blocks, page, _, dim = latent_cache.shape
    if page < 16:
        return f"the Gluon MLA kernel takes cache blocks of 16 or more tokens, got {page}"
    row = latent_cache.stride(1)  # TMA views the cache as (blocks * PAGE, D) rows of slots, 16-byte aligned
    if (latent_cache.stride(3) != 1 or (blocks > 1 and latent_cache.stride(0) != page * row)
            or row * latent_cache.element_size() % 16 or latent_cache.data_ptr() % 16):
        return ("the Gluon MLA kernel reads latent_cache as rows of slots (stride(0) == block_size * stride(1), "
                f"stride(3) == 1, 16-byte aligned rows), got strides {latent_cache.stride()}")
    if not (q.is_cuda and device_capability(q.device) == (9, 0)):
        return f"the Gluon MLA kernel needs an sm_90 GPU, q is on {q.device}"
    return None


def gluon_mla_config_unsupported(config, v_head_dim: int) -> str | None:
    """Why the Gluon MLA decode cannot build `config` (an MLAConfig with kernel="gluon"), None when it can: 16
    heads per program on four consumer warps (mma.sync) or 64 on eight (two warpgroups on wgmma), a tile of 32 or
    64 keys, the ring, Q and P within shared memory."""
    if (config.block_h, config.num_warps) not in ((16, 4), (64, 8)):
        return ("config.block_h and num_warps must be 16 and 4 (mma.sync) or 64 and 8 (wgmma) for the Gluon MLA "
                f"kernel, got block_h={config.block_h}, num_warps={config.num_warps}")
    if config.block_n not in (32, 64):
        return f"config.block_n must be 32 or 64 for the Gluon MLA kernel, got {config.block_n}"
    if config.seesaw and (config.block_h, config.block_n, config.num_stages, config.maxnreg) != (64, 64, 2, None):
        return ("config.seesaw takes block_h=64, block_n=64, num_stages=2 (a pair of tiles) and maxnreg=None (it "
                f"sets each warpgroup's registers), got block_h={config.block_h}, block_n={config.block_n}, "
                f"num_stages={config.num_stages}, maxnreg={config.maxnreg}")
    # the launch counts whole warpgroups: the consumer warps, the producer warp and the idle rest of its group
    threads = 128 * math.ceil((config.num_warps + 1) / 4)
    if config.maxnreg is not None and config.maxnreg * threads > REGISTERS:
        return (f"config.maxnreg={config.maxnreg} x {threads} threads exceeds an SM's {REGISTERS} registers (the "
                f"Gluon MLA kernel launches {threads}); at most {REGISTERS // threads // 8 * 8}, or None")
    row_bytes = 2 * (v_head_dim + ROPE_DIM)
    shared = (config.num_stages * config.block_n * row_bytes + config.block_h * row_bytes
              + config.block_h * config.block_n * 2)
    if shared > HOPPER_SHARED_MEMORY:
        return (f"config.num_stages={config.num_stages} x block_n={config.block_n} latent rows need {shared} bytes "
                f"of shared memory, more than {HOPPER_SHARED_MEMORY}")
    return None


def launch_gluon_mla(q, latent_cache, block_table, seq_lens, part_out, part_lse, v_head_dim: int, scale: float,
                     splits: int, config, release_dependents: bool = False) -> None:
    """One launch over grid (cdiv(heads, config.block_h), batch, splits), writing the Triton kernel's partials (or
    the output): 16 heads per program on mma.sync, or 64 on wgmma; release_dependents: the split combine follows by
    programmatic dependent launch."""
    from ioattn.kernels import gluon_mla

    batch, num_heads, _ = q.shape
    rows = min(latent_cache.shape[1], config.block_n)
    wide = config.block_h == 64
    gluon_mla.gluon_mla_decode_kernel[(math.ceil(num_heads / config.block_h), batch, splits)](
        cache_descriptor(latent_cache, rows, v_head_dim), cache_descriptor(latent_cache, rows, ROPE_DIM), q,
        block_table, seq_lens, part_out, part_lse,
        q.stride(0), q.stride(1), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        scale * math.log2(math.e), num_heads, splits,
        BLOCK_N=config.block_n, PAGE=latent_cache.shape[1], STAGES=config.num_stages, WIDE=wide,
        RELEASE_DEPENDENTS=release_dependents, SEESAW=config.seesaw, STAGE_OUT=config.stage_out,
        num_warps=4 if config.seesaw else config.num_warps, maxnreg=config.maxnreg,  # seesaw: 4 + 4 in partitions
    )
