"""Training state and the result of one step.

Gradient contract (stated once): every backward function returns *fresh*
arrays; the model backward assembles them into one fresh flat vector G.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class State:
    """Flat float32 vectors P (parameters), M and V (AdamW moments), and the
    update count t (updates applied so far; the next update is t + 1)."""

    P: np.ndarray  # (N,) float32
    M: np.ndarray  # (N,) float32
    V: np.ndarray  # (N,) float32
    t: int = 0

    @classmethod
    def fresh(cls, P: np.ndarray) -> "State":
        return cls(P=P, M=np.zeros_like(P), V=np.zeros_like(P), t=0)

    def copy(self) -> "State":
        return State(self.P.copy(), self.M.copy(), self.V.copy(), self.t)


@dataclass
class StepResult:
    loss: np.float32  # mean of row_losses, float32
    row_losses: np.ndarray  # (B, T) float32, SPEC section 4
    grads: np.ndarray | None  # (N,) float32 gradient of the mean loss, or None
    state: State  # the state after the update
    grad_norm: np.float32 = np.float32("nan")  # ||G|| before clipping (SPEC 7)
