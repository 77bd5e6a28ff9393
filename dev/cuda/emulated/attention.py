"""The NumPy stand-ins of the attention softmax kernels (accelerated/cuda/kernels/attention.cu,
launched by accelerated/cuda/attention.py): their contracts, not their code."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .common import _a, _causal, _null


def _store_causal(out, values, bf16):
    """Write the causal part (j <= i) of (..., T, T) values only."""
    T = out.shape[-1]
    keep = ~_causal(T)
    o = _a(out).reshape(-1, T, T)
    v = np.asarray(values, np.float32).reshape(-1, T, T)
    if bf16:
        v = v.astype(ml_dtypes.bfloat16).view(np.uint16)
    o[:, keep] = v[:, keep]


def k_attention_softmax_forward(bf16, s, p_op, rows, T, scale):
    T = int(T)
    x = _a(s).reshape(-1, T, T) * scale
    x[:, _causal(T)] = -np.inf
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(-1, keepdims=True)
    if _null(p_op):  # under fp32 the product reads s: its zeros are written too
        _a(s)[...] = p.reshape(s.shape)
    else:
        _store_causal(s, p, False)
        _store_causal(p_op, p, bf16)


def k_attention_softmax_backward(bf16, p, dp, ds, p_op, rows, T, scale):
    T = int(T)
    keep = ~_causal(T)
    P = np.where(keep, _a(p).reshape(-1, T, T), 0)  # the causal part only is read
    dP = np.where(keep, _a(dp).reshape(-1, T, T), 0)
    g = P * (dP - (dP * P).sum(-1, keepdims=True))
    g *= scale
    _store_causal(ds, g, bf16)
    if not _null(p_op):
        _store_causal(p_op, P, bf16)
