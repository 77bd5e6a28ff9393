"""Causal self-attention core: y = softmax(q k^T / sqrt(E), causal) v per head."""

import numpy as np

from ..precision import matmul


def _causal_mask(T):
    return np.triu(np.ones((T, T), dtype=bool), k=1)  # True where j > i


def attention_forward(q, k, v, policy):
    # q, k, v (B,H,T,E) -> y (B,H,T,E)
    E, T = q.shape[-1], q.shape[-2]
    scale = q.dtype.type(1.0 / np.sqrt(E))
    s = matmul(q, np.swapaxes(k, -1, -2), policy) * scale  # (B,H,T,T)
    s[..., _causal_mask(T)] = -np.inf
    s = s - s.max(axis=-1, keepdims=True)  # row maximum subtracted before exp
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)  # (B,H,T,T); exactly 0 above the diagonal
    y = matmul(p, v, policy)  # (B,H,T,E)
    return y, (q, k, v, p, scale)


def attention_backward(dy, cache, policy):
    # dy (B,H,T,E) -> dq, dk, dv (B,H,T,E)
    q, k, v, p, scale = cache
    dv = matmul(np.swapaxes(p, -1, -2), dy, policy)  # (B,H,T,E)
    dp = matmul(dy, np.swapaxes(v, -1, -2), policy)  # (B,H,T,T)
    # softmax backward: ds = p * (dp - sum_j dp * p); masked entries have p = 0
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    ds *= scale  # the scale multiplied the product q k^T
    dq = matmul(ds, k, policy)  # (B,H,T,E)
    dk = matmul(np.swapaxes(ds, -1, -2), q, policy)  # (B,H,T,E)
    return dq, dk, dv
