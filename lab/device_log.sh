# Sourced by the lab's device-call scripts after they set PYTHONPATH: $OUT made, everything after this tee'd to
# $OUT/$1, `step` prints the seconds since the start before each stage, and the device and versions are printed.
# `gpu_tests SECONDS WORKERS FILE TEST...` runs `pytest -m gpu` on TEST... (WORKERS 1: in one process) into
# $OUT/FILE and prints its summary; `fp8_gpu_tests SECONDS WORKERS` does so for the GPU tests of fp8 caches, the
# paged kernel and the fp8 engine into $OUT/gpu-tests.txt; `fp8_decode_bench SECONDS` runs `ioattn bench decode`
# over fp8 and bf16 caches beside cuDNN at the W2 4/7 bar's rows into $OUT/decode-fp8.{json,txt} and prints its
# tables.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$1") 2>&1
started=$SECONDS
step() { echo "== $(( SECONDS - started )) s: $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
echo "tree: ${TREE_COMMIT:-unknown} (the device copy's .git may be older than its working tree)"
gpu_tests() {
    local seconds=$1 workers=$2 file=$3 parallel=()
    shift 3
    [ "$workers" -gt 1 ] && parallel=(-n "$workers")
    timeout "$seconds" python3 -m pytest -q ${parallel[@]+"${parallel[@]}"} -m gpu -rfE --tb=short -p no:warnings \
        -p no:cacheprovider "$@" > "$OUT/$file" 2>&1
    echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$file" | tail -15
}
fp8_gpu_tests() {
    step "0. GPU tests: fp8 caches, the paged kernel, the fp8 engine"
    gpu_tests "$1" "$2" gpu-tests.txt tests/kernels/test_paged_fp8.py tests/kernels/test_paged.py \
        tests/engine/test_fp8_engine.py
}
fp8_decode_bench() {
    timeout "$1" python3 -m ioattn.cli bench decode --kv-cache-dtype fp8_e4m3 --backends ioattn-paged,torch-cudnn \
        --heads 32/8,32/32 --batches 8,64,256 --seqlens 4096,32768 --long-seqlens 131072 --no-prefill \
        --budget-s $(( $1 - 30 )) --json "$OUT/decode-fp8.json" > "$OUT/decode-fp8.txt" 2>&1
    echo "bench exit $?"; grep -E "^\|" "$OUT/decode-fp8.txt" | head -40
}
