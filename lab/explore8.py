"""Device exploration 8: after the dQ kernel took over the row statistics (no preprocess launch), dQ tiles that
fit two programs per SM at D=128, N = 2k, 4k, 16k. PYTHONPATH=. python3 lab/explore8.py; writes
$OUT/explore8.json (results: bench/results/2026-12-01-s4-explore8-h200.json).

The recorded run also timed a variant since removed: pointer loads for the dK/dV kernel's resident K/V
("resident=pointers"): slower by 0-3% where it compiled, and ptxas crashed (error -11) on the non-causal
build."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

from ioattn.ops.backward import BwdConfig as B  # noqa: E402

CONFIGS = {128: [B(64, 64, 128, 64, 4, 2, False, 8, 3), B(64, 64, 64, 64, 4, 2, False, 4, 2),
                 B(64, 64, 128, 32, 4, 2, False, 8, 4)]}
SHAPES = [(128, n, c) for n in (2048, 4096, 16384) for c in (False, True)]

if __name__ == "__main__":
    e1.save_as("explore8")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore8.py")
    e1.bwd_section(configs_by_dim=CONFIGS, shapes=SHAPES)
    e1.save()
    for r in e1.RESULTS["bwd"]:
        print(r["D"], r["N"], r["causal"], r["variant"], [round(e, 4) for e in r["errors"]],
              round(r.get("tflops", 0), 1), flush=True)
    print(e1.RESULTS["errors"])
