"""`ioattn bench tune`: time every candidate tile configuration of a kernel on the GPU and print the winners.

The winners go into the tuned tables by hand (`ioattn.ops.forward` and `ioattn.ops.backward`; the paged family is
tuned by `ioattn bench decode --tune`), so a table entry always traces back to a committed tuning run under
bench/results/.
Compiling a Triton kernel takes seconds and there are many candidates, so every candidate is first compiled in
parallel worker processes (they share Triton's on-disk cache), then timed one at a time in this process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path

import torch

from ioattn.bench.harness import attention_flops, collect_disclosure, time_ms


@dataclasses.dataclass(frozen=True)
class Shape:
    family: str  # "fwd" | "bwd"
    head_dim: int
    causal: bool
    seqlen: int
    dtype: str = "bfloat16"

    @property
    def batch(self) -> int:
        return max(1, 16384 // self.seqlen)  # B·N = 16k, as in the prefill benchmark

    @property
    def heads(self) -> int:
        return 2048 // self.head_dim  # H·D = 2048

    def flops(self) -> float:
        pass_ = "forward" if self.family == "fwd" else "backward"
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim,
                               causal=self.causal, pass_=pass_)


def candidates(shape: Shape) -> list:
    from ioattn.ops.tuning import candidate_configs

    return candidate_configs(shape.family, shape.head_dim, getattr(torch, shape.dtype))


def make_runner(shape: Shape, config):
    """A no-argument callable that runs the kernel once on random inputs of `shape` with `config`."""
    dtype = getattr(torch, shape.dtype)
    b, n, h, d = shape.batch, shape.seqlen, shape.heads, shape.head_dim
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    if shape.family == "fwd":
        # through the public path (checks, dispatch, autograd wrapper), so a winner is timed as users run it
        from ioattn.ops.attention import flash_attn_with_config

        return lambda: flash_attn_with_config(q, k, v, config, causal=shape.causal)
    import ioattn
    from ioattn.ops.backward import attention_bwd

    out, lse = ioattn.flash_attn_func(q, k, v, causal=shape.causal, return_lse=True)
    do = torch.randn_like(out)
    return lambda: attention_bwd(do, q, k, v, out, lse, scale=scale, causal=shape.causal, config=config)


def _compile_one(shape: Shape, index: int) -> str:
    """Worker: compile (by running once) candidate `index` of `shape`; returns "ok" or the error."""
    try:
        make_runner(shape, candidates(shape)[index])()
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # out of shared memory / registers: the candidate is dropped, with its reason
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def compile_all(shapes: list[Shape], workers: int) -> dict[tuple[Shape, int], str]:
    jobs = [(s, i) for s in shapes for i in range(len(candidates(s)))]
    print(f"compiling {len(jobs)} (shape, config) pairs in {workers} processes", flush=True)
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        results = dict(zip(jobs, pool.map(_compile_one, *zip(*jobs))))
    print(f"compiled in {time.perf_counter() - start:.0f}s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ioattn bench tune", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["fwd", "bwd"], nargs="+", default=["fwd"])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192])
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ioattn bench tune needs a CUDA device", file=sys.stderr)
        return 2
    causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    shapes = [Shape(f, d, c, n) for f in args.family for d in args.dims for c in causal for n in args.seqlens]
    compiled = compile_all(shapes, args.workers)
    results = []
    for shape in shapes:
        timed = []
        for index, config in enumerate(candidates(shape)):
            status = compiled[(shape, index)]
            if status == "ok":
                try:
                    ms = time_ms(make_runner(shape, config), "cuda").ms
                except Exception as exc:
                    status, ms = f"{type(exc).__name__}: {exc}"[:160], None
            else:
                ms = None
            tflops = None if ms is None else shape.flops() / ms / 1e9
            timed.append({"config": str(config), "repr": repr(config), "ms": ms, "tflops": tflops, "status": status})
        ranked = sorted((t for t in timed if t["ms"] is not None), key=lambda t: t["ms"])
        label = f"{shape.family} D={shape.head_dim} causal={shape.causal} N={shape.seqlen} B={shape.batch} H={shape.heads}"
        for t in ranked[:3]:
            print(f"{label}: {t['tflops']:7.1f} TFLOP/s {t['ms']:8.3f} ms  {t['repr']}", flush=True)
        if not ranked:
            print(f"{label}: no candidate ran; first error: {timed[0]['status'] if timed else 'no candidates'}")
        results.append({"shape": dataclasses.asdict(shape), "candidates": timed})
        torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"disclosure": collect_disclosure("cuda", "ioattn bench tune " + " ".join(argv or [])),
                   "results": results}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0
