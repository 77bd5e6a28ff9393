"""cuBLAS through ctypes, with the program's own handle, stream and workspace.

CuPy's own matmul refuses to run while its stream captures a graph (its
wrapper sets the handle's stream on every call, which is illegal during a
capture); cuBLAS itself captures fine. So the CuPy backend keeps one cuBLAS
handle of its own: the stream is set once, before the capture, then the
workspace (setting the stream resets it), and every product is
`cublasGemmEx` or `cublasGemmStridedBatchedEx`.

Types (SPEC section 6): under bf16 both operands are CUDA_R_16BF and the
product accumulates in float32 (CUBLAS_COMPUTE_32F) with a float32 result
(or a bfloat16 result where that result is only ever another product's
operand: cuBLAS rounds the float32 value once). Under fp32 everything is
CUDA_R_32F with CUBLAS_COMPUTE_32F and the default math mode: no TF32.

The project's matrices are row-major and cuBLAS's column-major. A row-major
(m, n) matrix with row stride ld is the column-major (n, m) matrix with
leading dimension ld, its transpose. So C = op(A) @ op(B) (row-major, C is
(m, n)) is computed as the column-major C^T = op(B)^T @ op(A)^T: B is passed
first, m and n swap, and each operand keeps its own transpose flag.
`column_major` does that mapping (pure Python, checked on the CPU).
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass

# cublasOperation_t, cudaDataType_t, cublasComputeType_t, cublasGemmAlgo_t, cublasMath_t
OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH = 0

DTYPES = {"float32": CUDA_R_32F, "bfloat16": CUDA_R_16BF}
ITEMSIZE = {"float32": 4, "bfloat16": 2}
WORKSPACE_BYTES = 32 << 20  # cuBLAS's advice for Hopper


class CublasError(RuntimeError):
    pass


@dataclass(frozen=True)
class Gemm:
    """One product in cuBLAS's column-major terms (the arguments of
    cublasGemm[StridedBatched]Ex, less handle, scalars and pointers)."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    first: str  # which row-major operand cuBLAS reads as its A: "B"


def column_major(trans_a: bool, trans_b: bool, m: int, n: int, k: int, lda: int, ldb: int,
                 ldc: int, stride_a: int = 0, stride_b: int = 0, stride_c: int = 0) -> Gemm:
    """Row-major C (m,n) = op(A) (m,k) @ op(B) (k,n), each matrix given by its
    row stride (ld) and batch stride -> the column-major call computing C^T =
    op(B)^T op(A)^T: cuBLAS's A is our B, its B is our A."""
    rows_a, cols_a = (k, m) if trans_a else (m, k)  # A as stored, row-major
    rows_b, cols_b = (n, k) if trans_b else (k, n)
    if lda < cols_a or ldb < cols_b or ldc < n:
        raise ValueError(f"row strides too small: lda={lda} (A is {rows_a}x{cols_a}), "
                         f"ldb={ldb} (B is {rows_b}x{cols_b}), ldc={ldc} (C is {m}x{n})")
    return Gemm(transa=OP_T if trans_b else OP_N, transb=OP_T if trans_a else OP_N,
                m=n, n=m, k=k, lda=ldb, ldb=lda, ldc=ldc,
                stride_a=stride_b, stride_b=stride_a, stride_c=stride_c, first="B")


def _candidates() -> list:
    """Where libcublas may be: already loaded by CuPy (a soname resolves to
    the loaded copy), the CUDA toolkit, or NVIDIA's wheels."""
    names = ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    try:  # CuPy 14 finds its CUDA libraries with cuda.pathfinder
        from cuda.pathfinder import load_nvidia_dynamic_lib

        names.append(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception:
        pass
    roots = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    for root in filter(None, roots):
        names += sorted(glob.glob(os.path.join(root, "lib64", "libcublas.so*")))
    try:
        import nvidia

        for base in nvidia.__path__:
            names += sorted(glob.glob(os.path.join(base, "*", "lib", "libcublas.so*")))
    except ImportError:
        pass
    return names


_LIB = None
LOADED_FROM = None  # the name the library was loaded by (diagnostics)


def library():
    """The libcublas shared library (loaded once)."""
    global _LIB, LOADED_FROM
    if _LIB is None:
        try:
            import cupy.cuda.cublas  # noqa: F401  (loads CuPy's libcublas, when it links one)
        except Exception:
            pass
        errors = []
        for name in _candidates():
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise CublasError("libcublas not found: " + "; ".join(errors[-3:]))
        _declare(lib)
        _LIB, LOADED_FROM = lib, name
    return _LIB


def _declare(lib) -> None:
    p, i, ll, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_size_t
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
    lib.cublasDestroy_v2.argtypes = [p]
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetWorkspace_v2.argtypes = [p, p, sz]
    lib.cublasSetMathMode.argtypes = [p, i]
    lib.cublasGetVersion_v2.argtypes = [p, ctypes.POINTER(i)]
    lib.cublasGetStatusString.argtypes = [i]
    lib.cublasGetStatusString.restype = ctypes.c_char_p
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll,
                                               p, p, i, i, ll, i, i, i]
    for name in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2",
                 "cublasSetWorkspace_v2", "cublasSetMathMode", "cublasGetVersion_v2",
                 "cublasGemmEx", "cublasGemmStridedBatchedEx"):
        getattr(lib, name).restype = i


