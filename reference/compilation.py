"""The compilation report of a training program (SPEC section 13): the
eleven stages and their states, the records a backend builds its analyses
from (StageRecord, PartitionOutcome, Resource, MemoryAnalysis), and the
JSON documents made of them -- the executable plan (debug_report_json)
and the compilation debug report (compilation_debug_report_json), built
here from a program's own analyses."""

from __future__ import annotations

from dataclasses import dataclass

from .semantic import SemanticGraph, partitions, report_json


SCHEMA = "coppelius.training_compilation.v1"
DEBUG_SCHEMA = "coppelius.training_compilation.v2"  # compilation_debug_report_json
PLAN_SCHEMA = "coppelius.executable_plan.v1"  # debug_report_json
STAGES = ("semantic_validation", "replay_safety", "decomposition", "fusion", "placement",
          "precision", "kernel_selection", "lowering_validation", "memory_planning",
          "synchronization_planning", "command_recording")
STAGE_STATES = ("not_run", "inherited", "analyzed", "applied", "failed")

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


def plan_report_json(program, name: str) -> str:
    """debug_report_json() of a program: its executable plan (the
    backend's `_executable_plan()` rows) as deterministic JSON."""
    nodes = program._executable_plan()
    return report_json({"schema": PLAN_SCHEMA, "name": name, "backend": program.backend,
                        "precision": program.precision, "batch": program.batch,
                        "model": program.config.identity(), "captured": program._captured(),
                        "node_count": len(nodes), "nodes": nodes})


def compilation_debug_report_json(program, name: str) -> str:
    """compilation_debug_report_json() of a program: the stages of its
    compilation_report(), its partitions' outcomes, its lowering and its
    memory analysis (the backend's `_partition_outcomes()`,
    `_executable_nodes()` and `_memory_analysis()`) as deterministic JSON."""
    graph = program.semantic_graph()
    report = program.compilation_report()
    candidates = partitions(program.config)
    outcomes = program._partition_outcomes()
    rows = [{"partition": p.name, "kind": p.kind, "operations": list(p.operations),
             "state": o.state, "reason": o.reason} for p, o in zip(candidates, outcomes)]
    states = [o.state for o in outcomes]
    nodes, why = program._executable_nodes()
    lowering = lowering_analysis(graph, nodes, why)
    return report_json({
        "schema": DEBUG_SCHEMA, "name": name, "backend": program.backend,
        "precision": program.precision, "batch": program.batch,
        "model": program.config.identity(),
        "captured": program._captured(),
        "capture": {"state": ("refused" if program.capture_refused else
                              "captured" if program._captured() else "disabled"),
                    "reason": program.capture_refused or ""},
        "replays": program.replays,
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
        "memory_analysis": memory_document(program._memory_analysis()),
    })


# reference/model.py and step.py call one function per semantic operation:
# its executable nodes are those calls (numpy's own for the adds and the mean)
REFERENCE_FUNCTIONS = {
    "embedding": "layers.embedding.embedding_forward",
    "layernorm": "layers.layernorm.layernorm_forward",
    "rmsnorm": "layers.rmsnorm.rmsnorm_forward",
    "linear": "layers.linear.linear_forward",
    "linear_bias": "layers.linear.linear_bias_forward",
    "rope": "layers.rope.rope_forward",
    "attention": "layers.attention.attention_forward",
    "add": "numpy.add",
    "swiglu": "layers.swiglu.swiglu_forward",
    "crossentropy": "layers.crossentropy.crossentropy_forward",
    "mean": "numpy.mean",
    "crossentropy_backward": "layers.crossentropy.crossentropy_backward",
    "linear_backward": "layers.linear.linear_backward",
    "linear_bias_backward": "layers.linear.linear_bias_backward",
    "layernorm_backward": "layers.layernorm.layernorm_backward",
    "rmsnorm_backward": "layers.rmsnorm.rmsnorm_backward",
    "rope_backward": "layers.rope.rope_backward",
    "attention_backward": "layers.attention.attention_backward",
    "swiglu_backward": "layers.swiglu.swiglu_backward",
    "embedding_backward": "layers.embedding.embedding_backward",
    "gradient_norm": "adamw.gradient_norm",
    "clip_scale": "adamw.clip_scale",
    "adamw": "adamw.adamw_update",
}
