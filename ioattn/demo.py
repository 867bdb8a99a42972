"""The README's main job: check every kernel path against the float64 reference, then a quick benchmark.

On a CPU-only machine the Triton kernels run in Triton's interpreter (small shapes) and the torch backend runs
natively; on CUDA the same checks run compiled, bf16 included. Exit status 1 if any path misses its tolerance.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

import ioattn
import ioattn.kernels
from ioattn.reference import TOLERANCE, attention_ref, lse_error, rel_error, sdpa_ref


@dataclass
class Check:
    name: str
    run: Callable[[str, torch.dtype], float]  # returns the relative error against the reference


def _qkv(batch, n_q, n_k, h_q, h_kv, d, dtype, device):
    q = torch.randn(batch, n_q, h_q, d, dtype=dtype, device=device)
    k = torch.randn(batch, n_k, h_kv, d, dtype=dtype, device=device)
    v = torch.randn(batch, n_k, h_kv, d, dtype=dtype, device=device)
    return q, k, v


def _dense(backend: str, **options) -> Callable[[str, torch.dtype], float]:
    def run(device, dtype):
        q, k, v = _qkv(2, 67, 93, 4, 2, 72, dtype, device)
        out, lse = ioattn.flash_attn_func(q, k, v, return_lse=True, backend=backend, **options)
        ref, ref_lse = attention_ref(q, k, v, **options)
        assert lse_error(lse, ref_lse) < 1e-3, "log-sum-exp differs from the reference"
        return rel_error(out, ref)

    return run


def _varlen(backend: str) -> Callable[[str, torch.dtype], float]:
    def run(device, dtype):
        lens_q, lens_k = [5, 0, 40, 17], [9, 3, 40, 60]
        cu_q = torch.tensor([0] + lens_q, device=device).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=device).cumsum(0).to(torch.int32)
        q = torch.randn(sum(lens_q), 4, 64, dtype=dtype, device=device)
        k = torch.randn(sum(lens_k), 1, 64, dtype=dtype, device=device)
        v = torch.randn(sum(lens_k), 1, 64, dtype=dtype, device=device)
        out = ioattn.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, backend=backend
        )
        ref, _ = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
        return rel_error(out, ref)

    return run


def _sdpa_masked(device, dtype):
    q = torch.randn(2, 4, 33, 64, dtype=dtype, device=device)
    k = torch.randn(2, 4, 47, 64, dtype=dtype, device=device)
    v = torch.randn(2, 4, 47, 64, dtype=dtype, device=device)
    mask = torch.rand(2, 1, 33, 47, device=device) > 0.3
    out = ioattn.sdpa(q, k, v, attn_mask=mask)
    ref, _ = sdpa_ref(q, k, v, attn_mask=mask)
    return rel_error(out, ref)


def checks() -> list[Check]:
    backends = ["triton", "torch"]
    found = [Check(f"flash_attn_func[{b}] GQA 4:2 D=72 Nq!=Nk", _dense(b)) for b in backends]
    found += [Check(f"flash_attn_func[{b}] causal bottom-right", _dense(b, causal=True)) for b in backends]
    found += [Check(f"flash_attn_func[{b}] window (16, 0)", _dense(b, window_size=(16, 0))) for b in backends]
    found += [Check(f"flash_attn_varlen_func[{b}] causal, empty seq", _varlen(b)) for b in backends]
    found.append(Check("sdpa dense bool mask", _sdpa_masked))
    return found


def _describe_machine(device: str) -> str:
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    mode = "Triton interpreter" if ioattn.kernels.interpreted() else "Triton compiled"
    import triton

    return f"{where}; torch {torch.__version__}, triton {triton.__version__}, {mode}"


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    print(f"ioattn {ioattn.__version__} exactness check on {_describe_machine(device)}", flush=True)
    print(f"{'path':52s} {'dtype':9s} {'rel err':>9s} {'tol':>7s}  ok", flush=True)
    failures = 0
    for check in checks():
        for dtype in dtypes:
            start = time.perf_counter()
            try:
                err = check.run(device, dtype)
                ok = err < TOLERANCE[dtype]
                line = f"{err:9.2e} {TOLERANCE[dtype]:7.0e}  {'yes' if ok else 'NO'}"
            except Exception as exc:  # a failing path is reported, then the demo exits non-zero
                ok, line = False, f"error: {type(exc).__name__}: {exc}"
            failures += not ok
            took = time.perf_counter() - start
            print(f"{check.name:52s} {str(dtype)[6:]:9s} {line}  ({took:.1f}s)", flush=True)
    if failures:
        print(f"{failures} path(s) failed their tolerance", flush=True)
        return 1
    print("every path matches the float64 reference\n", flush=True)
    from ioattn.bench.prefill import main as bench_prefill

    return bench_prefill(["--quick"]) or 0


if __name__ == "__main__":
    sys.exit(main())
