"""Time the CuPy backend's training step: median ms per step (one upload,
one graph replay, waited for) on the coppelius preset, and where the device
time goes.

    PYTHONPATH=. python dev/cuda/bench_step.py [--preset coppelius] [--batch 1]
        [--precision bf16 --precision fp32] [--steps 30] [--breakdown]

The breakdown records extra graphs from the captured program's own buffers:
the forward, the backward and AdamW alone; the step with only cuDNN's
attention (where the step uses it); with only its cuBLAS products; and with
only the launches of one kernel; each replayed and timed with CUDA events
(median of 20). They run on whatever the buffers hold
after the timed steps (real activations, not zeros).

Floor for one coppelius B=1 step on an H200: 0.51 ms of
bf16 matrix work, 0.38 ms of AdamW traffic. The PyTorch peer: 4.77 ms
(torch.compile + CUDA graph), 51.8 ms (eager).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import cudnn_attention  # noqa: E402
from coppelius.accelerated.cuda.program import capture  # noqa: E402
from coppelius.accelerated.cuda.step import run_step_tail  # noqa: E402
from coppelius.bench import flops_per_step  # noqa: E402
from coppelius.reference.config import Hyper, preset  # noqa: E402
from coppelius.reference.params import initialize  # noqa: E402
from coppelius.reference.state import State  # noqa: E402

PEER = {"torch.compile + CUDA graph": 4.77, "eager": 51.8}  # ms, B=1, bf16, measured on an H200


def record(program, work):
    s = program.stream
    with s:
        s.begin_capture()
        try:
            work()
        finally:
            graph = s.end_capture()
    return graph


def time_graph(program, graph, n=20):
    s = program.stream
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    ms = []
    for _ in range(n + 2):
        start.record(s)
        graph.launch(stream=s)
        end.record(s)
        end.synchronize()
        ms.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(ms[2:]))


def breakdown(program):
    m, a, k, T = program.model, program.acts, program.kernels, program.config.context
    rows = []
    parts = {
        "forward (to the final norm)": lambda: m.forward(a, program.ids, T + 1),
        "classifier, loss + backward": lambda: m.backward(a, program.ids, T + 1),
        "norm + adamw": lambda: run_step_tail(program.model, program.kernels,
                                                           program.buffers),
    }
    for name, work in parts.items():
        rows.append((name, time_graph(program, record(program, work))))
    # cuDNN's attention alone, then the step without it: with only its
    # products, then with only one kernel's launches
    execute = cudnn_attention.Graph.execute
    gemm = program.blas.gemm
    if program.recorded.get("library_calls"):
        k._launch = lambda *args, **kw: None
        program.blas.gemm = lambda *args, **kw: None
        try:
            rows.append(("cuDNN attention only", time_graph(program, record(program, program._step))))
        finally:
            del k._launch
            program.blas.gemm = gemm
    cudnn_attention.Graph.execute = lambda *args, **kw: None
    try:
        rows += breakdown_without_cudnn(program, k)
    finally:
        cudnn_attention.Graph.execute = execute
    return rows


def breakdown_without_cudnn(program, k):
    rows = []
    k._launch = lambda *args, **kw: None
    try:
        rows.append(("cuBLAS products only", time_graph(program, record(program, program._step))))
    finally:
        del k._launch
    gemm = program.blas.gemm
    for label, keep in (("  attention products (batched)", lambda kw: kw.get("batch", 1) > 1),
                        ("  linear products", lambda kw: kw.get("batch", 1) == 1)):
        k._launch = lambda *args, **kw: None
        program.blas.gemm = lambda *args, _keep=keep, **kw: gemm(*args, **kw) if _keep(kw) else None
        try:
            rows.append((label, time_graph(program, record(program, program._step))))
        finally:
            del k._launch
            program.blas.gemm = gemm
    program.blas.gemm = lambda *args, **kw: None
    try:
        for name in program.recorded["kernels"]:
            launch = type(k)._launch

            def only(self_name, grid, block, args, shared_mem=0, _want=name, _launch=launch):
                if self_name == _want:
                    _launch(k, self_name, grid, block, args, shared_mem)

            k._launch = only
            try:
                rows.append((f"  kernel {name}", time_graph(program, record(program, program._step))))
            finally:
                del k._launch
    finally:
        program.blas.gemm = gemm
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="coppelius")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--precision", action="append")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    config = preset(args.preset)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device {props['name'].decode()}, CuPy {cupy.__version__}, preset {args.preset}, "
          f"B={args.batch}, T={config.context}")
    rng = np.random.default_rng(0)
    results = []
    for precision in args.precision or ["bf16", "fp32"]:
        start = time.perf_counter()
        program = capture(config, Hyper(), precision, args.batch,
                                       State.fresh(initialize(config)))
        capture_s = time.perf_counter() - start
        host, device, losses = [], [], []
        for i in range(args.warmup + args.steps):
            tokens = rng.integers(0, config.vocab, (args.batch, config.context + 1))
            t0 = time.perf_counter()
            program.upload_input(tokens)
            loss, seconds = program.replay_timed_and_wait()
            t1 = time.perf_counter()
            losses.append(loss)
            if i >= args.warmup:
                host.append(1e3 * (t1 - t0))
                device.append(1e3 * seconds)
        report = program.compilation_report()
        ms = float(np.median(host))
        results.append((precision, capture_s, ms, float(np.median(device)), min(host),
                        flops_per_step(config, args.batch) / (ms / 1e3) / 1e12, losses[0],
                        losses[-1], report["graph_nodes"], report["device_bytes"]))
        if args.breakdown:
            print(f"\n{precision}: device ms per part (graph replays, median of 20)")
            for name, t in breakdown(program):
                print(f"  {name:<40} {t:8.3f}")
        del program
    print(f"\n{'precision':<9} {'capture s':>9} {'median ms':>9} {'device ms':>9} {'min ms':>7} "
          f"{'TFLOP/s':>7} {'loss 0':>7} {'loss n':>7} {'nodes':>6} {'GB':>6}  x peer (4.77 / 51.8)")
    for p, cap, ms, dms, mn, tf, l0, ln, nodes, nbytes in results:
        print(f"{p:<9} {cap:>9.1f} {ms:>9.3f} {dms:>9.3f} {mn:>7.3f} {tf:>7.1f} {l0:>7.3f} "
              f"{ln:>7.3f} {nodes:>6} {nbytes / 1e9:>6.2f}  {ms / PEER['torch.compile + CUDA graph']:.2f}"
              f" / {ms / PEER['eager']:.3f}")


if __name__ == "__main__":
    main()
