"""The fused attention family (accelerated/cuda/attention_fused.py,
kernels/attention_fused.cu), as the step runs it, against the reference's
layer functions (hypothesis-drawn shapes and values; on a GPU, or on
dev/cuda/emulated's stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.config import Config
from coppelius.reference.layers.attention import attention_backward, attention_forward
from coppelius.accelerated.cuda.policy import attention_path
from coppelius.accelerated.cuda.cupy_debug import fused_from_batch, step_attention

from .helpers import PRECISIONS, small, policy, check_close, operand_tol

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 5, 63, 64, 65, 130, 200]),
       st.sampled_from([16, 32, 64]), st.sampled_from(PRECISIONS), st.integers(0, 2**31 - 1))
def test_attention_matches_reference_layer(Bn, H, T, E, precision, seed):
    """The step's attention, forward and backward, against
    reference.layers.attention: under bf16 the project's fused kernels
    (query and key tiles of 64: T below, at and across tile edges), under
    fp32 the materialized scores."""
    rng = np.random.default_rng(seed)
    q, k = 2 * rng.standard_normal((2, Bn, H, T, E))  # scores of a few units: peaked rows
    v, dy = rng.standard_normal((2, Bn, H, T, E))
    q, k, v, dy = (policy(x.astype(np.float32), precision) for x in (q, k, v, dy))
    with fused_from_batch(1):
        path = attention_path(Config(8, T, H * E, 1, H, 8), precision, Bn)
        assert path.kind == ("fused" if precision == "bf16" else "materialized")
        y, dq, dk, dv = step_attention(precision, q, k, v, dy)
    want_y, cache = attention_forward(q, k, v, precision)
    want_dq, want_dk, want_dv = attention_backward(dy, cache, precision)
    # y and dv are operands: one rounding to a neighbouring bfloat16 apart at
    # most; dq, dk come from the rounded ds, a roundoff apart now and then
    check_close("y", y, policy(want_y, precision), operand_tol(precision))
    check_close("dv", dv, policy(want_dv, precision), operand_tol(precision))
    tol = 1e-5 if precision == "fp32" else 1e-2
    check_close("dq", dq, want_dq, tol)
    check_close("dk", dk, want_dk, tol)
