"""Host microseconds of each part of one public attention call (causal D 128 N 2k, the GPU held busy so that
launches queue): validation, dispatch (and its Gluon check and backward-config lookup), the four TMA descriptors,
the Gluon launch, the whole call; beside cuDNN."""
import time

import torch
import torch.nn.functional as F

from ioattn import flash_attn_func
from ioattn.ops import checks, dispatch
from ioattn.ops.gluon_forward import BLOCK_M, _descriptor, launch_dense


def main():
    q, k, v = (torch.randn(8, 2048, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(8, 16, 2048, device="cuda", dtype=torch.float32)
    inputs = checks.validate_dense(q, k, v, True, (-1, -1), None)
    plan = dispatch.plan(inputs, "auto")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    parts = {
        "validate_dense": lambda: checks.validate_dense(q, k, v, True, (-1, -1), None),
        "dispatch.plan": lambda: dispatch.plan(inputs, "auto"),
        "gluon_unsupported": lambda: dispatch.gluon_unsupported(inputs, (9, 0)),
        "tuned_bwd_config": lambda: dispatch.tuned_bwd_config(128, torch.bfloat16, (9, 0)),
        "4 descriptors": lambda: [_descriptor(t, r) for t, r in ((q, BLOCK_M), (k, 128), (v, 128), (out, BLOCK_M))],
        "launch_dense": lambda: launch_dense(q, k, v, -1, 0, 0.088, out, lse, plan.config),
        "torch.empty x2": lambda: (torch.empty_like(q), torch.empty(8, 16, 2048, device="cuda")),
        "flash_attn_func": lambda: flash_attn_func(q, k, v, causal=True),
        "cudnn sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
    }
    for name, fn in parts.items():
        best = host_us_rounds(fn)
        print(f"{name:18s} {min(best):7.1f} us (median {sorted(best)[2]:.1f})", flush=True)


def host_us_rounds(fn, calls=100, rounds=5, busy_cycles=500_000_000) -> list[float]:
    """Host microseconds per call of `fn` in each of `rounds` rounds of `calls` calls, the GPU held busy
    (`torch.cuda._sleep`) so that launches queue: a part that waits for the GPU shows the busy time."""
    fn()
    best = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(busy_cycles)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - start) * 1e6 / calls)
        torch.cuda.synchronize()
    return best


if __name__ == "__main__":
    main()
