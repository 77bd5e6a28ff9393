"""The NumPy stand-ins of the linear_bias kernels (accelerated/cuda/kernels/linear_bias.cu,
launched by accelerated/cuda/linear_bias.py): their contracts, not their code."""

from __future__ import annotations

import numpy as np

from .common import _a, _operand


def k_linear_bias_forward(bf16, y, bq, bk, bv, rows, W, K, Vc, vec):
    _a(y)[...] = _a(y) + np.concatenate([_a(bq), _a(bk), _a(bv)])


def k_linear_bias_backward(bf16, dy, partials, rows, W, chunk, vec):
    d = _operand(dy, bf16)
    chunk = int(chunk)
    for c in range(partials.shape[0]):
        _a(partials)[c] = d[c * chunk:(c + 1) * chunk].sum(0)


def k_linear_bias_param_grads(bf16, partials, chunks, W, K, Vc, gq, gk, gv):
    db = _a(partials).sum(0)
    K, Vc = int(K), int(Vc)
    _a(gq)[...], _a(gk)[...], _a(gv)[...] = db[:K], db[K:Vc], db[Vc:]


def k_linear_bias_gather_weights(bf16, P, out, offsets, nq, nk, nv, vec):
    counts = (int(nq), int(nk), int(nv))
    for l, starts in enumerate(_a(offsets)):
        _a(out)[l] = np.concatenate([_a(P)[int(s):int(s) + c] for s, c in zip(starts, counts)])
