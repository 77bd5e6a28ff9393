#!/bin/bash
# On the GPU machine: every model family (SPEC 21) and SPEC 23's scale on the
# CuPy backend.
#   PART=tests        the gpu-marked tests (tests/cuda, the contract's cupy rows)
#   PART=conformance  the conformance suite of each family preset (PRESETS), and
#                     of the members of dev/cuda/families/ (MODELS: a glob; the
#                     head-dim-64 ones so cuDNN's and the fused kernels'
#                     attention serve them, wide*.toml past a warp's 1024
#                     features), fp32 and bf16, B = 1 and 8; the fused kernels'
#                     path forced once
#   PART=shapes       dev/cuda/scale_shapes.py: head dims, long contexts, a
#                     large vocabulary, the widest rows, against the reference
#   PART=digest       the default presets' steps against an earlier tree (OLD),
#                     bit for bit (the families change no bit of them)
#   PART=bench        llama-124m beside the PyTorch peer of the same model;
#                     BENCH="bench/models/a.toml ...": those model files instead,
#                     each at its own batch (BENCHARGS: more bench options)
# WHEELS: a folder holding the nvidia-cudnn-frontend wheel. Logs under $OUT,
# a short table last.
#     PART=conformance WHEELS=.whl bash dev/cuda/family_check.sh
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/family_check}; mkdir -p "$OUT"
source dev/cuda/wheels.sh && install_wheels "$OUT/pip.log"
FE=${FE_DIR:+:$FE_DIR}
export PYTHONPATH=$PWD$FE
summary=()
row() { summary+=("$(printf '%-58s %s' "$1" "$2")"); }

if [[ ${PART:-} == *tests* ]]; then
    timeout 420 python -m pytest -m gpu -q -p no:cacheprovider -x > "$OUT/tests.log" 2>&1
    row "pytest -m gpu (exit $?)" "$(tail -1 "$OUT/tests.log")"
fi

verdicts() {  # a conformance log -> "fp32 221/221 PASS; bf16 ..." (or its last line)
    grep -E ' checks, ' "$1" | sed -E 's/^conformance [a-z]+ ([a-z0-9]+) .*: ([0-9]+) checks, ([0-9]+) passed.*: ([A-Z]+)$/\1 \3\/\2 \4/' \
        | paste -sd';' | grep . || tail -1 "$1"
}
conformance() {  # label, args...
    local label=$1; shift
    local log="$OUT/conf-${label//[^A-Za-z0-9_.-]/_}.log"
    timeout 240 python -m coppelius.conformance --backend cupy --failures-only --steps 8 "$@" \
        > "$log" 2>&1
    row "$label (exit $?)" "$(verdicts "$log")"
}
if [[ ${PART:-} == *conformance* ]]; then
    for preset in ${PRESETS-test-llama test-qwen test-stablelm}; do
        for B in 1 8; do conformance "$preset B=$B" --preset "$preset" --batch $B; done
    done
    for model in ${MODELS:-dev/cuda/families/*.toml}; do
        name=$(basename "$model" .toml)
        for B in 1 8; do conformance "$name B=$B" --model "$model" --batch $B; done
        conformance "$name B=8 accumulate 2" --model "$model" --batch 8 --accumulate 2 \
            --precision bf16
        log="$OUT/conf-$name-fused.log"
        timeout 240 python - "$model" > "$log" 2>&1 <<'PY'
import sys
from coppelius.accelerated.cuda import cupy_debug
from coppelius.cli import main
with cupy_debug.fused_from_batch(1):
    sys.exit(main(["conformance", "--backend", "cupy", "--model", sys.argv[1], "--batch", "4",
                   "--precision", "bf16", "--steps", "8", "--failures-only"]))
PY
        row "$name B=4 fused kernels (exit $?)" "$(verdicts "$log")"
    done
fi

if [[ ${PART:-} == *shapes* ]]; then
    timeout 500 python dev/cuda/scale_shapes.py > "$OUT/shapes.log" 2>&1
    row "scale shapes (exit $?)" "see shapes.log"
fi

if [[ ${PART:-} == *digest* ]]; then
    OLD=$(cd "${OLD:-.old}" && pwd) || exit 2
    same=0; differ=0
    for args in "--preset tiny" "--preset coppelius --batch 8 --precision bf16" \
                "--preset coppelius --batch 1 --precision fp32 --steps 2" \
                "--preset test-llama --batch 8 --precision bf16"; do
        (cd "$OLD" && PYTHONPATH=$OLD$FE timeout 120 python "$PWD/dev/cuda/step_digest.py" $args) \
            > "$OUT/old.txt" 2>&1
        timeout 120 python dev/cuda/step_digest.py $args > "$OUT/new.txt" 2>&1
        while read -r line; do
            if grep -qxF "$line" "$OUT/old.txt"; then same=$((same + 1))
            else differ=$((differ + 1)); echo "DIFFER $line" >> "$OUT/digest.log"; fi
        done < <(grep "^cupy" "$OUT/new.txt")
        grep -q "^cupy" "$OUT/new.txt" || { differ=$((differ + 1)); tail -3 "$OUT/new.txt" >> "$OUT/digest.log"; }
    done
    row "default presets' digests, old tree vs this one" "equal $same, different or missing $differ"
fi

if [[ ${PART:-} == *bench* ]]; then
    if [ -z "${BENCH:-}" ]; then
        timeout 400 python -m coppelius bench --preset llama-124m --backend cupy --precision bf16 \
            --no-reference --batch 1 --batch 8 --steps 20 --warmup 5 --json "$OUT/bench.json" \
            > "$OUT/bench.log" 2>&1
        row "bench llama-124m (exit $?)" "see bench.log"
    fi
    for model in ${BENCH:-}; do
        name=$(basename "$model" .toml)
        timeout 300 python -m coppelius bench --model "$model" --backend cupy --precision bf16 \
            --no-reference --steps 10 --warmup 3 ${BENCHARGS:-} --json "$OUT/bench-$name.json" \
            > "$OUT/bench-$name.log" 2>&1
        row "bench $name (exit $?)" "$(grep -E '^\| *(cupy|CuPy)' "$OUT/bench-$name.log" | head -1)"
        tail -8 "$OUT/bench-$name.log" >> "$OUT/bench.log"
    done
fi

echo "================================================================ summary"
printf '%s\n' "${summary[@]}"
[ -f "$OUT/bench.log" ] && tail -12 "$OUT/bench.log"
[ -f "$OUT/digest.log" ] && head -5 "$OUT/digest.log"
exit 0
