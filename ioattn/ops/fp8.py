"""FP8 KV caches: the two formats, their per-KV-head scales, and the torch reference of quantization.

A cache in `float8_e4m3fn` or `float8_e5m2` holds `round(x / scale)` per element, saturated to the format's
finite range, with one float32 scale per KV head for K and one for V (`k_scale`, `v_scale`: (num_kv_heads,)),
so that `x ≈ q * scale`. Quantization rounds to nearest, ties to even (what the hardware's conversion does),
after clamping to ±max: a finite input never becomes NaN or inf (e4m3fn has no inf, and its overflow would be
NaN); a NaN input stays NaN, so a poisoned key is never hidden. The kernels fold the K scale into the softmax
scale and the V scale into the output; the ops here are what the torch paths and the tests use.

Hardware: the Triton kernels convert fp8 with the conversion instructions of compute capability 8.9+ (Ada,
Hopper); on an older GPU an fp8 cache is refused with a ValueError before anything runs. On the CPU, the
torch backend and Triton's interpreter both take fp8 caches (the interpreter's fp8 -> wider conversions are
exact for every finite code; its wider -> fp8 conversion is not, so the cache-write kernel rounds to the fp8
grid itself before converting, see `ioattn.kernels.cache_ops`).
"""

from __future__ import annotations

import functools

import torch

from ioattn.ops.capability import device_capability

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The names users pass (`kv_cache_dtype=`); "auto" keeps the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MIN_CAPABILITY = (8, 9)
# Mantissa bits and the smallest normal exponent of each format: the kernels' rounding needs them.
FORMAT_BITS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """"fp8_e4m3" / "fp8_e5m2" for the fp8 formats, else the torch name ("bfloat16", ...)."""
    for name, value in KV_CACHE_DTYPES.items():
        if value is dtype:
            return name
    return str(dtype).removeprefix("torch.")


def parse_kv_cache_dtype(value) -> torch.dtype | None:
    """The cache dtype a `kv_cache_dtype` setting names (None: "auto", the model's dtype)."""
    if isinstance(value, torch.dtype) and value in FP8_DTYPES:
        return value
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {value!r}")
    return KV_CACHE_DTYPES[value]


def check_fp8_supported(device: torch.device, name: str = "k_cache") -> None:
    """ValueError unless the device converts fp8 in hardware (CUDA 8.9+), or is the CPU."""
    problem = fp8_problem(device)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


@functools.cache
def fp8_problem(device: torch.device) -> str | None:
    """Why `device` cannot hold an fp8 cache, or None (asked once per device: the ops ask on every call)."""
    capability = device_capability(device)
    if capability is not None and capability < FP8_MIN_CAPABILITY:
        return (f"an fp8 KV cache needs a GPU with fp8 conversions (compute capability "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))}+, Ada or Hopper); {device} has "
                f"{'.'.join(map(str, capability))}")
    return None


def check_scales(k_cache: torch.Tensor, k_scale, v_scale) -> None:
    """fp8 caches take float32 (num_kv_heads,) scales for K and V on their device; other caches none."""
    heads = k_cache.shape[2]
    if not is_fp8(k_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale apply to fp8 caches only; k_cache is {k_cache.dtype}")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"{name} is required with an fp8 cache ({k_cache.dtype}): float32 (num_kv_heads,) = "
                             f"({heads},), one dequantization scale per KV head")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.shape != (heads,):
            got = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
            raise ValueError(f"{name} must be a float32 tensor of shape (num_kv_heads,) = ({heads},), got {got}")
        if not scale.is_contiguous() or scale.device != k_cache.device:
            raise ValueError(f"{name} must be contiguous and on the caches' device ({k_cache.device}), got "
                             f"stride {scale.stride()} on {scale.device}")


def check_scale_values(name: str, scale: torch.Tensor) -> None:
    """Every scale finite and > 0 (read on the host: call it where contents are checked)."""
    values = scale.detach().to("cpu", torch.float64)
    bad = ~(torch.isfinite(values) & (values > 0))
    if bad.any():
        head = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{head}] = {float(values[head])!r}: scales must be finite and > 0")


def scale_for_amax(amax: torch.Tensor, dtype: torch.dtype, headroom: float) -> torch.Tensor:
    """float32 scales 2^ceil(log2(amax * headroom / max)): amax lands in [max / (2 headroom), max / headroom]; a
    power of two, so dequantization is exact in every dtype. amax 0 (nothing seen) gives 1."""
    exponent = torch.ceil(torch.log2(amax.double() * headroom / fp8_max(dtype)))
    return torch.where(amax > 0, torch.exp2(exponent), 1.0).float()


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (..., num_kv_heads, D) -> fp8: x / scale per head in float32, saturated to ±max, rounded to nearest
    even; NaN stays NaN (the torch path of `reshape_and_cache`, and the tests' reference)."""
    limit = fp8_max(dtype)
    scaled = x.float() / scale[:, None]
    return torch.where(scaled.isnan(), scaled, scaled.clamp(-limit, limit)).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 (..., num_kv_heads, D) -> dtype: q * scale per head, computed in float32 (float64 stays float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(compute) * scale.to(compute)[:, None]).to(dtype)


# The rotation an fp8 cache may store K and V in (see `ioattn.engine.kv_scales`): its name, and the seed of its signs.
KV_ROTATION = "hadamard-signed"
KV_ROTATION_SEED = 0


def kv_rotation(head_dim: int) -> torch.Tensor | None:
    """The ±1 matrix M = diag(s) H (H the Sylvester Hadamard matrix, s random signs from a fixed seed) with
    M M^T = M^T M = head_dim * I, float32 (head_dim, head_dim); None unless head_dim is a power of two.

    A cache rotated by it holds K M / D and V M / D and the queries become q M: (q M).(k M / D) = q.k, and the
    output o' = P (V M / D) gives o = o' M^T. Every entry (±1, ±1/D) is exact in float16 and bfloat16, so only the
    products round. The signs matter: the plain Hadamard matrix's first column is all ones, which puts the mean of
    K (a large part of its RMS on smollm2) into one channel."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(KV_ROTATION_SEED)) * 2.0 - 1
    return signs[:, None] * h


def bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (the same memory), for the copies torch has no fp8 kernel for (index_copy_ on
    the CPU); any other cache as itself."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
