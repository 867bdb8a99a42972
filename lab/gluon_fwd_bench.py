"""Is the Gluon warp-specialized forward (ioattn.ops.gluon_forward) exact on the H200, and how fast is it against
ioattn's Triton forward (`ioattn.flash_attn_func`) and torch SDPA's cuDNN backend, in one run?

    PYTHONPATH=. python3 lab/gluon_fwd_bench.py [--variants] [--budget-s 85]     # writes $OUT/gluon_fwd.json

bf16, B·N = 16k tokens, H·D = 2048 (D 64, 128 and 256; N 2k, 4k, 8k, 16k; causal and not), plus GQA 16/4 at D=128:
N=8k causal (MEASURING.md's row), 8k and 2k unmasked. Each backend runs first on NaN-poisoned (gluon) or fresh
outputs and is compared with the float64 reference on batch 0, query head 0 (all rows): a wrong one is recorded
and not timed. Timing: `ioattn.bench.harness.time_ms` (do_bench, median, L2 flushed). TFLOP/s with FlashAttention's
count 4·B·H·Nq·Nk·D, halved for causal. `gluon-per-tile` is one program per work tile instead of the persistent
grid, `-band1` the work tiles' order before bands of 16 query blocks per head (every head's first block first).
`--variants` adds the kernel without ping-pong and with a conditional rescale (threshold 8), `--configs` other
(block_n, stages) per head dim. The JSON is rewritten after every row; the run stops between rows past the budget.
Without an sm_90 GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback

import torch

from ioattn.bench import harness

OUT = os.environ.get("OUT", "/tmp/out")
SHAPES = [(d, n, causal, 2048 // d, 2048 // d) for d in (128, 64, 256) for n in (16384, 8192, 4096, 2048)
          for causal in (False, True)] + [(128, n, causal, 16, 4)
                                          for n, causal in ((8192, True), (8192, False), (2048, False))]
# --configs: other tile shapes per head dim (block_n, ring stages), each timed as its own backend
CONFIG_VARIANTS = {64: [(64, 4), (256, 2)], 128: [(64, 4), (64, 3)], 256: [(32, 4), (32, 3)]}
TOKENS = 16384


def _backends(variants: bool, configs: bool, bands: list[int], named: list[str]) -> dict:
    import ioattn
    from ioattn.ops.gluon_forward import gluon_config, gluon_forward

    def gluon(head_dims=None, **override):
        def run(q, k, v, causal, out):
            if head_dims is not None and q.shape[-1] not in head_dims:
                raise ValueError(f"variant for D in {head_dims} only")
            config = dataclasses.replace(gluon_config(q.shape[-1], causal), **override) if override else None
            return gluon_forward(q, k, v, causal=causal, out=out, config=config)[0]
        return run

    def ioattn_fwd(q, k, v, causal, out):
        return ioattn.flash_attn_func(q, k, v, causal=causal, backend="triton")

    def cudnn(q, k, v, causal, out):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                 enable_gqa=k.shape[2] != q.shape[2])
        return o.transpose(1, 2)

    # gluon-per-tile: the same kernel on one program per work tile, the grid before the persistent one; -band1: the
    # work tiles' order before bands of 16 query blocks per (batch, head) (GluonConfig.band)
    backends = {"gluon": gluon(), "gluon-per-tile": gluon(persistent=False), "gluon-band1": gluon(band=1),
                "gluon-per-tile-band1": gluon(persistent=False, band=1), "ioattn": ioattn_fwd, "torch-cudnn": cudnn}
    if variants:
        backends.update({"gluon-no-pingpong": gluon(pingpong=False),
                         "gluon-rescale-conditional": gluon(rescale_threshold=8.0)})
    for band in bands:
        backends[f"gluon-band{band}"] = gluon(band=band)
    for spec in named:  # NAME:field=value,... over the head dim's GluonConfig
        name, _, fields = spec.partition(":")
        values = {f: {"true": True, "false": False}.get(v, v) for f, v in (kv.split("=") for kv in fields.split(","))}
        backends[f"gluon-{name}"] = gluon(**{f: v if isinstance(v, bool) else int(v) for f, v in values.items()})
    if configs:
        for d, shapes in CONFIG_VARIANTS.items():
            for block_n, stages in shapes:
                backends[f"gluon-d{d}-n{block_n}-s{stages}"] = gluon((d,), block_n=block_n, stages=stages)
    return backends


def _error_vs_reference(out, q, k, v, causal) -> float:
    from ioattn.reference import attention_ref, rel_error

    ref, _ = attention_ref(q[:1, :, :1], k[:1, :, :1], v[:1, :, :1], causal=causal)
    return rel_error(out[:1, :, :1], ref)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", action="store_true",
                   help="also time the kernel without ping-pong and with an unconditional rescale")
    p.add_argument("--configs", action="store_true", help="also time other (block_n, stages) per head dim")
    p.add_argument("--bands", default="", help="also time the persistent kernel with these bands (e.g. 32,64)")
    p.add_argument("--variant", action="append", default=[],
                   help="also time the kernel with these GluonConfig fields: NAME:field=int|true|false,... "
                        "(repeatable)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="rows with a causal mask or not")
    p.add_argument("--only", default="", help="time only these backends (comma-separated names)")
    p.add_argument("--seqlens", default="", help="rows of these N only")
    p.add_argument("--head-dims", default="128,64,256", help="rows of these head dims only")
    p.add_argument("--budget-s", type=float, default=85.0, help="stop between rows past this many seconds")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("gluon_fwd_bench: needs an sm_90 GPU (the Gluon kernel does not run under the CPU interpreter)")
        return 0
    started = time.time()
    from ioattn.reference import TOLERANCE

    results = dict(disclosure=harness.collect_disclosure("cuda", " ".join(sys.argv)), rows=[], errors=[],
                   flops="4*B*H*Nq*Nk*D, halved for causal", error="rel. Frobenius vs float64, batch 0, head 0")
    os.makedirs(OUT, exist_ok=True)

    def save():
        with open(os.path.join(OUT, "gluon_fwd.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    results["ceilings"] = harness.measure_ceilings("cuda", [torch.bfloat16])
    save()
    backends = _backends(args.variants, args.configs, [int(b) for b in args.bands.split(",") if b], args.variant)
    if args.only:
        backends = {name: fn for name, fn in backends.items() if name in args.only.split(",")}
    seqlens = {int(n) for n in args.seqlens.split(",") if n}
    head_dims = {int(d) for d in args.head_dims.split(",")}
    dtype = torch.bfloat16
    for d, n, causal, hq, hkv in SHAPES:
        if d not in head_dims or (seqlens and n not in seqlens) or args.causal == ("no" if causal else "yes"):
            continue
        if time.time() - started > args.budget_s:
            results["not_run"] = results.get("not_run", []) + [[d, n, causal, hq, hkv]]
            continue
        batch = TOKENS // n
        q = torch.randn(batch, n, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(batch, n, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(batch, n, hkv, d, device="cuda", dtype=dtype)
        flops = harness.attention_flops(batch, hq, n, n, d, causal=causal)
        row_ms = {}
        for name, fn in backends.items():
            config_dim = re.match(r"gluon-d(\d+)-", name)  # a --configs backend: its head dim only
            if config_dim and int(config_dim.group(1)) != d:
                continue
            row = dict(backend=name, dtype="bfloat16", B=batch, Hq=hq, Hkv=hkv, Nq=n, Nk=n, D=d, causal=causal)
            try:
                out = torch.full_like(q, float("nan"))
                err = _error_vs_reference(fn(q, k, v, causal, out), q, k, v, causal)
                row["rel_error"] = err
                if not err < TOLERANCE[dtype]:
                    row["status"] = "wrong: not timed"
                else:
                    row["peak_mib"] = harness.peak_memory_mib(lambda: fn(q, k, v, causal, out), "cuda")
                    row["ms"] = harness.time_ms(lambda: fn(q, k, v, causal, out), "cuda").ms
                    row["tflops"] = harness.tflops(flops, row["ms"])
                    row["status"] = "ok"
                    row_ms[name] = row["ms"]
            except Exception as exc:  # noqa: BLE001 — recorded, the sweep goes on
                row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
                results["errors"].append(dict(row=row, trace=traceback.format_exc()[-2000:]))
            results["rows"].append(row)
            print(json.dumps({k: row.get(k) for k in ("backend", "D", "Nq", "causal", "Hq", "Hkv", "ms", "tflops",
                                                      "rel_error", "status")}), flush=True)
            save()
        # ratios once every backend of the shape has run (gluon runs first, before its peers)
        for row in [r for r in results["rows"] if (r["D"], r["Nq"], r["causal"], r["Hq"]) == (d, n, causal, hq)]:
            if row["backend"].startswith("gluon") and "ms" in row:
                for peer in ("ioattn", "torch-cudnn"):
                    if peer in row_ms:
                        row[f"speed_vs_{peer}"] = row_ms[peer] / row["ms"]
        save()
        del q, k, v
        torch.cuda.empty_cache()
    results["elapsed_s"] = time.time() - started
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
