"""`ioattn demo | bench NAME | explain` — the command-line front of the library.

`ioattn bench NAME ...` runs `ioattn.bench.NAME.main(argv)`: each benchmark is one module with its own flags.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def _benchmarks() -> list[str]:
    import ioattn.bench

    skip = {"harness", "plot"}
    return sorted(m.name for m in pkgutil.iter_modules(ioattn.bench.__path__) if m.name not in skip)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="ioattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the README's main job: exactness of every kernel path, then a quick benchmark")
    bench = sub.add_parser("bench", help="run a benchmark: " + ", ".join(_benchmarks()), add_help=False)
    bench.add_argument("name", choices=_benchmarks())
    explain = sub.add_parser("explain", help="which kernel runs for a shape, and why")
    explain.add_argument("--batch", type=int, default=1)
    explain.add_argument("--seqlen-q", type=int, default=4096)
    explain.add_argument("--seqlen-k", type=int, default=None)
    explain.add_argument("--heads-q", type=int, default=16)
    explain.add_argument("--heads-kv", type=int, default=None)
    explain.add_argument("--head-dim", type=int, default=128)
    explain.add_argument("--dtype", default="bfloat16")
    explain.add_argument("--causal", action="store_true")
    explain.add_argument("--device", default=None)
    args, rest = parser.parse_known_args(argv)

    if args.command == "bench":
        return importlib.import_module(f"ioattn.bench.{args.name}").main(rest) or 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from ioattn.demo import main as demo_main

        return demo_main() or 0
    if args.command == "explain":
        import torch

        import ioattn

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, args.dtype)
        n_k = args.seqlen_k or args.seqlen_q
        h_kv = args.heads_kv or args.heads_q
        q = torch.empty(args.batch, args.seqlen_q, args.heads_q, args.head_dim, dtype=dtype, device=device)
        k = torch.empty(args.batch, n_k, h_kv, args.head_dim, dtype=dtype, device=device)
        print(ioattn.explain(q, k, k, causal=args.causal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
