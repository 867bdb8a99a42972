#!/usr/bin/env bash
# Wave 2's closing device call (< 10 minutes, each step with its own hard timeout), on the final code:
#   1. every GPU test of the suite (`pytest -m gpu`; kernels and ops on 12 workers, the rest on 4): the kernel
#      matrix, fp8 kernels and engine, CUDA graphs, no compile while serving, model parity on CUDA      <= 260 s
#   2. W2 6/7's bar: `bench serve --launch --offline` on llama3-8b-shape, 256 requests, prompts 100-1024, outputs
#      256: the server (HTTP process + engine process) and then LLM.generate, in the same run            <= 180 s
#   3. lab/fp8_tiles.py: five other decode tiles for an fp8 cache beside the default                      <= 60 s
#   4. W2 4/7's bar: `bench decode --kv-cache-dtype fp8_e4m3` beside bf16 ioattn-paged, torch CUDNN and FLASH,
#      FIRST_DECODE=1: all 34 rows, cut by --budget-s; else the 32/8 rows the first call did not reach (B256 L32k,
#      B1 L128k)
# Needs the server's wheels in .whl/ (carried; the list is lab/serve_h200.sh's). From the repository root:
#   OUT=/tmp/out bash lab/w2_check_h200.sh       (the first call of 2026-12-02 ran it with FIRST_DECODE=1)
set -u
FIRST_DECODE=${FIRST_DECODE:-0}
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" w2-check.log

step "1a. GPU tests: kernels and ops"
timeout 150 python3 -m pytest -q -n 12 -m gpu -rfE --tb=short -p no:warnings -p no:cacheprovider tests/kernels \
    tests/ops --junitxml="$OUT/gpu-tests-kernels-ops.xml" > "$OUT/gpu-tests-kernels-ops.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests-kernels-ops.txt" | tail -15
step "1b. GPU tests: the rest (engine, models, bench, demo; 4 workers: pool sizing reads free memory)"
timeout 110 python3 -m pytest -q -n 4 -m gpu -rfE --tb=short -p no:warnings -p no:cacheprovider tests \
    --ignore=tests/kernels --ignore=tests/ops --junitxml="$OUT/gpu-tests-rest.xml" > "$OUT/gpu-tests-rest.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests-rest.txt" | tail -15

step "2. server / offline, same run"
timeout 180 python3 -m ioattn.cli bench serve --launch --offline --model llama3-8b-shape --input-len 100 1024 \
    --output-len 256 --decode-batch 0 --launch-timeout 150 --num-prompts 256 --json "$OUT/ratio.json" \
    > "$OUT/ratio.log" 2>&1
echo "bench serve exit $?"; tail -n 25 "$OUT/ratio.log"

step "3. fp8 decode tiles"
timeout 60 python3 lab/fp8_tiles.py > "$OUT/fp8-tiles.txt" 2>&1
echo "fp8 tiles exit $?"; cut -c1-220 "$OUT/fp8-tiles.txt" | tail -21

decode() {  # name, budget, then the case flags
    local name=$1 budget=$2; shift 2
    timeout $(( budget + 40 )) python3 -m ioattn.cli bench decode --kv-cache-dtype fp8_e4m3 \
        --backends ioattn-paged,torch-cudnn,torch-flash --head-dim 128 --no-prefill --budget-s "$budget" "$@" \
        --json "$OUT/$name.json" --md "$OUT/$name.md" > "$OUT/$name.txt" 2>&1
    echo "bench decode $name exit $?"; grep -E "ioattn-paged|cudnn" "$OUT/$name.txt" | tail -24
}
if [ "$FIRST_DECODE" = 1 ]; then
    step "4. bench decode, every row"
    decode fp8-decode-h200 110 --batches 1,8,64,256 --seqlens 1024,4096,16384,32768 --long-seqlens 131072 \
        --heads 32/8,32/32
else
    step "4. bench decode, the rest of 32/8"
    decode fp8-decode-32-8-rest-h200 25 --batches 256 --seqlens 32768 --long-seqlens 131072 --heads 32/8
fi
step "done"
