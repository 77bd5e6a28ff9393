"""Programmatic dependent launch (accelerated/cuda/dependent_launch.py) on
the device: each of the project's kernels in the captured step may start
before the one ahead of it has ended, and waits at its first statement
(AFTER_PRIOR_GRIDS) for it, so the step's bits are those of the step with
plain launches: row losses, G, P, M and V after three steps, for fp32 and
bf16, the project's own products too (Hopper) and the fused attention.
On a GPU only: the CPU stand-ins launch nothing dependent."""

import pytest

from coppelius.conformance.cases import random_state
from coppelius.reference.config import Hyper, preset
from coppelius.accelerated.cuda import dependent_launch, products
from coppelius.accelerated.cuda.cupy_debug import fused_from_batch
from coppelius.accelerated.cuda.program import capture

from .helpers import check_same_steps, cupy, windows

pytestmark = pytest.mark.gpu


def hopper() -> bool:
    return int(cupy.cuda.Device().compute_capability) >= 90


@pytest.mark.parametrize("name, precision, batch", [("test", "fp32", 2), ("test", "bf16", 4),
                                                    ("test-llama", "bf16", 4)])
def test_dependent_launches_give_the_plain_launches_bits(monkeypatch, name, precision, batch):
    if getattr(cupy, "__version__", None) == "emulated" or not hopper():
        pytest.skip("dependent launch: a GPU of compute capability 9.0 or later")
    if precision == "bf16":  # the own products at the test presets' sizes too
        monkeypatch.setenv(products.ENV, "own")
        monkeypatch.setattr(products, "MIN_ROWS", 1)
    config = preset(name)
    state = random_state(config, seed=61, t=2)
    inputs = windows(3, seed=62, config=config, batch=batch)
    with fused_from_batch(4):
        monkeypatch.setenv(dependent_launch.ENV, "off")
        plain = capture(config, Hyper(), precision, batch, state.copy())
        monkeypatch.delenv(dependent_launch.ENV)
        dependent = capture(config, Hyper(), precision, batch, state.copy())
    # one module a process: the same kernels, the setting read at each launch
    assert all(isinstance(f, dependent_launch.DependentKernel)
               for f in dependent.kernels.functions.values())
    assert plain.kernels.functions == dependent.kernels.functions
    if precision == "bf16":  # some products took the own kernels, launched dependent too
        assert dependent.blas.own_calls > 0
        assert all(isinstance(f, dependent_launch.DependentKernel)
                   for f in dependent.blas.kernels.functions.values())
    check_same_steps(plain, dependent, inputs)
