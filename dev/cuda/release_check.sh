#!/bin/bash
# One call on the GPU machine before a release: the whole test suite, the
# conformance suite on CuPy, the step timing beside the PyTorch peer in one
# run, and the main job (`coppelius train` with its defaults, then a resume).
# Logs go to $OUT; a short table is printed last.
cd "$(dirname "$0")/../.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/release_check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

timeout 240 python -m pytest -q -p no:cacheprovider -x tests > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20

for preset in test tiny; do
    timeout 120 python -m coppelius.conformance --backend cupy --preset $preset > "$OUT/conformance-$preset.log" 2>&1
    echo "conformance $preset exit $?"
done

for B in 1 8; do
    timeout 150 python -m coppelius bench --preset coppelius --backend cupy --precision bf16 \
        --precision fp32 --no-reference --batch $B --steps 30 --warmup 5 > "$OUT/bench-B$B.log" 2>&1
    echo "bench B=$B exit $?"
done

run=$(mktemp -d); cd "$run" || exit 2
( time timeout 300 python -m coppelius train --steps 3000 ) > "$OUT/train.log" 2>&1
echo "train exit $?"
timeout 120 python -m coppelius train --steps 500 --no-sample > "$OUT/resume.log" 2>&1
echo "resume exit $?"
python -m coppelius inspect runs/coppelius/checkpoint.bin > "$OUT/inspect.log" 2>&1
python -m coppelius report runs/coppelius/results-3000.bin >> "$OUT/inspect.log" 2>&1
cd - > /dev/null

echo "================================================================ summary"
tail -1 "$OUT/pytest.log"
grep -h "^conformance" "$OUT"/conformance-*.log
cat "$OUT/bench-B1.log" "$OUT/bench-B8.log"
grep -v "^step " "$OUT/train.log" | tail -16
grep -E "^trained|^checkpoint" "$OUT/resume.log"
grep -E "^step|^contexts|^sha256|steps|loss" "$OUT/inspect.log" | head -12
