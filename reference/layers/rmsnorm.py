"""RMSNorm over the last axis (SPEC 21): y = x / sqrt(mean(x^2) + eps) * w, a
weight and no bias."""

import numpy as np


def rmsnorm_forward(x, w, eps):
    # x (...,D), w (D,) -> out (...,D)
    ms = (x * x).mean(axis=-1, keepdims=True)  # (...,1): the mean square, as layernorm's mean
    rstd = 1.0 / np.sqrt(ms + x.dtype.type(eps))  # (...,1)
    xhat = x * rstd  # (...,D)
    return xhat * w, (xhat, rstd, w)


def rmsnorm_backward(dout, cache):
    # dout (...,D) -> dx (...,D), dw (D,)
    xhat, rstd, w = cache
    D = xhat.shape[-1]
    dw = (dout * xhat).reshape(-1, D).sum(axis=0)
    dxhat = dout * w  # (...,D)
    # d/dx of x * rstd: rstd itself depends on x through mean(x^2)
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dw
