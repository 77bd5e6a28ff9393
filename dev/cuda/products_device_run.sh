#!/bin/bash
# On the GPU machine: the own product kernel (kernels/gemm_sm90.cu) and the
# step routed through it (COPPELIUS_PRODUCTS=own), one call, logs under $OUT,
# a short table last.
#   PART=check        dev/cuda/gemm_check.py under the watchdog (q|k|v) and in full
#                     (SHAPES, BATCHES, DIRECTIONS: forward,backward)
#   PART=tests        tests/cuda/test_gemm_sm90.py and tests/cuda/test_products.py
#   PART=conformance  the conformance suite with the own products, bf16, B = 4 and 8
#   PART=bench        coppelius bench, cuBLAS (COPPELIUS_PRODUCTS=cublas) beside the peer,
#                     then the own products
#   PART=profile      dev/cuda/step_profile.py with and without the own products
# WHEELS: a folder holding the nvidia-cudnn-frontend wheel.
#     PART=check,tests WHEELS=.whl bash dev/cuda/products_device_run.sh
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/products_run}; mkdir -p "$OUT"
source dev/cuda/wheels.sh && install_wheels "$OUT/pip.log"
FE=${FE_DIR:+:$FE_DIR}
export PYTHONPATH=$PWD$FE
PRESET=${PRESET:-coppelius}
summary=()
row() { summary+=("$(printf '%-52s %s' "$1" "$2")"); }

if [[ ${PART:-} == *check* ]]; then
    timeout 60 python3 dev/cuda/gemm_check.py --watchdog --batches 8 --shapes qkv,down \
        > "$OUT/watchdog.log" 2>&1
    row "gemm_check --watchdog qkv,down B=8 (exit $?)" "$(grep -c -i 'trap\|watchdog' "$OUT/watchdog.log") watchdog lines"
    timeout ${CHECK_S:-170} python3 dev/cuda/gemm_check.py --batches ${BATCHES:-1,8,32} \
        --shapes ${SHAPES:-qkv,o,gate_up,down,classifier} \
        --directions ${DIRECTIONS:-forward,backward} > "$OUT/check.log" 2>&1
    row "gemm_check (exit $?)" "$(grep -c -i 'FAIL' "$OUT/check.log") FAIL lines"
fi
if [[ ${PART:-} == *tests* ]]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_gemm_sm90.py \
        tests/cuda/test_products.py > "$OUT/tests.log" 2>&1
    row "pytest gemm + products (exit $?)" "$(tail -1 "$OUT/tests.log")"
fi
verdicts() {
    grep -E ' checks, ' "$1" | sed -E 's/^conformance [a-z]+ ([a-z0-9]+) .*: ([0-9]+) checks, ([0-9]+) passed.*: ([A-Z]+)$/\1 \3\/\2 \4/' \
        | paste -sd';' | grep . || tail -1 "$1"
}
if [[ ${PART:-} == *conformance* ]]; then
    # the own products serve 4096 rows and more: models of T = 1024 at B = 4 and 8, two
    # layers, so that the reference's steps are quick
    for model in ${CONF_MODELS:-dev/cuda/families/products*.toml}; do
        for B in ${CONF_B:-4 8}; do
            log="$OUT/conf-own-$(basename "$model" .toml)-B$B.log"
            COPPELIUS_PRODUCTS=own timeout ${CONF_S:-150} python3 -m coppelius.conformance \
                --backend cupy --failures-only --steps ${CONF_STEPS:-4} --model "$model" \
                --batch $B --precision bf16 > "$log" 2>&1
            row "conformance own $(basename "$model") B=$B (exit $?)" "$(verdicts "$log")"
        done
    done
fi
if [[ ${PART:-} == *bench* ]]; then
    B=${BENCH_B:-8}
    COPPELIUS_PRODUCTS=cublas timeout 200 python3 -m coppelius bench --preset $PRESET --backend cupy --precision bf16 \
        --no-reference --batch $B --steps 20 --warmup 5 > "$OUT/bench-cublas-$B.log" 2>&1
    row "bench cuBLAS + peer (exit $?)" "see bench-cublas-$B.log"
    COPPELIUS_PRODUCTS=own timeout 100 python3 -m coppelius bench --preset $PRESET --backend cupy \
        --precision bf16 --no-reference --no-peer --batch $B --steps 20 --warmup 5 \
        > "$OUT/bench-own-$B.log" 2>&1
    row "bench own products (exit $?)" "see bench-own-$B.log"
fi
if [[ ${PART:-} == *profile* ]]; then
    COPPELIUS_PRODUCTS=cublas timeout 150 python3 dev/cuda/step_profile.py --batch ${BENCH_B:-8} \
        > "$OUT/profile-cublas.log" 2>&1
    row "step_profile cuBLAS (exit $?)" "see profile-cublas.log"
    COPPELIUS_PRODUCTS=own timeout 150 python3 dev/cuda/step_profile.py --batch ${BENCH_B:-8} \
        > "$OUT/profile-own.log" 2>&1
    row "step_profile own (exit $?)" "see profile-own.log"
fi
echo "================================================================ summary"
printf '%s\n' "${summary[@]}"
for f in "$OUT"/bench-*${BENCH_B:-8}.log; do [ -f "$f" ] && { echo "--- $f"; tail -6 "$f"; }; done
exit 0
