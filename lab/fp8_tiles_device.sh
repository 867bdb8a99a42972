#!/usr/bin/env bash
# fp8 decode tiles on the device in one call (< 5 minutes): the GPU tests of the paged kernel and fp8 caches
# (paired whole tiles included; 4 pytest workers, so the fp8 engine's test has the memory it needs), then
# lab/fp8_tiles.py (decode configurations over an fp8 cache beside the bf16 default).
# From the repository root on the device:   OUT=/tmp/out bash lab/fp8_tiles_device.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/device_log.sh" fp8-tiles.log
fp8_gpu_tests 170 4  # 4 workers: with 8 the fp8 engine's test ran out of memory on an H100
step "1. decode tiles over an fp8 cache"
timeout 300 python3 lab/fp8_tiles.py > "$OUT/fp8-tiles.txt" 2>&1
echo "fp8_tiles exit $?"
python3 - "$OUT/fp8-tiles.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = r.get("config") or {}
    print(f"B{r['B']:<4} L{r['L']:<7} {r['cache']:<9} n{c.get('block_n')} w{c.get('num_warps')} r{c.get('maxnreg')} "
          f"{'paired' if c.get('paired_tiles') else 'single'} splits {r.get('splits')} {r.get('us', float('nan')):9.1f} us "
          f"{r.get('tbps', float('nan')):5.2f} TB/s err {r.get('error', float('nan')):.2e} {r.get('status', '')}")
PY
step "done"
