"""The NumPy stand-ins of the AdamW kernels (accelerated/cuda/kernels/adamw.cu,
launched by accelerated/cuda/adamw.py): their contracts, not their code."""

from __future__ import annotations

import numpy as np

from .common import _a, _gradient_whole, _null, _store, f32


def k_accumulate_gradient(bf16, G, Gm, n, n4):
    n = int(n)
    _a(G)[:n] = _a(G)[:n] + _a(Gm)[:n]  # one float32 add per element


def k_adamw_bias_corrections(bf16, t, c, beta1, beta2, rates, rows):
    _a(t)[0] += 1
    tn = int(_a(t)[0])
    _a(c)[0] = f32(1.0 - float(beta1) ** tn)
    _a(c)[1] = f32(1.0 - float(beta2) ** tn)
    row = min(tn, int(rows) - 1)
    _a(c)[2:4] = _a(rates).reshape(-1, 2)[row]


def k_gradient_sum_squares(bf16, gseg, S, n, n4, partial):
    g = _gradient_whole(gseg, S, n)
    blocks = _a(partial).size
    for b in range(blocks):  # the kernel's strided sets, each summed in float32
        _a(partial)[b] = np.sum(np.square(g[b::blocks]), dtype=np.float32)


def k_gradient_norm_clip(bf16, partial, blocks, norm, clip):
    n = f32(np.sqrt(np.sum(_a(partial)[:int(blocks)], dtype=np.float32)))
    clip = f32(clip)
    _a(norm)[0] = n
    _a(norm)[1] = clip / n if clip > 0 and np.isfinite(n) and n > clip else f32(1)


def k_adamw_bias_corrections_table(bf16, ts, c1, c2, n, beta1, beta2):
    for i, tn in enumerate(_a(ts)[:int(n)]):
        _a(c1)[i] = f32(1.0 - float(beta1) ** int(tn))
        _a(c2)[i] = f32(1.0 - float(beta2) ** int(tn))


def k_adamw_update(bf16, P, M, V, gseg, S, decay, R, base, Pb, c, norm, n, n4, b1, omb1, b2,
                   omb2, eps, partial):
    G = _gradient_whole(gseg, S, n)
    p, m, v = _a(P), _a(M), _a(V)
    mask = np.zeros(p.size, dtype=bool)  # element j is element base + j of the whole vector
    for start, end in _a(decay).reshape(-1, 2)[:int(R)]:
        mask[max(start - int(base), 0):max(end - int(base), 0)] = True
    if not _null(partial):  # clipping off: scale 1, each block's sum of squares
        g = G[:int(n)]
        n4 = int(n4)
        squares = np.concatenate([np.square(g[:4 * n4]).reshape(-1, 4).sum(1, dtype=np.float32),
                                  np.square(g[4 * n4:])]).astype(np.float32)
        for b in range(0, squares.size, 256):  # blocks of 256 items (THREADS)
            _a(partial)[b // 256] = np.sum(squares[b:b + 256], dtype=np.float32)
        g = G
    else:
        g = G * _a(norm)[1]
    c1, c2, lr, lrwd = _a(c)[0], _a(c)[1], _a(c)[2], _a(c)[3]
    m[...] = b1 * m + omb1 * g
    v[...] = b2 * v + omb2 * g * g
    p[...] = np.where(mask, p - lrwd * p, p)
    p[...] = p - lr * (m / c1) / (np.sqrt(v / c2) + eps)
    if not _null(Pb):
        _store(Pb, p, True)
