"""Device exploration 3: split counts at mid batch, the paged-prefill gather cost (page 16/64/256), graph overhead.

PYTHONPATH=. python3 lab/explore3.py; writes $OUT/explore3.json.
Results: bench/results/2026-12-01-explore3-h200.json.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

from ioattn.bench import harness  # noqa: E402
from ioattn.bench.decode import paged_pool  # noqa: E402
from ioattn.ops.paged import PagedConfig as C, paged_attention  # noqa: E402
from ioattn.reference import attention_ref, rel_error  # noqa: E402

DECODE_SHAPES = [(3, 256)] if e1.TINY else [(64, 1024), (64, 4096), (8, 4096), (8, 32768), (1, 32768)]
SPLIT_SWEEP = (2,) if e1.TINY else (2, 3, 4, 8, 16, 25, 48, 64)


def decode_configs():
    return {"base": C(16, 64, 4, 2)}


def graph_overhead_section():
    """do_bench of a CUDA graph holding one tiny kernel: the fixed cost every decode row pays."""
    x = torch.zeros(1, device=e1.DEV)
    for name, fn in (("tiny_kernel", lambda: x.add_(1)),):
        ms, how = e1.timed(fn)
        e1.RESULTS.setdefault("overhead", []).append({"what": name, "us": ms * 1e3, "how": how})
    e1.save()


def prefill_gather_section():
    hq, hkv, d, new, ctx = (4, 2, 64, 64, 64) if e1.TINY else (32, 8, 128, 4096, 4096)
    total = new + ctx
    torch.manual_seed(5)
    q = torch.randn(1, new, hq, d, dtype=e1.BF16, device=e1.DEV)
    k = torch.randn(1, total, hkv, d, dtype=e1.BF16, device=e1.DEV)
    v = torch.randn_like(k)
    rows = min(new, 256)
    ref = attention_ref(q[:, -rows:], k, v, causal=True)[0]
    flops = harness.attention_flops(1, hq, new, total, d, causal=True)
    cu = torch.tensor([0, new], dtype=torch.int32, device=e1.DEV)
    lens = torch.tensor([total], dtype=torch.int32, device=e1.DEV)
    configs = {"m128n64w8s2r128": C(128, 64, 8, 2, maxnreg=128),
               "m128n64w8s2r112": C(128, 64, 8, 2, maxnreg=112),
               "m128n64w8s2r168": C(128, 64, 8, 2, maxnreg=168)}
    if e1.TINY:
        configs = dict(list(configs.items())[:1])
    for page in ((16,) if e1.TINY else (16, 64, 256)):
        k_cache, v_cache, table = paged_pool(k, v, page, shuffled=True)
        for name, cfg in configs.items():
            try:
                out = torch.full_like(q[0], float("nan"))

                def fwd(cfg=cfg, out=out, k_cache=k_cache, v_cache=v_cache, table=table):
                    return paged_attention(q[0], k_cache, v_cache, table, lens, cu_seqlens_q=cu, max_seqlen_q=new,
                                           num_splits=1, config=cfg, out=out)
                fwd()
                e1.sync()
                err = rel_error(out[None, -rows:], ref)
                entry = {"page": page, "variant": name, "error": err, "nan": bool(torch.isnan(out).any())}
                if err < 1e-2 and not entry["nan"]:
                    ms, _ = e1.timed(fwd, 10, 60)
                    entry.update(ms=ms, tflops=harness.tflops(flops, ms))
                e1.RESULTS["prefill"].append(entry)
                e1.save()
            except Exception as exc:  # noqa: BLE001
                e1.record_error("prefill", (page, name), exc)
    print("prefill done", flush=True)


if __name__ == "__main__":
    e1.save_as("explore3")
    e1.DECODE_SHAPES, e1.decode_configs = DECODE_SHAPES, decode_configs
    e1.SPLIT_SWEEP_CONFIGS, e1.SPLIT_SWEEP = ("base",), SPLIT_SWEEP
    e1.SPLIT_SWEEP_MAX_BATCH = None  # explore1 sweeps splits only for batch <= 8: every batch of this run
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore3.py")
    for name, fn in (("overhead", graph_overhead_section), ("decode", e1.decode_section),
                     ("prefill", prefill_gather_section)):
        t = time.time()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            e1.record_error(name, "section", exc)
        e1.RESULTS[f"{name}_seconds"] = time.time() - t
        e1.save()
    print({k: round(v) for k, v in e1.RESULTS.items() if k.endswith("_seconds")})
