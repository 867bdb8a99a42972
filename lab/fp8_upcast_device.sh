#!/usr/bin/env bash
# The fp8 decode's routes on the device in one call (< 9 minutes): the fp8 GPU tests (the conversions bit for bit
# over all 256 codes, NaN codes reaching the output, queries of any magnitude, every paged path with bf16 queries,
# the fp8 engine's graphs), lab/fp8_upcast.py (Triton's conversion against float16 dots, beside the bf16 cache),
# then the decode rows of W2 4/7's bar (B·L >= 64k, 32/8 heads) beside cuDNN.
# From the repository root on the device:   OUT=/tmp/out bash lab/fp8_upcast_device.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" fp8-upcast.log
fp8_gpu_tests 150 4  # 4 workers: with 8 the fp8 engine's test ran out of memory on an H100
step "1. fp8 decode: Triton's conversion against float16 dots"
timeout 120 python3 lab/fp8_upcast.py > "$OUT/fp8-upcast.txt" 2>&1
echo "fp8_upcast exit $?"
python3 - "$OUT/fp8-upcast.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(f"B{r['B']:<4} L{r['L']:<7} {r['cache']:<22} {r.get('us', float('nan')):9.1f} us "
          f"{r.get('tbps', float('nan')):5.2f} TB/s err {r.get('error', float('nan')):.2e} {r.get('status', '')}")
PY
step "2. ioattn bench decode, fp8 beside bf16 and cuDNN, the bar's rows"
fp8_decode_bench 250
step "done"
