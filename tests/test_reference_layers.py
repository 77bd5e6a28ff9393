"""Each reference layer, forward and backward, on hypothesis-drawn shapes and
values (SPEC sections 3, 4, 5, and the family's layers of section 21:
RMSNorm, partial rotary, the biased q/k/v products, grouped-query attention).

Every forward is compared with the same formula written independently here
in float64 (per-row and per-head loops, math.fsum, complex rotation), once
with the reference running in float32 and once in float64. Every backward
is checked as a vector-Jacobian product against central finite differences
of the reference forward in float64,
    <dout, (f(x + h e) - f(x - h e)) / 2h>  ==  <dx, e>   for random e
(a 4-point stencil of the same), and, where the derivative has a short
closed form, against that formula.
"""

import functools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.config import LAYERNORM_EPS, ROPE_BASE
from coppelius.reference.layers.attention import attention_backward, attention_forward
from coppelius.reference.layers.crossentropy import crossentropy_backward, crossentropy_forward
from coppelius.reference.layers.embedding import embedding_backward, embedding_forward
from coppelius.reference.layers.layernorm import layernorm_backward, layernorm_forward
from coppelius.reference.layers.linear import (linear_backward, linear_bias_backward,
                                               linear_bias_forward, linear_forward)
from coppelius.reference.layers.rmsnorm import rmsnorm_backward, rmsnorm_forward
from coppelius.reference.layers.rope import rope_backward, rope_forward, rope_tables
from coppelius.reference.layers.swiglu import swiglu_backward, swiglu_forward
from coppelius.reference.model import _attention_backward, _attention_forward

EPS = float(LAYERNORM_EPS)

# Tolerances, one table. Errors are measured relative to the largest
# magnitude of the expected tensor (`scale`), so a tolerance reads as "so
# many units of float32/float64 precision of the output's size".
#   f32: the reference in float32 against the float64 formula; a few hundred
#        float32 ulps (2^-24 = 6e-8) leave room for sums over <= 64 terms and
#        the 1/sqrt(var + eps) of a near-constant row.
#   f64: the reference in float64 against the float64 formula: the same
#        maths in another order, so only a few hundred float64 ulps.
#   fd:  4-point central differences in float64 with h = 1e-6 (inputs are
#        1e-3 .. 10; the sharpest curvature, a layernorm row with var ~ 0,
#        has scale sqrt(eps) = 3e-3): truncation ~(h/3e-3)^4 = 1e-14; the
#        rounding of f magnified by 1/h is a separate, absolute floor.
#        Relative to the magnitude of the directional derivative's terms,
#        1e-6 is far below any real error (O(1)).
#   closed: the reference backward against a closed-form derivative, float64.
TOL = {"f32": 2e-5, "f64": 1e-12, "fd": 1e-6, "closed": 1e-12}
H_FD = 1e-6


