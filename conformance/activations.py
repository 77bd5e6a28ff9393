"""Layer-by-layer debugging against the reference (`conformance
--activations`, SPEC 13 and 14): every intermediate of one step's forward
and backward on a backend (`program.activations(tokens)`) against the
reference's (`reference.step_activations`), under the one naming scheme of
reference/semantic.py, in the order the step computes them. The first
tensor beyond its tolerance is where the backend first goes wrong: every
later one inherits its error.

Tolerances: a forward intermediate has the logits' (one forward), a
backward one the gradients' (SPEC 14, conformance/tolerances.py).
"""

from __future__ import annotations

import re

from ..reference.semantic import activation_names

from .suite import Row, compare
from .tolerances import tolerance

_LAYER = re.compile(r"^layers\.(\d+)\.")


def activation_rows(config, got: dict, want: dict, precision: str) -> list:
    """One Row per intermediate of the naming scheme, in the step's order:
    check "forward" or "backward", the tensor's name; `got` the backend's
    intermediates, `want` the reference's. A name the backend lacks, or a
    shape that differs, fails its row."""
    rows = []
    for name, check in activation_names(config):
        reference_value = want[name]
        tol = tolerance(check, precision)
        if name not in got or got[name].shape != reference_value.shape:
            shape = getattr(got.get(name), "shape", "missing")
            rows.append(Row(check, f"{name} (shape {shape}, reference "
                                   f"{tuple(reference_value.shape)})",
                            float("nan"), tol, False, (), float("nan"), float("nan")))
            continue
        rows.append(compare(check, name, got[name], reference_value, tol))
    return rows


def first_divergence(rows: list):
    """The first failing row in the step's order, or None."""
    return next((r for r in rows if not r.passed), None)


def layer_of(name: str) -> str:
    """`layers.3.mlp.h` -> "layer 3"; names outside the layers as they are."""
    m = _LAYER.match(name)
    return f"layer {m.group(1)}" if m else name.split(" ")[0]
