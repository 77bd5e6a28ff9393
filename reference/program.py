"""The reference's training program (SPEC section 13), whose "capture" is a
recorded plan: the bound configuration, policy and buffers, replayed by
calling `reference.step`. The interface it implements, and every backend
with it, is reference/contract.py; the compilation report's records are
reference/compilation.py.

This module is the reference backend: `available()` and
`capture(config, hyper, precision, batch, state, accumulate=None)`.
"""

from __future__ import annotations

import functools

import numpy as np

from .compilation import (REFERENCE_FUNCTIONS, MemoryAnalysis, PartitionOutcome, Resource,
                          compilation_report)
from .config import Config, Hyper
from .contract import (CapturedProgram, ReplayError, TrainingProgram, check_logits_tokens,
                       check_tokens, recompute_mode)
from .params import registry
from .semantic import partitions
from .state import State
from .model import IMPLEMENTED  # noqa: F401  (the family's fields the reference computes)
from .step import forward, row_losses, step, step_activations


class Event:
    """The reference computes synchronously: the event is complete on return."""

    def wait(self) -> None:
        return None


class ReferenceProgram(CapturedProgram):
    """The reference's program: its capture records the plan -- the step
    function bound to the configuration, policy and learner -- and a replay
    calls it on the input slot and the program's own state."""

    backend = "reference"

    def __init__(self, config: Config, hyper: Hyper, precision: str, batch: int, state: State,
                 accumulate: int | None = None):
        self._bind(config, hyper, precision, batch, state, accumulate)
        self._state = state.copy()  # the program owns its buffers, like a device backend
        self._tokens = None
        self._last = None
        self._loss = np.full(1, np.nan, np.float32)  # the captured loss buffer
        self._replays_left = None
        self.replays = 0
        self._plan = None
        self._capture()

    def _record(self) -> None:
        self._plan = functools.partial(step, self.config, policy=self.precision,
                                       hyper=self.hyper, grads=True, accumulate=self.accumulate)

    def _step(self, state, tokens):
        if self._plan is not None:
            return self._plan(state, tokens)
        return step(self.config, state, tokens, self.precision, self.hyper, grads=True,
                    accumulate=self.accumulate)

    def upload_input(self, tokens) -> None:
        self._tokens = check_tokens(self.config, self.batch, tokens)

    def replay(self) -> Event:
        if self._tokens is None:
            raise ReplayError("replay before any input was uploaded")
        self._last = self._step(self._state, self._tokens)
        self._state = self._last.state
        self._loss[0] = self._last.loss
        self.replays += 1
        return Event()

    def _host_loss(self) -> float:
        return float(self._last.loss)

    def _release(self) -> None:
        self._state = self._tokens = self._last = self._plan = self._loss = None

    def _result(self, what: str):
        self._need_replay(what)
        return self._last

    def row_losses(self) -> np.ndarray:
        return self._result("row_losses").row_losses.copy()

    def gradients(self) -> np.ndarray:
        return self._result("gradients").grads.copy()

    def grad_norm(self) -> float:
        return float(self._result("grad_norm").grad_norm)

    def state(self) -> State:
        return self._state.copy()

    def logits(self, tokens) -> np.ndarray:
        tokens = check_logits_tokens(self.config, tokens)
        return forward(self.config, self._state.P, tokens, self.precision)

    def evaluate(self, tokens) -> np.ndarray:
        tokens = check_tokens(self.config, self.batch, tokens, "evaluate input")
        return row_losses(self.config, self._state.P, tokens, self.precision)

    def activations(self, tokens) -> dict:
        tokens = check_tokens(self.config, self.batch, tokens, "activations input")
        return step_activations(self.config, self._state.P, tokens, self.precision)

    def compilation_report(self) -> dict:
        n = registry(self.config).total
        ops = len(self.semantic_graph().operations)
        captured = self._plan is not None
        stages = {
            "semantic_validation": ("applied", ops, ops),
            "replay_safety": ("analyzed", ops, ops),
            "decomposition": ("analyzed", ops, ops),  # one function call per operation
            "fusion": ("analyzed", len(partitions(self.config)), 0),
            "placement": ("inherited", ops, ops),
            "precision": ("applied", ops, ops),
            "kernel_selection": ("inherited", ops, ops),
            "lowering_validation": ("analyzed", ops, ops),
            "memory_planning": ("analyzed", 4, 0),
            "command_recording": ("applied" if captured else
                                  "failed" if self.capture_refused else "not_run", ops,
                                  1 if captured else 0),
        }
        return compilation_report(self.backend, stages, kernels=0, graph_nodes=0,
                                  device_bytes=4 * 3 * n, replays=self.replays,
                                  precision=self.precision, captured=captured,
                                  capture_refused=self.capture_refused or "")

    def _runtime(self) -> dict:
        return {"update_count": self._state.t, "batch": self.batch}

    # -- the analyses of the debug reports

    def _partition_outcomes(self) -> list:
        why = "the reference runs each operation as its own NumPy call: it defines, it fuses nothing"
        return [PartitionOutcome("fallback", why) for _ in partitions(self.config)]

    def _executable_nodes(self):
        return [(o.name,) for o in self.semantic_graph().operations], \
            "one reference function call per operation"

    def _executable_plan(self) -> list:
        graph = self.semantic_graph()
        shape = {t.name: list(t.shape) for t in graph.tensors}
        return [{"node": o.index, "function": REFERENCE_FUNCTIONS[o.kind],
                 "operations": [o.name], "inputs": {n: shape[n] for n in o.inputs},
                 "outputs": {n: shape[n] for n in o.outputs}} for o in graph.operations]

    def _memory_analysis(self) -> MemoryAnalysis:
        n = registry(self.config).total
        B, T = self.batch, self.config.context
        note = "NumPy allocates each intermediate as the step computes it; nothing is planned"
        resources = tuple(Resource(name, size, kind, None, None, False, False, None, note)
                          for name, size, kind in (("P", 4 * n, "state"), ("M", 4 * n, "state"),
                                                   ("V", 4 * n, "state"),
                                                   ("tokens", 8 * B * (T + 1), "input")))
        return MemoryAnalysis(resources, 0, 0, False, note)


def available() -> bool:
    return True


def capture(config: Config, hyper: Hyper, precision: str, batch: int, state: State,
            accumulate: int | None = None, recompute=None) -> TrainingProgram:
    """Record the reference's plan; performs no training update. `accumulate`
    k (default: hyper.accumulate) splits each step into k micro-batches.
    `recompute` (the accelerated backends' memory option, a mode of
    contract.RECOMPUTE_MODES: the gate and up products, or each layer's
    forward, computed again in the backward, the same values) is checked
    and changes nothing here: the reference defines the values and keeps
    every intermediate it checks."""
    recompute_mode(recompute)  # a mode no backend has is refused here too
    return ReferenceProgram(config, hyper, precision, batch, state, accumulate)
