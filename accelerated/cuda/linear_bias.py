"""The linear_bias family (kernels/linear_bias.cu): the q, k and v
products' biases (SPEC 21, qkv_bias) on the fused q | k | v row, added
after the products, their gradients, the column sums of dq, dk and dv, in
two passes and a fixed order, and the q, k, v weights gathered into one
operand matrix per layer (in P each is followed by its bias)."""

from __future__ import annotations

import numpy as np

from .launch import THREADS, Launcher, _cdiv, _vector, i32

LINEAR_BIAS_GROUPS = 8  # LB_GROUPS: row groups per block of the bias gradient kernels
LINEAR_BIAS_CHUNKS = 256  # the most blocks of rows (partials) of linear_bias_backward

KERNELS = ("linear_bias_forward", "linear_bias_backward", "linear_bias_param_grads",
           "linear_bias_gather_weights")


def linear_bias_chunk(rows: int) -> int:
    """Rows per block of linear_bias_backward: a multiple of
    LINEAR_BIAS_GROUPS, as few as give at most LINEAR_BIAS_CHUNKS blocks of
    rows (so the second pass adds few partials per column)."""
    return LINEAR_BIAS_GROUPS * max(1, _cdiv(rows, LINEAR_BIAS_GROUPS * LINEAR_BIAS_CHUNKS))


def linear_bias_chunks(rows: int) -> int:
    """Blocks of rows of linear_bias_backward over `rows` rows: the partials' rows."""
    return _cdiv(rows, linear_bias_chunk(rows))


def _columns(W: int, K: int, Vc: int, biases) -> None:
    assert 0 < K < Vc < W and [b.size for b in biases] == [K, Vc - K, W - Vc], \
        (W, K, Vc, [b.size for b in biases])


class LinearBiasLaunchers(Launcher):
    """The launchers of kernels/linear_bias.cu."""

    def linear_bias_forward(self, y, bq, bk, bv, K, Vc):
        # y (rows,W) float32 q | k | v products, k at column K, v at Vc -> y + (bq | bk | bv)
        rows, W = y.shape
        _columns(W, K, Vc, (bq, bk, bv))
        vec = _vector(y, bq, bk, bv, lengths=(W, K, Vc))
        self._rowwise("linear_bias_forward", rows, W // 4 if vec else W,
                      (y, bq, bk, bv, i32(rows), i32(W), i32(K), i32(Vc), i32(vec)))

    def linear_bias_backward(self, dy, partials):
        # dy (rows,W) operands -> partials (chunks, W): each block of
        # linear_bias_chunk(rows) rows' column sums, chunks = linear_bias_chunks(rows)
        rows, W = dy.shape
        chunks = linear_bias_chunks(rows)
        assert partials.shape == (chunks, W), (partials.shape, chunks, W)
        vec = _vector(dy, partials, lengths=(W,))
        self._launch("linear_bias_backward", (_cdiv(W // 4 if vec else W, 32), chunks),
                     32 * LINEAR_BIAS_GROUPS,
                     (dy, partials, i32(rows), i32(W), i32(linear_bias_chunk(rows)), i32(vec)))

    def linear_bias_param_grads(self, partials, gq, gk, gv, K, Vc):
        # partials (chunks, W) -> the column sums, in chunk order, into gq | gk | gv
        # (views of G: k's columns from K, v's from Vc)
        chunks, W = partials.shape
        _columns(W, K, Vc, (gq, gk, gv))
        self._launch("linear_bias_param_grads", _cdiv(W, 32), 32 * LINEAR_BIAS_GROUPS,
                     (partials, i32(chunks), i32(W), i32(K), i32(Vc), gq, gk, gv))

    def linear_bias_gather_weights(self, P, out, table, offsets, counts):
        # P (N,) operands -> out (L, n): layer l's q, k, v weights side by side,
        # counts (nq, nk, nv) elements from offsets[l] (L, 3) into P (host
        # values; table: the same, int64 on the device, which the kernel reads)
        L, n = out.shape
        offsets = np.asarray(offsets)
        assert offsets.shape == (L, 3) == table.shape and sum(counts) == n, \
            (offsets.shape, table.shape, counts, n)
        assert n < 2**31 and L <= 65535, (n, L)
        vec = _vector(P, out, lengths=(*counts, *offsets.ravel()))
        items = n // 4 if vec else n
        self._launch("linear_bias_gather_weights", (_cdiv(items, THREADS), L), THREADS,
                     (P, out, table, *(i32(c) for c in counts), i32(vec)))
