"""Would rotating K (and V) by a Hadamard matrix before the e4m3 rounding cut the fp8 cache's cost on smollm2?

The rounding error of one score is sum_i q_i k_i e_i with e_i the relative rounding error of k_i (about the same
size for every element of a float format, whatever the scale). Where q and k put their weight on the same few
channels (RoPE's slow pairs, outlier channels) that sum is dominated by those channels; an orthogonal rotation R
leaves q.k unchanged ((qR).(kR) = q.k) and spreads every vector over all channels, so the products spread too
(QuaRot's and SpinQuant's argument for low-bit K; FA3's incoherent processing for FP8). A cache would store
round(K R) and the kernels take q R; for V, round(V R) and the output times R^T.

Variants, each on the seeds' first 8192 tokens in one dense pass (no cache), scales by the engine's rule (a
power-of-two scale per (layer, KV head) from the calibration passages' amax, headroom 4), computed on the rotated
values where the values are rotated:

    PYTHONPATH=. python3 lab/fp8_rotation_cpu.py [--tokens 8192] [--out bench/results/<date>-fp8-rotation-smollm2-cpu]

writes OUT.json and OUT.md. ~10 minutes on two cores.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_k_shift_cpu import SEEDS, dense_perplexity, run_variants  # noqa: E402


def hadamard(n: int, signs=None):
    """The orthonormal n x n Sylvester Hadamard matrix (n a power of two), its rows times random ±1 if given."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = h / math.sqrt(n)
    return h if signs is None else signs[:, None] * h


def main() -> None:
    import torch

    from ioattn.bench.harness import collect_disclosure, markdown_table
    from ioattn.engine.kv_scales import HEADROOM, calibration_tokens
    from ioattn.models.llama import DenseCausalAttention
    from ioattn.models.loader import load_model
    from ioattn.ops.fp8 import fp8_max, scale_for_amax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=f"bench/results/{time.strftime('%Y-%m-%d')}-fp8-rotation-smollm2-cpu")
    args = parser.parse_args()
    fp8 = torch.float8_e4m3fn
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    config = loaded.config
    ids = loaded.tokenizer.encode("\n\n".join(Path(p).read_text() for p in SEEDS))[: args.tokens]
    sequences, what = calibration_tokens(loaded, loaded.max_model_len)
    dim = config.head_dim
    generator = torch.Generator().manual_seed(0)
    rotations = {"Hadamard": hadamard(dim),
                 "random-sign Hadamard": hadamard(dim, torch.randint(0, 2, (dim,), generator=generator) * 2.0 - 1)}

    def calibration_kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's post-RoPE K and V over the calibration passages, (tokens, kv_heads, head_dim)."""
        keys, values = [[] for _ in range(config.num_layers)], [[] for _ in range(config.num_layers)]
        dense = DenseCausalAttention.build([len(s) for s in sequences], config, "cpu", backend="torch")

        class Record:
            def attend(self, q, k, v, layer):
                keys[layer].append(k.clone())
                values[layer].append(v.clone())
                return dense.attend(q, k, v, layer)

        flat = torch.tensor([t for s in sequences for t in s])
        with torch.inference_mode():
            loaded.model(flat, torch.cat([torch.arange(len(s)) for s in sequences]), Record())
        return [torch.cat(k) for k in keys], [torch.cat(v) for v in values]

    def round_trip(x, scale):
        limit = fp8_max(fp8)
        return (x / scale).clamp(-limit, limit).to(fp8).to(x.dtype) * scale

    def per_head_scale(x):
        return scale_for_amax(x.abs().amax(dim=(0, 2)), fp8, HEADROOM)[:, None]

    cal_k, cal_v = calibration_kv()
    scales = {name: ([per_head_scale(k @ r) for k in cal_k], [per_head_scale(v @ r) for v in cal_v])
              for name, r in (("none", torch.eye(dim)), *rotations.items())}

    def rounded(x, layer, name, which):
        """x through e4m3 in the frame of rotation `name` (scales from the same frame), back in the model's."""
        r = torch.eye(dim) if name == "none" else rotations[name]
        return round_trip(x @ r, scales[name][which][layer]) @ r.T

    def perplexity(transform) -> float:
        return dense_perplexity(loaded, ids, transform)

    variants = {"none (float32 K and V)": lambda k, v, layer: (k, v)}
    for name in ("none", *rotations):
        frame = "not rotated (the engine's rule)" if name == "none" else f"{name}-rotated"
        variants[f"K {frame}"] = lambda k, v, layer, n=name: (rounded(k, layer, n, 0), v)
        variants[f"K and V {frame}"] = lambda k, v, layer, n=name: (rounded(k, layer, n, 0), rounded(v, layer, n, 1))
    result = {"disclosure": collect_disclosure("cpu", "PYTHONPATH=. python3 lab/fp8_rotation_cpu.py "
                                               f"--tokens {args.tokens} --out {args.out}"),
              "settings": {"model": "smollm2 (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized), float32",
                           "text": f"seeds, first {len(ids)} tokens, one dense pass", "calibration": what,
                           "torch_threads": torch.get_num_threads(), "head_dim": dim}, "runs": {}}
    rows = run_variants(variants, perplexity, result, args.out, "none (float32 K and V)")
    Path(args.out + ".md").write_text(
        "# FP8 (e4m3) K and V on smollm2 (CPU): rounded in a Hadamard-rotated frame against the engine's rule\n\n"
        f"- command: `{result['disclosure']['command']}`; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
        f"- {result['settings']['model']}; {result['settings']['text']}; rounded through e4m3 and back\n"
        f"- calibration: {what}; scales per (layer, KV head), headroom {HEADROOM}, from the frame they round in\n\n"
        + markdown_table(["rounded", "perplexity", "Δ vs float32"], rows) + "\n")


if __name__ == "__main__":
    main()
