"""Device exploration 11 (run in the sixth session: bench/results/2026-12-01-s6-explore11-h200.json): the latency-bound decode rows of issue 4.

- B=1 and B=8 at L = 1k and 4k (32/8 heads, D=128): split counts below MIN_KEYS_PER_SPLIT's limit (1-16, i.e.
  down to 64 keys per split), paged (page 16, shuffled) against contiguous (page 256), per-layer over 32 copies:
  is the B=1 L=1k paged/contiguous gap (19.8 vs 17.7 µs) the split count's fixed cost or the page gathers?
- B=1 L=32k: split counts 32-132, per layer over 32 copies and as a lone call (layers=1), beside the device copy
  of the same 134 MB as a lone call (what a lone call can reach at this size at all).

PYTHONPATH=. python3 lab/explore11.py; writes $OUT/explore11.json. On a CPU: toy shapes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402
import explore10 as e10  # noqa: E402

import torch  # noqa: E402


def copy_section(nbytes: int) -> None:
    """Lone-call device copy of nbytes (read + written counted as in the harness ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=e1.DEV)
    dst = torch.empty_like(src)
    ms, how = e1.timed(lambda: dst.copy_(src))
    e1.RESULTS.setdefault("copy", []).append({"bytes": nbytes, "us": ms * 1e3, "tbps": 2 * nbytes / ms / 1e9,
                                              "how": how})
    print("copy", nbytes, round(ms * 1e3, 1), "us", round(2 * nbytes / ms / 1e9, 2), "TB/s", flush=True)
    e1.save()


if __name__ == "__main__":
    e1.save_as("explore11")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore11.py")
    e1.RESULTS["ceilings"] = e1.harness.measure_ceilings(e1.DEV, [e1.BF16])
    layouts = (("paged", 16), ("contig", 256 if not e1.TINY else 16))
    short = [(1, 256)] if e1.TINY else [(1, 1024), (1, 4096), (8, 1024), (8, 4096)]
    e10.decode_section(heads=(4, 2) if e1.TINY else (32, 8), shapes=short,
                       split_counts=(1, 2) if e1.TINY else (1, 2, 4, 8, 16), layouts=layouts)
    long_shape = [(1, 512)] if e1.TINY else [(1, 32768)]
    for layers in ((2, 1) if e1.TINY else (32, 1)):
        e10.decode_section(heads=(4, 2) if e1.TINY else (32, 8), shapes=long_shape,
                           split_counts=(2,) if e1.TINY else (32, 48, 64, 96, 132), layers=layers, layouts=layouts)
    copy_section(1 << 20 if e1.TINY else 134217728)
    e1.save()
    print(e1.RESULTS["errors"])
