#!/usr/bin/env bash
# One device call for what this tree needs run (< 10 minutes, each part under its own timeout):
#   1. lab/gluon_fwd_device.sh: the Gluon forward's GPU tests and its bench beside the Triton forward and cuDNN
#      (W2 5/7)                                                                                        <= 150 + 170 s
#   2. on an H200 only, lab/gluon_decode_device.sh: the fp8 decode bar's H200 run (W2 4/7)                  <= 120 s
# Everything comes back as one archive, $OUT/session.tgz (the device returns 8 files), beside session.log.
# From the repository root on the device:   OUT=/tmp/out bash lab/session_device.sh
set -u
OUT=${OUT:-/tmp/out}
lab=$(dirname "$0")
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
parts=(fwd)
OUT="$OUT/fwd" TESTS_S=150 BENCH_S=170 timeout 330 bash "$lab/gluon_fwd_device.sh"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    parts+=(decode)
    OUT="$OUT/decode" timeout 120 bash "$lab/gluon_decode_device.sh"
else
    echo "not an H200: the fp8 decode bar's H200 run is left out"
fi
tar czf "$OUT/session.tgz" -C "$OUT" "${parts[@]}" && rm -rf "${parts[@]/#/$OUT/}"