def _check(lib, status: int, what: str) -> None:
    if status != 0:
        text = lib.cublasGetStatusString(status)
        raise CublasError(f"{what}: cuBLAS status {status} ({text.decode() if text else '?'})")


class Cublas:
    """One handle bound to one stream, with its own workspace (a device
    buffer the caller keeps alive as long as the handle). dry=True loads
    nothing and computes nothing: with a `log` set, gemm only records the
    products (the memory plan's dry run, accelerated/cuda/memory_plan.py)."""

    def __init__(self, stream_ptr: int, workspace_ptr: int, workspace_bytes: int,
                 dry: bool = False):
        self.calls = 0  # products issued so far
        self.log = None  # a memory_plan.CommandLog recording every product, or None
        self.handle = None
        if dry:
            self.lib, self.version = None, 0
            return
        self.lib = library()
        handle = ctypes.c_void_p()
        _check(self.lib, self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        # the stream first: setting it resets the workspace to cuBLAS's own
        _check(self.lib, self.lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream_ptr)),
               "cublasSetStream")
        _check(self.lib, self.lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace_ptr),
                                                        workspace_bytes), "cublasSetWorkspace")
        _check(self.lib, self.lib.cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH),
               "cublasSetMathMode")
        version = ctypes.c_int()
        _check(self.lib, self.lib.cublasGetVersion_v2(handle, ctypes.byref(version)),
               "cublasGetVersion")
        self.version = version.value
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def close(self) -> None:
        if self.handle is not None:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = None

    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int,
             A: int, lda: int, B: int, ldb: int, C: int, ldc: int, *,
             ab_type: str, c_type: str, beta: float = 0.0, batch: int = 1,
             stride_a: int = 0, stride_b: int = 0, stride_c: int = 0) -> None:
        """Row-major C (m,n) = op(A) @ op(B) [+ beta C], float32 accumulation.
        A, B, C: device addresses; lda, ldb, ldc: row strides in elements;
        batch > 1: `batch` products, operand i at address + i * stride
        (elements). ab_type, c_type: "float32" or "bfloat16"."""
        g = column_major(trans_a, trans_b, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c)
        if self.log is not None:
            self.log.add("product", "gemm" if batch == 1 else "gemm_strided_batched",
                         {"m": m, "n": n, "k": k, "batch": batch, "trans_a": trans_a,
                          "trans_b": trans_b, "ab_type": ab_type, "c_type": c_type}, (A, B, C))
        if self.lib is None:  # dry: recorded only
            self.calls += 1
            return
        ab, c = DTYPES[ab_type], DTYPES[c_type]
        one = ctypes.byref(self._one)
        scale = ctypes.byref(self._zero if beta == 0.0 else ctypes.c_float(beta))
        pa, pb, pc = ctypes.c_void_p(B), ctypes.c_void_p(A), ctypes.c_void_p(C)  # B first
        if batch == 1:
            status = self.lib.cublasGemmEx(
                self.handle, g.transa, g.transb, g.m, g.n, g.k, one, pa, ab, g.lda, pb, ab,
                g.ldb, scale, pc, c, g.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        else:
            status = self.lib.cublasGemmStridedBatchedEx(
                self.handle, g.transa, g.transb, g.m, g.n, g.k, one, pa, ab, g.lda, g.stride_a,
                pb, ab, g.ldb, g.stride_b, scale, pc, c, g.ldc, g.stride_c, batch,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        _check(self.lib, status, f"gemm m={m} n={n} k={k} batch={batch}")
        self.calls += 1
