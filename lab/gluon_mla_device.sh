#!/usr/bin/env bash
# The Gluon MLA decode on the device in one call (< 10 minutes): the GPU tests of the MLA kernels (and of the paged
# kernels, whose Gluon defaults changed), the Gluon variants beside the Triton MLA kernel at DeepSeek-V3's decode
# shapes (SWEEP=0 skips them), then `ioattn bench decode --mla` with the defaults (BENCH_HEADS, default 16; BENCH_S).
# From the repository root on the device:   OUT=/tmp/out bash lab/gluon_mla_device.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" gluon-mla.log
step "1. GPU tests: the Gluon and Triton MLA kernels, the paged kernels, the engine (tiny-mla decodes on Gluon)"
gpu_tests 150 8 gpu-tests.txt tests/kernels/test_gluon_mla.py tests/kernels/test_mla.py \
    tests/kernels/test_gluon_paged.py tests/kernels/test_paged.py
# the engines size their pools from the GPU's free memory: one at a time, with the GPU to themselves
gpu_tests 120 1 gpu-tests-engine.txt tests/engine/test_fp8_engine.py tests/engine/test_engine_gpu.py
if [ "${SWEEP:-1}" = 1 ]; then
step "2. Gluon MLA variants beside the Triton MLA kernel, 16 heads"
timeout 150 python3 lab/gluon_mla.py 2>&1 | grep -v Warning
step "2b. 128 heads: the wgmma variants (64 heads per program)"
GLUON_MLA="w64/2/0/1 w32/3/0/1 w32/2/0/1" GLUON_MLA_HEADS=128 GLUON_MLA_JSON=gluon-mla-h128.json \
    GLUON_MLA_SHAPES="64x1024 128x1024 64x8192 128x8192 64x32768" timeout 100 python3 lab/gluon_mla.py 2>&1 \
    | grep -v Warning
fi
heads=${BENCH_HEADS:-16}
step "3. ioattn bench decode --mla, $heads heads, the defaults"
timeout "${BENCH_S:-100}" python3 -m ioattn.cli bench decode --mla --heads "$heads" --budget-s $(( ${BENCH_S:-100} - 20 )) \
    --json "$OUT/mla-decode.json" > "$OUT/mla-decode.txt" 2>&1
echo "bench exit $?"; grep -E "^Bar" "$OUT/mla-decode.txt" | cut -c1-400
step "done"
