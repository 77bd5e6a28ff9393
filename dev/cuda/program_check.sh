#!/bin/bash
# The captured program's surface on the GPU machine (SPEC 13), in one call of
# under five minutes: the CuPy tests and the program contract's CuPy rows,
# the conformance suite on CuPy, `coppelius program` on the production model
# at B = 1, 8, 32, then the memory plan measured: for the coppelius preset at
# B = 1, 8 and 32 (bf16, the CUDA default), the pool's peak, the program's
# device bytes and the plan's savings with the plan on and off
# (COPPELIUS_NO_MEMORY_PLAN=1), the CUDA-graph replay time (median of 20
# device-timed replays) both ways, and whether both ways give the same bits.
# Logs go to $OUT; the table is printed last.
cd "$(dirname "$0")/../.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/o}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0

timeout 130 python -m pytest -q -p no:cacheprovider tests/cuda \
    tests/test_program_contract.py -k "cuda or cupy" > "$OUT/pytest.log" 2>&1
rc=$?; echo "pytest exit $rc"; [ $rc -eq 0 ] || status=1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20

timeout 50 python -m coppelius.conformance --backend cupy > "$OUT/conformance.log" 2>&1
rc=$?; echo "conformance exit $rc"; [ $rc -eq 0 ] || status=1

for B in 1 8 32; do
    timeout 40 python -m coppelius program --backend cupy --preset coppelius --batch $B \
        > "$OUT/program-B$B.json" 2> "$OUT/program-B$B.err"
    rc=$?; echo "program B=$B exit $rc"; [ $rc -eq 0 ] || { status=1; cat "$OUT/program-B$B.err"; }
done

timeout 100 python - > "$OUT/memory.log" 2>&1 <<'EOF'
import gc
import hashlib
import os
import statistics

import cupy
import numpy as np

from coppelius.accelerated.cuda.program import capture
from coppelius.reference.config import Hyper, preset
from coppelius.reference.params import initialize
from coppelius.reference.state import State

config = preset("coppelius")
state = State.fresh(initialize(config))  # once: 57.7M values on the host
pool = cupy.get_default_memory_pool()
rows = []
for B in (1, 8, 32):
    tokens = np.random.default_rng(B).integers(0, config.vocab, (B, config.context + 1))
    seen = {}
    for plan in ("on", "off"):
        if plan == "off":
            os.environ["COPPELIUS_NO_MEMORY_PLAN"] = "1"
        else:
            os.environ.pop("COPPELIUS_NO_MEMORY_PLAN", None)
        gc.collect()
        pool.free_all_blocks()  # the pool's total now grows from this program alone
        base = pool.total_bytes()
        program = capture(config, Hyper(), "bf16", B, state.copy())
        program.upload_input(tokens)
        program.replay_and_wait()
        digest = hashlib.sha256(program.row_losses().tobytes() + program.gradients().tobytes())
        seen[plan] = digest.hexdigest()
        for _ in range(3):
            program.replay_and_wait()
        ms = [program.replay_timed().device_seconds() * 1e3 for _ in range(20)]
        report = program.compilation_report()
        peak = pool.total_bytes() - base  # the pool never shrinks by itself: its high mark
        rows.append((B, plan, peak, report["device_bytes"], report["memory_saved_bytes"],
                     statistics.median(ms)))
        program.reset()
        del program
    rows.append((B, "bitwise", seen["on"] == seen["off"]))
    print(f"B={B}: plan on and off give the same row losses and G bit for bit: "
          f"{seen['on'] == seen['off']}", flush=True)
print()
print("coppelius preset, bf16   pool peak   device_bytes   plan saves   step ms (median of 20)")
for row in rows:
    if row[1] == "bitwise":
        continue
    B, plan, peak, device, saved, ms = row
    print(f"B={B:<2} plan {plan:<3}  {peak / 2**30:9.3f} GiB {device / 2**30:10.3f} GiB "
          f"{saved / 2**20:9.1f} MiB   {ms:8.3f}")
if not all(row[2] for row in rows if row[1] == "bitwise"):
    raise SystemExit("the planned and unplanned steps differ")
EOF
rc=$?; echo "memory exit $rc"; [ $rc -eq 0 ] || status=1

echo "================================================================ summary"
tail -1 "$OUT/pytest.log"
grep -h "^conformance" "$OUT/conformance.log"
for B in 1 8 32; do
    python - "$OUT/program-B$B.json" <<'EOF' 2>/dev/null || echo "program B=$B: no report"
import json, sys
d = json.load(open(sys.argv[1]))
m, p, l = d["memory_analysis"], d["dnn_plan"], d["lowering_analysis"]
print(f"program {d['name']}: captured {d['captured']}, partitions applied "
      f"{p['applied_partition_count']}/{p['partition_count']}, {l['executable_node_count']} nodes "
      f"for {l['operation_count']} operations, memory plan saves "
      f"{m['materialized_savings_bytes'] / 2**20:.1f} MiB of {m['unplanned_bytes'] / 2**20:.1f}")
EOF
done
sed -n '/^coppelius preset/,$p' "$OUT/memory.log"
grep -E "same row losses|Error|error" "$OUT/memory.log" | head -5
exit $status
