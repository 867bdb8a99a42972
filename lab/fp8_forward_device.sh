#!/usr/bin/env bash
# Question (W2 5/7, FP8 part): does the FP8 forward (e4m3 products, block scales, two-level accumulation) pass its
# GPU tests, and how fast is it against our bf16 forward and cuDNN at D 128 (bar: >= 1.6x our bf16 at N >= 4k)?
# Which launch tile suits it (sm_90 builds: 4 warps spill, 8 do not)?
#
# One device call (~5 min): 1. the fp8 forward's GPU tests; 2. `bench prefill` at D 128, N 4k/8k/16k, causal and
# not, GQA 1, B·N 16k, H·D 2048: ioattn (bf16), ioattn-fp8 (e4m3 inputs, the kernel alone), ioattn-fp8-quant
# (quantized in the call), torch-cudnn; 3. lab/fp8_forward_tiles.py: the fp8 kernel at other tiles on the same rows.
# On the device, from the repository root: bash lab/fp8_forward_device.sh -> $OUT/{fp8-forward.log,gpu-tests.txt,
# prefill-fp8.json,prefill-fp8.md,fp8-tiles.json}
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
source lab/device_log.sh fp8-forward.log

step "1. GPU tests: the fp8 forward, the Gluon forward"
timeout 150 python3 -m pytest -q -m gpu -rfE --tb=short -p no:warnings -p no:cacheprovider \
    -n 4 tests/kernels/test_fp8_forward.py tests/kernels/test_gluon_fwd.py > "$OUT/gpu-tests.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.txt" | tail -15

step "2. bench prefill: bf16 ioattn, fp8, fp8 with quantization, cuDNN"
timeout 200 python3 -m ioattn.cli bench prefill --dims 128 --seqlens 4096,8192,16384 --gqa 1 \
    --backends ioattn,ioattn-fp8,ioattn-fp8-quant,torch-cudnn --json "$OUT/prefill-fp8.json" \
    > "$OUT/prefill-fp8.md" 2>&1 || echo "   stage 2 exit $?"
tail -n 40 "$OUT/prefill-fp8.md"

step "3. fp8 tiles"
timeout 120 python3 lab/fp8_forward_tiles.py "$OUT/fp8-tiles.json" || echo "   stage 3 exit $?"
step "done"
