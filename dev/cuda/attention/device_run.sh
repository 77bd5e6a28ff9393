#!/bin/bash
# One call on the GPU machine for the fused attention: its check against the
# reference model's attention and its timing against the materialized path, then the
# backend's whole device check (GPU tests, conformance, step timing).
cd "$(dirname "$0")/../../.." || exit 2
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_check}; mkdir -p "$OUT"
timeout 200 python dev/cuda/attention/check.py > "$OUT/attention.log" 2>&1
echo "attention check exit $?"
# grouped heads (H = 12, Hkv = 4) at the production context
timeout 200 python dev/cuda/attention/check.py --preset llama-124m --batch 1 --batch 8 \
    >> "$OUT/attention.log" 2>&1
echo "attention check (llama-124m) exit $?"
bash dev/cuda/device_check.sh
echo "================================================================ attention"
cat "$OUT/attention.log"
