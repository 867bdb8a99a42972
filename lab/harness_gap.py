"""Causal N 2k: why `ioattn bench prefill` and a direct call of the Gluon forward disagree (443 against 493 TFLOP/s
at D 128 on the same H100, 2026-12-07). Times, interleaved over three rounds on the same inputs: the public
`flash_attn_func` (what the bench runs), `gluon_forward` with the same config, the kernel with `out`/`lse` given,
and torch's cuDNN; and the host time of one public call while the GPU is held busy (what would leave it idle if it
exceeded the L2 flush). Every output is checked against float64 first. Writes JSON to argv[1]."""
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ioattn import flash_attn_func
from ioattn.bench import harness
from ioattn.ops.gluon_forward import gluon_config, gluon_forward

SHAPES = [(128, 16, 16), (128, 16, 4), (64, 32, 32), (256, 8, 8)]  # (D, Hq, Hkv), B·N 16k, N 2k, causal
N, B = 2048, 8


def rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def reference(q, k, v):
    group = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(qd[:1], kd[:1], vd[:1], is_causal=True).transpose(1, 2)


def host_us(fn, calls=50):
    """Host microseconds per call with the GPU busy (a long sleep queued first): launch cost alone."""
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return spent


def main(path):
    results = []
    for d, hq, hkv in SHAPES:
        torch.manual_seed(d + hkv)
        q = torch.randn(B, N, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, N, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cfg = gluon_config(d, True)
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(B, hq, N, device="cuda", dtype=torch.float32)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        runs = {
            "api": lambda: flash_attn_func(q, k, v, causal=True),
            "direct": lambda: gluon_forward(q, k, v, causal=True, config=cfg),
            "direct-out": lambda: gluon_forward(q, k, v, causal=True, config=cfg, out=out, lse=lse),
            "cudnn": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=hkv != hq),
        }
        ref = reference(q, k, v)
        errors = {}
        for name, fn in runs.items():
            out.fill_(float("nan"))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                got = fn()
            got = got[0] if isinstance(got, tuple) else got
            if name == "cudnn":
                got = got.transpose(1, 2)
            errors[name] = rel(got[:1], ref)
        flops = 4 * B * hq * N * N * d / 2
        times = {name: [] for name in runs}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(3):
                for name, fn in runs.items():
                    times[name].append(harness.time_ms(fn, "cuda").ms)
            hosts = {name: host_us(fn) for name, fn in runs.items()}
        row = dict(D=d, Hq=hq, Hkv=hkv, N=N, B=B, config=str(cfg), errors=errors, ms=times, host_us=hosts,
                   tflops={name: [round(flops / t / 1e9, 1) for t in ts] for name, ts in times.items()})
        print(json.dumps(row), flush=True)
        results.append(row)
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=results), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
