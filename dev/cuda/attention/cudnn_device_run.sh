#!/bin/bash
# One call on a two-GPU machine for cuDNN's attention. GPU 0: the check and
# the per-layer table of every attention path (cudnn_check.py), then the
# B=8 step with its breakdown with cuDNN off (the project's kernels) and on.
# GPU 1 meanwhile: another frontend release's quick check (ALT, optional),
# the GPU tests of the attention paths, the conformance suite (tiny and
# coppelius, bf16). Logs under $OUT; a summary last.
#   usage: WHEELS=dir [ALT=dir] bash dev/cuda/attention/cudnn_device_run.sh
# WHEELS, ALT: folders holding an nvidia-cudnn-frontend wheel each (the
# device has cuDNN itself as nvidia-cudnn-cu13, not the frontend), e.g.
# WHEELS=$PWD/.whl with 1.32.0, installed without its dependencies.
cd "$(dirname "$0")/../../.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cudnn_run}; mkdir -p "$OUT"
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl; }
pip_install "$WHEELS" /tmp/fe || exit 2
[ -n "$ALT" ] && pip_install "$ALT" /tmp/fe-alt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip show nvidia-cudnn-cu13 2>/dev/null | grep -E "^(Name|Version)"

(
    export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=12 OPENBLAS_NUM_THREADS=12
    if [ -n "$ALT" ]; then
        PYTHONPATH=/tmp/fe-alt:$PYTHONPATH timeout 45 python3 dev/cuda/attention/cudnn_check.py \
            --quick --batch 8 > "$OUT/alt.log" 2>&1
        echo "alt exit $?" >> "$OUT/alt.log"
    fi
    export PYTHONPATH=/tmp/fe:$PYTHONPATH
    timeout 120 python3 -m pytest tests/cuda tests/test_program_contract.py \
        -q -p no:cacheprovider --tb=short -rs \
        -k "(cuda or cupy) and (attention or cudnn or one_step or compilation_report or memory_plan or rope or executable or reset or eager or captured or replay)" \
        > "$OUT/pytest.log" 2>&1
    echo "pytest exit $?" >> "$OUT/pytest.log"
    timeout 45 python3 -m coppelius.conformance --backend cupy --preset tiny --precision bf16 \
        --failures-only > "$OUT/conformance.log" 2>&1
    echo "tiny exit $?" >> "$OUT/conformance.log"
    timeout 60 python3 -m coppelius.conformance --backend cupy --preset coppelius --precision bf16 \
        --steps 2 --failures-only >> "$OUT/conformance.log" 2>&1
    echo "coppelius exit $?" >> "$OUT/conformance.log"
) &
other=$!

export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/fe:$PYTHONPATH
timeout 110 python3 dev/cuda/attention/cudnn_check.py > "$OUT/check.log" 2>&1
echo "check exit $?" >> "$OUT/check.log"
if grep -q "^graphs B=8: built" "$OUT/check.log"; then
    for run in before after; do
        [ $run = before ] && export COPPELIUS_NO_CUDNN=1 || unset COPPELIUS_NO_CUDNN
        timeout 60 python3 dev/cuda/bench_step.py --batch 8 --precision bf16 --breakdown \
            --steps 10 --warmup 3 > "$OUT/bench-$run.log" 2>&1
        echo "bench $run exit $?" >> "$OUT/bench-$run.log"
    done
fi
wait $other

echo "================================================================ summary"
for f in alt check pytest conformance bench-before bench-after; do
    [ -f "$OUT/$f.log" ] || continue
    echo "---- $f"
    case $f in
        pytest) grep -E "^(FAILED|ERROR|SKIPPED)|^E  |passed|failed|exit" "$OUT/$f.log" | cut -c1-400 | head -40 ;;
        bench-*) grep -E "cuDNN|kernel attention|kernel rope|forward|backward|products|^bf16|exit" "$OUT/$f.log" ;;
        check) cut -c1-300 "$OUT/$f.log" ;;
        *) cut -c1-400 "$OUT/$f.log" | tail -30 ;;
    esac
done
