"""Does the integer fp8 -> bf16 upcast make the fp8 decode read at the fp8 byte rate? The paged decode kernel
over fp8 caches with Triton's conversion (fp8 -> f16 -> f32 -> bf16: an F2F per element, lab/aot.py --sass
--fp8 e4m3 --fp8-cast) against the integer upcast the launcher now picks for bf16 queries, beside the bf16 cache,
at rows where B·L >= 64k (32/8 heads, D 128, block 16 shuffled). Each variant: the error against float64 on the
(dequantized) cache first, then per layer over up to 32 cache copies in one CUDA graph (`ioattn.bench.decode`'s
hooks); a variant that misses the tolerance is recorded as wrong and not timed.

    PYTHONPATH=. python3 lab/fp8_upcast.py     # writes $OUT/fp8-upcast.json; on a CPU: toy shapes, no upcast
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
BY_BITS = paged.fp8_upcast_by_bits


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
            casts = (False, True) if fmt == torch.float8_e4m3fn else (True,)
            trials += [(f"{name} {'integer upcast' if bits else 'triton cast'}", bits, (k8, v8, k_scale, v_scale),
                        ref8, case.kv_bytes_at(1)) for bits in casts]
        for name, bits, (kc, vc, ks, vs), expected, kv_bytes in trials:
            paged.fp8_upcast_by_bits = BY_BITS if bits is None or bits else (lambda q: False)
            row = {"B": batch, "L": length, "heads": f"{HEADS[0]}/{HEADS[1]}", "cache": name}
            try:
                row.update(measure_trial(case, q, kc, vc, lens, ks, vs, expected, kv_bytes, args))
            finally:
                paged.fp8_upcast_by_bits = BY_BITS
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out_dir / "fp8-upcast.json").write_text(json.dumps(result, indent=1) + "\n")
        del k, v, trials
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
