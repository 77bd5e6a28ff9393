"""LayerNorm over the last axis, biased variance (SPEC section 3)."""

import numpy as np


def layernorm_forward(x, w, b, eps):
    # x (...,D), w (D,), b (D,) -> out (...,D)
    mu = x.mean(axis=-1, keepdims=True)  # (...,1)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)  # biased: mean((x - mu)^2)
    rstd = 1.0 / np.sqrt(var + x.dtype.type(eps))  # (...,1)
    xhat = xc * rstd  # (...,D)
    out = xhat * w + b
    return out, (xhat, rstd, w)


def layernorm_backward(dout, cache):
    # dout (...,D) -> dx (...,D), dw (D,), db (D,)
    xhat, rstd, w = cache
    D = xhat.shape[-1]
    db = dout.reshape(-1, D).sum(axis=0)
    dw = (dout * xhat).reshape(-1, D).sum(axis=0)
    dxhat = dout * w  # (...,D)
    # d/dx of (x - mu) * rstd: the two mean terms come from mu and var.
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dw, db
