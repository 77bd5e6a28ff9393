#!/bin/bash
# One call on the GPU machine (one GPU) for the step's device memory: first,
# side by side (none of it timed), the GPU tests, the conformance suite (test
# preset fp32 and bf16, tiny bf16) and dev/cuda/memory_check.py in this tree
# and in OLD (the pool's growth by site; the bits of two steps at B = 8 and
# 32, compared); then, alone on the GPU and timed, `coppelius bench` at
# B = 1, 8, 32 in this tree with the PyTorch peers and in OLD without them,
# with CHUNKS=1 the logits chunk sizes (memory_check.py --chunk-bytes), and
# the changed kernels beside OLD's (kernel_bench.py; KERNELS: its --only
# arguments, by default the gradient's readers). Logs under $OUT; a summary last.
#   usage: OLD=path/to/tree [WHEELS=dir] [QUICK=1] [NOPEER=1] [CHUNKS=1] [KERNELS="--only ..."]
#          bash dev/cuda/memory_device_run.sh
# QUICK=1: a check after a change: the tests, the test preset's conformance,
# this tree's memory_check and the two benches without the peers, nothing else.
# WHEELS: a folder holding the nvidia-cudnn-frontend wheel (cuDNN's
# attention; the device has cuDNN, not the frontend).
cd "$(dirname "$0")/../.." || exit 2
NEW=$PWD
OLD=$(cd "$OLD" && pwd) || exit 2
OUT=${OUT:-/tmp/memory_run}; mkdir -p "$OUT"
WORK=/tmp/memory_run_work; mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4
source dev/cuda/wheels.sh && install_wheels "$WORK/pip.log"
FE=${FE_DIR:+$FE_DIR:}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
cp dev/cuda/memory_check.py "$OLD/dev/cuda/"  # run from OLD's root: it imports OLD

# -- untimed, side by side
(
    export PYTHONPATH=$FE$NEW
    timeout 170 python3 -m pytest tests/cuda tests/test_program_contract.py \
        tests/test_attention_path.py -k "cuda or cupy or cudnn or attention" -q -p no:cacheprovider \
        --tb=short -rs > "$WORK/pytest.log" 2>&1
    echo "pytest exit $?" >> "$WORK/pytest.log"
) &
tests=$!
(
    export PYTHONPATH=$FE$NEW
    runs=("")
    [ -n "$QUICK" ] || runs+=("--preset tiny --precision bf16")
    for args in "${runs[@]}"; do
        timeout 80 python3 -m coppelius.conformance --backend cupy --failures-only $args \
            >> "$WORK/conformance.log" 2>&1
        echo "conformance $args: exit $?" >> "$WORK/conformance.log"
    done
) &
suite=$!
trees=$([ -n "$QUICK" ] && echo new || echo "new old")
for tree in $trees; do
    (
        dir=$([ $tree = new ] && echo "$NEW" || echo "$OLD")
        batches=$([ $tree = new ] && echo "--batch 1 --batch 8 --batch 32" || echo "--batch 8 --batch 32")
        cd "$dir" && PYTHONPATH=$FE$dir timeout 150 python3 dev/cuda/memory_check.py $batches \
            --json "$WORK/memcheck-$tree.json" > "$WORK/memcheck-$tree.log" 2>&1
        echo "memory_check $tree exit $?" >> "$WORK/memcheck-$tree.log"
    ) &
done
wait
[ -n "$QUICK" ] || PYTHONPATH=$FE$NEW python3 dev/cuda/memory_check.py --compare \
    "$WORK/memcheck-new.json" "$WORK/memcheck-old.json" > "$WORK/compare.log" 2>&1
cat "$WORK/pytest.log" "$WORK/conformance.log" > "$OUT/tests.log"
cat "$WORK"/memcheck-*.log "$WORK"/compare.log > "$OUT/memcheck.log" 2>/dev/null

# -- timed, alone on the GPU
LIMIT=${LIMIT:-330}
bench() {  # tree, extra arguments
    dir=$([ "$1" = new ] && echo "$NEW" || echo "$OLD")
    (cd "$dir" && PYTHONPATH=$FE$dir timeout "$2" python3 -m coppelius bench --backend cupy \
        --preset coppelius --batch 1 --batch 8 --batch 32 --steps 20 --no-reference "${@:3}") \
        > "$OUT/bench-$1.log" 2>&1
    echo "bench $1 exit $?" >> "$OUT/bench-$1.log"
}
bench new 200 ${QUICK:+--no-peer} ${NOPEER:+--no-peer}
[ $SECONDS -lt $LIMIT ] && bench old 60 --no-peer
[ -n "$QUICK" ] && LIMIT=0  # no chunk sizes, no kernels
M=$((1 << 20))
[ -n "$CHUNKS" ] && [ $SECONDS -lt $LIMIT ] && PYTHONPATH=$FE$NEW timeout 60 python3 dev/cuda/memory_check.py \
    --time 15 --chunk-batch 8 --chunk-batch 32 --chunk-bytes $((24 * M)) \
    --chunk-bytes $((48 * M)) --chunk-bytes $((96 * M)) --chunk-bytes $((1 << 40)) \
    > "$OUT/timing.log" 2>&1
echo "chunk variants exit $?" >> "$OUT/timing.log"
[ $SECONDS -lt $LIMIT ] && PYTHONPATH=$FE$NEW timeout 40 python3 dev/cuda/kernel_bench.py \
    --old "$OLD" --launches 10 --replays 3 ${KERNELS:---only adamw --only gradient_norm --only param_grads} \
    >> "$OUT/timing.log" 2>&1
echo "kernel_bench exit $? (at ${SECONDS} s)" >> "$OUT/timing.log"

echo "================================================================ summary"
grep -E "^(FAILED|ERROR)|^E  |passed|failed|exit" "$OUT/tests.log" | cut -c1-300 | head -20
grep "^conformance cupy" "$OUT/tests.log" | cut -c1-200
grep -E "^B=|bits|exit" "$OUT/memcheck.log"
grep -E " MiB  " "$OUT/memcheck.log" | head -24
sed -n '/^  B what/,$p' "$OUT/memcheck.log"
grep -E "logits chunk|exit" "$OUT/timing.log"
sed -n '/^kernel /,$p' "$OUT/timing.log"
for t in old new; do echo "---- bench $t"; tail -14 "$OUT/bench-$t.log"; done
