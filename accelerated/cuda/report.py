"""The CUDA program's reports (SPEC section 13): the compilation report,
stage by stage, the step's fusion candidates as the CUDA step has them
(partitions), and the memory plan as a MemoryAnalysis."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ...reference.compilation import (MemoryAnalysis, PartitionOutcome, Resource,
                                             compilation_report)
from ...reference.semantic import partitions

from . import attention_fused
from .memory_plan import planning_enabled

if TYPE_CHECKING:
    from .program import CupyProgram


def graph_nodes(graph):
    """Nodes of the captured graph, read from CUDA's DOT dump of it
    (cudaGraphDebugDotPrint through CuPy), or None where CuPy lacks it."""
    dump = getattr(graph, "debug_dot_str", None)
    if dump is None:
        return None
    try:
        return len(set(re.findall(r'"(graph_\d+_node_\d+)"', dump())))
    except Exception:
        return None


def _report(program: CupyProgram) -> dict:
    """What was done to the step, stage by stage (SPEC section 13). Counts:
    the commands (kernel launches, cuBLAS products and cuDNN executions)
    recorded into the graph, and its nodes as CUDA reports them (a product
    or an execution may be more than one kernel)."""
    B = program.batch
    on = program.graph is not None
    rec = program.recorded
    plan = program.plan
    candidates = sum(b.candidate for b in plan.buffers)
    aliased = len(plan.aliased()) if program.memory_planned else 0
    launches, products, calls = rec["kernel_launches"], rec["products"], rec["library_calls"]
    collectives = rec.get("collectives", 0)  # NCCL, W > 1 ranks (SPEC 19)
    commands = launches + products + calls + collectives
    path = program.acts.path
    nodes = graph_nodes(program.graph) if on else None
    bf16 = program.precision == "bf16"
    stages = {
        "semantic_validation": ("applied", 1, 1),
        "replay_safety": ("analyzed", 1, 1),
        "decomposition": ("applied", 1, commands),
        "fusion": ("applied", commands, commands),
        "placement": ("applied", commands, commands),
        "precision": ("applied" if bf16 else "analyzed", products, products),
        "kernel_selection": ("applied", commands, commands),
        "lowering_validation": ("analyzed", commands, commands),
        "memory_planning": ("applied" if program.memory_planned else "analyzed",
                            len(plan.buffers), aliased if program.memory_planned else candidates),
        "synchronization_planning": ("applied", 1, 1),
        "command_recording": ("applied" if on else "failed" if program.capture_refused
                              else "not_run", commands, 1 if on else 0),
    }
    notes = {
        "semantic_validation": "configuration, precision, batch and state checked at capture",
        "replay_safety": "fixed shapes; t and the bias corrections live on the device; the input "
                         "slot is the only per-step host input",
        "decomposition": "hand-written forward and backward: NVRTC kernels and cuBLAS products"
                         + ("; attention: cuDNN graphs" if path.kind == "cudnn" else ""),
        "fusion": "residual add into the norm; loss, softmax and dlogits in one kernel; "
                  + "q,k,v as a single product"
                  + (" over their weights gathered side by side, the biases added after"
                     if program.config.qkv_bias else "")
                  + "; gate,up as a single product; operands rounded by their producers"
                  + ("; causal attention fused (scores never in memory)"
                     if program.acts.fused else ""),
        "placement": "one CUDA device, one non-blocking stream" if program.world == 1 else
                     f"rank {program.rank} of {program.world}: one CUDA device and one "
                     f"non-blocking stream per rank, {program.local_batch} of the batch's "
                     f"{B} contexts here",
        "precision": "bfloat16 operands, float32 accumulation and results" if bf16
                     else "float32 products, CUBLAS_COMPUTE_32F, no TF32",
        "kernel_selection": "cuBLAS heuristics (GemmEx, GemmStridedBatchedEx)"
                            + {"cudnn": "; attention: cuDNN's fused attention (SDPA graphs by "
                                        "cuDNN's heuristics, deterministic backward)",
                               "fused": "; attention: mma.sync bfloat16 tiles",
                               "materialized": ""}[path.kind]
                            + (f"; cuDNN attention not used: {path.reason}" if path.reason
                               else ""),
        "lowering_validation": "the step runs eagerly once before capture",
        "memory_planning": (f"{aliased} activation, scratch and gradient buffers share one "
                            f"arena by "
                            f"lifetime: {plan.savings} bytes saved" if program.memory_planned
                            else "plan not applied: " + _plan_off_reason(program))
                           + "; every buffer allocated before capture, none in the step"
                           + {None: "", "gate-up": "; the gate and up products computed "
                              "again in the backward (recompute gate-up)",
                              "block": "; each layer's forward computed again in the backward "
                              "from its input (recompute block)"}[program.recompute],
        "synchronization_planning": "stream order only; the host waits once per replay"
                                    + ("" if program.world == 1 else
                                       "; the gradient summed (NCCL all-reduce) and the row "
                                       "losses gathered (NCCL all-gather) inside the graph"
                                       if not program.shard else
                                       "; the gradient reduce-scattered, the norm's partials, "
                                       "the row losses and the updated parameters gathered "
                                       "(NCCL) inside the graph: M and V sharded"),
        "command_recording": "CUDA graph by stream capture" if on
                             else f"capture refused ({program.capture_refused}): the step runs "
                                  "eagerly" if program.capture_refused
                             else "disabled by COPPELIUS_NO_CAPTURE: the step runs eagerly",
    }
    return compilation_report(
        program.backend, stages, kernels=len(rec["kernels"]),
        graph_nodes=nodes if nodes is not None else (commands if on else 0),
        device_bytes=program.alloc.bytes, replays=program.replays, precision=program.precision,
        batch=B, accumulate=program.accumulate, world=program.world, rank=program.rank,
        collectives=collectives, captured=on,
        capture_refused=program.capture_refused or "",
        kernel_names=rec["kernels"], kernel_launches=launches, products=products,
        library_calls=calls, attention=path.kind, attention_reason=path.reason,
        memory_planned=program.memory_planned, memory_saved_bytes=(
            plan.savings if program.memory_planned else 0),
        graph_nodes_source=("cudaGraphDebugDotPrint" if nodes is not None
                            else "recorded commands" if on else "no graph"),
        state_memory=state_memory(program), notes=notes)


def state_memory(program: CupyProgram) -> dict:
    """This rank's optimizer state and gradient on the device (SPEC 23),
    from the memory plan's buffers: P (and Pb) whole, M and V whole or this
    rank's shard, G (flat where it carries a sum; else the arena's
    segments, counted at their full size), and the sharded step's shard of
    the summed gradient and norm partials. `master`: the float32 master
    of the shard is the rank's slice of the whole P the forward reads, no
    copy of its own."""
    plan, N = program.plan, program.P.size
    names = ("P", "M", "V", "Pb", "G", "Gshard", "partials")
    state = {b.name: b.nbytes for b in plan.buffers if b.name in names}
    if "G" not in state:  # the arena's segments
        state["G"] = sum(b.nbytes for b in plan.buffers if b.kind == "gradient")
    sh = program.buffers.shard
    total = sum(state.values())
    return {"bytes_per_rank": total, "parameters": N,
            "bytes_per_parameter": round(total / N, 3),
            "optimizer_bytes_per_parameter": round(
                sum(state.get(k, 0) for k in ("P", "M", "V")) / N, 3),
            "sharded": sh is not None, "world": program.world,
            "shard": None if sh is None else {"offset": sh.offset, "length": sh.length,
                                              "size": sh.size},
            "master": "the shard of P (no copy)" if sh is not None else "P",
            "buffers": state}


def _plan_off_reason(program: CupyProgram) -> str:
    if not planning_enabled():
        return "disabled by COPPELIUS_NO_MEMORY_PLAN"
    return "no two activation buffers have disjoint lifetimes"


def _partition_outcomes(program: CupyProgram) -> list:
    """The step's fusion candidates as the CUDA step has them (Model)."""
    c, B = program.config, program.micro_batch  # the activations' batch (B/k, SPEC 19)
    path = program.acts.path
    if path.kind == "cudnn":
        attention = PartitionOutcome("applied", "cuDNN's fused attention (SDPA forward and "
                                                "backward): the (T, T) scores never in memory")
    elif path.kind == "fused":
        attention = PartitionOutcome("applied", "fused kernels (flash-attention style): the "
                                                "(T, T) scores never in memory; cuDNN not used: "
                                                + path.reason)
    elif program.precision != "bf16":
        attention = PartitionOutcome("fallback", "fp32 policy: the fused kernels take "
                                                 "bfloat16 operands")
    elif c.head_dim not in attention_fused.ATTENTION_HEAD_DIMS:
        attention = PartitionOutcome("fallback", f"head dim {c.head_dim}: no fused kernel; "
                                                 f"cuDNN not used: {path.reason}")
    else:
        attention = PartitionOutcome(
            "fallback", f"batch {B} < {attention_fused.ATTENTION_FUSED_MIN_BATCH}: the fused "
                        "kernels' few blocks would leave the GPU idle; scores materialized; "
                        f"cuDNN not used: {path.reason}")
    outcomes = {
        "shared_input_products": PartitionOutcome("applied", "one product over the adjacent "
                                                             "weights"),
        "residual_norm": PartitionOutcome("applied", f"the residual add inside the {c.norm} "
                                                     "kernel"),
        "attention": attention,
        "loss": PartitionOutcome("applied", "row losses and dlogits in one kernel"),
    }
    return [outcomes[p.kind] for p in partitions(c)]


def _memory_analysis(program: CupyProgram) -> MemoryAnalysis:
    plan = program.plan
    on = program.memory_planned
    aliased = plan.aliased() if on else set()
    resources = tuple(
        Resource(b.name, b.nbytes, b.kind, b.first, b.last, b.candidate, i in aliased,
                 b.offset if on and b.kind in ("activation", "gradient") else None, b.note)
        for i, b in enumerate(plan.buffers))
    return MemoryAnalysis(resources, plan.arena_bytes, plan.unplanned_bytes, on,
                          "" if on else _plan_off_reason(program))
