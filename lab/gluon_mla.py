"""The Gluon MLA decode (TMA latent rows, a producer warp: `MLAConfig(kernel="gluon")`) beside the Triton MLA
kernel at DeepSeek-V3's decode shapes (latent 512 + RoPE 64, block 64 shuffled, bf16), each at its split
heuristic, against the copy and bf16 matmul ceilings of the same run (W2 7/7's bars: >= 85% of copy at 16 heads
where B·L >= 64k, >= 60% of matmul at 128 heads, B >= 64).

Each variant: its error against float64 on the first sequence, then µs per layer over up to 32 cache copies in one
CUDA graph (`ioattn bench decode --mla`'s timing).

    PYTHONPATH=. python3 lab/gluon_mla.py     # writes $OUT/gluon-mla.json (CUDA, sm_90)
    GLUON_MLA="n/s/r/p ..."  block_n/stages/maxnreg (0: none)/programs_per_sm of each Gluon variant
                             (a leading w: 64 heads per program on wgmma, s: the same on the seesaw
                             schedule; a trailing /ordered: the split combine in stream order, not by
                             dependent launch; /half: half the split heuristic's count; /staged: O stored
                             through the ring's stages; /smsN: the heuristic aims for one program per N SMs)
    GLUON_MLA_TRITON=0       leaves out the Triton kernel's rows
    GLUON_MLA_HEADS="16"  GLUON_MLA_SHAPES="64x1024 8x8192 ..."
"""

from __future__ import annotations

import json
import os

import torch

from ioattn.bench import harness
from ioattn.bench.mla import LATENT_DIM, ROW_DIM, SOFTMAX_SCALE, Case, _time, ioattn_runner, latent_pool
from ioattn.bench.harness import layer_count
from ioattn.ops.mla import MLAConfig, default_config
from ioattn.reference import attention_ref
from lab.fp8_tiles import run_setup

GLUON_MLA = os.environ.get("GLUON_MLA", "32/2/128/2 32/2/128/1 32/3/128/1 32/4/0/1 64/2/0/1")
HEADS = [int(h) for h in os.environ.get("GLUON_MLA_HEADS", "16").split()]
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get(
    "GLUON_MLA_SHAPES", "64x1024 128x1024 32x4096 64x4096 128x4096 8x8192 32x8192 64x8192 8x32768 32x32768 "
                        "1x65536 128x32768").split()]


def variants(heads: int) -> list:
    """(name, config, dependent_combine, half_splits) of the Triton default (unless GLUON_MLA_TRITON=0) and each
    Gluon variant of GLUON_MLA."""
    out = [("triton", default_config(heads, LATENT_DIM, torch.bfloat16, decode=True), None, False)]
    out = out if os.environ.get("GLUON_MLA_TRITON", "1") == "1" else []
    for item in GLUON_MLA.split():
        seesaw = item.startswith("s")  # 64 heads per program, the seesaw schedule
        wide = seesaw or item.startswith("w")  # 64 heads per program on wgmma, 8 warps
        fields = item.lstrip("ws").split("/")
        ordered, half, staged = ("ordered" in fields[4:], "half" in fields[4:], "staged" in fields[4:])
        sms = next((int(f[3:]) for f in fields[4:] if f.startswith("sms")), 1)
        n, s, r, p = map(int, fields[:4])
        h, w = (64, 8) if wide else (16, 4)
        name = f"gluon{'-seesaw' if seesaw else '-wgmma' if wide else ''} n{n} s{s} r{r} p{p}"
        name += (" ordered" if ordered else "") + (" half" if half else "") + (" staged" if staged else "")
        name += f" sms{sms}" if sms > 1 else ""
        out.append((name, MLAConfig(
            block_h=h, block_m=h, block_n=n, num_warps=w, num_stages=s, maxnreg=r or None, programs_per_sm=p,
            kernel="gluon", seesaw=seesaw, stage_out=staged, sms_per_program=sms), False if ordered else None, half))
    return out


def main() -> None:
    out_dir, args, result = run_setup("lab/gluon_mla.py")
    args.mla_backend, args.num_splits, args.max_kv_gib = "triton", 0, 60.0
    ceilings = harness.measure_ceilings(args.device, [torch.bfloat16])
    matmul = ceilings["matmul_tflops"]["bfloat16"]
    result["disclosure"].update(copy_tbps=ceilings["copy_tbps"], matmul_tflops=matmul)
    print(f"copy ceiling {ceilings['copy_tbps']:.3f} TB/s, bf16 matmul {matmul:.0f} TFLOP/s", flush=True)
    for heads in HEADS:
        for batch, length in SHAPES:
            case = Case("bfloat16", batch, heads, length)
            q = torch.randn(batch, heads, ROW_DIM, dtype=torch.bfloat16, device=args.device)
            latent = torch.randn(batch, length, ROW_DIM, dtype=torch.bfloat16, device=args.device)
            lens = torch.full((batch,), length, dtype=torch.int32, device=args.device)
            first = latent[:1, :, None]
            ref = attention_ref(q[:1, None], first, first[..., :LATENT_DIM], softmax_scale=SOFTMAX_SCALE)[0][0, 0]
            pool, table = latent_pool(latent, 64)
            del latent, first
            layers = layer_count(case, args)
            for name, config, dependent, half in variants(heads):
                row = {"H": heads, "B": batch, "L": length, "kernel": name}
                try:
                    forward, _, plan = ioattn_runner(q, pool, table, lens, args, layers, config, 0, dependent)
                    if half:  # half the heuristic's split count: fewer programs, more keys each
                        forward, _, plan = ioattn_runner(q, pool, table, lens, args, layers, config,
                                                         max(1, plan.num_splits // 2), dependent)
                    timed = _time(forward, ref, args, layers)
                    row.update(us=timed["ms"] * 1e3, tbps=case.bytes / (timed["ms"] * 1e-3) / 1e12,
                               error=timed["error"], splits=plan.num_splits, used=timed["how"])
                    row["copy_pct"] = 100 * row["tbps"] / ceilings["copy_tbps"]
                    flops = 2 * batch * heads * length * (ROW_DIM + LATENT_DIM)
                    row["matmul_pct"] = 100 * flops / (timed["ms"] * 1e-3) / 1e12 / matmul
                except Exception as error:  # noqa: BLE001 - a variant that fails is a result too
                    row["status"] = f"failed: {type(error).__name__}: {error}"[:300]
                result["rows"].append(row)
                print(f"H{heads:<4} B{batch:<4} L{length:<6} {name:<24} splits {row.get('splits')} "
                      f"{row.get('us', float('nan')):8.1f} us {row.get('tbps', float('nan')):5.2f} TB/s "
                      f"{row.get('copy_pct', float('nan')):5.1f}% copy {row.get('matmul_pct', float('nan')):5.1f}% "
                      f"matmul err {row.get('error', float('nan')):.2e} "
                      f"{row.get('status', '')}", flush=True)
                (out_dir / os.environ.get("GLUON_MLA_JSON", "gluon-mla.json")).write_text(json.dumps(result, indent=1) + "\n")
            del pool, q
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
