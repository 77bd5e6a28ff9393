"""Check and time the project's own product kernel (kernels/gemm_sm90.cu)
beside cuBLAS on the step's forward shapes, on a Hopper GPU:

    PYTHONPATH=$PWD python dev/cuda/gemm_check.py [--batches 1,8,32] [--preset coppelius]

Per shape and variant: the output poisoned with NaN first (every element
must be written), the relative error against a float64 product of the
same bfloat16 operands (and beside it cuBLAS's), two launches bitwise
equal; with the SwiGLU epilogue also `a` against the project's
swiglu_forward kernel run on the kernel's own gu (bitwise: the same
formula); with the rope epilogue (q | k | v), the operands against a
float64 rotation of the float64 product, and whether they equal
rope_forward's on the own float32 product bit for bit ("bits="). Times:
a CUDA graph of 20 launches replayed 15 times, the median per launch in
microseconds, against cuBLAS (cublasGemmEx, float32 result), for gate/up
against cuBLAS + the swiglu kernel, for q | k | v + rope against cuBLAS +
rope_forward. The backward's layouts (--directions backward): per shape
dX = dY W (layout kn, B given as (K,N); the o product's with a bfloat16
result, as the step's) and dW = dY^T X (layout mn) against cublasGemmEx's
same call. A table last."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

from coppelius.accelerated.cuda import gemm, products  # noqa: E402
from coppelius.accelerated.cuda.compile import Kernels as ProjectKernels  # noqa: E402
from coppelius.accelerated.cuda.cublas import WORKSPACE_BYTES, Cublas  # noqa: E402
from coppelius.reference.config import PRESETS, config_from_toml  # noqa: E402
from coppelius.reference.layers.swiglu import swiglu_backward, swiglu_forward  # noqa: E402

REPEAT, REPLAYS = 20, 15


def bf16_bits(rng, shape, scale=1.0):
    x = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16)
    return cp.asarray(x.view(np.uint16))


def as_f64(bits):
    return (bits.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)


def rel(x, ref):
    x = x.astype(cp.float64)
    return float(cp.linalg.norm(x - ref) / cp.linalg.norm(ref))


def timed(stream, body) -> float:
    """Median microseconds of one `body()` over graph replays."""
    body()
    stream.synchronize()
    stream.begin_capture()
    for _ in range(REPEAT):
        body()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        graph.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / REPEAT)
    return float(np.median(times))


def first_launch(build, stream, failures, row, B, label, v):
    """The plan build() makes, launched once and waited for; None (a
    failure and an ERR row) where planning or the launch raised."""
    try:
        plan = build()
        plan.launch(stream)
        stream.synchronize()
    except Exception as e:  # noqa: BLE001 (reported in the table)
        failures.append(f"B={B} {label} {v}: {type(e).__name__}: {e}")
        row(B, label, v, float("nan"), float("nan"), float("nan"), "ERR")
        return None
    return plan


def backward_pass(args, shapes, T, variants, kernels, project, blas, stream, rng, row,
                  failures):
    """dX = dY W (M, in) for each forward product W (out, in), dY (M, out),
    and dW = dY^T X (out, in), X (M, in), by the kn and mn variants beside
    cuBLAS's same call; the edges first (M, N, K past the tiles)."""
    edge = [("edge", 1000, [("o", 520, 200)])]
    passes = edge + [(B, B * T, shapes) for B in map(int, args.batches.split(","))]
    for B, M, product_shapes in passes:
        for name, n_out, n_in in product_shapes:
            if name == "classifier":
                continue
            dY = bf16_bits(rng, (M, n_out))
            W = bf16_bits(rng, (n_out, n_in), scale=n_out ** -0.5)
            X = bf16_bits(rng, (M, n_in))
            # (product, m, n, k, A, lda, B, ldb, trans_a, the float64 reference)
            cases = [("dX", M, n_in, n_out, dY, n_out, W, n_in, False, as_f64(dY) @ as_f64(W)),
                     ("dW", n_out, n_in, M, dY, n_out, X, n_in, True,
                      as_f64(dY).T @ as_f64(X))]
            for what, m, n, k, A, lda, Bm, ldb, trans_a, ref in cases:
                layout = "mn" if trans_a else "kn"
                for c_type in ("float32", "bfloat16") if what == "dX" and name == "o" \
                        else ("float32",):
                    bf16 = c_type == "bfloat16"
                    epilogue = "bf16_tma" if bf16 else "f32_tma"
                    label = f"{what} {name}" + (" bf16" if bf16 else "")
                    new = (lambda: cp.full((m, n), 0xFFFF, cp.uint16)) if bf16 else \
                        (lambda: cp.full((m, n), cp.nan, cp.float32))
                    value = as_f64 if bf16 else (lambda x: x.astype(cp.float64))
                    tol = 1e-2 if bf16 else max(1e-5, 2e-9 * k)  # float32 sums of k terms
                    C0 = new()

                    def cublas_product(C=C0, A=A, Bm=Bm, m=m, n=n, k=k, lda=lda, ldb=ldb,
                                       trans_a=trans_a, c_type=c_type):
                        blas.gemm(trans_a, False, m, n, k, A.data.ptr, lda, Bm.data.ptr, ldb,
                                  C.data.ptr, n, ab_type="bfloat16", c_type=c_type)

                    cublas_product()
                    stream.synchronize()
                    t_blas = timed(stream, cublas_product)
                    row(B, label, "cublas", rel(value(C0), ref), t_blas, 1.0, "-")
                    for v in variants:
                        var = gemm.VARIANTS[v]
                        if var.layout != layout or var.epilogue != epilogue \
                                or var.split and m % var.bm:
                            continue  # (a split's partials: whole tiles of rows)
                        C1 = new()
                        plan = first_launch(
                            lambda: kernels.plan_pointers(v, m, n, k, A.data.ptr, lda,
                                                          Bm.data.ptr, ldb, C1.data.ptr, n),
                            stream, failures, row, B, label, v)
                        if plan is None:
                            continue
                        got = value(C1)
                        written = not bool(cp.isnan(got).any())
                        err = rel(got, ref) if written else float("inf")
                        first = C1.copy()
                        C1.fill(0xFFFF if bf16 else cp.nan)
                        plan.launch(stream)
                        stream.synchronize()
                        same = bool((C1.view(cp.uint16) == first.view(cp.uint16)).all())
                        check = "ok" if written and same and err < tol else "FAIL"
                        if check != "ok":
                            failures.append(f"B={B} {label} {v}: written={written} "
                                            f"err={err:.2e} replay-equal={same}")
                        t = timed(stream, lambda plan=plan: plan.launch(stream))
                        row(B, label, v, err, t, t / t_blas, check)
            if name == "down":
                dswiglu_rows(B, M, n_out, n_in, dY, W, variants, kernels, project, blas, stream,
                             rng, row, failures)
                again_rows(B, M, n_out, n_in, dY, W, variants, kernels, project, stream, rng,
                           row, failures)


