"""A timeline of the own product kernel's ping-pong, from inside it: the
module compiled with GEMM_TRACE (kernels/gemm_sm90.cu), so that each
multiplying warpgroup records the multiprocessor's clock at five points of
its tiles (before the wait for its turn, after it, after the first slab's
wait, at the mainloop's end, at the epilogue's end), on the coppelius
preset's B = 8 gate/up shape (M 8192, N 2816, K 512) and the SwiGLU
backward's (dswiglu_again m1n128, the B = 8 step's, and m2n64; F 1408).
Builds with GEMM_PROBE_NO_STORE (the staged epilogue fills its buffers, the
copy engine stores nothing) and GEMM_PROBE_NO_FILL (nothing filled, the
buffers stored) take the epilogue apart; GEMM_PROBE_STAGGER=S starts the
cooperative tile's second warpgroup S slabs after the first (its results
checked bitwise against the full build's). Two builds since removed were
measured so too: stmatrix fills, and the L2's evict-first and evict-last
policies on the copies (dev/cuda/NOTES.md, "The ping-pong's timeline").
Per kernel and build, medians over every block's tiles after its first,
in clock cycles:

- mainloop: the turn's start to the last product's end (the tensor cores'
  busy time, one warpgroup at a time);
- first slab: the turn's start to the first slab's arrival;
- epilogue: the mainloop's end to the epilogue's end;
- turn wait: the epilogue's end to the turn (negative never: the wait);
- hand-over: one warpgroup's mainloop end to the other's first slab (the
  tensor cores idle between the two mainloops);
- busy: the mainloops' share of the block's span.

The full build also times the cooperative 128 x 256 tile (c_n256: both
warpgroups on every slab, 64 rows each; its tile is twice the ping-pong
one's products) and the 64 x 256 ping-pong tile (p_m1n256), bare and
storing float32 C (and the cooperative SwiGLU a alone), and the ping-pong
tile storing float32 C from the registers (no copy engine).

    PYTHONPATH=$PWD python dev/cuda/epilogue_trace.py
(dev/cuda/NOTES.md, "The ping-pong's timeline")"""
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

BUILDS = {"full": [], "no store": ["-DGEMM_PROBE_NO_STORE"], "no fill": ["-DGEMM_PROBE_NO_FILL"],
          "stagger 1": ["-DGEMM_PROBE_STAGGER=1"], "stagger 2": ["-DGEMM_PROBE_STAGGER=2"]}
STAGGERED = ("bare c_n256", "f32t c_n256", "swiglua c_n256")  # the builds' kernels it changes
TILES, POINTS = 32, 8  # kernels/gemm_sm90.cu: TRACE_TILES, the record's stride


def build(extra):
    from coppelius.accelerated.cuda import gemm
    return gemm.compile_cubin(options=gemm.compile_options(trace=True) + extra)[0]


def summary(trace, blocks):
    """The medians (cycles) and the busy share of one launch's records."""
    t = trace.reshape(-1, 2, TILES, POINTS)[:blocks].astype(np.int64)
    ml, first, ep, wait, hand, busy = [], [], [], [], [], []
    for b in range(blocks):
        tiles = []  # (turn, first slab, mainloop end, epilogue end, warpgroup, tile, wait)
        for c in range(2):
            for j in range(TILES):
                r = t[b, c, j]
                if r[1] == 0:
                    break
                tiles.append((r[1], r[2], r[3], r[4], c, j, r[0]))
                if j > 0:
                    ml.append(r[3] - r[1])
                    first.append(r[2] - r[1])
                    ep.append(r[4] - r[3])
                    wait.append(r[1] - r[0])
        tiles.sort()
        for prev, nxt in zip(tiles, tiles[1:]):
            hand.append(nxt[1] - prev[2])
        if tiles:
            span = max(x[3] for x in tiles) - tiles[0][0]
            busy.append(sum(x[2] - x[0] for x in tiles) / span)
    med = lambda x: float(np.median(x)) if x else float("nan")  # noqa: E731
    return med(ml), med(first), med(ep), med(wait), med(hand), med(busy)


