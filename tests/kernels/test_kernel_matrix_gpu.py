"""The layouts users hit, on the GPU: forward and backward against the float64 reference for head dims 8..256 in
steps of 8 (the padded ones above all), q/k/v as views of packed qkv and kv tensors, transposed and strided inputs,
a strided or expanded dO, causal / window / GQA / varlen with empty and length-1 sequences, deterministic on and
off, bf16 and fp16, N from 1 to 4k. Each case synchronises, so a CUDA fault fails the case that caused it.

The cases come from `op_fuzz_worker` (the fuzzer's case runner) so the layouts are built one way everywhere.
"""

from __future__ import annotations

import pytest
import torch

import ioattn
from op_fuzz_worker import run

pytestmark = pytest.mark.gpu

HEAD_DIMS = list(range(8, 257, 8))
DENSE_LAYOUTS = ["qkv_packed", "kv_packed", "contiguous", "transposed", "strided", "last_dim_strided"]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 0)), (True, (17, -1))]
LENGTHS = [(97, 97), (384, 384), (1, 147), (256, 512), (1024, 1024), (203, 113)]


def _dense(d, i):
    layout = DENSE_LAYOUTS[i % len(DENSE_LAYOUTS)]
    n_q, n_k = LENGTHS[i % len(LENGTHS)]
    if layout == "qkv_packed":
        n_k = n_q
    causal, window = MASKS[(i // 2) % len(MASKS)]
    hq, hkv = (4, 1) if layout == "kv_packed" or i % 3 == 0 else (2, 2)
    if layout == "qkv_packed":
        hq = hkv = 2
    return dict(op="flash_attn_func", seed=1000 + i, dtype="bfloat16" if i % 2 else "float16", B=2, Nq=n_q, Nk=n_k,
                Hq=hq, Hkv=hkv, D=d, causal=causal, window=list(window), scale=None, backend="triton",
                deterministic=bool(i % 4 < 2), layout=layout, grad=True,
                do_layout=["contiguous", "strided", "transposed", "expanded"][i % 4])


def _varlen(d, i):
    lens_q = [[0, 1, 113, 37], [203, 0, 1, 64], [128, 128]][i % 3]
    lens_k = [[0, 1, 203, 37], [113, 5, 1, 64], [128, 128]][i % 3]
    causal, window = MASKS[i % len(MASKS)]
    return dict(op="flash_attn_varlen_func", seed=2000 + i, dtype="float16" if i % 2 else "bfloat16", lens_q=lens_q,
                lens_k=lens_k, Hq=4, Hkv=2 if i % 2 else 4, D=d, causal=causal, window=list(window), scale=None,
                backend="triton", cu_q="ok", cu_k="ok", max_q="exact", grad=True,
                deterministic=bool(i % 2), layout="qkv_packed" if i % 3 == 2 and i % 2 == 0 else "kv_packed")


CASES = [_dense(d, i) for i, d in enumerate(HEAD_DIMS)]
CASES += [_dense(d, i + 7) for i, d in enumerate(HEAD_DIMS)]
CASES += [_varlen(d, i) for i, d in enumerate(HEAD_DIMS)]
# The failures the attacker-style review listed, each as it was reported.
CASES += [
    dict(_dense(160, 0), Nq=97, Nk=97, causal=True, window=[-1, -1], deterministic=True, dtype="bfloat16"),
    dict(_dense(64, 0), Nq=768, Nk=768, causal=True, window=[-1, -1], dtype="bfloat16"),
    dict(_varlen(192, 2), lens_q=[128, 128], lens_k=[128, 128], layout="qkv_packed", Hkv=4),
    dict(_dense(256, 2), Nq=1024, Nk=1024, Hq=2, Hkv=2, causal=True, window=[-1, -1], deterministic=True,
         dtype="bfloat16"),
    *[dict(_dense(d, 1), Nq=n, Nk=n, Hq=8, Hkv=2, causal=False, window=[-1, -1]) for d, n in ((40, 256), (40, 512),
                                                                                              (256, 1024))],
    dict(_varlen(160, 0), lens_q=[113, 203], lens_k=[203, 113], window=[64, 0], causal=False),
    dict(_dense(96, 1), Nq=1, Nk=147, Hq=8, Hkv=2, layout="contiguous", causal=True, window=[-1, -1]),
    dict(_dense(64, 2), B=1, Nq=4096, Nk=4096, Hq=2, Hkv=2, layout="contiguous", causal=True, window=[-1, -1]),
]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_layout_matrix(index):
    case = dict(CASES[index], device="cuda")
    result = run(case)
    assert result["outcome"] == "ok", f"{result['detail']}\ncase: {case}"


@pytest.mark.parametrize("n, d, packed", [(384, 64, False), (200, 64, True), (384, 128, True)])
def test_repeated_deterministic_backward_is_bitwise_equal(n, d, packed):
    """flash-attn's repeated-backward test: the same gradients bit for bit, run after run."""
    grads = []
    for _ in range(3):
        generator = torch.Generator().manual_seed(0)
        base = torch.randn(2, n, 3, 2, d, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
        q, k, v = base.unbind(2) if packed else (t.contiguous() for t in base.unbind(2))
        out = ioattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        grads.append(base.grad.clone())
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_matrix_covers_every_padded_head_dim():
    covered = {case["D"] for case in CASES}
    assert covered == set(HEAD_DIMS)
    assert {"qkv_packed", "kv_packed", "transposed", "strided"} <= {case.get("layout") for case in CASES}
    assert any(0 in case.get("lens_q", ()) and 1 in case.get("lens_q", ()) for case in CASES)
    assert len(CASES) >= 100
