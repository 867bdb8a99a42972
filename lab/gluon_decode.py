"""The Gluon paged decode (TMA pages, a producer warp: `PagedConfig(kernel="gluon")`) beside the Triton kernel,
fp8 and bf16 caches, at the W2 4/7 bar's shapes (B·L >= 64k, 32/8 heads, D 128, block 16 shuffled through the
pool).

Each variant: its error against float64 on its own (dequantized) cache first, then per layer over up to 32 cache
copies in one CUDA graph (lab/fp8_tiles.py's `measure_trial`).

    PYTHONPATH=. python3 lab/gluon_decode.py     # writes $OUT/gluon-decode.json (CUDA, sm_90)
"""

from __future__ import annotations

import json
import os

import torch

from ioattn.ops.paged import PagedConfig
from lab.fp8_tiles import SHAPES, decode_inputs, measure_trial, run_setup, with_fp8

# block_n/stages/maxnreg/warps
# block_n/stages/maxnreg/warps[/rescale_threshold]: each a Gluon configuration timed beside the Triton kernel
GLUON_FP8 = os.environ.get("GLUON_FP8", "64/2/96/4 64/2/96/4/8")
GLUON_BF16 = os.environ.get("GLUON_BF16", "64/2/96/4 64/2/96/4/8")


def gluon_trials(cache: str, spec: str) -> list:
    """(cache, name, config) of each Gluon configuration in `spec` (see GLUON_FP8)."""
    trials = []
    for item in spec.split():
        n, s, r, w, *t = map(int, item.split("/"))
        threshold = t[0] if t else 0
        trials.append((cache, f"gluon n{n} s{s} r{r} w{w} t{threshold}", PagedConfig(
            block_m=16, block_n=n, num_stages=s, maxnreg=r, num_warps=w, kernel="gluon",
            rescale_threshold=threshold)))
    return trials


def l2_trial(case, q, k, v, lens, k_scale, v_scale, kv_bytes, args, config) -> dict:
    """The same call with every sequence reading one sequence's blocks (a pool of L / 16 blocks, 4-8 MB per
    cache here, which stays in L2): the kernel's own rate when HBM is not what limits it. kv_bytes: the logical
    bytes read (every sequence's K and V)."""
    from ioattn.bench.decode import _measure
    from ioattn.ops.paged import paged_attention, plan_paged_attention, paged_workspace

    blocks = case.seqlen // 16
    k_pool = k[:1].reshape(blocks, 16, case.heads_kv, case.head_dim)
    v_pool = v[:1].reshape(blocks, 16, case.heads_kv, case.head_dim)
    table = torch.stack([torch.randperm(blocks, device=q.device) for _ in range(case.batch)]).to(torch.int32)
    plan = plan_paged_attention(q, k_pool, table, decode=True, max_seqlen_q=1, config=config)
    workspace = paged_workspace(case.batch, case.heads_q, case.head_dim, max_splits=plan.num_splits, device=q.device)
    out = torch.empty_like(q)

    def forward():
        for _ in range(8):
            paged_attention(q, k_pool, v_pool, table, lens, out=out, workspace=workspace, num_splits=plan.num_splits,
                            config=plan.config, k_scale=k_scale, v_scale=v_scale)
        return out

    row = {"mode": "l2"}
    try:
        ms, how = _measure(forward, args.device, args, 8)
        row.update(us=ms * 1e3, tbps=kv_bytes / (ms * 1e-3) / 1e12, used=how, splits=plan.num_splits)
    except Exception as error:  # noqa: BLE001 - a variant that does not build or run is a result too
        row["status"] = f"failed: {type(error).__name__}: {error}"[:300]
    return row


def main() -> None:
    out_dir, args, result = run_setup("lab/gluon_decode.py")
    only = os.environ.get("GLUON_ONLY")  # e.g. "fp8": skip the bf16 rows
    for batch, length in SHAPES:
        case, q, k, v, lens = decode_inputs(batch, length, args.device)
        k8, v8, k_scale, v_scale, ref8, ref = with_fp8(q, k, v)
        trials = []
        if only != "fp8":
            trials += [("bf16", "triton", None)] + gluon_trials("bf16", GLUON_BF16)
        trials += [("fp8_e4m3", "triton", None)] + gluon_trials("fp8_e4m3", GLUON_FP8)
        for cache, name, config in trials:
            fp8 = cache != "bf16"
            row = {"B": batch, "L": length, "cache": cache, "kernel": name}
            kc, vc, ks, vs = (k8, v8, k_scale, v_scale) if fp8 else (k, v, None, None)
            kv_bytes = case.kv_bytes_at(1) if fp8 else case.kv_bytes
            if os.environ.get("GLUON_L2"):
                row.update(l2_trial(case, q, kc, vc, lens, ks, vs, kv_bytes, args, config))
            else:
                row.update(measure_trial(case, q, kc, vc, lens, ks, vs, ref8 if fp8 else ref, kv_bytes, args,
                                         config))
            result["rows"].append(row)
            print(f"B{batch:<4} L{length:<7} {cache:<9} {name:<14} splits {row.get('splits')} "
                  f"{row.get('us', float('nan')):9.1f} us {row.get('tbps', float('nan')):5.2f} TB/s "
                  f"err {row.get('error', float('nan')):.2e} {row.get('status', '')}", flush=True)
            name = "gluon-decode-l2.json" if os.environ.get("GLUON_L2") else "gluon-decode.json"
            (out_dir / name).write_text(json.dumps(result, indent=1) + "\n")
        del k, v, k8, v8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
