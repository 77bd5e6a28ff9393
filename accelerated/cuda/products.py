"""The step's matrix products: cuBLAS's (cublas.py), or, where chosen, the
project's own Hopper kernel (gemm.py, kernels/gemm_sm90.cu) for the
forward's x @ W^T products, with the gate/up product's SwiGLU and the
q | k | v product's rope in their epilogues, and for the backward's
input gradients dY W, with the SwiGLU's backward in the down product's;
where gate_up_again holds, that kernel computes the gate and up products
again (the forward's bits) and the forward keeps h instead of them.

The own kernel serves the bf16 policy on Hopper (compute capability 9.0,
which its wgmma and tensor-map code needs) where the rule below picks it,
measured faster there (dev/cuda/NOTES.md, "A product kernel of the
project's own"); COPPELIUS_PRODUCTS=cublas keeps every product on cuBLAS,
=own asks for the rule on any device (the CPU stand-ins' tests), =auto (or
unset) is the default. The choice is a fixed rule of
the product's shape, types and alignment, not a timing taken at capture:
two processes of one run must make the same choice, or a resumed run's
bits would differ from an uninterrupted one's (SPEC 9). The memory plan's
dry run asks the same rule, so its commands are the step's.

A product of the own kernel is planned (its tensor maps encoded and
uploaded) the first time it is issued with its buffers: in the step's
eager warm-up, before the capture, which then only launches it."""

from __future__ import annotations

import os

from ...reference.errors import ConfigError
from . import gemm

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

ENV = "COPPELIUS_PRODUCTS"  # "auto" (Hopper: the own kernel where the rule picks it), "own", "cublas"
MIN_ROWS = 4096  # below, cuBLAS (H200, B = 1 at T = 1024: the grid has too few tiles)
MAX_COLUMNS = 4096  # above (the classifier's 12288), cuBLAS: measured 1.02-1.06x cuBLAS
# above, cuBLAS: the shapes measured are K = 512 to 1408 (the coppelius preset, the ~110M
# shape's q | k | v, o and gate/up); at d_model 2048 (the ~890M shape) the own o, gate/up
# and down products made the step 1.1x slower
MAX_K = 1408
# H200, B = 8 (dev/cuda/NOTES.md): fused gate/up + SwiGLU 66.7 us against cuBLAS + swiglu
# 79.1 (through the copy engine; F a multiple of 8, else the register stores' variant);
# fused q | k | v + rope 22.7 us against 50.2 (and at B = 1 6.4 against 9.1: every M)
# the backward's dX = dY W (B given as (K, N)), by the result's type, up to K = MAX_K_INPUT
# (H200, B = 8, coppelius preset: o 9.5 against cuBLAS 11.0 us, down 26.6 against 29.6, o
# with a bfloat16 result 8.5 against 9.2; at K = 1536 and 2816 (q | k | v, gate/up) level
# or slower: cuBLAS's)
BACKWARD_INPUT = {"float32": "gemm_f32t_kn_p_m2n128_s4", "bfloat16": "gemm_bf16t_kn_p_m2n128_s4"}
MAX_K_INPUT = 1024
# the down product's dX with the SwiGLU's backward in its epilogue (no float32 da)
DSWIGLU = "gemm_dswiglu_kn_p_m1n128_s6"
# the same with the gate/up product computed again in its tile (no float32 gu kept from
# the forward, whose gate/up kernel then stores a alone): at the input gradients' shapes
# with the fused forward's F (a multiple of 8). H200, coppelius preset (us, forward +
# backward per layer): B = 8 swiglua 54.1 + again m1n128 77.1 against swiglut 64.7 +
# dswiglu 71.4; B = 32 198.0 + again m2n64 302.0 against 239.8 + 265.0; and 92 MB (B = 8)
# of float32 gu a layer not kept, 8 MB of h kept instead
DSWIGLU_AGAIN = {True: "gemm_dswiglu_again_p_m1n128_s3",  # m <= AGAIN_WIDE_ROWS
                 False: "gemm_dswiglu_again_p_m2n64_s3"}
