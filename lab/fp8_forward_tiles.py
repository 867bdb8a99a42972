"""Which launch tile suits the FP8 forward (`ioattn.ops.fp8_attention`) on sm_90, and how does the warp-specialized
(Gluon) kernel compare? Times `flash_attn_fp8_func` on
e4m3 inputs (per-(sequence, KV head) descales, the kernel alone) at D 128, B·N 16k, 16 heads, N 4k/8k/16k, causal
and not, for each candidate tile, with the bf16 forward beside it; checks each against the default tile's output.

    PYTHONPATH=. python3 lab/fp8_forward_tiles.py OUT.json   (CUDA only)
"""
import functools
import json
import sys

import torch
import triton

import ioattn
from ioattn.ops.forward import FwdConfig
from ioattn.ops.fp8_attention import flash_attn_fp8_func, quantize_per_head

# The first is the default (`fp8_config`); the rest were faster or close in the first sweeps.
TILES = [FwdConfig(64, 128, 4, 2), FwdConfig(64, 128, 4, 3), FwdConfig(64, 64, 4, 2), FwdConfig(64, 128, 8, 2),
         FwdConfig(128, 128, 8, 3), FwdConfig(128, 128, 8, 2)]


def main(path: str) -> None:
    rows = []
    for n in (4096, 8192, 16384):
        for causal in (False, True):
            b, h, d = 16384 // n, 16, 128
            q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            codes, scales = zip(*(quantize_per_head(t) for t in (q, k, v)))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            bf16_ms = triton.testing.do_bench(lambda: ioattn.flash_attn_func(q, k, v, causal=causal))
            base = flash_attn_fp8_func(*codes, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                       v_descale=scales[2], config=TILES[0], backend="triton").float()
            row = {"N": n, "causal": causal, "bf16_tflops": flops / bf16_ms / 1e9, "tiles": {}}
            for tile in (*TILES, "gluon"):
                options = {"backend": "gluon"} if tile == "gluon" else {"config": tile, "backend": "triton"}
                run = functools.partial(flash_attn_fp8_func, *codes, causal=causal, q_descale=scales[0],
                                        k_descale=scales[1], v_descale=scales[2], **options)
                try:
                    diff = float((run().float() - base).norm() / base.norm())
                    ms = triton.testing.do_bench(run)
                    row["tiles"][str(tile)] = {"tflops": flops / ms / 1e9, "diff_vs_default": diff}
                except Exception as error:  # noqa: BLE001 (a tile that does not build is reported, the rest run)
                    row["tiles"][str(tile)] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            rows.append(row)
            timed = [t for t in row["tiles"].items() if "tflops" in t[1]]
            best = max(timed, key=lambda t: t[1]["tflops"], default=None)
            print(f"N {n} causal {causal}: bf16 {row['bf16_tflops']:.0f} TFLOP/s; "
                  + "; ".join(f"{name}: {r.get('tflops', 0):.0f}" for name, r in row["tiles"].items())
                  + (f"; best / bf16 {best[1]['tflops'] / row['bf16_tflops']:.2f}" if best else ""))
            with open(path, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
