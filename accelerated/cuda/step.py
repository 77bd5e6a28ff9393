"""The CUDA training step: forward, backward, the norm, clipping and AdamW
on the step's buffers (run_step, the work a capture records), the
process's compiled kernels per precision, and the step's memory plan by a
dry run of this very step (memory_plan)."""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from ...reference.config import Config, Hyper

from . import adamw, compile
from .buffers import Activations, Gradient, StepBuffers, allocate_state
from .cublas import Cublas
from .products import Products, own_products
from .distributed import Collectives
from .memory_plan import (Buffer, CommandLog, MemoryPlan, VirtualArray, VirtualBuffers, liveness,
                          place)
from .model import Model, model_for


_KERNELS = {}  # precision -> Kernels: each policy's module is compiled once per process


def kernels_for(precision: str):
    if precision not in _KERNELS:
        _KERNELS[precision] = compile.Kernels(precision)
    return _KERNELS[precision]


def step_gradients(config: Config, s: StepBuffers, alloc) -> tuple:
    """(the step's Gradient, micro-batch 1..'s or None): s's flat ones, or
    (k = 1, one rank) the segments, from `alloc` (the activations')."""
    if s.grad is not None:
        return s.grad, s.grad_micro
    return Gradient.segments(config, alloc), None


def run_step(model: Model, kernels, a: Activations, s: StepBuffers, micro: Model = None,
             collectives=None) -> None:
    """Forward, backward and AdamW on the input slot: the captured work.
    With s.accumulate k > 1 (SPEC 19) the activations hold one micro-batch
    of m = b/k contexts: k forward and backward passes over the slot's rows
    [i*m, (i+1)*m), micro-batch 0's gradient into G, each later one's into
    s.Gmicro (by `micro`, the model over it) and added into G; each pass's
    row losses into its slice of s.rows. With W = s.world > 1 ranks the
    slot holds this rank's b = B/W contexts and every loss gradient is
    scaled by 1/(B*T) all the same; then `collectives` sum G over the
    ranks and gather every rank's row losses in rank order, which is the
    batch order (accelerated/cuda/distributed.py). The loss is the mean over
    all B*T rows; then the norm, clipping and AdamW on G, as without."""
    T = model.config.context
    k, W = s.accumulate, s.world
    if k == 1 and W == 1:
        model.forward(a, s.ids, T + 1)
        model.backward(a, s.ids, T + 1)
    else:
        m, rows = a.B, a.B * k * W * T  # rows: the whole batch's B*T
        for i in range(k):
            ids = s.ids[i * m:(i + 1) * m]
            mm = model if i == 0 else micro
            mm.forward(a, ids, T + 1)
            mm.backward(a, ids, T + 1, rows=rows, ce=s.rows[i * m * T:(i + 1) * m * T])
            if i:
                model.at()  # the sum of the gradients: no operation of its own
                kernels.accumulate_gradient(s.G, s.Gmicro)
        if W > 1:
            model.at()  # the sum over the ranks: part of the gradient, as the sum above
            if s.shard is not None:  # this rank's shard of the sum alone (SPEC 23)
                collectives.reduce_scatter_sum(s.shard.G, s.Gshard)
            else:
                collectives.all_reduce_sum(s.G)
            collectives.all_gather(s.rows, s.gathered)
            collectives.all_reduce_sum(s.stop)
        model.at("loss.mean")
        kernels.mean_loss(s.gathered if W > 1 else s.rows, a.loss)
    if s.shard is not None:
        run_step_tail_sharded(model, kernels, s, collectives)
        return
    run_step_tail(model, kernels, s)


