#!/usr/bin/env bash
# The device-machine runs behind bench/results/, one stage per call (each fits the 10-minute limit).
# Usage on the device (repo root, the image's python3): bash bench/h200.sh STAGE; results land in $OUT.
#   tests     every `gpu` test (bf16 included), 12 workers
#   tune      forward + backward tile candidates at D 64/128/256
#   prefill   the forward sweep of `ioattn bench prefill` (every peer)
#   backward  `ioattn bench prefill --backward`
#   decode    `ioattn bench decode` (32/8 and 32/32) with chunked prefill
#   serve     `ioattn bench serve --compare ioattn,static,hf` on llama3-8b-shape (output 256 tokens each)
#   serve-uniform  ours vs the static baseline with output lengths uniform in 1..512 (the same mean)
#   server    `ioattn bench serve --launch --offline`: the HTTP server against LLM.generate (needs the
#             server's wheels in .whl/, carried: fastapi, starlette, pydantic, uvicorn and their needs)
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/ioattn-out}
mkdir -p "$OUT"
case "${1:?stage: tests | tune | prefill | backward | decode | serve | serve-uniform | server}" in
  tests) python3 -m pytest -q -n 12 -m gpu -p no:warnings tests 2>&1 | tail -40 ;;
  tune) python3 -m ioattn.cli bench tune --family fwd bwd --dims 64 128 256 --seqlens 2048 16384 --json "$OUT/tune.json" ;;
  prefill) python3 -m ioattn.cli bench prefill --budget-s 480 --out "$OUT" ;;
  backward) python3 -m ioattn.cli bench prefill --backward --budget-s 480 --out "$OUT" ;;
  decode) python3 -m ioattn.cli bench decode --budget-s 480 --out "$OUT" ;;
  serve) python3 -m ioattn.cli bench serve --compare ioattn,static,hf --model llama3-8b-shape --out "$OUT" ;;
  serve-uniform) python3 -m ioattn.cli bench serve --compare ioattn,static --output-len 1 512 --decode-batch 0 \
    --model llama3-8b-shape --json "$OUT/serve-uniform.json" ;;
  server)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=.:/tmp/site
    python3 -m ioattn.cli bench serve --launch --offline --decode-batch 0 --model llama3-8b-shape \
      --json "$OUT/server.json" ;;
  *) echo "unknown stage: $1" >&2; exit 2 ;;
esac
