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

from tests.support import EMULATED

from .helpers import cupy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(EMULATED, reason="wgmma and the copy engine: a Hopper GPU")]


@pytest.fixture(scope="module")
def kernels():
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


SHAPES = [(1000, 520, 200), (257, 136, 1408), (2048, 2816, 512)]


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_every_variant_against_float64(kernels, M, N, K):
    gemm, own, project = kernels
    rng = np.random.default_rng(M + N + K)
    A, W = _operand(rng, (M, K)), _operand(rng, (N, K), K ** -0.5)
    ref = _f64(A) @ _f64(W).T
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for name, v in gemm.VARIANTS.items():
            C = cupy.full((M, N), cupy.nan, cupy.float32)
            H = cupy.full((M, N // 2), 0xFFFF, cupy.uint16) if v.epilogue == "swiglu" else None
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
