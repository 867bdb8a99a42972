#!/usr/bin/env bash
# W2 7/7 follow-up in one short device call: the wgmma MLA kernel beside the Triton one at 128 heads and small
# batches (B 1-32, where the first sweep did not look), and the GPU tests that failed in the defaults call.
# From the repository root on the device:   OUT=/tmp/out bash lab/gluon_mla_small_device.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" gluon-mla-small.log
step "1. 128 heads, small batches: Triton beside the wgmma kernel"
GLUON_MLA="w64/2/0/1" GLUON_MLA_HEADS=128 GLUON_MLA_JSON=gluon-mla-h128-small.json \
    GLUON_MLA_SHAPES="1x1024 1x4096 1x8192 1x32768 8x1024 8x4096 8x32768" timeout 100 \
    python3 lab/gluon_mla.py 2>&1 | grep -v Warning
step "2. GPU tests: the default plan, and the engine's pool sizing alone (it failed beside seven other workers)"
gpu_tests 120 1 gpu-tests-small.txt \
    tests/kernels/test_gluon_mla.py::test_default_plan_takes_gluon_at_16_and_128_heads_on_sm90 \
    tests/engine/test_engine_gpu.py::test_pool_sized_from_gpu_memory_utilization_bf16
step "done"
