"""The own product kernel at the coppelius preset's B = 8 gate/up shape, on a
Hopper GPU: the plain float32 product through the copy engine, the SwiGLU
epilogue storing a alone, and the first storing nothing (bare), each timed
over 20 launches; with PROBE_UNTIMED set, three launches of each alone, for
Nsight Compute to read (dev/cuda/NOTES.md, "Where the epilogues' time
goes"):

    PYTHONPATH=$PWD python dev/cuda/epilogue_probe.py
    PROBE_UNTIMED=1 ncu --kernel-name regex:gemm_ --launch-count 9 --section SpeedOfLight \
        --section WarpStateStats --section ComputeWorkloadAnalysis \
        python dev/cuda/epilogue_probe.py"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import cupy as cp  # noqa: E402

from coppelius.accelerated.cuda import gemm  # noqa: E402
from gemm_check import bf16_bits  # noqa: E402


def bare(plan):
    """The same launch storing nothing (ldc 0: gemm_check.py's bare)."""
    return gemm.Planned(plan.function, plan.grid, plan.shared,
                        plan.args[:5] + (np.int32(0),) + plan.args[6:], plan.maps)


def launch_us(plan, count=20):
    """Mean microseconds of a launch over `count` back to back (after three)."""
    for _ in range(3):
        plan.launch()
    ev = [cp.cuda.Event() for _ in range(2)]
    ev[0].record()
    for _ in range(count):
        plan.launch()
    ev[1].record()
    ev[1].synchronize()
    return cp.cuda.get_elapsed_time(*ev) * 1000 / count


def main():
    M, N, K = 8192, 2816, 512
    rng = np.random.default_rng(0)
    A, W = bf16_bits(rng, (M, K)), bf16_bits(rng, (N, K), K ** -0.5)
    C = cp.empty((M, N), cp.float32)
    a = cp.empty((M, N // 2), cp.uint16)
    k = gemm.Kernels()
    plans = {"f32t": k.plan_pointers("gemm_f32t_p_m2n128_s4", M, N, K, A.data.ptr, K,
                                     W.data.ptr, K, C.data.ptr, N),
             "swiglua": k.plan_pointers("gemm_swiglua_p_m2n128_s4", M, N, K, A.data.ptr, K,
                                        W.data.ptr, K, 0, N, a.data.ptr)}
    plans["bare"] = bare(plans["f32t"])
    for name, plan in plans.items():
        if os.environ.get("PROBE_UNTIMED"):  # under the profiler: three launches only
            for _ in range(3):
                plan.launch()
            cp.cuda.Device().synchronize()
            continue
        print(name, f"{launch_us(plan):.1f} us", flush=True)


if __name__ == "__main__":
    main()
