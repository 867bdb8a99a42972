#!/usr/bin/env bash
# W2 7/7 and 5/7 on the H200 in one device call (< 10 minutes), after the first GPU run of both (2026-12-05):
#   0. the Gluon forward as flash_attn_func's auto choice (GPU test), and the attention ops' GPU tests beside it
#   1. `bench decode --mla --tune` on the rows that missed the bars: every candidate config at 1, half, 1x and 2x
#      the heuristic's split count (extra.tune: the five fastest) at 16 heads (B·L >= 64k) and 128 heads (B >= 64)
#   2. lab/gluon_fwd_bench.py --variants --configs: D 64/128/256 rows beside the Triton forward and cuDNN, with
#      the kernel without ping-pong, with an unconditional rescale, and other (block_n, stages) per head dim
# From the repository root on the device:   OUT=/tmp/out bash lab/w2_tune_h200.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" w2-tune.log
step "0. GPU tests: Gluon dispatch (flash_attn_func / sdpa auto) and every attention-op GPU test beside it"
timeout 100 python3 -m pytest -q -n 8 -m gpu -rfE --tb=short -p no:warnings -p no:cacheprovider tests/ops \
    tests/kernels/test_gluon_fwd.py::test_auto_dispatch_runs_gluon_forward_and_triton_backward \
    > "$OUT/gpu-tests-dispatch.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests-dispatch.txt" | tail -15
TUNE=(bench decode --mla --tune --backends ioattn-mla --warmup-ms 10 --rep-ms 40)

step "1a. MLA tune, 16 heads"
timeout 120 python3 -m ioattn.cli "${TUNE[@]}" --heads 16 --batches 32,64,128 --seqlens 1024,4096 --budget-s 95 \
    --json "$OUT/mla-tune-h16.json" > "$OUT/mla-tune-h16.txt" 2>&1
echo "exit $?"; grep -E "ioattn-mla" "$OUT/mla-tune-h16.txt" | cut -c1-120 | tail -12
step "1b. MLA tune, 128 heads"
timeout 120 python3 -m ioattn.cli "${TUNE[@]}" --heads 128 --batches 64,128 --seqlens 1024,8192 --budget-s 95 \
    --json "$OUT/mla-tune-h128.json" > "$OUT/mla-tune-h128.txt" 2>&1
echo "exit $?"; grep -E "ioattn-mla" "$OUT/mla-tune-h128.txt" | cut -c1-120 | tail -12

step "2. Gluon forward: variants and tile shapes"
OUT="$OUT" timeout 200 python3 lab/gluon_fwd_bench.py --variants --configs --budget-s 175 > "$OUT/gluon-fwd.txt" 2>&1
echo "gluon_fwd_bench exit $?"; cut -c1-160 "$OUT/gluon-fwd.txt" | tail -8
step "done"
