"""The linear_bias family (accelerated/cuda/linear_bias.py,
kernels/linear_bias.cu): the q, k, v biases added to the fused row after
the products, and their gradients, the column sums of the row's gradient,
against the reference's layer (linear_bias_forward, linear_bias_backward)
and float64 sums (hypothesis-drawn shapes and values; on a GPU, or on
dev/cuda/emulated's stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.layers.linear import linear_bias_backward, linear_bias_forward
from coppelius.reference.layout import qkv_columns
from coppelius.accelerated.cuda.linear_bias import (LINEAR_BIAS_CHUNKS, LINEAR_BIAS_GROUPS,
                                                    linear_bias_chunk, linear_bias_chunks)

from .helpers import (PRECISIONS, small, kernels, dev, host, empty, placed, op_dtype, policy,
                      check_bitwise, check_sum_close)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]

# rows, heads H, key/value heads Hkv (dividing H), head dim E (a multiple of 4
# or not: the element-by-element path), whether the arrays are 16-byte aligned
shapes = st.tuples(st.integers(1, 300), st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (3, 3)]),
                   st.sampled_from([2, 4, 6, 16]), st.booleans(), st.integers(0, 2**31 - 1))


def columns(heads, E):
    H, Hkv = heads
    q, k, v = qkv_columns(H, Hkv, E)
    return q, k, v, v.stop


@small
@given(shapes)
def test_linear_bias_forward(shape):
    """y + b in float32 after the product: bit for bit the reference's add."""
    rows, heads, E, aligned, seed = shape
    q, k, v, W = columns(heads, E)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 3)).astype(np.float32)
    weights = [rng.standard_normal((c.width, 3)).astype(np.float32) for c in (q, k, v)]
    biases = [rng.standard_normal(c.width).astype(np.float32) for c in (q, k, v)]
    # the products as the reference's layer makes them, side by side in one row
    y = np.concatenate([x @ w.T for w in weights], axis=1)
    want = np.concatenate([linear_bias_forward(x, w, b, "fp32")[0]
                           for w, b in zip(weights, biases)], axis=1)
    out = placed(y, aligned)
    kernels("fp32").linear_bias_forward(out, *(placed(b, aligned) for b in biases), k.start,
                                        v.start)
    check_bitwise("y + b", host(out), want)


@small
@given(shapes, st.sampled_from(PRECISIONS))
def test_linear_bias_backward_and_param_grads(shape, precision):
    """The column sums of dy (the operands the step keeps: bfloat16 under
    bf16) into three views of one G, each element of its sum's terms'
    float32 error; the rest of G untouched."""
    rows, heads, E, aligned, seed = shape
    q, k, v, W = columns(heads, E)
    rng = np.random.default_rng(seed)
    dy = policy(rng.standard_normal((rows, W)).astype(np.float32), precision)
    stored = dy if precision == "fp32" else (dy.view(np.uint32) >> 16).astype(np.uint16)
    kern = kernels(precision)
    partials = empty((linear_bias_chunks(rows), W))
    kern.linear_bias_backward(placed(stored, aligned, op_dtype(precision)), partials)
    G = empty((W + 9,))
    at = (5, 5 + q.width + 1, W + 9 - v.width)  # the q, k, v biases' gradients, apart in G
    views = [G[a:a + c.width] for a, c in zip(at, (q, k, v))]
    kern.linear_bias_param_grads(partials, *views, k.start, v.start)
    g = host(G)
    want64 = dy.astype(np.float64).sum(0)
    # the reference's bias gradient of each part
    ref = np.concatenate([linear_bias_backward(dy[:, c.start:c.stop],
                                               (np.zeros((rows, 1), np.float32),
                                                np.zeros((c.width, 1), np.float32)),
                                               "fp32")[2] for c in (q, k, v)])
    magnitude = np.abs(dy).sum(0)
    for a, c in zip(at, (q, k, v)):
        got = g[a:a + c.width]
        check_sum_close("db", got, want64[c.start:c.stop], magnitude[c.start:c.stop], 1e-6)
        check_sum_close("db (reference)", got, ref[c.start:c.stop], magnitude[c.start:c.stop],
                        1e-6)
    written = np.zeros(G.shape, bool)
    for a, c in zip(at, (q, k, v)):
        written[a:a + c.width] = True
    assert np.isnan(g[~written]).all()


@small
@given(st.integers(1, 10**6))
def test_the_bias_gradient_partition(rows):
    """Blocks of whole row groups, at most LINEAR_BIAS_CHUNKS of them, as
    few rows each as that allows, covering every row once."""
    chunk, chunks = linear_bias_chunk(rows), linear_bias_chunks(rows)
    assert chunk % LINEAR_BIAS_GROUPS == 0 and chunks <= LINEAR_BIAS_CHUNKS
    assert (chunks - 1) * chunk < rows <= chunks * chunk
    assert chunk == LINEAR_BIAS_GROUPS or -(-rows // (chunk - LINEAR_BIAS_GROUPS)) > \
        LINEAR_BIAS_CHUNKS


def test_the_step_keeps_the_bias_gradient_reproducible():
    """The same dy twice: the same bits (a fixed order of every sum)."""
    rows, (q, k, v, W) = 777, columns((4, 2), 16)
    dy = dev(np.random.default_rng(3).standard_normal((rows, W)).astype(np.float32))
    kern = kernels("fp32")
    out = []
    for _ in range(2):
        partials, G = empty((linear_bias_chunks(rows), W)), empty((W,))
        kern.linear_bias_backward(dy, partials)
        kern.linear_bias_param_grads(partials, G[:q.width], G[k.start:k.stop], G[v.start:],
                                     k.start, v.start)
        out.append(host(G))
    check_bitwise("db, again", out[1], out[0])
    assert np.isfinite(out[0]).all()
    check_sum_close("db", out[0], host(dy).astype(np.float64).sum(0),
                    np.abs(host(dy)).sum(0), 1e-6)


@small
@given(st.integers(1, 4), st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.sampled_from([3, 4, 16]),
       st.sampled_from(PRECISIONS), st.booleans(), st.integers(0, 2**31 - 1))
def test_the_q_k_v_weights_gathered_side_by_side(L, heads, E, precision, gaps, seed):
    """Each layer's q, k, v weights, apart in P (a bias after each: `gaps`
    of a bias's length, or of 1 element, which leaves the offsets off the
    chunks of 4), copied bit for bit into one (qkv, D) matrix per layer."""
    q, k, v, W = columns(heads, E)
    D = q.width
    rng = np.random.default_rng(seed)
    widths = (q.width, k.width, v.width)
    offsets, at = [], 0
    for _ in range(L):
        starts = []
        for width in widths:
            starts.append(at)
            at += width * D + (width if gaps else 1)
        offsets.append(starts)
    dtype = op_dtype(precision)
    P = rng.integers(0, 2**16, at).astype(dtype) if precision == "bf16" else \
        rng.standard_normal(at).astype(np.float32)
    out = empty((L, W * D), dtype)
    offsets = np.array(offsets, np.int64)
    kernels(precision).linear_bias_gather_weights(dev(P), out, dev(offsets), offsets,
                                                  [w * D for w in widths])
    want = np.stack([np.concatenate([P[s:s + w * D] for s, w in zip(starts, widths)])
                     for starts in offsets])
    assert np.array_equal(host(out).view(np.uint8), want.view(np.uint8))
