"""Does the Gluon FP8 forward at D 128 (three consumer warpgroups without the intra-warpgroup overlap, P from
registers: `fp8_gluon_config(128)`) gain from the snake order of work tiles under a causal mask, O rescaled only
when a row's max grows by more than 2 bits, or a fourth K/V stage; and how far are two ping-pong warpgroups with
the overlap (the tiles before 2026-12-07) behind? Other variants with --variant. W2 5/7's bar: FP8 >= 1.6x our
bf16 forward at D 128, N >= 4k.

Each variant first runs against float64 attention on its dequantized inputs (fresh random inputs, B 1, N 1000 x
1300, 8/2 heads, causal and not; poisoned outputs), then is timed on e4m3 inputs with per-(sequence, KV head)
descales (the public call: V's transpose and the checks included) at D 128 (--head-dim: 64, 256 with VARIANTS_64,
VARIANTS_256), B·N 16k, H·D 2048, N 4k/8k/16k, causal and not, beside our bf16 forward, the Triton fp8 kernel and
cuDNN (bf16); every timed variant is compared with the first one's output on the same row.

    PYTHONPATH=. python3 lab/fp8_gluon_variants.py OUT.json [--variant NAME:field=value,...] ...   (sm_90 only)
"""
import argparse
import dataclasses
import functools
import json

import torch
import triton

import ioattn
from ioattn.ops import fp8_attention as fa8
from ioattn.ops.gluon_forward import fp8_gluon_config

PINGPONG = {"consumers": 2, "maxnreg": 168, "consumer_regs": 240, "pingpong": True, "overlap": True}
VARIANTS = {"snake": {"snake": True, "dynamic": False}, "t2": {"rescale_threshold": 2.0}, "s4": {"stages": 4},
            "snake-t2": {"snake": True, "rescale_threshold": 2.0, "dynamic": False},
            "pingpong-shared": {**PINGPONG, "fp8_p_shared": True},
            # two serial warpgroups on 256-key tiles (FA3's fp8 D 128 takes 224): the per-tile work (row max and sum
            # reductions, barriers) once per 256 keys; 779 instructions per tile in the sm_90 build (the default 473)
            "c2n256": {"consumers": 2, "block_n": 256, "stages": 2, "maxnreg": 168, "consumer_regs": 240},
            # the static schedule (each program every num_programs-th work tile) the dynamic default replaced
            "static": {"dynamic": False}}
# D 256 (--head-dim 256): its default is two serial warpgroups adding each tile's P·V to O a quarter of its columns at
# a time (452-466 instructions a 64-key tile, 3-7 spills in the sm_90 build; the overlapped ping-pong loop spilled
# 144), P through shared memory; beside it P from registers, 128-key tiles and the dynamic schedule
VARIANTS_256 = {"q64reg": {"fp8_p_shared": False}, "q128reg": {"fp8_p_shared": False, "block_n": 128, "stages": 2},
                "q128shared": {"block_n": 128, "stages": 2}, "q64-dyn": {"dynamic": True}}
# D 64 (--head-dim 64): its default is two overlapped ping-pong warpgroups (an H100 ran it at 0.78x our bf16
# forward at N 8k); three serial warpgroups as at D 128 (128 registers, no spills in the sm_90 builds)
SERIAL_C3 = {"consumers": 3, "maxnreg": 128, "consumer_regs": 160, "pingpong": False, "overlap": False}
VARIANTS_64 = {"c3reg": {**SERIAL_C3, "fp8_p_shared": False, "dynamic": True},
               "c3shared": {**SERIAL_C3, "fp8_p_shared": True, "dynamic": True},
               "c3reg-static": {**SERIAL_C3, "fp8_p_shared": False}}


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, fields = text.partition(":")
    values = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        values[key] = {"true": True, "false": False}.get(value) if value in ("true", "false") else (
            float(value) if "." in value else int(value))
    return name, values


