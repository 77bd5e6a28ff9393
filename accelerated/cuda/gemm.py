"""The project's own matrix-product kernel on Hopper (kernels/gemm_sm90.cu):
row-major C (M,N) float32 = A (M,K) @ B (N,K)^T with bfloat16 operands, the
forward's products (x @ W^T), the same product with the SwiGLU of the
gate/up projections or the rope of q | k | v done in its epilogue, and the
backward's layouts: B given as (K,N) (`kn`: dX = dY W), and A as (K,M)
too (`mn`: dW = dY^T X), with float32 or bfloat16 results.

The kernel needs sm_90a (wgmma, setmaxnreg), which CuPy's RawModule does
not target (it names the device's plain architecture itself), so this
module compiles its source with NVRTC directly (ctypes: the library CuPy
loads) to a cubin and loads that with CuPy. Operands reach the kernel
through tensor maps (the copy engine's descriptors), encoded on the host by
the driver (cuTensorMapEncodeTiled, ctypes into libcuda) and kept in a
device buffer: a map names one buffer's address, so a product is planned
once for its buffers (`plan`) and launched as often as needed (`launch`),
inside a captured graph too.

`map_geometry` and `check_shape`, the pure arithmetic, run without a GPU
(tests/test_gemm_sm90.py); the rest needs CuPy and a Hopper GPU.
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass

import numpy as np

from . import dependent_launch
from .compile import KERNEL_DIR

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

FILES = ("common.cuh", "swiglu.cu", "rope.cu", "gemm_sm90.cu")  # the module's source, in order
BK, THREADS = 64, 384  # kernels/gemm_sm90.cu's GEMM_BK, GEMM_THREADS
REDUCE_THREADS = 256  # gemm_splitk_reduce's block

# kernels/gemm_sm90.cu's EPI_* epilogues, by name
# (and dswiglu_again, the kernel of its own that computes the gate and up
# products again in the SwiGLU backward's tile; swiglu_a the gate/up kernel
# that stores a alone, its forward)
EPILOGUES = ("f32", "f32_tma", "swiglu", "swiglu_tma", "rope", "bf16_tma", "dswiglu",
             "swiglu_a", "dswiglu_again")
# stored through shared memory and the copy engine
STAGED = ("f32_tma", "swiglu_tma", "rope", "bf16_tma", "dswiglu", "swiglu_a", "dswiglu_again")
# the operands' layouts: kk both K-major (A (M,K), B (N,K)); kn B given as
# (K,N); mn A as (K,M) and B as (K,N)
LAYOUTS = ("kk", "kn", "mn")


# name -> Variant; kernels/gemm_sm90.cu's instantiations
@dataclass(frozen=True)
class Variant:
    mt: int  # 64-row blocks of a warpgroup's tile (ping-pong), else 1
    bn: int  # a tile's columns
    stages: int
    epilogue: str  # one of EPILOGUES
    pingpong: bool
    cluster: int = 1  # 2: pairs of blocks sharing B's slabs (multicast)
    rope: int = 0  # the rope epilogue's head width R (= E, every head rotated whole)
    layout: str = "kk"  # one of LAYOUTS
    split: bool = False  # K split into partials summed by gemm_splitk_reduce (split_k)
    buffers: int = 2  # a multiplying warpgroup's staging buffers (the staged epilogues')

    @property
    def bm(self) -> int:  # a tile's rows
        return 64 * self.mt if self.pingpong else 128

    @property
    def staging_rows(self) -> int:  # a warpgroup's rows of C (f32_tma: staged)
        return 64 * self.mt if self.pingpong else 64

    @property
    def swiglu(self) -> bool:  # the gate/up tiles: bn/2 gate and as many up columns
        return self.epilogue in ("swiglu", "swiglu_tma", "swiglu_a")

    @property
    def again(self) -> bool:  # dswiglu_again: da and the gate/up product in one tile
        return self.epilogue == "dswiglu_again"

    @property
    def stage_bytes(self) -> int:  # a slab of each operand (again: dres, h, W_gu, W_down)
        if self.again:
            return (2 * self.bm + 2 * self.bn + self.bn) * BK * 2
        return (self.bm + self.bn) * BK * 2

    @property
    def staging_buffers(self) -> int:  # a multiplying warpgroup's
        return self.buffers if self.staged else 0

    @property
    def staged(self) -> bool:  # stored through shared memory and the copy engine
        return self.epilogue in STAGED

    @property
    def box_b(self) -> int:  # the rows of B one copy brings (K-major)
        return self.bn // 2 if self.swiglu or self.cluster == 2 else self.bn

    @property
    def c_item(self) -> int:  # bytes of an element of the result C
        return 2 if self.epilogue == "bf16_tma" else 4


VARIANTS = {
    "gemm_f32_c_n256_s4": Variant(1, 256, 4, "f32", False),
    "gemm_f32_c_n128_s6": Variant(1, 128, 6, "f32", False),
    "gemm_f32_p_m2n128_s6": Variant(2, 128, 6, "f32", True),
    "gemm_f32_p_m1n128_s8": Variant(1, 128, 8, "f32", True),
    "gemm_f32_c2_n256_s4": Variant(1, 256, 4, "f32", False, 2),
    "gemm_f32_c2_n128_s6": Variant(1, 128, 6, "f32", False, 2),
    "gemm_f32_p2_m2n128_s6": Variant(2, 128, 6, "f32", True, 2),
    "gemm_f32t_c_n256_s4": Variant(1, 256, 4, "f32_tma", False),
    "gemm_f32t_c_n128_s6": Variant(1, 128, 6, "f32_tma", False),
    "gemm_f32t_p_m2n128_s4": Variant(2, 128, 4, "f32_tma", True),
    "gemm_f32t_p_m1n256_s4": Variant(1, 256, 4, "f32_tma", True),
    "gemm_swiglu_c_n256_s4": Variant(1, 256, 4, "swiglu", False),
    "gemm_swiglu_c_n128_s6": Variant(1, 128, 6, "swiglu", False),
    "gemm_swiglu_c2_n256_s4": Variant(1, 256, 4, "swiglu", False, 2),
    "gemm_swiglu_c2_n128_s6": Variant(1, 128, 6, "swiglu", False, 2),
    "gemm_swiglu_p2_m2n128_s6": Variant(2, 128, 6, "swiglu", True, 2),
    "gemm_swiglut_c_n128_s6": Variant(1, 128, 6, "swiglu_tma", False),
    "gemm_swiglut_c_n256_s4": Variant(1, 256, 4, "swiglu_tma", False),
    "gemm_swiglut_p_m2n128_s4": Variant(2, 128, 4, "swiglu_tma", True),
    "gemm_swiglut_p_m1n256_s4": Variant(1, 256, 4, "swiglu_tma", True),
    "gemm_rope64_c_n128_s6": Variant(1, 128, 6, "rope", False, rope=64),
    "gemm_rope128_c_n128_s6": Variant(1, 128, 6, "rope", False, rope=128),
    "gemm_rope64_p_m1n256_s4": Variant(1, 256, 4, "rope", True, rope=64),
    "gemm_rope128_p_m1n128_s6": Variant(1, 128, 6, "rope", True, rope=128),
    "gemm_rope128_p_m1n256_s4": Variant(1, 256, 4, "rope", True, rope=128),
    "gemm_f32t_kn_c_n128_s6": Variant(1, 128, 6, "f32_tma", False, layout="kn"),
    "gemm_f32t_kn_p_m2n128_s4": Variant(2, 128, 4, "f32_tma", True, layout="kn"),
    "gemm_bf16t_kn_p_m2n128_s4": Variant(2, 128, 4, "bf16_tma", True, layout="kn"),
    "gemm_dswiglu_kn_p_m1n128_s6": Variant(1, 128, 6, "dswiglu", True, layout="kn"),
    "gemm_swiglua_p_m2n128_s4": Variant(2, 128, 4, "swiglu_a", True),
    "gemm_swiglua_p_m1n256_s4": Variant(1, 256, 4, "swiglu_a", True),
    "gemm_swiglua_c_n256_s4": Variant(1, 256, 4, "swiglu_a", False),
    "gemm_dswiglu_again_p_m2n64_s3": Variant(2, 64, 3, "dswiglu_again", True, layout="kn",
                                             buffers=1),
    "gemm_dswiglu_again_p_m1n128_s3": Variant(1, 128, 3, "dswiglu_again", True, layout="kn"),
    "gemm_f32t_mn_p_m1n128_s6": Variant(1, 128, 6, "f32_tma", True, layout="mn"),
    "gemm_f32t_mn_p_m1n128_s6_splitk": Variant(1, 128, 6, "f32_tma", True, layout="mn",
                                               split=True),
}

# CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle,
# CUtensorMapL2promotion, CUtensorMapFloatOOBfill (cuda.h)
FLOAT32, BFLOAT16 = 7, 9
INTERLEAVE_NONE, SWIZZLE_128B, L2_256B, OOB_ZERO = 0, 3, 3, 0
MAP_BYTES = 128
MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class GemmError(RuntimeError):
    pass


def shared_bytes(v: Variant) -> int:
    """The dynamic shared memory a variant asks for: the stages, the staged
    epilogues' buffers (a variant's `buffers` per multiplying warpgroup,
    each its rows of 128 bytes), the stages' two barriers each, the
    two order barriers, dswiglu_again's count of tiles (16 bytes), and up
    to 1024 bytes to align the first stage."""
    staging = 2 * v.staging_buffers * v.staging_rows * 128
    count = 16 if v.again else 0
    return v.stages * v.stage_bytes + staging + (v.stages + 1) * 16 + count + 1024


@dataclass(frozen=True)
class MapGeometry:
    """The arguments of cuTensorMapEncodeTiled for a row-major (rows, cols)
    bfloat16 matrix of row stride ld (elements): innermost dimension first."""

    dims: tuple  # (cols, rows)
    strides: tuple  # (ld * 2,) bytes, the row stride (the innermost is implied)
    box: tuple  # (64, box_rows)


def map_geometry(rows: int, cols: int, ld: int, box_rows: int, item: int = 2) -> MapGeometry:
    """The tensor map of a row-major (rows, cols) matrix of `item`-byte
    elements moved in boxes of 128 bytes of a row (the 128-byte swizzle's
    row: 64 bfloat16 columns of an operand, K's or, transposed, M's or N's;
    32 float32 columns of C) by box_rows rows."""
    if ld < cols:
        raise ValueError(f"row stride {ld} below the {cols} columns")
    if (ld * item) % 16:
        raise ValueError(f"row stride {ld} elements of {item} bytes: the copy engine needs a "
                         f"multiple of 16 bytes")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"box of {box_rows} rows: 1 to 256")
    return MapGeometry(dims=(cols, rows), strides=(ld * item,), box=(128 // item, box_rows))


def check_shape(M: int, N: int, K: int, epilogue: str, layout: str = "kk") -> None:
    """The shapes the kernel takes: K and N multiples of 8 (the copy engine's
    16-byte strides, and the epilogue's pairs of columns: with the SwiGLU
    epilogue N is 2F, so F is a multiple of 4); with A given as (K,M)
    (layout mn), M too (the shapes its device checks cover; the copy
    engine itself constrains only lda)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}")
    if min(M, N, K) < 1:
        raise ValueError(f"empty product {M}x{N}x{K}")
    if K % 8 or N % 8:
        raise ValueError(f"product {M}x{N}x{K}: N and K must be multiples of 8")
    if layout == "mn" and M % 8:
        raise ValueError(f"product {M}x{N}x{K}: A given as (K,M) needs M a multiple of 8")


