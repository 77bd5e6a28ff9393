"""Token embedding: a gather of rows of the (V, D) table."""

import numpy as np


def embedding_forward(ids, W):
    # ids (B,T) int, W (V,D) -> x (B,T,D)
    return W[ids]


def embedding_backward(dx, ids, V):
    # dx (B,T,D) -> dW (V,D): each row receives the sum of the gradients of
    # the positions that gathered it (np.add.at accumulates repeated ids).
    D = dx.shape[-1]
    dW = np.zeros((V, D), dtype=dx.dtype)
    np.add.at(dW, ids.reshape(-1), dx.reshape(-1, D))
    return dW
