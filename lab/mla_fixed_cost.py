"""How much of a short Gluon MLA decode call is fixed cost: one launch timed alone (CUDA events over a graph of N
identical launches on ONE cache, L2 warm) against the bench's distinct caches, at B 64, 128 heads, L 64 and 1024,
beside an empty kernel's launch. Prints µs per launch. CUDA (sm_90) only.

    PYTHONPATH=. python3 lab/mla_fixed_cost.py
"""

from __future__ import annotations

import torch
import triton

from ioattn.bench.mla import LATENT_DIM, ROW_DIM, SOFTMAX_SCALE, latent_pool
from ioattn.ops.mla import MLAConfig, mla_paged_attention, mla_workspace


@triton.jit
def _empty(x):
    pass


def graph_us(fn, n=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(20):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    x = torch.zeros(1, device="cuda")
    print(f"empty triton kernel: {graph_us(lambda: _empty[(128,)](x)):.1f} us")
    wide = dict(block_h=64, block_m=64, block_n=64, num_warps=8, num_stages=2, kernel="gluon")
    kernels = {128: {"lockstep": MLAConfig(**wide), "seesaw": MLAConfig(**wide, seesaw=True),
                     "lockstep staged": MLAConfig(**wide, stage_out=True),
                     "seesaw staged": MLAConfig(**wide, seesaw=True, stage_out=True)},
               16: {"16h": MLAConfig(block_h=16, block_m=16, block_n=64, num_warps=4, num_stages=2, kernel="gluon"),
                    "16h staged": MLAConfig(block_h=16, block_m=16, block_n=64, num_warps=4, num_stages=2,
                                            kernel="gluon", stage_out=True)}}
    for heads, cfgs in kernels.items():
        for batch, length in ((64, 64), (64, 1024), (1, 64)):
            q = torch.randn(batch, heads, ROW_DIM, dtype=torch.bfloat16, device="cuda")
            latent = torch.randn(batch, length, ROW_DIM, dtype=torch.bfloat16, device="cuda")
            lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            pool, table = latent_pool(latent, 64)
            out = torch.empty(batch, heads, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
            for name, cfg in cfgs.items():
                ws = mla_workspace(batch, heads, LATENT_DIM, device="cuda")

                def call(cfg=cfg, ws=ws):
                    return mla_paged_attention(q, pool, table, lens, v_head_dim=LATENT_DIM,
                                               softmax_scale=SOFTMAX_SCALE, out=out, workspace=ws, config=cfg,
                                               num_splits=1)
                print(f"H{heads} B{batch} L{length} {name}: {graph_us(call):.1f} us (one cache, L2 warm, splits 1)",
                      flush=True)


if __name__ == "__main__":
    main()
