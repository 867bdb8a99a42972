#!/usr/bin/env bash
# One device call (< 10 minutes) for what the open W2 issues lack, each part under its own timeout and skipped when
# the call's 560 s would not hold it. On an H200 the fp8 decode bar's rows come first (W2 4/7 lacks only its H200 run).
#   decode (H200 only): `ioattn bench decode --kv-cache-dtype fp8_e4m3` at the W2 4/7 bar's rows      <= 100 s
#   mla:    the Gluon MLA and paged decode GPU tests, then 128 heads on the seesaw schedule beside the lockstep
#           wgmma kernel, and 16 heads with split combines by dependent launch and in stream order (W2 7/7)  <= 250 s
#   fwd:    lab/gluon_fwd_device.sh: the Gluon forward's GPU tests and its bench beside the Triton forward and
#           cuDNN (W2 5/7), in what is left                                                             <= 300 s
# Everything comes back as one archive, $OUT/session.tgz (the device returns 8 files), beside session.log.
# From the repository root on the device:   OUT=/tmp/out bash lab/session_device.sh
set -u
OUT=${OUT:-/tmp/out}
root=$OUT
lab=$(dirname "$0")
mkdir -p "$root"
exec > >(tee -a "$root/session.log") 2>&1
export PYTHONPATH=. PYTHONUNBUFFERED=1
parts=()
run_part() {  # run_part NAME SECONDS COMMAND...: in $root/NAME, unless fewer than SECONDS are left of the 560
    local name=$1 seconds=$2
    shift 2
    if (( SECONDS + seconds > 560 )); then
        echo "== part $name left out: $seconds s do not fit after $SECONDS s"
        return
    fi
    echo "== part $name at $SECONDS s (<= $seconds s)"
    parts+=("$name")
    OUT="$root/$name" timeout "$seconds" "$@"
}
decode_bar() {
    source "$lab/device_log.sh" decode.log
    step "the fp8 decode bar's rows, beside bf16 and cuDNN"
    fp8_decode_bench 90
}
mla_parts() {
    source "$lab/device_log.sh" mla.log
    step "GPU tests: the Gluon MLA and paged decodes"
    gpu_tests 100 8 gpu-tests.txt tests/kernels/test_gluon_mla.py tests/kernels/test_gluon_paged.py
    step "128 heads: the seesaw schedule beside the lockstep wgmma kernel"
    GLUON_MLA="w64/2/0/1 s64/2/0/1" GLUON_MLA_HEADS=128 GLUON_MLA_JSON=gluon-mla-h128.json \
        GLUON_MLA_SHAPES="64x1024 64x4096 64x8192 128x4096 64x32768" timeout 80 python3 lab/gluon_mla.py 2>&1 \
        | grep -v Warning
    step "16 heads at the bar rows the split combine decides: by dependent launch, and in stream order"
    GLUON_MLA="64/2/0/1 64/2/0/1/ordered" GLUON_MLA_HEADS=16 GLUON_MLA_JSON=gluon-mla-h16.json \
        GLUON_MLA_SHAPES="64x1024 32x4096 8x8192 1x32768" timeout 60 python3 lab/gluon_mla.py 2>&1 | grep -v Warning
}
fwd_part() {  # the Gluon forward in what is left of the 560 s
    local left=$(( 560 - SECONDS - 10 ))
    if (( left < 150 )); then
        echo "== part fwd left out: $left s left"
        return
    fi
    run_part fwd "$left" env TESTS_S=$(( left * 2 / 5 )) BENCH_S=$(( left * 3 / 5 - 10 )) bash "$lab/gluon_fwd_device.sh"
}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    run_part decode 100 bash -c "$(declare -f decode_bar); lab=$lab; decode_bar"
else
    echo "not an H200: the fp8 decode bar's H200 run is left out"
fi
run_part mla 250 bash -c "$(declare -f mla_parts); lab=$lab; mla_parts"
fwd_part
tar czf "$root/session.tgz" -C "$root" "${parts[@]}" && rm -rf "${parts[@]/#/$root/}"
