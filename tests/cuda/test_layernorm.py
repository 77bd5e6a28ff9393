"""The layernorm family (accelerated/cuda/layernorm.py, kernels/layernorm.cu)
against the reference's layer functions (hypothesis-drawn shapes and
values; on a GPU, or on dev/cuda/emulated's stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from coppelius.reference.layers.layernorm import layernorm_backward, layernorm_forward
from coppelius.reference.precision import round_bf16
from coppelius.accelerated.cuda.layernorm import layernorm_chunks
from coppelius.accelerated.cuda.model import EPS

from .helpers import (PRECISIONS, small, kernels, dev, host, empty, placed, empty_placed, op_dtype,
                      as_float, policy, check_close, check_sum_close, check_bitwise, operand_tol,
                      gradient, host_gradient)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


# D: each register variant (a warp's 128, 256, 512, 1024 features per row;
# a block's 2048, 4096, 8192), rows of 4k and of other lengths (the
# element-by-element path), on either side of each variant's width; every
# block variant drawn at least once (the examples)
dims = st.tuples(st.integers(1, 3), st.integers(1, 40),
                 st.sampled_from([1, 4, 6, 32, 40, 130, 256, 300, 512, 1000, 1024, 1025,
                                  1028, 2048, 2304, 3001, 4100, 8192]),
                 st.integers(0, 2**31 - 1))


@small
@example((2, 37, 1028, 1), "bf16", True, True)
@example((2, 40, 1024, 5), "bf16", True, True)  # the widest warp kernel (c8)
@example((1, 9, 2304, 2), "fp32", False, True)
@example((1, 5, 8191, 3), "bf16", True, False)
@given(dims, st.sampled_from(PRECISIONS), st.booleans(), st.booleans())
def test_layernorm_forward(shape, precision, residual, aligned):
    Bn, T, D, seed = shape
    rng = np.random.default_rng(seed)
    rows = Bn * T
    x = (rng.standard_normal((rows, D)) * 3 + 1).astype(np.float32)
    add = rng.standard_normal((rows, D)).astype(np.float32)
    w, b = rng.standard_normal((2, D)).astype(np.float32)
    h, mean, rstd = empty((rows, D), op_dtype(precision)), empty((rows,)), empty((rows,))
    x_out = empty_placed((rows, D), aligned=aligned)
    kernels(precision).layernorm_forward(placed(x, aligned), dev(add) if residual else None,
                                         x_out if residual else None, h, mean, rstd, dev(w),
                                         dev(b), EPS)
    xin = x + add if residual else x
    if residual:
        check_bitwise("residual", host(x_out), xin)
    out, (xhat, want_rstd, _) = layernorm_forward(xin, w, b, float(EPS))
    check_close("h", as_float(h, precision), policy(out, precision), operand_tol(precision))
    check_close("rstd", host(rstd), want_rstd[:, 0], 1e-6)
    check_close("mean", host(mean), xin.mean(-1), 1e-6)


@small
@example((2, 37, 1028, 1), "bf16", True, True)
@example((2, 40, 1024, 5), "bf16", True, True)  # the widest warp kernel (c8)
@example((1, 9, 2304, 2), "fp32", False, True)
@example((1, 5, 8191, 3), "bf16", True, False)
@given(dims, st.sampled_from(PRECISIONS), st.booleans(), st.booleans())
def test_layernorm_backward_and_param_grads(shape, precision, residual, aligned):
    Bn, T, D, seed = shape
    rng = np.random.default_rng(seed)
    rows = Bn * T
    x = (rng.standard_normal((rows, D)) * 2 - 1).astype(np.float32)
    w, b = rng.standard_normal((2, D)).astype(np.float32)
    dout, dres = rng.standard_normal((2, rows, D)).astype(np.float32)
    _, cache = layernorm_forward(x, w, b, float(EPS))
    want_dx, want_dw, want_db = layernorm_backward(dout, cache)
    if residual:
        want_dx = dres + want_dx
    k = kernels(precision)
    h, mean, rstd = empty((rows, D), op_dtype(precision)), empty((rows,)), empty((rows,))
    dx_x = dev(x)
    k.layernorm_forward(dx_x, None, None, h, mean, rstd, dev(w), dev(b), EPS)
    # in place over dres, as the step does
    dx = placed(dres, aligned) if residual else empty_placed((rows, D), aligned=aligned)
    dx_op = empty((rows, D), np.uint16) if precision == "bf16" else None
    chunks = layernorm_chunks(rows)
    # two norms: this one, and a copy at another offset, each in a buffer of its own
    partials = [empty((chunks, 2 * D)), empty((chunks, 2 * D))]
    k.layernorm_backward(dev(dout), dx if residual else None, dx_x, mean, rstd, dev(w), dx, dx_op,
                         partials[0])
    partials[1][...] = partials[0]
    # G in two segments, a norm in each
    G = gradient(np.full(5 * D + 7, np.nan, np.float32), cuts=(3 * D + 5,))
    offsets = dev(np.array([D + 3, 3 * D + 7], np.int64))
    table = dev(np.array([p.data.ptr for p in partials], np.uint64))
    k.layernorm_param_grads(partials, table, offsets, G)
    check_close("dx", host(dx), want_dx, 1e-5)
    if dx_op is not None:
        check_close("dx operand", as_float(dx_op, "bf16"), round_bf16(host(dx)), 0)
    # the step keeps no h per layer: with the bias, the backward writes the forward's h again
    again = empty_placed((rows, D), op_dtype(precision), aligned)
    dx2 = placed(dres, aligned) if residual else empty_placed((rows, D), aligned=aligned)
    k.layernorm_backward(dev(dout), dx2 if residual else None, dx_x, mean, rstd, dev(w), dx2,
                         None, empty((chunks, 2 * D)), b=placed(b, aligned), h=again)
    check_bitwise("h (written again by the backward)", as_float(again, precision),
                  as_float(h, precision))
    check_bitwise("dx (with h)", host(dx2), host(dx))
    g = host_gradient(G)
    # dw and db are sums over the rows that can cancel: float32's error is
    # relative to the sum of the terms' magnitudes, not to the sum itself
    xhat = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + EPS)
    for off in (D + 3, 3 * D + 7):
        check_sum_close("dw", g[off:off + D], want_dw, np.abs(dout * xhat).sum(0), 1e-5)
        check_sum_close("db", g[off + D:off + 2 * D], want_db, np.abs(dout).sum(0), 1e-5)
    assert np.isnan(g[:D + 3]).all() and np.isnan(g[3 * D + 3:3 * D + 7]).all()
