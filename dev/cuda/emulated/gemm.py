"""The stand-in of the project's own product kernel (accelerated/cuda/gemm.py's
Kernels, kernels/gemm_sm90.cu): its contract on host memory. The product
is cuBLAS's stand-in's own (the same NumPy operation on the same float32
values, so a step gives the same bits with either), and the SwiGLU
variants' a is the swiglu kernel's stand-in's on the product's gu, the rope
variants' operands the rope kernel's stand-in's on the float32 product."""

from __future__ import annotations

import ctypes

import numpy as np

from .cublas import _gemm
from .runtime import _submit
from .rope import k_rope_forward
from .swiglu import k_swiglu_forward

CUDA_R_32F, CUDA_R_16BF, CUBLAS_COMPUTE_32F = 0, 14, 68


def _rows(address: int, dtype, rows: int, cols: int, ld: int) -> np.ndarray:
    """The row-major (rows, cols) matrix at address, row stride ld, writable."""
    item = np.dtype(dtype).itemsize
    buf = (ctypes.c_char * (((rows - 1) * ld + cols) * item)).from_address(address)
    raw = np.frombuffer(buf, dtype=dtype)
    return np.lib.stride_tricks.as_strided(raw, shape=(rows, cols), strides=(ld * item, item),
                                           writeable=True)


class _Plan:
    def __init__(self, variant, M, N, K, A, lda, B, ldb, C, ldc, H, rope=None):
        self.variant, self.shape, self.rope = variant, (M, N, K), rope
        self.operands = (A, lda, B, ldb, C, ldc, H)

    def launch(self, stream=None) -> None:
        M, N, K = self.shape
        A, lda, B, ldb, C, ldc, H = self.operands

        rope = self.rope

        def run():
            # row-major C = A B^T is column-major C^T = B A^T: cuBLAS's call, B first
            product = np.empty((M, N), np.float32) if rope else None
            at, ld = (product.ctypes.data, N) if rope else (C, ldc)
            _gemm(1, 0, N, M, K, 1.0, B, CUDA_R_16BF, ldb, 0, A, CUDA_R_16BF, lda, 0, 0.0, at,
                  CUDA_R_32F, ld, 0, 1, CUBLAS_COMPUTE_32F)
            if rope:
                from coppelius.accelerated.cuda import gemm

                R = gemm.VARIANTS[self.variant].rope
                half = R // 2
                k_rope_forward(True, product, _rows(rope.out, np.uint16, M, N, rope.ld),
                               _rows(rope.cos, np.float32, rope.T, half, half),
                               _rows(rope.sin, np.float32, rope.T, half, half), M, rope.T,
                               rope.rotated, R, R, N, 1)
            if H:
                F = N // 2
                k_swiglu_forward(True, _rows(C, np.float32, M, N, ldc),
                                 _rows(H, np.uint16, M, F, F), M, F, 1)

        _submit(run)


class FakeGemmKernels:
    """gemm.Kernels on the CPU: plans check what the real ones check."""

    def __init__(self, watchdog: bool = False):
        self.planned = 0

    def plan_pointers(self, variant, M, N, K, A, lda, B, ldb, C, ldc, H=0, rope=None) -> _Plan:
        from coppelius.accelerated.cuda import gemm

        gemm.check_plan(variant, M, N, K, A, lda, B, ldb, C, ldc, H, rope)
        self.planned += 1
        return _Plan(variant, M, N, K, A, lda, B, ldb, C, ldc, H, rope)