def dswiglu_rows(B, M, D, F, dres, W, variants, kernels, project, blas, stream, rng, row,
                 failures):
    """The down product's dX with the SwiGLU backward in its epilogue
    against cuBLAS's dX + the swiglu_backward kernel: dgu and a bitwise the
    kernel's on the own kn product's float32 da ("bits=")."""
    gu = cp.asarray(rng.standard_normal((M, 2 * F), dtype=np.float32) * 2)
    da = cp.zeros((M, F), cp.float32)
    dgu0, a0 = cp.zeros((M, 2 * F), cp.uint16), cp.zeros((M, F), cp.uint16)

    def cublas_dswiglu():
        blas.gemm(False, False, M, F, D, dres.data.ptr, D, W.data.ptr, F, da.data.ptr, F,
                  ab_type="bfloat16", c_type="float32")
        project.swiglu_backward(da, gu, dgu0, a0)

    t_base = timed(stream, cublas_dswiglu)
    g, u = (cp.asnumpy(x).astype(np.float64) for x in (gu[:, :F], gu[:, F:]))
    _, cache = swiglu_forward(g, u)
    ref = cp.asarray(np.concatenate(swiglu_backward(cp.asnumpy(as_f64(dres) @ as_f64(W)),
                                                    cache), axis=1))
    row(B, "dX down+dswiglu", "cublas+swiglu_backward", rel(as_f64(dgu0), ref), t_base, 1.0, "-")
    # the unfused path's bits: the step's dX product, then the swiglu_backward kernel
    kernels.plan_pointers(products.BACKWARD_INPUT["float32"], M, F, D, dres.data.ptr, D,
                          W.data.ptr, F, da.data.ptr, F).launch(stream)
    want_dgu, want_a = cp.zeros_like(dgu0), cp.zeros_like(a0)
    project.swiglu_backward(da, gu, want_dgu, want_a)
    for v in variants:
        if gemm.VARIANTS[v].epilogue != "dswiglu":
            continue
        dgu, a = cp.full_like(dgu0, 0xFFFF), cp.full_like(a0, 0xFFFF)
        plan = kernels.plan_pointers(v, M, F, D, dres.data.ptr, D, W.data.ptr, F, gu.data.ptr,
                                     2 * F, dswiglu=gemm.Dswiglu(dgu.data.ptr, a.data.ptr))
        plan.launch(stream)
        stream.synchronize()
        err = rel(as_f64(dgu), ref)
        bits = "bits=" if bool((dgu == want_dgu).all()) and bool((a == want_a).all()) \
            else "bits~"
        check = "ok" if err < 1e-2 and bits == "bits=" else "FAIL"
        if check != "ok":
            failures.append(f"B={B} dX down+dswiglu {v}: err={err:.2e} {bits}")
        t = timed(stream, lambda plan=plan: plan.launch(stream))
        row(B, "dX down+dswiglu", v, err, t, t / t_base, f"{check} {bits}")