def run_step_tail_sharded(model: Model, kernels, s: StepBuffers, collectives) -> None:
    """The step after the gradient's reduce-scatter, with the optimizer
    state sharded (SPEC 23; accelerated/cuda/distributed.py): the norm from
    every rank's partial sums of its shard's squares, gathered and summed in
    one fixed order (the same norm and clip scale on every rank), AdamW on
    this rank's shard of P, M, V (and Pb), then the updated shards of P
    (and Pb) gathered from every rank, in place."""
    sh, G = s.shard, s.grad_shard
    own = slice(sh.offset, sh.offset + sh.length)
    model.at("gradient_norm", "clip")
    partial = s.partial[:adamw.NORM_BLOCKS]
    kernels.gradient_sum_squares(G, partial)
    collectives.all_gather(partial, s.partials)
    kernels.gradient_norm_clip(s.partials, s.norm, s.clip)  # and scale
    model.at("adamw")
    kernels.adamw_bias_corrections(s.t, s.c, *s.betas, s.rates)  # t += 1 on the device
    kernels.adamw_update(s.P[own], s.M[:sh.length], s.V[:sh.length], G, s.decay,
                         None if s.Pb is None else s.Pb[own], s.c, s.norm, s.adamw,
                         base=sh.offset)
    mine = slice(sh.offset, sh.offset + sh.size)  # the padded shard: S elements on every rank
    collectives.all_gather(sh.P[mine], sh.P)
    if sh.Pb is not None:
        collectives.all_gather(sh.Pb[mine], sh.Pb)


def run_step_tail(model: Model, kernels, s: StepBuffers) -> None:
    """The step after its gradient model.G: the norm, clipping and AdamW (SPEC 7)."""
    G = model.G
    if s.clip == 0:
        # clipping off: the norm is only recorded, so AdamW's own pass over G
        # sums its squares (SPEC 7: float32, any order) and no pass of its own
        # reads G's 4 N bytes again
        model.at("adamw", "gradient_norm")
        kernels.adamw_bias_corrections(s.t, s.c, *s.betas, s.rates)  # t += 1 on the device
        blocks = kernels.adamw_update(s.P, s.M, s.V, G, s.decay, s.Pb, s.c, s.norm, s.adamw,
                                      partial=s.partial)
        model.at("gradient_norm", "clip")
        kernels.gradient_norm_finish(s.partial, blocks, s.norm)
        return
    model.at("gradient_norm", "clip")
    kernels.gradient_norm(G, s.partial[:adamw.NORM_BLOCKS], s.norm, s.clip)  # and scale
    model.at("adamw")
    kernels.adamw_bias_corrections(s.t, s.c, *s.betas, s.rates)  # t += 1 on the device
    kernels.adamw_update(s.P, s.M, s.V, G, s.decay, s.Pb, s.c, s.norm, s.adamw)


# Activations buffers that keep storage of their own whatever their lifetimes
PINNED = {"ce": "row losses: read by the host after a replay",
          "ln_table": "the norms' partials' addresses: written at allocation, read every step",
          "loss": "the loss: read by the host after a replay",
          "G.table": "the gradient's segments' addresses: written at allocation, read every step"}
KINDS = {"P": "state", "M": "state", "V": "state", "G": "state", "Pb": "state", "t": "state",
         "Gshard": "state", "partials": "state",
         "ids": "input", "workspace": "workspace", "Gmicro": "workspace", "rows": "state",
         "gathered": "state", "stop": "state", "qkv_weights": "workspace"}


