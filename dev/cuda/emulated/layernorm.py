"""The NumPy stand-ins of the layernorm kernels (accelerated/cuda/kernels/layernorm.cu,
launched by accelerated/cuda/layernorm.py): their contracts, not their code."""

from __future__ import annotations

import numpy as np

from .common import _a, _floats, _null, _store, f32


def k_layernorm_forward(bf16, x_prev, add, x_out, h, mean, rstd, w, b, rows, D, eps, vec):
    x = _a(x_prev)
    if not _null(add):
        x = x + _a(add)
        _a(x_out)[...] = x
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(-1, keepdims=True)
    rs = f32(1.0) / np.sqrt(var + eps)
    _store(h, xc * rs * _a(w) + _a(b), bf16)
    _a(mean)[...] = mu[:, 0]
    _a(rstd)[...] = rs[:, 0]


def k_layernorm_backward(bf16, dout, dres, x, mean, rstd, w, b, h, dx, dx_op, partials, rows,
                         D, chunk, vec):
    dy = _a(dout)
    rs = _a(rstd)[:, None]
    xhat = (_a(x) - _a(mean)[:, None]) * rs
    if not _null(h):  # the forward's h, as k_layernorm_forward computes it
        _store(h, xhat * _a(w) + _a(b), bf16)
    dxhat = dy * _a(w)
    v = rs * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    if not _null(dres):
        v = _a(dres) + v
    _a(dx)[...] = v
    if not _null(dx_op):
        _store(dx_op, v, bf16)
    chunk = int(chunk)
    for c in range(partials.shape[0]):
        s = slice(c * chunk, (c + 1) * chunk)
        _a(partials)[c, :int(D)] = (dy[s] * xhat[s]).sum(0)
        _a(partials)[c, int(D):] = dy[s].sum(0)


def k_layernorm_param_grads(bf16, table, offsets, gseg, S, norms, chunks, width):
    # table: each norm's partials' address, (chunks, width) float32 there
    count = int(chunks) * int(width)
    segments = _a(gseg).reshape(-1, 2)[:int(S)]
    for n in range(int(norms)):
        off = int(_a(offsets)[n])
        part = _floats(int(_a(table)[n]), count).reshape(int(chunks), int(width))
        start, addr = next((int(st), int(a)) for st, a in reversed(segments) if st <= off)
        _floats(addr + 4 * (off - start), int(width))[...] = part.sum(0)
