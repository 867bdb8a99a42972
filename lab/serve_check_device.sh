#!/usr/bin/env bash
# Question (W2 6/7): does `ioattn serve` keep >= 0.9 of the offline engine's output throughput in a second,
# independent launch (the ratio moved 0.76-1.07 between runs: the step rate is set by the host's work), and do the
# GPU tests of the engine, the models, MLA and the benches pass on the current tree?
#
# One device call, under 9 minutes: 1. `bench serve --launch --offline` as lab/serve_h200.sh's stage 1 (~2.5 min);
# 2. the gpu-marked tests of tests/engine, tests/models, tests/kernels/test_mla.py and tests/bench (4 workers).
# On the device, from the repository root, with the server's wheels in .whl/ (lab/serve_h200.sh lists them, plus
# opentelemetry-api 1.45.2): bash lab/serve_check_device.sh -> $OUT/{serve-check.log,ratio.json,ratio.log,gpu-tests.txt}
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
source lab/device_log.sh serve-check.log

step "1. server / offline, same run"
timeout 240 python3 -m ioattn.cli bench serve --launch --offline --model llama3-8b-shape --input-len 100 1024 \
  --output-len 256 --decode-batch 0 --launch-timeout 200 --num-prompts 256 --json "$OUT/ratio.json" \
  > "$OUT/ratio.log" 2>&1 || echo "   stage 1 exit $? (see ratio.log)"
grep -E "Output token throughput|step_|server / offline" "$OUT/ratio.log"

step "2. GPU tests: engine, models, MLA, benches"
timeout 280 python3 -m pytest -q -n 4 -m gpu -rfE --tb=short -p no:warnings -p no:cacheprovider \
    tests/engine tests/models tests/kernels/test_mla.py tests/bench > "$OUT/gpu-tests.txt" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.txt" | tail -15
step "done"
