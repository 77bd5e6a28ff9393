"""AdamW (SPEC section 7), against the update written out here one scalar at
a time in pure Python: exact rationals (Fraction) rounded once to float32
for the coefficients, and each float32 operation emulated as a float64
operation rounded to float32 (exact for + - * / sqrt of float32 operands,
since float64 carries more than twice float32's precision).

The coefficient reading is the reference's (reference/adamw.py): every
coefficient, including 1 - beta1, 1 - beta2 and lr * weight_decay, is its
exact rational rounded once to float32; c1 and c2 are computed in float64,
then rounded.
"""

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius import reference
from coppelius.reference.adamw import AdamWConstants, adamw_update, bias_corrections
from coppelius.reference.config import Hyper

CONFIG = reference.preset("test")


def f32(x):
    """Round a float64 to the nearest float32 (struct packs with the C cast)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_of_fraction(q):
    """The float32 nearest to the exact rational q, ties to even (integer
    arithmetic: no intermediate float64 rounding)."""
    q = Fraction(q)
    if q == 0:
        return 0.0
    sign, q = (-1 if q < 0 else 1), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()  # 2^e <= q < 2^(e+2)
    if Fraction(2) ** e > q:
        e -= 1
    e = max(e, -126)  # subnormals share the smallest normal exponent
    scaled = q / Fraction(2) ** (e - 23)  # 24-bit significand, fraction below
    m, rem = divmod(scaled.numerator, scaled.denominator)
    if 2 * rem > scaled.denominator or (2 * rem == scaled.denominator and m % 2 == 1):
        m += 1
    return sign * math.ldexp(m, e - 23)


def coefficients(h):
    return dict(b1=f32_of_fraction(h.beta1), omb1=f32_of_fraction(1 - h.beta1),
                b2=f32_of_fraction(h.beta2), omb2=f32_of_fraction(1 - h.beta2),
                lr=f32_of_fraction(h.lr), lrwd=f32_of_fraction(h.lr * h.weight_decay),
                eps=f32_of_fraction(h.epsilon))


def update_one(p, m, v, g, decay, h, t):
    """One element of update number t, float32 operations in the SPEC's order."""
    k = coefficients(h)
    c1 = f32(1.0 - float(h.beta1) ** t)  # float64, then rounded (SPEC 7)
    c2 = f32(1.0 - float(h.beta2) ** t)
    m = f32(f32(k["b1"] * m) + f32(k["omb1"] * g))
    v = f32(f32(k["b2"] * v) + f32(f32(k["omb2"] * g) * g))
    if decay:
        p = f32(p - f32(k["lrwd"] * p))
    step = f32(f32(k["lr"] * f32(m / c1)) / f32(f32(math.sqrt(f32(v / c2))) + k["eps"]))
    return f32(p - step), m, v


def update_all(P, M, V, G, mask, h, t):
    out = [update_one(float(p), float(m), float(v), float(g), bool(d), h, t)
           for p, m, v, g, d in zip(P, M, V, G, mask)]
    return tuple(np.array(col, dtype=np.float32) for col in zip(*out))


def assert_bits_equal(name, got, want):
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{name}[{bad[0]}]: {got[bad[0]]!r} != {want[bad[0]]!r} "
                           f"({bad.size} elements differ)")


# ---------------------------------------------------------------- coefficients
def test_default_coefficients_are_the_exact_rationals_rounded_once():
    k = AdamWConstants.of(Hyper())
    want = coefficients(Hyper())
    for name, value in want.items():
        got = getattr(k, name)
        assert isinstance(got, np.float32), name
        assert float(got) == value, f"{name}: {float(got)!r}, float32 of the rational {value!r}"
    # the once-rounded 1 - beta1 is not 1 - float32(beta1): the reading matters
    assert float(k.omb1) == f32_of_fraction(Fraction(1, 10)) != f32(1.0 - f32(0.9))


def test_coefficient_rounding_has_no_double_rounding():
    """float32(a/b) of SPEC 7 is the rational's nearest float32. Going through
    float64 first rounds 1 + 2^-24 + 2^-60 to the float32 tie 1 + 2^-24 and
    then to even (1.0); the nearest float32 is 1 + 2^-23."""
    lr = Fraction(2**60 + 2**36 + 1, 2**60)
    assert f32_of_fraction(lr) == 1.0 + 2.0**-23
    k = AdamWConstants.of(Hyper(lr=lr))
    assert float(k.lr) == 1.0 + 2.0**-23, f"lr = {lr} became {float(k.lr)!r}"


@pytest.mark.parametrize("t", [1, 2, 3, 10, 1000])
def test_bias_corrections(t):
    h = Hyper()
    c1, c2 = bias_corrections(h, t)
    assert isinstance(c1, np.float32) and isinstance(c2, np.float32)
    # float64 then float32 equals the exact rational rounded once for these t
    assert float(c1) == f32_of_fraction(1 - h.beta1 ** t)
    assert float(c2) == f32_of_fraction(1 - h.beta2 ** t)


