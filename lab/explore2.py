"""Device exploration 2: register caps for the paged kernels, pointer-load forward tiles, backward stages.

PYTHONPATH=. python3 lab/explore2.py [sections]; writes $OUT/explore2.json (same checks as explore1).
Results: bench/results/2026-12-01-explore2-h200.json.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import explore1 as e1  # noqa: E402

from ioattn.kernels.combine import combine_splits_kernel  # noqa: E402
from ioattn.ops.backward import BwdConfig as B  # noqa: E402
from ioattn.ops.forward import FwdConfig as F  # noqa: E402
from ioattn.ops.paged import PagedConfig as C  # noqa: E402

DECODE_SHAPES = [(1, 512), (3, 256)] if e1.TINY else [(1, 32768), (1, 131072), (8, 32768), (64, 1024), (256, 1024),
                                                      (64, 4096)]


def decode_configs():
    return {
        "base": C(16, 64, 4, 2),
        "n64w4s2r96": C(16, 64, 4, 2, maxnreg=96),
        "n64w4s2r80": C(16, 64, 4, 2, maxnreg=80),
        "n32w4s2r80": C(16, 32, 4, 2, maxnreg=80),
        "n32w4s2r64": C(16, 32, 4, 2, maxnreg=64),
        "n128w4s2": C(16, 128, 4, 2),
        "n128w4s2r128": C(16, 128, 4, 2, maxnreg=128),
        "n128w8s2": C(16, 128, 8, 2),
        "n128w8s2r80": C(16, 128, 8, 2, maxnreg=80),
        "n128w8s2r64": C(16, 128, 8, 2, maxnreg=64),
        "n64w8s2r64": C(16, 64, 8, 2, maxnreg=64),
    }


SPLIT_SWEEP_CONFIGS = ("base", "n64w4s2r80", "n128w8s2r80", "n32w4s2r64")
SPLIT_SWEEP = (3,) if e1.TINY else (24, 48, 66, 99)


def combine_section():
    """The second launch of an unfused split: the combine kernel alone at B=1, 32 heads (launched as
    `ioattn.ops.paged.paged_attention` launches it in stream order: no public call runs it alone)."""
    for splits in (16, 33, 66, 99):
        po = torch.randn(splits, 1, 32, 128, device=e1.DEV)
        pl = torch.randn(splits, 1, 32, device=e1.DEV)
        out = torch.empty(1, 32, 128, dtype=e1.BF16, device=e1.DEV)
        lse = torch.empty(1, 32, device=e1.DEV)

        def run():
            combine_splits_kernel[(1, 32)](po, pl, out, lse, splits, po.stride(0), po.stride(1), po.stride(2),
                                          pl.stride(0), pl.stride(1), pl.stride(2), out.stride(0), out.stride(1),
                                          lse.stride(0), lse.stride(1), HEAD_DIM=128, BLOCK_D=128,
                                          BLOCK_S=1 << (splits - 1).bit_length())
        ms, how = e1.timed(run)
        e1.RESULTS.setdefault("combine", []).append({"splits": splits, "us": ms * 1e3, "how": how})
        e1.save()


def prefill_configs():
    return {
        "m128n64w8s2": C(128, 64, 8, 2),
        "m128n128w8s2": C(128, 128, 8, 2),
        "m128n64w8s2r128": C(128, 64, 8, 2, maxnreg=128),
        "m128n128w8s2r128": C(128, 128, 8, 2, maxnreg=128),
        "m128n64w8s3r128": C(128, 64, 8, 3, maxnreg=128),
        "m64n64w4s2r168": C(64, 64, 4, 2, maxnreg=168),
        "m256n64w8s2": C(256, 64, 8, 2),
        "m128n64w4s2r255": C(128, 64, 4, 2, maxnreg=255),
    }


def fwd_cases():
    if e1.TINY:
        return [(64, 128, c, [F(32, 32, 4, 1, tma=False)]) for c in (False, True)]
    return [
        (64, 2048, False, [F(128, 128, 4, 3), F(128, 64, 4, 3, tma=False), F(128, 64, 4, 4, tma=False),
                           F(128, 128, 4, 4, tma=False), F(128, 64, 8, 3, tma=False), F(64, 64, 4, 3, tma=False),
                           F(64, 128, 4, 3, tma=False), F(128, 64, 4, 3), F(128, 32, 4, 3, tma=False)]),
        (64, 2048, True, [F(64, 64, 4, 2), F(64, 64, 4, 3, tma=False), F(64, 64, 4, 4, tma=False),
                          F(128, 64, 4, 3, tma=False), F(64, 64, 4, 3), F(64, 32, 4, 3, tma=False),
                          F(128, 64, 8, 3, tma=False)]),
        (64, 4096, False, [F(128, 128, 4, 3), F(128, 64, 4, 3, tma=False)]),
        (64, 4096, True, [F(64, 128, 4, 2), F(64, 64, 4, 3, tma=False), F(128, 64, 4, 3, tma=False)]),
    ]


def bwd_configs():
    return {64: [B(64, 64, 64, 64, 4, 3, False), B(64, 64, 64, 64, 4, 4, False), B(128, 64, 128, 64, 8, 3, False),
                 B(128, 64, 128, 64, 8, 4, False)],
            128: [B(128, 64, 128, 64, 8, 3, False), B(128, 64, 128, 64, 8, 4, False), B(64, 64, 64, 64, 8, 4, False)]}


def bwd_section():
    e1.bwd_section(bwd_configs(), [(64, 16384, False), (64, 16384, True), (64, 2048, False), (128, 2048, False),
                                   (128, 2048, True), (128, 4096, True)])


if __name__ == "__main__":
    e1.save_as("explore2")
    e1.RESULTS["name"] = "explore2"
    e1.DECODE_SHAPES, e1.decode_configs = DECODE_SHAPES, decode_configs
    e1.SPLIT_SWEEP_CONFIGS, e1.SPLIT_SWEEP = SPLIT_SWEEP_CONFIGS, SPLIT_SWEEP
    sections = sys.argv[1:] or ["decode", "combine", "prefill", "fwd", "bwd"]
    e1.RESULTS["disclosure"] = e1.harness.collect_disclosure(e1.DEV, "lab/explore2.py " + " ".join(sections))
    e1.RESULTS["ceilings"] = e1.harness.measure_ceilings(e1.DEV, [e1.BF16])
    e1.save()
    table = {"decode": e1.decode_section, "combine": combine_section, "prefill": None, "fwd": None, "bwd": bwd_section}
    for section in sections:
        t = time.time()
        try:
            if section == "prefill":
                e1.prefill_section(configs=prefill_configs())
            elif section == "fwd":
                e1.fwd_section(cases=fwd_cases())
            else:
                table[section]()
        except Exception as exc:  # noqa: BLE001
            e1.record_error(section, "section", exc)
        e1.RESULTS[f"{section}_seconds"] = time.time() - t
        e1.save()
    print({k: round(v) for k, v in e1.RESULTS.items() if k.endswith("_seconds")})
