"""The learner's schedule and clipping (SPEC section 7), against values
written out by hand and against an elementwise float32 update computed here,
independently of coppelius.reference.adamw."""

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius import reference
from coppelius.reference.adamw import (clip_scale, gradient_norm, learning_rates, schedule_factor,
                                       schedule_table)
from coppelius.reference.config import Hyper
from coppelius.reference.errors import ConfigError

CONFIG = reference.preset("test")
COSINE = dict(schedule="cosine", warmup=4, total=20, floor=Fraction(1, 10))


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


# ------------------------------------------------------------------ s(t)

def test_schedule_factor_at_the_landmarks():
    W, N, f = 4, 20, Fraction(1, 10)
    assert schedule_factor(0, W, N, f) == 0.0
    assert schedule_factor(1, W, N, f) == 0.25  # warm-up: t / W, exact in binary
    assert schedule_factor(W, W, N, f) == 1.0  # the peak
    assert schedule_factor(12, W, N, f) == 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi / 2))
    assert abs(schedule_factor(12, W, N, f) - 0.55) < 1e-15  # halfway down: (1 + f) / 2
    assert abs(schedule_factor(N, W, N, f) - 0.1) < 1e-16  # cos(pi) = -1: the floor at N
    assert schedule_factor(N + 1, W, N, f) == 0.1 and schedule_factor(10**6, W, N, f) == 0.1
    # no warm-up: the first update is already on the cosine, just below the peak
    assert schedule_factor(1, 0, 10, 0) == 0.5 * (1.0 + math.cos(math.pi / 10)) < 1.0


@given(st.integers(0, 50), st.integers(1, 200), st.integers(1, 300), st.fractions(0, 1))
def test_schedule_factor_is_monotone_and_bounded(W, span, t, f):
    N = W + span
    s = schedule_factor(t, W, N, f)
    assert 0.0 <= s <= 1.0
    if t > W and t >= 2:  # after the peak it never rises, and never goes below the floor
        assert float(f) - 1e-15 <= s <= schedule_factor(t - 1, W, N, f) + 1e-15


def test_learning_rates_and_the_table():
    constant = Hyper()
    a, b = learning_rates(constant, 7)
    assert (a, b) == (np.float32(3e-4), np.float32(3e-5))  # the rationals rounded once
    assert schedule_table(constant).shape == (1, 2)
    h = Hyper(**COSINE)
    table = schedule_table(h)
    assert table.shape == (h.total + 2, 2) and table.dtype == np.float32
    for t in (1, 4, 5, 12, 20, 21, 5000):  # update t reads row min(t, R - 1)
        s = schedule_factor(t, 4, 20, Fraction(1, 10))
        row = table[min(t, len(table) - 1)]
        assert row[0] == f32(0.0003 * s) and row[1] == f32(0.0003 * 0.1 * s), t


# ------------------------------------------------------------------ the learner identity

