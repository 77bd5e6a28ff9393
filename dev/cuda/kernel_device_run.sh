#!/bin/bash
# One call on the GPU machine for the memory-bound kernels: each kernel
# beside the OLD tree's (dev/cuda/kernel_bench.py, B=8), then the step at
# B = 8 (with its breakdown), 1 and 32 in this tree and in OLD, on GPU 0;
# the GPU tests and the conformance suite (test preset, tiny bf16, fp32 with
# two micro-batches, and a model of odd sizes: D=18, E=6, F=13, V=37, so the
# element-by-element paths run end to end) on GPU 1 meanwhile, or after the
# timings where there is one GPU. Logs under $OUT; a summary last.
#   usage: OLD=path/to/tree [WHEELS=dir] [TREES=new] bash dev/cuda/kernel_device_run.sh
# TREES: whose steps to time (default: new old).
# WHEELS: a folder holding the nvidia-cudnn-frontend wheel (cuDNN's
# attention; the device has cuDNN, not the frontend).
cd "$(dirname "$0")/../.." || exit 2
NEW=$PWD
OUT=${OUT:-/tmp/kernel_run}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 OPENBLAS_NUM_THREADS=8
source dev/cuda/wheels.sh && install_wheels "$OUT/pip.log"
FE=${FE_DIR:+$FE_DIR:}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
printf 'vocab = 37\ncontext = 9\nd_model = 18\nn_layer = 2\nn_head = 3\nd_ff = 13\n' > "$OUT/odd.toml"

GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
CHECK_GPU=$([ "$GPUS" -gt 1 ] && echo 1 || echo 0)

checks() {
    (
        export CUDA_VISIBLE_DEVICES=$CHECK_GPU PYTHONPATH=$FE$NEW
        timeout 170 python3 -m pytest tests/cuda tests/test_program_contract.py \
            tests/test_attention_path.py -k "cuda or cupy" -q -p no:cacheprovider --tb=short -rs \
            > "$OUT/pytest.log" 2>&1
        echo "pytest exit $?" >> "$OUT/pytest.log"
    ) &
    tests=$!
    (
        export CUDA_VISIBLE_DEVICES=$CHECK_GPU PYTHONPATH=$FE$NEW
        conformance() {
            timeout "$1" python3 -m coppelius.conformance --backend cupy --failures-only "${@:2}" \
                >> "$OUT/conformance.log" 2>&1
            echo "conformance ${*:2}: exit $?" >> "$OUT/conformance.log"
        }
        conformance 60
        conformance 50 --preset tiny --precision bf16
        conformance 40 --precision fp32 --batch 2 --accumulate 2
        conformance 30 --model "$OUT/odd.toml" --batch 2 --steps 6
    ) &
    suite=$!
}

[ "$GPUS" -gt 1 ] && checks  # else after the timings, alone on the GPU

export CUDA_VISIBLE_DEVICES=0
PYTHONPATH=$FE$NEW timeout 80 python3 dev/cuda/kernel_bench.py --old "$OLD" --launches 10 \
    --replays 3 > "$OUT/kernel_bench.log" 2>&1
echo "kernel_bench exit $?" >> "$OUT/kernel_bench.log"
LIMIT=$([ "$GPUS" -gt 1 ] && echo 220 || echo 120)
for B in 8 1 32; do
    for tree in ${TREES:-new old}; do
        dir=$([ $tree = new ] && echo "$NEW" || echo "$OLD")
        [ $SECONDS -lt $LIMIT ] || { echo "skipped: out of time" > "$OUT/step-$tree-B$B.log"; continue; }
        extra=$([ $tree$B = new8 ] && echo --breakdown)
        steps=$([ "$B" = 32 ] && echo 6 || echo 12)
        (cd "$dir" && PYTHONPATH=$FE$dir timeout 50 python3 dev/cuda/bench_step.py --batch $B \
            --precision bf16 --steps $steps --warmup 2 $extra) > "$OUT/step-$tree-B$B.log" 2>&1
        echo "bench exit $?" >> "$OUT/step-$tree-B$B.log"
    done
done
[ "$GPUS" -gt 1 ] || checks
wait $tests $suite

echo "================================================================ summary"
grep -E "^(FAILED|ERROR|SKIPPED)|^E  |passed|failed|exit" "$OUT/pytest.log" | cut -c1-300 | head -30
grep -v "^conformance cupy" "$OUT/conformance.log" | cut -c1-300 | head -30
grep "^conformance cupy" "$OUT/conformance.log" | cut -c1-200
sed -n '/^kernel /,$p' "$OUT/kernel_bench.log"
grep -E "exit|Error" "$OUT/kernel_bench.log" | head -5
for f in "$OUT"/step-*.log; do
    echo "---- $(basename "$f" .log)"
    tail -3 "$f"
done
grep -E "kernel|forward|backward|products|cuDNN|norm" "$OUT/step-new-B8.log" | head -40
