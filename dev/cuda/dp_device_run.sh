#!/bin/bash
# One call on the two-GPU machine (nvidia-h200-x2): the CuPy GPU tests on
# GPU 0 and the accumulation conformance (--accumulate 2 and 4) on GPU 1,
# beside the data-parallel checks (dev/cuda/dp_check.py, both GPUs); then
# `coppelius bench --gpus 2` alone (coppelius preset, bf16, 8 contexts per
# GPU). Logs under $OUT; a short summary last.
#   usage: [WHEELS=dir] bash dev/cuda/dp_device_run.sh
# WHEELS: a folder holding the nvidia-cudnn-frontend wheel (cuDNN's
# attention; the device has cuDNN, not the frontend).
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/dp_device}; mkdir -p "$OUT"
source dev/cuda/wheels.sh && install_wheels "$OUT/pip.log"
FE=${FE_DIR:+$FE_DIR:}
export PYTHONPATH=$FE$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
t0=$(date +%s)
(CUDA_VISIBLE_DEVICES=0 timeout 200 python -m pytest -q -p no:cacheprovider --tb=short \
    tests/cuda tests/test_program_contract.py -k "cuda or cupy" > "$OUT/pytest.log" 2>&1
 echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest.log") &
(for k in 2 4; do
    CUDA_VISIBLE_DEVICES=1 timeout 90 python -m coppelius.conformance --backend cupy \
        --accumulate $k --failures-only
    echo "conformance --accumulate $k exit $? after $(( $(date +%s) - t0 )) s"
 done > "$OUT/conformance.log" 2>&1) &
timeout 190 python dev/cuda/dp_check.py --out "$OUT" > "$OUT/dp_check.txt" 2>&1
echo "dp_check exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/dp_check.txt"
wait
timeout 100 python -m coppelius bench --gpus 2 --preset coppelius --batch 8 --steps 30 \
    --warmup 5 > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
echo "================================================================ summary"
tail -3 "$OUT/pytest.log"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | cut -c1-250 | head -20
cat "$OUT/conformance.log" | cut -c1-250 | tail -20
cat "$OUT/dp_check.txt"
cat "$OUT/bench.log"
