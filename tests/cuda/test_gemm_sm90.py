"""The project's own product kernel (accelerated/cuda/gemm.py,
kernels/gemm_sm90.cu) on a Hopper GPU: every variant on shapes whose
rows, columns and K are no multiples of the tiles, against a float64
product of the same bfloat16 operands; every element written (the output
poisoned first); two launches, and a launch replayed from a captured
graph, bitwise equal; the SwiGLU epilogue's `a` bitwise the swiglu
kernel's on the product's own gu. Needs sm_90 (wgmma): skipped on the
CPU stand-ins and on other GPUs."""

import numpy as np
import pytest

from .helpers import cupy

pytestmark = [pytest.mark.gpu]


def _emulated() -> bool:
    # asked when a test runs: tests/support.EMULATED is fixed when it is first
    # imported, which may be while a module here is collected on the stand-ins
    return getattr(cupy, "__version__", None) == "emulated"


@pytest.fixture(scope="module")
def kernels():
    if _emulated():
        pytest.skip("wgmma and the copy engine: a Hopper GPU")
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the kernel is sm_90a's")
    from coppelius.accelerated.cuda import gemm
    from coppelius.accelerated.cuda.compile import Kernels

    return gemm, gemm.Kernels(), Kernels("bf16")


def _operand(rng, shape, scale=1.0):
    import ml_dtypes

    x = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16)
    return cupy.asarray(x.view(np.uint16))


def _f64(bits):
    return (bits.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)


