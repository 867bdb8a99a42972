#!/usr/bin/env bash
# FP8 KV cache on the H200, one device call (< 9 minutes; every step has its own hard timeout):
#   1. the fp8 GPU tests (bf16 queries over fp8 caches, the hardware quantization bit for bit, CUDA graphs; the
#      engine with graphs vs eager and no compile while serving)                                      ~1.5 min
#   2. `ioattn bench decode --kv-cache-dtype fp8_e4m3`: ioattn-paged-fp8 beside bf16 ioattn-paged, torch CUDNN
#      and FLASH (bf16 caches), B 1/8/64/256 x L 1k/4k/16k/32k (+ B1 L128k), 32/8 and 32/32 heads, D 128,
#      CUDA-graph timed over up to 32 layers; --budget-s stops starting cases after 120 s (the disclosure's
#      settings.not_run lists what was cut: at ~5 s a case (four backends), expect the 18 cases of 32/8 and the
#      first 32/32 ones to fit; B256 L32k 32/32 needs 137 GiB and is skipped by --max-kv-gib)            ~2.5 min
#   2b. lab/fp8_tiles.py: five other decode tiles for the fp8 cache beside the default, at B64 L4k, B8 L32k and
#      B256 L4k (the default fp8 tile is the bf16 tuning; this says whether another wins)          ~0.7 min
#   3. serving, llama3-8b-shape, 128 requests of 4096-7936 prompt tokens and 256 output tokens, all at once,
#      offline through ioattn.LLM with the cache in bf16 and in fp8_e4m3 (the pool's byte budget the same: fp8
#      holds twice the tokens): output tok/s, TPOT, preemptions, the pool's token capacity        ~2 x 1.5 min
# Run from the repository root (nothing to carry: the working tree is all it needs):
#   OUT=/tmp/out bash lab/fp8_h200.sh
# Results in $OUT: fp8-gpu-tests.{txt,xml}, fp8-decode-h200.{json,md}, fp8-tiles-h200.json, fp8-serve-{auto,fp8}-h200.json,
# fp8-serve-h200.md (the side by side), fp8-h200.log (everything printed).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
exec > >(tee -a "$OUT/fp8-h200.log") 2>&1
started=$SECONDS
step() { echo "== $(( SECONDS - started )) s: $*"; }

step "1. fp8 GPU tests"
timeout 100 python3 -m pytest -q -m gpu -k fp8 tests/kernels/test_paged_fp8.py tests/engine/test_fp8_engine.py \
    -p no:cacheprovider --junitxml="$OUT/fp8-gpu-tests.xml" > "$OUT/fp8-gpu-tests.txt" 2>&1
echo "pytest exit $?"; tail -25 "$OUT/fp8-gpu-tests.txt"

step "2. bench decode, fp8_e4m3 beside bf16 and torch"
timeout 165 python3 -m ioattn.cli bench decode --kv-cache-dtype fp8_e4m3 \
    --backends ioattn-paged,torch-cudnn,torch-flash --batches 1,8,64,256 --seqlens 1024,4096,16384,32768 \
    --long-seqlens 131072 --heads 32/8,32/32 --head-dim 128 --no-prefill --budget-s 120 \
    --json "$OUT/fp8-decode-h200.json" --md "$OUT/fp8-decode-h200.md" > "$OUT/fp8-decode.txt" 2>&1
echo "bench decode exit $?"; sed -n '/ioattn-paged-fp8: K\/V bytes/,$p' "$OUT/fp8-decode-h200.md" 2>/dev/null

step "2b. fp8 decode tiles"
timeout 50 python3 lab/fp8_tiles.py > "$OUT/fp8-tiles.txt" 2>&1
echo "fp8 tiles exit $?"; cut -c1-220 "$OUT/fp8-tiles.txt" | tail -21

for kv in auto fp8_e4m3; do
    step "3. serve, llama3-8b-shape long context, kv cache $kv"
    name=$([ "$kv" = auto ] && echo auto || echo fp8)
    timeout 110 python3 -m ioattn.cli bench serve --compare ioattn --model llama3-8b-shape --kv-cache-dtype "$kv" \
        --num-requests 128 --input-len 4096 7936 --output-len 256 --max-model-len 8192 --decode-batch 0 \
        --json "$OUT/fp8-serve-$name-h200.json" > "$OUT/fp8-serve-$name.txt" 2>&1
    echo "bench serve ($kv) exit $?"; tail -5 "$OUT/fp8-serve-$name.txt"
done

step "side by side"
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}
for name in ("auto", "fp8"):
    path = out / f"fp8-serve-{name}-h200.json"
    if path.exists():
        runs[name] = json.loads(path.read_text())["systems"]["ioattn"]
keys = ("output_tokens_per_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "preemptions", "kv_pool_tokens",
        "kv_pool_usage_peak", "kv_cache_dtype")
lines = ["# Serving llama3-8b-shape, 128 requests, prompts 4096-7936, outputs 256 (H200)", "",
         "| metric | " + " | ".join(runs) + " | fp8 / auto |", "|---|" + "---|" * (len(runs) + 1)]
for key in keys:
    values = [runs[n].get(key) for n in runs]
    ratio = (f"{values[1] / values[0]:.3f}" if len(values) == 2 and all(isinstance(v, (int, float)) and v
             for v in values) else "")
    lines.append(f"| {key} | " + " | ".join(str(round(v, 3) if isinstance(v, float) else v) for v in values)
                 + f" | {ratio} |")
text = "\n".join(lines) + "\n"
(out / "fp8-serve-h200.md").write_text(text)
print(text)
EOF
step "done"
