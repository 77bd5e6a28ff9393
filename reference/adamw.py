"""AdamW (SPEC section 7), elementwise in float32 on the flat vectors.

How the exact rationals enter float32 arithmetic (the reading every backend
implements): each coefficient is an exact rational rounded once to float32 —
float32(beta1), float32(1 - beta1), float32(beta2), float32(1 - beta2),
float32(lr), float32(lr * weight_decay), float32(epsilon) — and the bias
corrections c1 = float32(1 - beta1^t), c2 = float32(1 - beta2^t) are
computed in float64, then rounded.

The schedule (SPEC 7) replaces lr and lr * weight_decay by a_t and b_t for
update t. Under "constant" they are float32(lr) and float32(lr *
weight_decay), the exact rationals rounded once, as above; under "cosine"
and "wsd" they are float32(float(lr) * s(t)) and float32(float(lr) *
float(weight_decay) * s(t)), with s(t) evaluated in float64 exactly as the
SPEC's Python. A backend reads them from `schedule_table`, computed here
once: s is constant beyond `total`, so the table is finite and the captured
step needs nothing from the host but its input.
"""

from __future__ import annotations

import math

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


def schedule_factor(t: int, warmup: int, total: int, floor) -> float:
    """s(t) of SPEC 7 for the cosine schedule, float64, written as the SPEC
    writes it (math.cos, not numpy's: the bits must be the SPEC's)."""
    W, N, f = warmup, total, float(floor)
    if t <= W:  # W > 0 here: updates are numbered from 1
        return t / W
    if t > N:
        return f
    return f + (1 - f) * 0.5 * (1.0 + math.cos(math.pi * (t - W) / (N - W)))


def wsd_factor(t: int, warmup: int, total: int, decay: int, floor) -> float:
    """s(t) of SPEC 7 for the wsd schedule (warm-up, stable, decay), float64,
    written as the SPEC writes it: linear up to 1 over the warm-up, 1 until
    update total - decay, linear down to the floor at update total."""
    W, N, D, f = warmup, total, decay, float(floor)
    if t <= W:  # W > 0 here: updates are numbered from 1
        return t / W
    if t <= N - D:
        return 1.0
    if t <= N:
        return f + (1 - f) * (N - t) / D
    return f


def factor(hyper: Hyper, t: int) -> float:
    """s(t) of the learner's schedule (1.0 under "constant")."""
    if hyper.schedule == "cosine":
        return schedule_factor(t, hyper.warmup, hyper.total, hyper.floor)
    if hyper.schedule == "wsd":
        return wsd_factor(t, hyper.warmup, hyper.total, hyper.decay, hyper.floor)
    return 1.0


def learning_rates(hyper: Hyper, t: int) -> tuple:
    """(a_t, b_t) float32: what replaces lr and lr * weight_decay in update t."""
    if hyper.schedule == "constant":
        return float32_of(hyper.lr), float32_of(hyper.lr * hyper.weight_decay)
    s = factor(hyper, t)
    return f32(float(hyper.lr) * s), f32(float(hyper.lr) * float(hyper.weight_decay) * s)


def schedule_table(hyper: Hyper) -> np.ndarray:
    """(R, 2) float32 rows (a_t, b_t); update t reads row min(t, R - 1). One
    row under "constant"; rows 0..total+1 under "cosine" and "wsd" (row 0 is
    never read: t >= 1; row total+1 holds the floor, for every later t)."""
    if hyper.schedule == "constant":
        return np.array([learning_rates(hyper, 1)], dtype=np.float32)
    return np.array([learning_rates(hyper, t) if t else (0.0, 0.0)
                     for t in range(hyper.total + 2)], dtype=np.float32)


def gradient_norm(G: np.ndarray) -> np.float32:
    """n = sqrt(sum g^2) over every element of G (the tied embedding once:
    it has one gradient), summed in float64 and rounded to float32 (SPEC 7).
    A backend may sum in float32 in any order."""
    G64 = G.astype(np.float64)
    return f32(math.sqrt(float(np.dot(G64, G64))))


def clip_scale(hyper: Hyper, norm) -> np.float32 | None:
    """float32(c / n) when clipping is on and n > c, else None (no scaling).
    Reading: the quotient is float(c) / float(n) in float64, rounded once to
    float32; a non-finite n never clips (the run stops on it anyway)."""
    if hyper.clip is None or not np.isfinite(norm) or not float(norm) > float(hyper.clip):
        return None
    return f32(float(hyper.clip) / float(norm))


def bias_corrections(hyper: Hyper, t: int) -> tuple:
    """c1, c2 for update number t (1-based): computed in float64, then rounded."""
    b1, b2 = float(hyper.beta1), float(hyper.beta2)
    return f32(1.0 - b1 ** t), f32(1.0 - b2 ** t)


def adamw_update(P, M, V, G, decay_mask, hyper: Hyper, t: int):
    """One update, number t (1-based). P, M, V, G (N,) float32 (G already
    clipped); decay_mask (N,) bool. Returns fresh P, M, V."""
    k = AdamWConstants.of(hyper)
    c1, c2 = bias_corrections(hyper, t)
    a, b = learning_rates(hyper, t)  # lr and lr * weight_decay under the schedule
    M = k.b1 * M + k.omb1 * G
    V = k.b2 * V + k.omb2 * G * G
    P = np.where(decay_mask, P - b * P, P)  # two-dimensional parameters only
    P = P - a * (M / c1) / (np.sqrt(V / c2) + k.eps)
    return P, M, V