AGAIN_WIDE_ROWS = 8192
# d_model at most: measured level or faster at 512 (the coppelius preset); side by side
# (dev/cuda/side_by_side.py again, H200) the again path took 1.032x, 1.064x, 1.049x and 1.023x
# the kept path's step at gpt-110m, gpt-340m, gpt-e128 and gpt-t4096 (d_model 768-1024)
AGAIN_MAX_K = 512
# the fused epilogues' own bounds, K and N at most (each fusion saves a float32 round trip
# that a plain product does not, so its break-even shape is its own); today the plain
# products': at d_model 2048 (gpt-890m, B = 4, H200) each fusion taken past them made the
# step slower (rope 1.017x, SwiGLU 1.029x, its backward 1.028x; side_by_side.py wide)
ROPE_MAX_K, ROPE_MAX_COLUMNS = MAX_K, MAX_COLUMNS
SWIGLU_MAX_K = MAX_K
DSWIGLU_MAX_K, DSWIGLU_MAX_COLUMNS = MAX_K_INPUT, MAX_COLUMNS
SWIGLU_A = "gemm_swiglua_p_m2n128_s4"
SWIGLU, SWIGLU_ANY_F = "gemm_swiglut_p_m2n128_s4", "gemm_swiglu_c_n128_s6"
ROPE = {64: "gemm_rope64_p_m1n256_s4", 128: "gemm_rope128_p_m1n256_s4"}  # by head width
ROPE_FEW_ROWS = {64: "gemm_rope64_c_n128_s6", 128: "gemm_rope128_p_m1n128_s6"}  # M < MIN_ROWS


def own_products(precision: str) -> bool:
    """Whether the step's products may take the own kernel: bf16, and
    COPPELIUS_PRODUCTS=own, or auto (the default) on a Hopper GPU."""
    choice = os.environ.get(ENV, "") or "auto"
    if choice not in ("auto", "own", "cublas"):
        raise ConfigError(f"{ENV}={choice!r}: auto, own or cublas")
    if precision != "bf16" or choice == "cublas":
        return False
    return choice == "own" or _hopper()


def _hopper() -> bool:
    try:
        return cupy.cuda.Device().compute_capability == "90"
    except Exception:  # no device, or the CPU stand-ins (which have no capability)
        return False


def _aligned(*pointers_and_strides, c_item: int = 4) -> bool:
    try:
        gemm.check_addresses(*pointers_and_strides, c_item=c_item)
    except ValueError:
        return False
    return True


def choose(trans_a: bool, trans_b: bool, m: int, n: int, k: int, A: int, lda: int, B: int,
           ldb: int, C: int, ldc: int, ab_type: str, c_type: str, beta: float,
           batch: int) -> str | None:
    """The own kernel's variant for this product, or None for cuBLAS's:
    bfloat16 operands, nothing added, one product, and a layout and shape
    the H200's measurements favour (NOTES): the forward's x @ W^T (A (m,k),
    B (n,k)) with a float32 result, and the backward's dX = dY W (B given
    as (k,n)) with a float32 or bfloat16 result. The weight gradients
    dY^T X stay cuBLAS's: their (out, in) tiles are too few for the
    persistent grid, and the variant that splits K is not yet measured."""
    if ab_type != "bfloat16" or beta != 0.0 or batch != 1 or trans_a \
            or m < MIN_ROWS or n > MAX_COLUMNS or n % 8 or k % 8:
        return None
    if trans_b:  # the forward's
        if c_type != "float32" or k > MAX_K or not _aligned(A, lda, B, ldb, C, ldc):
            return None
        return "gemm_f32t_c_n256_s4" if k > 1024 else "gemm_f32t_p_m2n128_s4"
    variant = BACKWARD_INPUT.get(c_type)  # dX = dY W
    if variant is None or not _input_gradient(m, n, k) or not _aligned(
            A, lda, B, ldb, C, ldc, c_item=gemm.VARIANTS[variant].c_item):
        return None
    return variant


def _input_gradient(m: int, n: int, k: int) -> bool:
    """The input gradients' (dY W) shapes measured faster on the own kernel."""
    return m >= MIN_ROWS and n <= MAX_COLUMNS and k <= MAX_K_INPUT and n % 8 == 0 \
        and k % 8 == 0


def choose_swiglu(m: int, F: int, k: int, A: int, lda: int, W: int, ldw: int, gu: int,
                  a: int) -> str | None:
    """The fused gate/up + SwiGLU variant, or None (then the product and
    the swiglu kernel); gu 0: the variant that stores a alone (the
    backward computing g and u again: gate_up_again)."""
    if m < MIN_ROWS or k > SWIGLU_MAX_K or (2 * F) % 8 or k % 8 \
            or not _aligned(A, lda, W, ldw, gu, 2 * F, a):
        return None
    if not gu:
        return SWIGLU_A if gate_up_again(m, F, k) else None
    return SWIGLU if F % 8 == 0 else SWIGLU_ANY_F


def gate_up_again(m: int, F: int, k: int) -> bool:
    """Whether the SwiGLU's backward computes the gate and up products again
    in its own tile (DSWIGLU_AGAIN) for a product of m rows, d_ff F and
    d_model k, so that the forward keeps the gate/up product's operand h
    and not its float32 result: the input gradients' shapes and the fused
    forward's (F a multiple of 8), d_model up to AGAIN_MAX_K (measured)."""
    return _input_gradient(m, F, k) and k <= AGAIN_MAX_K and F % 8 == 0


