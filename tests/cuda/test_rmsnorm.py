"""The rmsnorm family (accelerated/cuda/rmsnorm.py, kernels/rmsnorm.cu)
against the reference's layer functions (hypothesis-drawn shapes and
values; on a GPU, or on dev/cuda/emulated's stand-ins: conftest.py), its
weight partials reduced by layernorm_param_grads."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from coppelius.reference.layers.rmsnorm import rmsnorm_backward, rmsnorm_forward
from coppelius.reference.precision import round_bf16
from coppelius.accelerated.cuda.layernorm import layernorm_chunks

from .helpers import (PRECISIONS, small, kernels, dev, host, empty, placed, empty_placed, op_dtype,
                      as_float, policy, check_close, check_sum_close, check_bitwise, operand_tol,
                      gradient, host_gradient)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]

# D: each register variant (a warp's 128, 256, 512, 1024 features per row;
# a block's 2048, 4096, 8192), rows of 4k and of other lengths (the
# element-by-element path), on either side of each variant's width; every
# block variant drawn at least once (the examples); eps: the default
# and a large one, which the output must see
dims = st.tuples(st.integers(1, 3), st.integers(1, 40),
                 st.sampled_from([1, 4, 6, 32, 40, 130, 256, 300, 512, 1000, 1024, 1025,
                                  1028, 2048, 2304, 3001, 4100, 8192]),
                 st.integers(0, 2**31 - 1))
epsilons = st.sampled_from([np.float32(1e-5), np.float32(0.5)])


@small
@example((2, 37, 1028, 1), "bf16", True, True, np.float32(1e-5))
@example((1, 9, 2304, 2), "fp32", False, True, np.float32(1e-5))
@example((1, 5, 8191, 3), "bf16", True, False, np.float32(1e-5))
@given(dims, st.sampled_from(PRECISIONS), st.booleans(), st.booleans(), epsilons)
def test_rmsnorm_forward(shape, precision, residual, aligned, eps):
    Bn, T, D, seed = shape
    rng = np.random.default_rng(seed)
    rows = Bn * T
    x = (rng.standard_normal((rows, D)) * 3 + 1).astype(np.float32)
    add = rng.standard_normal((rows, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    h, rstd = empty((rows, D), op_dtype(precision)), empty((rows,))
    x_out = empty_placed((rows, D), aligned=aligned)
    kernels(precision).rmsnorm_forward(placed(x, aligned), dev(add) if residual else None,
                                       x_out if residual else None, h, rstd, dev(w), eps)
    xin = x + add if residual else x
    if residual:
        check_bitwise("residual", host(x_out), xin)
    out, (_, want_rstd, _) = rmsnorm_forward(xin, w, float(eps))
    # the root mean square written out again, in float64
    x64 = xin.astype(np.float64)
    rms = 1.0 / np.sqrt((x64 * x64).mean(-1) + float(eps))
    check_close("rstd", host(rstd), rms, 1e-6)
    check_close("rstd (reference)", host(rstd), want_rstd[:, 0], 1e-6)
    check_close("h", as_float(h, precision), policy(out, precision), operand_tol(precision))
    check_close("h (float64)", as_float(h, precision), x64 * rms[:, None] * w,
                operand_tol(precision))


@small
@example((2, 37, 1028, 1), "bf16", True, True, np.float32(1e-5))
@example((1, 9, 2304, 2), "fp32", False, True, np.float32(1e-5))
@example((1, 5, 8191, 3), "bf16", True, False, np.float32(1e-5))
@given(dims, st.sampled_from(PRECISIONS), st.booleans(), st.booleans(), epsilons)
def test_rmsnorm_backward_and_param_grads(shape, precision, residual, aligned, eps):
    Bn, T, D, seed = shape
    rng = np.random.default_rng(seed)
    rows = Bn * T
    x = (rng.standard_normal((rows, D)) * 2 - 1).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    dout, dres = rng.standard_normal((2, rows, D)).astype(np.float32)
    _, cache = rmsnorm_forward(x, w, float(eps))
    want_dx, want_dw = rmsnorm_backward(dout, cache)
    if residual:
        want_dx = dres + want_dx
    k = kernels(precision)
    h, rstd = empty((rows, D), op_dtype(precision)), empty((rows,))
    dx_x = dev(x)
    k.rmsnorm_forward(dx_x, None, None, h, rstd, dev(w), eps)
    # in place over dres, as the step does
    dx = placed(dres, aligned) if residual else empty_placed((rows, D), aligned=aligned)
    dx_op = empty((rows, D), np.uint16) if precision == "bf16" else None
    chunks = layernorm_chunks(rows)
    # two norms: this one, and a copy at another offset, each in a buffer of its own
    partials = [empty((chunks, D)), empty((chunks, D))]
    k.rmsnorm_backward(dev(dout), dx if residual else None, dx_x, rstd, dev(w), dx, dx_op,
                       partials[0])
    partials[1][...] = partials[0]
    # G in two segments, a norm's weight in each
    G = gradient(np.full(3 * D + 7, np.nan, np.float32), cuts=(2 * D + 5,))
    offsets = dev(np.array([D + 3, 2 * D + 7], np.int64))
    table = dev(np.array([p.data.ptr for p in partials], np.uint64))
    k.layernorm_param_grads(partials, table, offsets, G)
    check_close("dx", host(dx), want_dx, 1e-5)
    # dx = rstd (dxhat - xhat mean(dxhat xhat)), dxhat = dout w: written out again in float64
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + float(eps))
    xhat, dxhat = x64 * r, dout * w.astype(np.float64)
    m2 = (dxhat * xhat).mean(-1, keepdims=True)
    dx64 = r * (dxhat - xhat * m2)
    # (a difference that cancels where D is small: float32's error is relative to its terms)
    check_sum_close("dx (float64)", host(dx) - (dres if residual else 0), dx64,
                    np.abs(r * dxhat) + np.abs(r * xhat * m2), 1e-5)
    if dx_op is not None:
        check_close("dx operand", as_float(dx_op, "bf16"), round_bf16(host(dx)), 0)
    # the step keeps no h per layer: the backward writes the forward's h again
    again = empty_placed((rows, D), op_dtype(precision), aligned)
    dx2 = placed(dres, aligned) if residual else empty_placed((rows, D), aligned=aligned)
    k.rmsnorm_backward(dev(dout), dx2 if residual else None, dx_x, rstd, placed(w, aligned), dx2,
                       None, empty((chunks, D)), h=again)
    check_bitwise("h (written again by the backward)", as_float(again, precision),
                  as_float(h, precision))
    check_bitwise("dx (with h)", host(dx2), host(dx))
    g = host_gradient(G)
    # dw is a sum over the rows that can cancel: float32's error is relative
    # to the sum of the terms' magnitudes, not to the sum itself
    for off in (D + 3, 2 * D + 7):
        check_sum_close("dw", g[off:off + D], want_dw, np.abs(dout * xhat).sum(0), 1e-5)
        check_sum_close("dw (float64)", g[off:off + D], (dout * xhat).sum(0),
                        np.abs(dout * xhat).sum(0), 1e-5)
    assert np.isnan(g[:D + 3]).all() and np.isnan(g[2 * D + 3:2 * D + 7]).all()


def test_a_norm_without_bias_has_no_bias_partials():
    """The partials the rmsnorm backward writes are one row of D weight sums
    per block; a layernorm-shaped (chunks, 2D) buffer is refused."""
    rows, D = 8, 32
    k = kernels("fp32")
    x = dev(np.ones((rows, D), np.float32))
    with pytest.raises(AssertionError):
        k.rmsnorm_backward(x, None, x, dev(np.ones(rows, np.float32)), dev(np.ones(D, np.float32)),
                           empty((rows, D)), None, empty((layernorm_chunks(rows), 2 * D)))
