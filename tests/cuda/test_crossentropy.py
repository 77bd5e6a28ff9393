"""The cross-entropy family (accelerated/cuda/crossentropy.py,
kernels/crossentropy.cu) against the reference's layer functions
(hypothesis-drawn shapes and values; on a GPU, or on dev/cuda/emulated's
stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.layers.crossentropy import crossentropy_backward, crossentropy_forward

from .helpers import (PRECISIONS, small, kernels, dev, host, empty, placed, op_dtype, as_float,
                      policy, check_close, check_bitwise, operand_tol)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 3), st.integers(1, 20), st.sampled_from([2, 7, 64, 1000, 12288, 16389,
                                                             20000]),
       st.sampled_from(PRECISIONS), st.booleans(), st.integers(0, 2**31 - 1))
def test_crossentropy_forward_backward(Bn, T, V, precision, aligned, seed):
    """Rows held in registers (up to 16384 logits) and longer ones, read
    16 bytes at a time (V of 4k) or one logit at a time."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((Bn, T, V)) * 5).astype(np.float32)
    ids = rng.integers(0, V, (Bn, T + 1))
    want_ce, cache = crossentropy_forward(logits, ids[:, 1:])
    n = Bn * T
    dce = np.float32(1.0 / n)
    want_dl = crossentropy_backward(np.full((Bn, T), dce, np.float32), cache)
    k = kernels(precision)
    ce, dl, loss = empty((n,)), empty((n, V), op_dtype(precision)), empty((1,))
    k.crossentropy_forward_backward(placed(logits.reshape(n, V), aligned),
                                    dev(ids.astype(np.int32)), T + 1, T, ce, dl, dce)
    k.mean_loss(ce, loss)
    check_close("ce", host(ce).reshape(Bn, T), want_ce, 1e-6)
    check_close("loss", host(loss)[0], want_ce.mean(dtype=np.float32), 1e-6)
    check_close("dlogits", as_float(dl, precision).reshape(Bn, T, V), policy(want_dl, precision),
                operand_tol(precision))


@small
@given(st.integers(1, 3), st.integers(1, 20), st.sampled_from([7, 64, 1000]), st.integers(1, 9),
       st.sampled_from(PRECISIONS), st.integers(0, 2**31 - 1))
def test_crossentropy_by_row_chunks(Bn, T, V, rows, precision, seed):
    """The step's loss runs the kernel on chunks of rows (Model.classifier_loss): each
    chunk's rows r0.. of the batch, their targets found from row0, give
    the bits of one launch over every row."""
    rng = np.random.default_rng(seed)
    n = Bn * T
    logits = (rng.standard_normal((n, V)) * 5).astype(np.float32)
    ids = dev(rng.integers(0, V, (Bn, T + 1)).astype(np.int32))
    dce = np.float32(1.0 / n)
    k = kernels(precision)
    ce, dl = empty((n,)), empty((n, V), op_dtype(precision))
    k.crossentropy_forward_backward(dev(logits), ids, T + 1, T, ce, dl, dce)
    ce2, dl2 = empty((n,)), empty((n, V), op_dtype(precision))
    chunk = empty((rows, V))
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        chunk[:m].set(logits[r0:r0 + m])
        k.crossentropy_forward_backward(chunk[:m], ids, T + 1, T, ce2[r0:r0 + m],
                                        dl2[r0:r0 + m], dce, row0=r0)
    check_bitwise("ce", host(ce2), host(ce))
    check_bitwise("dlogits", as_float(dl2, precision), as_float(dl, precision))
