"""Rotary position embedding, half-split pairs (SPEC section 3): element j of a
head pairs with element j + E/2."""

import numpy as np

from ..config import ROPE_BASE


def rope_tables(T, E, dtype=np.float32, base=ROPE_BASE):
    # -> cos, sin (T, E/2): theta = t * base^(-2j/E), computed in float64, then rounded
    t = np.arange(T, dtype=np.float64)[:, None]
    j = np.arange(E // 2, dtype=np.float64)[None, :]
    theta = t * np.power(float(base), -2.0 * j / E)  # base: the config's rope_base (SPEC 21)
    return np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)


def rope_forward(x, cos, sin):
    # x (B,T,H,E), cos/sin (T,E/2) -> out (B,T,H,E)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (T,1,E/2) broadcast over heads
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_backward(dout, cos, sin):
    # the rotation is orthogonal: dx = R^T dout, a rotation by -theta
    half = dout.shape[-1] // 2
    d1, d2 = dout[..., :half], dout[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([d1 * c + d2 * s, d2 * c - d1 * s], axis=-1)
