"""The semantic graph (SPEC 13) is traced from the reference's own forward
and backward (reference/tape.py, reference/semantic.py): the operations it
lists are the calls a step makes, its tensors are the values a step
computes (each of the graph's shape), and the names and fusion candidates
read off it stay what they were when they were written out by hand."""

import dataclasses

import numpy as np
import pytest

from coppelius import reference
from coppelius.reference.config import Config, ConfigError
from coppelius.reference.model import loss_backward, loss_forward, model_backward, model_forward
from coppelius.reference.semantic import activation_names, partitions, semantic_graph
from coppelius.reference.tape import Tape

CONFIG = reference.preset("test")
ODD = Config(vocab=37, context=9, d_model=18, n_layer=2, n_head=3, d_ff=13)


class Calls(Tape):
    """A Tape that also lists the operations it runs and the arrays each is given."""

    def __init__(self, record):
        super().__init__(record)
        self.calls = []

    def op(self, name, kind, fn, *args, out):
        self.calls.append((name, kind, [a for a in args if isinstance(a, np.ndarray)]))
        return super().op(name, kind, fn, *args, out=out)


def run_step(config, batch, precision):
    """One step's forward, loss and backward through a Calls tape -> (tape, record)."""
    P = reference.initialize(config)
    tokens = np.random.default_rng(3).integers(0, config.vocab, (batch, config.context + 1))
    record = {}
    tape = Calls(record)
    logits, cache = model_forward(config, P, tokens[:, :-1], precision, tape=tape)
    ce, ce_cache = loss_forward(logits, tokens[:, 1:], tape)
    record["loss"] = ce.mean(dtype=np.float32)  # step()'s mean, outside the model
    dlogits = loss_backward(ce_cache, ce.size, P.dtype, tape)
    record["G"] = model_backward(config, P, dlogits, cache, precision, tape=tape)
    return tape, record


@pytest.mark.parametrize("config, batch, precision", [(CONFIG, 2, "fp32"), (ODD, 3, "bf16")])
def test_every_computed_tensor_is_in_the_graph_with_its_shape(config, batch, precision):
    graph = semantic_graph(config, batch, precision)
    _, record = run_step(config, batch, precision)
    computed = {t.name: t for t in graph.tensors if t.role in ("activation", "gradient")}
    assert set(record) == set(computed)
    for name, t in computed.items():
        assert np.shape(record[name]) == t.shape, name
        assert record[name].dtype == np.float32, name


@pytest.mark.parametrize("config, batch, precision", [(CONFIG, 2, "fp32"), (ODD, 3, "bf16")])
def test_the_graphs_operations_are_the_calls_a_step_makes(config, batch, precision):
    """Name, kind and order of every operation of the forward, loss and
    backward (the mean and the update are step()'s, outside the tape), and
    every computed array an operation is given is one of its inputs."""
    graph = semantic_graph(config, batch, precision)
    tape, record = run_step(config, batch, precision)
    ops = [o for o in graph.operations if o.phase != "update" and o.name != "loss.mean"]
    assert [(name, kind) for name, kind, _ in tape.calls] == [(o.name, o.kind) for o in ops]
    named = {id(value): name for name, value in record.items()}
    for (name, _, arrays), o in zip(tape.calls, ops):
        given = [named[id(a)] for a in arrays if id(a) in named]
        assert set(given) <= set(o.inputs), (name, given, o.inputs)


def test_the_graph_stays_the_one_of_version_2():
    """The graphs traced from the model hash as the hand-written ones did."""
    assert semantic_graph(CONFIG, 2, "fp32").graph_hash() == "72a7d2f178415425"
    assert semantic_graph(CONFIG, 2, "bf16").graph_hash() == "eae099f6f6452222"
    coppelius = reference.preset("coppelius")
    assert semantic_graph(coppelius, 64, "fp32").graph_hash() == "963ecbe8a9817742"
    assert semantic_graph(coppelius, 64, "bf16").graph_hash() == "46ead7f90279c242"


def test_exposed_names_and_partitions_stay_as_they_were_written():
    forward = ("attn_norm.out", "attn.q", "attn.k", "attn.v", "attn.y", "mid", "mlp_norm.out",
               "mlp.gate", "mlp.up", "mlp.h", "out")
    backward = ("dout", "mlp.dh", "mlp.dgate", "mlp.dup", "mlp_norm.dout", "dmid", "attn.dy",
                "attn.dq", "attn.dk", "attn.dv", "attn_norm.dout")
    want = [("embedding.out", "forward")]
    for l in range(CONFIG.n_layer):
        want += [(f"layers.{l}.{name}", "forward") for name in forward]
    want += [("final_norm.out", "forward"), ("logits", "forward"), ("row_losses", "forward"),
             ("dlogits", "backward"), ("final_norm.dout", "backward")]
    for l in reversed(range(CONFIG.n_layer)):
        want += [(f"layers.{l}.{name}", "backward") for name in backward]
    want.append(("embedding.dout", "backward"))
    assert activation_names(CONFIG) == want

    got = [(p.name, p.kind, p.operations) for p in partitions(CONFIG)]
    want = []
    for l in range(CONFIG.n_layer):
        p = f"layers.{l}."
        nxt = f"layers.{l + 1}.attn_norm" if l + 1 < CONFIG.n_layer else "final_norm"
        want += [(p + "attn.qkv", "shared_input_products",
                  (p + "attn.q", p + "attn.k", p + "attn.v")),
                 (p + "attn.residual_norm", "residual_norm",
                  (p + "attn.residual", p + "mlp_norm")),
                 (p + "attn.core", "attention", (p + "attn.core", p + "attn.core.backward")),
                 (p + "mlp.gate_up", "shared_input_products", (p + "mlp.gate", p + "mlp.up")),
                 (p + "mlp.residual_norm", "residual_norm", (p + "mlp.residual", nxt))]
    want.append(("loss", "loss", ("loss", "loss.backward")))
    assert got == want


def test_a_family_field_the_model_does_not_compute_has_no_graph():
    """The graph is the model's: a configuration the reference refuses has none."""
    with pytest.raises(ConfigError, match="norm"):
        semantic_graph(dataclasses.replace(CONFIG, norm="rmsnorm"), 1, "fp32")
