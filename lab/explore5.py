"""Device exploration 5: register-capped forward tiles at the D=64, N=2048 bar rows, with FlexAttention in the
same run. PYTHONPATH=. python3 lab/explore5.py; writes $OUT/explore5.json (results:
bench/results/2026-12-01-explore5-h200.json)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

from ioattn.ops.forward import FwdConfig as F  # noqa: E402

CASES = [(64, 128, c, [F(32, 32, 4, 1, maxnreg=128)]) for c in (False, True)] if e1.TINY else [
    (64, 2048, False, [F(128, 64, 4, 3, tma=False), F(128, 64, 4, 3, maxnreg=168), F(128, 64, 4, 3, tma=False, maxnreg=168),
                       F(128, 128, 4, 3), F(128, 64, 4, 2, maxnreg=168), F(128, 64, 4, 4, maxnreg=168)]),
    (64, 2048, True, [F(64, 64, 4, 3, tma=False), F(64, 64, 4, 3, maxnreg=168), F(128, 64, 4, 3, maxnreg=168),
                      F(64, 64, 4, 3, tma=False, maxnreg=128), F(128, 64, 4, 3, tma=False)]),
]

if __name__ == "__main__":
    e1.save_as("explore5")
    e1.WITH_FLEX = not e1.TINY
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore5.py")
    e1.fwd_section(cases=CASES)
    e1.save()
    for r in e1.RESULTS["fwd"]:
        print(r["D"], r["N"], r["causal"], r["variant"], round(r.get("tflops", 0), 1))