def assert_close(name, got, want, tol, scale=None):
    """max |got - want| <= tol * scale, scale = max |want| unless given (the
    size an error is measured against); names the worst element."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    if scale is None:
        scale = float(np.abs(want).max(initial=0.0))
    scale = max(scale, 1e-30)
    err = np.abs(got - want)
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    assert err.size == 0 or err[worst] <= tol * scale, (
        f"{name}: worst element {worst}: {got[worst]!r} vs {want[worst]!r}, "
        f"error {err[worst]:.3e} > {tol:g} * scale {scale:.3e}")


def vjp_check(name, f, inputs, grads, dout, rng):
    """Directional check of each gradient: for a random direction e of input
    i, <dout, J e> by a 4-point central difference must equal <grads[i], e>."""
    for i, (x, g) in enumerate(zip(inputs, grads)):
        # float64 rounding of f, magnified by 1/h: the floor below which a
        # difference quotient cannot resolve anything (intermediates of f are
        # at most the size of its inputs or outputs)
        size = max(float(np.abs(f(*inputs)).max(initial=0.0)), float(np.abs(x).max(initial=0.0)))
        roundoff = 100 * np.finfo(np.float64).eps * float(np.abs(dout).sum()) * size / H_FD
        for _ in range(2):
            e = rng.standard_normal(x.shape)
            at = functools.partial(shifted, f, inputs, i, e)
            df = (8 * (at(H_FD) - at(-H_FD)) - (at(2 * H_FD) - at(-2 * H_FD))) / (12 * H_FD)  # O(h^4)
            terms = dout * df
            fd, analytic = math.fsum(terms.ravel()), math.fsum((g * e).ravel())
            scale = math.fsum(np.abs(terms).ravel())  # no credit for cancellation
            assert abs(fd - analytic) <= TOL["fd"] * scale + roundoff, (
                f"{name}: input {i}: <dout, J e> by finite differences {fd!r}, "
                f"<grad, e> {analytic!r}, error {abs(fd - analytic):.3e}, scale {scale:.3e}, "
                f"roundoff {roundoff:.1e}")


def shifted(f, inputs, i, e, t):
    """f with input i moved by t * e."""
    return f(*[x + t * e if j == i else x for j, x in enumerate(inputs)])


def values(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)


seeds = st.integers(0, 2**32 - 1)
scales = st.sampled_from([1e-3, 0.1, 1.0, 4.0])


# ---------------------------------------------------------------- embedding
def embedding_naive(ids, W):
    B, T = ids.shape
    return np.array([[W[ids[b, t]] for t in range(T)] for b in range(B)])


def embedding_backward_naive(dx, ids, V):
    dW = np.zeros((V, dx.shape[-1]))
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            dW[ids[b, t]] += dx[b, t]
    return dW


@given(B=st.integers(1, 3), T=st.integers(1, 8), V=st.integers(1, 6), D=st.integers(1, 8), seed=seeds)
def test_embedding(B, T, V, D, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (B, T))  # V small: ids repeat, which the backward must accumulate
    W = values(rng, (V, D), 1.0)
    for dtype in (np.float32, np.float64):
        x = embedding_forward(ids, W.astype(dtype))
        assert x.dtype == dtype
        np.testing.assert_array_equal(x, embedding_naive(ids, W))  # a gather is exact
    dx = values(rng, (B, T, D), 1.0)
    dW = embedding_backward(dx.astype(np.float32), ids, V)
    assert dW.shape == (V, D) and dW.dtype == np.float32
    assert_close("embedding dW f32", dW, embedding_backward_naive(dx, ids, V), TOL["f32"])
    dW = embedding_backward(dx, ids, V)
    assert_close("embedding dW", dW, embedding_backward_naive(dx, ids, V), TOL["closed"])
    vjp_check("embedding", lambda W: embedding_forward(ids, W), [W], [dW], dx, rng)


# ---------------------------------------------------------------- layernorm
def layernorm_naive(x, w, b):
    out = np.empty_like(x, dtype=np.float64)
    D = x.shape[-1]
    for r, row in zip(np.ndindex(x.shape[:-1]), x.reshape(-1, D)):
        mu = math.fsum(row) / D
        var = math.fsum((v - mu) ** 2 for v in row) / D  # biased
        out[r] = [(v - mu) / math.sqrt(var + EPS) * w[i] + b[i] for i, v in enumerate(row)]
    return out


def layernorm_dx_by_jacobian(x, w, dout):
    """dx = J^T dout with the explicit Jacobian of one row,
    J[i, j] = w[i] rstd (delta_ij - 1/D - xhat_i xhat_j / D)."""
    D = x.shape[-1]
    dx = np.empty_like(x, dtype=np.float64)
    for r in np.ndindex(x.shape[:-1]):
        row = x[r]
        mu = row.mean()
        rstd = 1.0 / math.sqrt(((row - mu) ** 2).mean() + EPS)
        xhat = (row - mu) * rstd
        J = w[:, None] * rstd * (np.eye(D) - 1.0 / D - np.outer(xhat, xhat) / D)
        dx[r] = J.T @ dout[r]
    return dx


@given(B=st.integers(1, 3), T=st.integers(1, 5), D=st.integers(1, 16), scale=scales, seed=seeds,
       constant_row=st.booleans())
def test_layernorm(B, T, D, scale, seed, constant_row):
    rng = np.random.default_rng(seed)
    x = values(rng, (B, T, D), scale)
    if constant_row:
        x[0, 0] = x[0, 0, 0]  # var = 0: only eps keeps the row finite
    w, b = values(rng, (D,), 1.0), values(rng, (D,), 1.0)
    want = layernorm_naive(x, w, b)
    out32, _ = layernorm_forward(*(a.astype(np.float32) for a in (x, w, b)), EPS)
    assert out32.dtype == np.float32
    # float32 rounds x - mu to ~2^-24 |x|, and 1/sqrt(var + eps) magnifies
    # that up to 1/sqrt(eps) = 316 times (a constant row): the error is
    # measured against |x| / sqrt(var + eps) |w| + |b|, not against |out|
    rstd = 1.0 / np.sqrt(x.var(-1) + EPS)  # (B,T)
    scale = float((np.abs(x).max(-1) * rstd).max() * np.abs(w).max() + np.abs(b).max())
    assert_close("layernorm f32", out32, want, TOL["f32"], scale=scale)
    out, cache = layernorm_forward(x, w, b, EPS)
    assert_close("layernorm f64", out, want, TOL["f64"])

    dout = values(rng, (B, T, D), 1.0)
    dx, dw, db = layernorm_backward(dout, cache)
    # dx is a difference of terms of size |w| rstd |dout| that can cancel to
    # far less (a row of two features): the error is measured against them
    terms = float(np.abs(w).max() * rstd.max() * np.abs(dout).max())
    assert_close("layernorm dx (Jacobian)", dx, layernorm_dx_by_jacobian(x, w, dout), 1e-10,
                 scale=terms)
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS)
    assert_close("layernorm dw", dw, (dout * xhat).sum((0, 1)), 1e-10)
    assert_close("layernorm db", db, dout.sum((0, 1)), TOL["closed"])
    vjp_check("layernorm", lambda x, w, b: layernorm_forward(x, w, b, EPS)[0], [x, w, b], [dx, dw, db],
              dout, rng)


# ---------------------------------------------------------------- rmsnorm (SPEC 21)
def rmsnorm_naive(x, w, eps=EPS):
    """y = x / sqrt(mean(x^2) + eps) * w per row, math.fsum in float64."""
    out = np.empty_like(x, dtype=np.float64)
    D = x.shape[-1]
    for r, row in zip(np.ndindex(x.shape[:-1]), x.reshape(-1, D)):
        ms = math.fsum(v * v for v in row) / D
        out[r] = [v / math.sqrt(ms + eps) * w[i] for i, v in enumerate(row)]
    return out


def rmsnorm_dx_by_jacobian(x, w, dout, eps=EPS):
    """dx = J^T dout with the explicit Jacobian of one row: y_i = w_i x_i r,
    r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / D, so
    J[i, j] = w[i] r (delta_ij - xhat_i xhat_j / D) with xhat = x r."""
    D = x.shape[-1]
    dx = np.empty_like(x, dtype=np.float64)
    for r in np.ndindex(x.shape[:-1]):
        row = x[r]
        rstd = 1.0 / math.sqrt((row * row).mean() + eps)
        xhat = row * rstd
        J = w[:, None] * rstd * (np.eye(D) - np.outer(xhat, xhat) / D)
        dx[r] = J.T @ dout[r]
    return dx


@given(B=st.integers(1, 3), T=st.integers(1, 5), D=st.integers(1, 16), scale=scales, seed=seeds,
       near_zero_row=st.booleans(), eps=st.sampled_from([EPS, 1e-6, 3 / 7]))
def test_rmsnorm(B, T, D, scale, seed, near_zero_row, eps):
    rng = np.random.default_rng(seed)
    x = values(rng, (B, T, D), scale)
    if near_zero_row:
        x[0, 0] *= 1e-4 / scale  # mean(x^2) ~ 1e-8, far below eps: eps decides the row
    w = values(rng, (D,), 1.0)
    want = rmsnorm_naive(x, w, eps)
    out32, _ = rmsnorm_forward(x.astype(np.float32), w.astype(np.float32), eps)
    assert out32.dtype == np.float32
    # as layernorm's: the error is measured against |x| / sqrt(mean(x^2) + eps) |w|
    rstd = 1.0 / np.sqrt((x * x).mean(-1) + eps)  # (B,T)
    assert_close("rmsnorm f32", out32, want, TOL["f32"],
                 scale=float((np.abs(x).max(-1) * rstd).max() * np.abs(w).max()))
    out, cache = rmsnorm_forward(x, w, eps)
    assert_close("rmsnorm f64", out, want, TOL["f64"])
    # no mean is subtracted: a constant row is not sent to zero, as layernorm's is
    c = np.full((1, 1, D), 2.0)
    assert_close("rmsnorm of a constant row", rmsnorm_forward(c, w, eps)[0],
                 rmsnorm_naive(c, w, eps), TOL["f64"])

    dout = values(rng, (B, T, D), 1.0)
    dx, dw = rmsnorm_backward(dout, cache)
    assert dx.shape == x.shape and dw.shape == w.shape
    # measured against the size of dx's terms, rstd |dout w|: with D = 1 they
    # nearly cancel (xhat^2 = 1 - eps rstd^2) and dx is far smaller than each
    terms = float((rstd[..., None] * np.abs(dout * w)).max())
    assert_close("rmsnorm dx (Jacobian)", dx, rmsnorm_dx_by_jacobian(x, w, dout, eps), 1e-10,
                 scale=terms)
    xhat = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    assert_close("rmsnorm dw", dw, (dout * xhat).sum((0, 1)), 1e-10)
    vjp_check("rmsnorm", lambda x, w: rmsnorm_forward(x, w, eps)[0], [x, w], [dx, dw], dout, rng)
    dx32, dw32 = rmsnorm_backward(dout.astype(np.float32),
                                  rmsnorm_forward(x.astype(np.float32), w.astype(np.float32),
                                                  eps)[1])
    assert dx32.dtype == dw32.dtype == np.float32
    # float32 dx: rstd (up to 1/sqrt(eps)) times sums of D terms of |dout w|
    assert_close("rmsnorm dx f32", dx32, dx, TOL["f32"],
                 scale=float(rstd.max() * np.abs(dout).max() * np.abs(w).max()) * 2)
    assert_close("rmsnorm dw f32", dw32, dw, TOL["f32"],
                 scale=float(np.abs(dout).sum((0, 1)).max() * 2))


# ---------------------------------------------------------------- linear
def linear_naive(x, W):
    N, n_in = x.reshape(-1, x.shape[-1]).shape
    rows = x.reshape(N, n_in)
    y = np.array([[math.fsum(rows[n, i] * W[o, i] for i in range(n_in)) for o in range(W.shape[0])]
                  for n in range(N)])
    return y.reshape(*x.shape[:-1], W.shape[0])


def bf16(a):
    """Round float32 values to bfloat16 (ml_dtypes' cast; test_precision checks it)."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@given(B=st.integers(1, 3), T=st.integers(1, 5), n_in=st.integers(1, 12), n_out=st.integers(1, 12),
       scale=scales, seed=seeds)
