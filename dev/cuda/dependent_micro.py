"""What dependent launch buys between kernels, alone: a graph of N launches
of one small kernel (each adds 1 to a vector: BLOCKS blocks of 256 threads),
captured with plain launches and with dependent ones
(accelerated/cuda/dependent_launch.py), each replayed and timed with CUDA
events; microseconds a kernel, and the vector checked (N added everywhere).

    PYTHONPATH=. python dev/cuda/dependent_micro.py [--launches 400] [--blocks 1,132,1056]
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import dependent_launch  # noqa: E402

from bench_step import time_graph  # noqa: E402  (dev/cuda's: median ms of 20 replays)

SOURCE = r"""
extern "C" __global__ void add_one(float* x, long long n) {
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += 1.0f;
}
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--launches", type=int, default=400)
    p.add_argument("--blocks", default="1,132,1056")
    args = p.parse_args()
    plain = cupy.RawModule(code=SOURCE, options=("-arch=sm_90",)).get_function("add_one")
    dependent = dependent_launch.DependentKernel(plain, cupy)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        n = blocks * 256
        result = {}
        for name, kernel in (("plain", plain), ("dependent", dependent)):
            x = cupy.zeros(n, cupy.float32)
            with stream:
                stream.begin_capture()
                for _ in range(args.launches):
                    kernel((blocks,), (256,), (x, np.int64(n)), stream=stream)
                graph = stream.end_capture()
            ms = time_graph(types.SimpleNamespace(stream=stream), graph)
            stream.synchronize()
            replays = 22  # time_graph's: 20 timed after 2
            ok = bool((x == replays * args.launches).all())
            result[name] = (1e3 * ms / args.launches, ok)
        rows.append((blocks, result))
    print(f"\n{args.launches} launches a graph; us a kernel")
    print(f"{'blocks':>7} {'plain':>8} {'dependent':>10} {'saved':>7}  sums right")
    for blocks, r in rows:
        (t0, ok0), (t1, ok1) = r["plain"], r["dependent"]
        print(f"{blocks:>7} {t0:>8.2f} {t1:>10.2f} {t0 - t1:>7.2f}  {ok0 and ok1}")


if __name__ == "__main__":
    main()
