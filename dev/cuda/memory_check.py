"""Where the CuPy training step's device memory goes, and whether a change
kept every bit: for each B, one capture of the coppelius preset (bf16)
watched by a CuPy memory hook, then a few steps from a fixed state and
inputs, hashed.

    PYTHONPATH=. python dev/cuda/memory_check.py --batch 8 [--batch 32 ...] [--json FILE]
    PYTHONPATH=. python dev/cuda/memory_check.py --chunk-bytes N [...] [--chunk-batch 8 ...]
    python dev/cuda/memory_check.py --compare new.json old.json

Memory: the pool's growth over the capture (what `coppelius bench` reports
as peak memory: CuPy's pool never shrinks by itself) beside the memory
plan's account of it (the arena plus the state, constants, input slot and
workspace), and the pool's device allocations by the code that made them
(the innermost frames of the project's source; those given back to the
device before the capture ends, as the cuDNN trial's, included), so bytes
the plan does not know about (a library's scratch, a buffer kept alive by
mistake) have a name.

Bits: SHA-256 of the row losses of `--steps` steps, then the gradient, P, M
and V, and the held-out row losses of one evaluation; `--compare` lists
them for two trees' JSON (run this file with PYTHONPATH at each tree).

`--chunk-bytes`, `--workspace-mib`: where the tree has them
(policy.LOGITS_CHUNK_BYTES, the cuBLAS workspace WORKSPACE_BYTES of buffers.py and
program.py),
each value is captured and timed too (median device ms of `--time` steps,
and the pool's growth).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import buffers, policy, program as cuda_program  # noqa: E402
from coppelius.reference.config import Hyper, preset  # noqa: E402
from coppelius.reference.params import initialize  # noqa: E402
from coppelius.reference.state import State  # noqa: E402

MiB = 2 ** 20


def site(stack) -> str:
    """The innermost two frames of the project's own source, innermost first."""
    ours = [f for f in stack if os.sep + "accelerated" + os.sep in f.filename
            or os.sep + "coppelius" + os.sep in f.filename or "memory_check" in f.filename]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                      for f in reversed(ours[-2:])) or "(outside the project)"


def growth_hook():
    """A CuPy memory hook counting the pool's device allocations (its
    growth) by site, in .sites; None where CuPy has no hooks (the CPU
    stand-ins of emulate.py)."""
    base = getattr(getattr(cupy.cuda, "memory_hook", None), "MemoryHook", None)
    if base is None:
        return None

    class GrowthBySite(base):
        name = "GrowthBySite"

        def __init__(self):
            self.sites = collections.Counter()

        def alloc_postprocess(self, device_id, mem_size, mem_ptr):
            self.sites[site(traceback.extract_stack()[:-1])] += mem_size

    return GrowthBySite()


def sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def plan_bytes(program) -> int:
    plan = program.plan
    # the arena holds the activations and (trees that plan it) the gradient's segments
    return plan.arena_bytes + sum(b.nbytes for b in plan.buffers
                                  if b.kind not in ("activation", "gradient"))


RECOMPUTE = {}  # capture's recompute=MODE where --recompute asks (trees that have it)


def capture(config, batch, state):
    """(program, pool growth, growth by site or None)."""
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.total_bytes()
    hook = growth_hook()
    if hook is None:
        program = cuda_program.capture(config, Hyper(), "bf16", batch, state.copy(), **RECOMPUTE)
        return program, pool.total_bytes() - base, None
    with hook:
        program = cuda_program.capture(config, Hyper(), "bf16", batch, state.copy(), **RECOMPUTE)
    return program, pool.total_bytes() - base, hook.sites


def timed(program, config, batch, n, seed=1):
    rng = np.random.default_rng(seed)
    ms = []
    for _ in range(n + 2):
        program.upload_input(rng.integers(0, config.vocab, (batch, config.context + 1)))
        ms.append(1e3 * program.replay_timed_and_wait()[1])
    return float(np.median(ms[2:]))


def check(config, batch, steps, time_steps) -> dict:
    state = State.fresh(initialize(config))
    program, growth, sites = capture(config, batch, state)
    out = {"batch": batch, "growth_mib": growth / MiB, "plan_mib": plan_bytes(program) / MiB,
           "device_bytes_mib": program.compilation_report()["device_bytes"] / MiB,
           "arena_mib": program.plan.arena_bytes / MiB,
           "sites": [(s, n / MiB) for s, n in (sites or {}).items()]}
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(steps):
        program.upload_input(rng.integers(0, config.vocab, (batch, config.context + 1)))
        program.replay_and_wait()
        rows.append(program.row_losses())
    G, s = program.gradients(), program.state()
    held_out = rng.integers(0, config.vocab, (batch, config.context + 1))
    evaluated = program.evaluate(held_out)
    out["hashes"] = {"row losses": sha(*rows), "G": sha(G), "P": sha(s.P), "M": sha(s.M),
                     "V": sha(s.V), "held-out row losses": sha(evaluated)}
    out["loss"] = float(np.mean(rows[-1])) if rows else float("nan")
    out["step_ms"] = timed(program, config, batch, time_steps) if time_steps else None
    program.reset()
    return out


