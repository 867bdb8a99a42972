#!/usr/bin/env bash
# The Gluon paged decode on the device in one call (< 10 minutes): its variants beside the Triton kernel (HBM-bound
# shapes, then every sequence reading one L2-resident sequence: the kernels' own ceilings), the GPU tests of the
# paged kernels and fp8 caches, and `ioattn bench decode` over fp8 and bf16 caches at the W2 4/7 bar's rows.
# From the repository root on the device:   OUT=/tmp/out bash lab/gluon_decode_device.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" gluon-decode.log
# the default configuration and its conditional-rescale variant (block_n/stages/maxnreg/warps/threshold)
FP8="${GLUON_FP8:-64/2/96/4 64/2/96/4/8}"
BF16="${GLUON_BF16:-64/2/96/4 64/2/96/4/8}"
step "1. variants, HBM-bound"
GLUON_FP8="$FP8" GLUON_BF16="$BF16" timeout 150 python3 lab/gluon_decode.py 2>&1 | grep -v Warning
step "2. variants, L2-resident"
GLUON_L2=1 GLUON_FP8="$FP8" GLUON_BF16="$BF16" timeout 100 python3 lab/gluon_decode.py 2>&1 | grep -v Warning \
    | grep "B64 \|B256"
step "3. GPU tests: the Gluon decode, fp8 caches, the paged kernel, the fp8 engine"
gpu_tests 330 8 gpu-tests.txt tests/kernels/test_gluon_paged.py tests/kernels/test_paged_fp8.py \
    tests/kernels/test_paged.py tests/engine/test_fp8_engine.py
step "4. ioattn bench decode, fp8 beside bf16 and cuDNN, the bar's rows"
fp8_decode_bench 170
step "done"