def again_rows(B, M, D, F, dres, W_down, variants, kernels, project, stream, rng, row,
               failures):
    """The gate and up products computed again in the SwiGLU backward's
    kernel (dswiglu_again) against the step's path that keeps them: the
    forward's swiglut (gu float32 and a) and the backward's dswiglu (gu
    read). Bits: the again kernel's dgu and a equal swiglu_backward's on
    the own kn product's da and swiglut's gu, and swiglua's a equals
    swiglut's ("bits="). Times per layer: forward and backward each way."""
    h = bf16_bits(rng, (M, D))
    W_gu = bf16_bits(rng, (2 * F, D), scale=D ** -0.5)
    gu = cp.full((M, 2 * F), cp.nan, cp.float32)
    a_fwd = cp.full((M, F), 0xFFFF, cp.uint16)
    forward = kernels.plan(products.SWIGLU, h, W_gu, gu, a_fwd)
    forward.launch(stream)
    da = cp.zeros((M, F), cp.float32)
    kernels.plan_pointers(products.BACKWARD_INPUT["float32"], M, F, D, dres.data.ptr, D,
                          W_down.data.ptr, F, da.data.ptr, F).launch(stream)
    want_dgu, want_a = cp.zeros((M, 2 * F), cp.uint16), cp.zeros((M, F), cp.uint16)
    project.swiglu_backward(da, gu, want_dgu, want_a)
    dgu, a = cp.full_like(want_dgu, 0xFFFF), cp.full_like(want_a, 0xFFFF)
    kept = kernels.plan_pointers(products.DSWIGLU, M, F, D, dres.data.ptr, D, W_down.data.ptr,
                                 F, gu.data.ptr, 2 * F,
                                 dswiglu=gemm.Dswiglu(dgu.data.ptr, a.data.ptr))
    stream.synchronize()
    t_fwd, t_back = (timed(stream, lambda p=p: p.launch(stream)) for p in (forward, kept))
    row(B, "gate/up fwd, gu kept", products.SWIGLU, float("nan"), t_fwd, 1.0, "-")
    row(B, "dswiglu, gu read", products.DSWIGLU, float("nan"), t_back, 1.0, "-")
    g, u = (cp.asnumpy(x).astype(np.float64) for x in (gu[:, :F], gu[:, F:]))
    _, cache = swiglu_forward(g, u)
    ref = cp.asarray(np.concatenate(swiglu_backward(cp.asnumpy(as_f64(dres) @ as_f64(W_down)),
                                                    cache), axis=1))
    for v in variants:
        var = gemm.VARIANTS[v]
        if var.epilogue == "swiglu_a":
            a1 = cp.full_like(a_fwd, 0xFFFF)
            plan = first_launch(lambda: kernels.plan_pointers(v, M, 2 * F, D, h.data.ptr, D,
                                                              W_gu.data.ptr, D, 0, 2 * F,
                                                              a1.data.ptr),
                                stream, failures, row, B, "gate/up fwd, a alone", v)
            if plan is None:
                continue
            bits = "bits=" if bool((a1 == a_fwd).all()) else "bits~"
            if bits != "bits=":
                failures.append(f"B={B} gate/up fwd, a alone {v}: a differs from swiglut's")
            t = timed(stream, lambda plan=plan: plan.launch(stream))
            row(B, "gate/up fwd, a alone", v, float("nan"), t, t / t_fwd,
                f"{'ok' if bits == 'bits=' else 'FAIL'} {bits}")
        if not var.again:
            continue
        dgu1, a1 = cp.full_like(want_dgu, 0xFFFF), cp.full_like(want_a, 0xFFFF)
        d = gemm.Dswiglu(dgu1.data.ptr, a1.data.ptr, h.data.ptr, D, W_gu.data.ptr, D)
        plan = first_launch(lambda: kernels.plan_pointers(v, M, F, D, dres.data.ptr, D,
                                                          W_down.data.ptr, F, 0, 0, dswiglu=d),
                            stream, failures, row, B, "dswiglu, gu again", v)
        if plan is None:
            continue
        err = rel(as_f64(dgu1), ref)
        first = (dgu1.copy(), a1.copy())
        dgu1.fill(0xFFFF)
        a1.fill(0xFFFF)
        plan.launch(stream)
        stream.synchronize()
        same = bool((dgu1 == first[0]).all()) and bool((a1 == first[1]).all())
        bits = "bits=" if bool((dgu1 == want_dgu).all()) and bool((a1 == want_a).all()) \
            else "bits~"
        check = "ok" if err < 1e-2 and same and bits == "bits=" else "FAIL"
        if check != "ok":
            wrong = int((dgu1 != want_dgu).sum()) + int((a1 != want_a).sum())
            failures.append(f"B={B} dswiglu, gu again {v}: err={err:.2e} replay-equal={same} "
                            f"{bits} ({wrong} elements differ)")
        t = timed(stream, lambda plan=plan: plan.launch(stream))
        row(B, "dswiglu, gu again", v, err, t, t / t_back, f"{check} {bits}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--preset", default="coppelius")
    p.add_argument("--model", metavar="FILE.toml", help="the shapes of a model file instead")
    p.add_argument("--variants", default=",".join(gemm.VARIANTS))
    p.add_argument("--shapes", default="qkv,o,gate_up,down,classifier")
    p.add_argument("--directions", default="forward,backward",
                   help="forward: the x @ W^T products and their epilogues; backward: dX, dW")
    p.add_argument("--watchdog", action="store_true",
                   help="compile with GEMM_WATCHDOG: a barrier wait over 2 s traps")
    args = p.parse_args()
    c = config_from_toml(args.model)[0] if args.model else PRESETS[args.preset]
    D, V, T = c.d_model, c.vocab, c.context
    F = c.d_ff
    qkv = D + 2 * (c.n_kv_head or c.n_head) * (D // c.n_head)
    shapes = [("qkv", qkv, D), ("o", D, D), ("gate_up", 2 * F, D), ("down", D, F),
              ("classifier", V, D)]
    variants = args.variants.split(",")
    shapes = [s for s in shapes if s[0] in args.shapes.split(",")]

    kernels = gemm.Kernels(watchdog=args.watchdog)
    project = ProjectKernels("bf16")
    stream = cp.cuda.Stream(non_blocking=True)
    workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)
    blas = Cublas(stream.ptr, workspace.data.ptr, WORKSPACE_BYTES)
    rng = np.random.default_rng(0)
    rows, failures = [], []

    def row(*r):
        rows.append(r)
        B, name, v, err, t, ratio, check, bare = (*r, float("nan"))[:8]
        print(f"| {B} | {name} | {v} | {err:.2e} | {t:.1f} | {ratio:.3f} | {check} | {bare:.1f} |",
              flush=True)

    # first the edges: M, N, K no multiples of the tiles (M odd in tiles of
    # 128, K not of 64): rows, columns and K past the matrices
    directions = args.directions.split(",")
    passes = [("edge", 1000, [("o", 520, 200), ("gate_up", 520, 200)])]
    passes += [(B, B * T, shapes) for B in map(int, args.batches.split(","))]
    if "forward" not in directions:
        passes = []
    with stream:
        for B, M, product_shapes in passes:
            for name, N, K in product_shapes:
                F = N // 2  # gate_up's
                A = bf16_bits(rng, (M, K))
                W = bf16_bits(rng, (N, K), scale=K ** -0.5)
                ref = as_f64(A) @ as_f64(W).T
                C0 = cp.full((M, N), cp.nan, cp.float32)

                def cublas_product(C=C0):
                    blas.gemm(False, True, M, N, K, A.data.ptr, K, W.data.ptr, K, C.data.ptr, N,
                              ab_type="bfloat16", c_type="float32")

                cublas_product()
                stream.synchronize()
                err_blas = rel(C0, ref)
                t_blas = timed(stream, cublas_product)
                t_base = t_blas
                if name == "gate_up":
                    a0 = cp.zeros((M, F), cp.uint16)

                    def cublas_swiglu():
                        cublas_product()
                        project.swiglu_forward(C0, a0)

                    t_base = timed(stream, cublas_swiglu)
                row(B, name, "cublas", err_blas, t_blas, 1.0, "-")
                if name == "gate_up":
                    row(B, name, "cublas+swiglu", err_blas, t_base, 1.0, "-")
                for v in variants:
                    swiglu = gemm.VARIANTS[v].swiglu
                    if swiglu and name != "gate_up" or gemm.VARIANTS[v].epilogue == "rope":
                        continue  # (the rope variants: below)
                    if gemm.VARIANTS[v].layout != "kk" or gemm.VARIANTS[v].epilogue in (
                            "bf16_tma", "swiglu_a"):
                        continue  # (the backward's: backward_pass; swiglu_a: again_rows)
                    if gemm.VARIANTS[v].epilogue == "swiglu_tma" and F % 8:
                        row(B, name, v, float("nan"), float("nan"), float("nan"), "refused (F % 8)")
                        continue  # check_plan's refusal (tests/test_gemm_sm90.py)
                    base = t_base if swiglu else t_blas
                    C1 = cp.full((M, N), cp.nan, cp.float32)
                    H = cp.full((M, F), 0xFFFF, cp.uint16) if swiglu else None
                    plan = first_launch(lambda: kernels.plan(v, A, W, C1, H), stream, failures,
                                        row, B, name, v)
                    if plan is None:
                        continue
                    written = not bool(cp.isnan(C1).any())
                    err = rel(C1, ref) if written else float("inf")
                    first = C1.copy()
                    C1.fill(cp.nan)
                    plan.launch(stream)
                    stream.synchronize()
                    same = bool((C1.view(cp.uint32) == first.view(cp.uint32)).all())
                    check = "ok" if written and same and err < 1e-5 else "FAIL"
                    if H is not None:
                        a_mine = cp.zeros((M, F), cp.uint16)
                        project.swiglu_forward(C1, a_mine)
                        stream.synchronize()
                        if not bool((a_mine == H).all()):
                            check = "FAIL(a)"
                    if check != "ok":
                        failures.append(f"B={B} {name} {v}: written={written} err={err:.2e} "
                                        f"replay-equal={same} {check}")
                    t = timed(stream, lambda plan=plan: plan.launch(stream))
                    # the same launch storing nothing (ldc 0): the loads and products alone
                    bare = gemm.Planned(plan.function, plan.grid, plan.shared,
                                        plan.args[:5] + (np.int32(0),) + plan.args[6:], plan.maps)
                    t_bare = timed(stream, lambda bare=bare: bare.launch(stream))
                    row(B, name, v, err, t, t / base, check, t_bare)
        if "backward" in directions:
            backward_pass(args, shapes, T, variants, kernels, project, blas, stream, rng, row,
                          failures)
        # q | k | v with the rope in the epilogue, against cuBLAS + rope_forward
        H, Hkv, E = c.n_head, c.n_kv_head or c.n_head, D // c.n_head
        ropes = [v for v in variants if gemm.VARIANTS[v].rope == E] \
            if "forward" in directions else []
        angles = rng.uniform(0, 6.3, (T, E // 2))
        cos = cp.asarray(np.cos(angles).astype(np.float32))
        sin = cp.asarray(np.sin(angles).astype(np.float32))
        for B in map(int, args.batches.split(",")) if ropes else ():
            M, N, K = B * T, qkv, D
            A = bf16_bits(rng, (M, K))
            W = bf16_bits(rng, (N, K), scale=K ** -0.5)
            x = (as_f64(A) @ as_f64(W).T).reshape(M, N // E, E)
            c64 = cos.astype(cp.float64)[cp.arange(M) % T][:, None, :]
            s64 = sin.astype(cp.float64)[cp.arange(M) % T][:, None, :]
            x1, x2 = x[:, :H + Hkv, :E // 2], x[:, :H + Hkv, E // 2:]
            ref = x.copy()
            ref[:, :H + Hkv, :E // 2] = x1 * c64 - x2 * s64
            ref[:, :H + Hkv, E // 2:] = x2 * c64 + x1 * s64
            ref = ref.reshape(M, N)
            C0 = cp.zeros((M, N), cp.float32)
            out0 = cp.zeros((M, N), cp.uint16)

            def cublas_rope():
                blas.gemm(False, True, M, N, K, A.data.ptr, K, W.data.ptr, K, C0.data.ptr, N,
                          ab_type="bfloat16", c_type="float32")
                project.rope_forward(C0, out0, cos, sin, T, H, Hkv)

            t_base = timed(stream, cublas_rope)
            row(B, "qkv+rope", "cublas+rope", rel(as_f64(out0), ref), t_base, 1.0, "-")
            # the same product by the own float32 kernel, then rope_forward: the bits to equal
            C1 = cp.zeros((M, N), cp.float32)
            kernels.plan("gemm_f32t_c_n128_s6", A, W, C1).launch(stream)
            want = cp.zeros((M, N), cp.uint16)
            project.rope_forward(C1, want, cos, sin, T, H, Hkv)
            for v in ropes:
                out = cp.full((M, N), 0xFFFF, cp.uint16)  # NaN bits
                rope = gemm.Rope(out.data.ptr, N, cos.data.ptr, sin.data.ptr, T, H + Hkv)
                plan = kernels.plan_pointers(v, M, N, K, A.data.ptr, K, W.data.ptr, K, 0, N,
                                             rope=rope)
                plan.launch(stream)
                stream.synchronize()
                got = as_f64(out)
                err = rel(got, ref) if not bool(cp.isnan(got).any()) else float("inf")
                first = out.copy()
                out.fill(0xFFFF)
                plan.launch(stream)
                stream.synchronize()
                same = bool((out == first).all())
                bits = "bits=" if bool((out == want).all()) else "bits~"
                check = "ok" if err < 1e-2 and same else "FAIL"
                if check != "ok":
                    failures.append(f"B={B} qkv+rope {v}: err={err:.2e} replay-equal={same}")
                t = timed(stream, lambda plan=plan: plan.launch(stream))
                row(B, "qkv+rope", v, err, t, t / t_base, f"{check} {bits}")
    print()
    print("| B | product | kernel | rel err vs f64 | us | / cuBLAS | check | us, nothing stored |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        B, name, v, err, t, ratio, check, bare = (*r, float("nan"))[:8]
        print(f"| {B} | {name} | {v} | {err:.2e} | {t:.1f} | {ratio:.3f} | {check} | {bare:.1f} |")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
