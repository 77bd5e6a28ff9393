"""The layernorm family (kernels/layernorm.cu): the forward with the residual
add, the backward with its per-block weight partials, and the partials
of every norm (layernorm's, or rmsnorm's: accelerated/cuda/rmsnorm.py)
reduced in a fixed order at the end of the step."""

from __future__ import annotations

from .launch import Launcher, _cdiv, _opt, _vector, f32, i32

LAYERNORM_VARIANTS = (1, 2, 4, 8)  # float4 chunks per lane of the warp kernels (_c<NC>)
WIDE_VARIANTS = (2, 4, 8)  # float4 chunks per thread of the block kernels (_w<NC>)
LN_CHUNKS = 8  # the most float4 chunks per thread of the norm kernels (layernorm.cu)
LAYERNORM_WARPS = 8  # LN_WARPS: warps (rows at once) per block of the warp kernels
LAYERNORM_WIDE = 256  # LN_WIDE: threads holding one row in the block kernels
MAX_D = LAYERNORM_WIDE * 4 * LN_CHUNKS  # the widest row the norm kernels hold in registers
LAYERNORM_GROUPS = 8  # LN_GROUPS: threads summing one column of the partials

# the norm kernels' suffixes: a warp per row, then a block per row
VARIANTS = (*(f"c{nc}" for nc in LAYERNORM_VARIANTS), *(f"w{nc}" for nc in WIDE_VARIANTS))
KERNELS = (*(f"layernorm_{part}_{v}" for v in VARIANTS for part in ("forward", "backward")),
           "layernorm_param_grads")


def layernorm_variant(D: int) -> str:
    """The suffix of the norm kernels for rows of D features: a warp's
    (c<NC>, rows of up to 1024 features: the fewest float4 chunks per lane
    that hold a row), else a block's (w<NC>, up to MAX_D)."""
    assert D <= MAX_D, D
    if D <= 32 * 4 * LAYERNORM_VARIANTS[-1]:
        return "c%d" % next(nc for nc in LAYERNORM_VARIANTS if D <= 32 * 4 * nc)
    return "w%d" % next(nc for nc in WIDE_VARIANTS if D <= LAYERNORM_WIDE * 4 * nc)


def norm_forward_grid(rows: int, D: int) -> tuple[int, int]:
    """(blocks, threads) of a norm's forward over rows of D features: a
    warp per row, LAYERNORM_WARPS rows a block, or a block per row."""
    if layernorm_variant(D).startswith("c"):
        return _cdiv(rows, LAYERNORM_WARPS), 32 * LAYERNORM_WARPS
    return rows, LAYERNORM_WIDE


def norm_backward_threads(D: int) -> int:
    """Threads of a block of a norm's backward (one block per
    layernorm_chunk(rows) rows either way)."""
    return 32 * LAYERNORM_WARPS if layernorm_variant(D).startswith("c") else LAYERNORM_WIDE


def layernorm_chunk(rows: int) -> int:
    """Rows per block of layernorm_backward: the partition of its weight
    gradients' partial sums (one per block, added in order). About 256
    blocks or more to fill the GPU, each warp taking 1 to 8 rows."""
    return min(8 * LAYERNORM_WARPS, max(LAYERNORM_WARPS, LAYERNORM_WARPS * _cdiv(rows, 8 * 256)))


def layernorm_chunks(rows: int) -> int:
    """Blocks of layernorm_backward over `rows` rows: the partials' rows."""
    return _cdiv(rows, layernorm_chunk(rows))


class LayernormLaunchers(Launcher):
    """The launchers of kernels/layernorm.cu."""

    def layernorm_forward(self, x_prev, add, x_out, h, mean, rstd, w, b, eps):
        # x_prev (+ add -> x_out) (rows,D) -> h (rows,D) operand, mean, rstd (rows)
        rows, D = x_prev.shape
        vec = _vector(x_prev, add, x_out, h, w, b, lengths=(D,))
        self._launch(f"layernorm_forward_{layernorm_variant(D)}", *norm_forward_grid(rows, D),
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
        self._launch(f"layernorm_backward_{layernorm_variant(D)}", chunks,
                     norm_backward_threads(D),
                     (dout, _opt(dres), x, mean, rstd, w, _opt(b), _opt(h), dx, _opt(dx_op),
                      partials, i32(rows), i32(D), i32(layernorm_chunk(rows)), i32(vec)))

    def layernorm_param_grads(self, partials, table, offsets, G):
        # partials: per norm, a (chunks, width) buffer (width: 2D, a layernorm's
        # weight then bias; D, an rmsnorm's weight); table (norms,) uint64: their
        # addresses, which the kernel reads; offsets (norms) int64 -> G[offset :
        # offset + width] (G: buffers.Gradient, reached through its segments' table)
        norms = len(partials)
        chunks, width = partials[0].shape
        assert all(p.shape == (chunks, width) for p in partials) and table.shape == (norms,)
        self._launch("layernorm_param_grads", norms * _cdiv(width, 32), 32 * LAYERNORM_GROUPS,
                     (table, offsets, G.table, i32(len(G.parts)), i32(norms), i32(chunks),
                      i32(width)), reads=(*partials, *G.parts))
