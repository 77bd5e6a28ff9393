"""The one table of conformance tolerances (SPEC section 14) and the error
measure they bound.

Error of a tensor: ||a - b|| / ||b||, the Frobenius norms taken in float64,
`a` the backend's value and `b` the reference's. NaN never passes: any
non-finite value on either side makes the error NaN and the check fails.

How the numbers were chosen:
- fp32: the reference and a backend run the same float32 arithmetic in a
  different order (blocked matrix products, fused reductions). Summation
  order alone moves a float32 result by a few ulp times sqrt(terms), a
  relative error around 1e-7..1e-6 for the sizes here, so 1e-5 on one
  forward (logits, row losses, mean loss) and on one update (P, M, V) leaves
  an order of magnitude of headroom while a wrong formula (a missing scale,
  a wrong rope pair, no weight decay) shows at 1e-3 or more. Gradients pass
  through every layer twice (forward, then backward) and their small
  entries cancel, so they get 1e-4. The 20-step mean-loss trajectory
  compounds 20 updates; Adam's normalisation keeps the drift bounded, 1e-4.
- bf16: each matrix-product operand is rounded to 8 significant bits
  (unit roundoff 2^-9 ~ 2e-3). Two implementations that accumulate in a
  different order can round an intermediate to a neighbouring bfloat16
  value, so one step may differ by a few roundoffs: 1e-2 on forward and
  update, 3e-2 on gradients and the trajectory, which accumulate more
  roundings. A wrong formula still lands far above these; a backend that
  skips one operand's rounding differs by about one roundoff and passes
  (the bf16 tolerances cannot see that, and are not meant to).
- P after the first update from zero moments is lr * g / (|g| + epsilon),
  close to lr * sign(g): where |g| is within a few epsilon of zero, a
  gradient difference far inside the gradient tolerance moves that element
  by up to lr. On `tiny` (1M parameters) a correct fp32 backend can meet
  such an element; the suite then says whether the backend's update matches
  the reference AdamW of its own gradient (suite.update_diagnosis).
- The gradient norm (SPEC 7) is a sum over every gradient element: its
  error is at most the gradient vector's, so it shares the gradient row.
  Held-out row losses (SPEC 18) are a forward: the row-losses row.
- Exact resume is bitwise (tolerance 0): the same backend and policy must
  give the same bits whether or not the run was split (SPEC section 9).
"""

from __future__ import annotations

import math

import numpy as np

# check -> {precision: tolerance}. "update" covers P, M and V after one update.
TOLERANCES = {
    "logits": {"fp32": 1e-5, "bf16": 1e-2},
    "row_losses": {"fp32": 1e-5, "bf16": 1e-2},
    "loss": {"fp32": 1e-5, "bf16": 1e-2},
    "gradient": {"fp32": 1e-4, "bf16": 3e-2},
    "update": {"fp32": 1e-5, "bf16": 1e-2},
    "trajectory": {"fp32": 1e-4, "bf16": 3e-2},
    "resume": {"fp32": 0.0, "bf16": 0.0},
}

# the checks P, M and V share the "update" row of the table
# layer-by-layer intermediates (conformance/activations.py): a forward one is
# one forward deep at most, as the logits; a backward one is a gradient
_TABLE_ROW = {"P": "update", "M": "update", "V": "update", "t": "resume", "norm": "gradient",
              "eval": "row_losses", "forward": "logits", "backward": "gradient"}


def tolerance(check: str, precision: str) -> float:
    return TOLERANCES[_TABLE_ROW.get(check, check)][precision]


def relative_error(a, b):
    """||a - b|| / ||b|| in float64 and the worst element.

    Returns (error, index, a_value, b_value): `index` is the multi-index of
    the element with the largest |a - b| (or the first non-finite element of
    `a`, then of `b`). The error is NaN when either side holds a non-finite
    value, 0 when both are exactly zero, inf when only `b` is zero."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape {a.shape} != reference shape {b.shape}")
    if a.size == 0:
        return 0.0, (), math.nan, math.nan
    bad = ~np.isfinite(a)
    if not bad.any():
        bad = ~np.isfinite(b)
    if bad.any():
        flat = int(np.argmax(bad))
        index = np.unravel_index(flat, a.shape)
        return math.nan, tuple(int(i) for i in index), float(a.flat[flat]), float(b.flat[flat])
    diff = np.abs(a - b)
    flat = int(np.argmax(diff))
    index = tuple(int(i) for i in np.unravel_index(flat, a.shape))
    num = float(np.linalg.norm(diff.ravel()))
    den = float(np.linalg.norm(b.ravel()))
    if den == 0.0:
        error = 0.0 if num == 0.0 else math.inf
    else:
        error = num / den
    return error, index, float(a.flat[flat]), float(b.flat[flat])


def passes(error: float, tol: float) -> bool:
    """NaN never passes (NaN <= tol is False); a tolerance of 0 asks for 0."""
    return bool(error <= tol)
