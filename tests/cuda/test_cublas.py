"""The cuBLAS products (accelerated/cuda/cublas.py): the row-major mapping
against NumPy, and fp32 products without TF32."""

import ml_dtypes
import numpy as np
import pytest

from coppelius.accelerated.cuda import cublas

from .helpers import PRECISIONS, dev, host, empty, as_float, policy, check_close, cupy

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


# ------------------------------------------------------------------ cuBLAS

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_gemm_row_major_against_numpy(precision, trans_a, trans_b):
    """C = op(A) @ op(B) in row-major terms, batched with strides and padded
    row strides, float32 accumulation over bfloat16 (or float32) operands."""
    rng = np.random.default_rng(1)
    batch, m, n, k, pad = 3, 37, 29, 53, 5
    shape_a = (k, m) if trans_a else (m, k)
    shape_b = (n, k) if trans_b else (k, n)
    a = rng.standard_normal((batch,) + shape_a).astype(np.float32)
    b = rng.standard_normal((batch,) + shape_b).astype(np.float32)
    # operands laid out with row strides wider than the rows
    A = np.full((batch, shape_a[0], shape_a[1] + pad), np.nan, np.float32)
    Bm = np.full((batch, shape_b[0], shape_b[1] + pad), np.nan, np.float32)
    A[:, :, :shape_a[1]], Bm[:, :, :shape_b[1]] = a, b
    kind = "bfloat16" if precision == "bf16" else "float32"
    to_op = (lambda x: dev(x.astype(ml_dtypes.bfloat16).view(np.uint16))) if precision == "bf16" \
        else dev
    dA, dB = to_op(A), to_op(Bm)
    ldc = n + 3
    for c_type in ("float32", kind):
        C = empty((batch, m, ldc), np.float32 if c_type == "float32" else np.uint16)
        cupy.cuda.Device().synchronize()  # the copies ran on the default stream
        stream = cupy.cuda.Stream(non_blocking=True)
        ws = cupy.empty(cublas.WORKSPACE_BYTES, np.uint8)
        blas = cublas.Cublas(stream.ptr, ws.data.ptr, cublas.WORKSPACE_BYTES)
        blas.gemm(trans_a, trans_b, m, n, k, dA.data.ptr, shape_a[1] + pad, dB.data.ptr,
                  shape_b[1] + pad, C.data.ptr, ldc, ab_type=kind, c_type=c_type, batch=batch,
                  stride_a=A[0].size, stride_b=Bm[0].size, stride_c=m * ldc)
        stream.synchronize()
        blas.close()
        got = as_float(C, "bf16" if c_type == "bfloat16" else "fp32")
        ra, rb = policy(a, precision).astype(np.float64), policy(b, precision).astype(np.float64)
        ra = np.swapaxes(ra, 1, 2) if trans_a else ra
        rb = np.swapaxes(rb, 1, 2) if trans_b else rb
        want = ra @ rb
        check_close(f"gemm {c_type}", got[:, :, :n], want, 1e-6 if c_type == "float32" else 4e-3)
        assert np.isnan(got[:, :, n:]).all(), "wrote outside the (m, n) block"


def test_fp32_products_are_not_tf32():
    """Operands whose low mantissa bits matter: TF32 (10 bits) would lose them."""
    m = n = k = 64
    a = np.full((m, k), 1 + 2.0 ** -20, np.float32)
    b = np.eye(k, n, dtype=np.float32)
    C, da, db = empty((m, n)), dev(a), dev(b)
    cupy.cuda.Device().synchronize()  # the copies ran on the default stream
    stream = cupy.cuda.Stream(non_blocking=True)
    ws = cupy.empty(cublas.WORKSPACE_BYTES, np.uint8)
    blas = cublas.Cublas(stream.ptr, ws.data.ptr, cublas.WORKSPACE_BYTES)
    blas.gemm(False, False, m, n, k, da.data.ptr, k, db.data.ptr, n, C.data.ptr, n,
              ab_type="float32", c_type="float32")
    stream.synchronize()
    blas.close()
    assert (host(C) == a).all()
