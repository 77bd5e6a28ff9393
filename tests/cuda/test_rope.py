"""The rope family (accelerated/cuda/rope.py, kernels/rope.cu) against the
reference's layer functions (hypothesis-drawn shapes and values; on a GPU,
or on dev/cuda/emulated's stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.layers.rope import rope_backward, rope_forward, rope_tables
from coppelius.reference.precision import round_bf16

from .helpers import small, kernels, dev, host, empty, placed, as_float, check_bitwise

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 3), st.integers(1, 20),
       st.sampled_from([(1, 2), (2, 4), (3, 6), (8, 64), (2, 8), (3, 16), (2, 24), (1, 12)]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_rope_forward_backward_bitwise(Bn, T, HE, aligned, seed):
    """Half-split pairs; the same float32 operations as the reference. Head
    dims of 8k take 4 pairs at a time (16-byte loads), others and misaligned
    rows one element at a time."""
    H, E = HE
    D = H * E
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((Bn * T, 3 * D)).astype(np.float32)
    Tmax = T + 3  # the table may be longer than the context (an eager prefix)
    cos, sin = rope_tables(Tmax, E)
    k = kernels("fp32")
    out = empty((Bn * T, 3 * D))
    k.rope_forward(placed(qkv, aligned), out, dev(cos), dev(sin), T, H)
    got = host(out).reshape(Bn, T, 3, H, E)
    x = qkv.reshape(Bn, T, 3, H, E)
    c, s = cos[:T], sin[:T]
    check_bitwise("q", got[:, :, 0], rope_forward(x[:, :, 0], c, s))
    check_bitwise("k", got[:, :, 1], rope_forward(x[:, :, 1], c, s))
    check_bitwise("v", got[:, :, 2], x[:, :, 2])

    dqk = rng.standard_normal((Bn * T, 2 * D)).astype(np.float32)
    dqkv = empty((Bn * T, 3 * D))
    k.rope_backward(placed(dqk, aligned), dqkv, dev(cos), dev(sin), T, H)
    got = host(dqkv).reshape(Bn, T, 3, H, E)
    d = dqk.reshape(Bn, T, 2, H, E)
    check_bitwise("dq", got[:, :, 0], rope_backward(d[:, :, 0], c, s))
    check_bitwise("dk", got[:, :, 1], rope_backward(d[:, :, 1], c, s))
    assert np.isnan(got[:, :, 2]).all(), "rope_backward wrote the v columns"


@small
@given(st.integers(1, 3), st.integers(1, 20),
       st.sampled_from([(1, 2), (2, 4), (3, 6), (8, 64), (2, 8), (3, 16), (1, 12)]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_rope_backward_of_operands_bitwise(Bn, T, HE, aligned, seed):
    """The rope backward after cuDNN's attention, which writes dq, dk as
    bfloat16: the reference's rope backward of the widened values, rounded
    (head dims of 8k 4 pairs at a time, others and misaligned rows one
    element at a time)."""
    H, E = HE
    D = H * E
    rng = np.random.default_rng(seed)
    dqk = round_bf16(rng.standard_normal((Bn * T, 2 * D)).astype(np.float32))
    cos, sin = rope_tables(T + 3, E)
    dqkv = empty((Bn * T, 3 * D), np.uint16)
    bits = (dqk.view(np.uint32) >> 16).astype(np.uint16)
    kernels("bf16").rope_backward_operand(placed(bits, aligned), dqkv, dev(cos), dev(sin), T, H)
    got = as_float(dqkv, "bf16").reshape(Bn, T, 3, H, E)
    d = dqk.reshape(Bn, T, 2, H, E)
    c, s = cos[:T], sin[:T]
    check_bitwise("dq", got[:, :, 0], round_bf16(rope_backward(d[:, :, 0], c, s)))
    check_bitwise("dk", got[:, :, 1], round_bf16(rope_backward(d[:, :, 1], c, s)))
    assert np.isnan(got[:, :, 2]).all(), "rope_backward_operand wrote the v columns"
