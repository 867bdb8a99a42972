"""Device exploration 14 (results: bench/results/2026-12-01-s6-explore14-h200.json): the D=128 N=2k backward row
of issue 3, ioattn beside FlexAttention in one process.

bf16 B=8 H=16 N=2048 D=128, non-causal and causal: per backend the backward alone timed as the bench times it
(do_bench, L2 flushed, `retain_graph`), then a torch-profiler list of every kernel one backward runs (name,
calls, µs), so the kernel time and what lies between kernels can be told apart. The profiled backwards
accumulate into .grad, so their lists also show torch add kernels (three per backward) that the timed ones,
which clear the gradients first, do not run. Both backends get the same inputs and the same dO, so their
gradients are compared too (the recorded run drew a dO per backend: its `ioattn_vs_flex` errors, 1.41 = √2,
compare two unrelated gradients and say nothing about either kernel).

PYTHONPATH=. python3 lab/explore14.py; writes $OUT/explore14.json. On a CPU: toy shapes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

import torch  # noqa: E402

import ioattn  # noqa: E402
from ioattn.reference import rel_error  # noqa: E402

DEV, BF16, TINY = e1.DEV, e1.BF16, e1.TINY


def backends(batch, n, heads, d, causal):
    """name -> (leaves, forward, dO) on one set of fresh random q, k, v, dO; layouts as `ioattn bench prefill`."""
    base = [torch.randn(batch, n, heads, d, dtype=BF16, device=DEV) for _ in range(3)]
    dout = torch.randn(batch, n, heads, d, dtype=BF16, device=DEV)
    ours = [t.clone().requires_grad_(True) for t in base]
    theirs = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in base]
    made = {"ioattn": (ours, lambda: ioattn.flash_attn_func(*ours, causal=causal), dout)}
    if not TINY:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, n, n, device=DEV) if causal else None
        made["flex"] = (theirs, lambda: compiled(*theirs, block_mask=mask), dout.transpose(1, 2).contiguous())
    return made


def section(batch, n, heads, d, causal):
    results = {}
    for name, (leaves, forward, dout) in backends(batch, n, heads, d, causal).items():
        try:
            out = forward()
            out.backward(dout, retain_graph=True)
            grads = [t.grad.clone() for t in leaves]

            def bwd(out=out, dout=dout):
                out.backward(dout, retain_graph=True)
            timing = e1.harness.time_ms(bwd, DEV, warmup_ms=25, rep_ms=300, grad_to_none=leaves)
            for t in leaves:
                t.grad = None
            kernels = e1.kernel_times(bwd, 5)
            results[name] = (grads, leaves)
            row = {"B": batch, "N": n, "H": heads, "D": d, "causal": causal, "backend": name, "ms": timing.ms,
                   "reps": timing.reps, "tflops": 2.5 * 4 * batch * heads * n * n * d * (0.5 if causal else 1)
                   / timing.ms / 1e9,
                   "kernels": {k: {"calls": c, "us_per_call": t / c} for k, (c, t) in kernels.items()}}
            row["kernel_us_per_backward"] = sum(t for _, t in kernels.values()) / 5
            e1.RESULTS["bwd"].append(row)
            print("bwd", name, n, causal, round(timing.ms, 3), "ms", round(row["tflops"], 1), "TFLOP/s",
                  "kernels", round(row["kernel_us_per_backward"], 1), "us", flush=True)
            for k, v in row["kernels"].items():
                print("   ", v["calls"], round(v["us_per_call"], 1), k[:110], flush=True)
        except Exception as exc:  # noqa: BLE001
            e1.record_error("bwd", (name, n, causal), exc)
        e1.save()
    if "flex" in results:  # same inputs and dO: the two backends' gradients agree
        ours, theirs = results["ioattn"][0], [g.transpose(1, 2) for g in results["flex"][0]]
        e1.RESULTS["bwd"].append({"N": n, "causal": causal, "ioattn_vs_flex": [rel_error(a, b) for a, b in
                                                                            zip(ours, theirs)]})
    e1.save()


if __name__ == "__main__":
    e1.save_as("explore14")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(DEV, "lab/explore14.py")
    if TINY:
        section(1, 32, 2, 32, False)
    else:
        for causal in (False, True):
            section(8, 2048, 16, 128, causal)
    e1.save()
    print(e1.RESULTS["errors"])
