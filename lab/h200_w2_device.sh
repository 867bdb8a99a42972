#!/usr/bin/env bash
# The H200 runs that W2 4/7 and 7/7 still lack, in one device call (< 10 minutes; each part under its own timeout):
#   1. lab/gluon_decode_device.sh: the Gluon paged decode's variants, the GPU tests of the paged kernels and fp8
#      caches, `ioattn bench decode --kv-cache-dtype fp8_e4m3` at the W2 4/7 bar's rows                   <= 270 s
#   2. lab/gluon_mla_device.sh without the sweep: the MLA GPU tests, `bench decode --mla` at 16 and 128 heads  <= 230 s
#   3. lab/gluon_mla_small_device.sh: 128 heads at B 1 and 8, Triton beside the wgmma kernel                   <= 60 s
# Each part writes into its own folder; they come back as one archive, $OUT/h200-w2.tgz (the device returns 8 files).
# From the repository root on the device:   OUT=/tmp/out bash lab/h200_w2_device.sh
set -u
OUT=${OUT:-/tmp/out}
lab=$(dirname "$0")
OUT="$OUT/decode" timeout 270 bash "$lab/gluon_decode_device.sh"
OUT="$OUT/mla" SWEEP=0 BENCH_HEADS=16,128 BENCH_S=110 timeout 230 bash "$lab/gluon_mla_device.sh"
OUT="$OUT/mla-small" timeout 60 bash "$lab/gluon_mla_small_device.sh"
tar czf "$OUT/h200-w2.tgz" -C "$OUT" decode mla mla-small && rm -rf "$OUT/decode" "$OUT/mla" "$OUT/mla-small"
