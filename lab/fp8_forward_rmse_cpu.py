"""How much error does the FP8 forward add, and how much does incoherent processing (the signed Hadamard rotation
of Q and K) take away? Q, K, V standard normal, D 128, with outliers of two kinds: FlashAttention-3's test inputs
(0.1% of all entries scaled by 10-100x, at random places) and outlier channels as LLM activations have them (2 of
the 128 channels of Q and K scaled by 20 at every position); and none. Against float64 attention on the original
inputs: RMSE (FA3's figure), the relative Frobenius error, and the part the kernel adds (against float64 on the
dequantized inputs), for three scalings: one scale per (sequence, KV head) (e4m3 inputs with descales, the nearest
to FA3's per-tensor baseline), one per 128 positions (block scales), block scales after the Hadamard rotation.
Runs the Triton FP8 kernel under the interpreter (exact fp8 products, round-to-nearest probabilities): no GPU.

    PYTHONPATH=. TRITON_INTERPRET=1 python3 lab/fp8_forward_rmse_cpu.py OUT.json
"""
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from ioattn.ops import fp8_attention as fa8  # noqa: E402

SHAPE = (1, 512, 4, 128)  # B, N, H (= Hkv), D
SEEDS = (0, 1, 2)


OUTLIERS = ("entries (FA3)", "channels", "none")


def inputs(seed: int, outliers: str):
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(SHAPE, generator=generator) for _ in range(3)]
    if outliers == "entries (FA3)":
        for t in tensors:
            hit = torch.rand(SHAPE, generator=generator) < 1e-3
            t[hit] *= torch.empty(int(hit.sum())).uniform_(10, 100, generator=generator)
    elif outliers == "channels":
        channels = torch.randperm(SHAPE[3], generator=generator)[:2]
        for t in tensors[:2]:
            t[..., channels] *= 20
    return [t.to(torch.bfloat16) for t in tensors]


def per_sequence(q, k, v):
    """e4m3 codes with one descale per (sequence, head), through flash_attn_fp8_func's descale path."""
    codes, scales = zip(*(fa8.quantize_per_head(t) for t in (q, k, v)))
    return fa8.flash_attn_fp8_func(*codes, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])


def main(path: str) -> None:
    rows = []
    for outliers in OUTLIERS:
        for name in ("per (sequence, head)", "per 128 positions", "per 128 positions + Hadamard"):
            rmse, rel, kernel = [], [], []
            for seed in SEEDS:
                q, k, v = inputs(seed, outliers)
                exact = fa8._reference(q.double(), k.double(), v.double(), False)
                if name.startswith("per (sequence"):
                    out = per_sequence(q, k, v)
                else:
                    hadamard = name.endswith("Hadamard")
                    out = fa8.flash_attn_fp8_func(q, k, v, hadamard=hadamard)
                    errors = fa8.quantization_error(q, k, v, hadamard=hadamard)
                    kernel.append(errors["kernel"])
                err = out.double() - exact
                rmse.append(float(err.pow(2).mean().sqrt()))
                rel.append(float(err.norm() / exact.norm()))
            rows.append({"outliers": outliers, "scaling": name, "rmse": sum(rmse) / len(rmse),
                         "relative_error": sum(rel) / len(rel),
                         "kernel_relative_error": sum(kernel) / len(kernel) if kernel else None, "seeds": len(SEEDS)})
            kernel_part = f"  kernel {rows[-1]['kernel_relative_error']:.2e}" if kernel else ""
            print(f"outliers {outliers:14} {name:30} RMSE {rows[-1]['rmse']:.2e}  relative "
                  f"{rows[-1]['relative_error']:.2e}{kernel_part}")
    with open(path, "w") as f:
        json.dump({"shape_bnhd": SHAPE, "rows": rows, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
