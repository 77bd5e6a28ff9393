"""The training program's contract (SPEC section 13): one fixed-shape step
captured once and replayed. This module holds the interface every backend
implements (`TrainingProgram`, a typing.Protocol), the errors it raises,
the checks every backend's capture and replay share, what a step's
submission returns (ReplayEvent, StepRecords, Submitted), what a backend
declares it can do (`Capabilities`), and `CapturedProgram`, the base every
backend's program subclasses: what all of them write the same way lives
there once.

A backend is a module with `available() -> bool` and
`capture(config, hyper, precision, batch, state, accumulate=None) -> TrainingProgram`
(accumulate k: SPEC 19's micro-batches; None takes hyper.accumulate)
(coppelius.accelerated.BACKENDS lists them, and CAPABILITIES what each
declares). The reference's own program is reference/program.py; the
compilation report's records and documents are reference/compilation.py.
tests/test_program_contract.py checks every available backend against this
contract.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from .compilation import StageRecord, compilation_debug_report_json, plan_report_json
from .config import Config, Hyper, check_precision
from .errors import ConfigError, CoppeliusError, RunError
from .params import registry
from .semantic import SemanticGraph, semantic_graph
from .state import State
from .step import check_accumulate


class ReplayError(CoppeliusError):
    """A replay whose inputs or state do not match the capture."""


class ProgramReset(ReplayError):
    """Use of a program after reset() released what it captured."""


class MissingCapability(CoppeliusError):
    """The backend lacks what was asked for (a device clock for
    replay_timed(), a completion query): names the backend and the capability."""


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


def check_capture(config: Config, precision: str, batch: int, state: State,
                  accumulate: int | None = 1) -> None:
    """What every backend's capture checks before it allocates anything: the
    policy, the batch, the accumulation k (None: not checked here; it must
    divide the batch, SPEC 19), the state's vectors and its update count
    (kept on a device as int32 and advanced in the step, so t + 1 must fit)."""
    check_precision(precision)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise RunError(f"batch={batch!r}: must be a positive integer")
    if accumulate is not None:
        check_accumulate(batch, accumulate)
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


# capture(recompute=...)'s modes (docs/SPEC.md "Reading: recomputation"): what
# the backward computes again from the layer's input instead of keeping it.
# "gate-up": each layer's mlp_norm and gate and up products; "block": each
# layer's whole forward, from the residual stream entering it. Either gives
# the step's bits without recompute.
RECOMPUTE_MODES = ("gate-up", "block")


def recompute_mode(value) -> str | None:
    """capture()'s `recompute` as a mode of RECOMPUTE_MODES, or None (off):
    None, False and "none" are off; True is "gate-up" (the one mode there
    was when it was a switch: run.json files and callers holding true). A
    ConfigError names any other value."""
    if value is None or value == "none":
        return None
    if isinstance(value, (bool, int, np.bool_)):  # the switch: on is gate-up
        return "gate-up" if value else None
    if value not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute={value!r}: choose from none, {', '.join(RECOMPUTE_MODES)}")
    return value


def capture_or_fallback(program, record) -> bool:
    """Run `record()`, the backend's capture of its step (SPEC 13). A
    capture the backend refuses -- a RuntimeError or ValueError of its
    library (CUDA's capture errors, cuBLAS's, MLX's compile errors) -- is a
    `failed` command_recording stage: the program then runs the same step
    uncaptured on every replay, `program.capture_refused` holds the reason
    for the report, and one line goes to stderr. Any other exception is a
    bug and propagates. -> whether the step was captured."""
    program.capture_refused = None
    try:
        record()
        return True
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
        program.capture_refused = reason
        print(f"coppelius: backend {program.backend}: capture refused ({reason}); the step "
              "runs uncaptured, with the same results", file=sys.stderr)
        return False


@runtime_checkable
class ReplayEvent(Protocol):
    """What replay() returns: the submitted step, complete once wait() returns."""

    def wait(self) -> None: ...


@dataclass(frozen=True)
class StepRecords:
    """What the run loop writes of one step (SPEC 11), as host copies: the
    mean loss, the (B, T) float32 row losses, the gradient norm before
    clipping (SPEC 7) and the device seconds (NaN without a device clock)."""

    loss: float
    row_losses: np.ndarray
    grad_norm: float
    device_seconds: float
    stops: int = 0  # W > 1 ranks (SPEC 19): nonzero once a rank asked to stop; 0 on one


class Submitted:
    """A step submitted by submit(): records() waits for this step alone
    (not for any step submitted after it) and gives its StepRecords; read
    once, kept."""

    def __init__(self, read):
        self._read, self._records = read, None

    def records(self) -> StepRecords:
        if self._records is None:
            self._records, self._read = self._read(), None
        return self._records


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared as data (coppelius.accelerated.CAPABILITIES)
    so that callers read a field instead of comparing the backend's name.
    tests/test_capabilities.py checks the declarations it can cheaply."""

    default_precision: str  # the policy a run takes when none is given (SPEC 6)
    data_parallel: bool  # runs W > 1 ranks of one step, each on its own device (SPEC 19)
    device_clock: bool  # replay_timed() gives device seconds; else MissingCapability
    device_memory: bool  # a device memory pool whose peak bench reports
    host_data: bool  # the step's buffers live in host memory (limits.step_bytes' on_host)
    # the modes of capture(recompute=...) it honours (RECOMPUTE_MODES); it
    # accepts and ignores the others
    recompute: tuple
    defines: bool  # the definition itself (the reference): others are checked against it
    device: str  # where the step runs on the platforms below: "cuda", "gpu" or "cpu"
    # best_backend(): among the available backends preferred on this platform
    # (platform.system(); () = wherever it is available), the highest preference
    preference: int
    platforms: tuple = ()

    def preferred_on(self, system: str) -> bool:
        return not self.platforms or system in self.platforms

    def device_on(self, system: str) -> str:
        """The device of the step on `system` (platform.system()): elsewhere
        than its platforms the backend runs on the CPU."""
        return self.device if self.preferred_on(system) else "cpu"


# every method of the TrainingProgram protocol: refused once reset() has run
def _protocol_methods() -> tuple:
    return tuple(name for name, value in vars(TrainingProgram).items()
                 if callable(value) and not name.startswith("_"))


class CapturedProgram:
    """What every backend's program shares: the semantic graph, the debug
    reports built from the backend's own analyses, compilation_stages(),
    replay_count(), reset() with the refusal of any later use, and the
    protocol methods every backend writes the same way: replay_and_wait(),
    replay_timed_and_wait(), wait() and is_complete() over the pending
    event, loss(), diagnostics(), and a synchronous submit().

    A backend subclass sets `backend`, `config`, `hyper`, `precision`,
    `batch`, `accumulate` (`_bind()` checks and sets them), counts
    `replays`, keeps the event of a replay not yet waited for in
    `_pending` and the captured loss buffer in `_loss`, and provides
    `replay()`, `_host_loss()` (the last replay's mean loss, read after its
    wait), `_release()` (drop what the capture holds), `_runtime()`,
    `_partition_outcomes()`, `_executable_nodes()`, `_executable_plan()` and
    `_memory_analysis()`."""

    replays = 0
    capture_refused = None  # the reason a capture was refused, or None
    _released = False
    _pending = None  # the event of the last replay submitted and not yet waited for
    _loss = None  # the captured loss buffer: the backend's own array

    def __init_subclass__(cls, **kwargs):
        # Every protocol method of a released program raises ProgramReset:
        # a method here and not at each definition, so none is forgotten.
        super().__init_subclass__(**kwargs)
        for name in _protocol_methods():
            method = getattr(cls, name, None)
            if method is None or getattr(method, "_refused_after_reset", False):
                continue

            def guarded(self, *args, _method=method, _name=name, **kw):
                if self._released:
                    raise ProgramReset(f"{_name}(): the {self.backend} program was reset and "
                                       "holds nothing: capture a new one")
                return _method(self, *args, **kw)

            functools.update_wrapper(guarded, method)
            guarded._refused_after_reset = True
            setattr(cls, name, guarded)

    # -- what the backends' constructors share

    def _bind(self, config: Config, hyper: Hyper, precision: str, batch: int, state: State,
              accumulate: int | None) -> None:
        """check_capture(), then the fields of the protocol (accumulate None:
        the learner's hyper.accumulate)."""
        check_capture(config, precision, batch, state, accumulate)
        self.config, self.hyper, self.precision, self.batch = config, hyper, precision, batch
        self.accumulate = hyper.accumulate if accumulate is None else accumulate

    def _capture(self) -> bool:
        """The backend's `_record()` under capture_or_fallback, unless
        COPPELIUS_NO_CAPTURE turned capture off. -> whether it was captured."""
        return capture_enabled() and capture_or_fallback(self, self._record)

    def _need_replay(self, what: str) -> None:
        if not self.replays:
            raise ReplayError(f"{what}: no step has been replayed yet")

    # -- the shared surface

    def replay_count(self) -> int:
        return self.replays

    def replay_and_wait(self) -> float:
        self.replay().wait()
        self._pending = None
        return self._host_loss()  # the step's one read back

    def replay_timed(self):
        raise MissingCapability(f"replay_timed(): backend {self.backend} has no device clock "
                                "(time replay() and wait() with a host clock instead)")

    def replay_timed_and_wait(self) -> tuple:
        """-> (mean loss, device seconds between the events around the step;
        NaN where the backend has no device clock: the caller's host clock
        measures the step). replay_timed() refuses before it submits."""
        try:
            event = self.replay_timed()
        except MissingCapability:
            return self.replay_and_wait(), math.nan
        seconds = event.device_seconds()  # waits for the step
        self._pending = None
        return self._host_loss(), seconds

    def submit(self, tokens) -> Submitted:
        """The protocol's submit() for a backend that reads synchronously:
        the step is waited for and its records read at once."""
        self.upload_input(tokens)
        loss, seconds = self.replay_timed_and_wait()
        records = StepRecords(float(loss), self.row_losses(), self.grad_norm(), seconds)
        return Submitted(lambda: records)

    def loss(self):
        """The captured loss buffer of the last replay, without waiting."""
        self._need_replay("loss")
        return self._loss

    def is_complete(self) -> bool:
        if self._pending is None:
            return True
        query = getattr(self._pending, "query", None)
        if query is None:
            raise MissingCapability(f"is_complete(): backend {self.backend} cannot query a "
                                    "submitted replay without waiting for it (call wait())")
        return bool(query())

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def reset(self) -> None:
        self.wait()
        self._release()
        self._released = True

    def diagnostics(self) -> dict:
        report = self.compilation_report()
        report["runtime"] = self._runtime()
        return report

    def semantic_graph(self) -> SemanticGraph:
        return semantic_graph(self.config, self.batch, self.precision)

    def semantic_debug_report_json(self, name: str) -> str:
        return self.semantic_graph().debug_report_json(name)

    def compilation_stages(self) -> tuple:
        return tuple(StageRecord(r["stage"], r["state"], r["inputs"], r["outputs"])
                     for r in self.compilation_report()["stages"])

    def debug_report_json(self, name: str) -> str:
        return plan_report_json(self, name)

    def compilation_debug_report_json(self, name: str) -> str:
        return compilation_debug_report_json(self, name)

    def _captured(self) -> bool:
        return bool(self.compilation_report().get("captured", False))


@runtime_checkable
class TrainingProgram(Protocol):
    """One captured training step of one backend (SPEC section 13).

    The program owns its state (P, M, V and the update count t, on its
    device); capture performs no update. Every refusal is a ReplayError
    naming what does not match the capture; after reset() every method
    raises ProgramReset."""

    backend: str  # the backend's name, as in coppelius.accelerated.BACKENDS
    config: Config
    hyper: Hyper
    precision: str  # "fp32" or "bf16" (SPEC 6)
    batch: int  # B, contexts per step
    accumulate: int  # k micro-batches of B/k per step (SPEC 19)

    def upload_input(self, tokens) -> None:
        """(B, T+1) integer ids in [0, V) into the captured input slot,
        after any pending replay has finished with the previous input."""

    def replay(self) -> ReplayEvent:
        """Submit one step (forward, backward, AdamW; t advances on the
        device) without waiting for it."""

    def replay_and_wait(self) -> float:
        """One step, waited for; its mean loss."""

    def replay_timed(self):
        """Submit one step with device timestamps around it: an event with
        wait() and device_seconds() (which waits). MissingCapability, before
        anything is submitted, where the backend has no device clock."""

    def replay_timed_and_wait(self) -> tuple:
        """One step, waited for: (mean loss, device seconds, or NaN where the
        backend has no device clock: the result file's timing record)."""

    def submit(self, tokens) -> Submitted:
        """upload_input(tokens) and one step, without waiting for it or for
        any step before it: the returned object's records() gives the step's
        loss, row losses, gradient norm and device time, which no later
        submission changes. The run loop submits step s+1 before it reads
        step s's records, so the device never waits for the host."""

    def loss(self):
        """The captured loss buffer of the last replay, the backend's own
        array of one element, returned without waiting: its value is the
        mean loss once the replay is complete (wait())."""

    def replay_count(self) -> int:
        """How many steps this program has submitted."""

    def is_complete(self) -> bool:
        """Whether the last submitted replay has finished (True before any);
        MissingCapability where the backend cannot tell without waiting."""

    def wait(self) -> None:
        """Wait for the last submitted replay."""

    def reset(self) -> None:
        """Wait, then release everything the capture holds (buffers, graph,
        compiled function); any later use raises ProgramReset."""

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

    def activations(self, tokens) -> dict:
        """(B, T+1) ids, the capture's shape -> {name: float32 array}: every
        intermediate of one step's forward and backward with the current
        parameters, named as reference.semantic.activation_names; no update,
        no state change, the last replay's results kept. For debugging."""

    def semantic_graph(self) -> SemanticGraph:
        """The backend-independent operations of the step (reference.semantic)."""

    def semantic_debug_report_json(self, name: str) -> str:
        """semantic_graph() as deterministic JSON."""

    def debug_report_json(self, name: str) -> str:
        """The executable plan as deterministic JSON: the kernels, products
        or function calls of the step in order, with their launch shapes."""

    def compilation_stages(self) -> tuple:
        """The eleven StageRecord rows of compilation_report()."""

    def compilation_report(self) -> dict:
        """The JSON document of schema coppelius.training_compilation.v1."""

    def compilation_debug_report_json(self, name: str) -> str:
        """Deterministic JSON of schema coppelius.training_compilation.v2: the
        stages, dnn_plan, lowering_analysis and memory_analysis (SPEC 13)."""

    def diagnostics(self) -> dict:
        """compilation_report() plus the program's runtime counters."""