def check_addresses(A: int, lda: int, B: int, ldb: int, C: int, ldc: int, H: int = 0,
                    c_item: int = 4) -> None:
    """The copy engine's rule: every matrix 16-byte aligned, every row
    stride a multiple of 16 bytes (lda, ldb in bfloat16 elements, ldc in
    elements of c_item bytes, float32's 4 unless the result is bfloat16);
    the epilogue's 8-byte stores need no more."""
    if A % 16 or B % 16 or C % 16 or H % 16:
        raise ValueError("the product's matrices must start 16-byte aligned")
    if (lda * 2) % 16 or (ldb * 2) % 16 or (ldc * c_item) % 16:
        raise ValueError(f"row strides lda={lda}, ldb={ldb}, ldc={ldc}: multiples of 16 bytes")


@dataclass(frozen=True)
class Rope:
    """The rope epilogue's arguments: the operand matrix it writes (out, its
    row stride ld in elements), the (T, R/2) float32 cos and sin tables'
    addresses, the context T (row r's position is r mod T) and the number
    of heads rotated from column 0 (q's and k's: H + Hkv)."""

    out: int
    ld: int
    cos: int
    sin: int
    T: int
    rotated: int


@dataclass(frozen=True)
class Dswiglu:
    """The dswiglu epilogue's outputs (the product's C is then gu, read):
    dgu (M, 2F) bfloat16 operands (dg then du) and a (M, F) bfloat16, the
    forward's silu(g) u again. dswiglu_again (C not read) computes g and u
    again from the gate/up product's operands: h (M, K) (row stride ldh)
    and W_gu (2F, K) (row stride ldw), bfloat16."""

    dgu: int
    a: int
    h: int = 0
    ldh: int = 0
    w: int = 0
    ldw: int = 0