# ---------------------------------------------------------------- one update by hand
def test_first_update_by_hand():
    """t = 1 from zero moments: m = (1-b1) g, v = (1-b2) g^2, so m/c1 ~ g and
    sqrt(v/c2) ~ |g|: each parameter moves by ~lr * sign(g) (plus decay)."""
    h = Hyper()
    P = np.array([0.5, -0.25, 1.0, 2.0], np.float32)
    G = np.array([0.125, -2.0, 0.0, 1e-3], np.float32)
    mask = np.array([True, True, False, False])
    Z = np.zeros(4, np.float32)
    P1, M1, V1 = adamw_update(P, Z, Z, G, mask, h, 1)
    assert P1.dtype == M1.dtype == V1.dtype == np.float32
    want = update_all(P, Z, Z, G, mask, h, 1)
    for name, got, w in zip("PMV", (P1, M1, V1), want):
        assert_bits_equal(name, got, w)
    # and against the real-number formula: within a few float32 ulps
    lr, wd = float(h.lr), float(h.weight_decay)
    for i in range(4):
        decayed = float(P[i]) * (1 - lr * wd) if mask[i] else float(P[i])
        g = float(G[i])
        exact = decayed - lr * g / (abs(g) + float(h.epsilon)) if g else decayed
        assert abs(float(P1[i]) - exact) <= 4 * abs(float(np.spacing(np.float32(exact)))), i
    assert float(P1[2]) == 1.0  # a norm weight with g = 0 does not move


def test_third_update_by_hand():
    """t = 3 with moments from two earlier steps: the bias corrections of t = 3."""
    h = Hyper()
    rng = np.random.default_rng(5)
    P = rng.standard_normal(64).astype(np.float32)
    M = (rng.standard_normal(64) * 1e-2).astype(np.float32)
    V = (rng.random(64) * 1e-4).astype(np.float32)
    G = (rng.standard_normal(64) * 1e-2).astype(np.float32)
    mask = rng.random(64) < 0.5
    got = adamw_update(P, M, V, G, mask, h, 3)
    want = update_all(P, M, V, G, mask, h, 3)
    for name, a, b in zip("PMV", got, want):
        assert_bits_equal(name, a, b)
    # t matters: the update with t = 1 is a different one
    assert not np.array_equal(adamw_update(P, M, V, G, mask, h, 1)[0], got[0])


@given(p=st.floats(-4, 4, width=32), m=st.floats(-1, 1, width=32), v=st.floats(0, 1, width=32),
       g=st.floats(-1, 1, width=32), decay=st.booleans(), t=st.integers(1, 50),
       lr=st.fractions(Fraction(1, 10**6), Fraction(1, 10)), wd=st.fractions(0, 1))
def test_update_matches_the_written_out_formula(p, m, v, g, decay, t, lr, wd):
    h = Hyper(lr=lr, weight_decay=wd)
    arr = lambda x: np.array([x], np.float32)  # noqa: E731
    got = adamw_update(arr(p), arr(m), arr(v), arr(g), np.array([decay]), h, t)
    want = update_one(p, m, v, g, decay, h, t)
    for name, a, b in zip("PMV", got, want):
        assert a.dtype == np.float32
        assert_bits_equal(name, a, arr(b))


def test_weight_decay_only_on_two_dimensional_parameters():
    """G = 0 and fresh moments: the Adam step is exactly 0, so a norm weight or
    bias does not move and a matrix shrinks by exactly float32(lr*wd) * p."""
    h = Hyper()
    reg = reference.registry(CONFIG)
    P = np.random.default_rng(6).standard_normal(reg.total).astype(np.float32)
    Z = np.zeros_like(P)
    P1, M1, V1 = adamw_update(P, Z, Z, Z, reg.decay_mask(), h, 1)
    lrwd = np.float32(f32_of_fraction(h.lr * h.weight_decay))
    assert (M1 == 0).all() and (V1 == 0).all()
    for spec in reg.specs:
        got, p = P1[spec.slice], P[spec.slice]
        want = (p - lrwd * p) if len(spec.shape) == 2 else p
        assert_bits_equal(spec.name, got, want.astype(np.float32))
        if len(spec.shape) == 2:
            assert (np.abs(got) < np.abs(p)).all(), spec.name  # it does shrink


# ---------------------------------------------------------------- through the step
def test_step_advances_the_update_count_and_applies_update_t_plus_one():
    tokens = np.random.default_rng(20260925).integers(0, CONFIG.vocab, (2, CONFIG.context + 1))
    reg = reference.registry(CONFIG)
    state = reference.State.fresh(reference.initialize(CONFIG))
    r1 = reference.step(CONFIG, state, tokens, "fp32", grads=True)
    assert r1.state.t == 1
    r2 = reference.step(CONFIG, r1.state, tokens, "fp32", grads=True)
    r3 = reference.step(CONFIG, r2.state, tokens, "fp32", grads=True)
    assert (r2.state.t, r3.state.t) == (2, 3)
    # the third step is update number 3 applied to its own gradient
    s = r2.state
    idx = np.random.default_rng(7).choice(reg.total, 200, replace=False)
    mask = reg.decay_mask()
    want = update_all(s.P[idx], s.M[idx], s.V[idx], r3.grads[idx], mask[idx], Hyper(), 3)
    for name, w in zip("PMV", want):
        assert_bits_equal(name, getattr(r3.state, name)[idx], w)


def test_step_uses_its_hyperparameters():
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab, (1, CONFIG.context + 1))
    state = reference.State.fresh(reference.initialize(CONFIG))
    a = reference.step(CONFIG, state, tokens, "fp32", Hyper())
    b = reference.step(CONFIG, state, tokens, "fp32", Hyper(lr=Fraction(1, 1000)))
    moved_a = np.abs(a.state.P - state.P).max()
    moved_b = np.abs(b.state.P - state.P).max()
    assert moved_b > 3 * moved_a  # ~lr per step on the first update