def test_linear(B, T, n_in, n_out, scale, seed):
    rng = np.random.default_rng(seed)
    x, W = values(rng, (B, T, n_in), scale), values(rng, (n_out, n_in), 0.5)
    want = linear_naive(x, W)
    y32, _ = linear_forward(x.astype(np.float32), W.astype(np.float32), "fp32")
    assert y32.dtype == np.float32
    # measured against sum_i |x_i W_oi| rather than |y|: a dot product may cancel
    assert_close("linear f32", y32, want, TOL["f32"], scale=float((np.abs(x) @ np.abs(W).T).max()))
    y, cache = linear_forward(x, W, "fp32")
    assert_close("linear f64", y, want, 1e-10)

    dy = values(rng, (B, T, n_out), 1.0)
    dx, dW = linear_backward(dy, cache, "fp32")
    assert dx.shape == x.shape and dW.shape == W.shape
    assert_close("linear dx", dx, linear_naive(dy, W.T), 1e-10)
    assert_close("linear dW", dW, linear_naive(dy.reshape(-1, n_out).T, x.reshape(-1, n_in).T), 1e-10)
    vjp_check("linear", lambda x, W: linear_forward(x, W, "fp32")[0], [x, W], [dx, dW], dy, rng)


@given(N=st.integers(1, 12), n_in=st.integers(1, 12), n_out=st.integers(1, 12), scale=scales, seed=seeds)
def test_linear_bf16_rounds_each_operand(N, n_in, n_out, scale, seed):
    """Under bf16 each operand of each product is rounded, the product is
    accumulated in float32 (SPEC 6). Products of two bfloat16 values are exact
    in float32, so the float64 product of rounded operands differs only by
    the float32 accumulation."""
    rng = np.random.default_rng(seed)
    x, W, dy = (values(rng, s, scale) for s in ((N, n_in), (n_out, n_in), (N, n_out)))
    x32, W32, dy32 = (a.astype(np.float32) for a in (x, W, dy))
    y, cache = linear_forward(x32, W32, "bf16")
    dx, dW = linear_backward(dy32, cache, "bf16")
    assert y.dtype == dx.dtype == dW.dtype == np.float32
    for name, got, want, a, b in [("y", y, bf16(x) @ bf16(W).T, x, W.T), ("dx", dx, bf16(dy) @ bf16(W), dy, W),
                                  ("dW", dW, bf16(dy).T @ bf16(x), dy.T, x)]:
        bound = np.abs(bf16(a)) @ np.abs(bf16(b))  # accumulation error scales with sum |a_i b_i|
        err = np.abs(got - want)
        assert (err <= 1e-6 * bound + 1e-30).all(), f"linear bf16 {name}: error {err.max():.3e}"


