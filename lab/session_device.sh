#!/usr/bin/env bash
# One device call (< 10 minutes) for what the open W2 issues lack, each part under its own timeout and skipped when
# the call's 560 s (LIMIT) would not hold it. On an H200 the fp8 decode bar's rows come first (W2 4/7 lacks
# only its H200 run).
#   decode (H200 only): `ioattn bench decode --kv-cache-dtype fp8_e4m3` at the W2 4/7 bar's rows      <= 100 s
#   wide:   GPU tests of the fp8 forward; its D 128 default (the dynamic schedule) beside the static schedule and
#           256-key tiles on two serial warpgroups (c2n256)                                           <= 180 s
#   halfgrid: GPU tests of the MLA kernels and plans (the 16-head half grid), `bench decode --mla` at 16
#           heads with the defaults                                                                    <= 190 s
#   probe128: the 64-head lockstep and seesaw kernels with time stamps per phase (lab/gluon_mla_probe.py), and
#           64 heads at B 128 beside 128 heads at B 64 (the same programs; unshared against shared latent rows) <= 110 s
#   mla16:  halfgrid's `bench decode --mla` at 16 heads alone (the suite holds its tests)                <= 75 s
#   suite:  every GPU test of the suite (`pytest -m gpu`): kernels and ops on 8 workers, the rest on 4 with the
#           server's wheels from .whl/ when carried (lab/serve_h200.sh lists them)                      <= 350 s
#   aligned: GPU tests of the Gluon forward, the fp8 forward and the dispatch (first run for 223d9bc);
#           causal D 64/128 at N 2k-4k beside cuDNN                                                    <= 290 s
#   floor:  16-head MLA at the bar's smallest rows: split kernel, combine, a read and a copy of the same
#           bytes (lab/mla_floor.py)                                                                   <= 105 s
#   dynamic: the Gluon forward's dynamic schedule (GluonConfig.dynamic): its GPU tests, then causal D 64/128/256
#           and unmasked D 64/128 at N 2k-4k beside the static schedule and cuDNN                        <= 260 s
#   combine: 16-head MLA at one and eight sequences (split combine in column blocks of 128)            <= 40 s
#   varlen: GPU tests of the forward's dispatch (the varlen call's launch_packed included) and of the Gluon
#           forward                                                                                    <= 170 s
#   gap:    causal N 2k: the public call beside the Gluon forward called directly and cuDNN (lab/harness_gap.py) <= 90 s
#   launch: host µs of the Gluon forward's launch: Triton's JIT dispatch against the compiled kernel called
#           directly and the driver launch alone (lab/launch_cost.py)                                  <= 60 s
#   ncu:    Nsight Compute over the kernels behind the open bars beside cuDNN's (lab/ncu_kernels.py)       <= 300 s
#   matrix: the GPU layout matrix and the Triton forward/backward kernels' GPU tests                  <= 210 s
#   tests:  the GPU tests of the Gluon forward (bands of 16, auto dispatch), the fp8 forward (the same kernel) and
#           the MLA kernels (the seesaw default, O staged through the ring)                              <= 250 s
#   fp8:    the Gluon fp8 forward's variants (lab/fp8_gluon_variants.py VARIANTS) beside our bf16 forward, the
#           Triton fp8 kernel and cuDNN (W2 5/7's fp8 bar)                                          <= 150 s
#   mla-lab: 128 and 16 heads with O stored through the ring's stages beside the direct store; the
#           fixed cost per program                                                                        <= 130 s
#   mla:    `ioattn bench decode --mla --heads 16,128` with the defaults, beside torch's MLA (W2 7/7)    <= 140 s
#   d64:    the Gluon forward with three consumer warpgroups at D 64 beside two, Triton and cuDNN       <= 120 s
#   d64causal: causal D 64 on other tiles, consumer counts and work orders                             <= 120 s
#   snake:  causal D 128/256 with every other round of work tiles reversed beside the default order   <= 90 s
#   bands:  the Gluon forward's bands of 32-128 query blocks beside 16 at N 8k/16k, D 128/256      <= 120 s
#   d64fp8: the fp8 forward at D 64: its default beside three serial warpgroups (P from registers or shared
#           memory, dynamic or static schedule)                                                        <= 100 s
#   skeleton: the Gluon forward at D 128 (fp8 and bf16) with its softmax cut to exp2 only, then to nothing:
#           how far the loop design is from W2 5/7's fp8 bar whatever the softmax costs (fp8_skeleton.py) <= 180 s
#   fp8bar: `ioattn bench prefill` with the fp8 forward at the W2 5/7 fp8 bar's rows (D 128, N 4k-16k) beside
#           our bf16 forward and cuDNN, with the e4m3 matmul ceiling of the run; D 64 and 256 at N 8k      <= 190 s
#   d256fp8: the fp8 forward's GPU tests (D 256 in quarters among them), then D 256's Gluon default (two serial
#           warpgroups adding P·V a quarter of O's columns at a time) beside its variants and the Triton fp8
#           kernel (fp8_gluon_variants.py --head-dim 256)                                              <= 230 s
#   prefill: `ioattn bench prefill` bf16 beside torch cuDNN over N 2k-16k, D 64/128/256, causal and not, GQA
#           (W2 5/7), in what is left
# Everything comes back as one archive, $OUT/session.tgz (the device returns 8 files), beside session.log.
# From the repository root on the device:   OUT=/tmp/out bash lab/session_device.sh   (PARTS="tests mla": those only)
set -u
OUT=${OUT:-/tmp/out}
root=$OUT
lab=$(dirname "$0")
mkdir -p "$root"
exec > >(tee -a "$root/session.log") 2>&1
export PYTHONPATH=. PYTHONUNBUFFERED=1
parts=()
LIMIT=${LIMIT:-560}  # seconds for all parts (a call may run 600)
PARTS=${PARTS:-}  # the parts to run (names, space-separated); empty: all of them
run_part() {  # run_part NAME SECONDS COMMAND...: in $root/NAME, unless fewer than SECONDS are left of the LIMIT
    local name=$1 seconds=$2
    shift 2
    if [[ -n "$PARTS" && " $PARTS " != *" $name "* ]]; then
        return
    fi
    if (( SECONDS + seconds > LIMIT )); then
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
gpu_test_part() {
    source "$lab/device_log.sh" tests.log
    step "GPU tests: the Gluon forward, the fp8 forward, the MLA kernels"
    gpu_tests 240 8 gpu-tests.txt tests/kernels/test_gluon_fwd.py tests/kernels/test_fp8_forward.py \
        tests/kernels/test_gluon_mla.py tests/kernels/test_mla.py
}
matrix_test_part() {
    source "$lab/device_log.sh" matrix.log
    step "GPU tests: the layout matrix (its gradient cases' helper fixed in 70a1ca0), the forward and backward kernels"
    gpu_tests 200 8 gpu-tests.txt tests/kernels/test_kernel_matrix_gpu.py tests/kernels/test_prefill_fwd.py \
        tests/kernels/test_prefill_bwd.py
}
dynamic_schedule() {
    source "$lab/device_log.sh" dynamic.log
    step "GPU tests of the dynamic schedule"
    gpu_tests 90 6 gpu-tests.txt tests/kernels/test_gluon_fwd.py -k "dynamic or persistent_grid"
    step "causal: the dynamic schedule (bands of 16 and of 4) beside the static one (snake order) and cuDNN"
    OUT=$OUT/causal timeout 120 python3 lab/gluon_fwd_bench.py --head-dims 64,128,256 --causal yes \
        --variant "dyn:dynamic=true,snake=false" --variant "dyn4:dynamic=true,snake=false,band=4" \
        --only gluon,gluon-dyn,gluon-dyn4,torch-cudnn --budget-s 100 2>&1 | grep -v Warning | cut -c1-200
    step "unmasked, N 2k-4k: the dynamic schedule beside the static one and cuDNN"
    OUT=$OUT/full timeout 45 python3 lab/gluon_fwd_bench.py --head-dims 64,128 --causal no --seqlens 2048,4096 \
        --variant "dyn:dynamic=true" --only gluon,gluon-dyn,torch-cudnn --budget-s 35 2>&1 | grep -v Warning \
        | cut -c1-200
}
combine_blocks() {
    source "$lab/device_log.sh" combine.log
    step "16 heads, many splits: the split combine in column blocks of 128 (COMBINE_COLUMNS)"
    GLUON_MLA_TRITON=0 GLUON_MLA="64/2/0/1" GLUON_MLA_HEADS=16 GLUON_MLA_JSON=gluon-mla-h16-combine.json \
        GLUON_MLA_SHAPES="1x65536 1x32768 8x8192 64x1024" timeout 35 python3 lab/gluon_mla.py 2>&1 | grep -v Warning
}
varlen_tests() {
    source "$lab/device_log.sh" varlen.log
    step "GPU tests: the forward dispatch (the varlen launch_packed included), the Gluon forward"
    gpu_tests 160 8 gpu-tests.txt tests/ops/test_dispatch.py tests/ops/test_attention_fwd.py \
        tests/kernels/test_gluon_fwd.py
}
ncu_profile() {
    source "$lab/device_log.sh" ncu.log
    local ncu sections=() c pipes=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
    pipes+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
    pipes+=,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -1)
    for c in SpeedOfLight ComputeWorkloadAnalysis WarpStateStats SchedulerStats InstructionStats Occupancy \
            LaunchStats MemoryWorkloadAnalysis; do sections+=(--section "$c"); done
    for c in ${NCU_CASES:-d64causal-gluon d64causal-cudnn fp8-gluon d128-gluon d128-cudnn mla128 mla16}; do
        step "ncu $c (lab/ncu_kernels.py)"
        timeout 40 "$ncu" --clock-control none --profile-from-start off -k "regex:gluon|cudnn|combine" \
            "${sections[@]}" --metrics "$pipes" \
            python3 lab/ncu_kernels.py "$c" > "$OUT/ncu-$c.txt" 2>&1
        echo "ncu exit $?"
        grep -E "^  [a-z_0-9]+.*\(|Duration|Issue Slots Busy|Executed Ipc Active|No Eligible|One or More Elig|sm__" \
            "$OUT/ncu-$c.txt" | cut -c1-120 | head -30
    done
}
wide_fp8() {
    source "$lab/device_log.sh" wide.log
    step "GPU tests: the fp8 forward (256-key tiles included)"
    gpu_tests 70 8 gpu-tests.txt tests/kernels/test_fp8_forward.py
    step "fp8 D 128: the default (dynamic schedule) beside the static schedule and 256-key tiles (c2n256), bf16,"\
        "Triton fp8 and cuDNN"
    timeout 100 python3 lab/fp8_gluon_variants.py "$OUT/fp8-wide.json" --only static,c2n256 2>&1 \
        | grep -v Warning | cut -c1-300
}
fp8_variants() {
    source "$lab/device_log.sh" fp8.log
    step "the Gluon fp8 forward's variants (fp8_gluon_variants.py VARIANTS), beside bf16, Triton fp8 and cuDNN"
    timeout 140 python3 lab/fp8_gluon_variants.py "$OUT/fp8-variants.json" 2>&1 | grep -v Warning | cut -c1-300
}
mla_lab() {
    source "$lab/device_log.sh" mla-lab.log
    step "128 heads: O stored through the ring's stages (/staged) beside the direct store"
    GLUON_MLA_TRITON=0 GLUON_MLA="w64/2/0/1 w64/2/0/1/staged s64/2/0/1 s64/2/0/1/staged" GLUON_MLA_HEADS=128 \
        GLUON_MLA_JSON=gluon-mla-h128-staged.json GLUON_MLA_SHAPES="1x1024 8x4096 64x1024 128x1024 64x4096 64x8192" \
        timeout 60 python3 lab/gluon_mla.py 2>&1 | grep -v Warning
    step "16 heads: O stored through the ring's stages beside the direct store"
    GLUON_MLA_TRITON=0 GLUON_MLA="64/2/0/1 64/2/0/1/staged" GLUON_MLA_HEADS=16 \
        GLUON_MLA_JSON=gluon-mla-h16-staged.json GLUON_MLA_SHAPES="64x1024 32x4096 8x8192 1x32768" timeout 40 \
        python3 lab/gluon_mla.py 2>&1 | grep -v Warning
    step "one launch alone: the fixed cost per program"
    timeout 20 python3 lab/mla_fixed_cost.py 2>&1 | grep -v Warning
}
mla_bench() {
    source "$lab/device_log.sh" mla.log
    step "ioattn bench decode --mla, 16 and 128 heads, the defaults"
    python3 -m ioattn.cli bench decode --mla --heads 16,128 --budget-s 110 --json "$OUT/mla-decode.json" \
        > "$OUT/mla-decode.txt" 2>&1
    echo "bench exit $?"; grep -E "^Bar|^\|" "$OUT/mla-decode.txt" | cut -c1-300 | tail -60
}
band_sweep() {
    source "$lab/device_log.sh" bands.log
    step "the Gluon forward's work-tile order: bands of 16 (the default), 32, 64, 128 query blocks, beside cuDNN"
    timeout 110 python3 lab/gluon_fwd_bench.py --bands 32,64,128 --head-dims 128,256 --seqlens 8192,16384 \
        --only gluon,gluon-band32,gluon-band64,gluon-band128,torch-cudnn --budget-s 90 2>&1 | grep -v Warning \
        | cut -c1-200
}
d64_consumers() {
    source "$lab/device_log.sh" d64.log
    step "D 64: three consumer warpgroups (192 query rows per work tile) beside two, the Triton forward and cuDNN"
    local c3="consumers=3,maxnreg=128,consumer_regs=160"
    timeout 110 python3 lab/gluon_fwd_bench.py --head-dims 64 --variant "c3n64:$c3,block_n=64,stages=4" \
        --variant "c3n64s6:$c3,block_n=64,stages=6" --variant "c3n128:$c3,block_n=128,stages=3" \
        --only gluon,gluon-c3n64,gluon-c3n64s6,gluon-c3n128,ioattn,torch-cudnn --budget-s 90 2>&1 | grep -v Warning \
        | cut -c1-200
}
d64_causal() {
    source "$lab/device_log.sh" d64causal.log
    step "D 64 causal: the Gluon forward's tiles and work orders beside the Triton forward and cuDNN"
    local c3="consumers=3,maxnreg=128,consumer_regs=160"
    timeout 110 python3 lab/gluon_fwd_bench.py --head-dims 64 --bands 4,64 --variant "c2n64:block_n=64,stages=4" \
        --variant "c3n64:$c3,block_n=64,stages=4" --variant "c3n64nopp:$c3,block_n=64,stages=4,pingpong=false" \
        --only gluon,gluon-band4,gluon-band64,gluon-c2n64,gluon-c3n64,gluon-c3n64nopp,ioattn,torch-cudnn \
        --causal yes --budget-s 90 2>&1 | grep -v Warning | cut -c1-200
}
snake_order() {
    source "$lab/device_log.sh" snake.log
    step "causal: every other round of work tiles from its far end (snake) beside the default order and cuDNN"
    timeout 80 python3 lab/gluon_fwd_bench.py --head-dims 128,256 --causal yes --variant "snake:snake=true" \
        --only gluon,gluon-snake,torch-cudnn --budget-s 60 2>&1 | grep -v Warning | cut -c1-200
}
launch_cost() {
    source "$lab/device_log.sh" launch.log
    step "host µs of the Gluon forward's launch: JIT dispatch, the compiled kernel directly, the driver alone"
    timeout 55 python3 lab/launch_cost.py "$OUT/launch-cost.json" 2>&1 | grep -v Warning | cut -c1-300
}
harness_gap() {
    source "$lab/device_log.sh" gap.log
    step "causal N 2k: the public call, the Gluon forward called directly, cuDNN; host time per call"
    timeout 80 python3 lab/harness_gap.py "$OUT/gap.json" 2>&1 | grep -v Warning | cut -c1-600
}
aligned_blocks() {
    source "$lab/device_log.sh" aligned.log
    step "GPU tests: the Gluon forward, the fp8 forward, the dispatch"
    gpu_tests 200 8 gpu-tests.txt tests/kernels/test_gluon_fwd.py tests/kernels/test_fp8_forward.py \
        tests/ops/test_dispatch.py tests/ops/test_attention_fwd.py
    step "causal N 2k-4k: the Gluon forward called directly beside cuDNN"
    OUT=$OUT/causal timeout 70 python3 lab/gluon_fwd_bench.py --head-dims 64,128 --causal yes --seqlens 2048,4096 \
        --only gluon,torch-cudnn --budget-s 55 2>&1 | grep -v Warning | cut -c1-200
}
mla_floor() {
    source "$lab/device_log.sh" floor.log
    step "16-head MLA at the bar's smallest rows: the split kernel, the combine, a read and a copy of the same bytes"
    timeout 100 python3 lab/mla_floor.py 2>&1 | grep -v Warning | cut -c1-400
}
half_grid() {
    source "$lab/device_log.sh" halfgrid.log
    step "GPU tests of the MLA kernels and plans (the 16-head half grid, HALF_GRID_MAX_KEYS)"
    gpu_tests 110 8 gpu-tests.txt tests/kernels/test_gluon_mla.py tests/kernels/test_mla.py
    mla16_bench
}
mla16_bench() {
    step "ioattn bench decode --mla, 16 heads, the defaults"
    timeout 70 python3 -m ioattn.cli bench decode --mla --heads 16 --backends ioattn-mla --budget-s 55 \
        --json "$OUT/mla-decode.json" > "$OUT/mla-decode.txt" 2>&1
    echo "bench exit $?"; grep -E "^Bar|^\| 16" "$OUT/mla-decode.txt" | cut -c1-160 | tail -24
}
mla16_part() {
    source "$lab/device_log.sh" mla16.log
    mla16_bench
}
probe_128() {
    source "$lab/device_log.sh" probe128.log
    step "lab/gluon_mla_probe.py 128 seesaw"
    timeout 50 python3 "$lab/gluon_mla_probe.py" 128 seesaw > "$OUT/probe.txt" 2>&1
    echo "probe exit $?"; cat "$OUT/probe.txt" | cut -c1-200 | tail -40
    step "64 heads at B 128 beside 128 heads at B 64, lockstep and seesaw, O staged"
    GLUON_MLA="w64/2/0/1/staged s64/2/0/1/staged" GLUON_MLA_TRITON=0 GLUON_MLA_HEADS="64 128" \
        GLUON_MLA_SHAPES="128x1024 64x1024 64x128 128x128" timeout 50 python3 "$lab/gluon_mla.py" \
        > "$OUT/shared-rows.txt" 2>&1
    echo "lab exit $?"; grep -E "^H|ceiling|rror" "$OUT/shared-rows.txt" | cut -c1-200 | tail -24
}
gpu_suite() {
    source "$lab/device_log.sh" suite.log
    if ls .whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && export PYTHONPATH=.:/tmp/site
    fi
    step "GPU tests: kernels and ops"
    gpu_tests 230 8 gpu-tests-kernels-ops.txt tests/kernels tests/ops
    step "GPU tests: the rest (engine, models, bench, demo; 4 workers: pool sizing reads free memory)"
    gpu_tests 110 4 gpu-tests-rest.txt tests --ignore=tests/kernels --ignore=tests/ops
}
fp8_d256() {
    source "$lab/device_log.sh" d256fp8.log
    step "GPU tests: the fp8 forward at D 256 in quarters (two serial warpgroups), and every fp8 forward GPU test"
    gpu_tests 100 8 gpu-tests.txt tests/kernels/test_fp8_forward.py
    step "fp8 D 256: the default (two serial warpgroups in quarters, P shared) beside its variants and Triton fp8"
    timeout 120 python3 lab/fp8_gluon_variants.py "$OUT/fp8-d256.json" --head-dim 256 2>&1 | grep -v Warning \
        | cut -c1-400
}
fp8_d64() {
    source "$lab/device_log.sh" d64fp8.log
    step "fp8 D 64: the default (two overlapped ping-pong warpgroups) beside three serial ones (fp8_gluon_variants.py)"
    timeout 90 python3 lab/fp8_gluon_variants.py "$OUT/fp8-d64.json" --head-dim 64 --seqlens 4096,16384 2>&1 \
        | grep -v Warning | cut -c1-400
}
fp8_skeleton() {
    source "$lab/device_log.sh" skeleton.log
    step "the Gluon forward at D 128 with the softmax cut to exp2 only, then to nothing (fp8_skeleton.py)"
    timeout 170 python3 lab/fp8_skeleton.py "$OUT/fp8-skeleton.json" --seqlens 4096,16384 2>&1 | grep -v Warning \
        | cut -c1-300
}
fp8_bar() {
    source "$lab/device_log.sh" fp8bar.log
    step "ioattn bench prefill: the fp8 bar's rows (D 128, N 4k-16k) beside our bf16 and cuDNN, e4m3 matmul ceiling"
    python3 -m ioattn.cli bench prefill --backends ioattn,ioattn-fp8,torch-cudnn --dims 128 --gqa 1 \
        --seqlens 4096,8192,16384 --budget-s 110 --json "$OUT/fp8bar.json" --md "$OUT/fp8bar.md" \
        > "$OUT/fp8bar.txt" 2>&1
    echo "bench exit $?"; grep -E "^\||^Bar|ceiling" "$OUT/fp8bar.md" | head -30
    step "the same at D 64 and 256, N 8k (their fp8 defaults: two overlapped consumers, P through shared memory)"
    python3 -m ioattn.cli bench prefill --backends ioattn,ioattn-fp8,torch-cudnn --dims 64,256 --gqa 1 \
        --seqlens 8192 --budget-s 45 --json "$OUT/fp8-d64-d256.json" --md "$OUT/fp8-d64-d256.md" \
        > "$OUT/fp8-d64-d256.txt" 2>&1
    echo "bench exit $?"; grep -E "^\|" "$OUT/fp8-d64-d256.md" | head -30
}
prefill_bench() {  # $1: seconds
    source "$lab/device_log.sh" prefill.log
    step "ioattn bench prefill beside torch cuDNN"
    python3 -m ioattn.cli bench prefill --backends ioattn,torch-cudnn --dims 128,64,256 \
        --seqlens 2048,4096,8192,16384 --budget-s $(( $1 - 25 )) --json "$OUT/prefill.json" --md "$OUT/prefill.md" \
        > "$OUT/prefill.txt" 2>&1
    echo "bench exit $?"; grep -E "^\|" "$OUT/prefill.md" | head -60
}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    run_part decode 100 bash -c "$(declare -f decode_bar); lab=$lab; decode_bar"
else
    echo "not an H200: the fp8 decode bar's H200 run is left out"