def test_identity_adds_schedule_and_clip_only_when_on():
    base = Hyper().identity("fp32")
    assert "schedule" not in base and "clip" not in base
    ident = Hyper(**COSINE, clip=Fraction(1)).identity("bf16")
    assert ident == base.replace("precision=fp32", "precision=bf16") + \
        "|schedule=cosine(warmup=4,total=20,floor=1/10)|clip=1/1"


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="linear"), "schedule='linear'"),
    (dict(warmup=3), "add --schedule cosine"),
    (dict(schedule="cosine", warmup=5, total=5), "total=5: must exceed warmup=5"),
    (dict(schedule="cosine", warmup=-1, total=5), "warmup=-1"),
    (dict(schedule="cosine", warmup=0, total=None), "total=None"),
    (dict(schedule="cosine", warmup=0, total=10**9), "at most"),
    (dict(schedule="cosine", warmup=0, total=9, floor=Fraction(3, 2)), "floor=15/10"),
    (dict(clip=Fraction(0)), "clip=0/1: must be positive"),
    (dict(clip=Fraction(10) ** 50), "clip="),
])
def test_bad_learner_values_are_refused_by_name(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Hyper(**kwargs)


# ------------------------------------------------------------------ clipping

def test_gradient_norm_is_the_float64_sum_rounded():
    G = np.random.default_rng(0).standard_normal(10001).astype(np.float32)
    want = f32(math.sqrt(math.fsum(float(g) * float(g) for g in G)))  # exactly summed
    assert gradient_norm(G) == np.float32(want)


def test_clip_scale():
    h = Hyper(clip=Fraction(1, 2))
    assert clip_scale(Hyper(), np.float32(100)) is None  # off
    assert clip_scale(h, np.float32(0.5)) is None  # n == c: no clip
    assert clip_scale(h, np.float32(2)) == np.float32(0.25)
    assert clip_scale(h, np.float32(3)) == np.float32(f32(0.5 / 3.0))
    assert clip_scale(h, np.float32("nan")) is None and clip_scale(h, np.float32("inf")) is None


def update_by_hand(P, M, V, G, mask, h, t, s=None):
    """SPEC 7 elementwise, with the schedule's a_t, b_t computed here (from
    s(t) when given)."""
    if s is None and h.schedule == "cosine":
        s = schedule_factor(t, h.warmup, h.total, h.floor)
    a = f32(float(h.lr) * s) if s is not None else f32(3e-4)
    b = f32(float(h.lr) * float(h.weight_decay) * s) if s is not None else f32(3e-5)
    b1, omb1, b2, omb2, eps = f32(0.9), f32(0.1), f32(0.95), f32(0.05), f32(1e-8)
    c1, c2 = f32(1.0 - 0.9 ** t), f32(1.0 - 0.95 ** t)
    out = []
    for p, m, v, g, d in zip(P.tolist(), M.tolist(), V.tolist(), G.tolist(), mask.tolist()):
        m = f32(f32(b1 * m) + f32(omb1 * g))
        v = f32(f32(b2 * v) + f32(f32(omb2 * g) * g))
        if d:
            p = f32(p - f32(b * p))
        p = f32(p - f32(f32(a * f32(m / c1)) / f32(f32(math.sqrt(f32(v / c2))) + eps)))
        out.append((p, m, v))
    return [np.array(col, dtype=np.float32) for col in zip(*out)]


@pytest.mark.parametrize("t0", [0, 2, 9, 25])  # warm-up, peak, decay, floor
@pytest.mark.parametrize("clip", [None, "small", "large"])
def test_step_with_schedule_and_clipping_by_hand(t0, clip):
    rng = np.random.default_rng(t0)
    P = reference.initialize(CONFIG)
    state = reference.State(P, rng.standard_normal(P.size).astype(np.float32) * 1e-3,
                            rng.random(P.size).astype(np.float32) * 1e-6, t0)
    tokens = rng.integers(0, CONFIG.vocab, (2, CONFIG.context + 1))
    _, G = reference.loss_and_grads(CONFIG, P, tokens)
    n = f32(math.sqrt(math.fsum(float(g) ** 2 for g in G)))
    c = {None: None, "small": Fraction(n) / 3, "large": Fraction(n) * 2}[clip]
    h = Hyper(**COSINE, clip=c)
    result = reference.step(CONFIG, state, tokens, "fp32", h, grads=True)
    assert result.grad_norm == np.float32(n)
    assert np.array_equal(result.grads, G)  # G is reported before clipping
    used = G * np.float32(f32(float(c) / n)) if clip == "small" else G
    want = update_by_hand(P, state.M, state.V, used, reference.registry(CONFIG).decay_mask(), h,
                          t0 + 1)
    for name, got, w in zip("PMV", (result.state.P, result.state.M, result.state.V), want):
        bad = np.flatnonzero(got.view(np.uint32) != w.view(np.uint32))
        assert bad.size == 0, f"{name}[{bad[0]}]: {got[bad[0]]!r} != {w[bad[0]]!r}"


def test_accumulation_is_part_of_the_learner_identity_and_parsed_back():
    from coppelius.reference.config import ConfigError
    from coppelius.reference.schedule import learner_from_identity

    assert "accumulate" not in Hyper().identity("fp32")  # k = 1: the identity of before
    text = Hyper(accumulate=4).identity("bf16")
    assert text.endswith("|accumulate=4")
    assert learner_from_identity(text) == (Hyper(accumulate=4), "bf16")
    for bad in ("|accumulate=1", "|accumulate=04", "|accumulate=x", "|accumulate=0"):
        with pytest.raises(ConfigError):
            learner_from_identity(Hyper().identity("fp32") + bad)


# ------------------------------------------------------------------ wsd (warm-up, stable, decay)

WSD = dict(schedule="wsd", warmup=2, total=10, decay=3, floor=Fraction(1, 10))


def wsd_exact(t, W, N, D, f) -> Fraction:
    """s(t) of the wsd schedule as an exact rational, from SPEC 7's cases,
    with the floor entering as float(f) (its float64), as the SPEC has it."""
    F = Fraction(float(f))
    if t <= W:
        return Fraction(t, W)
    if t <= N - D:
        return Fraction(1)
    if t <= N:
        return F + (1 - F) * Fraction(N - t, D)
    return F


def wsd_float(t, W, N, D, f) -> float:
    """s(t) as SPEC 7's Python writes it, copied here."""
    if t <= W:
        return t / W
    if t <= N - D:
        return 1.0
    if t <= N:
        return float(f) + (1 - float(f)) * (N - t) / D
    return float(f)


def f32_ulp(x) -> Fraction:
    x = abs(np.float32(x))
    return Fraction(float(np.nextafter(x, np.float32(np.inf)))) - Fraction(float(x))


def test_wsd_at_the_landmarks():
    table = schedule_table(Hyper(**WSD))
    lr = f32(0.0003)
    assert table.shape == (12, 2) and table.dtype == np.float32
    assert table[1, 0] == f32(0.0003 * 0.5) and table[2, 0] == lr  # warm-up: t / W
    assert all(table[t, 0] == lr for t in range(3, 8))  # stable: s = 1.0 for t <= N - D = 7
    assert table[8, 0] == f32(0.0003 * (0.1 + 0.9 * 2 / 3))  # the decay: 2/3 of the way up
    assert table[9, 0] == f32(0.0003 * (0.1 + 0.9 * 1 / 3))
    assert table[10, 0] == table[11, 0] == f32(0.0003 * 0.1)  # the floor at N and after
    assert table[5, 1] == f32(0.0003 * 0.1)  # b_t: lr * weight_decay * s
    # no warm-up and a decay over every update: the first update already decays
    h = Hyper(schedule="wsd", warmup=0, total=4, decay=4)
    assert [float(r) for r in schedule_table(h)[1:, 0]] == [f32(0.0003 * s) for s in
                                                            (0.75, 0.5, 0.25, 0.0, 0.0)]


@given(st.integers(0, 40), st.integers(1, 150), st.data(), st.fractions(0, 1, max_denominator=1000),
       st.fractions(Fraction(1, 10**6), Fraction(1, 10), max_denominator=10**6))
def test_wsd_table_against_the_exact_formula(W, span, data, f, lr):
    N = W + span
    D = data.draw(st.integers(1, span), label="decay")
    h = Hyper(schedule="wsd", warmup=W, total=N, decay=D, floor=f, lr=lr,
              weight_decay=Fraction(1, 10))
    table = schedule_table(h)
    assert table.shape == (N + 2, 2)
    peak = np.float32(float(lr))
    for t in range(1, N + 2):
        a, b = table[t]
        s = wsd_exact(t, W, N, D, f)
        # a_t is float32(float(lr) * s(t)): within half a float32 ulp of the
        # exact product, but for the float64 rounding of s(t) and of the product
        want = Fraction(float(lr)) * s
        assert abs(Fraction(float(a)) - want) <= f32_ulp(a) / 2 + want * Fraction(1, 2**48), t
        want_b = Fraction(float(lr)) * Fraction(0.1) * s
        assert abs(Fraction(float(b)) - want_b) <= f32_ulp(b) / 2 + want_b * Fraction(1, 2**48)
        # and the SPEC's float64 Python, bit for bit
        s64 = wsd_float(t, W, N, D, f)
        assert a == np.float32(float(lr) * s64) and b == np.float32(float(lr) * 0.1 * s64)
        if W < t <= N - D:
            assert a == peak  # the stable phase: lr itself
        if t >= N:
            assert a == table[N + 1, 0]  # the floor from N on
    if f == 0:
        assert table[N, 0] == 0 and table[N + 1, 0] == 0
    rates = table[1:, 0]
    top = max(W, 1)  # the peak: t = W (or t = 1)
    assert np.all(np.diff(rates[:top]) >= 0) and np.all(np.diff(rates[top - 1:]) <= 0)
    # learning_rates(t) beyond the table is the last row
    assert learning_rates(h, N + 1000) == tuple(table[N + 1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(decay=0), r"decay=0: must be an integer in \[1, total - warmup\] = \[1, 8\]"),
    (dict(decay=9), r"decay=9: must be an integer in \[1, total - warmup\] = \[1, 8\]"),
    (dict(decay=None), "decay=None"),
    (dict(decay=True), "decay=True"),
    (dict(decay=2.0), "decay=2.0"),
    (dict(warmup=10), "total=10: must exceed warmup=10"),
    (dict(warmup=-1), "warmup=-1"),
    (dict(total=None), "total=None"),
    (dict(total=10**8, decay=3), "at most"),
    (dict(floor=Fraction(3, 2)), "floor=15/10"),
    (dict(schedule="cosine"), "decay=3: belongs to the wsd schedule"),
    (dict(schedule="constant", warmup=0, total=None, floor=Fraction(0)), "add --schedule wsd"),
])
def test_bad_wsd_values_are_refused_by_name(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Hyper(**{**WSD, **kwargs})


def test_wsd_identity_and_its_parsing_back():
    from coppelius.reference.schedule import learner_from_identity

    h = Hyper(**WSD, clip=Fraction(1, 2))
    ident = h.identity("fp32")
    assert ident == Hyper().identity("fp32") + \
        "|schedule=wsd(warmup=2,total=10,decay=3,floor=1/10)|clip=5/10"
    assert learner_from_identity(ident) == (h, "fp32")
    for bad in ("decay=03", "decay=0", "decay=9", "decay=x"):  # non-canonical or out of range
        with pytest.raises(ConfigError, match="not one this version implements"):
            learner_from_identity(ident.replace("decay=3", bad))
    with pytest.raises(ConfigError):  # wsd's part order is the SPEC's
        learner_from_identity(ident.replace("total=10,decay=3", "decay=3,total=10"))


@pytest.mark.parametrize("t0", [4, 8])  # stable, decay (the table test has the rest)
def test_step_under_wsd_by_hand(t0):
    rng = np.random.default_rng(t0)
    P = reference.initialize(CONFIG)
    state = reference.State(P, rng.standard_normal(P.size).astype(np.float32) * 1e-3,
                            rng.random(P.size).astype(np.float32) * 1e-6, t0)
    tokens = rng.integers(0, CONFIG.vocab, (2, CONFIG.context + 1))
    _, G = reference.loss_and_grads(CONFIG, P, tokens)
    h = Hyper(**WSD)
    s = wsd_float(t0 + 1, 2, 10, 3, Fraction(1, 10))
    result = reference.step(CONFIG, state, tokens, "fp32", h)
    want = update_by_hand(P, state.M, state.V, G, reference.registry(CONFIG).decay_mask(),
                          Hyper(**COSINE), t0 + 1, s=s)
    for name, got, w in zip("PMV", (result.state.P, result.state.M, result.state.V), want):
        bad = np.flatnonzero(got.view(np.uint32) != w.view(np.uint32))
        assert bad.size == 0, f"{name}[{bad[0]}]: {got[bad[0]]!r} != {w[bad[0]]!r}"