@given(B=st.integers(1, 3), T=st.integers(1, 5), n_in=st.integers(1, 12), n_out=st.integers(1, 12),
       scale=scales, seed=seeds)
def test_linear_bias(B, T, n_in, n_out, scale, seed):
    """y = x @ W.T + b (q, k, v under qkv_bias, SPEC 21); db is the sum of dy
    over every row."""
    rng = np.random.default_rng(seed)
    x, W, b = values(rng, (B, T, n_in), scale), values(rng, (n_out, n_in), 0.5), values(rng, (n_out,), 1.0)
    want = linear_naive(x, W) + b
    y32, _ = linear_bias_forward(x.astype(np.float32), W.astype(np.float32), b.astype(np.float32), "fp32")
    assert y32.dtype == np.float32
    bound = float((np.abs(x) @ np.abs(W).T).max() + np.abs(b).max())
    assert_close("linear_bias f32", y32, want, TOL["f32"], scale=bound)
    y, cache = linear_bias_forward(x, W, b, "fp32")
    assert_close("linear_bias f64", y, want, 1e-10, scale=bound)

    dy = values(rng, (B, T, n_out), 1.0)
    dx, dW, db = linear_bias_backward(dy, cache, "fp32")
    assert dx.shape == x.shape and dW.shape == W.shape and db.shape == b.shape
    assert_close("linear_bias dx", dx, linear_naive(dy, W.T), 1e-10)
    assert_close("linear_bias dW", dW, linear_naive(dy.reshape(-1, n_out).T, x.reshape(-1, n_in).T), 1e-10)
    rows = dy.reshape(-1, n_out)
    assert_close("linear_bias db", db, [math.fsum(rows[:, o]) for o in range(n_out)], TOL["closed"])
    vjp_check("linear_bias", lambda x, W, b: linear_bias_forward(x, W, b, "fp32")[0], [x, W, b],
              [dx, dW, db], dy, rng)


