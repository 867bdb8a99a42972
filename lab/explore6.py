"""Device exploration 6: D=128 backward tiles at short sequences (N = 2k, 4k against 16k), one kernel varied at a
time: the dK/dV kernel's tiles with the dQ kernel as the default, then the dQ kernel's with the dK/dV kernel as
the default, so each kernel's share of the time shows as a difference. The candidates fit two programs per SM
(registers x threads <= 32k and shared memory <= 113 KB in offline sm_90 builds) or drop the default's spills.
PYTHONPATH=. python3 lab/explore6.py; writes $OUT/explore6.json (results:
bench/results/2026-12-01-s4-explore6-h200.json, run before the dQ kernel took over the row statistics)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

import ioattn  # noqa: E402
from ioattn.ops.backward import BwdConfig as B, attention_bwd  # noqa: E402

DEFAULT = B(128, 64, 128, 64, 8, 3, False)
DKDV = [B(128, 32, 128, 64, 8, 3, False, 8, 3), B(64, 32, 128, 64, 4, 2, False, 8, 3),
        B(64, 32, 128, 64, 4, 3, False, 8, 3), B(64, 16, 128, 64, 4, 3, False, 8, 3),
        B(64, 64, 128, 64, 8, 2, False, 8, 3), B(64, 64, 128, 64, 4, 2, False, 8, 3),
        B(128, 64, 128, 64, 8, 2, False, 8, 3)]
DQ = [B(128, 64, 64, 64, 8, 3, False, 4, 2), B(128, 64, 64, 32, 8, 3, False, 4, 3),
      B(128, 64, 128, 32, 8, 3, False, 8, 3), B(128, 64, 64, 64, 8, 3, False, 8, 2),
      B(128, 64, 128, 64, 8, 3, False, 8, 2)]
SHAPES = [(128, n, c) for n in (2048, 4096, 16384) for c in (False, True)]


def kernel_breakdown():
    """Per-kernel CUDA time of the default backward (torch profiler, mean of 5 calls) at every shape."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for d, n, causal in ([(64, 128, False)] if e1.TINY else SHAPES):
        heads, batch = (2, 1) if e1.TINY else (2048 // d, 16384 // n)
        q, k, v, do = (torch.randn(batch, n, heads, d, dtype=e1.BF16, device=e1.DEV) for _ in range(4))
        o, lse = ioattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)

        def run():
            return attention_bwd(do, q, k, v, o, lse, scale=d ** -0.5, causal=causal, config=DEFAULT)
        for _ in range(3):
            run()
        e1.sync()
        with profile(activities=[ProfilerActivity.CUDA] if not e1.TINY else [ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                run()
            e1.sync()
        times = {}
        for evt in prof.key_averages():
            if "attention_bwd" in evt.key:
                times[evt.key] = getattr(evt, "device_time_total", 0) / 5
        rows.append({"D": d, "N": n, "causal": causal, "us_per_call": times})
        print("breakdown", n, causal, times, flush=True)
    e1.RESULTS["breakdown"] = rows
    e1.save()


if __name__ == "__main__":
    e1.save_as("explore6")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore6.py")
    try:
        kernel_breakdown()
    except Exception as exc:  # noqa: BLE001
        e1.record_error("breakdown", "profiler", exc)
    e1.bwd_section(configs_by_dim={128: [DEFAULT, *DKDV, *DQ]}, shapes=SHAPES)
    e1.save()
    for r in e1.RESULTS["bwd"]:
        print(r["N"], r["causal"], r["variant"], round(r.get("tflops", 0), 1), flush=True)
    print(e1.RESULTS["errors"])
