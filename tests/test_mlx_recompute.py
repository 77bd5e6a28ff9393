"""Recomputation on MLX (accelerated/mlx_backend.py, docs/SPEC.md "Reading:
recomputation"): with each layer's gate and up products, or each layer's
whole forward, one mx.checkpoint, the step's bits are those of the step
that keeps every activation, for every family preset, fp32 and bf16, and
with accumulation."""

import numpy as np
import pytest

from coppelius.conformance.cases import random_state
from coppelius.reference.config import Hyper, preset

mx = pytest.importorskip("mlx.core")
from coppelius.accelerated import mlx_backend  # noqa: E402

B = 2


def windows(n, seed, config):
    return np.random.default_rng(seed).integers(0, config.vocab,
                                                size=(n, B, config.context + 1))


def steps(program, inputs):
    """Row losses of each step, then G, P, M, V after the last, as bytes."""
    out = []
    for tokens in inputs:
        program.upload_input(tokens)
        program.replay_and_wait()
        out.append(program.row_losses().tobytes())
    state = program.state()
    return out + [program.gradients().tobytes()] + [getattr(state, n).tobytes() for n in "PMV"]


@pytest.mark.parametrize("name", ["test", "test-llama", "test-qwen", "test-stablelm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recomputing_each_block_keeps_every_bit(name, precision):
    """recompute="block" (each layer's forward one mx.checkpoint, from the
    residual stream entering it): after 2 steps the same row losses, G, P,
    M, V, bit for bit, as the step that keeps every activation; accumulation
    (k = 2) on the first preset."""
    config = preset(name)
    state = random_state(config, seed=61, t=3)
    inputs = windows(2, 62, config)
    for k in ((1, 2) if name == "test" else (1,)):
        kept = mlx_backend.capture(config, Hyper(), precision, B, state.copy(), accumulate=k)
        again = mlx_backend.capture(config, Hyper(), precision, B, state.copy(), accumulate=k,
                                    recompute="block")
        assert again.recompute == again.model.recompute == "block" and kept.recompute is None
        want, got = steps(kept, inputs), steps(again, inputs)
        labels = ["row losses 1", "row losses 2", "G", "P", "M", "V"]
        for label, a, b in zip(labels, got, want):
            assert a == b, f"{name} {precision} k={k}: {label} differs with recompute block"
