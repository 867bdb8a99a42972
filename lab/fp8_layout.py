"""Is the fp8 decode held back by its cache layout? The paged kernel gathers, per KV head and cache slot, one row of
head_dim elements: in the engine's layout (blocks, slot, head, dim), "NHD", rows of one head sit heads x dim
elements apart, so an fp8 row is a lone 128-byte segment (bf16: 256 bytes). With (blocks, head, slot, dim), "HND"
(FlashInfer's other layout), one head's rows of a block are contiguous (16 x 128 bytes at block 16). The kernel
takes strides, so the same launch reads either; this times both, bf16 and fp8 (e4m3, the launcher's defaults),
32/8 heads, D 128, block 16 shuffled, at rows where B·L >= 64k.

    PYTHONPATH=. python3 lab/fp8_layout.py     # writes $OUT/fp8-layout.json; on a CPU: one toy shape, errors only
"""

from __future__ import annotations

import json
import os

import torch
import triton

from ioattn.bench import harness
from ioattn.bench.decode import fp8_inputs
from ioattn.ops.fp8 import dequantize
from ioattn.ops.paged import paged_attention
from ioattn.reference import attention_ref, rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(64, 4096), (8, 32768), (256, 4096), (1, 131072)] if DEVICE == "cuda" else [(2, 64)]
HEADS, KV_HEADS, DIM, PAGE = (32, 8, 128, 16) if DEVICE == "cuda" else (4, 2, 32, 16)


def layouts(k, v, perm):
    """{layout: (k_cache, v_cache)}: (B, L, H, D) scattered into blocks by perm, as NHD tensors and as HND storage
    viewed in the NHD index order."""
    blocks = perm.numel()
    out = {}
    for name in ("NHD", "HND"):
        pair = []
        for t in (k, v):
            flat = t.reshape(blocks, PAGE, KV_HEADS, DIM)
            if name == "NHD":
                cache = torch.empty_like(flat)
            else:
                cache = torch.empty(blocks, KV_HEADS, PAGE, DIM, dtype=t.dtype, device=t.device).permute(0, 2, 1, 3)
            cache[perm] = flat
            pair.append(cache)
        out[name] = tuple(pair)
    return out


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    result = {"disclosure": harness.collect_disclosure(DEVICE, "PYTHONPATH=. python3 lab/fp8_layout.py"), "rows": []}
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    for batch, length in SHAPES:
        torch.manual_seed(batch + length)
        k = torch.randn(batch, length, KV_HEADS, DIM, dtype=dtype, device=DEVICE)
        v = torch.randn_like(k)
        q = torch.randn(batch, HEADS, DIM, dtype=dtype, device=DEVICE)
        blocks = batch * length // PAGE
        perm = torch.randperm(blocks, device=DEVICE)
        table = perm.view(batch, length // PAGE).to(torch.int32)
        lens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
        k8, v8, k_scale, v_scale = fp8_inputs(k, v, torch.float8_e4m3fn)
        cases = [("bf16", k, v, None, None, attention_ref(q[:1, None], k[:1], v[:1])[0]),
                 ("fp8_e4m3", k8, v8, k_scale, v_scale,
                  attention_ref(q[:1, None], dequantize(k8[:1], k_scale, torch.float64),
                                dequantize(v8[:1], v_scale, torch.float64))[0])]
        del k, v, k8, v8
        for cache_name, kk, vv, ks, vs, ref in cases:
            for layout, (k_cache, v_cache) in layouts(kk, vv, perm).items():
                row = {"B": batch, "L": length, "cache": cache_name, "layout": layout}
                out = torch.full_like(q, float("nan"))

                def run():
                    paged_attention(q, k_cache, v_cache, table, lens, out=out, k_scale=ks, v_scale=vs)

                try:
                    run()
                    row["error"] = rel_error(out[:1], ref[:, 0]) if out[:1].isfinite().all() else float("nan")
                    if not row["error"] < 1e-2:
                        row["status"] = "wrong"
                    elif DEVICE == "cuda":
                        ms = triton.testing.do_bench(run, warmup=25, rep=100)
                        kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
                        row.update(us=ms * 1e3, tbps=kv_bytes / (ms * 1e-3) / 1e12)
                except Exception as error:  # noqa: BLE001 - a layout the launch refuses is a result too
                    row["status"] = f"failed: {type(error).__name__}: {error}"[:300]
                result["rows"].append(row)
                print(f"B{batch:<4} L{length:<7} {cache_name:<9} {layout} {row.get('us', float('nan')):9.1f} us "
                      f"{row.get('tbps', float('nan')):5.2f} TB/s err {row.get('error', float('nan')):.2e} "
                      f"{row.get('status', '')}", flush=True)
                with open(os.path.join(out_dir, "fp8-layout.json"), "w") as f:
                    json.dump(result, f, indent=1)
                del k_cache, v_cache
        del cases
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