def main():
    with ProcessPoolExecutor(len(BUILDS)) as pool:  # before CuPy is imported here
        cubins = dict(zip(BUILDS, pool.map(build, BUILDS.values())))
    import cupy as cp

    from coppelius.accelerated.cuda import gemm
    from epilogue_probe import bare, launch_us
    from gemm_check import bf16_bits

    M, N, K = 8192, 2816, 512
    F, D = N // 2, K
    rng = np.random.default_rng(0)
    A, W = bf16_bits(rng, (M, K)), bf16_bits(rng, (N, K), K ** -0.5)
    dres, W_down = bf16_bits(rng, (M, D)), bf16_bits(rng, (D, F), F ** -0.5)
    C = cp.empty((M, N), cp.float32)
    a = cp.empty((M, F), cp.uint16)
    dgu = cp.empty((M, N), cp.uint16)
    rows, kept = [], {}
    for name, cubin in cubins.items():
        gemm.compile_cubin = lambda options=None, cubin=cubin, **kw: (cubin, "")
        k = gemm.Kernels(trace=True)
        plans = {"f32t": k.plan_pointers("gemm_f32t_p_m2n128_s4", M, N, K, A.data.ptr, K,
                                         W.data.ptr, K, C.data.ptr, N),
                 "swiglua": k.plan_pointers("gemm_swiglua_p_m2n128_s4", M, N, K, A.data.ptr, K,
                                            W.data.ptr, K, 0, N, a.data.ptr),
                 **{f"again {v}": k.plan_pointers(
                     f"gemm_dswiglu_again_p_{v}_s3", M, F, D, dres.data.ptr, D,
                     W_down.data.ptr, F, 0, 0,
                     dswiglu=gemm.Dswiglu(dgu.data.ptr, a.data.ptr, A.data.ptr, D, W.data.ptr, D))
                    for v in ("m1n128", "m2n64")}}
        # the same launches storing nothing (ldc 0), and other tiles
        other = {v: k.plan_pointers(f"gemm_f32t_{v}_s4", M, N, K, A.data.ptr, K,
                                    W.data.ptr, K, C.data.ptr, N)
                 for v in ("c_n256", "p_m1n256")}
        plans = {"bare": bare(plans["f32t"]), **plans,
                 **{f"bare {v}": bare(f) for v, f in other.items()},
                 **{f"f32t {v}": f for v, f in other.items()},
                 "f32 p_m2n128 (registers)": k.plan_pointers(
                     "gemm_f32_p_m2n128_s6", M, N, K, A.data.ptr, K, W.data.ptr, K,
                     C.data.ptr, N),
                 "swiglua c_n256": k.plan_pointers("gemm_swiglua_c_n256_s4", M, N, K,
                                                   A.data.ptr, K, W.data.ptr, K, 0, N,
                                                   a.data.ptr)}
        trace = k.module.get_global_var("gemm_trace")  # its device address
        trace = getattr(trace, "ptr", trace)
        words = 132 * 2 * TILES * POINTS
        if name.startswith("stagger"):
            plans = {v: p for v, p in plans.items() if v in STAGGERED}
        elif name != "full":
            plans = {v: p for v, p in plans.items() if v in ("f32t", "swiglua") or "again" in v}
        for variant, plan in plans.items():
            us = launch_us(plan)
            cp.cuda.runtime.memset(trace, 0, words * 8)
            plan.launch()
            cp.cuda.Device().synchronize()
            host = np.empty(words, np.uint64)
            cp.cuda.runtime.memcpy(host.ctypes.data, trace, words * 8,
                                   cp.cuda.runtime.memcpyDeviceToHost)
            rows.append((variant, name, us, *summary(host, min(plan.grid, 132))))
            if variant in ("f32t c_n256", "swiglua c_n256"):
                out = cp.asnumpy(C if variant.startswith("f32t") else a)
                if name == "full":
                    kept[variant] = out
                else:
                    print(f"{variant} {name}: bitwise the full build's: "
                          f"{bool((out == kept[variant]).all())}")
            print(rows[-1], flush=True)
    print("\n| kernel | build | us | mainloop | first slab | epilogue | turn wait | hand-over "
          "| busy |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for v, b, us, ml, first, ep, wait, hand, busy in rows:
        print(f"| {v} | {b} | {us:.1f} | {ml:.0f} | {first:.0f} | {ep:.0f} | {wait:.0f} "
              f"| {hand:.0f} | {busy:.3f} |")


if __name__ == "__main__":
    main()
