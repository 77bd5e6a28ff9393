"""CUDA kernels of the CuPy backend and their launchers (llm.c style: the
kernel source, accelerated/kernels/*.cu, one file per layer family, then
one launcher per kernel; names follow the reference's layer functions).

Shapes use the project's letters: B batch, T context, D d_model, H heads,
E = D/H head dim, F d_ff, V vocab, BT = B*T rows. Activations are row-major
float32. `floatX` is the type of a matrix-product operand under the
precision policy (SPEC section 6): float for fp32, the bits of a bfloat16
(unsigned short, rounded to nearest even) for bf16. A kernel that produces
a tensor whose only use is as a matrix-product operand writes it as floatX
directly, so the bf16 policy costs no separate rounding pass. The files
are concatenated into one module (module_source), compiled once per policy
(`-DOPERAND_BF16` selects bf16); no system header is included, so NVRTC
compiles it as is.

Determinism: no kernel uses floating-point atomics. Every reduction runs
in a fixed order (warp shuffles in a fixed tree, then shared memory in warp
order), so a replay gives the same bits every time and resume is exact
(SPEC 9). Layernorm's weight gradients reduce in two passes (per-block
partials, then the blocks in order); the embedding gradient of an id is
summed by one block over the positions holding it, in position order, as
the reference's np.add.at does (integer atomics find each id's first
position and count: a minimum and a sum, the same in any order).

Bandwidth. The memory-bound kernels move 16 bytes per load and store (a
float4, or 4 bfloat16 operands in 8 bytes) where every pointer is 16-byte
aligned and the row length is a multiple of 4: the launcher decides (`vec`,
_vector) and passes the decision, with the matching number of items; else
the same kernel takes one element at a time, the same values in the same
order.

Elementwise formulas that the reference writes as separate float32
operations use the _rn intrinsics (no fused multiply-add) where that makes
the kernel reproduce the reference's rounding exactly: AdamW, rope, the
layernorm normalization. Division and sqrtf are IEEE (no fast math).
"""

from __future__ import annotations

import math
import os

import numpy as np

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

# ---------------------------------------------------------------------------
# kernel source
# ---------------------------------------------------------------------------

# The kernels are package data, one file per layer family, concatenated in
# this order into one module: common.cuh first (the operand type floatX and
# the warp and block reductions the others use), then the families in the
# order of the step.
KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
FILES = ("common.cuh", "precision.cu", "embedding.cu", "layernorm.cu", "rope.cu", "attention.cu",
         "attention_fused.cu", "swiglu.cu", "crossentropy.cu", "adamw.cu")


def module_source(replace: dict | None = None) -> str:
    """The module's CUDA source: the files of FILES in order, each after a
    `#line 1 "accelerated/kernels/<file>"` directive, so that NVRTC's errors
    and a profiler's source view name the file and its line. The files are
    concatenated, not #included: CuPy's compile cache is keyed on the source
    string (and the options), so an included file's edit would not be
    recompiled.

    replace: {name in FILES: path}, whole files swapped for this source
    (dev/cuda's kernel variants replace attention_fused.cu); the #line
    directive then names the path as given."""
    replace = dict(replace or {})
    unknown = sorted(set(replace) - set(FILES))
    if unknown:
        raise ValueError(f"replace: {', '.join(unknown)} not a kernel file (one of "
                         f"{', '.join(FILES)})")
    parts = []
    for name in FILES:
        path = replace.get(name, os.path.join(KERNEL_DIR, name))
        # forward slashes: a backslash in the directive's string would be an escape
        label = replace.get(name, f"accelerated/kernels/{name}").replace("\\", "/")
        with open(path, encoding="utf-8") as f:
            parts.append(f'#line 1 "{label}"\n{f.read()}')
    return "\n".join(parts)


