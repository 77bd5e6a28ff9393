"""Rotary position embedding, half-split pairs (SPEC sections 3 and 21): of
each head's E elements the first R are rotated, element j pairing with
element j + R/2; the other E - R pass through (R = E unless rotary < 1)."""

import numpy as np

from ..config import ROPE_BASE


def rope_tables(T, R, dtype=np.float32, base=ROPE_BASE):
    # -> cos, sin (T, R/2): theta = t * base^(-2j/R), computed in float64, then rounded
    t = np.arange(T, dtype=np.float64)[:, None]
    j = np.arange(R // 2, dtype=np.float64)[None, :]
    theta = t * np.power(float(base), -2.0 * j / R)  # base: the config's rope_base (SPEC 21)
    return np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)


def _rotate(x, c, s, sign):
    # x (...,R): the half-split rotation by sign * theta
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - sign * x2 * s, x2 * c + sign * x1 * s], axis=-1)


def _apply(x, cos, sin, sign):
    # x (B,T,H,E), cos/sin (T,R/2); the rotation of the first R elements of each head
    R = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # (T,1,R/2) broadcast over heads
    if R == x.shape[-1]:
        return _rotate(x, c, s, sign)
    return np.concatenate([_rotate(x[..., :R], c, s, sign), x[..., R:]], axis=-1)


def rope_forward(x, cos, sin):
    # x (B,T,H,E), cos/sin (T,R/2) -> out (B,T,H,E)
    return _apply(x, cos, sin, 1)


def rope_backward(dout, cos, sin):
    # the rotation is orthogonal: dx = R^T dout, a rotation by -theta; the rest passes through
    return _apply(dout, cos, sin, -1)