@given(N=st.integers(1, 8), n_in=st.integers(1, 12), n_out=st.integers(1, 12), seed=seeds)
def test_linear_bias_bf16_rounds_the_product_operands_and_not_the_bias(N, n_in, n_out, seed):
    """SPEC 6: only a product's operands are rounded; the bias is added in
    float32 after the product. A bias of 1 + 2^-12 (and such) is no bfloat16
    value: rounded, it would move y by ~2^-12, far beyond the accumulation
    error allowed here."""
    rng = np.random.default_rng(seed)
    x, W = values(rng, (N, n_in), 1.0), values(rng, (n_out, n_in), 0.5)
    b = (1.0 + rng.integers(1, 128, n_out) * 2.0**-14) * rng.choice([-1, 1], n_out)  # float32-exact
    y, cache = linear_bias_forward(x.astype(np.float32), W.astype(np.float32), b.astype(np.float32), "bf16")
    assert y.dtype == np.float32
    product = bf16(x) @ bf16(W).T
    bound = np.abs(bf16(x)) @ np.abs(bf16(W)).T + np.abs(b)  # float32 accumulation and add
    err = np.abs(y - (product + b))
    assert (err <= 1e-6 * bound).all(), f"linear_bias bf16 y: error {err.max():.3e}"
    assert (np.abs(y - (product + bf16(b))) > 1e-5).any()  # the bias was not rounded
    dy = values(rng, (N, n_out), 1.0)
    _, _, db = linear_bias_backward(dy.astype(np.float32), cache, "bf16")
    # db is a sum, not a product: float32, no bfloat16 rounding of dy
    assert_close("linear_bias bf16 db", db, dy.sum(0), TOL["f32"], scale=float(np.abs(dy).sum(0).max()))


