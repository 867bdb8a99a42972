#!/usr/bin/env bash
# Question (W2 6/7): with the engine in its own process, does `ioattn serve` deliver >= 0.9 of the offline engine's
# output throughput on the same workload, and how do TTFT and TPOT grow with the request rate?
#
# One device call, under 9 minutes (each stage has its own timeout; together 530 s):
#   1. ratio  `bench serve --launch --offline`, llama3-8b-shape, 256 requests, prompts 100-1024, outputs 256: the
#             server (HTTP process + engine process) and then LLM.generate, in the same run (~2.5 min: a cold
#             launch with kernel compiles and CUDA graphs, 10-20 s of serving, the offline engine's start, ~10 s).
#   2. sweep  the same shapes at 2, 4, 8, 16, 32 req/s and inf against one launched server, with goodput at
#             TTFT <= 2 s and TPOT <= 50 ms. 160 prompts per rate, not the 1000: a rate-r run lasts about
#             N / r s plus its last requests' latency (~8 s at 30 ms TPOT), so 1000 prompts would take 500 s at
#             2 req/s alone; 160 take ~80 + 40 + 20 + 10 + 5 + 6 + 6 x 8 = ~210 s, plus the launch (~45 s, warm
#             kernel cache).
# Each rate's summary is appended to sweep.json.partial.jsonl as it finishes, so a stage cut short keeps its rates.
# The PNG is drawn only where matplotlib is installed; elsewhere, later: ioattn bench serve --replot sweep JSON.
#
# On the device, from the repository root, with the server's wheels in .whl/ (carried; see the list below):
#   bash lab/serve_h200.sh            -> $OUT/{ratio,sweep}.{json,log}, $OUT/<date>-serve-sweep-llama3-8b-shape-h200.*
# Wheels (cp312, manylinux x86_64 where compiled): fastapi 0.165.0, starlette 1.10.0, pydantic 2.14.4,
# pydantic_core 2.50.5, typing_extensions 4.16.0, typing-inspection 0.4.5, annotated-types 0.8.0, annotated-doc
# 0.0.7, opentelemetry-api 1.45.2, uvicorn 0.54.0, h11 0.16.0, click 8.5.1, uvloop 0.23.0, httptools 0.9.0, anyio
# 4.16.0, idna 3.20, httpx 0.28.1, httpcore 1.0.9, certifi 2026.10.19.post1, prometheus-client 0.26.0, jinja2
# 3.1.6, markupsafe 3.0.4, pyzmq 27.3.0, msgspec 0.23.0.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
SHAPES=(--model llama3-8b-shape --input-len 100 1024 --output-len 256 --decode-batch 0 --launch-timeout 200)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== 1. server / offline, same run"
timeout 240 python3 -m ioattn.cli bench serve --launch --offline "${SHAPES[@]}" --num-prompts 256 \
  --json "$OUT/ratio.json" > "$OUT/ratio.log" 2>&1 || echo "   stage 1 exit $? (see ratio.log)"
tail -n 30 "$OUT/ratio.log"

echo "== 2. request-rate sweep"
timeout 290 python3 -m ioattn.cli bench serve --launch "${SHAPES[@]}" --num-prompts 160 \
  --request-rate 2,4,8,16,32,inf --goodput ttft:2000 tpot:50 --json "$OUT/sweep.json" --out "$OUT" \
  > "$OUT/sweep.log" 2>&1 || echo "   stage 2 exit $? (see sweep.log)"
tail -n 25 "$OUT/sweep.log"
