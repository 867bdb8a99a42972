#!/usr/bin/env bash
# After the 2026-12-05 tuning run: the new defaults on the device in one call (< 8 minutes). GPU tests of the
# Gluon forward (now rescaling every tile) and the MLA kernel (3 stages, programs_per_sm splits), then the MLA
# rows that were tuned and the Gluon forward rows beside the Triton forward and cuDNN, with the defaults.
# From the repository root on the device:   OUT=/tmp/out bash lab/w2_defaults_h100.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" w2-defaults.log
step "0. GPU tests: Gluon forward, MLA kernel, attention ops"
timeout 170 python3 -m pytest -q -n 8 -m gpu -rfE --tb=short -p no:warnings -p no:cacheprovider \
    tests/kernels/test_gluon_fwd.py tests/kernels/test_mla.py tests/ops > "$OUT/gpu-tests.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.txt" | tail -15
MLA=(bench decode --mla --backends ioattn-mla,torch-absorbed-sdpa --warmup-ms 10 --rep-ms 40)
step "1a. MLA defaults, 16 heads"
timeout 90 python3 -m ioattn.cli "${MLA[@]}" --heads 16 --batches 32,64,128 --seqlens 1024,4096 \
    --json "$OUT/mla-h16.json" > "$OUT/mla-h16.txt" 2>&1
echo "exit $?"; grep -E "^\| 16 .*ioattn-mla" "$OUT/mla-h16.txt" | cut -c1-110
step "1b. MLA defaults, 128 heads"
timeout 90 python3 -m ioattn.cli "${MLA[@]}" --heads 128 --batches 64,128 --seqlens 1024,8192 \
    --json "$OUT/mla-h128.json" > "$OUT/mla-h128.txt" 2>&1
echo "exit $?"; grep -E "^\| 128 .*ioattn-mla" "$OUT/mla-h128.txt" | cut -c1-110
step "2. Gluon forward with its defaults"
OUT="$OUT" timeout 120 python3 lab/gluon_fwd_bench.py --budget-s 100 > "$OUT/gluon-fwd.txt" 2>&1
echo "gluon_fwd_bench exit $?"
step "done"
