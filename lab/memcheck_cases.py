"""Question: do the kernels touch memory outside their tensors on the layouts that used to fault (packed qkv/kv
views, varlen with windows, the paged kernels)? Run under `compute-sanitizer --tool memcheck` on the device:

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 lab/memcheck_cases.py

Each case is one of tests/kernels/test_kernel_matrix_gpu.py (forward and backward) or a paged call; the script
exits non-zero if a result is wrong, the sanitizer if any access is out of bounds.
"""

import sys

sys.path[:0] = ["tests", "tests/kernels"]

from op_fuzz_worker import run  # noqa: E402
from test_kernel_matrix_gpu import CASES  # noqa: E402

PAGED = [dict(op="paged_attention", seed=s, dtype="bfloat16", batch=3, seq_lens=[300, 17, 0], q_lens=q_lens, page=page,
              Hkv=2, group=4, D=128, window=list(window), sinks=sinks, splits=splits, gather=gather, table="ok",
              lens="ok", cu_q="ok")
         for s, (q_lens, page, window, sinks, splits, gather) in enumerate([
             (None, 16, (-1, -1), 0, 0, None), (None, 1, (64, -1), 4, 3, None), ([40, 17, 0], 16, (-1, -1), 0, 0, True),
             ([40, 3, 0], 64, (32, -1), 2, 1, False), (None, 256, (-1, -1), 0, 8, None)])]
CACHE_WRITES = [dict(op="reshape_and_cache", seed=0, dtype="bfloat16", page=16, Hkv=8, D=128, tokens=4, slots=slots,
                     slot_dtype="int64") for slots in ("ok", "padding")]


def main() -> int:
    picked = [c for c in CASES if c["D"] in (40, 64, 160, 192, 256)][:12] + PAGED + CACHE_WRITES
    failures = 0
    for case in picked:
        case = dict(case, device="cuda")
        if "Nq" in case:  # the sanitizer slows kernels ~100x: shorter sequences, same layouts
            case["Nq"], case["Nk"] = min(case["Nq"], 200), min(case["Nk"], 200)
        result = run(case)
        failures += result["outcome"] != "ok"
        print(case["op"], case.get("D"), case.get("layout"), result["outcome"], result["detail"][:300], flush=True)
    print(f"{len(picked)} cases, {failures} not ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
