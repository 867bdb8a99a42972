"""Where the FP8 forward's public call (`flash_attn_fp8_func` on e4m3 inputs with descales, as `bench prefill`'s
ioattn-fp8 times it) spends its time beside the Gluon kernel alone: V's transpose to (B, H, D, N), the checks, the
whole call (do_bench, L2 flushed), and each host part in microseconds with the GPU held busy (a part that waits for
the GPU shows the busy time). D 128, B·N 16k, 16 heads, N 4k-16k, causal and not; the default tiles and three
consumer warpgroups without the overlap, P from registers. Writes OUT.json.

    PYTHONPATH=. python3 lab/fp8_host_parts.py OUT.json   (sm_90 only)
"""
import dataclasses
import functools
import json
import sys

import torch
import triton

import ioattn
from host_parts import host_us_rounds
from ioattn.bench import harness
from ioattn.ops import fp8_attention as fa8
from ioattn.ops.gluon_forward import fp8_gluon_config, gluon_forward_fp8

C3 = {"consumers": 3, "maxnreg": 128, "consumer_regs": 160, "pingpong": False, "overlap": False,
      "fp8_p_shared": False}


def host_us(fn, calls=50):
    """Host microseconds per call, the best of a few rounds with the GPU busy (`host_parts.host_us_rounds`)."""
    return min(host_us_rounds(fn, calls=calls, rounds=3, busy_cycles=200_000_000))


def main():
    out_path = sys.argv[1]
    configs = {"default": fp8_gluon_config(128), "c3-registers": dataclasses.replace(fp8_gluon_config(128), **C3)}
    result = {"disclosure": harness.collect_disclosure("cuda", " ".join(sys.argv)), "rows": []}
    for n in (4096, 8192, 16384):
        for causal in (False, True):
            b, h, d = 16384 // n, 16, 128
            q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            (qc, qs), (kc, ks), (vc, vs) = (fa8.quantize_per_head(t) for t in (q, k, v))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            descales = dict(q_descale=qs, k_descale=ks, v_descale=vs)
            row = {"N": n, "B": b, "causal": causal, "ms": {}, "host_us": {}}
            timed = {"bf16 public": functools.partial(ioattn.flash_attn_func, q, k, v, causal=causal)}
            for name, cfg in configs.items():
                permute = not cfg.fp8_p_shared
                vt = fa8.transposed(vc, permute)
                block = max(128, -(-n // 128) * 128)
                scales = (qs[..., None].contiguous(), ks[..., None].contiguous(), vs[..., None].contiguous(), block)
                o = torch.empty(b, n, h, d, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(b, h, n, dtype=torch.float32, device="cuda")
                public = functools.partial(fa8.flash_attn_fp8_func, qc, kc, vc, causal=causal, backend="gluon",
                                           config=cfg, **descales)
                kernel = functools.partial(gluon_forward_fp8, qc, kc, vt, scales, causal=causal,
                                           softmax_scale=d ** -0.5, out=o, lse=lse, config=cfg)
                kernel()
                diff = float((o.float() - public().float()).norm() / o.float().norm())
                row.setdefault("kernel_vs_public", {})[name] = diff
                timed.update({f"{name} public": public, f"{name} kernel": kernel,
                              f"{name} transpose": functools.partial(fa8.transposed, vc, permute)})
                row["host_us"][f"{name} plan_fp8"] = host_us(functools.partial(
                    fa8.plan_fp8, qc, kc, vc, causal, backend="gluon", config=cfg, **descales))
                row["host_us"][f"{name} kernel"] = host_us(kernel)
                row["host_us"][f"{name} public"] = host_us(public)
            for name, fn in timed.items():
                row["ms"][name] = harness.time_ms(fn, "cuda").ms
            row["tflops"] = {name: flops / ms / 1e9 for name, ms in row["ms"].items() if "transpose" not in name}
            bf16 = row["tflops"]["bf16 public"]
            print(f"N {n} causal {causal}: " + "; ".join(f"{k} {v:.0f} ({v / bf16:.2f}x)" for k, v in
                                                         row["tflops"].items()), flush=True)
            print("   ms: " + "; ".join(f"{k} {v:.3f}" for k, v in row["ms"].items())
                  + " | host us: " + "; ".join(f"{k} {v:.0f}" for k, v in row["host_us"].items())
                  + f" | kernel vs public {row['kernel_vs_public']}", flush=True)
            result["rows"].append(row)
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
