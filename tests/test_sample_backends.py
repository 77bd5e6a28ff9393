"""Sampling on a backend (coppelius sample --backend): the greedy tokens of
the backend's forward equal the reference's on the tiny preset, and the
command line takes --backend. The CuPy backend's is tests/cuda/test_sample.py."""

import numpy as np
import pytest

from coppelius import sample
from coppelius.reference.config import PRESETS
from coppelius.reference.errors import ConfigError
from coppelius.reference.params import initialize

TINY = PRESETS["tiny"]


def greedy_on(backend, config, tokens=12, precision="fp32"):
    """(the reference's greedy ids, the backend's) from a prompt of 5 ids."""
    # the initialization's tied embedding makes "the last id again" the
    # argmax everywhere: perturbed, the greedy ids change along the way
    P = initialize(config, 3)
    P = (P + np.random.default_rng(0).normal(0, 0.05, P.shape)).astype(np.float32)
    prompt = [11, 7, 300, 5, 42]
    want = sample.generate(config, P, prompt, tokens)
    got = sample.generate(config, P, prompt, tokens,
                          logits_of=sample.backend_logits(backend, config, P, precision))
    return want, got


@pytest.mark.mlx
def test_mlx_greedy_tokens_are_the_reference_s():
    pytest.importorskip("mlx.core")
    want, got = greedy_on("mlx", TINY)
    assert len(want) == 17 and len(set(want[5:])) > 1 and got == want


def test_the_reference_samples_in_fp32_only():
    P = initialize(PRESETS["test"], 0)
    assert sample.backend_logits("reference", PRESETS["test"], P) is None
    with pytest.raises(ConfigError, match="--precision bf16"):
        sample.backend_logits("reference", PRESETS["test"], P, "bf16")
