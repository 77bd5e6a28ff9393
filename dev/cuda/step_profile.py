"""Where a replayed training step's device time goes, and how much of it
the GPU runs nothing: this project's captured CuPy step and the PyTorch
peer's (torch.compile + one CUDA graph), each replayed as a graph under
torch.profiler (CUPTI sees the kernels of any library's graph on the
device), kernel by kernel.

    PYTHONPATH=. python dev/cuda/step_profile.py [--batch 1 --batch 8] [--steps 5]
        [--model bench/models/gpt-890m.toml] [--top 8]

Per step (median over the profiled replays): the span from the first
kernel's start to the last one's end, the time some kernel runs (the union
of the kernels' intervals), the gaps (span minus busy: launch latency
between the graph's nodes, and waits), the kernel count, and the busy time
by group: cuBLAS products, attention (cuDNN), the project's own kernels
(or the peer's Triton kernels), the rest.

The project's step is captured with plain launches unless
--dependent-launch: a dependent launch starts before its predecessor ends
and waits inside (accelerated/cuda/dependent_launch.py), and CUPTI counts
that wait as the kernel's time, so each kernel's time and the busy time
would include the waits and the gaps would look smaller (H200, B = 8: gaps
0.337 ms with plain launches, 0.193 with dependent ones, the span 11.40 and
11.27 ms).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from coppelius.accelerated.cuda import dependent_launch  # noqa: E402
from coppelius.accelerated.cuda.compile import KERNELS  # noqa: E402
from coppelius.accelerated.cuda.program import capture  # noqa: E402
from coppelius.bench.torch_peer import CompiledGraphStep  # noqa: E402
from coppelius.reference.config import Hyper, config_from_toml, preset  # noqa: E402
from coppelius.reference.params import initialize  # noqa: E402
from coppelius.reference.state import State  # noqa: E402

GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce", "sm90_")
ATTENTION = ("cudnn", "flash", "fmha", "sdpa", "attention")
OURS = set(KERNELS)


def group(name: str) -> str:
    low = name.lower()
    if name in OURS:
        return "own kernels"
    if any(s in low for s in ATTENTION):
        return "attention"
    if any(s in low for s in GEMM):
        return "products"
    if "triton" in low:
        return "triton"
    return "other"


def profiled(replay, steps: int) -> list:
    """[(name, start us, end us)] of every kernel of `steps` replays, each
    replay waited for and followed by 2 ms of idle device (the split)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
            torch.cuda.synchronize()
            time.sleep(0.002)
    out = []
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda k: k[1])


def per_step(kernels: list) -> list:
    """Split where the device idled over 1 ms; per step: span, busy, count, busy by group."""
    steps, current = [], []
    for k in kernels:
        if current and k[1] - max(c[2] for c in current[-64:]) > 1000:
            steps.append(current)
            current = []
        current.append(k)
    steps.append(current)
    out = []
    for ks in steps:
        span = max(k[2] for k in ks) - ks[0][1]
        busy, end = 0.0, -1e300
        groups = collections.Counter()
        for name, start, stop in ks:
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
            groups[group(name)] += stop - start
        out.append({"span": span, "busy": busy, "count": len(ks), "groups": groups})
    return out


def summary(label: str, kernels: list, top_n: int) -> dict:
    steps = per_step(kernels)
    med = lambda key: float(np.median([s[key] for s in steps])) / 1e3  # noqa: E731  ms
    groups = collections.Counter()
    for s in steps:
        groups.update({g: t / len(steps) / 1e3 for g, t in s["groups"].items()})
    top = collections.Counter()
    for name, start, stop in kernels:
        top[name[:70]] += (stop - start) / len(steps) / 1e3
    row = {"who": label, "steps": len(steps), "span": med("span"), "busy": med("busy"),
           "count": int(np.median([s["count"] for s in steps])), "groups": dict(groups),
           "top": top.most_common(top_n)}
    row["gaps"] = row["span"] - row["busy"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="coppelius")
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--model", help="a model file (SPEC 17): its shape, and its batch "
                        "where --batch is not given")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=8, help="kernels listed per step")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--dependent-launch", action="store_true",
                        help="capture with dependent launches (the waits then count as the "
                             "kernels' time)")
    args = parser.parse_args()
    os.environ[dependent_launch.ENV] = "on" if args.dependent_launch else "off"
    config, defaults = preset(args.preset), {}
    if args.model:
        config, defaults = config_from_toml(args.model, config)
    rows = []
    for B in args.batch or ([defaults["batch"]] if "batch" in defaults else [1, 8]):
        tokens = np.random.default_rng(B).integers(0, config.vocab, (B, config.context + 1))
        program = capture(config, Hyper(), "bf16", B,
                                       State.fresh(initialize(config)))
        program.upload_input(tokens)
        for _ in range(3):
            program.replay_and_wait()

        rows.append((B, summary("cupy", profiled(program.replay, args.steps), args.top)))
        program.reset()
        del program
        if not args.no_peer:
            peer = CompiledGraphStep(config, initialize(config), tokens)
            for _ in range(3):
                peer.replay()
            rows.append((B, summary("torch.compile + graph", profiled(peer.replay, args.steps),
                                 args.top)))
            del peer
            torch.cuda.empty_cache()
    for B, r in rows:
        print(f"\nB={B} {r['who']}: {r['steps']} steps profiled; per step "
              f"(median) span {r['span']:.3f} ms, busy {r['busy']:.3f}, gaps {r['gaps']:.3f} "
              f"({100 * r['gaps'] / r['span']:.1f}%), {r['count']} kernels "
              f"({1e3 * r['gaps'] / max(r['count'], 1):.2f} us of gap per kernel)")
        for g, t in sorted(r["groups"].items(), key=lambda kv: -kv[1]):
            print(f"    {g:<14} {t:7.3f} ms")
        for name, t in r["top"]:
            print(f"    {t:7.3f}  {name}")
    print(f"\n{'B':>3} {'who':<24} {'span ms':>8} {'busy':>7} {'gaps':>7} {'kernels':>8}")
    for B, r in rows:
        print(f"{B:>3} {r['who']:<24} {r['span']:8.3f} {r['busy']:7.3f} {r['gaps']:7.3f} "
              f"{r['count']:>8}")


if __name__ == "__main__":
    main()