fi
run_part wide 180 bash -c "$(declare -f wide_fp8); lab=$lab; wide_fp8"
run_part halfgrid 190 bash -c "$(declare -f half_grid mla16_bench); lab=$lab; half_grid"
run_part suite 350 bash -c "$(declare -f gpu_suite); lab=$lab; gpu_suite"
run_part mla16 75 bash -c "$(declare -f mla16_part mla16_bench); lab=$lab; mla16_part"
run_part probe128 110 bash -c "$(declare -f probe_128); lab=$lab; probe_128"
run_part aligned 290 bash -c "$(declare -f aligned_blocks); lab=$lab; aligned_blocks"
run_part floor 105 bash -c "$(declare -f mla_floor); lab=$lab; mla_floor"
run_part dynamic 260 bash -c "$(declare -f dynamic_schedule); lab=$lab; dynamic_schedule"
run_part combine 40 bash -c "$(declare -f combine_blocks); lab=$lab; combine_blocks"
run_part varlen 170 bash -c "$(declare -f varlen_tests); lab=$lab; varlen_tests"
run_part gap 90 bash -c "$(declare -f harness_gap); lab=$lab; harness_gap"
run_part launch 60 bash -c "$(declare -f launch_cost); lab=$lab; launch_cost"
run_part ncu 300 bash -c "$(declare -f ncu_profile); lab=$lab; ncu_profile"
run_part matrix 210 bash -c "$(declare -f matrix_test_part); lab=$lab; matrix_test_part"
run_part tests 250 bash -c "$(declare -f gpu_test_part); lab=$lab; gpu_test_part"
run_part fp8 150 bash -c "$(declare -f fp8_variants); lab=$lab; fp8_variants"
run_part mla-lab 130 bash -c "$(declare -f mla_lab); lab=$lab; mla_lab"
run_part d64 120 bash -c "$(declare -f d64_consumers); lab=$lab; d64_consumers"
run_part d64causal 120 bash -c "$(declare -f d64_causal); lab=$lab; d64_causal"
run_part snake 90 bash -c "$(declare -f snake_order); lab=$lab; snake_order"
run_part bands 120 bash -c "$(declare -f band_sweep); lab=$lab; band_sweep"
run_part d256fp8 230 bash -c "$(declare -f fp8_d256); lab=$lab; fp8_d256"
run_part d64fp8 100 bash -c "$(declare -f fp8_d64); lab=$lab; fp8_d64"
run_part skeleton 180 bash -c "$(declare -f fp8_skeleton); lab=$lab; fp8_skeleton"
run_part fp8bar 190 bash -c "$(declare -f fp8_bar); lab=$lab; fp8_bar"
run_part mla 140 bash -c "$(declare -f mla_bench); lab=$lab; mla_bench"
left=$(( LIMIT - SECONDS - 5 ))
if (( left >= 50 )); then
    run_part prefill "$left" bash -c "$(declare -f prefill_bench); lab=$lab; prefill_bench $left"
else
    echo "== part prefill left out: $left s left"
fi
tar czf "$root/session.tgz" -C "$root" "${parts[@]}" && rm -rf "${parts[@]/#/$root/}"
