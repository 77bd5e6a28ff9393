"""The NumPy stand-ins of the rope kernels (accelerated/cuda/kernels/rope.cu,
launched by accelerated/cuda/rope.py): their contracts, not their code."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .common import _a


def _rope_rows(x, cos, sin, T, heads, E, R, inverse):
    """x (BT, ldx) float32 -> (BT, ldx): of the first `heads` heads of E
    columns the first R elements rotated (half-split pairs within R, by
    theta or, inverse, by -theta: the float32 operations of
    reference/layers/rope.py), every other column as it is."""
    BT = x.shape[0]
    pos = np.arange(BT) % T
    c, s = _a(cos)[pos][:, None, :], _a(sin)[pos][:, None, :]  # (BT, 1, R/2)
    out = x.copy()
    h = out[:, :heads * E].reshape(BT, heads, E)  # a view of out's rotated heads
    x1, x2 = np.split(x[:, :heads * E].reshape(BT, heads, E)[..., :R], 2, axis=-1)
    if inverse:
        h[..., :R // 2], h[..., R // 2:R] = x1 * c + x2 * s, x2 * c - x1 * s
    else:
        h[..., :R // 2], h[..., R // 2:R] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def _store_columns(out, values, bf16):
    """values (BT, n) into out's first n columns, as operands."""
    n = values.shape[1]
    if bf16:
        _a(out)[:, :n] = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        _a(out)[:, :n] = values


def k_rope_forward(bf16, qkv, out, cos, sin, BT, T, heads, E, R, W, vec):
    x = _a(qkv).reshape(int(BT), int(W))
    _store_columns(out, _rope_rows(x, cos, sin, int(T), int(heads), int(E), int(R), False), bf16)


def k_rope_backward(bf16, dqk, dqkv, cos, sin, BT, T, heads, E, R, ldx, W, vec):
    x = _a(dqk).reshape(int(BT), int(ldx))
    _store_columns(dqkv, _rope_rows(x, cos, sin, int(T), int(heads), int(E), int(R), True), bf16)


def k_rope_backward_operand(bf16, dqk, dqkv, cos, sin, BT, T, heads, E, R, ldx, W, vec):
    x = _a(dqk)
    widened = (x.astype(np.uint32) << 16).view(np.float32) if bf16 else x
    k_rope_backward(bf16, widened, dqkv, cos, sin, BT, T, heads, E, R, ldx, W, vec)
