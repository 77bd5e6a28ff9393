"""The input gradient with the layer norm's backward in its epilogue
(products.LNBACK, kernels/gemm_sm90.cu's lnback) beside the two unfused
paths it replaces: cuBLAS's float32 dX product then the layernorm_backward
kernel (the step's before), and the own float32 dX product then the same
kernel; at the q | k | v and gate/up products' K, B = 8 and 32 rows of
T = 1024, d_model 512. Each path's outputs (dx, its operand, h, the
partials) against the first's; each timed as a graph of 10 runs (us a run,
median of 20 replays). --watchdog: barrier waits over 2 s trap.

    PYTHONPATH=. python dev/cuda/lnback_check.py [--batches 8,32] [--watchdog]
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import gemm, products  # noqa: E402
from coppelius.accelerated.cuda.compile import Kernels as ProjectKernels  # noqa: E402
from coppelius.accelerated.cuda.cublas import WORKSPACE_BYTES, Cublas  # noqa: E402
from coppelius.accelerated.cuda.layernorm import layernorm_chunk, layernorm_chunks  # noqa: E402

from bench_step import time_graph  # noqa: E402

D, T, RUNS = 512, 1024, 10


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="8,32")
    p.add_argument("--ks", default="1536,2816", help="the products' K (q | k | v, gate/up)")
    p.add_argument("--watchdog", action="store_true")
    args = p.parse_args()
    own = gemm.Kernels(watchdog=args.watchdog)
    project = ProjectKernels("bf16")
    stream = cupy.cuda.Stream(non_blocking=True)
    workspace = cupy.empty(WORKSPACE_BYTES, np.uint8)
    blas = Cublas(stream.ptr, workspace.data.ptr, WORKSPACE_BYTES)
    rng = np.random.default_rng(0)
    table = []
    for B in map(int, args.batches.split(",")):
        rows = B * T
        chunk, chunks = layernorm_chunk(rows), layernorm_chunks(rows)
        for K in map(int, args.ks.split(",")):
            bits = lambda shape, s=1.0: cupy.asarray(  # noqa: E731
                ((rng.standard_normal(shape, dtype=np.float32) * s).view(np.uint32) >> 16)
                .astype(np.uint16))
            dY, W = bits((rows, K)), bits((K, D), K ** -0.5)
            xh = rng.standard_normal((rows, D), dtype=np.float32) * 2
            x = cupy.asarray(xh)
            w = cupy.asarray(1 + 0.2 * rng.standard_normal(D, dtype=np.float32))
            b = cupy.asarray(0.1 * rng.standard_normal(D, dtype=np.float32))
            mean = cupy.asarray(xh.mean(1))
            rstd = cupy.asarray((1 / np.sqrt(((xh - xh.mean(1)[:, None]) ** 2).mean(1) + 1e-5))
                                .astype(np.float32))
            dres0 = cupy.asarray(rng.standard_normal((rows, D), dtype=np.float32))
            dout = cupy.empty((rows, D), np.float32)
            outs = {}

            def buffers(name):
                outs[name] = (dres0.copy(), cupy.zeros((rows, D), np.uint16),
                              cupy.zeros((rows, D), np.uint16),
                              cupy.zeros((chunks, 2 * D), np.float32))
                return outs[name]

            def unfused(product, o):
                def run():
                    product()
                    project.layernorm_backward(dout, o[0], x, mean, rstd, w, o[0], o[1], o[3],
                                               b=b, h=o[2])
                return run

            o1 = buffers("cuBLAS + layernorm_backward")
            o2 = buffers("own f32 dX + layernorm_backward")
            lnbacks = [n for n in gemm.VARIANTS if gemm.VARIANTS[n].lnback]
            fused_outs = {n: buffers(n) for n in lnbacks}
            own_dx = own.plan_pointers(products.BACKWARD_INPUT["float32"], rows, D, K,
                                       dY.data.ptr, K, W.data.ptr, D, dout.data.ptr, D)
            def fused(name, o):
                plan = own.plan_pointers(name, rows, D, K, dY.data.ptr, K, W.data.ptr, D, 0, 0,
                                         lnback=gemm.Lnback(
                                             x.data.ptr, mean.data.ptr, rstd.data.ptr,
                                             w.data.ptr, b.data.ptr, o[0].data.ptr,
                                             o[0].data.ptr, o[1].data.ptr, o[2].data.ptr,
                                             o[3].data.ptr, chunk))
                return lambda: plan.launch(stream)

            paths = {
                "cuBLAS + layernorm_backward": unfused(lambda: blas.gemm(
                    False, False, rows, D, K, dY.data.ptr, K, W.data.ptr, D, dout.data.ptr, D,
                    ab_type="bfloat16", c_type="float32"), o1),
                "own f32 dX + layernorm_backward": unfused(lambda: own_dx.launch(stream), o2),
                **{n: fused(n, o) for n, o in fused_outs.items()},
            }
            with stream:
                for name, run in paths.items():  # once each, from the same dres
                    run()
                stream.synchronize()
                first = [cupy.asnumpy(a).astype(np.float64) for a in o1]
                first[1], first[2] = ((cupy.asnumpy(a).astype(np.uint32) << 16).view(np.float32)
                                      .astype(np.float64) for a in (o1[1], o1[2]))
                for name, run in paths.items():
                    o = outs[name]
                    got = [cupy.asnumpy(a).astype(np.float64) for a in o]
                    got[1], got[2] = ((cupy.asnumpy(a).astype(np.uint32) << 16)
                                      .view(np.float32).astype(np.float64) for a in (o[1], o[2]))
                    errs = [float(np.linalg.norm(g - f) / np.linalg.norm(f))
                            for g, f in zip(got, first)]
                    h_bits = bool((cupy.asnumpy(o[2]) == cupy.asnumpy(o1[2])).all())
                    stream.begin_capture()
                    for _ in range(RUNS):
                        run()
                    graph = stream.end_capture()
                    us = 1e3 * time_graph(types.SimpleNamespace(stream=stream), graph) / RUNS
                    ok = all(e < 1e-4 for e in (errs[0], errs[3])) and errs[1] < 1e-2 and h_bits
                    table.append((B, K, name, us, *errs, h_bits, "ok" if ok else "FAIL"))
                    print(f"| {B} | {K} | {name} | {us:.1f} | dx {errs[0]:.1e} | dx_op "
                          f"{errs[1]:.1e} | h {errs[2]:.1e} bits={h_bits} | partials "
                          f"{errs[3]:.1e} | {table[-1][-1]} |", flush=True)
    print("\n| B | K | path | us | ratio to the first |\n| --- | --- | --- | --- | --- |")
    for i, r in enumerate(table):
        base = table[i - i % (2 + len(lnbacks))][3]
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[3] / base:.3f} |")


if __name__ == "__main__":
    main()
