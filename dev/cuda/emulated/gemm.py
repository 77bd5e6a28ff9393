"""The stand-in of the project's own product kernel (accelerated/cuda/gemm.py's
Kernels, kernels/gemm_sm90.cu): its contract on host memory. The product
is cuBLAS's stand-in's own (the same NumPy operation on the same float32
values, so a step gives the same bits with either), and the SwiGLU
variants' a is the swiglu kernel's stand-in's on the product's gu (swiglu_a:
on a gu of its own, not stored), the rope variants' operands the rope
kernel's stand-in's on the float32 product, the dswiglu variants' dgu and a
the swiglu_backward kernel's on the product's da (dswiglu_again: and on
the gate/up product computed again, as the forward's stand-in computes it)."""

from __future__ import annotations

import ctypes

import numpy as np

from .cublas import _gemm
from .runtime import _submit
from .rope import k_rope_forward
from .swiglu import k_swiglu_backward, k_swiglu_forward

CUDA_R_32F, CUDA_R_16BF, CUBLAS_COMPUTE_32F = 0, 14, 68


def _rows(address: int, dtype, rows: int, cols: int, ld: int) -> np.ndarray:
    """The row-major (rows, cols) matrix at address, row stride ld, writable."""
    item = np.dtype(dtype).itemsize
    buf = (ctypes.c_char * (((rows - 1) * ld + cols) * item)).from_address(address)
    raw = np.frombuffer(buf, dtype=dtype)
    return np.lib.stride_tricks.as_strided(raw, shape=(rows, cols), strides=(ld * item, item),
                                           writeable=True)


class _Plan:
    def __init__(self, variant, M, N, K, A, lda, B, ldb, C, ldc, H, rope=None, dswiglu=None):
        self.variant, self.shape, self.rope, self.dswiglu = variant, (M, N, K), rope, dswiglu
        self.operands = (A, lda, B, ldb, C, ldc, H)

    def launch(self, stream=None) -> None:
        M, N, K = self.shape
        A, lda, B, ldb, C, ldc, H = self.operands

        rope = self.rope

        def run():
            from coppelius.accelerated.cuda import gemm
            from coppelius.accelerated.cuda.cublas import column_major

            v = gemm.VARIANTS[self.variant]
            # the column-major call cuBLAS's stand-in makes for the same
            # row-major product (B first): the same bits
            trans_a, trans_b = {"kk": (False, True), "kn": (False, False),
                                "mn": (True, False)}[v.layout]
            # the float32 product is the epilogue's input only
            fused = rope or self.dswiglu or v.epilogue == "swiglu_a"
            product = np.empty((M, N), np.float32) if fused else None
            at, ld = (product.ctypes.data, N) if fused else (C, ldc)
            g = column_major(trans_a, trans_b, M, N, K, lda, ldb, ld)
            ct = CUDA_R_16BF if v.epilogue == "bf16_tma" else CUDA_R_32F
            _gemm(g.transa, g.transb, g.m, g.n, g.k, 1.0, B, CUDA_R_16BF, g.lda, 0, A,
                  CUDA_R_16BF, g.ldb, 0, 0.0, at, ct, g.ldc, 0, 1, CUBLAS_COMPUTE_32F)
            gu = None
            if v.again:  # g | u = h W_gu^T again: the forward's product (layout kk)
                d = self.dswiglu
                gu = np.empty((M, 2 * N), np.float32)
                g = column_major(False, True, M, 2 * N, K, d.ldh, d.ldw, 2 * N)
                _gemm(g.transa, g.transb, g.m, g.n, g.k, 1.0, d.w, CUDA_R_16BF, g.lda, 0, d.h,
                      CUDA_R_16BF, g.ldb, 0, 0.0, gu.ctypes.data, CUDA_R_32F, g.ldc, 0, 1,
                      CUBLAS_COMPUTE_32F)
            if rope:
                R = v.rope
                half = R // 2
                k_rope_forward(True, product, _rows(rope.out, np.uint16, M, N, rope.ld),
                               _rows(rope.cos, np.float32, rope.T, half, half),
                               _rows(rope.sin, np.float32, rope.T, half, half), M, rope.T,
                               rope.rotated, R, R, N, 1)
            if self.dswiglu:  # the swiglu_backward kernel's stand-in on da
                d = self.dswiglu
                k_swiglu_backward(True, product,
                                  gu if gu is not None else _rows(C, np.float32, M, 2 * N, ldc),
                                  _rows(d.dgu, np.uint16, M, 2 * N, 2 * N),
                                  _rows(d.a, np.uint16, M, N, N), M, N, 1)
            if H:
                F = N // 2
                k_swiglu_forward(True, product if product is not None
                                 else _rows(C, np.float32, M, N, ldc),
                                 _rows(H, np.uint16, M, F, F), M, F, 1)

        _submit(run)


class FakeGemmKernels:
    """gemm.Kernels on the CPU: plans check what the real ones check."""

    def __init__(self, watchdog: bool = False):
        self.planned = 0

    def plan_pointers(self, variant, M, N, K, A, lda, B, ldb, C, ldc, H=0, rope=None,
                      dswiglu=None) -> _Plan:
        from coppelius.accelerated.cuda import gemm

        gemm.check_plan(variant, M, N, K, A, lda, B, ldb, C, ldc, H, rope, dswiglu)
        self.planned += 1
        return _Plan(variant, M, N, K, A, lda, B, ldb, C, ldc, H, rope, dswiglu)
