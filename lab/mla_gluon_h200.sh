#!/usr/bin/env bash
# W2 7/7 and 5/7 on the H200 in one device call (< 10 minutes, each stage with its own hard timeout): what stop 25
# and this tree built but no GPU has run yet.
#   1. GPU tests of the MLA kernel, the Gluon forward and the engine's GPU file (tiny-mla: no kernel compiles
#      while serving; no transformers needed on the device)                                                <= 170 s
#   2. `bench decode --mla` (DeepSeek-V3 latent 512 + 64; 16 and 128 heads, B 1-128, L 1k-32k) beside the torch
#      peers, against the copy and matmul ceilings of the same run; the issue's bars per row                  <= 160 s
#   3. serving, offline, 256 requests of 100-1024 prompt / 256 output tokens: deepseek-v2-lite-shape (MLA, latent
#      cache) and llama3.2-3b-shape (GQA 24/8): output tok/s, KV bytes per token, pool tokens, the requests the
#      pool holds                                                                                              <= 2 x 90 s
#   4. lab/gluon_fwd_bench.py: the Gluon forward's exactness and speed beside the Triton forward and cuDNN       <= 75 s
# From the repository root on the device (no wheels needed):
#   OUT=/tmp/out bash lab/mla_gluon_h200.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" mla-gluon.log

step "1. GPU tests: MLA kernel, Gluon forward, engine"
timeout 170 python3 -m pytest -q -n 8 -m gpu -rfE --tb=short -p no:warnings -p no:cacheprovider \
    tests/kernels/test_mla.py tests/kernels/test_gluon_fwd.py tests/engine/test_engine_gpu.py \
    --junitxml="$OUT/gpu-tests-mla-gluon.xml" > "$OUT/gpu-tests-mla-gluon.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests-mla-gluon.txt" | tail -15

step "2. bench decode --mla"
timeout 160 python3 -m ioattn.cli bench decode --mla --budget-s 120 --json "$OUT/mla-decode-h200.json" \
    --md "$OUT/mla-decode-h200.md" > "$OUT/mla-decode.txt" 2>&1
echo "bench decode --mla exit $?"; grep -E "ioattn-mla" "$OUT/mla-decode.txt" | cut -c1-200 | tail -40

for model in deepseek-v2-lite-shape llama3.2-3b-shape; do
    step "3. serving $model"
    timeout 90 python3 -m ioattn.cli bench serve --compare ioattn --model "$model" --num-requests 256 \
        --input-len 100 1024 --output-len 256 --max-model-len 2048 --decode-batch 0 \
        --json "$OUT/serve-$model-h200.json" \
        > "$OUT/serve-$model.txt" 2>&1
    echo "bench serve $model exit $?"
    grep -E "Output token throughput|Median TPOT|kv_|requests_in_pool|running_peak|preemptions" "$OUT/serve-$model.txt"
done

step "4. Gluon forward"
OUT="$OUT" timeout 75 python3 lab/gluon_fwd_bench.py --budget-s 60 > "$OUT/gluon-fwd.txt" 2>&1
echo "gluon_fwd_bench exit $?"; cut -c1-200 "$OUT/gluon-fwd.txt" | tail -20
step "done"