def dequantized_reference(codes, scales, causal):
    deq = [c.double() * s.double().repeat_interleave(c.shape[2] // s.shape[1], 1)[:, None, :, None]
           for c, s in zip(codes, scales)]
    return fa8._reference(*deq, causal)


def e4m3_inputs(b, n_q, n_k, hq, hkv, d):
    q = torch.randn(b, n_q, hq, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(b, n_k, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    codes, scales = zip(fa8.quantize_per_head(q, hq // hkv), fa8.quantize_per_head(k), fa8.quantize_per_head(v))
    return (q, k, v), codes, scales


def cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2), is_causal=causal)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--variant", action="append", default=[], help="NAME:field=value,... over fp8_gluon_config")
    parser.add_argument("--seqlens", default="4096,8192,16384")
    parser.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256])
    parser.add_argument("--only", help="which of VARIANTS (D 64 / 256: VARIANTS_64 / 256) to run (comma-separated)")
    args = parser.parse_args()
    known = {64: VARIANTS_64, 128: VARIANTS, 256: VARIANTS_256}[args.head_dim]
    variants = {name: known[name] for name in filter(None, (args.only or ",".join(known)).split(","))}
    variants.update(parse_variant(v) for v in args.variant)
    default = fp8_gluon_config(args.head_dim)
    configs = {name: dataclasses.replace(default, **fields) for name, fields in variants.items()}
    configs = {"default": None, **configs}  # fp8_gluon_config's own
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "variants": {name: str(cfg) for name, cfg in configs.items()}, "exactness": [], "rows": []}

    for causal in (False, True):
        _, codes, scales = e4m3_inputs(1, 1000, 1300, 8, 2, args.head_dim)
        expected = dequantized_reference(codes, scales, causal)
        for name, cfg in configs.items():
            poison = torch.full((64 << 20,), float("nan"), device="cuda")
            del poison
            out = fa8.flash_attn_fp8_func(*codes, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                          v_descale=scales[2], backend="gluon", config=cfg).double()
            error = float((out - expected).norm() / expected.norm()) if not out.isnan().any() else float("nan")
            result["exactness"].append({"variant": name, "causal": causal, "rel_error": error})
            print(f"exactness {name} causal {causal}: rel error {error:.4f} (tolerance 3.5e-2)")

    for n in map(int, args.seqlens.split(",")):
        for causal in (False, True):
            b, h, d = 16384 // n, 2048 // args.head_dim, args.head_dim
            (q, k, v), codes, scales = e4m3_inputs(b, n, n, h, h, d)
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            descales = dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
            timed = {"bf16": functools.partial(ioattn.flash_attn_func, q, k, v, causal=causal),
                     "cudnn": functools.partial(cudnn, q, k, v, causal),
                     "fp8-triton": functools.partial(fa8.flash_attn_fp8_func, *codes, causal=causal,
                                                     backend="triton", **descales)}
            timed.update({f"fp8-{name}": functools.partial(fa8.flash_attn_fp8_func, *codes, causal=causal,
                                                           backend="gluon", config=cfg, **descales)
                          for name, cfg in configs.items()})
            row = {"N": n, "B": b, "causal": causal, "tflops": {}, "diff_vs_first": {}}
            first = None
            for name, run in timed.items():
                try:
                    out = run().float()
                    if name[4:] in configs:  # the Gluon fp8 variants
                        first = out if first is None else first
                        row["diff_vs_first"][name] = float((out - first).norm() / first.norm())
                    row["tflops"][name] = flops / triton.testing.do_bench(run) / 1e9
                except Exception as error:  # noqa: BLE001 (one variant failing is reported, the rest run)
                    row["tflops"][name] = f"{type(error).__name__}: {str(error)[:200]}"
            bf16 = row["tflops"]["bf16"]
            print(f"N {n} causal {causal}: " + "; ".join(
                f"{k}: {v:.0f}" + (f" ({v / bf16:.2f}x bf16)" if k.startswith("fp8") else "")
                if isinstance(v, float) else f"{k}: {v}" for k, v in row["tflops"].items())
                  + f"; diffs {', '.join(f'{k} {v:.1e}' for k, v in row['diff_vs_first'].items())}")
            result["rows"].append(row)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
