"""Device exploration 13: where B=1 L=32k decode time goes, and where the D=128 N=2k backward time goes.

- Decode 32/8 heads B=1 L=32k, 64 splits, per layer over 32 cache copies (page 16, shuffled): decode tile
  configs (BLOCK_N, warps, stages, register cap) beside the default; a torch-profiler breakdown of one graph
  replay into the split kernel and the combine (and the same at L=1k).
- Read ceilings with larger per-program reads than explore12's streaming sum (2 GiB, and 134 MB as a lone call).
- Backward D=128 bf16 B=8 H=16 N=2k non-causal (and B=1 N=16k): profiler time of the dQ and the dK/dV kernel.

The decode rows run through explore10's `decode_section` (merged into it after the recorded run: the
same measurement, a few more fields per row).

PYTHONPATH=. python3 lab/explore13.py; writes $OUT/explore13.json (results:
bench/results/2026-12-01-s6-explore13-h200.json). On a CPU: toy shapes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402
import explore10 as e10  # noqa: E402
import explore12 as e12  # noqa: E402

import torch  # noqa: E402

import ioattn  # noqa: E402
from ioattn.ops.paged import PagedConfig as C  # noqa: E402

DEV, BF16, TINY = e1.DEV, e1.BF16, e1.TINY


def decode_configs(batch, length, splits, layers, configs, profile):
    """explore10's per-layer decode section at one shape (32/8 heads, page 16 shuffled), per decode config."""
    e10.decode_section(heads=(4, 2) if TINY else (32, 8), shapes=[(batch, length)], split_counts=(splits,),
                       layers=layers, configs=configs, profile=profile)


def backward_profile(batch, n, heads, d, causal):
    q, k, v = (torch.randn(batch, n, heads, d, dtype=BF16, device=DEV, requires_grad=True) for _ in range(3))
    out = ioattn.flash_attn_func(q, k, v, causal=causal)
    do = torch.randn_like(out)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    try:
        times = e1.kernel_times(bwd, 5)
        row = {"B": batch, "N": n, "H": heads, "D": d, "causal": causal,
               "kernels": {key: {"calls": c, "us_per_call": t / c} for key, (c, t) in times.items()}}
        e1.RESULTS["bwd"].append(row)
        print("bwd", batch, n, causal, row["kernels"], flush=True)
    except Exception as exc:  # noqa: BLE001
        e1.record_error("bwd", (batch, n, causal), exc)
    e1.save()


if __name__ == "__main__":
    e1.save_as("explore13")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(DEV, "lab/explore13.py")
    e1.RESULTS["ceilings"] = e1.harness.measure_ceilings(DEV, [BF16])
    e12.read_section([1 << 20] if TINY else [1 << 31, 134217728],
                     ((4096, 4, 8), (8192, 4, 8), (8192, 8, 8), (16384, 4, 16), (4096, 16, 4)))
    if TINY:
        decode_configs(1, 256, 2, 2, [None, C(16, 32, 4, 2, None)], True)
        backward_profile(1, 32, 2, 32, False)
    else:
        decode_configs(1, 32768, 64, 32, [None] + [C(16, n, w, s, r) for n in (32, 64, 128) for w in (4, 8)
                                                   for s in (2, 3, 4) for r in (128, None)], False)
        decode_configs(1, 32768, 64, 32, [None], True)
        decode_configs(1, 1024, 16, 32, [None], True)
        backward_profile(8, 2048, 16, 128, False)
        backward_profile(1, 16384, 16, 128, False)
        backward_profile(8, 2048, 16, 128, True)
    e1.save()
    print(e1.RESULTS["errors"])
