"""What does launching the Gluon forward cost the host, and how much of it is Triton's JIT dispatch (binding ~45
arguments, their specialization key, the cache lookup) rather than the driver launch? The public call's host time
(bench/results/2026-12-07-host-path-h100: 167 µs, ~65 of them Triton's launch of the Gluon kernel) leaves the GPU
idle inside `do_bench`'s timed region wherever it outlasts the 256 MB L2 flush (~85 µs).

Causal D 128 and D 64 at N 2k, bf16, B·N 16k: host µs per call (the GPU held busy, so launches queue) of
`launch_dense` as the dispatch calls it; of `gluon_fwd_kernel[grid](...)` with the arguments built beforehand;
of the CompiledKernel that call returns, called directly (`compiled[grid](*all_args)`, no binder); of the
driver launch alone (`compiled.run` with the launch metadata built beforehand); and of torch cuDNN. Each
direct path's output is compared with the JIT launch's. Then a cProfile of `launch_dense`: where its host time
beyond the JIT launch goes.

    PYTHONPATH=. python3 lab/launch_cost.py OUT.json   (sm_90 only)
"""
import inspect
import json
import sys

import torch
import torch.nn.functional as F
import triton

from host_parts import host_us_rounds
from ioattn.ops.gluon_forward import BLOCK_M, _descriptor, _grid, gluon_config, launch_dense, separate_o


def host_us(fn, calls=200):
    """Host microseconds per call, the best of a few rounds with the GPU busy (`host_parts.host_us_rounds`)."""
    return min(host_us_rounds(fn, calls=calls, rounds=5, busy_cycles=400_000_000))


def _profile(fn, calls=300) -> str:
    """cProfile of `calls` calls of `fn` (the GPU busy, launches queueing): the 25 functions of most own time."""
    import cProfile
    import io
    import pstats

    torch.cuda._sleep(2_000_000_000)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def main():
    from triton.runtime import driver

    from ioattn.kernels.gluon_fwd import LOG2E, gluon_fwd_kernel

    result = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for d in (128, 64):
        heads, n = 2048 // d, 2048
        q, k, v = (torch.randn(8, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(8, heads, n, device="cuda", dtype=torch.float32)
        cfg = gluon_config(d, masked=True)
        m_blocks = triton.cdiv(n, cfg.consumers * BLOCK_M)
        grid = _grid(cfg, q.device, 8 * heads * m_blocks)
        args = (_descriptor(q, BLOCK_M), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
                _descriptor(out, BLOCK_M), lse, n, n, heads, 1, 8 * heads, m_blocks, 0, 0, d ** -0.5 * LOG2E)
        constexprs = dict(LEFT=False, RIGHT=True, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                          RESCALE_THRESHOLD=cfg.rescale_threshold, PINGPONG=cfg.pingpong,
                          CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
                          SEPARATE_O=separate_o(d, cfg, 2), BAND=cfg.band, CONSUMERS=cfg.consumers, SNAKE=cfg.snake,
                          OVERLAP=cfg.overlap)
        options = dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)
        compiled = gluon_fwd_kernel[grid](*args, **constexprs, **options)
        torch.cuda.synchronize()
        expected = out.clone()
        bound = inspect.signature(gluon_fwd_kernel.fn).bind(*args, **constexprs)
        bound.apply_defaults()
        all_args = list(bound.arguments.values())
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        full_grid = (*grid, 1, 1)[:3]
        metadata = compiled.launch_metadata(full_grid, stream, *all_args)

        def driver_only():
            compiled.run(*full_grid, stream, compiled.function, compiled.packed_metadata, metadata, None, None,
                         *all_args)

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        parts = {
            "launch_dense": lambda: launch_dense(q, k, v, -1, 0, d ** -0.5, out, lse, cfg),
            "jit launch, arguments built": lambda: gluon_fwd_kernel[grid](*args, **constexprs, **options),
            "CompiledKernel[grid](*args)": lambda: compiled[full_grid](*all_args),
            "driver launch alone": driver_only,
            "4 descriptors": lambda: [_descriptor(t, r) for t, r in ((q, BLOCK_M), (k, cfg.block_n), (v, cfg.block_n),
                                                                   (out, BLOCK_M))],
            "cudnn sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
        }
        row = {"D": d, "N": n, "host_us": {}, "equal": {}}
        for name, fn in parts.items():
            if name in ("CompiledKernel[grid](*args)", "driver launch alone"):
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row["equal"][name] = bool(torch.equal(out, expected))
            row["host_us"][name] = host_us(fn)
            print(f"D {d} N {n} {name:30s} {row['host_us'][name]:7.1f} us"
                  + (f"  output equal: {row['equal'][name]}" if name in row["equal"] else ""), flush=True)
        row["profile"] = _profile(parts["launch_dense"])
        print(row["profile"], flush=True)
        result["rows"].append(row)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
