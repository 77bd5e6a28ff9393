"""The swiglu family (accelerated/cuda/swiglu.py, kernels/swiglu.cu) against
the reference's layer functions (hypothesis-drawn shapes and values; on a
GPU, or on dev/cuda/emulated's stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.layers.swiglu import swiglu_backward, swiglu_forward

from .helpers import (PRECISIONS, small, kernels, dev, empty, placed, empty_placed, op_dtype,
                      as_float, policy, check_close, check_bitwise, operand_tol)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 50), st.integers(1, 70), st.sampled_from(PRECISIONS), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_swiglu_forward_backward(BT, F, precision, aligned, seed):
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((BT, 2 * F)) * 4).astype(np.float32)
    da = rng.standard_normal((BT, F)).astype(np.float32)
    g, u = gu[:, :F], gu[:, F:]
    want_a, cache = swiglu_forward(g, u)
    want_dg, want_du = swiglu_backward(da, cache)
    k = kernels(precision)
    a = empty((BT, F), op_dtype(precision))
    k.swiglu_forward(placed(gu, aligned), a)
    check_close("a", as_float(a, precision), policy(want_a, precision), operand_tol(precision))
    dgu = empty((BT, 2 * F), op_dtype(precision))
    k.swiglu_backward(placed(da, aligned), dev(gu), dgu)
    got = as_float(dgu, precision)
    check_close("dg", got[:, :F], policy(want_dg, precision), operand_tol(precision))
    check_close("du", got[:, F:], policy(want_du, precision), operand_tol(precision))
    # the step keeps no a per layer: the backward writes the forward's a again
    again, dgu2 = empty_placed((BT, F), op_dtype(precision), aligned), empty(dgu.shape, dgu.dtype)
    k.swiglu_backward(placed(da, aligned), placed(gu, aligned), dgu2, again)
    check_bitwise("a (written again by the backward)", as_float(again, precision),
                  as_float(a, precision))
    check_bitwise("dgu (with a)", as_float(dgu2, precision), got)