# the modules reading each size chunk_variants() varies
HOLDERS = {"LOGITS_CHUNK_BYTES": (policy,), "WORKSPACE_BYTES": (buffers, cuda_program)}


def chunk_variants(config, batch, values, time_steps, name="LOGITS_CHUNK_BYTES") -> list:
    """Capture and time the step with <name> set to each value in the
    modules that read it (HOLDERS: LOGITS_CHUNK_BYTES, or WORKSPACE_BYTES:
    cuBLAS's workspace)."""
    rows = []
    default = getattr(HOLDERS[name][0], name)
    state = State.fresh(initialize(config))
    try:
        for value in values:
            for module in HOLDERS[name]:
                setattr(module, name, value)
            program, growth, _ = capture(config, batch, state)
            chunk = program.acts.logits.shape[0]
            rows.append({"batch": batch, "name": name, "value": value, "chunk_rows": chunk,
                         "growth_mib": growth / MiB,
                         "step_ms": timed(program, config, batch, time_steps)})
            program.reset()
            print(f"  B={batch} {name}={value} (logits chunk {chunk} rows): "
                  f"{rows[-1]['step_ms']:.3f} ms, pool growth {growth / MiB:.0f} MiB", flush=True)
    finally:
        for module in HOLDERS[name]:
            setattr(module, name, default)
    return rows


def compare(paths) -> int:
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            runs.append({r["batch"]: r for r in json.load(f)["checks"]})
    new, old = runs
    differ = 0
    print(f"{'B':>3} {'what':<22} {'new':<16} {'old':<16}")
    for batch in sorted(set(new) & set(old)):
        for what, h in new[batch]["hashes"].items():
            other = old[batch]["hashes"][what]
            differ += h != other
            print(f"{batch:>3} {what:<22} {h:<16} {other:<16} {'same' if h == other else 'DIFFER'}")
    print(f"{'B':>3} {'pool growth MiB new':>20} {'old':>8} {'step ms new':>12} {'old':>8}")
    for batch in sorted(set(new) & set(old)):
        n, o = new[batch], old[batch]
        print(f"{batch:>3} {n['growth_mib']:>20.0f} {o['growth_mib']:>8.0f} "
              f"{n['step_ms'] or float('nan'):>12.3f} {o['step_ms'] or float('nan'):>8.3f}")
    return 1 if differ else 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="coppelius")
    parser.add_argument("--batch", type=int, action="append", default=[],
                        help="check this batch; repeatable")
    parser.add_argument("--steps", type=int, default=2, help="steps hashed (default: 2)")
    parser.add_argument("--time", type=int, default=0, help="steps timed after them")
    parser.add_argument("--chunk-bytes", type=int, action="append", default=[],
                        help="also capture and time with this LOGITS_CHUNK_BYTES; repeatable")
    parser.add_argument("--workspace-mib", type=int, action="append", default=[],
                        help="also capture and time with this cuBLAS workspace; repeatable")
    parser.add_argument("--chunk-batch", type=int, action="append",
                        help="the batches of --chunk-bytes and --workspace-mib; "
                             "repeatable (default: 8)")
    parser.add_argument("--recompute", nargs="?", const="gate-up", choices=("gate-up", "block"),
                        metavar="MODE",
                        help="capture with MODE's recomputation in the backward: gate-up (the "
                             "default MODE) or block (the bits must equal a run without)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--compare", nargs=2, metavar=("NEW", "OLD"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(args.compare))
    config = preset(args.preset)
    if args.recompute:
        RECOMPUTE["recompute"] = args.recompute
    checks, variants = [], []
    for batch in args.batch:
        r = check(config, batch, args.steps, args.time)
        checks.append(r)
        step = f", step {r['step_ms']:.3f} ms" if r["step_ms"] else ""
        print(f"B={batch}: pool growth {r['growth_mib']:.1f} MiB, the plan's {r['plan_mib']:.1f} "
              f"(arena {r['arena_mib']:.1f}), device_bytes {r['device_bytes_mib']:.1f}; "
              f"loss {r['loss']:.4f}{step}", flush=True)
        print("    bits: " + ", ".join(f"{what} {h}" for what, h in r["hashes"].items()))
        for s, n in sorted(r["sites"], key=lambda x: -x[1])[:12]:
            print(f"    {n:10.1f} MiB  {s}")
    for name, values in (("LOGITS_CHUNK_BYTES", args.chunk_bytes),
                         ("WORKSPACE_BYTES", [v * MiB for v in args.workspace_mib])):
        if values and hasattr(HOLDERS[name][0], name):
            for batch in args.chunk_batch or [8]:
                variants += chunk_variants(config, batch, values, args.time or 20, name)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"checks": checks, "variants": variants}, f, indent=1)


if __name__ == "__main__":
    main()
