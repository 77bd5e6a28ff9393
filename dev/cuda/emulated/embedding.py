"""The NumPy stand-ins of the embedding kernels (accelerated/cuda/kernels/embedding.cu,
launched by accelerated/cuda/embedding.py): their contracts, not their code."""

from __future__ import annotations

import numpy as np

from .common import _a, _rows_ids


def k_embedding_forward(bf16, ids, stride, T, W, x, BT, D, vec):
    _a(x)[...] = _a(W)[_rows_ids(ids, int(stride), int(T), int(BT))]


def k_embedding_index_reset(bf16, index, V):
    _a(index)[:, 0] = 0x7FFFFFFF
    _a(index)[:, 1] = 0


def k_embedding_index(bf16, ids, stride, T, BT, index):
    v = _rows_ids(ids, int(stride), int(T), int(BT))
    first = _a(index)[:, 0]
    np.minimum.at(first, v, np.arange(int(BT), dtype=np.int32))
    np.add.at(_a(index)[:, 1], v, 1)


def k_embedding_backward(bf16, dx, ids, stride, T, BT, dW, D, index, accumulate, vec):
    v = _rows_ids(ids, int(stride), int(T), int(BT))
    acc = np.zeros(dW.shape, dtype=np.float32)
    np.add.at(acc, v, _a(dx))
    seen = np.unique(v)  # the rows of ids that occur nowhere are not touched
    _a(dW)[seen] = (_a(dW)[seen] + acc[seen]) if accumulate else acc[seen]


def k_embedding_backward_unseen(bf16, index, dW, V, D, vec):
    _a(dW)[_a(index)[:, 1] == 0] = 0.0
