"""The decoder's elementwise work fused into one launch each: RMSNorm (optionally adding the residual first),
RoPE on q and k in place, and SiLU-and-mul.

Each kernel rounds where the unfused PyTorch code (`ioattn.models.llama`) rounds: torch evaluates every bf16/fp16
elementwise op in float32 and rounds its result to the tensor's dtype, so the kernels compute in float32 and cast
to the element type after each op that torch runs as its own kernel. The launcher passes `enable_fp_fusion=False`
for the same reason (torch's separate kernels cannot contract a multiply and an add into one FMA).

LIBDEVICE selects CUDA's libdevice for exp/cos/sin/rsqrt: Triton's own exp is the fast `ex2.approx`, while
torch's kernels call libdevice's `expf`, `cosf`, ... . The CPU interpreter has no libdevice and uses numpy's.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        result = libdevice.exp(x)
    else:
        result = tl.exp(x)
    return result


@triton.jit
def _rsqrt(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        result = libdevice.rsqrt(x)
    else:
        result = tl.math.rsqrt(x)
    return result


@triton.jit
def _cos_sin(angle, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    return cos, sin


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x rounded to `dtype` and widened back to float32: the value torch's op would have stored."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _input_row(X_row, R_row, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """The row the norm sees, in float32: x, or x + residual rounded as torch's add rounds."""
    h = tl.load(X_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R_row + cols, mask=mask, other=0.0).to(tl.float32)
        h = _rounded(h + r, X_row.dtype.element_ty)
    return h


@triton.jit
def _store_normed(h, rstd, Weight, O_row, R_row, cols, mask, HAS_RESIDUAL: tl.constexpr):
    dtype = O_row.dtype.element_ty
    if HAS_RESIDUAL:
        tl.store(R_row + cols, h.to(dtype), mask=mask)
    w = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
    # RMSNorm.forward: normalise in float32, round to the dtype, then scale (a rounded dtype x dtype multiply).
    tl.store(O_row + cols, (w * _rounded(h * rstd, dtype)).to(dtype), mask=mask)


@triton.jit
def rms_norm_kernel(
    X, Residual, Weight, Out,
    stride_xt, stride_xn, stride_rt, stride_rn, stride_ot, stride_on,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Grid (tokens, rows per token): normalise one row of `hidden` <= BLOCK elements, held in registers.

    With HAS_RESIDUAL the row is x + residual, and that sum is written back into Residual (the next layer's
    residual stream). x and residual are read once; the whole row stays in registers between the sum of squares
    and the scaling.
    """
    token = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    X_row = X + token * stride_xt + row * stride_xn
    R_row = Residual + token * stride_rt + row * stride_rn
    O_row = Out + token * stride_ot + row * stride_on
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = _input_row(X_row, R_row, cols, mask, HAS_RESIDUAL)
    rstd = _rsqrt(tl.sum(h * h, axis=0) / hidden + eps, LIBDEVICE)
    _store_normed(h, rstd, Weight, O_row, R_row, cols, mask, HAS_RESIDUAL)


@triton.jit
def _rotate_heads(X_token, stride_h, first_head, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate heads [first_head, first_head + BLOCK_HEADS) of one token in place (halves convention)."""
    dtype = X_token.dtype.element_ty
    heads = first_head + tl.arange(0, BLOCK_HEADS)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < HALF)
    first = X_token + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    # apply_rotary: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype.
    out1 = _rounded(x1 * cos, dtype) + _rounded(-x2 * sin, dtype)
    out2 = _rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def rotary_embedding_kernel(
    Q, K, Positions, Inv_freq,
    stride_qt, stride_qh, stride_kt, stride_kh,
    num_q_heads, num_kv_heads, q_head_blocks,
    HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Grid (tokens, q_head_blocks + k head blocks): one token's block of q heads or of k heads.

    Angles are position * inv_freq in float32, their cos/sin rounded to the dtype (as `rotary_cos_sin`), so
    no cos/sin table is read.
    """
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    position = tl.load(Positions + token).to(tl.float32)
    angle = position * tl.load(Inv_freq + offs, mask=offs < HALF, other=0.0)
    cos, sin = _cos_sin(angle, LIBDEVICE)
    dtype = Q.dtype.element_ty
    cos, sin = _rounded(cos, dtype), _rounded(sin, dtype)
    if head_block < q_head_blocks:
        _rotate_heads(Q + token * stride_qt, stride_qh, head_block * BLOCK_HEADS, num_q_heads, cos, sin,
                      HALF, BLOCK_HEADS, BLOCK_HALF)
    else:
        _rotate_heads(K + token * stride_kt, stride_kh, (head_block - q_head_blocks) * BLOCK_HEADS, num_kv_heads,
                      cos, sin, HALF, BLOCK_HEADS, BLOCK_HALF)


@triton.jit
def silu_and_mul_kernel(
    Gate_up, Out, stride_gt, stride_ot, inter,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Grid (tokens, cdiv(inter, BLOCK)): out = silu(gate) * up for gate, up = the two halves of a row."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = Gate_up + token * stride_gt
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    # torch's silu: x / (1 + exp(-x)) in float32 with an IEEE division, rounded; then a rounded multiply.
    silu = _rounded(tl.math.div_rn(gate, 1.0 + _exp(-gate, LIBDEVICE)), dtype)
    tl.store(Out + token * stride_ot + cols, (silu * up).to(dtype), mask=mask)
