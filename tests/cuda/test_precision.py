"""The precision family (accelerated/cuda/precision.py, kernels/precision.cu):
the bfloat16 rounding, bitwise, on the vector and element-by-element paths."""

import ml_dtypes
import numpy as np
import pytest

from coppelius.reference.precision import round_bf16

from .helpers import kernels, dev, empty, placed, empty_placed, as_float, check_bitwise

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


# ------------------------------------------------------------------ precision

def test_round_bf16_matches_reference_bitwise():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-40, 38, 1 << 16)).astype(np.float32)
    # exact ties (a bfloat16 value plus half its last place), both parities
    ties = (rng.standard_normal(4096).astype(ml_dtypes.bfloat16).astype(np.float32)
            .view(np.uint32) | np.uint32(0x8000)).view(np.float32)
    special = np.float32([np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-45,
                          np.finfo(np.float32).max])
    x = np.concatenate([x, ties, special])
    out = empty(x.shape, np.uint16)
    kernels().round_bf16(dev(x), out)
    check_bitwise("round_bf16", as_float(out, "bf16"), round_bf16(x))
    nan = np.float32([np.nan, -np.nan])
    out = empty(nan.shape, np.uint16)
    kernels().round_bf16(dev(nan), out)
    assert np.isnan(as_float(out, "bf16")).all()


@pytest.mark.parametrize("n, aligned", [(1 << 16, True), (4099, True), (4099, False)])
def test_round_bf16_paths(n, aligned):
    """16-byte chunks, the elements left, and misaligned vectors."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 1e3
    out = empty_placed((n,), np.uint16, aligned)
    kernels().round_bf16(placed(x, aligned), out)
    check_bitwise("round_bf16", as_float(out, "bf16"), round_bf16(x))
