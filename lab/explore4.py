"""Device exploration 4: the committed decode kernel timed the explore way (scatter into a fresh pool) and the
`ioattn bench decode` way (the pool is the K/V tensor itself, shuffled in place), at the rows where the two
disagreed. PYTHONPATH=. python3 lab/explore4.py; writes $OUT/explore4.json (results:
bench/results/2026-12-01-explore4-h200.json)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

from ioattn.bench.decode import Case, paged_decode_runner  # noqa: E402
from ioattn.ops.paged import PagedConfig as C  # noqa: E402

DECODE_SHAPES = [(3, 256)] if e1.TINY else [(64, 4096), (64, 1024), (256, 1024), (1, 32768), (8, 32768)]


def decode_configs():
    return {"base": C(16, 64, 4, 2), "r128": C(16, 64, 4, 2, maxnreg=128)}


def bench_way():
    for batch, length in DECODE_SHAPES:
        case = Case("bfloat16" if not e1.TINY else "float16", batch, 32, 8, length, 128)
        k = torch.randn(batch, length, 8, 128, dtype=e1.BF16, device=e1.DEV)
        v = torch.randn_like(k)
        q = torch.randn(batch, 32, 128, dtype=e1.BF16, device=e1.DEV)
        lens = torch.full((batch,), length, dtype=torch.int32, device=e1.DEV)
        for cfg_name, cfg in decode_configs().items():
            for shuffled, block in ((True, 16), (False, 256)):
                forward, out, plan, restore = paged_decode_runner(case, q, k, v, lens, block=block,
                                                                  shuffled=shuffled, config=cfg)
                ms, how = e1.timed(forward, 25, 100)
                e1.RESULTS["decode"].append({"way": "bench", "B": batch, "L": length, "variant": cfg_name,
                                             "layout": "paged" if shuffled else "contig", "splits": plan.num_splits,
                                             "us": ms * 1e3, "tbps": 2 * k.numel() * 2 / ms / 1e9})
                restore()
        e1.save()
        del k, v
        e1.sync()


if __name__ == "__main__":
    e1.save_as("explore4")
    e1.DECODE_SHAPES, e1.decode_configs, e1.SPLIT_SWEEP_CONFIGS = DECODE_SHAPES, decode_configs, ()
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore4.py")
    e1.decode_section()
    bench_way()
    e1.save()
    for r in e1.RESULTS["decode"]:
        if "us" in r:
            print(r.get("way", "explore"), r["B"], r["L"], r.get("layout"), r["variant"], r["splits"], round(r["tbps"], 2))
