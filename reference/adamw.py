"""AdamW (SPEC section 7), elementwise in float32 on the flat vectors.

How the exact rationals enter float32 arithmetic (the reading every backend
implements): each coefficient is an exact rational rounded once to float32 —
float32(beta1), float32(1 - beta1), float32(beta2), float32(1 - beta2),
float32(lr), float32(lr * weight_decay), float32(epsilon) — and the bias
corrections c1 = float32(1 - beta1^t), c2 = float32(1 - beta2^t) are
computed in float64, then rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .config import Hyper

f32 = np.float32


def float32_of(q) -> np.float32:
    """The float32 nearest to the exact rational q, ties to even, rounded
    once. (float32(float(q)) rounds twice and can land on the wrong side of a
    float32 halfway point.) The float64 detour is within one float32 ulp, so
    the answer is it or a neighbour; compare the three exactly."""
    q = Fraction(q)
    x = f32(float(q))
    candidates = [np.nextafter(x, f32(-np.inf)), x, np.nextafter(x, f32(np.inf))]

    def key(c):
        distance = abs(Fraction(float(c)) - q) if np.isfinite(c) else Fraction(2) ** 200
        return distance, int(np.array(c, dtype=f32).view(np.uint32)) & 1  # ties: even mantissa

    return min(candidates, key=key)


@dataclass(frozen=True)
class AdamWConstants:
    b1: np.float32
    omb1: np.float32  # 1 - beta1
    b2: np.float32
    omb2: np.float32  # 1 - beta2
    lr: np.float32
    lrwd: np.float32  # lr * weight_decay
    eps: np.float32

    @classmethod
    def of(cls, hyper: Hyper) -> "AdamWConstants":
        r = float32_of
        return cls(b1=r(hyper.beta1), omb1=r(1 - hyper.beta1), b2=r(hyper.beta2),
                   omb2=r(1 - hyper.beta2), lr=r(hyper.lr), lrwd=r(hyper.lr * hyper.weight_decay),
                   eps=r(hyper.epsilon))


def bias_corrections(hyper: Hyper, t: int) -> tuple:
    """c1, c2 for update number t (1-based): computed in float64, then rounded."""
    b1, b2 = float(hyper.beta1), float(hyper.beta2)
    return f32(1.0 - b1 ** t), f32(1.0 - b2 ** t)


def adamw_update(P, M, V, G, decay_mask, hyper: Hyper, t: int):
    """One update, number t (1-based). P, M, V, G (N,) float32; decay_mask (N,)
    bool. Returns fresh P, M, V."""
    k = AdamWConstants.of(hyper)
    c1, c2 = bias_corrections(hyper, t)
    M = k.b1 * M + k.omb1 * G
    V = k.b2 * V + k.omb2 * G * G
    P = np.where(decay_mask, P - k.lrwd * P, P)  # two-dimensional parameters only
    P = P - k.lr * (M / c1) / (np.sqrt(V / c2) + k.eps)
    return P, M, V
