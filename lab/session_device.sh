#!/usr/bin/env bash
# One device call (< 10 minutes) for what the open W2 issues lack, each part under its own timeout and skipped when
# the call's 560 s would not hold it. On an H200 the fp8 decode bar's rows come first (W2 4/7 lacks only its H200 run).
#   decode (H200 only): `ioattn bench decode --kv-cache-dtype fp8_e4m3` at the W2 4/7 bar's rows      <= 100 s
#   fwd:    lab/gluon_fwd_device.sh: the Gluon forward's GPU tests and its bench beside the Triton forward and
#           cuDNN (W2 5/7)                                                                       <= 245 s (H100: 330)
#   mla:    the Gluon MLA and paged decode GPU tests, then 128 heads on wgmma with and without the overlapped loop,
#           and 16 heads at the bar rows missed before the combine's dependent launch (W2 7/7)            <= 215 s
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
mla_overlap() {
    source "$lab/device_log.sh" mla.log
    step "GPU tests: the Gluon MLA and paged decodes (both now release the split combine early)"
    gpu_tests 70 8 gpu-tests.txt tests/kernels/test_gluon_mla.py tests/kernels/test_gluon_paged.py
    step "128 heads on wgmma: the default beside the overlapped loop"
    GLUON_MLA="w64/2/0/1 wo64/2/0/1 wo32/3/0/1 wo32/4/0/1" GLUON_MLA_HEADS=128 GLUON_MLA_JSON=gluon-mla-h128.json \
        GLUON_MLA_SHAPES="64x1024 64x4096 64x8192 128x8192 64x32768" timeout 105 python3 lab/gluon_mla.py \
        2>&1 | grep -v Warning
    step "16 heads at the bar rows it missed (2-16 splits: the combine now follows by dependent launch)"
    GLUON_MLA="64/2/0/1" GLUON_MLA_HEADS=16 GLUON_MLA_JSON=gluon-mla-h16.json \
        GLUON_MLA_SHAPES="64x1024 32x4096 8x8192 128x1024" timeout 35 python3 lab/gluon_mla.py 2>&1 | grep -v Warning
}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    run_part decode 100 bash -c "$(declare -f decode_bar); lab=$lab; decode_bar"
    run_part fwd 245 env TESTS_S=105 BENCH_S=130 bash "$lab/gluon_fwd_device.sh"
else
    echo "not an H200: the fp8 decode bar's H200 run is left out"
    run_part fwd 330 env TESTS_S=145 BENCH_S=175 bash "$lab/gluon_fwd_device.sh"
fi
run_part mla 215 bash -c "$(declare -f mla_overlap); lab=$lab; mla_overlap"
tar czf "$root/session.tgz" -C "$root" "${parts[@]}" && rm -rf "${parts[@]/#/$root/}"
