"""How should the fp8 decode meet bf16 queries? The paged decode kernel over fp8 caches with Triton's conversion to
bf16 (fp8 -> f16 -> f32 -> bf16: an F2F per element) against float16 dots (FP16_DOTS, the launcher's choice for
bf16 queries on CUDA: queries scaled per row into float16, tiles converted two codes per instruction; 415 SASS
instructions per thread per 64-key tile against 741 for the integer fp8 -> bf16 upcast this replaced, lab/aot.py
--sass --fp8 e4m3 [--fp8-cast]), beside the bf16 cache, at rows where B·L >= 64k (32/8 heads, D 128, block 16
shuffled). Each variant: the error against float64 on the (dequantized) cache first, then per layer over up to 32
cache copies in one CUDA graph (`ioattn.bench.decode`'s hooks); a variant that misses the tolerance is recorded
as wrong and not timed.

    PYTHONPATH=. python3 lab/fp8_upcast.py     # writes $OUT/fp8-upcast.json; on a CPU: toy shapes, Triton's cast
"""

from __future__ import annotations

import json
import os
import sys

import torch

from ioattn.bench.decode import fp8_inputs
from ioattn.ops import paged
from ioattn.ops.fp8 import dequantize
from ioattn.reference import attention_ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_tiles import HEADS, decode_inputs, measure_trial, run_setup  # noqa: E402

CUDA = torch.cuda.is_available()
SHAPES = [(1, 32768), (8, 32768), (64, 4096), (256, 4096), (64, 16384), (1, 131072)] if CUDA else [(2, 64)]
LAUNCHERS_CHOICE = paged.fp16_dots


def main() -> None:
    out_dir, args, result = run_setup("lab/fp8_upcast.py")
    for batch, length in SHAPES:
        case, q, k, v, lens = decode_inputs(batch, length, args.device)
        ref, _ = attention_ref(q[:1, None], k[:1], v[:1])
        trials = [("bf16", None, (k, v, None, None), ref, case.kv_bytes)]
        for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
            k8, v8, k_scale, v_scale = fp8_inputs(k, v, fmt)
            ref8, _ = attention_ref(q[:1, None], dequantize(k8[:1], k_scale, torch.float64),
                                    dequantize(v8[:1], v_scale, torch.float64))
            name = "e4m3" if fmt == torch.float8_e4m3fn else "e5m2"
            dots = (False, True) if fmt == torch.float8_e4m3fn else (True,)
            trials += [(f"{name} {'fp16 dots' if fp16 else 'triton cast'}", fp16, (k8, v8, k_scale, v_scale), ref8,
                        case.kv_bytes_at(1)) for fp16 in dots]
        for name, fp16, (kc, vc, ks, vs), expected, kv_bytes in trials:
            paged.fp16_dots = LAUNCHERS_CHOICE if fp16 is None or not CUDA else (lambda q, fp16=fp16: fp16)
            row = {"B": batch, "L": length, "heads": f"{HEADS[0]}/{HEADS[1]}", "cache": name}
            try:
                row.update(measure_trial(case, q, kc, vc, lens, ks, vs, expected, kv_bytes, args))
            finally:
                paged.fp16_dots = LAUNCHERS_CHOICE
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out_dir / "fp8-upcast.json").write_text(json.dumps(result, indent=1) + "\n")
        del k, v, trials
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
