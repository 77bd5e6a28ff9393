#!/bin/bash
# One call on the GPU machine: the GPU tests, the conformance suite (test and
# tiny presets, both precisions) and the step timing; a short table last.
# Full logs go to $OUT.   usage: bash dev/cuda/device_check.sh [pytest args]
cd "$(dirname "$0")/../.." || exit 2
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python -c "import cupy, coppelius.accelerated.cuda.cublas as c; c.library(); print('cupy', cupy.__version__, 'cublas', c.LOADED_FROM)"
timeout 120 python dev/cuda/nvrtc_check.py > "$OUT/nvrtc.log" 2>&1
echo "nvrtc exit $?"; tail -2 "$OUT/nvrtc.log"

# the backend's own tests, and the program contract's CuPy rows
timeout 240 python -m pytest tests/cuda tests/test_program_contract.py -k "cuda or cupy" \
    -q -p no:cacheprovider --tb=short "$@" \
    > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)|^E  " "$OUT/pytest.log" | cut -c1-300 | head -40

for preset in test tiny; do
    limit=$([ $preset = test ] && echo 60 || echo 110)
    timeout $limit python -m coppelius.conformance --backend cupy --preset $preset --precision fp32 \
        --precision bf16 --failures-only > "$OUT/conformance-$preset.log" 2>&1
    echo "conformance $preset exit $?"
    grep -v "^conformance" "$OUT/conformance-$preset.log" | head -30
done

timeout 150 python dev/cuda/bench_step.py --breakdown > "$OUT/bench.log" 2>&1
echo "bench exit $?"
timeout 90 python dev/cuda/bench_step.py --batch 8 --precision bf16 > "$OUT/bench-b8.log" 2>&1
echo "bench B=8 exit $?"

echo "================================================================ summary"
tail -3 "$OUT/pytest.log"
grep -h "^conformance" "$OUT"/conformance-*.log
cat "$OUT/bench.log"
tail -2 "$OUT/bench-b8.log"