def choose_dswiglu(m: int, F: int, k: int, A: int, lda: int, W: int, ldw: int, gu: int,
                   dgu: int, a: int) -> str | None:
    """The fused down dX + SwiGLU backward variant, or None (then the
    product into float32 da and the swiglu_backward kernel): dX's shapes,
    and what its plan takes (F a multiple of 8: its outputs' rows through
    the copy engine; every matrix 16-byte aligned)."""
    if m < MIN_ROWS or F > DSWIGLU_MAX_COLUMNS or k > DSWIGLU_MAX_K or F % 8 or k % 8:
        return None
    try:
        gemm.check_plan(DSWIGLU, m, F, k, A, lda, W, ldw, gu, 2 * F,
                        dswiglu=gemm.Dswiglu(dgu, a))
    except ValueError:
        return None
    return DSWIGLU


def choose_dswiglu_again(m: int, F: int, k: int, A: int, lda: int, W: int, ldw: int,
                         d: gemm.Dswiglu) -> str | None:
    """DSWIGLU_AGAIN's variant for m rows where gate_up_again holds and its
    plan takes the buffers (every matrix 16-byte aligned, rows of whole 16
    bytes), or None."""
    if not gate_up_again(m, F, k):
        return None
    variant = DSWIGLU_AGAIN[m <= AGAIN_WIDE_ROWS]
    try:
        gemm.check_plan(variant, m, F, k, A, lda, W, ldw, 0, 0, dswiglu=d)
    except ValueError:
        return None
    return variant


def choose_rope(m: int, n: int, k: int, A: int, lda: int, W: int, ldw: int, out: int,
                ldo: int, E: int, R: int) -> str | None:
    """The fused q | k | v + rope variant, or None (then the product into
    float32 and the rope kernel): heads rotated whole (R = E) of a width
    the kernel is built for, at any M (faster than cuBLAS + rope at B = 1
    too)."""
    if R != E or E not in ROPE or n > ROPE_MAX_COLUMNS or k > ROPE_MAX_K or n % E or k % 8 \
            or not _aligned(A, lda, W, ldw, out, ldo):
        return None
    return (ROPE if m >= MIN_ROWS else ROPE_FEW_ROWS)[E]


