"""The SwiGLU product kernels with other bodies of kernels/swiglu.cu's
sigmoid: the gate/up product that stores a alone (products.SWIGLU_A) and
the SwiGLU backward computing the products again (products.DSWIGLU_AGAIN),
each module compiled with the tree's sigmoid and with each FORMULA in its
place, at the coppelius preset's widths, B = 8 and 32 rows of T = 1024: us
a launch (graph of 10, median of 20 replays) and how many of a's and dgu's
bfloat16 values differ from the tree's.

    PYTHONPATH=. python dev/cuda/sigmoid_check.py \\
        "__fdividef(1.0f, 1.0f + __expf(-g))" "__frcp_rn(1.0f + __expf(-g))"
        [--context 1024] [--batches 8,32]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import gemm, products  # noqa: E402

from bench_step import time_graph  # noqa: E402

SIGMOID = re.compile(r"(float sigmoid\(float g\) \{\s*return )(.*?)(;\s*\})", re.S)
D, F = 512, 1408  # the coppelius preset's


def module(source: str):
    kept = gemm.module_source
    gemm.module_source = lambda: source
    try:
        return gemm.Kernels()
    finally:
        gemm.module_source = kept


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("formulas", nargs="+", help="bodies of sigmoid(g), C expressions in g")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batches", default="8,32")
    args = p.parse_args()
    source = gemm.module_source()
    tree = SIGMOID.search(source)
    assert tree, "kernels/swiglu.cu's sigmoid"
    modules = {"tree": gemm.Kernels()}
    for f in args.formulas:
        modules[f] = module(SIGMOID.sub(lambda m: m.group(1) + f + m.group(3), source, count=1))
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)

    def operand(shape, scale=1.0):
        x = rng.standard_normal(shape, dtype=np.float32) * scale
        return cupy.asarray((x.view(np.uint32) >> 16).astype(np.uint16))

    print(f"the tree's sigmoid: {tree.group(2)}")
    for B in map(int, args.batches.split(",")):
        M = B * args.context
        h, W_gu = operand((M, D)), operand((2 * F, D), 2 * D ** -0.5)
        dres, W_down = operand((M, D)), operand((D, F), D ** -0.5)
        results = {}
        for name, k in modules.items():
            a, a2 = cupy.zeros((M, F), np.uint16), cupy.zeros((M, F), np.uint16)
            dgu = cupy.zeros((M, 2 * F), np.uint16)
            plans = (k.plan_pointers(products.SWIGLU_A, M, 2 * F, D, h.data.ptr, D,
                                     W_gu.data.ptr, D, 0, 2 * F, a.data.ptr),
                     k.plan_pointers(products.DSWIGLU_AGAIN[M <= products.AGAIN_WIDE_ROWS], M,
                                     F, D, dres.data.ptr, D, W_down.data.ptr, F, 0, 0,
                                     dswiglu=gemm.Dswiglu(dgu.data.ptr, a2.data.ptr, h.data.ptr,
                                                          D, W_gu.data.ptr, D)))
            us = []
            with stream:
                for plan in plans:
                    plan.launch(stream)
                    stream.synchronize()
                    stream.begin_capture()
                    for _ in range(10):
                        plan.launch(stream)
                    graph = stream.end_capture()
                    us.append(1e3 * time_graph(types.SimpleNamespace(stream=stream), graph) / 10)
            results[name] = (us, cupy.asnumpy(a), cupy.asnumpy(dgu))
        base = results["tree"]
        for name, (us, a, dgu) in results.items():
            print(f"B={B} | {name} | swiglua {us[0]:.1f} us | again {us[1]:.1f} us | a differs "
                  f"{int((a != base[1]).sum())}/{a.size} | dgu differs "
                  f"{int((dgu != base[2]).sum())}/{dgu.size}", flush=True)


if __name__ == "__main__":
    main()
