"""SwiGLU gate: a = silu(g) * u, silu(g) = g * sigmoid(g)."""

import numpy as np


def _sigmoid(g):
    return 1.0 / (1.0 + np.exp(-g))


def swiglu_forward(g, u):
    # g, u (B,T,F) -> a (B,T,F)
    sig = _sigmoid(g)
    return g * sig * u, (g, u, sig)


def swiglu_backward(da, cache):
    # da (B,T,F) -> dg, du (B,T,F)
    g, u, sig = cache
    du = da * g * sig
    # d silu/dg = sig + g * sig * (1 - sig)
    dg = da * u * (sig + g * sig * (1.0 - sig))
    return dg, du