# ---------------------------------------------------------------- rope
def rope_tables_naive(T, E):
    """cos, sin (T, E/2) of theta = t * base^(-2j/E): math module in float64, then float32."""
    theta = [[t * ROPE_BASE ** (-2.0 * j / E) for j in range(E // 2)] for t in range(T)]
    cos = np.array([[math.cos(a) for a in row] for row in theta], dtype=np.float64).astype(np.float32)
    sin = np.array([[math.sin(a) for a in row] for row in theta], dtype=np.float64).astype(np.float32)
    return cos, sin


def rope_complex(x, cos, sin):
    """Half-split pairs as complex numbers: z_j = x_j + i x_{j+E/2}, out = z e^{i theta}."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]  # (B,T,H,E/2)
    rot = (cos.astype(np.float64) + 1j * sin.astype(np.float64))[:, None, :]  # (T,1,E/2)
    out = z * rot
    return np.concatenate([out.real, out.imag], axis=-1)


def test_rope_tables_are_float64_rounded_to_float32():
    for T, E in [(1024, 64), (256, 32), (16, 16), (3, 2)]:  # the presets' shapes and small ones
        cos, sin = rope_tables(T, E)
        assert cos.dtype == sin.dtype == np.float32 and cos.shape == (T, E // 2)
        want_cos, want_sin = rope_tables_naive(T, E)
        # bit for bit: a last-place difference of libm in float64 almost never
        # survives the rounding to float32; allow at most one such element
        assert (cos != want_cos).sum() + (sin != want_sin).sum() <= 1, (T, E)


@given(B=st.integers(1, 2), T=st.integers(1, 8), H=st.integers(1, 3), half=st.integers(1, 4),
       scale=scales, seed=seeds)
def test_rope(B, T, H, half, scale, seed):
    E = 2 * half
    rng = np.random.default_rng(seed)
    x = values(rng, (B, T, H, E), scale)
    cos, sin = rope_tables(T, E)
    want = rope_complex(x, cos, sin)
    out32 = rope_forward(x.astype(np.float32), cos, sin)
    assert out32.dtype == np.float32
    assert_close("rope f32", out32, want, TOL["f32"])
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    assert_close("rope f64", rope_forward(x, c64, s64), want, TOL["f64"])
    # position 0 is the identity rotation
    np.testing.assert_array_equal(rope_forward(x, c64, s64)[:, 0], x[:, 0])

    dout = values(rng, (B, T, H, E), 1.0)
    dx = rope_backward(dout, c64, s64)
    # the rotation is unitary: dx = conj(e^{i theta}) dout, a rotation by -theta
    assert_close("rope dx", dx, rope_complex(dout, cos, -sin), TOL["closed"] * 10)
    vjp_check("rope", lambda x: rope_forward(x, c64, s64), [x], [dx], dout, rng)


def rope_tables_base(T, R, base):
    """cos, sin (T, R/2) of theta = t * base^(-2j/R) (SPEC 21), j < R/2: the
    math module in float64, then float32."""
    theta = [[t * float(base) ** (-2.0 * j / R) for j in range(R // 2)] for t in range(T)]
    cos = np.array([[math.cos(a) for a in row] for row in theta]).astype(np.float32)
    sin = np.array([[math.sin(a) for a in row] for row in theta]).astype(np.float32)
    return cos, sin


@pytest.mark.parametrize("T, R, base", [(16, 8, 10000), (16, 16, 500000), (64, 4, 10000),
                                        (9, 6, Fraction(10001, 2)), (1024, 32, 500000)])
def test_rope_tables_of_a_partial_rotation_and_another_base(T, R, base):
    cos, sin = rope_tables(T, R, np.float32, base)
    assert cos.shape == sin.shape == (T, R // 2) and cos.dtype == np.float32
    want_cos, want_sin = rope_tables_base(T, R, base)
    assert (cos != want_cos).sum() + (sin != want_sin).sum() <= 1, (T, R, base)


def rope_partial_complex(x, cos, sin):
    """The first R = 2 cos.shape[-1] elements of each head as complex pairs
    z_j = x_j + i x_{j+R/2} rotated by e^{i theta}; the other E - R as they are."""
    R = 2 * cos.shape[-1]
    return np.concatenate([rope_complex(x[..., :R], cos, sin), x[..., R:]], axis=-1)


@given(B=st.integers(1, 2), T=st.integers(1, 8), H=st.integers(1, 3), half=st.integers(1, 4),
       data=st.data(), scale=scales, seed=seeds,
       base=st.sampled_from([ROPE_BASE, 500000, Fraction(10001, 2)]))
def test_partial_rope(B, T, H, half, data, scale, seed, base):
    """Partial rotary (SPEC 21): R = 2r of each head's E elements rotated,
    half-split within R, theta = t * base^(-2j/R); the rest passes through."""
    E = 2 * half
    R = 2 * data.draw(st.integers(1, half), label="R/2")
    rng = np.random.default_rng(seed)
    x = values(rng, (B, T, H, E), scale)
    cos, sin = rope_tables(T, R, np.float32, base)
    want = rope_partial_complex(x, *rope_tables_base(T, R, base))
    out32 = rope_forward(x.astype(np.float32), cos, sin)
    assert out32.shape == x.shape and out32.dtype == np.float32
    assert_close("partial rope f32", out32, want, TOL["f32"])
    np.testing.assert_array_equal(out32[..., R:], x[..., R:])  # the tail, bit for bit
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    out = rope_forward(x, c64, s64)
    assert_close("partial rope f64", out, want, TOL["f64"])
    np.testing.assert_array_equal(out[..., R:], x[..., R:])

    dout = values(rng, (B, T, H, E), 1.0)
    dx = rope_backward(dout, c64, s64)
    # the inverse rotation on the first R, the identity on the tail
    assert_close("partial rope dx", dx, rope_partial_complex(dout, cos, -sin), TOL["closed"] * 10)
    np.testing.assert_array_equal(dx[..., R:], dout[..., R:])
    vjp_check("partial rope", lambda x: rope_forward(x, c64, s64), [x], [dx], dout, rng)


@given(B=st.integers(1, 2), T=st.integers(1, 8), H=st.integers(1, 3), half=st.integers(1, 4),
       scale=scales, seed=seeds)
def test_full_rotary_is_spec_3s_rope_bit_for_bit(B, T, H, half, scale, seed):
    """R = E: SPEC 3's rope, written out in float32 in its own order
    (out[j] = x[j] cos - x[j+E/2] sin, out[j+E/2] = x[j+E/2] cos + x[j] sin),
    bit for bit, forward and backward (the inverse rotation)."""
    E = 2 * half
    rng = np.random.default_rng(seed)
    x = values(rng, (B, T, H, E), scale).astype(np.float32)
    cos, sin = rope_tables(T, E)
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    np.testing.assert_array_equal(rope_forward(x, cos, sin),
                                  np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))
    np.testing.assert_array_equal(rope_backward(x, cos, sin),
                                  np.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1))
    np.testing.assert_array_equal(rope_tables(T, E)[0], rope_tables(T, E, np.float32, ROPE_BASE)[0])


# ---------------------------------------------------------------- attention
def attention_naive(q, k, v):
    """Per batch element, head and query position, over keys j <= i only."""
    B, H, T, E = q.shape
    y = np.zeros((B, H, T, E))
    for b in range(B):
        for h in range(H):
            for i in range(T):
                s = [math.fsum(q[b, h, i] * k[b, h, j]) / math.sqrt(E) for j in range(i + 1)]  # causal
                m = max(s)
                e = [math.exp(a - m) for a in s]
                z = math.fsum(e)
                for j in range(i + 1):
                    y[b, h, i] += e[j] / z * v[b, h, j]
    return y


@given(B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 7), half=st.integers(1, 4),
       scale=st.sampled_from([1e-2, 0.5, 2.0, 6.0]), seed=seeds)
def test_attention(B, H, T, half, scale, seed):
    E = 2 * half
    rng = np.random.default_rng(seed)
    q, k, v = (values(rng, (B, H, T, E), scale) for _ in range(3))
    want = attention_naive(q, k, v)
    y32, _ = attention_forward(*(a.astype(np.float32) for a in (q, k, v)), "fp32")
    assert y32.dtype == np.float32
    # float32 rounding of a score s moves p by ~|s| 2^-24 relative, so the
    # error is measured against max(1, |s|) |v| (scale 6, E 8: |s| up to ~100)
    smax = float(np.abs(q @ np.swapaxes(k, -1, -2)).max()) / math.sqrt(E)
    assert_close("attention f32", y32, want, TOL["f32"], scale=max(1.0, smax) * float(np.abs(v).max()))
    y, cache = attention_forward(q, k, v, "fp32")
    assert_close("attention f64", y, want, 1e-10)
    # causal: a row never sees a later key or value
    if T > 1:
        k2, v2 = k.copy(), v.copy()
        k2[:, :, -1] += 1.0
        v2[:, :, -1] -= 1.0
        y2, _ = attention_forward(q, k2, v2, "fp32")
        np.testing.assert_array_equal(y2[:, :, :-1], y[:, :, :-1])

    dy = values(rng, (B, H, T, E), 1.0)
    dq, dk, dv = attention_backward(dy, cache, "fp32")
    vjp_check("attention", lambda q, k, v: attention_forward(q, k, v, "fp32")[0], [q, k, v],
              [dq, dk, dv], dy, rng)


# ---------------------------------------------------------------- grouped-query attention (SPEC 21)
def grouped_attention_naive(q, k, v, H, Hkv):
    """q (B,T,H*E), k, v (B,T,Hkv*E) -> y (B,T,H*E): query head h attends with
    key/value head h // g, g = H / Hkv, per batch element, head and query
    position over keys j <= i."""
    B, T, HE = q.shape
    E, g = HE // H, H // Hkv
    y = np.zeros((B, T, HE))
    for b in range(B):
        for h in range(H):
            qc, kc = slice(h * E, (h + 1) * E), slice((h // g) * E, (h // g + 1) * E)
            for i in range(T):
                s = [math.fsum(q[b, i, qc] * k[b, j, kc]) / math.sqrt(E) for j in range(i + 1)]
                m = max(s)
                e = [math.exp(a - m) for a in s]
                z = math.fsum(e)
                for j in range(i + 1):
                    y[b, i, qc] += e[j] / z * v[b, j, kc]
    return y


@st.composite
def head_groups(draw):
    """(H, Hkv): Hkv divides H; H = 4, Hkv = 2 tells h // g from h % Hkv."""
    H = draw(st.sampled_from([1, 2, 3, 4, 6]))
    return H, draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))


@given(B=st.integers(1, 2), heads=head_groups(), T=st.integers(1, 6), half=st.integers(1, 3),
       scale=st.sampled_from([1e-2, 0.5, 2.0]), seed=seeds)
def test_grouped_query_attention(B, heads, T, half, scale, seed):
    H, Hkv = heads
    E, g = 2 * half, H // Hkv
    rng = np.random.default_rng(seed)
    q = values(rng, (B, T, H * E), scale)
    k, v = values(rng, (B, T, Hkv * E), scale), values(rng, (B, T, Hkv * E), scale)
    want = grouped_attention_naive(q, k, v, H, Hkv)
    y32, _ = _attention_forward(*(a.astype(np.float32) for a in (q, k, v)), H, "fp32")
    assert y32.dtype == np.float32 and y32.shape == q.shape
    # as test_attention's, against max(1, |s|) |v|, with |s| <= sqrt(E) max|q| max|k|
    smax = math.sqrt(E) * float(np.abs(q).max() * np.abs(k).max())
    assert_close("grouped attention f32", y32, want, TOL["f32"],
                 scale=max(1.0, smax) * float(np.abs(v).max()))
    y, cache = _attention_forward(q, k, v, H, "fp32")
    assert_close("grouped attention f64", y, want, 1e-10)

    dy = values(rng, (B, T, H * E), 1.0)
    dq, dk, dv = _attention_backward(dy, cache, H, "fp32")
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    vjp_check("grouped attention", lambda q, k, v: _attention_forward(q, k, v, H, "fp32")[0],
              [q, k, v], [dq, dk, dv], dy, rng)
    # a shared key/value head's gradient is the sum over its g query heads: with
    # dy on query head h alone, only key/value head h // g has a gradient, and
    # the H such gradients add up to the whole one (the backward is linear in dy)
    total_k, total_v = np.zeros_like(dk), np.zeros_like(dv)
    for h in range(H):
        one = np.zeros_like(dy)
        one[..., h * E:(h + 1) * E] = dy[..., h * E:(h + 1) * E]
        _, dk_h, dv_h = _attention_backward(one, cache, H, "fp32")
        others = [c for c in range(Hkv * E) if c // E != h // g]
        assert not dk_h[..., others].any() and not dv_h[..., others].any(), (H, Hkv, h)
        total_k, total_v = total_k + dk_h, total_v + dv_h
    assert_close("grouped attention dk, summed", dk, total_k, 1e-12)
    assert_close("grouped attention dv, summed", dv, total_v, 1e-12)


# ---------------------------------------------------------------- swiglu
def swiglu_naive(g, u):
    return np.vectorize(lambda g, u: g / (1.0 + math.exp(-g)) * u)(g, u)


@given(B=st.integers(1, 2), T=st.integers(1, 5), F=st.integers(1, 12), scale=scales, seed=seeds)
def test_swiglu(B, T, F, scale, seed):
    rng = np.random.default_rng(seed)
    g, u = values(rng, (B, T, F), scale * 4), values(rng, (B, T, F), scale)
    want = swiglu_naive(g, u)
    a32, _ = swiglu_forward(g.astype(np.float32), u.astype(np.float32))
    assert a32.dtype == np.float32
    assert_close("swiglu f32", a32, want, TOL["f32"])
    a, cache = swiglu_forward(g, u)
    assert_close("swiglu f64", a, want, TOL["f64"])

    da = values(rng, (B, T, F), 1.0)
    dg, du = swiglu_backward(da, cache)
    sig = 1.0 / (1.0 + np.exp(-g))
    assert_close("swiglu du", du, da * g * sig, TOL["closed"])
    vjp_check("swiglu", swiglu_forward_only, [g, u], [dg, du], da, rng)


def swiglu_forward_only(g, u):
    return swiglu_forward(g, u)[0]


# ---------------------------------------------------------------- cross-entropy
def crossentropy_naive(logits, targets):
    B, T, _ = logits.shape
    ce = np.empty((B, T))
    for b in range(B):
        for t in range(T):
            row = logits[b, t]
            m = max(row)
            lse = m + math.log(math.fsum(math.exp(a - m) for a in row))
            ce[b, t] = lse - row[targets[b, t]]
    return ce


@given(B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(1, 40),
       scale=st.sampled_from([1e-3, 1.0, 10.0, 60.0]), seed=seeds)
def test_crossentropy(B, T, V, scale, seed):
    rng = np.random.default_rng(seed)
    logits = values(rng, (B, T, V), scale)
    targets = rng.integers(0, V, (B, T))
    want = crossentropy_naive(logits, targets)
    ce32, _ = crossentropy_forward(logits.astype(np.float32), targets)
    assert ce32.dtype == np.float32 and ce32.shape == (B, T)
    # absolute error ~ |logits| * 2^-24 (the maximum subtracted keeps exp in range)
    err = np.abs(ce32 - want).max()
    assert err <= TOL["f32"] * max(1.0, np.abs(logits).max()), f"crossentropy f32: error {err:.3e}"
    ce, cache = crossentropy_forward(logits, targets)
    assert np.abs(ce - want).max() <= TOL["f64"] * max(1.0, np.abs(logits).max())
    assert (ce >= 0).all()

    dce = values(rng, (B, T), 1.0)
    dlogits = crossentropy_backward(dce, cache)
    # closed form: dce * (softmax(logits) - onehot(target))
    soft = np.exp(logits - logits.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    onehot = np.zeros_like(soft)
    for b in range(B):
        for t in range(T):
            onehot[b, t, targets[b, t]] = 1.0
    assert_close("crossentropy dlogits", dlogits, dce[..., None] * (soft - onehot), 1e-12)
    vjp_check("crossentropy", lambda z: crossentropy_forward(z, targets)[0], [logits], [dlogits], dce, rng)


# ---------------------------------------------------------------- the gradient contract
def test_backward_functions_return_fresh_arrays_and_leave_inputs_alone():
    """State/contract: every backward returns fresh arrays (the model assembles
    them); none writes into its inputs or its cache."""
    rng = np.random.default_rng(7)
    B, T, H, E, D, F, V = 2, 5, 2, 4, 8, 6, 11
    x, w, b = values(rng, (B, T, D), 1), values(rng, (D,), 1), values(rng, (D,), 1)
    ids = rng.integers(0, V, (B, T))
    W, Wf = values(rng, (V, D), 1), values(rng, (F, D), 1)
    q, k, v = (values(rng, (B, H, T, E), 1) for _ in range(3))
    cos, sin = rope_tables(T, E, np.float64)
    g, bf = values(rng, (B, T, F), 1), values(rng, (F,), 1)
    qm, km, vm = values(rng, (B, T, H * E), 1), values(rng, (B, T, E), 1), values(rng, (B, T, E), 1)
    cases = {
        "embedding": (lambda: embedding_backward(x, ids, V), [x, ids]),
        "layernorm": (lambda: layernorm_backward(x, layernorm_forward(x, w, b, EPS)[1]), [x, w, b]),
        "rmsnorm": (lambda: rmsnorm_backward(x, rmsnorm_forward(x, w, EPS)[1]), [x, w]),
        "linear": (lambda: linear_backward(g, linear_forward(x, Wf, "fp32")[1], "fp32"), [g, x, Wf]),
        "linear_bias": (lambda: linear_bias_backward(g, linear_bias_forward(x, Wf, bf, "fp32")[1],
                                                     "fp32"), [g, x, Wf, bf]),
        "rope": (lambda: (rope_backward(q.transpose(0, 2, 1, 3), cos, sin),), [q, cos, sin]),
        "attention": (lambda: attention_backward(q, attention_forward(q, k, v, "fp32")[1], "fp32"), [q, k, v]),
        "grouped attention": (lambda: _attention_backward(
            qm, _attention_forward(qm, km, vm, H, "fp32")[1], H, "fp32"), [qm, km, vm]),
        "swiglu": (lambda: swiglu_backward(x, swiglu_forward(x, x[::-1].copy())[1]), [x]),
        "crossentropy": (lambda: (crossentropy_backward(x[..., 0], crossentropy_forward(W[ids], ids % D)[1]),),
                         [x, W, ids]),
    }
    for name, (run, inputs) in cases.items():
        before = [a.copy() for a in inputs]
        outs = run()
        for a, a0 in zip(inputs, before):
            np.testing.assert_array_equal(a, a0, err_msg=f"{name} changed an input")
        for out in outs:
            for a in inputs:
                assert not np.shares_memory(out, a), f"{name}: a gradient aliases an input"
