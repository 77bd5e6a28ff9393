#!/bin/bash
# On the GPU machine: the README's scale table, `coppelius bench --model FILE`
# for each of bench/models/gpt-$MODELS.toml at the file's own B, beside the
# peers, one run each; gpt-1b3 with --one-at-a-time (its implementations do
# not fit on the device together). Logs and JSON under $OUT, a short table
# last. WHEELS: a folder holding the nvidia-cudnn-frontend wheel.
#     MODELS="340m e128 t4096" WHEELS=.whl bash dev/cuda/scale_bench_run.sh
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scale_bench}; mkdir -p "$OUT"
source dev/cuda/wheels.sh && install_wheels "$OUT/pip.log"
export PYTHONPATH=$PWD${FE_DIR:+:$FE_DIR}
for m in ${MODELS:-340m e128 t4096}; do
    extra=()
    [[ $m == 1b3 ]] && extra=(--one-at-a-time)
    timeout ${BENCH_S:-280} python3 -m coppelius bench --model "bench/models/gpt-$m.toml" \
        --backend cupy --precision bf16 --no-reference --steps ${STEPS:-10} --warmup 3 \
        ${RECOMPUTE:+--recompute $RECOMPUTE} "${extra[@]}" --json "$OUT/$m.json" \
        > "$OUT/$m.log" 2>&1
    echo "== gpt-$m (exit $?)"
    tail -n ${TAIL:-8} "$OUT/$m.log" | cut -c1-170
done
