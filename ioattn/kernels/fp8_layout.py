"""V's fp8 codes laid out for the fp8 P·V wgmma, which reads only K-major operands: (B, N, H, D) bytes to
(B, H, D, N') with each head's keys contiguous, N' the row width (a multiple of 16), zeros past N.

PERMUTE takes the keys of each group of 16 in the order the Gluon kernel's P from registers holds them: position
4t + 2b + e of a group holds key 8b + 2t + e (`ioattn.ops.fp8_attention.KEY_ORDER`). torch's strided copy moves
these bytes at ~0.3 TB/s on an H100 (a 1-byte transpose); tiles through shared memory move them at copy speed.
"""

import triton
import triton.language as tl


@triton.jit
def transpose_keys_kernel(Src, Dst, n_keys, n_heads, width, stride_sb, stride_sn, stride_sh,
                          HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, PERMUTE: tl.constexpr):
    """Grid (B * H * cdiv(width, BLOCK_K),) (one axis: the second is capped at 65535). Src: bytes (B, N, H, D), D
    contiguous; Dst: bytes (B, H, D, width) contiguous. Program p writes positions (p % blocks) * BLOCK_K .. of
    batch bh // H, head bh % H, where bh = p // blocks."""
    blocks = tl.cdiv(width, BLOCK_K)
    block = tl.program_id(0) % blocks
    bh = tl.program_id(0) // blocks
    batch = bh // n_heads
    head = bh % n_heads
    positions = block * BLOCK_K + tl.arange(0, BLOCK_K)
    if PERMUTE:  # position 16g + 4t + 2b + e holds key 16g + 8b + 2t + e
        within = positions % 16
        keys = positions - within + 8 * ((within // 2) % 2) + 2 * (within // 4) + within % 2
    else:
        keys = positions
    dims = tl.arange(0, HEAD_DIM)
    src = (Src + batch.to(tl.int64) * stride_sb + head * stride_sh + keys.to(tl.int64)[:, None] * stride_sn
           + dims[None, :])
    tile = tl.load(src, mask=(keys < n_keys)[:, None], other=0)
    dst = Dst + bh.to(tl.int64) * HEAD_DIM * width + dims[:, None] * width + positions[None, :]
    tl.store(dst, tl.trans(tile), mask=(positions < width)[None, :])
