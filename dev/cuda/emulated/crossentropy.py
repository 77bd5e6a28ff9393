"""The NumPy stand-ins of the cross-entropy kernels (accelerated/cuda/kernels/crossentropy.cu,
launched by accelerated/cuda/crossentropy.py): their contracts, not their code."""

from __future__ import annotations

import numpy as np

from .common import _a, _rows_ids, _store, f32


def k_crossentropy_forward_backward(bf16, logits, ids, stride, T, row0, ce, dlogits, V, dce,
                                    vec):
    l = _a(logits)
    BT = l.shape[0]
    target = _rows_ids(ids, int(stride), int(T), int(row0) + BT, shift=1)[int(row0):]
    mx = l.max(-1, keepdims=True)
    e = np.exp(l - mx)
    se = e.sum(-1, keepdims=True)
    _a(ce)[...] = (np.log(se) + mx)[:, 0] - l[np.arange(BT), target]
    p = e / se
    p[np.arange(BT), target] -= f32(1.0)
    _store(dlogits, p * dce, bf16)


def k_mean_loss(bf16, ce, loss, n):
    _a(loss)[0] = _a(ce)[:int(n)].mean(dtype=np.float32)
