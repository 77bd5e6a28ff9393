"""Precision policies (SPEC section 6).

`fp32`: every operation in float32. `bf16`: each operand of each matrix
product is rounded to bfloat16 (round to nearest even), the product is
accumulated in float32 and its result is float32. `matmul` is the only place
the policy acts; everything else in the reference is float32 either way.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding the nearest bfloat16 value (ties to even;
    NaN stays NaN, overflow past the largest bfloat16 becomes inf).

    ml_dtypes' cast is the rounding (one C loop each way, which matters for
    the 57.7M-parameter preset); tests/test_precision.py checks it against an
    independent bit-arithmetic rounding on ties and specials."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def operand(x: np.ndarray, policy: str) -> np.ndarray:
    """A matrix-product operand under `policy` (float64 inputs are left exact
    under fp32, which is how the finite-difference tests run)."""
    if policy == "bf16":
        return round_bf16(x)
    return x


def matmul(a: np.ndarray, b: np.ndarray, policy: str) -> np.ndarray:
    """a @ b with both operands rounded by the policy; result in a's dtype."""
    return np.matmul(operand(a, policy), operand(b, policy))
