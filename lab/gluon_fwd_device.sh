#!/usr/bin/env bash
# W2 5/7: the Gluon forward on the device in one call (< 10 minutes): its GPU tests and the fp8 forward's (the
# same kernel), then lab/gluon_fwd_bench.py: the persistent grid beside one program per work tile, ioattn's Triton
# forward and cuDNN at B·N 16k, H·D 2048 (D 128, 64, 256; N 2k-16k; causal and not; GQA 16/4).
# From the repository root on the device:   OUT=/tmp/out bash lab/gluon_fwd_device.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" gluon-fwd.log
step "1. GPU tests: the Gluon forward, the fp8 forward"
gpu_tests "${TESTS_S:-200}" 8 gpu-tests.txt tests/kernels/test_gluon_fwd.py tests/kernels/test_fp8_forward.py
step "2. the Gluon forward beside its peers"
timeout "${BENCH_S:-300}" python3 lab/gluon_fwd_bench.py --head-dims "${HEAD_DIMS:-128,64,256}" \
    --budget-s $(( ${BENCH_S:-300} - 40 )) 2>&1 | grep -v Warning \
    | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line, end=''); continue
    print(f\"{r['backend']:15} D{r['D']} N{r['Nq']} {'causal' if r['causal'] else 'full  '} {r['Hq']}/{r['Hkv']} \"
          f\"{(r['tflops'] or 0):6.1f} TFLOP/s err {(r['rel_error'] or 0):.1e} {r['status'][:60]}\")"
step "done"
