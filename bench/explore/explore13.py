"""Device exploration 13: where B=1 L=32k decode time goes, and where the D=128 N=2k backward time goes.

- Decode 32/8 heads B=1 L=32k, 64 splits, per layer over 32 cache copies (page 16, shuffled): decode tile
  configs (BLOCK_N, warps, stages, register cap) beside the default; a torch-profiler breakdown of one graph
  replay into the split kernel and the combine (and the same at L=1k).
- Read ceilings with larger per-program reads than explore12's streaming sum (2 GiB, and 134 MB as a lone call).
- Backward D=128 bf16 B=8 H=16 N=2k non-causal (and B=1 N=16k): profiler time of the dQ and the dK/dV kernel.

PYTHONPATH=. python3 bench/explore/explore13.py; writes $OUT/explore13.json (results:
bench/results/2026-12-01-s6-explore13-h200.json). On a CPU: toy shapes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402
import explore12 as e12  # noqa: E402

import torch  # noqa: E402

import ioattn  # noqa: E402
import ioattn.ops.paged as paged  # noqa: E402
from ioattn.bench.decode import _graphed  # noqa: E402
from ioattn.reference import rel_error  # noqa: E402

save = e1.save_as("explore13")
DEV, BF16, TINY = e1.DEV, e1.BF16, e1.TINY


def kernel_times(fn, replays):
    """{kernel name: (calls, total µs)} of `replays` calls of fn under the torch profiler (CUDA only)."""
    if TINY:
        return {}
    fn()
    e1.sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    return {ev.key: (ev.count, ev.device_time_total) for ev in prof.key_averages() if ev.device_time_total > 0}


def decode_configs(batch, length, splits, layers, configs, profile):
    hq, hkv = (4, 2) if TINY else (32, 8)
    d = 64 if TINY else 128
    q, k, v, lens, ref, kv_bytes = e1.decode_inputs(batch, length, hq, hkv, d)
    k_cache, v_cache, table = e1.paged_pool(k, v, 16, True)
    del k, v
    copies = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(layers - 1)]
    ws = paged.paged_workspace(batch, hq, d, max_splits=splits, device=DEV)
    for config in configs:
        out = torch.full_like(q, float("nan"))

        def fwd(config=config, out=out):
            for kc, vc in copies:
                paged.paged_attention(q, kc, vc, table, lens, out=out, workspace=ws, num_splits=splits, config=config)
            return out
        name = "default" if config is None else (f"n{config.block_n} w{config.num_warps} s{config.num_stages} "
                                                 f"r{config.maxnreg}")
        try:
            err = rel_error(fwd()[0], ref)
            ms, how = e1.timed(fwd)
            row = {"B": batch, "L": length, "splits": splits, "layers": layers, "config": name,
                   "us": ms * 1e3 / layers, "tbps": kv_bytes / (ms / layers) / 1e9, "error": err, "how": how}
            if profile:
                graphed, _ = _graphed(fwd, DEV)
                row["kernels"] = {key: {"calls": n, "us_per_call": t / n} for key, (n, t) in
                                  kernel_times(graphed, 5).items()}
            e1.RESULTS["decode"].append(row)
            print("decode", batch, length, splits, name, round(row["us"], 1), "us", round(row["tbps"], 2), "TB/s",
                  err, row.get("kernels", ""), flush=True)
        except Exception as exc:  # noqa: BLE001
            e1.record_error("decode", (batch, length, name), exc)
        save()
    del copies
    e1.sync()


def backward_profile(batch, n, heads, d, causal):
    q, k, v = (torch.randn(batch, n, heads, d, dtype=BF16, device=DEV, requires_grad=True) for _ in range(3))
    out = ioattn.flash_attn_func(q, k, v, causal=causal)
    do = torch.randn_like(out)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    try:
        times = kernel_times(bwd, 5)
        row = {"B": batch, "N": n, "H": heads, "D": d, "causal": causal,
               "kernels": {key: {"calls": c, "us_per_call": t / c} for key, (c, t) in times.items()}}
        e1.RESULTS["bwd"].append(row)
        print("bwd", batch, n, causal, row["kernels"], flush=True)
    except Exception as exc:  # noqa: BLE001
        e1.record_error("bwd", (batch, n, causal), exc)
    save()


if __name__ == "__main__":
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(DEV, "bench/explore/explore13.py")
    e1.RESULTS["ceilings"] = e1.harness.measure_ceilings(DEV, [BF16])
    C = paged.PagedConfig
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
    save()
    print(e1.RESULTS["errors"])