SHAPES = [(1000, 520, 200), (1000, 528, 200), (257, 136, 1408), (2048, 2816, 512)]


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_every_variant_against_float64(kernels, M, N, K):
    gemm, own, project = kernels
    rng = np.random.default_rng(M + N + K)
    A, W = _operand(rng, (M, K)), _operand(rng, (N, K), K ** -0.5)
    ref = _f64(A) @ _f64(W).T
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for name, v in gemm.VARIANTS.items():
            if v.epilogue in ("rope", "bf16_tma", "swiglu_a") or v.layout != "kk":
                continue  # test_the_rope_epilogue, test_the_backward_layouts, below
            C = cupy.full((M, N), cupy.nan, cupy.float32)
            H = cupy.full((M, N // 2), 0xFFFF, cupy.uint16) if v.swiglu else None
            if v.epilogue == "swiglu_tma" and (N // 2) % 8:
                with pytest.raises(ValueError, match="multiple of 8"):
                    own.plan(name, A, W, C, H)
                continue
            plan = own.plan(name, A, W, C, H)
            plan.launch(stream)
            stream.synchronize()
            assert not bool(cupy.isnan(C).any()), name
            err = float(cupy.linalg.norm(C - ref) / cupy.linalg.norm(ref))
            assert err < 1e-5, (name, err)
            first = C.copy()
            C.fill(cupy.nan)
            plan.launch(stream)
            stream.synchronize()
            assert bool((C.view(cupy.uint32) == first.view(cupy.uint32)).all()), name
            if H is not None:
                a = cupy.zeros_like(H)
                project.swiglu_forward(C, a)
                stream.synchronize()
                assert bool((a == H).all()), name
        # the gate/up kernel that stores a alone: a bitwise that of the same
        # tiles storing gu too (the products the backward's dswiglu_again
        # computes again), F a multiple of 8 (a's rows through the copy engine)
        if N % 2 == 0:
            F = N // 2
            a_alone = cupy.full((M, F), 0xFFFF, cupy.uint16)
            args = (M, N, K, A.data.ptr, K, W.data.ptr, K, 0, N, a_alone.data.ptr)
            if F % 8:
                with pytest.raises(ValueError, match="multiple of 8"):
                    own.plan_pointers("gemm_swiglua_p_m2n128_s4", *args)
                return
            C, a_both = cupy.zeros((M, N), cupy.float32), cupy.zeros((M, F), cupy.uint16)
            own.plan("gemm_swiglut_p_m2n128_s4", A, W, C, a_both).launch(stream)
            own.plan_pointers("gemm_swiglua_p_m2n128_s4", *args).launch(stream)
            stream.synchronize()
            assert bool((a_alone == a_both).all())


@pytest.mark.parametrize("rows,n_out,n_in,pad", [(1000, 520, 200, 0), (2048, 512, 1408, 0),
                                                  (4096, 1536, 512, 0), (520, 64, 136, 0),
                                                  (1000, 136, 200, 24), (8192, 512, 136, 8)])
def test_the_backward_layouts_against_float64(kernels, rows, n_out, n_in, pad):
    """dX = dY W (layout kn: B given as (K,N)) with float32 and bfloat16
    results, and dW = dY^T X (layout mn: A given as (K,M) too; also with K
    split and the partials summed in split order, where M is whole tiles),
    against float64 products of the same operands: rows, columns and K past
    the tiles, row strides `pad` past the columns, every element written
    and none past them, two launches bitwise equal."""
    gemm, own, _ = kernels
    rng = np.random.default_rng(rows + n_out + n_in)
    dY = _operand(rng, (rows, n_out + pad))[:, :n_out]
    X = _operand(rng, (rows, n_in + pad))[:, :n_in]
    W = _operand(rng, (n_out, n_in + pad), n_out ** -0.5)[:, :n_in]
    lo, li = n_out + pad, n_in + pad  # the row strides
    products = {"kn": (rows, n_in, n_out, dY, lo, W, li, _f64(dY) @ _f64(W)),
                "mn": (n_out, n_in, rows, dY, lo, X, li, _f64(dY).T @ _f64(X))}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for name, v in gemm.VARIANTS.items():
            if v.layout == "kk" or v.epilogue in ("dswiglu", "dswiglu_again"):
                continue  # (test_the_dswiglu_epilogue, test_the_gate_up_products_again)
            m, n, k, A, lda, B, ldb, ref = products[v.layout]
            if v.split and m % v.bm:
                with pytest.raises(ValueError, match="whole tiles"):
                    own.plan_pointers(name, m, n, k, A.data.ptr, lda, B.data.ptr, ldb, 0, n)
                continue
            bf16 = v.epilogue == "bf16_tma"
            full = cupy.full((m, n + pad), 0xFFFF, cupy.uint16) if bf16 else \
                cupy.full((m, n + pad), cupy.nan, cupy.float32)
            C = full[:, :n]
            plan = own.plan_pointers(name, m, n, k, A.data.ptr, lda, B.data.ptr, ldb,
                                     C.data.ptr, n + pad)
            plan.launch(stream)
            stream.synchronize()
            got = _f64(C) if bf16 else C.astype(cupy.float64)
            assert not bool(cupy.isnan(got).any()), name
            assert bool(cupy.isnan(_f64(full[:, n:]) if bf16 else full[:, n:]).all()), name
            err = float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
            assert err < (8e-3 if bf16 else 1e-5), (name, err)
            first = full.copy()
            full.fill(0xFFFF if bf16 else cupy.nan)
            plan.launch(stream)
            stream.synchronize()
            assert bool((full.view(cupy.uint16) == first.view(cupy.uint16)).all()), name


@pytest.mark.parametrize("rows,D,F", [(1000, 200, 136), (4096, 512, 1408)])
def test_the_dswiglu_epilogue(kernels, rows, D, F):
    """The down product's dX with the SwiGLU backward in its epilogue: dgu
    and a bitwise the unfused path's (the swiglu_backward kernel on the
    step's own float32 dX product: the same formula on the same values),
    and within the operands' rounding of the reference's float64 formula;
    every element written, two launches bitwise equal."""
    from coppelius.accelerated.cuda import products
    from coppelius.reference.layers.swiglu import swiglu_backward, swiglu_forward

    gemm, own, project = kernels
    rng = np.random.default_rng(rows + D + F)
    dres, W = _operand(rng, (rows, D)), _operand(rng, (D, F), D ** -0.5)
    gu = cupy.asarray(rng.standard_normal((rows, 2 * F), dtype=np.float32) * 2)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # the unfused path's: the step's dX product, then the swiglu_backward kernel
        da = cupy.full((rows, F), cupy.nan, cupy.float32)
        own.plan_pointers(products.BACKWARD_INPUT["float32"], rows, F, D, dres.data.ptr, D,
                          W.data.ptr, F, da.data.ptr, F).launch(stream)
        want_dgu = cupy.zeros((rows, 2 * F), cupy.uint16)
        want_a = cupy.zeros((rows, F), cupy.uint16)
        project.swiglu_backward(da, gu, want_dgu, want_a)
        # float64: the reference's formula on the float64 product
        g, u = (cupy.asnumpy(x).astype(np.float64) for x in (gu[:, :F], gu[:, F:]))
        _, cache = swiglu_forward(g, u)
        ref_dgu = cupy.asarray(np.concatenate(
            swiglu_backward(cupy.asnumpy(_f64(dres) @ _f64(W)), cache), axis=1))
        for name, v in gemm.VARIANTS.items():
            if v.epilogue != "dswiglu":
                continue
            dgu = cupy.full((rows, 2 * F), 0xFFFF, cupy.uint16)
            a = cupy.full((rows, F), 0xFFFF, cupy.uint16)
            plan = own.plan_pointers(name, rows, F, D, dres.data.ptr, D, W.data.ptr, F,
                                     gu.data.ptr, 2 * F, dswiglu=gemm.Dswiglu(dgu.data.ptr,
                                                                              a.data.ptr))
            _check_dswiglu(name, plan, stream, dgu, a, want_dgu, want_a, ref_dgu)


def _check_dswiglu(name, plan, stream, dgu, a, want_dgu, want_a, ref_dgu):
    """A dswiglu plan launched on poisoned dgu, a: both bitwise the unfused
    path's (want_dgu, want_a), dgu within the operands' rounding of the
    float64 reference, a second launch bitwise the first."""
    plan.launch(stream)
    stream.synchronize()
    wrong = int((dgu != want_dgu).sum()) + int((a != want_a).sum())
    assert wrong == 0, (name, wrong)
    err = float(cupy.linalg.norm(_f64(dgu) - ref_dgu) / cupy.linalg.norm(ref_dgu))
    assert err < 8e-3, (name, err)
    first = dgu.copy(), a.copy()
    dgu.fill(0xFFFF)
    a.fill(0xFFFF)
    plan.launch(stream)
    stream.synchronize()
    assert bool((dgu == first[0]).all()) and bool((a == first[1]).all()), name


@pytest.mark.parametrize("rows,D,F", [(1000, 200, 136), (4096, 512, 1408), (520, 768, 2048)])
def test_the_gate_up_products_again(kernels, rows, D, F):
    """dswiglu_again, the SwiGLU backward with g | u = h W_gu^T computed
    again beside da = dres W_down in its tile: dgu and a bitwise the step's
    path that keeps gu (the forward's gate/up kernel the rule pairs with it,
    then the own float32 dX product and the swiglu_backward kernel), within
    the operands' rounding of the reference's float64 formula on float64
    products; rows, F and d_model past the tiles, every element written,
    two launches bitwise equal."""
    from coppelius.accelerated.cuda import products
    from coppelius.reference.layers.swiglu import swiglu_backward, swiglu_forward

    gemm, own, project = kernels
    rng = np.random.default_rng(rows + D + F + 1)
    dres, W_down = _operand(rng, (rows, D)), _operand(rng, (D, F), D ** -0.5)
    h, W_gu = _operand(rng, (rows, D)), _operand(rng, (2 * F, D), D ** -0.5)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        gu = cupy.full((rows, 2 * F), cupy.nan, cupy.float32)
        own.plan(products.SWIGLU, h, W_gu, gu, cupy.zeros((rows, F), cupy.uint16)).launch(stream)
        da = cupy.full((rows, F), cupy.nan, cupy.float32)
        own.plan_pointers(products.BACKWARD_INPUT["float32"], rows, F, D, dres.data.ptr, D,
                          W_down.data.ptr, F, da.data.ptr, F).launch(stream)
        want_dgu = cupy.zeros((rows, 2 * F), cupy.uint16)
        want_a = cupy.zeros((rows, F), cupy.uint16)
        project.swiglu_backward(da, gu, want_dgu, want_a)
        gu64 = _f64(h) @ _f64(W_gu).T
        _, cache = swiglu_forward(cupy.asnumpy(gu64[:, :F]), cupy.asnumpy(gu64[:, F:]))
        ref_dgu = cupy.asarray(np.concatenate(
            swiglu_backward(cupy.asnumpy(_f64(dres) @ _f64(W_down)), cache), axis=1))
        for name, v in gemm.VARIANTS.items():
            if not v.again:
                continue
            dgu = cupy.full((rows, 2 * F), 0xFFFF, cupy.uint16)
            a = cupy.full((rows, F), 0xFFFF, cupy.uint16)
            d = gemm.Dswiglu(dgu.data.ptr, a.data.ptr, h.data.ptr, D, W_gu.data.ptr, D)
            plan = own.plan_pointers(name, rows, F, D, dres.data.ptr, D, W_down.data.ptr, F, 0,
                                     0, dswiglu=d)
            _check_dswiglu(name, plan, stream, dgu, a, want_dgu, want_a, ref_dgu)


@pytest.mark.parametrize("E, H, Hkv, M", [(64, 8, 8, 2048), (64, 4, 1, 1000), (128, 4, 2, 520)])
def test_the_rope_epilogue(kernels, E, H, Hkv, M):
    """q | k | v with the rope in the epilogue: the operands against a
    float64 rotation of the float64 product (bfloat16 rounding), v's heads
    passed, every element written, two launches bitwise equal; T below M:
    rows take their position mod T."""
    gemm, own, _ = kernels
    rng = np.random.default_rng(E + H + M)
    T, K, N = 256, 512, (H + 2 * Hkv) * E
    A, W = _operand(rng, (M, K)), _operand(rng, (N, K), K ** -0.5)
    angles = rng.uniform(0, 6.3, (T, E // 2))
    cos = cupy.asarray(np.cos(angles).astype(np.float32))
    sin = cupy.asarray(np.sin(angles).astype(np.float32))
    x = (_f64(A) @ _f64(W).T).reshape(M, N // E, E)
    pos = cupy.arange(M) % T
    c, s = cos.astype(cupy.float64)[pos][:, None, :], sin.astype(cupy.float64)[pos][:, None, :]
    ref = x.copy()
    x1, x2 = x[:, :H + Hkv, :E // 2], x[:, :H + Hkv, E // 2:]
    ref[:, :H + Hkv, :E // 2] = x1 * c - x2 * s
    ref[:, :H + Hkv, E // 2:] = x2 * c + x1 * s
    ref = ref.reshape(M, N)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for name, v in gemm.VARIANTS.items():
            if v.rope != E:
                continue
            out = cupy.full((M, N), 0xFFFF, cupy.uint16)
            rope = gemm.Rope(out.data.ptr, N, cos.data.ptr, sin.data.ptr, T, H + Hkv)
            plan = own.plan_pointers(name, M, N, K, A.data.ptr, K, W.data.ptr, K, 0, N, rope=rope)
            plan.launch(stream)
            stream.synchronize()
            got = _f64(out)
            assert not bool(cupy.isnan(got).any()), name
            err = float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
            assert err < 8e-3, (name, err)
            first = out.copy()
            out.fill(0xFFFF)
            plan.launch(stream)
            stream.synchronize()
            assert bool((out == first).all()), name


def test_a_captured_launch_replays_the_eager_bits(kernels):
    gemm, own, _ = kernels
    rng = np.random.default_rng(7)
    M, N, K = 1024, 1536, 512
    A, W = _operand(rng, (M, K)), _operand(rng, (N, K), K ** -0.5)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for name in ("gemm_f32_c_n256_s4", "gemm_f32_p_m2n128_s6", "gemm_f32_c2_n256_s4"):
            C = cupy.full((M, N), cupy.nan, cupy.float32)
            plan = own.plan(name, A, W, C)
            plan.launch(stream)
            stream.synchronize()
            eager = C.copy()
            C.fill(cupy.nan)
            stream.begin_capture()
            plan.launch(stream)
            graph = stream.end_capture()
            for _ in range(2):
                C.fill(cupy.nan)
                graph.launch(stream)
                stream.synchronize()
                assert bool((C.view(cupy.uint32) == eager.view(cupy.uint32)).all()), name


def test_operands_it_cannot_take_are_refused(kernels):
    gemm, own, _ = kernels
    A = cupy.zeros((64, 64), np.uint16)
    W = cupy.zeros((64, 64), np.uint16)
    with pytest.raises(ValueError, match="shapes"):
        own.plan("gemm_f32_c_n256_s4", A, W, cupy.zeros((64, 32), np.float32))
    with pytest.raises(ValueError, match="SwiGLU"):
        own.plan("gemm_swiglu_c_n256_s4", A, W, cupy.zeros((64, 64), np.float32))
    with pytest.raises(ValueError, match="unit column stride"):
        own.plan("gemm_f32_c_n256_s4", A[:, ::2], W[:, :32], cupy.zeros((64, 64), np.float32))
