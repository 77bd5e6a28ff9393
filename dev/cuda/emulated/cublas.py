"""cuBLAS's stand-in: the entry points accelerated/cuda/cublas.py
declares, a column-major GEMM on host memory behind them."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from .runtime import _submit


def _matrix(addr, dtype_code, rows, cols, ld, batch=0, stride=0):
    """The column-major (rows, cols) matrix at addr with leading dimension ld,
    as float32, by real pointer arithmetic on host memory."""
    itemsize = 4 if dtype_code == 0 else 2
    addr += batch * stride * itemsize
    span = ((cols - 1) * ld + rows) * itemsize
    buf = (ctypes.c_char * span).from_address(addr)
    raw = np.frombuffer(buf, dtype=np.float32 if dtype_code == 0 else np.uint16)
    view = np.lib.stride_tricks.as_strided(raw, shape=(rows, cols), strides=(itemsize, ld * itemsize))
    if dtype_code == 0:
        return view
    return (view.astype(np.uint32) << 16).view(np.float32)


def _write(addr, dtype_code, rows, cols, ld, values, batch=0, stride=0):
    itemsize = 4 if dtype_code == 0 else 2
    addr += batch * stride * itemsize
    span = ((cols - 1) * ld + rows) * itemsize
    buf = (ctypes.c_char * span).from_address(addr)
    raw = np.frombuffer(buf, dtype=np.float32 if dtype_code == 0 else np.uint16)
    view = np.lib.stride_tricks.as_strided(raw, shape=(rows, cols), strides=(itemsize, ld * itemsize),
                                           writeable=True)
    if dtype_code == 0:
        view[...] = values
    else:
        view[...] = values.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _value(ref):
    return ref._obj.value


def _addr(p):
    return p.value or 0


def _gemm(transa, transb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc,
          batch, compute):
    assert compute == 68, "CUBLAS_COMPUTE_32F expected"
    assert at == bt, "operand types differ"
    for i in range(batch):
        a = _matrix(A, at, *((m, k) if transa == 0 else (k, m)), lda, i, sa)
        b = _matrix(B, bt, *((k, n) if transb == 0 else (n, k)), ldb, i, sb)
        a = a if transa == 0 else a.T
        b = b if transb == 0 else b.T
        c = alpha * np.matmul(np.ascontiguousarray(a), np.ascontiguousarray(b))
        if beta != 0:
            c = c + beta * _matrix(C, ct, m, n, ldc, i, sc)
        _write(C, ct, m, n, ldc, c, i, sc)


class FakeCublas:
    """The entry points accelerated/cublas.py declares."""

    def __init__(self):
        self.gemms = 0

    def cublasCreate_v2(self, ref):
        return 0

    def cublasDestroy_v2(self, h):
        return 0

    def cublasSetStream_v2(self, h, s):
        return 0

    def cublasSetWorkspace_v2(self, h, p, n):
        return 0

    def cublasSetMathMode(self, h, mode):
        assert mode == 0
        return 0

    def cublasGetVersion_v2(self, h, ref):
        return 0

    def cublasGetStatusString(self, status):
        return b"emulated"

    def cublasGemmEx(self, h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc,
                     compute, algo):
        args = (ta, tb, m, n, k, _value(alpha), _addr(A), at, lda, 0, _addr(B), bt, ldb, 0,
                _value(beta), _addr(C), ct, ldc, 0, 1, compute)
        _submit(lambda: _gemm(*args))
        return 0

    def cublasGemmStridedBatchedEx(self, h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb,
                                   beta, C, ct, ldc, sc, batch, compute, algo):
        args = (ta, tb, m, n, k, _value(alpha), _addr(A), at, lda, sa, _addr(B), bt, ldb, sb,
                _value(beta), _addr(C), ct, ldc, sc, batch, compute)
        _submit(lambda: _gemm(*args))
        return 0