LAYERNORM_VARIANTS = (1, 2, 4, 8)  # float4 chunks per lane of the layernorm kernels (_c<NC>)
KERNELS = ("round_bf16", "embedding_forward", "embedding_index_reset", "embedding_index",
           "embedding_backward",
           *(f"layernorm_{part}_c{nc}" for nc in LAYERNORM_VARIANTS
             for part in ("forward", "backward")),
           "layernorm_param_grads", "rope_forward", "rope_backward",
           "attention_softmax_forward", "attention_softmax_backward",
           *(f"attention_{part}_e{E}" for E in (16, 32, 64)
             for part in ("forward", "backward_dq", "backward_dkdv")),
           "rope_backward_operand", "swiglu_forward",
           "swiglu_backward", "crossentropy_forward_backward", "mean_loss",
           "adamw_bias_corrections", "adamw_bias_corrections_table", "gradient_sum_squares",
           "gradient_norm_clip", "adamw_update", "accumulate_gradient")

ATTENTION_HEAD_DIMS = (16, 32, 64)  # head dims with fused attention kernels (attention_fused.cu)
# From this batch on the step's attention is fused. The fused kernels' grid
# is B*H*T/64 blocks of 4 warps and the longest block walks every key tile,
# so with few blocks the chip idles. Per layer, coppelius on an H200, fused
# vs materialized ms (dev/cuda/NOTES.md): B=1 0.111 vs 0.102, B=2 0.149 vs
# 0.206, B=4 0.235 vs 0.397, B=8 0.394 vs 0.769.
ATTENTION_FUSED_MIN_BATCH = 4
NORM_BLOCKS = 1056  # blocks of the norm's first pass: 8 per SM of an H200, a fixed order
ATTENTION_TILE = 64  # ATT_TILE: query rows per block of the fused kernels, keys per tile
EMBEDDING_THREADS = 256  # EMB_THREADS: positions per pass of embedding_backward (embedding.cu)
LN_CHUNKS = 8  # the most float4 chunks per lane of the layernorm kernels (layernorm.cu)
MAX_D = 32 * 4 * LN_CHUNKS  # the widest row the layernorm kernels hold in registers
LAYERNORM_WARPS = 8  # LN_WARPS: warps (rows at once) per block of the layernorm kernels
LAYERNORM_GROUPS = 8  # LN_GROUPS: threads summing one column of the partials
CE_THREADS = 512  # threads per row of crossentropy_forward_backward
THREADS = 256  # elementwise kernels
WARPS = 8  # warp-per-row kernels: rows per block

NULL = np.uint64(0)  # a null pointer argument
i32, i64, f32, f64 = np.int32, np.int64, np.float32, np.float64


def compile_options(precision: str) -> tuple:
    return ("-DOPERAND_BF16",) if precision == "bf16" else ()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _threads_over(n: int, cap: int = 256) -> int:
    """A block of threads over n columns: a multiple of 32, at most cap."""
    return min(cap, 32 * _cdiv(n, 32))


def _opt(a):
    """An optional pointer argument: the array, or null."""
    return NULL if a is None else a


def _vector(*arrays, lengths=()) -> int:
    """1 when the kernels may move 16 bytes at a time: every array (None:
    absent) 16-byte aligned and every row length a multiple of 4."""
    aligned = all(a is None or a.data.ptr % 16 == 0 for a in arrays)
    return int(aligned and all(n % 4 == 0 for n in lengths))


def layernorm_variant(D: int) -> int:
    """NC of the layernorm kernels for rows of D features: the fewest float4
    chunks per lane (of LAYERNORM_VARIANTS) that hold a row."""
    assert D <= MAX_D, D
    return next(nc for nc in LAYERNORM_VARIANTS if D <= 128 * nc)


def layernorm_chunk(rows: int) -> int:
    """Rows per block of layernorm_backward: the partition of its weight
    gradients' partial sums (one per block, added in order). About 256
    blocks or more to fill the GPU, each warp taking 1 to 8 rows."""
    return min(8 * LAYERNORM_WARPS, max(LAYERNORM_WARPS, LAYERNORM_WARPS * _cdiv(rows, 8 * 256)))


def layernorm_chunks(rows: int) -> int:
    """Blocks of layernorm_backward over `rows` rows: the partials' rows."""
    return _cdiv(rows, layernorm_chunk(rows))


def adamw_blocks(n: int) -> int:
    """At most the blocks of adamw_update over n parameters (one element
    per item where the vectors are not 16-byte aligned): the room for the
    partial sums it writes without clipping."""
    return max(1, _cdiv(n, THREADS))


