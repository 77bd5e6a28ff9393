"""The semantic graph of one training step (SPEC section 13): the
backend-independent list of the step's operations, in the order the
reference performs them, each with its kind, inputs and outputs, over named
tensors with their shapes. Every backend's program reports this same graph
(`semantic_graph()`), and says in its compilation report how it lowered
each operation to its own executable work.

Tensor names are the one naming scheme of the project's intermediates
(SPEC 13, also used by `conformance --activations`):

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

from .config import Config, check_precision
from .params import registry

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


def gradient_name(name: str) -> str:
    """The name of the gradient of tensor `name`: `d` before its last segment."""
    head, _, last = name.rpartition(".")
    return f"{head}.d{last}" if head else f"d{last}"


LAYER_FORWARD = ("attn_norm.out", "attn.q", "attn.k", "attn.v", "attn.y", "mid", "mlp_norm.out",
                 "mlp.gate", "mlp.up", "mlp.h", "out")
LAYER_BACKWARD = ("dout", "mlp.dh", "mlp.dgate", "mlp.dup", "mlp_norm.dout", "dmid", "attn.dy",
                  "attn.dq", "attn.dk", "attn.dv", "attn_norm.dout")


def activation_names(config: Config) -> list:
    """[(name, phase)] of the intermediates every backend exposes for
    debugging (`activations(tokens)`, `conformance --activations`), in the
    order the step computes them: the forward layer by layer, then the
    backward from the last layer to the first. phase: forward or backward."""
    L = config.n_layer
    out = [("embedding.out", "forward")]
    for l in range(L):
        out += [(f"layers.{l}.{name}", "forward") for name in LAYER_FORWARD]
    out += [("final_norm.out", "forward"), ("logits", "forward"), ("row_losses", "forward"),
            ("dlogits", "backward"), ("final_norm.dout", "backward")]
    for l in reversed(range(L)):
        out += [(f"layers.{l}.{name}", "backward") for name in LAYER_BACKWARD]
    out.append(("embedding.dout", "backward"))
    return out


@functools.lru_cache(maxsize=None)
def semantic_graph(config: Config, batch: int, precision: str) -> SemanticGraph:
    """The step of a (batch, T) window under `precision`, forward, loss,
    backward and AdamW, in the reference's order (reference/model.py,
    reference/step.py)."""
    check_precision(precision)
    B, T, D, F, V, L = batch, config.context, config.d_model, config.d_ff, config.vocab, \
        config.n_layer
    reg = registry(config)
    tensors: dict = {}
    ops: list = []

    def tensor(name, shape, role="activation", dtype="float32", view_of=None):
        tensors.setdefault(name, Tensor(name, tuple(shape), dtype, role, view_of))
        return name

    def grad(name):  # the gradient of an existing tensor, same shape
        t = tensors[name]
        view = "G" if t.role == "parameter" else None
        return tensor(gradient_name(name), t.shape, "gradient", view_of=view)

    def op(name, kind, phase, inputs, outputs):
        for n in (*inputs, *outputs):
            assert n in tensors, n
        ops.append(Operation(len(ops), name, kind, phase, tuple(inputs), tuple(outputs)))

    tensor("tokens", (B, T + 1), "input", dtype="int64")
    for spec in reg:
        tensor(spec.name, spec.shape, "parameter", view_of="P")
    for alias, owner in reg.aliases.items():
        tensor(alias, reg[owner].shape, "parameter", view_of="P")
    for name in ("P", "M", "V"):
        tensor(name, (reg.total,), "state")
    tensor("t", (), "state", dtype="int32")
    tensor("G", (reg.total,), "gradient")
    btd, btf = (B, T, D), (B, T, F)

    # -- forward (SPEC 3)
    x = tensor("embedding.out", btd)
    op("embedding", "embedding", "forward", ["tokens", "tok_embedding.weight"], [x])
    for l in range(L):
        p = f"layers.{l}."
        h = tensor(p + "attn_norm.out", btd)
        op(p + "attn_norm", "layernorm", "forward",
           [x, p + "attn_norm.weight", p + "attn_norm.bias"], [h])
        for part in ("q", "k"):
            op(p + f"attn.{part}", "linear", "forward", [h, p + f"attn.{part}.weight"],
               [tensor(p + f"attn.{part}_proj", btd)])
        op(p + "attn.v", "linear", "forward", [h, p + "attn.v.weight"],
           [tensor(p + "attn.v", btd)])
        for part in ("q", "k"):
            op(p + f"attn.rope_{part}", "rope", "forward", [p + f"attn.{part}_proj"],
               [tensor(p + f"attn.{part}", btd)])
        op(p + "attn.core", "attention", "forward", [p + "attn.q", p + "attn.k", p + "attn.v"],
           [tensor(p + "attn.y", btd)])
        op(p + "attn.o", "linear", "forward", [p + "attn.y", p + "attn.o.weight"],
           [tensor(p + "attn.out", btd)])
        mid = tensor(p + "mid", btd)
        op(p + "attn.residual", "add", "forward", [x, p + "attn.out"], [mid])
        h = tensor(p + "mlp_norm.out", btd)
        op(p + "mlp_norm", "layernorm", "forward",
           [mid, p + "mlp_norm.weight", p + "mlp_norm.bias"], [h])
        for part in ("gate", "up"):
            op(p + f"mlp.{part}", "linear", "forward", [h, p + f"mlp.{part}.weight"],
               [tensor(p + f"mlp.{part}", btf)])
        op(p + "mlp.swiglu", "swiglu", "forward", [p + "mlp.gate", p + "mlp.up"],
           [tensor(p + "mlp.h", btf)])
        op(p + "mlp.down", "linear", "forward", [p + "mlp.h", p + "mlp.down.weight"],
           [tensor(p + "mlp.out", btd)])
        x = tensor(p + "out", btd)
        op(p + "mlp.residual", "add", "forward", [mid, p + "mlp.out"], [x])
    last = x
    op("final_norm", "layernorm", "forward", [x, "final_norm.weight", "final_norm.bias"],
       [tensor("final_norm.out", btd)])
    op("lm_head", "linear", "forward", ["final_norm.out", "lm_head.weight"],
       [tensor("logits", (B, T, V))])

    # -- loss (SPEC 4)
    op("loss", "crossentropy", "loss", ["logits", "tokens"], [tensor("row_losses", (B, T))])
    op("loss.mean", "mean", "loss", ["row_losses"], [tensor("loss", ())])

    # -- backward (SPEC 5), as reference.model.model_backward
    op("loss.backward", "crossentropy_backward", "backward", ["logits", "tokens"],
       [grad("logits")])
    op("lm_head.backward", "linear_backward", "backward",
       ["dlogits", "final_norm.out", "lm_head.weight"],
       [grad("final_norm.out"), grad("lm_head.weight")])
    op("final_norm.backward", "layernorm_backward", "backward",
       ["final_norm.dout", last, "final_norm.weight"],
       [grad(last), grad("final_norm.weight"), grad("final_norm.bias")])
    for l in reversed(range(L)):
        p = f"layers.{l}."
        dout = gradient_name(p + "out")
        op(p + "mlp.down.backward", "linear_backward", "backward",
           [dout, p + "mlp.h", p + "mlp.down.weight"],
           [grad(p + "mlp.h"), grad(p + "mlp.down.weight")])
        op(p + "mlp.swiglu.backward", "swiglu_backward", "backward",
           [p + "mlp.dh", p + "mlp.gate", p + "mlp.up"], [grad(p + "mlp.gate"), grad(p + "mlp.up")])
        for part in ("gate", "up"):
            op(p + f"mlp.{part}.backward", "linear_backward", "backward",
               [p + f"mlp.d{part}", p + "mlp_norm.out", p + f"mlp.{part}.weight"],
               [tensor(p + f"mlp_norm.dout_{part}", btd, "gradient"),
                grad(p + f"mlp.{part}.weight")])
        op(p + "mlp_norm.dout_sum", "add", "backward",
           [p + "mlp_norm.dout_gate", p + "mlp_norm.dout_up"], [grad(p + "mlp_norm.out")])
        op(p + "mlp_norm.backward", "layernorm_backward", "backward",
           [p + "mlp_norm.dout", p + "mid", p + "mlp_norm.weight"],
           [tensor(p + "mlp_norm.dx", btd, "gradient"), grad(p + "mlp_norm.weight"),
            grad(p + "mlp_norm.bias")])
        op(p + "mlp.residual.backward", "add", "backward", [dout, p + "mlp_norm.dx"],
           [grad(p + "mid")])
        op(p + "attn.o.backward", "linear_backward", "backward",
           [p + "dmid", p + "attn.y", p + "attn.o.weight"],
           [grad(p + "attn.y"), grad(p + "attn.o.weight")])
        op(p + "attn.core.backward", "attention_backward", "backward",
           [p + "attn.dy", p + "attn.q", p + "attn.k", p + "attn.v"],
           [grad(p + "attn.q"), grad(p + "attn.k"), grad(p + "attn.v")])
        for part in ("q", "k"):
            op(p + f"attn.rope_{part}.backward", "rope_backward", "backward",
               [p + f"attn.d{part}"], [grad(p + f"attn.{part}_proj")])
        for part in ("q", "k", "v"):
            dproj = p + (f"attn.d{part}_proj" if part != "v" else "attn.dv")
            op(p + f"attn.{part}.backward", "linear_backward", "backward",
               [dproj, p + "attn_norm.out", p + f"attn.{part}.weight"],
               [tensor(p + f"attn_norm.dout_{part}", btd, "gradient"),
                grad(p + f"attn.{part}.weight")])
        op(p + "attn_norm.dout_sum", "add", "backward",
           [p + f"attn_norm.dout_{part}" for part in "qkv"], [grad(p + "attn_norm.out")])
        x_in = f"layers.{l - 1}.out" if l else "embedding.out"
        op(p + "attn_norm.backward", "layernorm_backward", "backward",
           [p + "attn_norm.dout", x_in, p + "attn_norm.weight"],
           [tensor(p + "attn_norm.dx", btd, "gradient"), grad(p + "attn_norm.weight"),
            grad(p + "attn_norm.bias")])
        op(p + "attn.residual.backward", "add", "backward", [p + "dmid", p + "attn_norm.dx"],
           [grad(x_in)])
    # the tied embedding: the gather gradient plus the unembedding gradient
    gather = tensor("tok_embedding.dweight_gather", reg["tok_embedding.weight"].shape, "gradient")
    op("embedding.backward", "embedding_backward", "backward", ["embedding.dout", "tokens"],
       [gather])
    op("tok_embedding.dweight_sum", "add", "backward", ["lm_head.dweight", gather],
       [grad("tok_embedding.weight")])

    # -- update (SPEC 7): G is every parameter's gradient, in the registry's layout
    tensor("grad_norm", (), "state")
    tensor("clip_scale", (), "state")
    op("gradient_norm", "gradient_norm", "update", ["G"], ["grad_norm"])
    op("clip", "clip_scale", "update", ["grad_norm"], ["clip_scale"])
    op("adamw", "adamw", "update", ["P", "M", "V", "G", "clip_scale", "t"], ["P", "M", "V", "t"])
    return SemanticGraph(config, batch, precision, tuple(tensors.values()), tuple(ops))


# ------------------------------------------------------------------ fusion candidates

@dataclass(frozen=True)
class Partition:
    """A group of semantic operations a backend may run as one unit."""

    name: str
    kind: str  # shared_input_products, residual_norm, attention, loss
    operations: tuple  # operation names


@functools.lru_cache(maxsize=None)
def partitions(config: Config) -> tuple:
    """The fusion candidates of the step, backend-independent: per layer the
    q, k, v products (one input), the gate and up products, each residual
    add with the norm that reads its sum, the attention core (scores,
    softmax and p v without the (T, T) scores in memory); and the loss with
    its gradient. Each backend's report says which it applied and why not."""
    out = []
    L = config.n_layer
    for l in range(L):
        p = f"layers.{l}."
        nxt = f"layers.{l + 1}.attn_norm" if l + 1 < L else "final_norm"
        out += [
            Partition(p + "attn.qkv", "shared_input_products",
                      (p + "attn.q", p + "attn.k", p + "attn.v")),
            Partition(p + "attn.residual_norm", "residual_norm",
                      (p + "attn.residual", p + "mlp_norm")),
            Partition(p + "attn.core", "attention", (p + "attn.core", p + "attn.core.backward")),
            Partition(p + "mlp.gate_up", "shared_input_products", (p + "mlp.gate", p + "mlp.up")),
            Partition(p + "mlp.residual_norm", "residual_norm", (p + "mlp.residual", nxt)),
        ]
    out.append(Partition("loss", "loss", ("loss", "loss.backward")))
    return tuple(out)
