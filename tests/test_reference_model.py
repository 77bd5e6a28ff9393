"""The whole reference model: logits, loss and every parameter's gradient
(SPEC sections 3, 4, 5) on the `test` preset.

- The forward against `naive_forward`, the SPEC text written out again in
  float64 with per-context and per-head loops, an explicit causal mask and
  rope as a complex rotation (test_precision.py reuses it for bf16).
- Every parameter tensor's gradient (reference.loss_and_grads in float64)
  against float64 central finite differences of the mean loss, on sampled
  elements of every tensor and on embedding rows used as inputs, used only
  as targets, and not used (the tied embedding's gradient is the sum of its
  gather and unembedding parts; a difference quotient sees both).
"""

import math

import numpy as np
import pytest

from coppelius import reference
from coppelius.reference.config import LAYERNORM_EPS, ROPE_BASE

CONFIG = reference.preset("test")

# Tolerances (errors relative to the largest magnitude of the expected tensor):
#   logits f32: float32 forward vs float64, a handful of layers of sums of
#       <= 96 terms: observed ~2e-7, allowed 1e-5.
#   logits f64: the same maths in float64; the reference rounds nothing in
#       float64, this file rounds the rope tables to float32 as SPEC 3 says
#       (a ~1e-8 relative difference of q and k), allowed 1e-6.
#   grads f32 vs f64: the float32 gradient of every tensor against the
#       float64 one: observed ~1e-6, allowed 1e-4.
#   finite differences: h = 1e-5 in float64: cancellation ~1e-16 * loss / h
#       ~ 5e-11 and truncation ~h^2 = 1e-10 relative; |fd - g| <= FD_RTOL |g|
#       + FD_ATOL (the gradients are 1e-5 .. 1e-1, so FD_ATOL is 1e-4 .. 1e-8
#       relative and any real mistake, O(1) relative, fails).
TOL = {"logits_f32": 1e-5, "logits_f64": 1e-6, "grads_f32": 1e-4}
FD_H, FD_RTOL, FD_ATOL = 1e-5, 1e-5, 1e-9