# ---------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------

class Kernels:
    """The module compiled for one precision policy, and one launcher per
    kernel. Arguments are contiguous CuPy arrays (RawKernel checks neither
    strides nor dtypes: the launchers pass explicit numpy scalars). Every
    launch goes to the current CuPy stream, so a launcher called inside a
    stream capture is recorded into the graph. replace swaps whole kernel
    files, as module_source's (for dev/cuda's variants; the backend passes
    none). dry=True compiles nothing and launches nothing: with a `log`
    set, the launchers only record their launches (the memory plan's dry
    run, accelerated/memory_plan.py)."""

    def __init__(self, precision: str, replace: dict | None = None, dry: bool = False):
        self.precision = precision
        if dry:
            self.functions = {name: (lambda *args, **kwargs: None) for name in KERNELS}
        else:
            module = cupy.RawModule(code=module_source(replace),
                                    options=compile_options(precision))
            self.functions = {name: module.get_function(name) for name in KERNELS}
        self.launches = 0  # kernel launches so far (the capture counts its own)
        self.log = None  # a memory_plan.CommandLog recording every launch, or None

    def _launch(self, name, grid, block, args, shared_mem=0, reads=()):
        # grid: blocks, or a tuple of blocks per dimension; reads: buffers the
        # kernel reaches through an address table among args (for the log)
        self.launches += 1
        grid = tuple(int(g) for g in grid) if isinstance(grid, tuple) else (int(grid),)
        if self.log is not None:
            pointers = [a.data.ptr for a in (*args, *reads)
                        if hasattr(getattr(a, "data", None), "ptr")]
            self.log.add("kernel", name, {"grid": list(grid), "block": int(block),
                                          "shared_mem": int(shared_mem)}, pointers)
        self.functions[name](grid, (int(block),), args, shared_mem=int(shared_mem))

    def _rowwise(self, name, rows, items, args):
        # 2-D grid: x over a row's items, y over the rows (the kernel strides
        # by gridDim.y); the fewest blocks of at most THREADS per row, evened
        # out (352 items: 2 x 192 threads, not 2 x 256)
        blocks = _cdiv(items, THREADS)
        threads = _threads_over(_cdiv(items, blocks), THREADS)
        self._launch(name, (blocks, min(rows, 65535)), threads, args)

    def _elementwise(self, name, n, args):
        assert n < 2**31, (name, n)  # int indices
        self._launch(name, _cdiv(n, THREADS), THREADS, args)

    def _flat(self, name, n, args, *arrays):
        # the flat kernels' items: n4 = n // 4 chunks (vec), then the n % 4
        # elements left one by one; n4 = 0: n elements one by one
        n4 = n // 4 if _vector(*arrays) else 0
        self._launch(name, max(1, _cdiv(n4 + n - 4 * n4, THREADS)), THREADS,
                     (*args, i64(n), i64(n4)))

    # -- precision
    def round_bf16(self, x, out):
        # x (n) float32 -> out (n) bfloat16 bits (uint16)
        self._flat("round_bf16", x.size, (x, out), x, out)

    # -- embedding
    def embedding_forward(self, ids, ids_stride, T, W, x):
        # ids (B, ids_stride), W (V,D) -> x (BT,D)
        BT, D = x.shape
        vec = _vector(W, x, lengths=(D,))
        self._elementwise("embedding_forward", BT * D // 4 if vec else BT * D,
                          (ids, i32(ids_stride), i32(T), W, x, i32(BT), i32(D), i32(vec)))

    def embedding_backward(self, dx, ids, ids_stride, T, dW, index):
        # dx (BT,D), dW (V,D) holding the unembedding gradient: dW += gather
        # gradient; index (V,2) int32 scratch: each id's first position and count
        BT, D = dx.shape
        V = dW.shape[0]
        assert index.shape == (V, 2) and index.dtype == np.int32, (index.shape, index.dtype)
        vec = _vector(dx, dW, lengths=(D,))
        assert D <= 4 * EMBEDDING_THREADS, D  # a thread holds 4 features
        # 128 threads where they hold a row's chunks: most blocks leave at
        # once, and small blocks retire fast
        threads = 128 if vec and D <= 4 * 128 else EMBEDDING_THREADS
        self._elementwise("embedding_index_reset", V, (index, i32(V)))
        self._elementwise("embedding_index", BT, (ids, i32(ids_stride), i32(T), i32(BT), index))
        self._launch("embedding_backward", BT, threads,
                     (dx, ids, i32(ids_stride), i32(T), i32(BT), dW, i32(D), index, i32(vec)))

    # -- layernorm
    def layernorm_forward(self, x_prev, add, x_out, h, mean, rstd, w, b, eps):
        # x_prev (+ add -> x_out) (rows,D) -> h (rows,D) operand, mean, rstd (rows)
        rows, D = x_prev.shape
        vec = _vector(x_prev, add, x_out, h, w, b, lengths=(D,))
        self._launch(f"layernorm_forward_c{layernorm_variant(D)}",
                     _cdiv(rows, LAYERNORM_WARPS), 32 * LAYERNORM_WARPS,
                     (x_prev, _opt(add), _opt(x_out), h, mean, rstd, w, b, i32(rows), i32(D),
                      f32(eps), i32(vec)))

    def layernorm_backward(self, dout, dres, x, mean, rstd, w, dx, dx_op, partials, b=None,
                           h=None):
        # dout (rows,D) -> dx (rows,D) (+ dres), dx_op, partials (chunks, 2D):
        # chunks = layernorm_chunks(rows), each the sums over layernorm_chunk(rows) rows;
        # h (not None; b the bias): the forward's output h (rows,D) operand again, bitwise
        rows, D = dout.shape
        chunks = layernorm_chunks(rows)
        assert partials.shape == (chunks, 2 * D), (partials.shape, chunks, D)
        assert h is None or b is not None, "h is written from the bias b"
        vec = _vector(dout, dres, x, w, b, h, dx, dx_op, lengths=(D,))
        self._launch(f"layernorm_backward_c{layernorm_variant(D)}", chunks,
                     32 * LAYERNORM_WARPS,
                     (dout, _opt(dres), x, mean, rstd, w, _opt(b), _opt(h), dx, _opt(dx_op),
                      partials, i32(rows), i32(D), i32(layernorm_chunk(rows)), i32(vec)))

    def layernorm_param_grads(self, partials, table, offsets, G):
        # partials: per norm, a (chunks, 2D) buffer; table (norms,) uint64: their
        # addresses, which the kernel reads; offsets (norms) int64 -> G[offset : offset + 2D]
        # (G: cupy_backend.Gradient, reached through its segments' table)
        norms = len(partials)
        chunks, twoD = partials[0].shape
        assert all(p.shape == (chunks, twoD) for p in partials) and table.shape == (norms,)
        self._launch("layernorm_param_grads", norms * _cdiv(twoD, 32), 32 * LAYERNORM_GROUPS,
                     (table, offsets, G.table, i32(len(G.parts)), i32(norms), i32(chunks),
                      i32(twoD // 2)), reads=(*partials, *G.parts))

    # -- rope
    def rope_forward(self, qkv, out, cos, sin, T, H):
        # qkv (BT,3D) float32 -> out (BT,3D) operands
        BT, D3 = qkv.shape
        D = D3 // 3
        vec = _vector(qkv, out, cos, sin, lengths=(D // H // 2,))
        self._rowwise("rope_forward", BT, D // 2 if vec else D3,
                      (qkv, out, cos, sin, i32(BT), i32(T), i32(D), i32(H), i32(vec)))

    def rope_backward(self, dqk, dqkv, cos, sin, T, H):
        # dqk (BT,2D) float32 -> dqkv[:, :2D] (BT,3D) operands
        self._rope_backward("rope_backward", dqk, dqkv, cos, sin, T, H)

    def rope_backward_operand(self, dqk, dqkv, cos, sin, T, H):
        # dqk (BT,2D) operands (cuDNN's attention writes dq, dk so) -> dqkv[:, :2D]
        # (BT,3D) operands: rope_backward on the widened values
        self._rope_backward("rope_backward_operand", dqk, dqkv, cos, sin, T, H)

    def _rope_backward(self, name, dqk, dqkv, cos, sin, T, H):
        BT, D2 = dqk.shape
        D = D2 // 2
        vec = _vector(dqk, dqkv, cos, sin, lengths=(D // H // 2,))
        self._rowwise(name, BT, D // 4 if vec else D2,
                      (dqk, dqkv, cos, sin, i32(BT), i32(T), i32(D), i32(H), i32(vec)))

    # -- attention
    def attention_softmax_forward(self, s, p_op, scale):
        # s (B,H,T,T) scores -> probabilities in place (+ p_op operands)
        T = s.shape[-1]
        rows = s.size // T
        self._launch("attention_softmax_forward", _cdiv(rows, WARPS), 32 * WARPS,
                     (s, _opt(p_op), i32(rows), i32(T), f32(scale)))

    def attention_softmax_backward(self, p, dp, ds, p_op, scale):
        # p, dp (B,H,T,T) -> ds (B,H,T,T) operands (+ p_op)
        T = p.shape[-1]
        rows = p.size // T
        self._launch("attention_softmax_backward", _cdiv(rows, WARPS), 32 * WARPS,
                     (p, dp, ds, _opt(p_op), i32(rows), i32(T), f32(scale)))

    # fused attention (bf16 policy, E in ATTENTION_HEAD_DIMS): q, k, v are
    # read from qkv (BT,3D) operands, head h at column h*E of each third
    def _attention(self, part, E, B, T, H, args):
        assert E in ATTENTION_HEAD_DIMS, E
        self._launch(f"attention_{part}_e{E}", (_cdiv(T, ATTENTION_TILE), B * H), 128, args)

    def attention_forward(self, qkv, y, m, l, B, T, H, scale):
        # qkv (BT,3D) -> y (BT,D) operand; kept: m, l (B,H,T), the row maximum
        # of the scores times log2(e) and 1 / the row sum of exp(s - m)
        E = qkv.shape[1] // 3 // H
        self._attention("forward", E, B, T, H, (qkv, y, m, l, i32(T), i32(H), f32(scale)))

    def attention_backward(self, qkv, y, dy, m, l, dot, dqk, dqkv, B, T, H, scale):
        # y (BT,D) the forward's output, dy (BT,D) operands -> dq, dk into dqk
        # (BT,2D) float32, dv into dqkv[:, 2D:] operand; dot (B,H,T) scratch:
        # sum_j dp p per row, written by the first kernel
        E = qkv.shape[1] // 3 // H
        self._attention("backward_dq", E, B, T, H, (qkv, y, dy, m, l, dot, dqk, i32(T), i32(H),
                                                    f32(scale)))
        self._attention("backward_dkdv", E, B, T, H, (qkv, dy, m, l, dot, dqk, dqkv, i32(T),
                                                      i32(H), f32(scale)))

    # -- swiglu
    def swiglu_forward(self, gu, a):
        # gu (BT,2F) -> a (BT,F) operand
        BT, F = a.shape
        vec = _vector(gu, a, lengths=(F,))
        self._rowwise("swiglu_forward", BT, F // 4 if vec else F, (gu, a, i32(BT), i32(F),
                                                                   i32(vec)))

    def swiglu_backward(self, da, gu, dgu, a=None):
        # da (BT,F), gu (BT,2F) -> dgu (BT,2F) operands, and (a: not None) the
        # forward's a (BT,F) = silu(g) * u operand again, bitwise
        BT, F = da.shape
        vec = _vector(da, gu, dgu, a, lengths=(F,))
        self._rowwise("swiglu_backward", BT, F // 4 if vec else F,
                      (da, gu, dgu, _opt(a), i32(BT), i32(F), i32(vec)))

    # -- loss
    def crossentropy_forward_backward(self, logits, ids, ids_stride, T, ce, dlogits, dce,
                                      row0=0):
        # logits (rows,V) -> ce (rows), dlogits (rows,V) operands for the mean's
        # gradient dce; the rows are rows row0.. of the batch's BT (their targets)
        rows, V = logits.shape
        assert ce.shape == (rows,) and dlogits.shape == (rows, V), (ce.shape, dlogits.shape)
        vec = _vector(logits, dlogits, lengths=(V,))
        self._launch("crossentropy_forward_backward", rows, _threads_over(_cdiv(V, 4), CE_THREADS),
                     (logits, ids, i32(ids_stride), i32(T), i32(row0), ce, dlogits, i32(V),
                      f32(dce), i32(vec)))

    def mean_loss(self, ce, loss):
        self._launch("mean_loss", 1, 1024, (ce, loss, i32(ce.size)))

    # -- AdamW
    def adamw_bias_corrections(self, t, c, beta1: float, beta2: float, rates):
        # t (1) int32 += 1; c (4) float32 = c1, c2, a_t, b_t of the new t;
        # rates (R, 2) float32: reference.adamw.schedule_table
        self._launch("adamw_bias_corrections", 1, 1,
                     (t, c, f64(beta1), f64(beta2), rates, i32(rates.shape[0])))

    def gradient_norm(self, G, partial, norm, clip: float):
        # G (N; cupy_backend.Gradient, through its segments' table) -> partial
        # (NORM_BLOCKS) -> norm (2) = (||G||, clip scale); clip 0: off
        n4 = G.size // 4 if G.vector else 0
        self._launch("gradient_sum_squares", partial.size, THREADS,
                     (G.table, i32(len(G.parts)), i64(G.size), i64(n4), partial), reads=G.parts)
        self._launch("gradient_norm_clip", 1, 1024, (partial, i32(partial.size), norm, f32(clip)))

    def adamw_bias_corrections_table(self, ts, c1, c2, beta1: float, beta2: float):
        self._elementwise("adamw_bias_corrections_table", ts.size,
                          (ts, c1, c2, i32(ts.size), f64(beta1), f64(beta2)))

    def adamw_update(self, P, M, V, G, decay, Pb, c, norm, k, partial=None):
        # P, M, V, G (N) float32 (G: cupy_backend.Gradient, through its
        # segments' table), decay (R, 2) int64: the decayed elements'
        # sorted, disjoint [start, end) runs (Registry.decay_ranges), Pb (N)
        # bfloat16 bits or None, c (4) c1, c2, a_t, b_t; norm (2) with the clip
        # scale norm[1]; k: reference.adamw.AdamWConstants (the betas and epsilon).
        # partial (at least adamw_blocks(N)) float32, clipping off: the scale is
        # 1 (norm unread) and each block's sum of G's squares goes to partial
        # (gradient_norm_finish takes the norm from them)
        n = P.size
        assert decay.dtype == np.int64 and decay.shape[1:] == (2,), decay.shape
        assert G.size == n, (G.size, n)
        n4 = n // 4 if _vector(P, M, V, Pb) and G.vector else 0
        blocks = max(1, _cdiv(n4 + n - 4 * n4, THREADS))
        assert partial is None or partial.size >= blocks, (partial.size, blocks)
        self._launch("adamw_update", blocks, THREADS,
                     (P, M, V, G.table, i32(len(G.parts)), decay, i32(decay.shape[0]), _opt(Pb), c,
                      norm, i64(n), i64(n4), f32(k.b1), f32(k.omb1), f32(k.b2), f32(k.omb2),
                      f32(k.eps), _opt(partial)), reads=G.parts)
        return blocks

    def gradient_norm_finish(self, partial, blocks, norm):
        # partial[:blocks], adamw_update's sums of squares -> norm (2) = (||G||, 1)
        self._launch("gradient_norm_clip", 1, 1024, (partial, i32(blocks), norm, f32(0.0)))

    def accumulate_gradient(self, G, Gm):
        # G, Gm (N) float32: G += Gm (a micro-batch's gradient, SPEC 19)
        self._flat("accumulate_gradient", G.size, (G, Gm), G, Gm)


def attention_scale(E: int) -> np.float32:
    """float32(1/sqrt(E)), as the reference's q.dtype.type(1.0 / np.sqrt(E))."""
    return np.float32(1.0 / math.sqrt(E))
