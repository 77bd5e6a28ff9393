"""Sampling on the CuPy backend: its greedy tokens equal the reference's on
the tiny preset (fp32; on the stand-ins where no GPU is)."""

from tests.test_sample_backends import TINY, greedy_on


def test_cupy_greedy_tokens_are_the_reference_s():
    want, got = greedy_on("cupy", TINY, tokens=9)
    assert len(want) == 14 and len(set(want[5:])) > 1 and got == want


def test_last_logits_is_the_window_s_last_row():
    """The padded forward of last_logits (buckets of 64, 128, 256 at T =
    256) against the forward of the window itself, across the buckets'
    edges and at the whole context; a batch of two is refused."""
    import numpy as np
    import pytest

    from coppelius.accelerated import backend_module
    from coppelius.reference.config import Hyper
    from coppelius.reference.contract import ReplayError
    from coppelius.reference.params import initialize
    from coppelius.reference.state import State

    config = TINY
    P = initialize(config, 5)
    program = backend_module("cupy").capture(config, Hyper(), "fp32", 1, State.fresh(P))
    rng = np.random.default_rng(1)
    for n in (1, 63, 64, 65, 200, config.context):
        window = rng.integers(0, config.vocab, (1, n))
        want = program.logits(window)[0, -1]
        got = program.last_logits(window)
        assert got.shape == (config.vocab,)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"n={n}")
    assert sorted(program._windows) == [64, 128, 256]
    with pytest.raises(ReplayError, match="one row"):
        program.last_logits(np.zeros((2, 8), np.int64))
