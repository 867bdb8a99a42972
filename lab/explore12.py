"""Device exploration 12: issue 4's latency-bound decode rows after explore11.

- Split counts past the 512-keys-per-split floor where explore11 did not reach: 32/8 heads B=1 at L = 4k and
  16k, 32/32 heads B=1 at L = 1k and 4k (per layer over 32 cache copies, page 16 shuffled).
- The split combine launched by programmatic dependent launch (paged_attention's `dependent_combine`) against
  the plain ordered launch, per layer and as a lone call; each CUDA graph is replayed once more on a
  NaN-poisoned output and checked against the float64 reference (the dependent launch inside a graph).
- Read-only ceiling: a streaming Triton sum over 2 GiB and over 134 MB (B=1 L=32k's K+V) as a lone call, next
  to the copy ceiling: what a decode kernel, which only reads, could reach at all.

The decode rows run through explore10's `decode_section` (merged into it after the recorded run: the
same measurement, a few more fields per row).

PYTHONPATH=. python3 lab/explore12.py; writes $OUT/explore12.json (results:
bench/results/2026-12-01-s6-explore12-h200.json). On a CPU: toy shapes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402
import explore10 as e10  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

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
                total = x.double()
                err = abs(float(run().double().sum()) - float(total.sum())) / max(1.0, float(total.abs().sum()))
                ms, how = e1.timed(run)
                e1.RESULTS.setdefault("read", []).append({"bytes": nbytes, "block": block, "unroll": unroll,
                                                          "warps": warps, "us": ms * 1e3, "tbps": nbytes / ms / 1e9,
                                                          "error": err, "how": how})
                print("read", nbytes, block, unroll, warps, round(ms * 1e3, 1), "us", round(nbytes / ms / 1e9, 2),
                      "TB/s", flush=True)
            except Exception as exc:  # noqa: BLE001
                e1.record_error("read", (nbytes, block, unroll, warps), exc)
        del x
        e1.sync()
        e1.save()


def decode_rows(heads, shapes, split_counts, layers, dependent_options):
    """explore10's per-layer decode section, page 16 shuffled, per combine launch, each graph checked."""
    e10.decode_section(heads=heads, shapes=shapes, split_counts=split_counts, layers=layers,
                       dependent_options=dependent_options, check_graph=True)


if __name__ == "__main__":
    e1.save_as("explore12")
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(DEV, "lab/explore12.py")
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
    e1.save()
    print(e1.RESULTS["errors"])