class Products:
    """cuBLAS's handle (cublas.Cublas) with the own kernel beside it. own:
    whether the rule applies (own_products); kernels: the compiled
    gemm.Kernels, or None in the memory plan's dry run (then the own
    products are only recorded, as cuBLAS's are). Every product goes
    through `gemm` (cuBLAS's arguments), `gemm_swiglu`, `gemm_rope` or
    `gemm_dswiglu`; `log`, `calls`, `version` and `close` are the handle's."""

    def __init__(self, blas, own: bool = False, kernels=None):
        self.blas, self.own, self.kernels = blas, own, kernels
        self.plans = {}  # the own products planned, by kernel, shape and addresses
        self.own_calls = 0

    @property
    def log(self):
        return self.blas.log

    @log.setter
    def log(self, value):
        self.blas.log = value

    @property
    def calls(self) -> int:
        return self.blas.calls + self.own_calls

    @property
    def version(self) -> int:
        return self.blas.version

    def close(self) -> None:
        self.blas.close()

    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, A: int, lda: int,
             B: int, ldb: int, C: int, ldc: int, *, ab_type: str, c_type: str,
             beta: float = 0.0, batch: int = 1, stride_a: int = 0, stride_b: int = 0,
             stride_c: int = 0) -> None:
        """cublas.Cublas.gemm's product, by the own kernel where chosen."""
        variant = choose(trans_a, trans_b, m, n, k, A, lda, B, ldb, C, ldc, ab_type, c_type,
                         beta, batch) if self.own else None
        if variant is None:
            self.blas.gemm(trans_a, trans_b, m, n, k, A, lda, B, ldb, C, ldc, ab_type=ab_type,
                           c_type=c_type, beta=beta, batch=batch, stride_a=stride_a,
                           stride_b=stride_b, stride_c=stride_c)
            return
        self._own(variant, m, n, k, A, lda, B, ldb, C, ldc)

    def gemm_swiglu(self, m: int, F: int, k: int, A: int, lda: int, W: int, ldw: int, gu: int,
                    a: int) -> bool:
        """gu (m, 2F) float32 = A (m,k) @ W (2F,k)^T and a (m,F) = silu(g) * u
        as bfloat16, as the product and kernels/swiglu.cu's swiglu_forward
        compute them, in one kernel where chosen: True if done, False if
        the caller is to run the two. gu 0 (where gate_up_again holds): a
        alone."""
        variant = choose_swiglu(m, F, k, A, lda, W, ldw, gu, a) if self.own else None
        if variant is None:
            return False
        self._own(variant, m, 2 * F, k, A, lda, W, ldw, gu, 2 * F, a)
        return True

    def gemm_dswiglu(self, m: int, F: int, k: int, A: int, lda: int, W: int, ldw: int,
                     gu: int, dgu: int, a: int) -> bool:
        """da = A (m,k) @ W (k,F) (the down product's input gradient, W given
        as (k, F)) and from it, as kernels/swiglu.cu's swiglu_backward
        computes them, dgu (m, 2F) operands and a (m, F) = silu(g) u again,
        gu (m, 2F) float32 read, in one kernel where chosen (no float32 da):
        True if done, False if the caller is to run the two."""
        variant = choose_dswiglu(m, F, k, A, lda, W, ldw, gu, dgu, a) if self.own else None
        if variant is None:
            return False
        self._own(variant, m, F, k, A, lda, W, ldw, gu, 2 * F,
                  dswiglu=gemm.Dswiglu(dgu, a))
        return True

    def gate_up_again(self, m: int, F: int, k: int, W_gu: int, W_down: int) -> bool:
        """gate_up_again where the rule applies (own) and the layer's weights
        W_gu (2F, k) and W_down (k, F) start 16-byte aligned (the buffers
        the step allocates always do): the forward then calls gemm_swiglu
        with gu 0 and the backward gemm_dswiglu_again."""
        return self.own and gate_up_again(m, F, k) and W_gu % 16 == 0 and W_down % 16 == 0

    def gemm_dswiglu_again(self, m: int, F: int, k: int, A: int, lda: int, W: int, ldw: int,
                           h: int, ldh: int, W_gu: int, ldw_gu: int, dgu: int, a: int) -> bool:
        """gemm_dswiglu's outputs with g | u = h (m,k) @ W_gu (2F,k)^T
        computed again in the same kernel, bit for bit the forward's
        (gemm_swiglu's), instead of read: True if done."""
        d = gemm.Dswiglu(dgu, a, h, ldh, W_gu, ldw_gu)
        variant = choose_dswiglu_again(m, F, k, A, lda, W, ldw, d) if self.own else None
        if variant is None:
            return False
        self._own(variant, m, F, k, A, lda, W, ldw, 0, 0, dswiglu=d)
        return True

    def gemm_rope(self, m: int, n: int, k: int, A: int, lda: int, W: int, ldw: int, out: int,
                  ldo: int, cos: int, sin: int, T: int, rotated: int, E: int, R: int) -> bool:
        """out (m,n) operands = the rope (kernels/rope.cu's rope_forward, cos,
        sin (T, R/2)) of the float32 product A (m,k) @ W (n,k)^T, its first
        `rotated` heads of E rotated, in one kernel where chosen: True if
        done, False if the caller is to run the product and the rope."""
        variant = choose_rope(m, n, k, A, lda, W, ldw, out, ldo, E, R) if self.own else None
        if variant is None:
            return False
        self._own(variant, m, n, k, A, lda, W, ldw, 0, ldo,
                  rope=gemm.Rope(out, ldo, cos, sin, T, rotated))
        return True

    def _own(self, variant: str, m: int, n: int, k: int, A: int, lda: int, B: int, ldb: int,
             C: int, ldc: int, H: int = 0, rope: gemm.Rope | None = None,
             dswiglu: gemm.Dswiglu | None = None) -> None:
        if self.log is not None:
            touched = (A, B, C, H) + ((rope.out, rope.cos, rope.sin) if rope else ()) \
                + ((dswiglu.dgu, dswiglu.a, dswiglu.h, dswiglu.w) if dswiglu else ())
            self.log.add("product", variant, {"m": m, "n": n, "k": k}, touched)
        self.own_calls += 1
        if self.kernels is None:  # dry: recorded only
            return
        key = (variant, m, n, k, A, lda, B, ldb, C, ldc, H, rope, dswiglu)
        plan = self.plans.get(key)
        stream = cupy.cuda.get_current_stream()
        if plan is None:
            if stream.is_capturing():
                raise RuntimeError(f"{variant} {m}x{n}x{k} first issued inside the capture: "
                                   f"the warm-up step plans every product before it")
            plan = self.plans[key] = self.kernels.plan_pointers(variant, m, n, k, A, lda, B,
                                                                ldb, C, ldc, H, rope, dswiglu)
        plan.launch(stream)