def check_rope(v: Variant, N: int, rope: Rope | None) -> None:
    """The rope variants' arguments: given exactly for them, N whole heads."""
    if (v.epilogue == "rope") != (rope is not None):
        raise ValueError("the rope arguments are the rope variants'")
    if rope is not None:
        if N % v.rope or v.bn % v.rope:
            raise ValueError(f"rope of heads of {v.rope} columns: N = {N} and the tile's "
                             f"{v.bn} columns must be whole heads")
        if rope.T < 1 or not 0 <= rope.rotated <= N // v.rope:
            raise ValueError(f"rope: T = {rope.T}, {rope.rotated} heads rotated of {N // v.rope}")
        if rope.cos % 8 or rope.sin % 8:
            raise ValueError("rope: the cos and sin tables must be 8-byte aligned")


def check_plan(variant: str, M: int, N: int, K: int, A: int, lda: int, B: int, ldb: int,
               C: int, ldc: int, H: int = 0, rope: Rope | None = None,
               dswiglu: Dswiglu | None = None) -> None:
    """Everything a plan of `variant` checks before it encodes a map (the
    CPU stand-in's plans check the same)."""
    v = VARIANTS[variant]
    if (v.epilogue in ("dswiglu", "dswiglu_again")) != (dswiglu is not None):
        raise ValueError("the dswiglu arguments are the dswiglu variants'")
    if v.again != bool(dswiglu and dswiglu.h):
        raise ValueError(f"{variant}: the gate/up product's operands (h, W_gu) are the again "
                         f"variants'")
    if v.again:
        if N % 8:
            raise ValueError(f"{variant}: F = {N}: a multiple of 8")
        check_addresses(dswiglu.h, dswiglu.ldh, dswiglu.w, dswiglu.ldw, dswiglu.dgu, 2 * N,
                        dswiglu.a, c_item=2)
    elif dswiglu is not None:
        if N % 8 or ldc < 2 * N:
            raise ValueError(f"{variant}: F = {N}: a multiple of 8, gu's rows (ldc = {ldc}) "
                             f"at least 2F")
        if dswiglu.dgu % 16 or dswiglu.a % 16:
            raise ValueError(f"{variant}: dgu and a must start 16-byte aligned")
    check_shape(M, N, K, v.epilogue, v.layout)
    check_rope(v, N, rope)
    check_addresses(A, lda, B, ldb, rope.out if rope else C, rope.ld if rope else ldc, H,
                    v.c_item)
    if v.split and M % v.bm:
        raise ValueError(f"{variant}: M = {M}: the split partials need whole tiles of {v.bm} "
                         f"rows")
    if v.swiglu != bool(H):
        raise ValueError(f"{variant}: H is the SwiGLU variants' output")
    if v.epilogue in ("swiglu_tma", "swiglu_a") and (N // 2) % 8:
        raise ValueError(f"{variant}: F = {N // 2}: a's rows through the copy engine need a "
                         f"multiple of 8 columns")


def tiles(M: int, N: int, v: Variant) -> int:
    """The output tiles of a product (the SwiGLU tiles cover bn/2 gate
    columns and as many up columns; in clusters of two, a pair of tiles
    one above the other counts as two, the lower one past M too)."""
    cols, width = (N // 2, v.bn // 2) if v.swiglu else (N, v.bn)
    return -(-M // (v.bm * v.cluster)) * v.cluster * -(-cols // width)


def split_k(M: int, N: int, K: int, v: Variant, multiprocessors: int) -> int:
    """The splits of K for a split variant: as many as fill the grid with
    tiles x splits items (at most one per multiprocessor), at most one a
    slab, every split whole slabs and none empty (the kernel's split i takes
    slabs [i per, (i + 1) per), per = ceil(slabs / splits)); 1 otherwise."""
    if not v.split:
        return 1
    slabs = -(-K // BK)
    want = max(1, min(slabs, multiprocessors // tiles(M, N, v)))
    per = -(-slabs // want)
    return -(-slabs // per)


def workspace_bytes(v: Variant, multiprocessors: int) -> int:
    """The float32 partials a split variant may write: splits x M x N, with
    tiles x splits at most the multiprocessors where splits > 1 and M x N
    at most the tiles' area (one split writes C itself)."""
    return multiprocessors * v.bm * v.bn * 4 if v.split else 0


def grid(M: int, N: int, v: Variant, multiprocessors: int, splits: int = 1) -> int:
    """Blocks of the persistent grid: one per multiprocessor, at most one
    per tile (per tile and split), a multiple of the cluster."""
    return min(multiprocessors, tiles(M, N, v) * splits) // v.cluster * v.cluster


# ---------------------------------------------------------------------------
# compilation (NVRTC, ctypes) and the driver's tensor maps
# ---------------------------------------------------------------------------

def module_source() -> str:
    parts = []
    for name in FILES:
        with open(os.path.join(KERNEL_DIR, name), encoding="utf-8") as f:
            parts.append(f'#line 1 "accelerated/cuda/kernels/{name}"\n{f.read()}')
    return "\n".join(parts)


def compile_options(watchdog: bool = False, trace: bool = False) -> list:
    return ["--gpu-architecture=sm_90a", "-std=c++17", "-DOPERAND_BF16",
            *(["-DGEMM_WATCHDOG"] if watchdog else []), *(["-DGEMM_TRACE"] if trace else [])]


def _load(kind: str, names: list):
    """A CUDA library by its candidates' names, after the one the CUDA
    pathfinder of CuPy 14 finds."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        names = [load_nvidia_dynamic_lib(kind).abs_path, *names]
    except Exception:
        pass
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise GemmError(f"lib{kind} not found: " + "; ".join(errors[-3:]))


def nvrtc_library():
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    try:
        import nvidia

        for base in nvidia.__path__:
            names += sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    return _load("nvrtc", names)


def compile_cubin(lib=None, source: str | None = None, options: list | None = None):
    """(cubin bytes, the compiler's log) of the module's source for sm_90a."""
    return nvrtc_compile(lib or nvrtc_library(), module_source() if source is None else source,
                         compile_options() if options is None else options, cubin=True)


def nvrtc_compile(lib, source: str, options: list, cubin: bool = True):
    """NVRTC on `source`: (the cubin's bytes, or None when cubin is False, as
    for a compute_XX target that makes PTX only; the compiler's log).
    Compile errors raise GemmError with the log (dev/cuda/nvrtc_check.py
    compiles the step's module through this too)."""
    prog = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"gemm_sm90.cu", 0,
                                    None, None)
    if status:
        raise GemmError(f"nvrtcCreateProgram: status {status}")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if status:
            raise GemmError(f"did not compile (status {status}):\n{text}")
        if not cubin:
            return None, text
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        status = lib.nvrtcGetCUBIN(prog, out)
        if status:
            raise GemmError(f"nvrtcGetCUBIN: status {status}")
        return out.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_DRIVER = None


def driver():
    global _DRIVER
    if _DRIVER is None:
        lib = _load("cuda", ["libcuda.so.1", "libcuda.so"])
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        lib.cuTensorMapEncodeTiled.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p,
            u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        _DRIVER = lib
    return _DRIVER


def encode_map(address: int, geometry: MapGeometry, dtype: int = BFLOAT16) -> bytes:
    """The 128 bytes of the tensor map of a matrix at address (dtype:
    BFLOAT16 or FLOAT32)."""
    out = (ctypes.c_uint8 * MAP_BYTES)()
    dims = (ctypes.c_uint64 * 2)(*geometry.dims)
    strides = (ctypes.c_uint64 * 1)(*geometry.strides)
    box = (ctypes.c_uint32 * 2)(*geometry.box)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    status = driver().cuTensorMapEncodeTiled(
        ctypes.addressof(out), dtype, 2, ctypes.c_void_p(address), dims, strides, box, unit,
        INTERLEAVE_NONE, SWIZZLE_128B, L2_256B, OOB_ZERO)
    if status:
        raise GemmError(f"cuTensorMapEncodeTiled: CUresult {status} for {geometry}")
    return bytes(out)


# ---------------------------------------------------------------------------
# the kernels
# ---------------------------------------------------------------------------

@dataclass
class Planned:
    """One product bound to its buffers: the kernel, its launch and its
    arguments (the tensor maps live in `maps`, which the plan keeps)."""

    function: object
    grid: int
    shared: int
    args: tuple
    maps: object  # the device buffer of the tensor maps (A, B, then the staged epilogue's)
    reduce: tuple | None = None  # split variants: (function, grid, args) of the partials' sum

    def launch(self, stream=None) -> None:
        self.function((self.grid,), (THREADS,), self.args, shared_mem=self.shared,
                      stream=stream)
        if self.reduce is not None:
            function, blocks, args = self.reduce
            function((blocks,), (REDUCE_THREADS,), args, stream=stream)


class Kernels:
    """The module, compiled and loaded once (needs a Hopper GPU)."""

    def __init__(self, watchdog: bool = False, trace: bool = False):
        cubin, self.log = compile_cubin(options=compile_options(watchdog, trace))
        self.module = cupy.cuda.function.Module()
        self.module.load(cubin)
        self.functions = {}
        for name, v in VARIANTS.items():
            f = self.module.get_function(name)
            cupy.cuda.driver.funcSetAttribute(f.ptr, MAX_DYNAMIC_SHARED, shared_bytes(v))
            self.functions[name] = f
        self.multiprocessors = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self.functions["gemm_splitk_reduce"] = self.module.get_function("gemm_splitk_reduce")
        # every kernel of the module waits for the one before it (common.cuh)
        self.functions = dependent_launch.wrap(self.functions, cupy)
        self.reduce = self.functions.pop("gemm_splitk_reduce")
        self._workspace = None  # the split variants' partials, one buffer for every plan

    def workspace(self):
        """The split variants' float32 partials: one buffer, as large as any
        of them may need (workspace_bytes), shared by their plans (the step
        runs its products one after another on one stream)."""
        if self._workspace is None:
            size = max(workspace_bytes(v, self.multiprocessors) for v in VARIANTS.values())
            self._workspace = cupy.empty(size // 4, np.float32)
        return self._workspace

    def plan(self, variant: str, A, B, C, H=None) -> Planned:
        """C (M,N) float32 = A (M,K) @ B (N,K)^T, A and B bfloat16 (any
        2-D CuPy arrays of 2-byte items with unit column stride); the
        SwiGLU variants also write H (M, N/2) bfloat16 bits."""
        if VARIANTS[variant].layout != "kk" or VARIANTS[variant].c_item != 4:
            raise ValueError(f"{variant}: plan takes the forward's layout with a float32 "
                             f"result; plan_pointers the others")
        (M, K), (N, K2) = A.shape, B.shape
        if K2 != K or C.shape != (M, N) or C.dtype != np.float32:
            raise ValueError(f"product shapes: A {A.shape}, B {B.shape}, C {C.shape} {C.dtype}")
        for x in (A, B):
            if x.itemsize != 2 or x.strides[1] != 2:
                raise ValueError("operands: bfloat16 rows with unit column stride")
        if C.strides[1] != 4:
            raise ValueError("C: float32 rows with unit column stride")
        return self.plan_pointers(variant, M, N, K, A.data.ptr, A.strides[0] // 2, B.data.ptr,
                                  B.strides[0] // 2, C.data.ptr, C.strides[0] // 4,
                                  H.data.ptr if H is not None else 0)

    def plan_pointers(self, variant: str, M: int, N: int, K: int, A: int, lda: int, B: int,
                      ldb: int, C: int, ldc: int, H: int = 0, rope: Rope | None = None,
                      dswiglu: Dswiglu | None = None) -> Planned:
        """plan's product by addresses and row strides (elements): A (M,K)
        and B (N,K) bfloat16 (layout kn: B (K,N); mn: A (K,M) and B (K,N)),
        C (M,N) float32 (bf16_tma: bfloat16), H (M, N/2) bfloat16 (the
        SwiGLU variants' a; else 0; swiglu_a writes H alone, C may be 0);
        the rope variants write rope.out instead of C (C may be 0); the
        dswiglu variants (N = F) read gu (M, 2F) float32 at C, row stride
        ldc, and write dswiglu.dgu and dswiglu.a; dswiglu_again reads
        dswiglu.h and dswiglu.w instead of gu (C 0)."""
        v = VARIANTS[variant]
        check_plan(variant, M, N, K, A, lda, B, ldb, C, ldc, H, rope, dswiglu)
        F = N // 2
        # a transposed operand: its (K, M) or (K, N) rows in boxes of 64 columns by 64 K-rows
        splits, target, ld_target = split_k(M, N, K, v, self.multiprocessors), C, ldc
        if splits > 1:  # the partials into the workspace, (splits M, N) packed; one split: C
            C, ldc = self.workspace().data.ptr, N
        a_map = encode_map(A, map_geometry(K, M, lda, BK) if v.layout == "mn"
                           else map_geometry(M, K, lda, v.bm))
        b_map = encode_map(B, map_geometry(K, N, ldb, BK) if v.layout != "kk"
                           else map_geometry(N, K, ldb, v.box_b))
        if v.again:  # dres, h, W_gu, then W_down
            d = dswiglu
            encoded = (a_map + encode_map(d.h, map_geometry(M, K, d.ldh, v.bm))
                       + encode_map(d.w, map_geometry(2 * N, K, d.ldw, v.bn)) + b_map)
        else:
            encoded = a_map + b_map
        if v.epilogue == "f32_tma":
            encoded += encode_map(C, map_geometry(splits * M, N, ldc, v.staging_rows, item=4),
                                  FLOAT32)
        if v.epilogue == "bf16_tma":
            encoded += encode_map(C, map_geometry(M, N, ldc, v.staging_rows))
        if v.epilogue in ("dswiglu", "dswiglu_again"):  # dgu's gate and up halves, and a
            for half in (dswiglu.dgu, dswiglu.dgu + 2 * N):
                encoded += encode_map(half, map_geometry(M, N, 2 * N, v.staging_rows))
            encoded += encode_map(dswiglu.a, map_geometry(M, N, N, v.staging_rows))
        if v.epilogue == "swiglu_tma":  # gu's gate and up halves
            for half in (C, C + 4 * F):
                encoded += encode_map(half, map_geometry(M, F, ldc, v.staging_rows, item=4),
                                      FLOAT32)
        if v.epilogue in ("swiglu_tma", "swiglu_a"):  # a
            encoded += encode_map(H, map_geometry(M, F, F, v.staging_rows))
        if v.epilogue == "rope":
            encoded += encode_map(rope.out, map_geometry(M, N, rope.ld, v.staging_rows))
        maps = cupy.asarray(np.frombuffer(encoded, dtype=np.uint8))
        assert maps.data.ptr % 64 == 0
        r = rope or Rope(0, 0, 0, 0, 1, 0)
        args = (maps, np.int32(M), np.int32(N), np.int32(K), np.uint64(C),
                np.int32(rope.ld if rope else ldc), np.uint64(H), np.uint64(r.cos),
                np.uint64(r.sin), np.int32(r.T), np.int32(splits if v.split else r.rotated))
        reduce = None
        if splits > 1:
            blocks = min(4 * self.multiprocessors, -(-M * N // (4 * REDUCE_THREADS)))
            reduce = (self.reduce, blocks, (np.uint64(C), np.uint64(target), np.int32(M),
                                            np.int32(N), np.int32(ld_target), np.int32(splits)))
        return Planned(self.functions[variant], grid(M, N, v, self.multiprocessors, splits),
                       shared_bytes(v), args, maps, reduce)
