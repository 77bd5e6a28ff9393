"""The NumPy stand-ins of the rmsnorm kernels (accelerated/cuda/kernels/rmsnorm.cu,
launched by accelerated/cuda/rmsnorm.py): their contracts, not their code."""

from __future__ import annotations

import numpy as np

from .common import _a, _null, _store, f32


def k_rmsnorm_forward(bf16, x_prev, add, x_out, h, rstd, w, rows, D, eps, vec):
    x = _a(x_prev)
    if not _null(add):
        x = x + _a(add)
        _a(x_out)[...] = x
    rs = f32(1.0) / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    _store(h, x * rs * _a(w), bf16)
    _a(rstd)[...] = rs[:, 0]


def k_rmsnorm_backward(bf16, dout, dres, x, rstd, w, h, dx, dx_op, partials, rows, D, chunk,
                       vec):
    dy = _a(dout)
    xhat = _a(x) * _a(rstd)[:, None]
    if not _null(h):  # the forward's h, as k_rmsnorm_forward computes it
        _store(h, xhat * _a(w), bf16)
    dxhat = dy * _a(w)
    v = _a(rstd)[:, None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    if not _null(dres):
        v = _a(dres) + v
    _a(dx)[...] = v
    if not _null(dx_op):
        _store(dx_op, v, bf16)
    chunk = int(chunk)
    for c in range(partials.shape[0]):
        s = slice(c * chunk, (c + 1) * chunk)
        _a(partials)[c] = (dy[s] * xhat[s]).sum(0)
