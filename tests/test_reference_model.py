"""The whole reference model: logits, loss and every parameter's gradient
(SPEC sections 3, 4, 5) on the `test` preset and on every member of the
family (SPEC 21): the family presets, two members no preset is, and
hypothesis-drawn small ones.

- The forward against `naive_forward`, the SPEC text written out again in
  float64 with per-context and per-head loops, an explicit causal mask and
  rope as a complex rotation of the first R elements of each head
  (test_precision.py reuses it for bf16).
- Every parameter tensor's gradient (reference.loss_and_grads in float64)
  against float64 central finite differences of the mean loss, on sampled
  elements of every tensor and on embedding rows used as inputs, used only
  as targets, and not used (the tied embedding's gradient is the sum of its
  gather and unembedding parts, an untied one's its gather part alone; a
  difference quotient sees both)."""

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coppelius import reference
from coppelius.reference.config import FAMILY_FIELDS, ROPE_BASE, Config
from tests.test_model_family import family_configs  # a small member of any kind

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
def rope_tables_f32(T, R, base=ROPE_BASE):
    """cos, sin (T, R/2) of theta = t * base^(-2j/R), j < R/2 (SPEC 3, 21),
    by the math module in float64, rounded to float32 as SPEC 3 says."""
    theta = np.array([[t * float(base) ** (-2.0 * j / R) for j in range(R // 2)]
                      for t in range(T)]).reshape(T, R // 2)
    cos = np.vectorize(math.cos, otypes=[float])(theta).astype(np.float32).astype(np.float64)
    sin = np.vectorize(math.sin, otypes=[float])(theta).astype(np.float32).astype(np.float64)
    return cos, sin


def naive_forward(config, P, tokens, rnd=None):
    """tokens (B,T) -> logits (B,T,V) in float64, for any member of the
    family (SPEC 3 and 21). `rnd` rounds each operand of each matrix product
    (None: exact); under bf16 that is bfloat16. Each field is read from the
    config here and its formula written out: the norm (layernorm, or rmsnorm
    without a bias) with norm_eps; k and v of n_kv_head heads, query head h
    using key/value head h // (H / Hkv); q, k, v biases added after the
    product; the first R = rotary * E elements of a head rotated by
    theta = t * rope_base^(-2j/R), the rest passed through; the logits of
    lm_head.weight where untied."""
    rnd = rnd or (lambda a: a)
    mm = lambda a, b: rnd(a) @ rnd(b)  # noqa: E731
    w = reference.registry(config).views(np.asarray(P, np.float64))
    H, D = config.n_head, config.d_model
    E = D // H
    Hkv = H if config.n_kv_head is None else config.n_kv_head
    group = H // Hkv
    R = Fraction(config.rotary) * E
    assert R.denominator == 1
    R = int(R)
    eps = float(Fraction(config.norm_eps))
    tokens = np.asarray(tokens)
    T = tokens.shape[1]
    cos, sin = rope_tables_f32(T, R, Fraction(config.rope_base))

    def norm(x, n):
        if config.norm == "rmsnorm":  # no mean, no bias (SPEC 21)
            return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w[n + ".weight"]
        assert config.norm == "layernorm"
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[n + ".weight"] + w[n + ".bias"]

    def project(h, name):  # h @ W.T, and + b where the config has q/k/v biases
        y = mm(h, w[name + ".weight"].T)
        return y + w[name + ".bias"] if config.qkv_bias else y

    def rope(x):  # (T,E): z_j = x_j + i x_{j+R/2} for j < R/2 rotated; x[R:] as it is
        z = (x[:, :R // 2] + 1j * x[:, R // 2:R]) * (cos + 1j * sin)
        return np.concatenate([z.real, z.imag, x[:, R:]], axis=-1)

    head = w["tok_embedding.weight"] if config.tied else w["lm_head.weight"]
    out = []
    for ids in tokens:  # batch elements never interact
        x = w["tok_embedding.weight"][ids]  # (T,D)
        for l in range(config.n_layer):
            p = f"layers.{l}."
            h = norm(x, p + "attn_norm")
            q, k, v = (project(h, p + f"attn.{n}") for n in "qkv")  # (T,D), (T,Hkv E) x2
            assert k.shape == v.shape == (T, Hkv * E)
            heads = []
            for hd in range(H):
                kv = hd // group  # Hugging Face's repeat_kv order
                qh = rope(q[:, hd * E:(hd + 1) * E])
                kh, vh = rope(k[:, kv * E:(kv + 1) * E]), v[:, kv * E:(kv + 1) * E]
                s = mm(qh, kh.T) / math.sqrt(E)  # (T,T)
                for i in range(T):
                    s[i, i + 1:] = -np.inf  # causal: key j > query i is masked
                e = np.exp(s - s.max(-1, keepdims=True))
                heads.append(mm(e / e.sum(-1, keepdims=True), vh))
            x = x + mm(np.concatenate(heads, axis=-1), w[p + "attn.o.weight"].T)
            h = norm(x, p + "mlp_norm")
            g, u = mm(h, w[p + "mlp.gate.weight"].T), mm(h, w[p + "mlp.up.weight"].T)
            x = x + mm(g / (1.0 + np.exp(-g)) * u, w[p + "mlp.down.weight"].T)
        out.append(mm(norm(x, "final_norm"), head.T))
    return np.stack(out)


def naive_row_losses(logits, targets):
    m = logits.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


# ---------------------------------------------------------------- the members checked
SHAPE = dict(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96)
# every family preset (SPEC 21), and members no preset is: each field away
# from its default at least once beside every other field's both values
MEMBERS = {name: reference.preset(name) for name in ("test", "test-llama", "test-qwen",
                                                     "test-stablelm")}
MEMBERS["mixed-layernorm"] = Config(**{**SHAPE, "n_head": 4}, n_kv_head=2, qkv_bias=True,
                                    rotary=Fraction(1, 2), norm_eps=Fraction(1, 1000),
                                    rope_base=500000)  # tied; 2 of 4 kv heads, E = 8, R = 4
MEMBERS["mixed-rmsnorm"] = Config(**SHAPE, norm="rmsnorm", qkv_bias=True, rotary=Fraction(1, 4),
                                  norm_eps=Fraction(1, 10**6),
                                  rope_base=Fraction(10001, 2))  # tied, ungrouped, E = 16, R = 4
UNTIED = [name for name, c in MEMBERS.items() if not c.tied]
TIED = [name for name, c in MEMBERS.items() if c.tied]


def test_the_members_cover_every_field_away_from_its_default():
    assert {field for c in MEMBERS.values() for field in c.non_default()} == set(FAMILY_FIELDS)
    assert {c.norm for c in MEMBERS.values()} == {"layernorm", "rmsnorm"}
    assert any(1 < c.kv_heads < c.n_head for c in MEMBERS.values())  # grouped, several kv heads


# ---------------------------------------------------------------- inputs
def tokens_with_every_kind_of_row(seed=20260925):
    """(2, T+1) ids: inputs from [0, 48) with a repeated id, two ids (60, 61)
    that occur only as the last target, and ids 48..59, 62, 63 unused."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 48, (2, CONFIG.context + 1))
    tokens[0, 5] = tokens[1, 9] = tokens[0, 12] = 7  # gathered three times
    tokens[:, -1] = [60, 61]
    return tokens


def rough_parameters(config=CONFIG, seed=1):
    """Initialized parameters plus noise: norms away from 1, biases away from
    0, attention away from uniform, so every path of the backward carries weight."""
    P = reference.initialize(config).astype(np.float64)
    return P + np.random.default_rng(seed).normal(0.0, 0.1, P.shape)


def parameters(config, point):
    return reference.initialize(config).astype(np.float64) if point == "initialized" \
        else rough_parameters(config)


def mean_loss(config, P, tokens):
    ce, _ = reference.loss_and_grads(config, P, tokens)
    return math.fsum(ce.ravel()) / ce.size


# ---------------------------------------------------------------- forward and loss
def check_logits_and_loss(config, P64, tokens):
    P32 = P64.astype(np.float32)
    B, T = tokens.shape[0], tokens.shape[1] - 1
    want = naive_forward(config, P32, tokens[:, :-1])
    scale = np.abs(want).max()

    got32 = reference.forward(config, P32, tokens[:, :-1], "fp32")
    assert got32.dtype == np.float32 and got32.shape == (B, T, config.vocab)
    err = np.abs(got32 - want).max() / scale
    assert err <= TOL["logits_f32"], f"logits (float32): error {err:.3e} of max |logit| {scale:.3e}"
    got64 = reference.forward(config, P32.astype(np.float64), tokens[:, :-1], "fp32")
    err = np.abs(got64 - want).max() / scale
    assert err <= TOL["logits_f64"], f"logits (float64): error {err:.3e}"

    result = reference.step(config, reference.State.fresh(P32), tokens, "fp32")
    ce = naive_row_losses(want, tokens[:, 1:])
    assert result.row_losses.dtype == np.float32 and result.row_losses.shape == (B, T)
    assert np.abs(result.row_losses - ce).max() <= 1e-5 * np.abs(ce).max()
    assert isinstance(result.loss, np.float32)
    assert abs(float(result.loss) - ce.mean()) <= 1e-5 * ce.mean()
    assert result.loss == np.float32(result.row_losses.mean(dtype=np.float32))  # the mean of the rows


@pytest.mark.parametrize("point", ["initialized", "rough"])
@pytest.mark.parametrize("member", MEMBERS)
def test_logits_and_loss_match_the_spec_written_out(member, point):
    config = MEMBERS[member]
    check_logits_and_loss(config, parameters(config, point), tokens_with_every_kind_of_row())


@settings(max_examples=8)
@given(config=family_configs(), seed=st.integers(0, 2**32 - 1))
def test_logits_of_a_drawn_member_match_the_spec_written_out(config, seed):
    tokens = np.random.default_rng(seed).integers(0, config.vocab, (2, config.context + 1))
    check_logits_and_loss(config, rough_parameters(config, seed), tokens)


def test_each_field_changes_the_logits():
    """Each member's written-out forward differs from the one of its
    defaults (on the same parameters where the shapes agree): no field is
    ignored by both this file and the reference alike."""
    tokens = tokens_with_every_kind_of_row()[:, :-1]
    base = MEMBERS["test"]
    P = rough_parameters(base)
    for fields in (dict(norm_eps=Fraction(1, 10)), dict(rope_base=500000), dict(rotary="1/2")):
        other = dataclasses.replace(base, **fields)
        a, b = naive_forward(base, P, tokens), naive_forward(other, P, tokens)
        assert np.abs(a - b).max() > 1e-3 * np.abs(a).max(), fields
        assert np.abs(reference.forward(other, P, tokens, "fp32") - b).max() <= 1e-6 * np.abs(b).max()


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
    for name, config in MEMBERS.items():
        result = reference.step(config, reference.State.fresh(reference.initialize(config)), tokens)
        assert abs(float(result.loss) - math.log(config.vocab)) < 0.1, name


# ---------------------------------------------------------------- gradients
def fd_check(config, P, tokens, name, flat_indices, G):
    """Central differences of the mean loss at P[flat_indices]; -> failures."""
    bad = []
    spec = reference.registry(config).by_name[name]
    for i in flat_indices:
        j = spec.offset + int(i)
        plus, minus = P.copy(), P.copy()
        plus[j] += FD_H
        minus[j] -= FD_H
        fd = (mean_loss(config, plus, tokens) - mean_loss(config, minus, tokens)) / (2 * FD_H)
        if not abs(fd - G[j]) <= FD_RTOL * abs(G[j]) + FD_ATOL:
            where = np.unravel_index(int(i), spec.shape)
            bad.append(f"{name}{list(where)}: gradient {G[j]!r}, finite difference {fd!r}, "
                       f"error {abs(fd - G[j]):.3e}")
    return bad


def check_every_gradient(config, P, tokens, per_tensor, seed=2):
    _, G = reference.loss_and_grads(config, P, tokens, "fp32")
    assert G.dtype == np.float64 and G.shape == P.shape
    rng = np.random.default_rng(seed)
    bad = []
    for spec in reference.registry(config).specs:  # every tensor, a few random elements of each
        n = min(per_tensor, spec.size)
        bad += fd_check(config, P, tokens, spec.name, rng.choice(spec.size, n, replace=False), G)
    assert not bad, "\n".join(bad)


# the initialized point only for `test`: a family member's biases are zeros
# and its norm weights ones there, which a wrong gradient of them can hide behind
@pytest.mark.parametrize("member, point", [("test", "initialized")] +
                         [(name, "rough") for name in MEMBERS])
def test_every_parameter_gradient_against_finite_differences(member, point):
    config = MEMBERS[member]
    check_every_gradient(config, parameters(config, point), tokens_with_every_kind_of_row(), 6)


@settings(max_examples=4)
@given(config=family_configs(), seed=st.integers(0, 2**32 - 1))
def test_every_gradient_of_a_drawn_member_against_finite_differences(config, seed):
    tokens = np.random.default_rng(seed).integers(0, config.vocab, (2, config.context + 1))
    check_every_gradient(config, rough_parameters(config, seed), tokens, 2, seed)


@pytest.mark.parametrize("point", ["initialized", "rough"])
@pytest.mark.parametrize("member", TIED)
def test_tied_embedding_gradient_is_gather_plus_unembedding(member, point):
    """Rows used as inputs get both parts, rows used only as targets and
    unused rows only the unembedding part: each kind against differences."""
    config = MEMBERS[member]
    tokens = tokens_with_every_kind_of_row()
    P = parameters(config, point)
    _, G = reference.loss_and_grads(config, P, tokens, "fp32")
    D = config.d_model
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
                    fd_check(config, P, tokens, "tok_embedding.weight", v * D + cols, G)]
    assert not bad, "\n".join(bad)
    # the gather part is real: an input row's gradient is not the gradient it
    # would get as an unembedding row alone (rows 7 and 48 differ in kind)
    emb = G[:config.vocab * D].reshape(config.vocab, D)
    assert np.abs(emb[7]).max() > 3 * np.abs(emb[48]).max()


@pytest.mark.parametrize("member", UNTIED)
def test_untied_embedding_gets_its_gather_gradient_only(member):
    """Untied (SPEC 21): a row never used as an input has a zero embedding
    gradient, exactly, and its lm_head row carries the unembedding gradient;
    input rows and lm_head rows of each kind against differences."""
    config = MEMBERS[member]
    tokens = tokens_with_every_kind_of_row()
    P = rough_parameters(config)
    _, G = reference.loss_and_grads(config, P, tokens, "fp32")
    reg = reference.registry(config)
    D = config.d_model
    emb = G[reg["tok_embedding.weight"].slice].reshape(config.vocab, D)
    head = G[reg["lm_head.weight"].slice].reshape(config.vocab, D)
    inputs = sorted(set(tokens[:, :-1].ravel().tolist()))
    others = [v for v in range(config.vocab) if v not in inputs]
    assert not emb[others].any()  # 60, 61 (targets only) and the unused rows
    assert np.abs(emb[inputs]).min(axis=1).max() > 0 and np.abs(head[[60, 61, 48]]).max() > 0
    rng = np.random.default_rng(4)
    bad = []
    for name, ids in (("tok_embedding.weight", [7] + inputs[:3] + [60, 48]),
                      ("lm_head.weight", [7, 60, 61, 48, 63])):
        for v in ids:
            bad += fd_check(config, P, tokens, name, v * D + rng.choice(D, 3, replace=False), G)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("member", MEMBERS)
def test_float32_gradients_follow_the_float64_gradients(member):
    """The production path (float32 P) computes the same gradient as the
    float64 one, tensor by tensor, and stays float32 throughout."""
    config = MEMBERS[member]
    tokens = tokens_with_every_kind_of_row()
    P32 = rough_parameters(config).astype(np.float32)
    ce32, G32 = reference.loss_and_grads(config, P32, tokens, "fp32")
    assert G32.dtype == np.float32 and ce32.dtype == np.float32
    _, G64 = reference.loss_and_grads(config, P32.astype(np.float64), tokens, "fp32")
    for spec in reference.registry(config).specs:
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

@pytest.mark.parametrize("member", ["test", "test-qwen", "mixed-layernorm"])
def test_the_reference_programs_plan_is_the_calls_it_makes(monkeypatch, member):
    """debug_report_json's nodes, one per semantic operation, name the
    functions a replay calls, in the order it calls them (numpy's own adds
    and mean aside)."""
    config = MEMBERS[member]
    import json
    import sys

    from coppelius.reference import model
    from coppelius.reference.program import capture

    step = sys.modules["coppelius.reference.step"]  # the package's `step` is the function

    program = capture(config, reference.Hyper(), "fp32", 2, reference.State.fresh(
        reference.initialize(config)))
    called = []
    for module, prefix, names in (
            (model, "layers.", ["embedding_forward", "layernorm_forward", "rmsnorm_forward",
                                "linear_forward", "linear_bias_forward",
                                "rope_forward", "attention_forward", "swiglu_forward",
                                "crossentropy_forward", "crossentropy_backward",
                                "linear_backward", "linear_bias_backward",
                                "layernorm_backward", "rmsnorm_backward", "rope_backward",
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
    program.upload_input(np.random.default_rng(0).integers(0, config.vocab,
                                                           (2, config.context + 1)))
    program.replay_and_wait()
    nodes = json.loads(program.debug_report_json("step"))["nodes"]
    planned = [n["function"] for n in nodes if not n["function"].startswith("numpy.")]
    assert called == planned
    norm = "rmsnorm" if config.norm == "rmsnorm" else "layernorm"
    assert f"layers.{norm}.{norm}_forward" in called
    assert ("layers.linear.linear_bias_forward" in called) == config.qkv_bias


@pytest.mark.parametrize("member", ["test", "test-llama"])
def test_named_intermediates_are_the_step_itself(member):
    """step_activations records what the step computes: its logits, row
    losses and the gradient at the embedding give the step's own logits,
    row losses and the embedding's gather gradient (plus, tied, the
    unembedding part; untied, that part is lm_head's gradient)."""
    from coppelius.reference.layers.embedding import embedding_backward
    from coppelius.reference.semantic import activation_names
    from coppelius.reference.step import step_activations

    config = MEMBERS[member]
    P = reference.initialize(config)
    tokens = np.random.default_rng(1).integers(0, config.vocab, (2, config.context + 1))
    acts = step_activations(config, P, tokens, "fp32")
    assert list(acts) == [name for name, _ in activation_names(config)]
    assert np.array_equal(acts["logits"], reference.forward(config, P, tokens[:, :-1]))
    rows, G = reference.loss_and_grads(config, P, tokens)
    assert np.array_equal(acts["row_losses"], rows)
    reg = reference.registry(config)
    embedding = G[reg["tok_embedding.weight"].slice].reshape(config.vocab, config.d_model)
    d_head = acts["dlogits"].reshape(-1, config.vocab).T @ acts["final_norm.out"].reshape(
        -1, config.d_model)
    gather = embedding_backward(acts["embedding.dout"], tokens[:, :-1], config.vocab)
    if config.tied:  # the unembedding part plus the gather of embedding.dout
        assert np.allclose(d_head + gather, embedding, rtol=1e-5, atol=1e-7)
    else:
        assert np.allclose(gather, embedding, rtol=1e-5, atol=1e-7)
        head = G[reg["lm_head.weight"].slice].reshape(config.vocab, config.d_model)
        assert np.allclose(d_head, head, rtol=1e-5, atol=1e-7)


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
