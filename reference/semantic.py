"""The semantic graph of one training step (SPEC section 13): the
backend-independent list of the step's operations, in the order the
reference performs them, each with its kind, inputs and outputs, over named
tensors with their shapes. Every backend's program reports this same graph
(`semantic_graph()`), and says in its compilation report how it lowered
each operation to its own executable work.

The graph is not written down here: it is traced from the reference itself.
reference/model.py makes each layer call through a tape (reference/tape.py)
that names the operation and its outputs; `Trace` is the tape that records
those calls instead of computing them, and semantic_graph runs the step's
forward, loss and backward with it, as reference/step.py composes them. The
exposed intermediates (`activation_names`) and the fusion candidates
(`partitions`) are read off the traced graph.

Tensor names are the one naming scheme of the project's intermediates
(SPEC 13, also used by `conformance --activations`), as model.py gives them:

    embedding.out                      (B,T,D)  the gathered rows, x of layer 0
    layers.{l}.attn_norm.out           (B,T,D)  h = attn_norm(x)
    layers.{l}.attn.q_proj, .k_proj    (B,T,D)  h Wq^T, h Wk^T before rope
    layers.{l}.attn.q, .k, .v          (B,T,D)  q, k after rope; v
    layers.{l}.attn.y                  (B,T,D)  attention output, heads side by side
    layers.{l}.attn.out                (B,T,D)  y Wo^T
    layers.{l}.mid                     (B,T,D)  x + attn.out: the residual between the blocks
    layers.{l}.mlp_norm.out            (B,T,D)
    layers.{l}.mlp.gate, .up           (B,T,F)
    layers.{l}.mlp.h                   (B,T,F)  silu(gate) * up
    layers.{l}.mlp.out                 (B,T,D)  h Wdown^T
    layers.{l}.out                     (B,T,D)  mid + mlp.out: x of layer l+1
    final_norm.out                     (B,T,D)
    logits                             (B,T,V)
    row_losses                         (B,T)
    loss                               ()

The gradient of the mean loss with respect to a tensor `a.b.c` is `a.b.dc`
(`layers.3.attn.dq`, `final_norm.dout`, `dlogits`); a parameter's gradient
is `<name>` with `weight` -> `dweight` (`layers.0.mlp.up.dweight`), a view
of the gradient vector G. A few partial gradients of the backward have
names of their own (`layers.{l}.mlp_norm.dout_gate`: the gate product's part
of mlp_norm.dout; `layers.{l}.mlp_norm.dx`: the norm's part of dmid).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from .config import NORMS, Config, check_precision
from .model import loss_backward, loss_forward, model_backward, model_forward
from .params import registry
from .tape import gradient_name

SCHEMA = "coppelius.semantic_graph.v1"
PHASES = ("forward", "loss", "backward", "update")


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple
    dtype: str  # float32, or int64 for the token ids
    role: str  # input, parameter, activation, gradient, state
    view_of: str | None = None  # P or G for a parameter or its gradient, else None


@dataclass(frozen=True)
class Operation:
    index: int  # position in the step, 0-based
    name: str  # stable name: the forward op's, "<name>.backward" for its backward
    kind: str  # embedding, layernorm, linear, rope, attention, add, swiglu, ...
    phase: str  # forward, loss, backward, update
    inputs: tuple  # tensor names
    outputs: tuple


@dataclass(frozen=True)
class SemanticGraph:
    config: Config
    batch: int
    precision: str
    tensors: tuple  # Tensor, in order of first appearance
    operations: tuple  # Operation, in the step's order

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def operation(self, name: str) -> Operation:
        return next(o for o in self.operations if o.name == name)

    def document(self, name: str) -> dict:
        c = self.config
        return {
            "schema": SCHEMA,
            "name": name,
            "model": c.identity(),
            "config": {"vocab": c.vocab, "context": c.context, "d_model": c.d_model,
                       "n_layer": c.n_layer, "n_head": c.n_head, "d_ff": c.d_ff},
            "batch": self.batch,
            "precision": self.precision,
            "tensor_count": len(self.tensors),
            "operation_count": len(self.operations),
            "tensors": [{"tensor": t.name, "shape": list(t.shape), "dtype": t.dtype,
                         "role": t.role, "view_of": t.view_of} for t in self.tensors],
            "operations": [{"operation": o.index, "name": o.name, "kind": o.kind,
                            "phase": o.phase, "inputs": list(o.inputs),
                            "outputs": list(o.outputs)} for o in self.operations],
        }

    def debug_report_json(self, name: str) -> str:
        return report_json(self.document(name))

    def graph_hash(self) -> str:
        """SHA-256 (hex, first 16 digits) of the graph's document without its
        name: the same step gives the same hash on every backend and run."""
        text = report_json(self.document(""))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def report_json(document: dict) -> str:
    """Deterministic JSON: sorted keys, two-space indent, one final newline.
    Every debug report of a program is written by this one function."""
    return json.dumps(document, sort_keys=True, indent=2, allow_nan=False) + "\n"


# ------------------------------------------------------------------ tracing

@dataclass(frozen=True)
class Symbol:
    """A tensor of the graph while tracing: its name and shape, no values."""

    name: str
    shape: tuple
    dtype: np.dtype = np.dtype(np.float32)  # P's, for the rope tables


# Tracing computes nothing: the shapes of each kind's outputs from its
# arguments (those of the function model.py calls), and for a forward that
# returns a cache, what the cache stands for in the graph: the tensors its
# backward reads (layernorm's xhat and rstd stand for x, attention's p for q
# and k, crossentropy's probabilities for the logits). A new kind adds a line.
SHAPES = {
    "embedding": lambda ids, W: ([ids.shape + W.shape[1:]], None),
    "layernorm": lambda x, w, b, eps: ([x.shape], (x, w)),
    "rmsnorm": lambda x, w, eps: ([x.shape], (x, w)),
    "linear": lambda x, W, policy: ([x.shape[:-1] + W.shape[:1]], (x, W)),
    "linear_bias": lambda x, W, b, policy: ([x.shape[:-1] + W.shape[:1]], (x, W)),
    "rope": lambda x, cos, sin, H: ([x.shape], None),
    "attention": lambda q, k, v, H, policy: ([q.shape], (q, k, v)),
    "add": lambda *terms: ([terms[0].shape], None),
    "swiglu": lambda g, u: ([g.shape], (g, u)),
    "crossentropy": lambda logits, targets: ([logits.shape[:-1]], (logits, targets)),
    "mean": lambda x: ([()], None),
    "crossentropy_backward": lambda dce, cache: ([cache[0].shape], None),
    "linear_backward": lambda dy, cache, policy: ([x.shape for x in cache], None),
    "layernorm_backward": lambda dout, cache: ([cache[0].shape, cache[1].shape, cache[1].shape],
                                               None),  # dx, dw, db
    "rmsnorm_backward": lambda dout, cache: ([cache[0].shape, cache[1].shape], None),  # dx, dw
    "linear_bias_backward": lambda dy, cache, policy: ([x.shape for x in cache]
                                                       + [dy.shape[-1:]], None),  # dx, dW, db
    "rope_backward": lambda dout, cos, sin, H: ([dout.shape], None),
    "attention_backward": lambda dy, cache, H, policy: ([x.shape for x in cache], None),
    "swiglu_backward": lambda da, cache: ([x.shape for x in cache], None),
    "embedding_backward": lambda dx, ids, V: ([(V, dx.shape[-1])], None),
}


def _symbols(args):
    """The graph tensors among an operation's arguments, in order (a cache's too)."""
    for a in args:
        if isinstance(a, Symbol):
            yield a
        elif isinstance(a, tuple):
            yield from _symbols(a)


class Trace:
    """The tape of semantic_graph (reference/tape.py's interface): records
    each operation the model makes, in the phase the step is in, and its
    outputs as tensors of the graph, in order of first appearance. An
    output of the backward is a gradient, a view of G where it is a
    parameter's; every other output is an activation."""

    def __init__(self, config: Config):
        self.phase = PHASES[0]
        self.tensors: dict = {}
        self.operations: list = []
        reg = registry(config)
        self._parameter_gradients = {gradient_name(n) for n in (*reg.by_name, *reg.aliases)}

    def tensor(self, name, shape, role, dtype="float32", view_of=None) -> Symbol:
        self.tensors.setdefault(name, Tensor(name, tuple(shape), dtype, role, view_of))
        return Symbol(name, tuple(shape))

    def record(self, name, kind, inputs, outputs) -> None:
        for n in (*inputs, *outputs):
            assert n in self.tensors, n
        self.operations.append(Operation(len(self.operations), name, kind, self.phase,
                                         tuple(inputs), tuple(outputs)))

    def op(self, name: str, kind: str, fn, *args, out):
        names = (out,) if isinstance(out, str) else tuple(out)
        if kind not in SHAPES:
            raise ValueError(f"{name}: kind {kind!r} has no shape rule (semantic.SHAPES)")
        shapes, cache = SHAPES[kind](*args)
        if len(shapes) != len(names):
            raise ValueError(f"{name}: {len(names)} output names for {len(shapes)} outputs")
        role = "gradient" if self.phase == "backward" else "activation"
        outputs = []
        for n, shape in zip(names, shapes):
            if n in self.tensors:
                raise ValueError(f"{name}: its output {n} is already a tensor of the graph")
            view = "G" if n in self._parameter_gradients else None
            outputs.append(self.tensor(n, shape, role, view_of=view))
        self.record(name, kind, [s.name for s in _symbols(args)], names)
        if cache is not None:
            return outputs[0], cache
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def parameters(self, config, P) -> dict:
        return {name: Symbol(name, self.tensors[name].shape)
                for name in (*registry(config).by_name, *registry(config).aliases)}

    def flatten(self, config, grads: dict, like) -> Symbol:
        return Symbol("G", self.tensors["G"].shape)


@functools.lru_cache(maxsize=None)
def semantic_graph(config: Config, batch: int, precision: str) -> SemanticGraph:
    """The step of a (batch, T) window under `precision`, forward, loss,
    backward and AdamW: the operations reference/model.py makes, traced
    (no arithmetic), composed as reference/step.py composes them."""
    check_precision(precision)
    B, T = batch, config.context
    reg = registry(config)
    trace = Trace(config)
    trace.tensor("tokens", (B, T + 1), "input", dtype="int64")
    for spec in reg:
        trace.tensor(spec.name, spec.shape, "parameter", view_of="P")
    for alias, owner in reg.aliases.items():
        trace.tensor(alias, reg[owner].shape, "parameter", view_of="P")
    P = trace.tensor("P", (reg.total,), "state")
    for name in ("M", "V"):
        trace.tensor(name, (reg.total,), "state")
    trace.tensor("t", (), "state", dtype="int32")
    trace.tensor("G", (reg.total,), "gradient")

    # as step.loss_and_grads: the inputs and the targets are the window's
    # first and last T ids, both of the tensor `tokens`
    window = Symbol("tokens", (B, T))
    trace.phase = "forward"  # SPEC 3
    logits, cache = model_forward(config, P, window, precision, tape=trace)
    trace.phase = "loss"  # SPEC 4
    ce, ce_cache = loss_forward(logits, window, tape=trace)
    trace.op("loss.mean", "mean", np.mean, ce, out="loss")  # step()'s mean of the row losses
    trace.phase = "backward"  # SPEC 5
    dlogits = loss_backward(ce_cache, B * T, np.float32, tape=trace)
    model_backward(config, P, dlogits, cache, precision, tape=trace)

    # -- update (SPEC 7): step.step's tail after the gradient, written here
    # (it calls adamw.py on the flat vectors, not the model): G is every
    # parameter's gradient in the registry's layout; the clip scale is an
    # input of the update whether or not it clips
    trace.phase = "update"
    trace.tensor("grad_norm", (), "state")
    trace.tensor("clip_scale", (), "state")
    trace.record("gradient_norm", "gradient_norm", ["G"], ["grad_norm"])
    trace.record("clip", "clip_scale", ["grad_norm"], ["clip_scale"])
    trace.record("adamw", "adamw", ["P", "M", "V", "G", "clip_scale", "t"], ["P", "M", "V", "t"])
    return SemanticGraph(config, batch, precision, tuple(trace.tensors.values()),
                         tuple(trace.operations))


# ------------------------------------------------------------------ exposed intermediates

# Tensors of the graph no backend has to expose: the products a backend
# fuses into the operation that reads them (the q and k products into rope,
# each residual branch into its add), and the mean loss (the program's loss())
NOT_EXPOSED = ("attn.q_proj", "attn.k_proj", "attn.out", "mlp.out", "loss")


def _local(name: str) -> str:
    """`layers.3.attn.q` -> `attn.q`: a name within its layer."""
    return name.split(".", 2)[2] if name.startswith("layers.") else name


@functools.lru_cache(maxsize=None)
def _activation_names(config: Config) -> tuple:
    graph = semantic_graph(config, 1, "fp32")
    first_read = {}
    for o in graph.operations:
        for position, name in enumerate(o.inputs):
            first_read.setdefault(name, (o.index, position))
    forward = [t.name for t in graph.tensors
               if t.role == "activation" and _local(t.name) not in NOT_EXPOSED]
    grads = {gradient_name(name) for name in forward}
    backward = [t.name for t in graph.tensors if t.role == "gradient" and t.name in grads]
    return tuple((name, phase) for names, phase in ((forward, "forward"), (backward, "backward"))
                 for name in sorted(names, key=first_read.__getitem__))


def activation_names(config: Config) -> list:
    """[(name, phase)] of the intermediates every backend exposes for
    debugging (`activations(tokens)`, `conformance --activations`): the
    graph's activations but NOT_EXPOSED, in the order the step first reads
    them (the forward layer by layer), then the gradients of those, in the
    order the backward first reads them (from the last layer to the first).
    phase: forward or backward."""
    return list(_activation_names(config))


# ------------------------------------------------------------------ fusion candidates

@dataclass(frozen=True)
class Partition:
    """A group of semantic operations a backend may run as one unit."""

    name: str
    kind: str  # shared_input_products, residual_norm, attention, loss
    operations: tuple  # operation names


# The order of the kinds within a block (the operations of `layers.3.attn.`):
# the products, the residual with its norm, the attention core
PARTITION_KINDS = ("shared_input_products", "residual_norm", "attention", "loss")


def _fused_name(names) -> str:
    """The products' block and last segments: `attn.qkv` for q, k and v,
    `mlp.gate_up` for gate and up (the usual names of the fused products)."""
    block = names[0].rpartition(".")[0]
    parts = [n.rpartition(".")[2] for n in names]
    return block + "." + ("".join(parts) if all(len(p) == 1 for p in parts) else "_".join(parts))


@functools.lru_cache(maxsize=None)
def partitions(config: Config) -> tuple:
    """The fusion candidates of the step, backend-independent, found in its
    graph: the forward products that read one input (per layer q, k, v and
    gate, up), each residual add with the norm that reads its sum, the
    attention core with its backward (scores, softmax and p v without the
    (T, T) scores in memory), and the loss with its gradient. Block by block
    (`layers.3.attn`, then `layers.3.mlp`, ...), in PARTITION_KINDS' order
    within a block. Each backend's report says which it applied and why not."""
    graph = semantic_graph(config, 1, "fp32")
    names = {o.name for o in graph.operations}
    forward = [o for o in graph.operations if o.phase in ("forward", "loss")]
    readers = {}
    for o in forward:
        for name in o.inputs:
            readers.setdefault(name, []).append(o)
    found = []
    for o in forward:
        products = [r for r in readers.get(o.inputs[0], []) if r.kind == "linear"]
        if o.kind == "linear" and len(products) > 1 and o is products[0]:
            found.append(Partition(_fused_name([r.name for r in products]),
                                   "shared_input_products", tuple(r.name for r in products)))
        norm = [r for r in readers.get(o.outputs[0], []) if r.kind in NORMS]  # config.norm's
        if o.kind == "add" and norm:
            found.append(Partition(o.name + "_norm", "residual_norm", (o.name, norm[0].name)))
        for kind, partition in (("attention", "attention"), ("crossentropy", "loss")):
            if o.kind == kind and o.name + ".backward" in names:
                found.append(Partition(o.name, partition, (o.name, o.name + ".backward")))
    blocks = list(dict.fromkeys(p.name.rpartition(".")[0] for p in found))
    return tuple(sorted(found, key=lambda p: (blocks.index(p.name.rpartition(".")[0]),
                                              PARTITION_KINDS.index(p.kind))))
