#!/bin/bash
# On the GPU machine: does a restructured tree step bit for bit and as fast
# as an earlier one? OLD names the earlier tree (a folder with its files,
# e.g. `git archive <commit> | tar -x -C .old`). For each (preset, policy,
# batch): the digests of dev/cuda/step_digest.py under both trees, then
# `coppelius bench` of both, alternated (old, new, old, new), without the
# peers. Logs under $OUT; a short table last.
# WHEELS: a folder holding the nvidia-cudnn-frontend wheel (cuDNN's
# attention, the bf16 step's path; the device has cuDNN, not the frontend).
#     OLD=.old WHEELS=.whl bash dev/cuda/same_tree_check.sh
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1
OLD=${OLD:-.old}; OUT=${OUT:-/tmp/same_tree_check}; mkdir -p "$OUT"
NEW=$PWD; OLD=$(cd "$OLD" && pwd) || exit 2
source dev/cuda/wheels.sh && install_wheels "$OUT/pip.log"
FE=${FE_DIR:+:$FE_DIR}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=$NEW$FE python -c "from coppelius.accelerated.cuda import cudnn_attention as c; \
print('cuDNN frontend', c.versions() if hasattr(c, 'versions') else c.frontend().__version__)"
digest() {  # tree, args...
    local tree=$1; shift
    (cd "$tree" && PYTHONPATH=$tree$FE timeout 120 python "$NEW/dev/cuda/step_digest.py" "$@")
}
same=0; differ=0
for args in "--preset tiny" "--preset coppelius --batch 8 --precision bf16" \
            "--preset coppelius --batch 1 --precision fp32 --steps 2"; do
    digest "$OLD" $args > "$OUT/old.txt" 2>&1
    digest "$NEW" $args > "$OUT/new.txt" 2>&1
    cat "$OUT/old.txt" >> "$OUT/digests-old.log"; cat "$OUT/new.txt" >> "$OUT/digests-new.log"
    while read -r line; do
        if grep -qxF "$line" "$OUT/old.txt"; then same=$((same + 1)); echo "same   $line"
        else differ=$((differ + 1)); echo "DIFFER $line"; fi
    done < <(grep "^cupy" "$OUT/new.txt")
    [ -s "$OUT/new.txt" ] && grep -q "^cupy" "$OUT/new.txt" || { differ=$((differ + 1)); tail -5 "$OUT/new.txt"; }
done
for round in 1 2; do
    for which in old new; do
        tree=$OLD; [ $which = new ] && tree=$NEW
        (cd "$tree" && PYTHONPATH=$tree$FE timeout 150 python -m coppelius bench --preset coppelius \
            --backend cupy --precision bf16 --no-peer --no-reference --batch 1 --batch 8 \
            --steps 30 --warmup 5) > "$OUT/bench-$which-$round.log" 2>&1
        echo "bench $which round $round exit $?"
    done
done
echo "================================================================ summary"
echo "digest lines equal: $same, different or missing: $differ"
for f in "$OUT"/bench-*.log; do echo "-- $(basename "$f")"; grep -E "cupy|ms" "$f" | tail -4; done
