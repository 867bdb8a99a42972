#!/usr/bin/env bash
# FP8 serving on the device in one call (< 5 minutes): llama3-8b-shape, 128 requests of 4096-7936 prompt tokens and
# 256 output tokens, all at once, offline through ioattn.LLM with the cache in bf16 and in fp8_e4m3 (the pool's
# byte budget the same: fp8 holds twice the tokens; fp8 with the integer upcast and calibrated, rotated K and V).
# As lab/fp8_h200.sh's step 3, after the 2026-12-06 changes. From the repository root on the device:
#   OUT=/tmp/out bash lab/fp8_serve_device.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" fp8-serve.log
for kv in auto fp8_e4m3; do
    step "serve, llama3-8b-shape long context, kv cache $kv"
    timeout 130 python3 -m ioattn.cli bench serve --compare ioattn --model llama3-8b-shape --kv-cache-dtype "$kv" \
        --num-requests 128 --input-len 4096 7936 --output-len 256 --max-model-len 8192 --decode-batch 0 \
        --json "$OUT/fp8-serve-$kv.json" > "$OUT/fp8-serve-$kv.txt" 2>&1
    echo "bench serve ($kv) exit $?"; tail -8 "$OUT/fp8-serve-$kv.txt"
done
step "done"
