"""Device exploration 7: the backward with its grid walked longest-first in head groups, and the 2-programs-per-SM
dK/dV tile at D=128, at D = 64 and 128, N = 2k, 4k, 16k. PYTHONPATH=. python3 lab/explore7.py; writes
$OUT/explore7.json (results: bench/results/2026-12-01-s4-explore7-h200.json).

The recorded run also timed a variant since removed: the dQ kernel launched with programmatic dependent launch
into the dK/dV kernel's tail (rows ending in "pdl"). It gained 0-2% and failed its exactness check once (D=64,
dq error 5e-2, dv 1e19): the two kernels overlapped while Triton's device-side descriptor scratch, freed by
the first launch, was handed to the second by the caching allocator."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

from ioattn.ops.backward import BwdConfig as B  # noqa: E402

CONFIGS = {
    128: [B(128, 64, 128, 64, 8, 3, False), B(64, 64, 128, 64, 4, 2, False, 8, 3)],
    64: [B(64, 64, 64, 64, 4, 3, False)],
}
SHAPES = [(d, n, c) for d in (128, 64) for n in (2048, 4096, 16384) for c in (False, True)]

if __name__ == "__main__":
    e1.save_as("explore7")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore7.py")
    e1.bwd_section(configs_by_dim=CONFIGS, shapes=SHAPES)
    e1.save()
    for r in e1.RESULTS["bwd"]:
        print(r["D"], r["N"], r["causal"], r["variant"], round(r.get("tflops", 0), 1), flush=True)
    print(e1.RESULTS["errors"])
