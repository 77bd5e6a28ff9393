"""The embedding family (accelerated/cuda/embedding.py, kernels/embedding.cu)
against the reference's layer functions (hypothesis-drawn shapes and
values; on a GPU, or on dev/cuda/emulated's stand-ins: conftest.py)."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from coppelius.reference.layers.embedding import embedding_backward

from .helpers import small, kernels, dev, host, empty, placed, empty_placed, check_bitwise

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 50),
       st.sampled_from([1, 5, 32, 70, 512, 1000, 1024, 1030, 2304, 4100]), st.booleans(),
       st.integers(0, 2**31 - 1))
@example(2, 17, 9, 2304, True, 1)  # rows wider than a block's 1024 features: slices
@example(1, 33, 40, 1030, False, 2)
def test_embedding_forward_backward(Bn, T, V, D, aligned, seed):
    """The gather, and the gather gradient added to the unembedding gradient
    in position order: bitwise the reference's d_head + np.add.at."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((V, D)).astype(np.float32)
    ids = rng.integers(0, min(V, 4), (Bn, T + 1))  # few ids: many repeats
    k = kernels()
    x = empty_placed((Bn * T, D), aligned=aligned)
    k.embedding_forward(dev(ids.astype(np.int32)), T + 1, T, dev(W), x)
    check_bitwise("gather", host(x), W[ids[:, :T].reshape(-1)])
    dx = rng.standard_normal((Bn * T, D)).astype(np.float32)
    d_head = rng.standard_normal((V, D)).astype(np.float32)
    dW = dev(d_head)
    index = empty((V, 2), np.int32)
    k.embedding_backward(placed(dx, aligned), dev(ids.astype(np.int32)), T + 1, T, dW, index)
    check_bitwise("dW", host(dW), d_head + embedding_backward(dx.reshape(Bn, T, D), ids[:, :T], V))


@pytest.mark.parametrize("Bn, T, V, D, ids", [(3, 900, 37, 24, "uniform"), (2, 700, 300, 64, "one"),
                                              (1, 1000, 5000, 8, "distinct")])
def test_embedding_backward_many_positions(Bn, T, V, D, ids):
    """More positions than one pass of a block, with ids repeated throughout,
    one id everywhere (its block walks every position), or all distinct."""
    rng = np.random.default_rng(5)
    ids = {"uniform": lambda: rng.integers(0, V, (Bn, T + 1)),
           "one": lambda: np.full((Bn, T + 1), 7),
           "distinct": lambda: rng.permutation(V)[:Bn * (T + 1)].reshape(Bn, T + 1)}[ids]()
    dx = rng.standard_normal((Bn * T, D)).astype(np.float32)
    d_head = rng.standard_normal((V, D)).astype(np.float32)
    dW = dev(d_head)
    index = empty((V, 2), np.int32)
    kernels().embedding_backward(dev(dx), dev(ids.astype(np.int32)), T + 1, T, dW, index)
    check_bitwise("dW", host(dW), d_head + embedding_backward(dx.reshape(Bn, T, D), ids[:, :T], V))


@small
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 50),
       st.sampled_from([1, 5, 32, 70, 512, 1000, 2304]), st.booleans(),
       st.integers(0, 2**31 - 1))
@example(2, 11, 30, 2304, True, 3)
def test_the_untied_embedding_gradient_is_the_gather_gradient_alone(Bn, T, V, D, aligned, seed):
    """accumulate=False (SPEC 21, untied): dW, poisoned, is written whole:
    bitwise the reference's gather gradient, the rows of ids absent from
    the batch zero."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(V, 6), (Bn, T + 1))  # some ids absent where V > 6
    dx = rng.standard_normal((Bn * T, D)).astype(np.float32)
    dW = empty_placed((V, D), aligned=aligned)
    index = empty((V, 2), np.int32)
    kernels().embedding_backward(placed(dx, aligned), dev(ids.astype(np.int32)), T + 1, T, dW,
                                 index, accumulate=False)
    want = embedding_backward(dx.reshape(Bn, T, D), ids[:, :T], V)
    check_bitwise("dW", host(dW), want)
    absent = np.setdiff1d(np.arange(V), ids[:, :T])
    assert (host(dW)[absent] == 0).all()
