"""The semantic graph (SPEC 13) is traced from the reference's own forward
and backward (reference/tape.py, reference/semantic.py): the operations it
lists are the calls a step makes, its tensors are the values a step
computes (each of the graph's shape), on the defaults' model and on every
family preset (SPEC 21), and the names and fusion candidates read off it
stay what they were when they were written out by hand."""

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
# the family presets (SPEC 21) and a member none of them is: layernorm, 2 of 4
# key/value heads, q/k/v biases, half of each head rotated, tied
MIXED = Config(vocab=37, context=9, d_model=32, n_layer=2, n_head=4, d_ff=13, n_kv_head=2,
               qkv_bias=True, rotary="1/2")
FAMILY = [reference.preset(name) for name in ("test-llama", "test-qwen", "test-stablelm")] + [MIXED]
CASES = [(CONFIG, 2, "fp32"), (ODD, 3, "bf16")] + [
    (config, 1 + i % 2, ("fp32", "bf16")[i % 2]) for i, config in enumerate(FAMILY)]


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


@pytest.mark.parametrize("config, batch, precision", CASES)
def test_every_computed_tensor_is_in_the_graph_with_its_shape(config, batch, precision):
    graph = semantic_graph(config, batch, precision)
    _, record = run_step(config, batch, precision)
    computed = {t.name: t for t in graph.tensors if t.role in ("activation", "gradient")}
    assert set(record) == set(computed)
    for name, t in computed.items():
        assert np.shape(record[name]) == t.shape, name
        assert record[name].dtype == np.float32, name


@pytest.mark.parametrize("config, batch, precision", CASES)
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


@pytest.mark.parametrize("config", [CONFIG] + FAMILY)
def test_each_member_has_its_operation_kinds_and_shapes(config):
    """The norm's kind (layernorm or rmsnorm), the q/k/v products' (linear,
    or linear_bias with qkv_bias) and their backwards', once per use; k and
    v (Hkv * E) wide; an untied head is lm_head.weight's own product."""
    B = 2
    graph = semantic_graph(config, B, "fp32")
    kinds = [o.kind for o in graph.operations]
    norm = "rmsnorm" if config.norm == "rmsnorm" else "layernorm"
    other = "layernorm" if norm == "rmsnorm" else "rmsnorm"
    L = config.n_layer
    assert kinds.count(norm) == kinds.count(norm + "_backward") == 2 * L + 1
    assert other not in kinds and other + "_backward" not in kinds
    biased = 3 * L if config.qkv_bias else 0
    assert kinds.count("linear_bias") == kinds.count("linear_bias_backward") == biased
    assert kinds.count("linear") == kinds.count("linear_backward") == 7 * L + 1 - biased
    shape = {t.name: t.shape for t in graph.tensors}
    E, T = config.d_model // config.n_head, config.context
    kv = (config.n_kv_head or config.n_head) * E
    for l in range(L):
        assert shape[f"layers.{l}.attn.q"] == (B, T, config.d_model)
        assert shape[f"layers.{l}.attn.k"] == shape[f"layers.{l}.attn.v"] == (B, T, kv)
        assert shape[f"layers.{l}.attn.dk"] == (B, T, kv)
        for part in "qkv":
            op = graph.operation(f"layers.{l}.attn.{part}")
            assert (f"layers.{l}.attn.{part}.bias" in op.inputs) == config.qkv_bias
    # tied: the embedding's gradient is the gather's plus the unembedding's
    ops = {o.name for o in graph.operations}
    assert ("tok_embedding.dweight_sum" in ops) == config.tied
    gather = graph.operation("embedding.backward").outputs
    assert gather == (("tok_embedding.dweight_gather",) if config.tied else ("tok_embedding.dweight",))


def test_a_family_field_the_model_does_not_compute_has_no_graph(monkeypatch):
    """The graph is the model's: a configuration the reference refuses (here
    with its IMPLEMENTED made smaller) has none."""
    from coppelius.reference import model

    config = dataclasses.replace(CONFIG, norm="rmsnorm", vocab=61)  # traced nowhere else
    with monkeypatch.context() as patch:
        patch.setattr(model, "IMPLEMENTED", ("norm_eps", "rope_base"))
        with pytest.raises(ConfigError, match="reference: config field norm='rmsnorm'"):
            semantic_graph(config, 1, "fp32")
    assert semantic_graph(config, 1, "fp32").operation("final_norm").kind == "rmsnorm"