# ---------------------------------------------------------------- the SPEC forward, again
def rope_tables_f32(T, E):
    theta = np.array([[t * ROPE_BASE ** (-2.0 * j / E) for j in range(E // 2)] for t in range(T)])
    cos = np.vectorize(math.cos)(theta).astype(np.float32).astype(np.float64)
    sin = np.vectorize(math.sin)(theta).astype(np.float32).astype(np.float64)
    return cos, sin


def naive_forward(config, P, tokens, rnd=None):
    """tokens (B,T) -> logits (B,T,V) in float64. `rnd` rounds each operand
    of each matrix product (None: exact); under bf16 that is bfloat16."""
    rnd = rnd or (lambda a: a)
    mm = lambda a, b: rnd(a) @ rnd(b)  # noqa: E731
    w = reference.registry(config).views(np.asarray(P, np.float64))
    H, E = config.n_head, config.head_dim
    eps = float(LAYERNORM_EPS)
    tokens = np.asarray(tokens)
    T = tokens.shape[1]
    cos, sin = rope_tables_f32(T, E)

    def layernorm(x, n):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[n + ".weight"] + w[n + ".bias"]

    def rope(x):  # (T,E): z_j = x_j + i x_{j+E/2}, rotated by t * base^(-2j/E)
        z = (x[:, :E // 2] + 1j * x[:, E // 2:]) * (cos + 1j * sin)
        return np.concatenate([z.real, z.imag], axis=-1)

    out = []
    for ids in tokens:  # batch elements never interact
        x = w["tok_embedding.weight"][ids]  # (T,D)
        for l in range(config.n_layer):
            p = f"layers.{l}."
            h = layernorm(x, p + "attn_norm")
            q, k, v = (mm(h, w[p + f"attn.{n}.weight"].T) for n in "qkv")
            heads = []
            for hd in range(H):
                cols = slice(hd * E, (hd + 1) * E)
                qh, kh, vh = rope(q[:, cols]), rope(k[:, cols]), v[:, cols]
                s = mm(qh, kh.T) / math.sqrt(E)  # (T,T)
                for i in range(T):
                    s[i, i + 1:] = -np.inf  # causal: key j > query i is masked
                e = np.exp(s - s.max(-1, keepdims=True))
                heads.append(mm(e / e.sum(-1, keepdims=True), vh))
            x = x + mm(np.concatenate(heads, axis=-1), w[p + "attn.o.weight"].T)
            h = layernorm(x, p + "mlp_norm")
            g, u = mm(h, w[p + "mlp.gate.weight"].T), mm(h, w[p + "mlp.up.weight"].T)
            x = x + mm(g / (1.0 + np.exp(-g)) * u, w[p + "mlp.down.weight"].T)
        out.append(mm(layernorm(x, "final_norm"), w["tok_embedding.weight"].T))  # tied
    return np.stack(out)


def naive_row_losses(logits, targets):
    m = logits.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


# ---------------------------------------------------------------- inputs
def tokens_with_every_kind_of_row(seed=20260925):
    """(2, T+1) ids: inputs from [0, 48) with a repeated id, two ids (60, 61)
    that occur only as the last target, and ids 48..59, 62, 63 unused."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 48, (2, CONFIG.context + 1))
    tokens[0, 5] = tokens[1, 9] = tokens[0, 12] = 7  # gathered three times
    tokens[:, -1] = [60, 61]
    return tokens


def rough_parameters(seed=1):
    """Initialized parameters plus noise: norms away from 1 and 0, attention
    away from uniform, so every path of the backward carries weight."""
    P = reference.initialize(CONFIG).astype(np.float64)
    return P + np.random.default_rng(seed).normal(0.0, 0.1, P.shape)


def mean_loss(P, tokens):
    ce, _ = reference.loss_and_grads(CONFIG, P, tokens)
    return math.fsum(ce.ravel()) / ce.size


# ---------------------------------------------------------------- forward and loss
@pytest.mark.parametrize("point", ["initialized", "rough"])
def test_logits_and_loss_match_the_spec_written_out(point):
    tokens = tokens_with_every_kind_of_row()
    P64 = reference.initialize(CONFIG).astype(np.float64) if point == "initialized" else rough_parameters()
    P32 = P64.astype(np.float32)
    want = naive_forward(CONFIG, P32, tokens[:, :-1])
    scale = np.abs(want).max()

    got32 = reference.forward(CONFIG, P32, tokens[:, :-1], "fp32")
    assert got32.dtype == np.float32 and got32.shape == (2, CONFIG.context, CONFIG.vocab)
    err = np.abs(got32 - want).max() / scale
    assert err <= TOL["logits_f32"], f"logits (float32): error {err:.3e} of max |logit| {scale:.3e}"
    got64 = reference.forward(CONFIG, P32.astype(np.float64), tokens[:, :-1], "fp32")
    err = np.abs(got64 - want).max() / scale
    assert err <= TOL["logits_f64"], f"logits (float64): error {err:.3e}"

    result = reference.step(CONFIG, reference.State.fresh(P32), tokens, "fp32")
    ce = naive_row_losses(want, tokens[:, 1:])
    assert result.row_losses.dtype == np.float32 and result.row_losses.shape == (2, CONFIG.context)
    assert np.abs(result.row_losses - ce).max() <= 1e-5 * np.abs(ce).max()
    assert isinstance(result.loss, np.float32)
    assert abs(float(result.loss) - ce.mean()) <= 1e-5 * ce.mean()
    assert result.loss == np.float32(result.row_losses.mean(dtype=np.float32))  # the mean of the rows


def test_batch_elements_never_interact():
    tokens = tokens_with_every_kind_of_row()[:, :-1]
    P = reference.initialize(CONFIG)
    both = reference.forward(CONFIG, P, tokens, "fp32")
    for b in range(2):
        alone = reference.forward(CONFIG, P, tokens[b:b + 1], "fp32")[0]
        np.testing.assert_allclose(both[b], alone, rtol=0, atol=1e-6 * np.abs(alone).max())


def test_fresh_uniform_model_starts_near_log_vocab():
    """A sanity anchor: with std-0.02 weights the logits are near zero, so the
    first loss is close to ln V."""
    tokens = tokens_with_every_kind_of_row()
    result = reference.step(CONFIG, reference.State.fresh(reference.initialize(CONFIG)), tokens)
    assert abs(float(result.loss) - math.log(CONFIG.vocab)) < 0.1


# ---------------------------------------------------------------- gradients
def fd_check(P, tokens, name, flat_indices, G):
    """Central differences of the mean loss at P[flat_indices]; -> failures."""
    bad = []
    reg = reference.registry(CONFIG)
    spec = reg.by_name[name]
    for i in flat_indices:
        j = spec.offset + int(i)
        plus, minus = P.copy(), P.copy()
        plus[j] += FD_H
        minus[j] -= FD_H
        fd = (mean_loss(plus, tokens) - mean_loss(minus, tokens)) / (2 * FD_H)
        if not abs(fd - G[j]) <= FD_RTOL * abs(G[j]) + FD_ATOL:
            where = np.unravel_index(int(i), spec.shape)
            bad.append(f"{name}{list(where)}: gradient {G[j]!r}, finite difference {fd!r}, "
                       f"error {abs(fd - G[j]):.3e}")
    return bad


@pytest.mark.parametrize("point", ["initialized", "rough"])
def test_every_parameter_gradient_against_finite_differences(point):
    tokens = tokens_with_every_kind_of_row()
    P = reference.initialize(CONFIG).astype(np.float64) if point == "initialized" else rough_parameters()
    _, G = reference.loss_and_grads(CONFIG, P, tokens, "fp32")
    assert G.dtype == np.float64 and G.shape == P.shape
    rng = np.random.default_rng(2)
    bad = []
    for spec in reference.registry(CONFIG).specs:  # every tensor, 6 random elements of each
        bad += fd_check(P, tokens, spec.name, rng.choice(spec.size, 6, replace=False), G)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("point", ["initialized", "rough"])
def test_tied_embedding_gradient_is_gather_plus_unembedding(point):
    """Rows used as inputs get both parts, rows used only as targets and
    unused rows only the unembedding part: each kind against differences."""
    tokens = tokens_with_every_kind_of_row()
    P = reference.initialize(CONFIG).astype(np.float64) if point == "initialized" else rough_parameters()
    _, G = reference.loss_and_grads(CONFIG, P, tokens, "fp32")
    D = CONFIG.d_model
    inputs = set(tokens[:, :-1].ravel().tolist())
    rows = {"repeated input": [7], "input": sorted(inputs - {7})[:3],
            "target only": [60, 61], "unused": [48, 59, 63]}
    assert not ({60, 61, 48, 59, 63} & inputs)
    rng = np.random.default_rng(3)
    bad = []
    for kind, ids in rows.items():
        for v in ids:
            cols = rng.choice(D, 3, replace=False)
            bad += [f"({kind}) " + b for b in
                    fd_check(P, tokens, "tok_embedding.weight", v * D + cols, G)]
    assert not bad, "\n".join(bad)
    # the gather part is real: an input row's gradient is not the gradient it
    # would get as an unembedding row alone (rows 7 and 48 differ in kind)
    emb = G[:CONFIG.vocab * D].reshape(CONFIG.vocab, D)
    assert np.abs(emb[7]).max() > 3 * np.abs(emb[48]).max()


def test_float32_gradients_follow_the_float64_gradients():
    """The production path (float32 P) computes the same gradient as the
    float64 one, tensor by tensor, and stays float32 throughout."""
    tokens = tokens_with_every_kind_of_row()
    P32 = rough_parameters().astype(np.float32)
    ce32, G32 = reference.loss_and_grads(CONFIG, P32, tokens, "fp32")
    assert G32.dtype == np.float32 and ce32.dtype == np.float32
    _, G64 = reference.loss_and_grads(CONFIG, P32.astype(np.float64), tokens, "fp32")
    for spec in reference.registry(CONFIG).specs:
        got, want = G32[spec.slice], G64[spec.slice]
        err = np.abs(got - want)
        i = int(np.argmax(err))
        assert err[i] <= TOL["grads_f32"] * np.abs(want).max(), (
            f"{spec.name}{list(np.unravel_index(i, spec.shape))}: float32 {got[i]!r}, "
            f"float64 {want[i]!r}")


def test_gradients_are_fresh_and_step_does_not_touch_its_input_state():
    tokens = tokens_with_every_kind_of_row()
    P = reference.initialize(CONFIG)
    state = reference.State.fresh(P.copy())
    before = state.copy()
    r1 = reference.step(CONFIG, state, tokens, "fp32", grads=True)
    r2 = reference.step(CONFIG, state, tokens, "fp32", grads=True)
    for name in "PMV":
        np.testing.assert_array_equal(getattr(state, name), getattr(before, name))
        assert not np.shares_memory(getattr(r1.state, name), getattr(state, name))
    assert state.t == 0 and r1.state.t == 1
    assert not np.shares_memory(r1.grads, r2.grads)
    np.testing.assert_array_equal(r1.grads, r2.grads)  # deterministic
    assert reference.step(CONFIG, state, tokens, "fp32").grads is None


# ---------------------------------------------------------------- the program's plan and intermediates

def test_the_reference_programs_plan_is_the_calls_it_makes(monkeypatch):
    """debug_report_json's nodes, one per semantic operation, name the
    functions a replay calls, in the order it calls them (numpy's own adds
    and mean aside)."""
    import json
    import sys

    from coppelius.reference import model
    from coppelius.reference.program import capture

    step = sys.modules["coppelius.reference.step"]  # the package's `step` is the function

    program = capture(CONFIG, reference.Hyper(), "fp32", 2, reference.State.fresh(
        reference.initialize(CONFIG)))
    called = []
    for module, prefix, names in (
            (model, "layers.", ["embedding_forward", "layernorm_forward", "linear_forward",
                                "rope_forward", "attention_forward", "swiglu_forward",
                                "crossentropy_forward", "crossentropy_backward",
                                "linear_backward", "layernorm_backward", "rope_backward",
                                "attention_backward", "swiglu_backward", "embedding_backward"]),
            (step, "adamw.", ["gradient_norm", "clip_scale", "adamw_update"])):
        for name in names:
            function = getattr(module, name)
            family = function.__module__.rsplit(".", 1)[1]
            label = f"{prefix}{family}.{name}" if prefix == "layers." else prefix + name

            def spy(*args, _function=function, _label=label, **kwargs):
                called.append(_label)
                return _function(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    program.upload_input(np.random.default_rng(0).integers(0, CONFIG.vocab,
                                                           (2, CONFIG.context + 1)))
    program.replay_and_wait()
    nodes = json.loads(program.debug_report_json("step"))["nodes"]
    planned = [n["function"] for n in nodes if not n["function"].startswith("numpy.")]
    assert called == planned


def test_named_intermediates_are_the_step_itself():
    """step_activations records what the step computes: its logits, row
    losses and the gradient at the embedding give the step's own logits,
    row losses and the embedding's gather gradient."""
    from coppelius.reference.layers.embedding import embedding_backward
    from coppelius.reference.semantic import activation_names
    from coppelius.reference.step import step_activations

    P = reference.initialize(CONFIG)
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab, (2, CONFIG.context + 1))
    acts = step_activations(CONFIG, P, tokens, "fp32")
    assert list(acts) == [name for name, _ in activation_names(CONFIG)]
    assert np.array_equal(acts["logits"], reference.forward(CONFIG, P, tokens[:, :-1]))
    rows, G = reference.loss_and_grads(CONFIG, P, tokens)
    assert np.array_equal(acts["row_losses"], rows)
    spec = reference.registry(CONFIG)["tok_embedding.weight"]
    # the tied embedding's gradient: the unembedding part plus the gather of embedding.dout
    d_head = acts["dlogits"].reshape(-1, CONFIG.vocab).T @ acts["final_norm.out"].reshape(
        -1, CONFIG.d_model)
    gather = embedding_backward(acts["embedding.dout"], tokens[:, :-1], CONFIG.vocab)
    assert np.allclose(d_head + gather, G[spec.slice].reshape(spec.shape), rtol=1e-5, atol=1e-7)


def test_accumulated_gradient_is_the_sum_of_micro_batch_gradients():
    """SPEC 19: G of the whole batch (loss_and_grads, mean over B*T rows)
    against the sum of the micro-batches' gradients, each scaled by
    1/(B*T), computed independently in float64; and the step's order."""
    from coppelius.reference.step import accumulated_loss_and_grads, loss_and_grads

    config = reference.preset("test")
    P = reference.initialize(config)
    tokens = np.random.default_rng(21).integers(0, config.vocab, (4, config.context + 1))
    ce, G = loss_and_grads(config, P, tokens)
    rows = tokens.shape[0] * config.context
    P64 = P.astype(np.float64)
    parts = [loss_and_grads(config, P64, tokens[i:i + 2], rows=rows) for i in (0, 2)]
    G64 = parts[0][1] + parts[1][1]
    assert np.linalg.norm(G - G64) / np.linalg.norm(G64) <= 1e-6
    ce2, G2 = accumulated_loss_and_grads(config, P, tokens, accumulate=2)
    assert np.array_equal(ce2, ce)  # the same row losses, in batch order
    g0 = loss_and_grads(config, P, tokens[:2], rows=rows)[1]
    g1 = loss_and_grads(config, P, tokens[2:], rows=rows)[1]
    assert np.array_equal(G2, g0 + g1)  # micro-batch 0 first, float32, left to right
    state = reference.State.fresh(P)
    one = reference.step(config, state, tokens, accumulate=2)
    assert one.loss == ce.mean(dtype=np.float32)
    with pytest.raises(Exception, match="accumulate=3: must divide the batch 4"):
        accumulated_loss_and_grads(config, P, tokens, accumulate=3)
