"""Where the host time of one attention call goes (cProfile over 200 calls, the GPU held busy so the launches
queue): the public flash_attn_func and gluon_forward at causal D 64/128 N 2k. Prints the top entries by total
and by cumulative time."""
import cProfile
import pstats
import sys

import torch

from ioattn import flash_attn_func
from ioattn.ops.gluon_forward import gluon_config, gluon_forward


def main():
    for d, h in ((128, 16), (64, 32)):
        q, k, v = (torch.randn(8, 2048, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cfg = gluon_config(d, True)
        for name, fn in (("api", lambda: flash_attn_func(q, k, v, causal=True)),
                         ("direct", lambda: gluon_forward(q, k, v, causal=True, config=cfg))):
            fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"===== D {d} {name}")
            stats = pstats.Stats(prof, stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
