"""Which decode tile suits an fp8 cache? A few configurations of the paged decode kernel over fp8 caches against
the default (the bf16 tuning), and the bf16 default beside them, at three shapes where B·L >= 64k.

An fp8 tile of 64 keys reads half the bytes of a bf16 one, so fewer bytes are in flight per resident program;
paired whole tiles (two loaded per step), tiles of 128 keys (the bf16 tile's bytes) or more programs per SM may
win back what a 64-key tile leaves idle (lab/aot.py --fp8 [--paired] [--maxnreg N] [--block-n N]).
Each variant: per layer over up to 32 cache copies in one CUDA graph (`ioattn.bench.decode`'s hooks), the error
against float64 on the dequantized cache first (a variant that misses is recorded as wrong and not timed).

    PYTHONPATH=. python3 lab/fp8_tiles.py     # writes $OUT/fp8-tiles.json; on a CPU: toy shapes
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ioattn.bench import harness
from ioattn.bench.decode import Case, _measure, fp8_inputs, layer_count, paged_decode_runner
from ioattn.ops.fp8 import dequantize
from ioattn.ops.paged import PagedConfig
from ioattn.reference import TOLERANCE, attention_ref, rel_error

CUDA = torch.cuda.is_available()
SHAPES = [(64, 4096), (8, 32768), (256, 4096), (1, 131072)] if CUDA else [(2, 64)]
HEADS = (32, 8) if CUDA else (4, 2)
HEAD_DIM = 128 if CUDA else 32
CONFIGS = [None] + [  # the default (64 keys, 4 warps, 2 stages, 128 registers), then variants
    PagedConfig(block_m=16, block_n=n, num_warps=w, num_stages=2, maxnreg=r, paired_tiles=paired)
    for n, w, r, paired in ((64, 4, 128, True), (64, 4, None, True), (64, 4, 96, True), (32, 4, 128, True),
                            (32, 4, 96, True), (64, 4, None, False), (64, 4, 96, False), (32, 4, 96, False),
                            (128, 8, 128, False), (128, 4, None, False))]


def measure_trial(case, q, k, v, lens, k_scale, v_scale, expected, kv_bytes, args, config=None) -> dict:
    """One variant of the paged decode over these caches (block 16, shuffled): its error against `expected` and,
    within the tolerance, its time per layer over up to 32 cache copies in one CUDA graph; a variant that misses
    is recorded as wrong and not timed, one that fails to build or run with its error."""
    layers = layer_count(case, args, kv_bytes)
    row = {"layers": layers}
    started = time.monotonic()
    try:
        forward, out, plan, restore = paged_decode_runner(case, q, k, v, lens, block=16, shuffled=True, config=config,
                                                          layers=layers, k_scale=k_scale, v_scale=v_scale)
        forward()
        row.update(config=dataclasses.asdict(plan.config), splits=plan.num_splits,
                   error=rel_error(out[0], expected[0, 0]))
        if row["error"] < TOLERANCE[q.dtype]:
            ms, how = _measure(forward, args.device, args, layers)
            row.update(us=ms * 1e3, tbps=kv_bytes / (ms * 1e-3) / 1e12,
                       tokens_per_s=case.batch * case.seqlen / (ms * 1e-3), used=how)
        else:
            row["status"] = "wrong"
        del forward
        restore()
    except Exception as error:  # noqa: BLE001 - a variant that does not build or run is a result too
        row["status"] = f"failed: {type(error).__name__}: {error}"[:300]
    row["seconds"] = time.monotonic() - started
    return row


def run_setup(script: str):
    """(the output folder $OUT, the timing settings, the result dict with its disclosure) of a lab decode run."""
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if CUDA else "cpu"
    args = SimpleNamespace(layers=32 if CUDA else 1, layers_gib=8.0, warmup_ms=25.0 if CUDA else 1.0,
                           rep_ms=100.0 if CUDA else 1.0, device=device)
    return out_dir, args, {"disclosure": harness.collect_disclosure(device, f"PYTHONPATH=. python3 {script}"),
                           "rows": []}


def decode_inputs(batch: int, length: int, device: str):
    """(case, q, k, v, lens): random bf16 (CPU: float32) decode inputs of one shape, every sequence `length` long."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    case = Case(harness.dtype_name(dtype), batch, *HEADS, length, HEAD_DIM)
    k = torch.randn(batch, length, HEADS[1], HEAD_DIM, dtype=dtype, device=device)
    q = torch.randn(batch, HEADS[0], HEAD_DIM, dtype=dtype, device=device)
    return case, q, k, torch.randn_like(k), torch.full((batch,), length, dtype=torch.int32, device=device)


def with_fp8(q, k, v):
    """(k8, v8, k_scale, v_scale, ref8, ref): the e4m3 cache of k, v and the float64 references of the first
    sequence's decode over the dequantized fp8 cache and over the 16-bit one."""
    k8, v8, k_scale, v_scale = fp8_inputs(k, v, torch.float8_e4m3fn)
    ref8, _ = attention_ref(q[:1, None], dequantize(k8[:1], k_scale, torch.float64),
                            dequantize(v8[:1], v_scale, torch.float64))
    ref, _ = attention_ref(q[:1, None], k[:1], v[:1])
    return k8, v8, k_scale, v_scale, ref8, ref


def main() -> None:
    out_dir, args, result = run_setup("lab/fp8_tiles.py")
    for batch, length in SHAPES:
        case, q, k, v, lens = decode_inputs(batch, length, args.device)
        k8, v8, k_scale, v_scale, ref8, ref = with_fp8(q, k, v)
        trials = [("bf16", None, k, v, None, None, ref, case.kv_bytes)]
        trials += [("fp8_e4m3", c, k8, v8, k_scale, v_scale, ref8, case.kv_bytes_at(1)) for c in CONFIGS]
        for name, config, kc, vc, ks, vs, expected, kv_bytes in trials:
            row = {"B": batch, "L": length, "heads": f"{HEADS[0]}/{HEADS[1]}", "cache": name}
            row.update(measure_trial(case, q, kc, vc, lens, ks, vs, expected, kv_bytes, args, config))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out_dir / "fp8-tiles.json").write_text(json.dumps(result, indent=1) + "\n")
        del k, v, k8, v8
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
