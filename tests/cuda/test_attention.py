"""The attention family (accelerated/cuda/attention.py, kernels/attention.cu):
the materialized softmax against the reference's layer functions
(hypothesis-drawn shapes and values; on a GPU, or on dev/cuda/emulated's
stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.layers.attention import attention_forward
from coppelius.reference.precision import round_bf16
from coppelius.accelerated.cuda.attention import attention_scale

from .helpers import (PRECISIONS, small, kernels, dev, host, op_dtype, as_float, policy,
                      check_close, check_sum_close, operand_tol, cupy)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 70), st.sampled_from([2, 8, 64]),
       st.sampled_from(PRECISIONS), st.integers(0, 2**31 - 1))
def test_attention_softmax_forward_backward(Bn, H, T, E, precision, seed):
    check_attention_softmax(Bn, H, T, E, precision, seed)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_attention_softmax_rows_longer_than_the_registers(precision):
    check_attention_softmax(1, 1, 32 * 32 + 9, 4, precision, 18)


def check_attention_softmax(Bn, H, T, E, precision, seed):
    """The causal softmax over (B,H,T,T) scores and its backward. Under bf16
    only the causal part is written (the operand buffers keep the zeros
    above the diagonal that the program allocates them with); under fp32 the
    products read the float32 p itself, so its zeros are written."""
    rng = np.random.default_rng(seed)
    q, kk, v = (rng.standard_normal((3, Bn, H, T, E)) * 2).astype(np.float32)
    _, (_, _, _, p_want, scale) = attention_forward(q, kk, v, "fp32")  # p of the reference
    assert scale == attention_scale(E)
    s = dev(q @ np.swapaxes(kk, -1, -2))  # the unscaled product, as the kernel receives it
    causal = np.tril(np.ones((T, T), bool))
    bf16 = precision == "bf16"
    k = kernels(precision)
    p_op = cupy.zeros(s.shape, np.uint16) if bf16 else None
    k.attention_softmax_forward(s, p_op, scale)
    p = host(s)  # under bf16, the scores are left above the diagonal
    check_close("p", np.where(causal, p, 0), p_want, 1e-6)
    if bf16:
        check_close("p operand", as_float(p_op, "bf16"), round_bf16(np.where(causal, p, 0)), 0)
    else:
        assert (p[..., ~causal] == 0).all()

    dp = rng.standard_normal(p.shape).astype(np.float32)
    ds = cupy.zeros(p.shape, op_dtype(precision))
    p_op2 = cupy.zeros(p.shape, np.uint16) if bf16 else None
    k.attention_softmax_backward(dev(p), dev(dp), ds, p_op2, scale)
    p64, dp64 = np.where(causal, p, 0).astype(np.float64), dp.astype(np.float64)
    want = p64 * (dp64 - (dp64 * p64).sum(-1, keepdims=True)) * scale
    # ds cancels where one p is near 1 (a row of T = 2, say: both ds near 0):
    # float32's error is relative to its terms' magnitudes, not to ds
    terms = p64 * (np.abs(dp64) + (np.abs(dp64) * p64).sum(-1, keepdims=True)) * scale
    check_sum_close("ds", as_float(ds, precision), policy(want.astype(np.float32), precision),
                    terms, operand_tol(precision))
    if bf16:
        check_close("p operand (backward)", as_float(p_op2, "bf16"),
                    round_bf16(np.where(causal, p, 0)), 0)
