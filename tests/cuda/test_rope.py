"""The rope family (accelerated/cuda/rope.py, kernels/rope.cu) against the
reference's layer functions (hypothesis-drawn shapes and values; on a GPU,
or on dev/cuda/emulated's stand-ins: conftest.py): q's H heads and k's Hkv
heads of the step's layout rotated in their first R elements (partial
rotary, SPEC 21), the rest passing through."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from coppelius.reference.layers.rope import rope_backward, rope_forward, rope_tables
from coppelius.reference.layout import qkv_columns
from coppelius.reference.precision import round_bf16

from .helpers import small, kernels, dev, host, empty, placed, as_float, check_bitwise

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@st.composite
def heads(draw):
    """(H, Hkv, E, R): Hkv dividing H, R even and at most E. Head dims of 4k
    with R of 8k take 4 pairs at a time (16-byte loads), the others one
    element at a time."""
    H = draw(st.integers(1, 4))
    Hkv = draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))
    E = draw(st.sampled_from([2, 4, 6, 8, 12, 16, 24, 64]))
    R = 2 * draw(st.integers(1, E // 2))
    return H, Hkv, E, R


def split(x, Bn, T, H, Hkv, E):
    # (BT, >= qk) -> q (B,T,H,E), k (B,T,Hkv,E) and the columns after them
    q, k, _ = qkv_columns(H, Hkv, E)
    return (x[:, q.start:q.stop].reshape(Bn, T, H, E), x[:, k.start:k.stop].reshape(Bn, T, Hkv, E),
            x[:, k.stop:])


@small
# the 4-pair items with a partial rotary (a head's tail copied by chunks),
# whole heads, grouped and not; and element by element
@example(2, 5, (4, 2, 16, 8), True, 1)
@example(1, 7, (3, 1, 12, 8), True, 2)
@example(2, 3, (2, 2, 8, 8), True, 3)
@example(1, 4, (4, 1, 6, 4), True, 4)
@given(st.integers(1, 3), st.integers(1, 20), heads(), st.booleans(), st.integers(0, 2**31 - 1))
def test_rope_forward_backward_bitwise(Bn, T, shape, aligned, seed):
    """The same float32 operations as the reference, forward and backward;
    the backward of dq, dk alone leaves dv's columns alone, and of dq, dk,
    dv side by side copies dv."""
    H, Hkv, E, R = shape
    q, k, v = qkv_columns(H, Hkv, E)
    W = v.stop
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((Bn * T, W)).astype(np.float32)
    cos, sin = rope_tables(T + 3, R)  # the table may be longer than the context (an eager prefix)
    assert cos.shape == (T + 3, R // 2)
    c, s = cos[:T], sin[:T]
    k32 = kernels("fp32")
    out = empty((Bn * T, W))
    k32.rope_forward(placed(qkv, aligned), out, dev(cos), dev(sin), T, H, Hkv)
    got_q, got_k, got_v = split(host(out), Bn, T, H, Hkv, E)
    x_q, x_k, x_v = split(qkv, Bn, T, H, Hkv, E)
    check_bitwise("q", got_q, rope_forward(x_q, c, s))
    check_bitwise("k", got_k, rope_forward(x_k, c, s))
    check_bitwise("q past R", got_q[..., R:], x_q[..., R:])
    check_bitwise("v", got_v, x_v)

    for width in (k.stop, W):  # dq | dk, or dq | dk | dv
        d = rng.standard_normal((Bn * T, width)).astype(np.float32)
        dqkv = empty((Bn * T, W))
        k32.rope_backward(placed(d, aligned), dqkv, dev(cos), dev(sin), T, H, Hkv)
        got_q, got_k, got_v = split(host(dqkv), Bn, T, H, Hkv, E)
        d_q, d_k, d_v = split(d, Bn, T, H, Hkv, E)
        check_bitwise("dq", got_q, rope_backward(d_q, c, s))
        check_bitwise("dk", got_k, rope_backward(d_k, c, s))
        if width == W:
            check_bitwise("dv", got_v, d_v)
        else:
            assert np.isnan(got_v).all(), "rope_backward of dq, dk wrote the v columns"


@small
# the 4-pair items with a partial rotary (a head's tail copied by chunks),
# whole heads, grouped and not; and element by element
@example(2, 5, (4, 2, 16, 8), True, 1)
@example(1, 7, (3, 1, 12, 8), True, 2)
@example(2, 3, (2, 2, 8, 8), True, 3)
@example(1, 4, (4, 1, 6, 4), True, 4)
@given(st.integers(1, 3), st.integers(1, 20), heads(), st.booleans(), st.integers(0, 2**31 - 1))
def test_rope_backward_of_operands_bitwise(Bn, T, shape, aligned, seed):
    """The rope backward after cuDNN's attention, which writes dq, dk as
    bfloat16: the reference's rope backward of the widened values, rounded."""
    H, Hkv, E, R = shape
    q, k, v = qkv_columns(H, Hkv, E)
    rng = np.random.default_rng(seed)
    dqk = round_bf16(rng.standard_normal((Bn * T, k.stop)).astype(np.float32))
    cos, sin = rope_tables(T + 3, R)
    dqkv = empty((Bn * T, v.stop), np.uint16)
    bits = (dqk.view(np.uint32) >> 16).astype(np.uint16)
    kernels("bf16").rope_backward_operand(placed(bits, aligned), dqkv, dev(cos), dev(sin), T, H,
                                          Hkv)
    got_q, got_k, got_v = split(as_float(dqkv, "bf16"), Bn, T, H, Hkv, E)
    d_q, d_k, _ = split(dqk, Bn, T, H, Hkv, E)
    c, s = cos[:T], sin[:T]
    check_bitwise("dq", got_q, round_bf16(rope_backward(d_q, c, s)))
    check_bitwise("dk", got_k, round_bf16(rope_backward(d_k, c, s)))
    assert np.isnan(got_v).all(), "rope_backward_operand wrote the v columns"


def test_rope_forward_of_bfloat16_operands_rounds_once():
    """Under bf16 the rotated q, k and the copied v are the float32 values
    rounded once; a partial rotary's pass-through elements too."""
    H, Hkv, E, R, T = 4, 2, 16, 8, 5
    _, _, v = qkv_columns(H, Hkv, E)
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((T, v.stop)).astype(np.float32)
    cos, sin = rope_tables(T, R)
    out = empty((T, v.stop), np.uint16)
    kernels("bf16").rope_forward(dev(qkv), out, dev(cos), dev(sin), T, H, Hkv)
    got_q, got_k, got_v = split(as_float(out, "bf16"), 1, T, H, Hkv, E)
    x_q, x_k, x_v = split(qkv, 1, T, H, Hkv, E)
    check_bitwise("q", got_q, round_bf16(rope_forward(x_q, cos, sin)))
    check_bitwise("k", got_k, round_bf16(rope_forward(x_k, cos, sin)))
    check_bitwise("v", got_v, round_bf16(x_v))


def test_rope_refuses_a_row_of_another_layout():
    """A row whose width is not the layout's for (H, Hkv) is refused by the
    launcher, not indexed."""
    cos, sin = rope_tables(4, 4)
    qkv = dev(np.zeros((4, 44), np.float32))  # H + 2 Hkv = 8 heads do not divide 44 columns
    with pytest.raises(AssertionError):
        kernels("fp32").rope_forward(qkv, empty(qkv.shape), dev(cos), dev(sin), 4, 4, 2)
