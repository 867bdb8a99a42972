"""Device exploration 12: issue 4's latency-bound decode rows after explore11.

- Split counts past the 512-keys-per-split floor where explore11 did not reach: 32/8 heads B=1 at L = 4k and
  16k, 32/32 heads B=1 at L = 1k and 4k (per layer over 32 cache copies, page 16 shuffled).
- The split combine launched by programmatic dependent launch (`ioattn.ops.paged.DEPENDENT_COMBINE`) against
  the plain ordered launch, per layer and as a lone call; each CUDA graph is replayed once more on a
  NaN-poisoned output and checked against the float64 reference (the dependent launch inside a graph).
- Read-only ceiling: a streaming Triton sum over 2 GiB and over 134 MB (B=1 L=32k's K+V) as a lone call, next
  to the copy ceiling: what a decode kernel, which only reads, could reach at all.

PYTHONPATH=. python3 bench/explore/explore12.py; writes $OUT/explore12.json (results:
bench/results/2026-12-01-s6-explore12-h200.json). On a CPU: toy shapes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import ioattn.ops.paged as paged  # noqa: E402
from ioattn.bench.decode import _graphed  # noqa: E402
from ioattn.reference import rel_error  # noqa: E402

save = e1.save_as("explore12")
DEV, BF16, TINY = e1.DEV, e1.BF16, e1.TINY


@triton.jit
def _streaming_sum_kernel(X, Partial, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Each program sums UNROLL consecutive blocks (independent loads in flight) into one float."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * UNROLL
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(UNROLL):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(Partial + tl.program_id(0), tl.sum(acc, 0))


def read_section(nbytes_list, shapes=((1024, 4, 4), (2048, 4, 4), (1024, 8, 4), (4096, 2, 4))):
    """Lone-call streaming read of nbytes, per (elements per load, loads per program, warps)."""
    for nbytes in nbytes_list:
        x = torch.randn(nbytes // 2, dtype=BF16, device=DEV)
        for block, unroll, warps in shapes:
            grid = triton.cdiv(x.numel(), block * unroll)
            partial = torch.empty(grid, dtype=torch.float32, device=DEV)

            def run(x=x, partial=partial, block=block, unroll=unroll, grid=grid, warps=warps):
                _streaming_sum_kernel[(grid,)](x, partial, x.numel(), BLOCK=block, UNROLL=unroll, num_warps=warps)
                return partial
            try:
                err = abs(float(run().double().sum()) - float(x.double().sum())) / max(1.0, float(x.double().abs().sum()))
                ms, how = e1.timed(run)
                e1.RESULTS.setdefault("read", []).append({"bytes": nbytes, "block": block, "unroll": unroll, "warps": warps,
                                                          "us": ms * 1e3, "tbps": nbytes / ms / 1e9, "error": err,
                                                          "how": how})
                print("read", nbytes, block, unroll, warps, round(ms * 1e3, 1), "us", round(nbytes / ms / 1e9, 2), "TB/s",
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                e1.record_error("read", (nbytes, block, unroll, warps), exc)
        del x
        e1.sync()
        save()


def decode_rows(heads, shapes, split_counts, layers, dependent_options=(True,)):
    """Per-layer µs of paged_attention (page 16, shuffled) per (B, L), split count and combine launch; every
    graph is replayed once more on a NaN-poisoned output and that output checked."""
    hq, hkv = heads
    d = 64 if TINY else 128
    for batch, length in shapes:
        q, k, v, lens, ref, kv_bytes = e1.decode_inputs(batch, length, hq, hkv, d)
        k_cache, v_cache, table = e1.paged_pool(k, v, 16, True)
        del k, v
        copies = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(layers - 1)]
        for splits in split_counts:
            for dependent in dependent_options:
                paged.DEPENDENT_COMBINE = dependent
                ws = paged.paged_workspace(batch, hq, d, max_splits=splits, device=DEV)
                out = torch.full_like(q, float("nan"))

                def fwd(splits=splits, ws=ws, out=out):
                    for kc, vc in copies:
                        paged.paged_attention(q, kc, vc, table, lens, out=out, workspace=ws, num_splits=splits)
                    return out
                try:
                    err = rel_error(fwd()[0], ref)
                    ms, how = e1.timed(fwd)
                    graphed, _ = _graphed(fwd, DEV)
                    out.fill_(float("nan"))
                    graphed()
                    e1.sync()
                    graph_err = rel_error(out[0], ref)
                    row = {"B": batch, "L": length, "heads": f"{hq}/{hkv}", "layers": layers, "splits": splits,
                           "dependent_combine": dependent, "us": ms * 1e3 / layers,
                           "tbps": kv_bytes / (ms / layers) / 1e9, "error": err, "graph_error": graph_err,
                           "how": how}
                    e1.RESULTS["decode"].append(row)
                    print("decode", hq, hkv, batch, length, splits, "pdl" if dependent else "plain", layers,
                          round(row["us"], 1), "us", round(row["tbps"], 2), "TB/s", err, graph_err, flush=True)
                except Exception as exc:  # noqa: BLE001
                    e1.record_error("decode", (heads, batch, length, splits, dependent), exc)
                save()
        paged.DEPENDENT_COMBINE = True
        del copies
        e1.sync()


if __name__ == "__main__":
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(DEV, "bench/explore/explore12.py")
    e1.RESULTS["ceilings"] = e1.harness.measure_ceilings(DEV, [BF16])
    read_section([1 << 20] if TINY else [1 << 31, 134217728])
    both = (True, False)
    if TINY:
        decode_rows((4, 2), [(1, 256)], (1, 2, 4), 2, both)
    else:
        decode_rows((32, 8), [(1, 1024)], (16,), 32, both)
        decode_rows((32, 8), [(1, 4096)], (16, 32, 64), 32, both)
        decode_rows((32, 8), [(1, 16384)], (32, 48, 64), 32, both)
        decode_rows((32, 8), [(8, 1024)], (8,), 32, both)
        decode_rows((32, 8), [(1, 32768)], (48, 64), 32, both)
        decode_rows((32, 8), [(1, 32768)], (48, 64), 1, both)
        decode_rows((32, 8), [(1, 131072)], (32, 64), 16, both)
        decode_rows((32, 32), [(1, 1024)], (2, 4, 8, 16), 32, both)
        decode_rows((32, 32), [(1, 4096)], (4, 8, 16, 32, 64), 32, both)
    save()
    print(e1.RESULTS["errors"])
