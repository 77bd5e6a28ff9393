"""The training program (SPEC section 13): one fixed-shape step captured once
and replayed. This module holds the interface every backend implements
(`TrainingProgram`, a typing.Protocol), the checks every backend's capture
and replay share, and the reference's own program, whose "capture" is a
recorded plan: the bound configuration, policy and buffers, replayed by
calling `reference.step`.

A backend is a module with `available() -> bool` and
`capture(config, hyper, precision, batch, state, accumulate=None) -> TrainingProgram`
(accumulate k: SPEC 19's micro-batches; None takes hyper.accumulate)
(coppelius.accelerated.BACKENDS lists them). tests/test_program_contract.py
checks every available backend against this contract.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from .config import Config, Hyper, check_precision
from .errors import CoppeliusError, RunError
from .params import registry
from .semantic import SemanticGraph, partitions, report_json, semantic_graph
from .state import State
from .step import check_accumulate, forward, row_losses, step, step_activations

SCHEMA = "coppelius.training_compilation.v1"
DEBUG_SCHEMA = "coppelius.training_compilation.v2"  # compilation_debug_report_json
PLAN_SCHEMA = "coppelius.executable_plan.v1"  # debug_report_json
STAGES = ("semantic_validation", "replay_safety", "decomposition", "fusion", "placement",
          "precision", "kernel_selection", "lowering_validation", "memory_planning",
          "synchronization_planning", "command_recording")
STAGE_STATES = ("not_run", "inherited", "analyzed", "applied", "failed")


class ReplayError(CoppeliusError):
    """A replay whose inputs or state do not match the capture."""


class ProgramReset(ReplayError):
    """Use of a program after reset() released what it captured."""


class MissingCapability(CoppeliusError):
    """The backend lacks what was asked for (a device clock for
    replay_timed(), a completion query): names the backend and the capability."""


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
class StageRecord:
    """One row of the compilation report (SPEC 13)."""

    stage: str  # one of STAGES
    state: str  # one of STAGE_STATES
    inputs: int
    outputs: int


@dataclass(frozen=True)
class PartitionOutcome:
    """What a backend did with one fusion candidate (semantic.partitions)."""

    state: str  # applied, inherited (left to the backend's compiler) or fallback
    reason: str


@dataclass(frozen=True)
class Resource:
    """One captured resource of a program (memory_analysis)."""

    resource: str  # its name: P, G, acts.h1[3], ...
    bytes: int
    kind: str  # state, constant, input, activation, gradient, workspace
    first_access: int | None  # executable node index, or None where not traced
    last_access: int | None
    alias_candidate: bool  # may share storage with a buffer whose lifetime it does not overlap
    aliased: bool  # shares storage with at least one other resource
    offset: int | None = None  # byte offset in the shared arena, if placed in one
    note: str = ""  # why it is not a candidate, where it is not


@dataclass(frozen=True)
class MemoryAnalysis:
    resources: tuple  # Resource
    planned_bytes: int  # the candidates' bytes laid out by the plan (the arena)
    unplanned_bytes: int  # the same buffers allocated one by one
    materialized: bool  # the program runs on the plan's storage
    fallback_reason: str = ""  # why not, where not

    @property
    def potential_savings_bytes(self) -> int:
        return max(0, self.unplanned_bytes - self.planned_bytes)

    @property
    def materialized_savings_bytes(self) -> int:
        return self.potential_savings_bytes if self.materialized else 0


def lowering_analysis(graph: SemanticGraph, nodes, reason: str = "") -> dict:
    """Per semantic operation, how many executable nodes run it. `nodes`: one
    tuple of operation names per executable node (a kernel, a product, a
    function call), or None where the backend cannot attribute its nodes to
    operations (`reason` says why). An operation is direct (one node of its
    own), decomposed (several nodes) or fused (a node shared with other
    operations)."""
    names = [o.name for o in graph.operations]
    if nodes is None:
        return {"attributed": False, "reason": reason, "operation_count": len(names),
                "executable_node_count": None, "direct_operation_count": None,
                "decomposed_operation_count": None, "fused_operation_count": None,
                "fused_node_count": None, "maximum_nodes_per_operation": None,
                "maximum_operations_per_node": None,
                "operations": [{"operation": o.index, "name": o.name,
                                "executable_node_count": None} for o in graph.operations]}
    count = {name: 0 for name in names}
    fused = set()
    for ops in nodes:
        for name in ops:
            if name not in count:
                raise ValueError(f"executable node lowers unknown operation {name!r}")
            count[name] += 1
        if len(ops) > 1:
            fused.update(ops)
    return {
        "attributed": True, "reason": reason, "operation_count": len(names),
        "executable_node_count": len(nodes),
        "direct_operation_count": sum(1 for n in names if count[n] == 1 and n not in fused),
        "decomposed_operation_count": sum(1 for n in names if count[n] > 1),
        "fused_operation_count": len(fused),
        "fused_node_count": sum(1 for ops in nodes if len(ops) > 1),
        "maximum_nodes_per_operation": max(count.values(), default=0),
        "maximum_operations_per_node": max((len(ops) for ops in nodes), default=0),
        "operations": [{"operation": o.index, "name": o.name,
                        "executable_node_count": count[o.name]} for o in graph.operations],
    }


def memory_document(m: MemoryAnalysis) -> dict:
    return {
        "resource_count": len(m.resources),
        "candidate_count": sum(r.alias_candidate for r in m.resources),
        "aliased_count": sum(r.aliased for r in m.resources),
        "unplanned_bytes": m.unplanned_bytes,
        "planned_bytes": m.planned_bytes,
        "potential_savings_bytes": m.potential_savings_bytes,
        "materialized_savings_bytes": m.materialized_savings_bytes,
        "materialized": m.materialized,
        "fallback_reason": m.fallback_reason,
        "resources": [{"resource": r.resource, "bytes": r.bytes, "kind": r.kind,
                       "first_access": r.first_access, "last_access": r.last_access,
                       "alias_candidate": r.alias_candidate, "aliased": r.aliased,
                       "offset": r.offset, "note": r.note} for r in m.resources],
    }


# every method of the TrainingProgram protocol: refused once reset() has run
def _protocol_methods() -> tuple:
    return tuple(name for name, value in vars(TrainingProgram).items()
                 if callable(value) and not name.startswith("_"))


class CapturedProgram:
    """What every backend's program shares: the semantic graph, the debug
    reports built from the backend's own analyses, compilation_stages(),
    replay_count(), and reset() with the refusal of any later use.

    A backend subclass sets `backend`, `config`, `hyper`, `precision`,
    `batch`, counts `replays`, and provides `_release()` (drop what the
    capture holds), `_partition_outcomes()`, `_executable_nodes()`,
    `_executable_plan()` and `_memory_analysis()`."""

    replays = 0
    capture_refused = None  # the reason a capture was refused, or None
    _released = False

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

    # -- the shared surface

    def replay_count(self) -> int:
        return self.replays

    def semantic_graph(self) -> SemanticGraph:
        return semantic_graph(self.config, self.batch, self.precision)

    def semantic_debug_report_json(self, name: str) -> str:
        return self.semantic_graph().debug_report_json(name)

    def compilation_stages(self) -> tuple:
        return tuple(StageRecord(r["stage"], r["state"], r["inputs"], r["outputs"])
                     for r in self.compilation_report()["stages"])

    def submit(self, tokens) -> Submitted:
        """The protocol's submit() for a backend that reads synchronously:
        the step is waited for and its records read at once."""
        self.upload_input(tokens)
        loss, seconds = self.replay_timed_and_wait()
        records = StepRecords(float(loss), self.row_losses(), self.grad_norm(), seconds)
        return Submitted(lambda: records)

    def replay_timed(self):
        raise MissingCapability(f"replay_timed(): backend {self.backend} has no device clock "
                                "(time replay() and wait() with a host clock instead)")

    def reset(self) -> None:
        self.wait()
        self._release()
        self._released = True

    def debug_report_json(self, name: str) -> str:
        nodes = self._executable_plan()
        return report_json({"schema": PLAN_SCHEMA, "name": name, "backend": self.backend,
                            "precision": self.precision, "batch": self.batch,
                            "model": self.config.identity(), "captured": self._captured(),
                            "node_count": len(nodes), "nodes": nodes})

    def compilation_debug_report_json(self, name: str) -> str:
        graph = self.semantic_graph()
        report = self.compilation_report()
        candidates = partitions(self.config)
        outcomes = self._partition_outcomes()
        rows = [{"partition": p.name, "kind": p.kind, "operations": list(p.operations),
                 "state": o.state, "reason": o.reason} for p, o in zip(candidates, outcomes)]
        states = [o.state for o in outcomes]
        nodes, why = self._executable_nodes()
        lowering = lowering_analysis(graph, nodes, why)
        return report_json({
            "schema": DEBUG_SCHEMA, "name": name, "backend": self.backend,
            "precision": self.precision, "batch": self.batch, "model": self.config.identity(),
            "captured": self._captured(),
            "capture": {"state": ("refused" if self.capture_refused else
                                  "captured" if self._captured() else "disabled"),
                        "reason": self.capture_refused or ""},
            "replays": self.replays,
            "stages": report["stages"],
            "dnn_plan": {
                "graph_hash": graph.graph_hash(),
                "source_operation_count": len(graph.operations),
                "captured_operation_count": (sum(1 for o in lowering["operations"]
                                                 if o["executable_node_count"])
                                             if lowering["attributed"] else None),
                "partition_count": len(candidates),
                "recognized_partition_count": len(candidates),
                "applied_partition_count": states.count("applied"),
                "inherited_partition_count": states.count("inherited"),
                "fallback_partition_count": states.count("fallback"),
                "fallback_reasons": sorted({o.reason for o in outcomes if o.state == "fallback"}),
                "partitions": rows,
            },
            "lowering_analysis": lowering,
            "memory_analysis": memory_document(self._memory_analysis()),
        })

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


class Event:
    """The reference computes synchronously: the event is complete on return."""

    def wait(self) -> None:
        return None


# reference/model.py and step.py call one function per semantic operation:
# its executable nodes are those calls (numpy's own for the adds and the mean)
REFERENCE_FUNCTIONS = {
    "embedding": "layers.embedding.embedding_forward",
    "layernorm": "layers.layernorm.layernorm_forward",
    "linear": "layers.linear.linear_forward",
    "rope": "layers.rope.rope_forward",
    "attention": "layers.attention.attention_forward",
    "add": "numpy.add",
    "swiglu": "layers.swiglu.swiglu_forward",
    "crossentropy": "layers.crossentropy.crossentropy_forward",
    "mean": "numpy.mean",
    "crossentropy_backward": "layers.crossentropy.crossentropy_backward",
    "linear_backward": "layers.linear.linear_backward",
    "layernorm_backward": "layers.layernorm.layernorm_backward",
    "rope_backward": "layers.rope.rope_backward",
    "attention_backward": "layers.attention.attention_backward",
    "swiglu_backward": "layers.swiglu.swiglu_backward",
    "embedding_backward": "layers.embedding.embedding_backward",
    "gradient_norm": "adamw.gradient_norm",
    "clip_scale": "adamw.clip_scale",
    "adamw": "adamw.adamw_update",
}


class ReferenceProgram(CapturedProgram):
    """The reference's program: its capture records the plan -- the step
    function bound to the configuration, policy and learner -- and a replay
    calls it on the input slot and the program's own state."""

    backend = "reference"

    def __init__(self, config: Config, hyper: Hyper, precision: str, batch: int, state: State,
                 accumulate: int | None = None):
        check_capture(config, precision, batch, state, accumulate)
        self.config, self.hyper, self.precision, self.batch = config, hyper, precision, batch
        self.accumulate = hyper.accumulate if accumulate is None else accumulate
        self._state = state.copy()  # the program owns its buffers, like a device backend
        self._tokens = None
        self._last = None
        self._loss = np.full(1, np.nan, np.float32)  # the captured loss buffer
        self._replays_left = None
        self.replays = 0
        self._plan = None
        if capture_enabled():
            capture_or_fallback(self, self._record)

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

    def replay_and_wait(self) -> float:
        self.replay().wait()
        return float(self._last.loss)

    def replay_timed_and_wait(self):
        return self.replay_and_wait(), float("nan")  # no device clock

    def loss(self) -> np.ndarray:
        self._need_replay()
        return self._loss

    def is_complete(self) -> bool:
        return True  # every replay has finished when replay() returns

    def wait(self) -> None:
        return None

    def _release(self) -> None:
        self._state = self._tokens = self._last = self._plan = self._loss = None

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

    def diagnostics(self) -> dict:
        report = self.compilation_report()
        report["runtime"] = {"update_count": self._state.t, "batch": self.batch}
        return report

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
            accumulate: int | None = None, recompute: bool = False) -> TrainingProgram:
    """Record the reference's plan; performs no training update. `accumulate`
    k (default: hyper.accumulate) splits each step into k micro-batches.
    `recompute` (the accelerated backends' memory option: the gate and up
    products computed again in the backward, the same values) is accepted
    and changes nothing here: the reference defines the values and keeps
    every intermediate it checks."""
    return ReferenceProgram(config, hyper, precision, batch, state, accumulate)
