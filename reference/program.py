"""The training program (SPEC section 13): one fixed-shape step captured once
and replayed. This module holds the interface every backend implements
(`TrainingProgram`, a typing.Protocol), the checks every backend's capture
and replay share, and the reference's own program, whose "capture" is a
recorded plan: the bound configuration, policy and buffers, replayed by
calling `reference.step`.

A backend is a module with `available() -> bool` and
`capture(config, hyper, precision, batch, state) -> TrainingProgram`
(coppelius.accelerated.BACKENDS lists them). tests/test_program_contract.py
checks every available backend against this contract.
"""

from __future__ import annotations

import math
import os
from typing import Protocol, runtime_checkable

import numpy as np

from .config import Config, Hyper, check_precision
from .errors import CoppeliusError, RunError
from .params import registry
from .state import State
from .step import forward, row_losses, step

SCHEMA = "coppelius.training_compilation.v1"
STAGES = ("semantic_validation", "replay_safety", "decomposition", "fusion", "placement",
          "precision", "kernel_selection", "lowering_validation", "memory_planning",
          "synchronization_planning", "command_recording")
STAGE_STATES = ("not_run", "inherited", "analyzed", "applied", "failed")


class ReplayError(CoppeliusError):
    """A replay whose inputs or state do not match the capture."""


def compilation_report(backend: str, stages: dict, *, kernels: int, graph_nodes: int,
                       device_bytes: int, replays: int, **extra) -> dict:
    """The JSON document of SPEC section 13. `stages` maps a stage name to
    (state, inputs, outputs); stages not named are reported `not_run`."""
    rows = []
    for name in STAGES:
        state, n_in, n_out = stages.get(name, ("not_run", 0, 0))
        assert state in STAGE_STATES, state
        rows.append({"stage": name, "state": state, "inputs": n_in, "outputs": n_out})
    return {"schema": SCHEMA, "backend": backend, "stages": rows, "kernels": kernels,
            "graph_nodes": graph_nodes, "device_bytes": device_bytes, "replays": replays, **extra}


def check_tokens(config: Config, batch: int, tokens, what="input") -> np.ndarray:
    """(B, T+1) integer ids in [0, V), else ReplayError naming the mismatch."""
    tokens = np.asarray(tokens)
    want = (batch, config.context + 1)
    if tokens.shape != want:
        raise ReplayError(f"{what} shape {tokens.shape} does not match the capture's {want}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ReplayError(f"{what} dtype {tokens.dtype} is not an integer type")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab):
        raise ReplayError(f"{what} holds ids outside [0, {config.vocab})")
    return tokens.astype(np.int64)


def check_logits_tokens(config: Config, tokens) -> np.ndarray:
    """(B', T') integer ids with B' >= 1, 1 <= T' <= T, each in [0, V), for
    logits(); else ReplayError naming the shape or the first bad id."""
    tokens = np.asarray(tokens)
    T, V = config.context, config.vocab
    if (tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer)
            or not 0 < tokens.shape[1] <= T or tokens.shape[0] < 1):
        raise ReplayError(f"logits tokens {tokens.dtype} {tokens.shape}: expected integer ids "
                          f"of shape (B, T) with T <= {T}")
    if tokens.min() < 0 or tokens.max() >= V:
        raise ReplayError(f"logits token id {int(tokens[(tokens < 0) | (tokens >= V)][0])}: "
                          f"out of range [0, {V})")
    return tokens


def check_state(config: Config, state: State) -> None:
    n = registry(config).total
    for name in ("P", "M", "V"):
        a = getattr(state, name)
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (n,):
            raise ReplayError(f"state.{name} must be a host float32 vector of {n} elements")


def capture_enabled() -> bool:
    """COPPELIUS_NO_CAPTURE=1 turns capture off: a backend then runs its step
    eagerly on every replay (for debugging, not for training)."""
    return os.environ.get("COPPELIUS_NO_CAPTURE", "") in ("", "0")


def check_capture(config: Config, precision: str, batch: int, state: State) -> None:
    """What every backend's capture checks before it allocates anything: the
    policy, the batch, the state's vectors and its update count (kept on a
    device as int32 and advanced in the step, so t + 1 must fit)."""
    check_precision(precision)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise RunError(f"batch={batch!r}: must be a positive integer")
    check_state(config, state)
    t = state.t
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < 2**31 - 1:
        raise ReplayError(f"state.t={t!r}: must be an integer update count in [0, 2^31 - 1)")


def check_replay_state(state, owned, backend: str) -> None:
    """A replay runs only on the state its program owns: refuse another
    backend's state, or a state replaced since the capture (SPEC 13)."""
    if getattr(state, "backend", None) != backend:
        raise ReplayError(f"replay with {getattr(state, 'backend', type(state).__name__)!r} state: "
                          f"this program replays only the state of backend {backend!r}")
    if state is not owned:
        raise ReplayError("replay after the optimizer state was replaced: capture a new "
                          "program from the new state")


@runtime_checkable
class ReplayEvent(Protocol):
    """What replay() returns: the submitted step, complete once wait() returns."""

    def wait(self) -> None: ...


