"""Where do the kernels behind the open bars spend their cycles, next to cuDNN's on the same inputs? One case
per run, for Nsight Compute: the case runs three times outside the profiled range (compiles, caches), then
once between cudaProfilerStart/Stop, so `ncu --profile-from-start off` reads only that launch's kernels.

Cases (bf16 unless named; B·N 16k, H·D 2048 as `ioattn bench prefill`):
  d64causal-gluon / d64causal-cudnn   causal D 64, N 2k, 32 heads (W2 5/7's bf16 row at 0.88x cuDNN)
  d128-gluon / d128-cudnn             unmasked D 128, N 4k, 16 heads (the bf16 side of the fp8 bar)
  fp8-gluon                           the fp8 forward at D 128, N 4k, unmasked (1.28x bf16; bar 1.6x)
  mla128                              the MLA decode, 128 heads, B 64, L 1k, pages of 64 (W2 7/7: 46% of matmul)
  mla16                               16 heads, the same cache (W2 7/7: 71% of copy; its split combine too)

    PYTHONPATH=. ncu --clock-control none --profile-from-start off ... python3 lab/ncu_kernels.py CASE
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def _qkv(n, heads, d, dtype=torch.bfloat16):
    return [torch.randn(16384 // n, n, heads, d, device="cuda", dtype=dtype) for _ in range(3)]


def _cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)


def _gluon(q, k, v, causal):
    from ioattn.ops.gluon_forward import gluon_forward

    return gluon_forward(q, k, v, causal=causal)[0]


def _fp8():
    import ioattn

    # e4m3 inputs with their descales, as a caller holding fp8 tensors passes them: no quantization kernels
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(4096, 16, 128))
    ones = torch.ones(q.shape[0], 16, device="cuda")
    return lambda: ioattn.flash_attn_fp8_func(q, k, v, causal=False, q_descale=ones, k_descale=ones, v_descale=ones,
                                              backend="gluon")


def _mla(heads):
    from ioattn.bench.mla import ROW_DIM, SOFTMAX_SCALE, latent_pool
    from ioattn.ops.mla import mla_paged_attention, mla_workspace

    batch, length = 64, 1024
    q = torch.randn(batch, heads, ROW_DIM, dtype=torch.bfloat16, device="cuda")
    latent = torch.randn(batch, length, ROW_DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    pool, table = latent_pool(latent, 64)
    workspace = mla_workspace(batch, heads, 512, device="cuda")
    return lambda: mla_paged_attention(q, pool, table, lens, v_head_dim=512, softmax_scale=SOFTMAX_SCALE,
                                       workspace=workspace)


def case(name: str):
    if name == "fp8-gluon":
        return _fp8()
    if name.startswith("mla"):
        return _mla(int(name[3:]))
    shape, _, backend = name.partition("-")
    n, heads, d, causal = {"d64causal": (2048, 32, 64, True), "d128": (4096, 16, 128, False)}[shape]
    q, k, v = _qkv(n, heads, d)
    fn = {"gluon": _gluon, "cudnn": _cudnn}[backend]
    return lambda: fn(q, k, v, causal)


def main() -> None:
    run = case(sys.argv[1])
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
