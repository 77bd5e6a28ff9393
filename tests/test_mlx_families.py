"""The MLX backend on every member of the model family (SPEC 21): its
compiled step against the reference's (the hand-written NumPy backward,
independent of MLX's autodiff) within SPEC 14's tolerances, under both
precision policies, one context and several, with and without accumulation;
the untied embedding's gradient; grouped heads as shared copies of
ungrouped ones; the intermediates of one step."""

import numpy as np
import pytest

from coppelius.conformance.cases import random_state
from coppelius.conformance.tolerances import relative_error, tolerance
from coppelius.reference.step import step, step_activations
from coppelius.reference.config import FAMILY_FIELDS, Config, Hyper
from coppelius.reference.params import registry
from coppelius.reference.state import State

mx = pytest.importorskip("mlx.core")
from coppelius.accelerated import mlx_backend  # noqa: E402
from tests.test_mlx_backend import MEMBERS, SHAPE, windows  # noqa: E402

pytestmark = pytest.mark.mlx


def check(check_name, tensor, got, want, precision):
    error, worst, a, b = relative_error(got, want)
    tol = tolerance(check_name, precision)
    assert error <= tol, (f"{check_name} {tensor}: error {error:.3e} > {tol:.0e} at {worst}: "
                          f"{a!r} vs {b!r}")


def test_every_family_field_is_computed():
    assert set(mlx_backend.IMPLEMENTED) == set(FAMILY_FIELDS)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("batch,accumulate", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("name", list(MEMBERS))
def test_one_step_matches_the_reference(name, batch, accumulate, precision):
    """Loss, row losses, gradient norm, each parameter's gradient, P, M, V
    and t after one compiled step. The state is one from the middle of a run
    (random_state: biases off zero, norm weights off one, moments of history)
    so every bias and weight enters the forward, and AdamW's update is well
    conditioned: the k bias's elements outside the rotated part have an
    exactly zero gradient (a constant added to a row of scores), whose
    float32 rounding noise a first update from zero moments would turn into
    steps of about lr."""
    config = MEMBERS[name]
    state = random_state(config, 11)
    tokens = windows(1, seed=12, config=config, batch=batch)[0]
    program = mlx_backend.capture(config, Hyper(), precision, batch, state.copy(),
                                  accumulate=accumulate)
    program.upload_input(tokens)
    loss = program.replay_and_wait()
    want = step(config, state.copy(), tokens, precision, Hyper(), grads=True)
    check("loss", "mean loss", np.float32(loss), want.loss, precision)
    check("row_losses", "row losses", program.row_losses(), want.row_losses, precision)
    check("norm", "gradient norm", np.float32(program.grad_norm()), np.float32(want.grad_norm),
          precision)
    G, got = program.gradients(), program.state()
    for spec in registry(config):
        check("gradient", spec.name, G[spec.slice], want.grads[spec.slice], precision)
        for part in "PMV":
            check(part, spec.name, getattr(got, part)[spec.slice],
                  getattr(want.state, part)[spec.slice], precision)
    assert got.t == want.state.t == state.t + 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_untied_embedding_gets_its_gather_gradient_alone(precision):
    """Untied (SPEC 21), an id the input does not hold has a zero embedding
    gradient row, exactly (the logits read lm_head.weight, whose every row
    has a gradient through the softmax); tied, that row has the logits'
    gradient."""
    tokens = windows(1, seed=13, batch=2)[0] % 16  # ids 0..15 of 64
    unused = np.setdiff1d(np.arange(64), tokens[:, :-1])
    rows = {}
    for tied in (False, True):
        config = Config(**SHAPE, norm="rmsnorm", tied=tied)
        program = mlx_backend.capture(config, Hyper(), precision, 2, random_state(config, 14))
        program.upload_input(tokens)
        program.replay_and_wait()
        rows[tied] = registry(config).views(program.gradients())
    embedding = rows[False]["tok_embedding.weight"]
    assert (embedding[unused] == 0).all()
    assert (np.abs(embedding[np.unique(tokens[:, :-1])]).sum(axis=1) > 0).all()
    assert (np.abs(rows[False]["lm_head.weight"]).sum(axis=1) > 0).all()
    assert (np.abs(rows[True]["tok_embedding.weight"][unused]).sum(axis=1) > 0).all()


def test_grouped_heads_are_shared_copies_of_ungrouped_heads():
    """A model with Hkv key/value heads is the ungrouped model whose k and v
    heads h are copies of head h // g (SPEC 21): the same logits, and each
    grouped k/v weight's gradient is the sum of its g copies' gradients."""
    H, Hkv, E = 4, 2, 8
    shape = {**SHAPE, "n_head": H}
    grouped = Config(**shape, n_kv_head=Hkv, qkv_bias=True, rotary="1/2")
    ungrouped = Config(**shape, qkv_bias=True, rotary="1/2")
    state = random_state(grouped, 15)
    g_views = registry(grouped).views(state.P)
    P = np.empty(registry(ungrouped).total, np.float32)
    u_views = registry(ungrouped).views(P)
    copies = np.repeat(np.arange(Hkv), H // Hkv)  # ungrouped head h reads grouped head h // g
    for name, view in u_views.items():
        source = g_views[name]
        if view.shape != source.shape:  # k, v weights (H E, D) and biases (H E,)
            source = source.reshape(Hkv, E, -1)[copies].reshape(view.shape)
        view[...] = source
    tokens = windows(1, seed=16, config=grouped, batch=2)[0]
    logits, grads = {}, {}
    for config, params in ((grouped, state.P), (ungrouped, P)):
        program = mlx_backend.capture(config, Hyper(), "fp32", 2, State.fresh(params.copy()))
        logits[config] = program.logits(tokens[:, :-1])  # (B,T,V)
        program.upload_input(tokens)
        program.replay_and_wait()
        grads[config] = registry(config).views(program.gradients())
    check("logits", "logits", logits[ungrouped], logits[grouped], "fp32")
    for name, want in grads[grouped].items():
        got = grads[ungrouped][name]
        if got.shape != want.shape:
            got = got.reshape(Hkv, H // Hkv, E, -1).sum(axis=1).reshape(want.shape)
        check("gradient", name, got, want, "fp32")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_intermediates_of_a_mixed_member_match_the_reference(precision):
    """Every named intermediate of one step's forward and backward (the
    debugging view) within its tolerance, on grouped heads with biases and
    partial rotary, where k's and v's are Hkv E wide."""
    from coppelius.conformance.activations import activation_rows

    config = MEMBERS["mixed"]
    state = random_state(config, 17)
    tokens = windows(1, seed=18, config=config, batch=2)[0]
    program = mlx_backend.capture(config, Hyper(), precision, 2, state.copy())
    rows = activation_rows(config, program.activations(tokens),
                           step_activations(config, state.P, tokens, precision),
                           precision)
    assert rows and all(row.passed for row in rows), [r for r in rows if not r.passed][:3]