@runtime_checkable
class TrainingProgram(Protocol):
    """One captured training step of one backend (SPEC section 13).

    The program owns its state (P, M, V and the update count t, on its
    device); capture performs no update. Every refusal is a ReplayError
    naming what does not match the capture."""

    backend: str  # the backend's name, as in coppelius.accelerated.BACKENDS
    config: Config
    hyper: Hyper
    precision: str  # "fp32" or "bf16" (SPEC 6)
    batch: int  # B, contexts per step

    def upload_input(self, tokens) -> None:
        """(B, T+1) integer ids in [0, V) into the captured input slot,
        after any pending replay has finished with the previous input."""

    def replay(self) -> ReplayEvent:
        """Submit one step (forward, backward, AdamW; t advances on the
        device) without waiting for it."""

    def replay_and_wait(self) -> float:
        """One step, waited for; its mean loss."""

    def replay_timed_and_wait(self) -> tuple:
        """One step, waited for: (mean loss, device seconds, or NaN where the
        backend has no device clock)."""

    def row_losses(self) -> np.ndarray:
        """(B, T) float32: the last replay's row losses (SPEC 4)."""

    def gradients(self) -> np.ndarray:
        """(N,) float32: the last replay's gradient vector G (SPEC 5), before
        any clipping."""

    def grad_norm(self) -> float:
        """The last replay's gradient norm ||G|| before clipping (SPEC 7)."""

    def state(self) -> State:
        """A host copy of P, M, V and t as they are now."""

    def logits(self, tokens) -> np.ndarray:
        """(B', T') ids, any B' and T' <= T -> (B', T', V) float32 logits with
        the current parameters, under the program's policy; no update."""

    def evaluate(self, tokens) -> np.ndarray:
        """(B, T+1) ids, the capture's shape -> (B, T) float32 row losses with
        the current parameters under the program's policy: a forward-only
        program (SPEC 18), captured on first use; no update, no state change."""

    def compilation_report(self) -> dict:
        """The JSON document of schema coppelius.training_compilation.v1."""

    def diagnostics(self) -> dict:
        """compilation_report() plus the program's runtime counters."""


class Event:
    """The reference computes synchronously: the event is complete on return."""

    def wait(self) -> None:
        return None


class ReferenceProgram:
    backend = "reference"

    def __init__(self, config: Config, hyper: Hyper, precision: str, batch: int, state: State):
        check_capture(config, precision, batch, state)
        self.config, self.hyper, self.precision, self.batch = config, hyper, precision, batch
        self._state = state.copy()  # the program owns its buffers, like a device backend
        self._tokens = None
        self._last = None
        self._replays = 0

    def upload_input(self, tokens) -> None:
        self._tokens = check_tokens(self.config, self.batch, tokens)

    def replay(self) -> Event:
        if self._tokens is None:
            raise ReplayError("replay before any input was uploaded")
        self._last = step(self.config, self._state, self._tokens, self.precision, self.hyper,
                          grads=True)
        self._state = self._last.state
        self._replays += 1
        return Event()

    def replay_and_wait(self) -> float:
        self.replay().wait()
        return float(self._last.loss)

    def replay_timed_and_wait(self):
        return self.replay_and_wait(), math.nan  # no device clock

    def _need_replay(self):
        if self._last is None:
            raise ReplayError("no step has been replayed yet")
        return self._last

    def row_losses(self) -> np.ndarray:
        return self._need_replay().row_losses.copy()

    def gradients(self) -> np.ndarray:
        return self._need_replay().grads.copy()

    def grad_norm(self) -> float:
        return float(self._need_replay().grad_norm)

    def state(self) -> State:
        return self._state.copy()

    def logits(self, tokens) -> np.ndarray:
        tokens = check_logits_tokens(self.config, tokens)
        return forward(self.config, self._state.P, tokens, self.precision)

    def evaluate(self, tokens) -> np.ndarray:
        tokens = check_tokens(self.config, self.batch, tokens, "evaluate input")
        return row_losses(self.config, self._state.P, tokens, self.precision)

    def compilation_report(self) -> dict:
        n = registry(self.config).total
        stages = {
            "semantic_validation": ("applied", 1, 1),
            "replay_safety": ("analyzed", 1, 1),
            "placement": ("inherited", 1, 1),
            "precision": ("applied", 1, 1),
            "kernel_selection": ("inherited", 1, 1),
            "command_recording": ("applied", 1, 1),
        }
        return compilation_report(self.backend, stages, kernels=0, graph_nodes=0,
                                  device_bytes=4 * 3 * n, replays=self._replays,
                                  precision=self.precision)

    def diagnostics(self) -> dict:
        report = self.compilation_report()
        report["runtime"] = {"update_count": self._state.t, "batch": self.batch}
        return report


def available() -> bool:
    return True


def capture(config: Config, hyper: Hyper, precision: str, batch: int, state: State) -> TrainingProgram:
    """Record the reference's plan; performs no training update."""
    return ReferenceProgram(config, hyper, precision, batch, state)