def memory_plan(config: Config, hyper: Hyper, precision: str, batch: int,
                accumulate: int = 1, world: int = 1, recompute: str | None = None,
                shard: bool = False, rank: int = 0) -> MemoryPlan:
    """The step's dry run (accelerated/cuda/memory_plan.py): every buffer, the
    commands in order with what they touch, each activation's lifetime, and
    the activations laid out in one arena. Allocates nothing; needs no GPU.
    With accumulate k and W = world ranks the activations are those of a
    micro-batch of B/(W*k); the collectives are logged, not run. recompute:
    the mode of Activations (None, "gate-up", "block"): the dry run is of
    the step that recomputes, so the lifetimes are its own.
    shard: the optimizer state sharded over the ranks (SPEC 23), rank's step
    (its shard's size sets AdamW's launch)."""
    v = VirtualBuffers()
    s = allocate_state(v, config, hyper, precision, batch, accumulate, world, shard, rank)
    names = {getattr(s, f.name).ptr: f.name for f in fields(StepBuffers)
             if isinstance(getattr(s, f.name), VirtualArray)}
    for label, grad in (("G", s.grad), ("Gmicro", s.grad_micro), ("Gshard", s.grad_shard)):
        if grad is not None:
            names.update(grad.names(label))
    n_state = len(v.requests)
    acts = Activations(config, batch // (accumulate * world), config.context,
                       np.uint16 if precision == "bf16" else np.float32, v, train=True,
                       recompute=recompute)
    G, G_micro = step_gradients(config, s, v)
    names.update(G.names("G"))
    segments = {part.ptr for part in G.parts} if s.grad is None else set()  # in the arena
    for attr, value in vars(acts).items():
        if isinstance(value, VirtualArray):
            names[value.ptr] = f"acts.{attr}"
        elif isinstance(value, list):  # per layer (None: not kept, e.g. rmsnorm's means)
            for l, x in enumerate(value):
                if x is not None:
                    names.setdefault(x.ptr, f"acts.{attr}[{l}]")
        elif isinstance(value, dict):
            for key, x in value.items():
                if x is not None:  # (the first name of one shared by two, as above)
                    names.setdefault(x.ptr, f"acts.{attr}.{key}")
    log = CommandLog()
    kernels = compile.Kernels(precision, dry=True)
    blas = Products(Cublas(0, 0, 0, dry=True), own_products(precision))
    collectives = Collectives(None, 0, rank=rank, world=world)
    kernels.log = blas.log = collectives.log = log
    micro = model_for(config, precision, kernels, blas, s, G_micro) if accumulate > 1 else None
    run_step(model_for(config, precision, kernels, blas, s, G), kernels, acts, s, micro,
             collectives)

    buffers = []
    for i, (shape, dtype, zeros, ptr, nbytes) in enumerate(v.requests):
        name = names[ptr]
        if i < n_state:
            kind = KINDS.get(name, "constant")
            buffers.append(Buffer(name, nbytes, kind, False, "kept for the program's life"))
            continue
        attr = name[len("acts."):].split("[")[0] if name.startswith("acts.") else name
        note = PINNED.get(attr, "")
        if zeros:
            note = "zeros above the diagonal written once, at allocation, and kept"
        buffers.append(Buffer(name, nbytes, "gradient" if ptr in segments else "activation",
                              not note, note))
    touches = liveness(buffers, [r[3] for r in v.requests], log.commands)
    if accumulate > 1:
        # SPEC 19: each micro-batch's pass repeats micro-batch 0's commands on
        # the same activations, and no activation a placement may share
        # (every candidate) carries a value from one pass into the next or
        # past the last: lifetimes are those of the first pass, the commands
        # before the first that reads micro-batch 1's rows of the input slot
        second = s.ids[acts.B:2 * acts.B].ptr
        n_pass = next(c.index for c in log.commands if second in c.pointers)
        for i in range(n_state, len(buffers)):
            used = [c for c in range(n_pass) if i in touches[c]]
            if buffers[i].candidate:
                buffers[i].first, buffers[i].last = (used[0], used[-1]) if used else (None, None)
    for b in buffers:
        if b.kind == "gradient":
            # the host reads G after the replay: live to the step's end, so
            # that nothing after AdamW may take its storage
            b.last = len(log.commands) - 1
    products = [c.index for c in log.commands if c.kind == "product"]
    ws = buffers[[b.name for b in buffers].index("workspace")]
    ws.first, ws.last = (products[0], products[-1]) if products else (None, None)
    ws.note = "cuBLAS's, used by every product"
    activations = list(range(n_state, len(buffers)))
    arena = place(buffers, activations, len(log.commands))
    return MemoryPlan(buffers, activations, arena, sum(buffers[i].nbytes for i in activations),
                      [(r[0], r[1]) for r in v.requests[n_state:]], log.commands, touches)
