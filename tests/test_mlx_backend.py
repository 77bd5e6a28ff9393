"""The MLX backend: its pieces against independent float64 NumPy, its whole
step against an independent float64 model and finite differences on every
member of the model family (SPEC 21), AdamW on hand-computable inputs, and
capture (traced once, refusals, the compilation report). The step against
the reference on each member: tests/test_mlx_families.py."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.conformance.cases import random_state
from coppelius.conformance.tolerances import relative_error
from coppelius.reference.config import Config, Hyper, preset
from coppelius.reference.params import initialize, registry
from coppelius.reference.compilation import STAGE_STATES, STAGES
from coppelius.reference.contract import ReplayError
from coppelius.reference.state import State

mx = pytest.importorskip("mlx.core")
from coppelius.accelerated import mlx_backend  # noqa: E402

pytestmark = pytest.mark.mlx

CONFIG = preset("test")
B = 2
SHAPE = {"vocab": 64, "context": 16, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 96}
# the family's members (SPEC 21): the presets, and one no preset is: layernorm
# with 2 key/value heads for 4 query heads, q/k/v biases, half of each head
# rotated, tied, and another epsilon and rope base
MIXED = Config(**{**SHAPE, "n_head": 4}, n_kv_head=2, qkv_bias=True, rotary="1/2",
               norm_eps="1/1000", rope_base=500)
MEMBERS = {"test-llama": preset("test-llama"), "test-qwen": preset("test-qwen"),
           "test-stablelm": preset("test-stablelm"), "mixed": MIXED}


def windows(n, seed=0, config=CONFIG, batch=B):
    # n windows of (B, T+1) random ids
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab, size=(n, batch, config.context + 1))


def fresh(config=CONFIG):
    return State.fresh(initialize(config))


def check_close(what, got, want, tol):
    error, worst, a, b = relative_error(got, want)
    assert error <= tol, f"{what}: error {error:.3e} > {tol:.0e} at {worst}: {a!r} vs {b!r}"


def f64(x):
    return np.array(x, dtype=np.float64)


# ------------------------------------------------- independent float64 model
# Written from SPEC 3 and 21 directly (loops over heads and pairs, no shared
# code with the reference or the backend), for every member of the family.

def np_layernorm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_rmsnorm(x, w, eps=1e-5):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def np_rope_tables(T, R, base=10000.0):
    # float64 angles theta = t * base^(-2j/R) for j < R/2 (SPEC 3, 21)
    theta = np.array([[t * base ** (-2.0 * j / R) for j in range(R // 2)] for t in range(T)])
    return np.cos(theta), np.sin(theta)


def np_rope(x, cos, sin):
    # x (B,T,H,E): pair j with j + R/2 for j < R/2, R = 2 * cos.shape[1]; the rest unchanged
    out = x.copy()
    half = cos.shape[1]
    for j in range(half):
        c, s = cos[:, j][None, :, None], sin[:, j][None, :, None]
        out[..., j] = x[..., j] * c - x[..., j + half] * s
        out[..., j + half] = x[..., j + half] * c + x[..., j] * s
    return out


def np_attention(q, k, v):
    # q (B,H,T,E), k, v (B,Hkv,T,E) -> (B,H,T,E): causal softmax(q k^T / sqrt(E)) v,
    # query head h with key/value head h // (H / Hkv)
    H, T, E = q.shape[1], q.shape[-2], q.shape[-1]
    g = H // k.shape[1]
    out = np.empty_like(q)
    for h in range(H):
        s = q[:, h] @ np.swapaxes(k[:, h // g], -1, -2) / math.sqrt(E)
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // g]
    return out


def np_row_losses(logits, targets):
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def np_logits(config, w, tokens):
    # w: name -> float64 array; tokens (B,T) -> (B,T,V)
    Bn, T = tokens.shape
    H, E, Hkv = config.n_head, config.d_model // config.n_head, config.n_kv_head or config.n_head
    R, eps = int(config.rotary * E), float(config.norm_eps)
    cos, sin = (t.astype(np.float32).astype(np.float64)
                for t in np_rope_tables(T, R, float(config.rope_base)))

    def norm(x, name):
        if config.norm == "rmsnorm":
            return np_rmsnorm(x, w[name + ".weight"], eps)
        return np_layernorm(x, w[name + ".weight"], w[name + ".bias"], eps)

    def project(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if config.qkv_bias else y

    x = w["tok_embedding.weight"][tokens]
    for l in range(config.n_layer):
        p = f"layers.{l}."
        h = norm(x, p + "attn_norm")
        q = np_rope(project(h, p + "attn.q").reshape(Bn, T, H, E), cos, sin)
        k = np_rope(project(h, p + "attn.k").reshape(Bn, T, Hkv, E), cos, sin)
        v = project(h, p + "attn.v").reshape(Bn, T, Hkv, E)
        y = np_attention(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)))
        x = x + y.transpose(0, 2, 1, 3).reshape(Bn, T, H * E) @ w[p + "attn.o.weight"].T
        h = norm(x, p + "mlp_norm")
        g, u = h @ w[p + "mlp.gate.weight"].T, h @ w[p + "mlp.up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down.weight"].T
    h = norm(x, "final_norm")
    return h @ w["tok_embedding.weight" if config.tied else "lm_head.weight"].T


def np_mean_loss(config, w, tokens):
    return np_row_losses(np_logits(config, w, tokens[:, :-1]), tokens[:, 1:]).mean()


# ------------------------------------------------- pieces

@pytest.mark.parametrize("config", [preset("test"), preset("tiny"), preset("test-stablelm"),
                                    Config(**SHAPE, rotary="1/4", rope_base=500000)],
                         ids=["test", "tiny", "test-stablelm", "rotary-1/4"])
def test_rope_tables_are_float64_angles_rounded_once(config):
    T, R = config.context, int(config.rotary * config.d_model // config.n_head)
    model = mlx_backend.Model(config, "fp32")
    assert model.cos.shape == (T, R // 2)
    for table, exact in zip((model.cos, model.sin), np_rope_tables(T, R, float(config.rope_base))):
        table = np.array(table)
        assert table.dtype == np.float32
        # within half an ulp of the float64 value: rounded to nearest, once
        half_ulp = np.spacing(np.abs(exact).astype(np.float32)) / 2
        assert (np.abs(table - exact) <= half_ulp * (1 + 1e-9)).all()


@given(st.integers(1, 3), st.integers(1, 8),
       st.sampled_from([(1, 1, 2, 2), (2, 2, 4, 4), (2, 2, 4, 2), (2, 1, 8, 4), (4, 2, 4, 2),
                        (4, 1, 8, 8)]),  # H, Hkv, E, R
       st.integers(0, 2**31 - 1))
def test_layer_pieces_match_float64(Bn, T, heads, seed):
    H, Hkv, E, R = heads
    rng = np.random.default_rng(seed)
    config = Config(vocab=64, context=8, d_model=H * E, n_layer=1, n_head=H, d_ff=8,
                    n_kv_head=Hkv, rotary=f"{R}/{E}", norm_eps="1/1000")
    model = mlx_backend.Model(config, "fp32")
    x = rng.standard_normal((Bn, T, H * E)).astype(np.float32) * 3 + 1
    w, b = rng.standard_normal((2, H * E)).astype(np.float32)
    got = model.layernorm_forward(mx.array(x), mx.array(w), mx.array(b))
    check_close("layernorm", np.array(got), np_layernorm(f64(x), f64(w), f64(b), 1e-3), 1e-5)
    got = model.rmsnorm_forward(mx.array(x), mx.array(w))
    check_close("rmsnorm", np.array(got), np_rmsnorm(f64(x), f64(w), 1e-3), 1e-5)

    x = rng.standard_normal((Bn, T, H, E)).astype(np.float32)
    cos, sin = np_rope_tables(T, R)
    got = np.array(model.rope_forward(mx.array(x)))
    check_close("rope", got, np_rope(f64(x), cos.astype(np.float32), sin.astype(np.float32)), 1e-6)
    assert np.array_equal(got[..., R:], x[..., R:])  # the unrotated elements pass through

    q = rng.standard_normal((Bn, H, T, E)).astype(np.float32)
    k, v = rng.standard_normal((2, Bn, Hkv, T, E)).astype(np.float32)
    got = model.attention_forward(mx.array(q), mx.array(k), mx.array(v))
    check_close("attention", np.array(got), np_attention(f64(q), f64(k), f64(v)), 1e-5)

    logits = (rng.standard_normal((Bn, T, 64)) * 5).astype(np.float32)
    targets = rng.integers(0, 64, (Bn, T))
    got = mlx_backend.Model.crossentropy_forward(mx.array(logits), mx.array(targets, dtype=mx.int32))
    want = np_row_losses(f64(logits), targets)
    # a loss is a difference, logsumexp - the target's logit: float32's error
    # is relative to those terms, which can be far larger than the loss
    picked = np.take_along_axis(f64(logits), targets[..., None], -1)[..., 0]
    terms = np.abs(want + picked) + np.abs(picked)
    error = np.linalg.norm(np.array(got, np.float64) - want) / np.linalg.norm(terms)
    assert error <= 1e-6, f"cross entropy: error {error:.3e} of its terms' magnitude"


@given(st.integers(0, 2**31 - 1))
def test_round_bf16_is_round_to_nearest_even(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(np.float32)
    # exact ties: a bfloat16 value plus half its last place
    ties = (rng.standard_normal(256).astype(ml_dtypes.bfloat16).astype(np.float32)
            .view(np.uint32) | np.uint32(0x8000)).view(np.float32)
    x = np.concatenate([x, ties, np.float32([np.inf, -np.inf, 0.0, -0.0, 3.4e38])])
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = np.array(mlx_backend.round_bf16(mx.array(x)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@given(st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_bf16_projection_adds_its_bias_in_float32(Bn, T, seed):
    """q = h @ Wq.T + b under bf16 (SPEC 6, 21): the product's operands are
    rounded, the bias is not (it is ten times the product here, so a rounded
    bias would be off by ~1e-3 of the result)."""
    rng = np.random.default_rng(seed)
    config = Config(**SHAPE, qkv_bias=True)
    D = config.d_model
    h = rng.standard_normal((Bn, T, D)).astype(np.float32)
    w = {"attn.q.weight": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32),
         "attn.q.bias": (10 * rng.standard_normal(D)).astype(np.float32)}
    got = mlx_backend.Model(config, "bf16").projection_forward(
        mx.array(h), {k: mx.array(v) for k, v in w.items()}, "attn.q")
    r = lambda x: f64(x.astype(ml_dtypes.bfloat16).astype(np.float32))  # noqa: E731
    want = r(h) @ r(w["attn.q.weight"]).T + f64(w["attn.q.bias"])
    check_close("q", np.array(got), want, 1e-6)


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_bf16_matmul_rounds_forward_and_backward_operands(n, k, m, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal((k, m)).astype(np.float32)
    g = rng.standard_normal((n, m)).astype(np.float32)
    r = lambda x: f64(x.astype(ml_dtypes.bfloat16).astype(np.float32))  # noqa: E731
    mm = mlx_backend.matmul_for("bf16")
    out, vjps = mx.vjp(lambda a, b: mm(a, b), [mx.array(a), mx.array(b)], [mx.array(g)])
    got = np.array(out[0])
    assert got.dtype == np.float32
    # products of bfloat16 values are exact, so only the float32 sums round
    check_close("forward", got, r(a) @ r(b), 1e-6)
    check_close("d a", np.array(vjps[0]), r(g) @ r(b).T, 1e-6)
    check_close("d b", np.array(vjps[1]), r(a).T @ r(g), 1e-6)
    # the result is not rounded to bfloat16: a float32 result keeps its low bits
    if n * m * k >= 8:
        assert not np.array_equal(got, got.astype(ml_dtypes.bfloat16).astype(np.float32))


# ------------------------------------------------- the whole step, independent of the reference

@pytest.mark.parametrize("name", ["test", *MEMBERS])
def test_step_matches_float64_model_and_finite_differences(name):
    """Logits and loss against the float64 model above; every parameter's
    gradient against a float64 central difference along a direction with no
    cancellation (the sign of the gradient times a positive random weight).
    From a state moved off the initialization, so the biases are not zeros
    and the norm weights not ones: a missing bias or weight shows."""
    config = CONFIG if name == "test" else MEMBERS[name]
    state = random_state(config, 5, t=0) if name != "test" else fresh()
    tokens = windows(1, seed=3, config=config)[0]
    program = mlx_backend.capture(config, Hyper(), "fp32", B, state.copy())
    w = {k: f64(v) for k, v in registry(config).views(state.P).items()}
    inputs = tokens[:, :-1]
    check_close("logits", program.logits(inputs), np_logits(config, w, inputs), 1e-5)
    program.upload_input(tokens)
    loss = program.replay_and_wait()
    want_rows = np_row_losses(np_logits(config, w, tokens[:, :-1]), tokens[:, 1:])
    check_close("row losses", program.row_losses(), want_rows, 1e-5)
    check_close("loss", loss, want_rows.mean(), 1e-5)

    G = registry(config).views(program.gradients())
    rng = np.random.default_rng(4)
    h = 1e-6
    for spec in registry(config):
        d = np.sign(G[spec.name]) * rng.uniform(0.5, 1.0, spec.shape)
        plus, minus = dict(w), dict(w)
        plus[spec.name] = w[spec.name] + h * d
        minus[spec.name] = w[spec.name] - h * d
        fd = (np_mean_loss(config, plus, tokens) - np_mean_loss(config, minus, tokens)) / (2 * h)
        check_close(f"gradient {spec.name}", float(np.sum(f64(G[spec.name]) * d)), fd, 1e-4)


def test_adamw_one_update_by_hand():
    """From m = v = 0 with a constant gradient g (t = 1): m = (1-b1) g,
    v = (1-b2) g^2, and the step is lr * g/|g| up to epsilon; matrices decay
    by lr * weight_decay first, vectors do not."""
    hyper = Hyper()
    adamw = mlx_backend.AdamW(CONFIG, hyper)
    reg = registry(CONFIG)
    rng = np.random.default_rng(5)
    P = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in reg}
    g = {s.name: np.full(s.shape, (-1) ** s.ordinal * 0.25 * (s.ordinal + 1), np.float32)
         for s in reg}  # a different constant per tensor, both signs
    zero = {s.name: mx.zeros(s.shape) for s in reg}
    dev = lambda d: {k: mx.array(v) for k, v in d.items()}  # noqa: E731
    new_p, new_m, new_v = adamw.update(dev(P), zero, zero, dev(g), mx.array(1, dtype=mx.int32))
    lr, wd, eps = float(hyper.lr), float(hyper.weight_decay), float(hyper.epsilon)
    for s in reg:
        gv = f64(g[s.name])
        check_close(f"m {s.name}", np.array(new_m[s.name]), 0.1 * gv, 1e-7)
        check_close(f"v {s.name}", np.array(new_v[s.name]), 0.05 * gv * gv, 1e-7)
        decayed = f64(P[s.name]) * (1 - lr * wd) if s.decay else f64(P[s.name])
        want = decayed - lr * np.sign(gv) * np.abs(gv) / (np.abs(gv) + eps)
        step = np.array(new_p[s.name], dtype=np.float64) - f64(P[s.name])
        check_close(f"step {s.name}", step, want - f64(P[s.name]), 1e-3)  # float32 cancellation
        check_close(f"p {s.name}", np.array(new_p[s.name]), want, 1e-7)


def test_adamw_zero_gradient_is_weight_decay_on_matrices_only():
    """g = 0 leaves m, v at 0 and the Adam step at exactly 0, so a matrix
    becomes p - float32(lr*wd) * p (one float32 rounding each) and a vector
    stays bit-identical."""
    hyper = Hyper(lr="1/100", weight_decay="1/2")
    adamw = mlx_backend.AdamW(CONFIG, hyper)
    reg = registry(CONFIG)
    P = {s.name: np.random.default_rng(s.ordinal).standard_normal(s.shape).astype(np.float32)
         for s in reg}
    zero = {s.name: mx.zeros(s.shape) for s in reg}
    new_p, _, _ = adamw.update({k: mx.array(v) for k, v in P.items()}, zero, zero, zero,
                               mx.array(7, dtype=mx.int32))
    lrwd = np.float32(0.005)
    for s in reg:
        want = P[s.name] - lrwd * P[s.name] if s.decay else P[s.name]
        got = np.array(new_p[s.name])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), s.name
        assert s.decay == (len(s.shape) == 2)


def test_bias_corrections_are_float64_powers_rounded_once():
    """c1, c2 for t = 1..3000, computed on the device inside a compiled
    function, equal float32(1 - beta^t) of the host's float64 arithmetic."""
    hyper = Hyper(beta1="9/10", beta2="999/1000")
    adamw = mlx_backend.AdamW(CONFIG, hyper)
    ts = mx.arange(1, 3001, dtype=mx.int32)
    c1, c2 = mx.compile(adamw.bias_corrections)(ts)
    for got, beta in ((c1, 0.9), (c2, 0.999)):
        want = np.array([np.float32(1.0 - beta ** t) for t in range(1, 3001)])
        assert np.array_equal(np.array(got), want)


# ------------------------------------------------- against the reference (SPEC section 14)

# ------------------------------------------------- capture and replay

def test_compiled_once_and_replays_without_waiting():
    """Many replays trace the step once; replay() submits without waiting,
    and queued replays give the same bits as waiting after each."""
    ws = windows(6, seed=10)
    queued = mlx_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    assert queued.traces == 1  # capture compiled it; nothing evaluated yet
    assert queued.state().t == 0  # capture performs no update
    for tokens in ws:
        queued.upload_input(tokens)
        event = queued.replay()
    event.wait()
    waited = mlx_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    for tokens in ws:
        waited.upload_input(tokens)
        waited.replay_and_wait()
    assert queued.traces == waited.traces == 1
    assert np.array_equal(queued.state().P, waited.state().P)
    assert np.array_equal(queued.row_losses(), waited.row_losses())
    loss, device_seconds = waited.replay_timed_and_wait()
    assert math.isfinite(loss) and math.isnan(device_seconds)  # MLX has no device clock


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recomputing_the_gate_and_up_products_keeps_every_bit(precision):
    """recompute=True (each layer's gate, up and SwiGLU one mx.checkpoint):
    the same row losses, gradient and P, M, V, bit for bit, over replays
    of the compiled step, and with accumulation."""
    ws = windows(3, seed=12)
    for k in (1, 2):
        kept = mlx_backend.capture(CONFIG, Hyper(), precision, B, fresh(), accumulate=k)
        again = mlx_backend.capture(CONFIG, Hyper(), precision, B, fresh(), accumulate=k,
                                    recompute=True)
        assert again.recompute and again.model.recompute and not kept.recompute
        for program in (kept, again):
            for tokens in ws:
                program.upload_input(tokens)
                program.replay_and_wait()
        assert kept.row_losses().tobytes() == again.row_losses().tobytes()
        assert kept.gradients().tobytes() == again.gradients().tobytes()
        for name in "PMV":
            assert getattr(kept.state(), name).tobytes() == getattr(again.state(), name).tobytes()


def test_no_capture_switch_traces_every_replay(monkeypatch):
    monkeypatch.setenv("COPPELIUS_NO_CAPTURE", "1")
    ws = windows(3, seed=11)
    eager = mlx_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    monkeypatch.delenv("COPPELIUS_NO_CAPTURE")
    compiled = mlx_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    for tokens in ws:
        for program in (eager, compiled):
            program.upload_input(tokens)
            program.replay_and_wait()
    assert eager.traces == 3 and compiled.traces == 1
    report = eager.compilation_report()
    assert {r["stage"]: r["state"] for r in report["stages"]}["command_recording"] == "not_run"
    check_close("P", eager.state().P, compiled.state().P, 1e-6)


def test_a_replaced_state_is_refused():
    """(The refusals every backend shares are in test_program_contract.py.)"""
    program = mlx_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    program.upload_input(windows(1)[0])
    program.replay_and_wait()

    # the optimizer state replaced behind the program's back
    s = program.device_state
    program.device_state = mlx_backend.DeviceState(dict(s.params), dict(s.m), dict(s.v), s.t)
    with pytest.raises(ReplayError, match="state was replaced"):
        program.replay()
    # another backend's state in its place
    program.device_state = program.state()
    with pytest.raises(ReplayError, match="'State' state"):
        program.replay()



@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["test", "mixed"])
def test_compilation_report(precision, name):
    config = CONFIG if name == "test" else MEMBERS[name]
    program = mlx_backend.capture(config, Hyper(), precision, B, fresh(config))
    for tokens in windows(2, seed=12, config=config):
        program.upload_input(tokens)
        program.replay_and_wait()
    report = program.compilation_report()
    assert report["schema"] == "coppelius.training_compilation.v1"
    assert [r["stage"] for r in report["stages"]] == list(STAGES)
    assert all(r["state"] in STAGE_STATES for r in report["stages"])
    states = {r["stage"]: r for r in report["stages"]}
    assert states["command_recording"]["state"] == "applied"
    assert states["precision"]["state"] == ("applied" if precision == "bf16" else "analyzed")
    # each product of the forward (9 per layer and the logits) appears once
    # forward and twice backward in the step's graph (a q/k/v bias is an add)
    products = 9 * config.n_layer + 1
    assert states["precision"]["inputs"] == 3 * products
    assert 0 < report["kernels"] < report["graph_nodes"]  # mx.compile fused something
    assert report["replays"] == 2 and report["traces"] == 1
    assert report["device_bytes"] >= 16 * registry(config).total
    diagnostics = program.diagnostics()
    assert diagnostics["runtime"]["update_count"] == 2


def test_available_and_backend_module():
    from coppelius import accelerated

    assert mlx_backend.available()
    assert accelerated.backend_module("mlx") is mlx_backend
    assert mlx_backend.capture(CONFIG, Hyper(), "fp32", 1, fresh()).backend == "mlx"


# ------------------------------------------------------------- binding backend

@pytest.mark.mlx
def test_binding_through_the_mlx_backend(tmp_path):
    """The binding layer realizes a checkpoint on MLX: the same values as the
    file, the tied head is the very same array, and a fused qkv recipe is the
    concatenation of the three weights."""
    import mlx.core as mx

    from coppelius.accelerated.mlx_backend import MLXBindingBackend
    from coppelius.reference import Hyper, State, initialize, registry
    from coppelius.reference.binding import Concat, RecipeBind, Tensor, bind, default_bindings
    from coppelius.reference.checkpoint import identities, write_checkpoint
    from coppelius.reference.config import PRESETS
    from coppelius.reference.sources import CheckpointFileSource

    config = PRESETS["test"]
    reg = registry(config)
    P = initialize(config)
    path = tmp_path / "ck.bin"
    write_checkpoint(path, config, identities(config, Hyper(), "fp32", 1, None, "0" * 64),
                     State.fresh(P), 0)
    backend = MLXBindingBackend()
    with CheckpointFileSource(path) as source:
        values = bind(reg, default_bindings(config), source, backend,
                      offered=[s.name for s in reg.specs])
        for spec in reg.specs:
            got = np.array(values[spec.name])
            assert got.dtype == np.float32 and got.shape == spec.shape, spec.name
            assert np.array_equal(got, P[spec.slice].reshape(spec.shape)), spec.name
        assert values["lm_head.weight"] is values["tok_embedding.weight"]

        D = config.d_model
        fused = {"layers.0.attn.qkv.weight": ("float32", (3 * D, D))}
        qkv = [Tensor(f"layers.0.attn.{x}.weight") for x in "qkv"]
        got = bind(fused, [RecipeBind("layers.0.attn.qkv.weight", Concat(qkv, 0))], source,
                   backend, offered=[t.key for t in qkv])["layers.0.attn.qkv.weight"]
    assert isinstance(got, mx.array)
    want = np.concatenate([P[reg[f"layers.0.attn.{x}.weight"].slice].reshape(D, D) for x in "qkv"])
    assert np.array_equal(np.array(got), want)


@pytest.mark.mlx
def test_an_mlx_failure_while_binding_names_the_parameter(tmp_path):
    """MLX's own exception while realizing a value (here its concatenate,
    as an out-of-memory would raise) is a BackendFailure naming the parameter."""
    from coppelius.accelerated.mlx_backend import MLXBindingBackend
    from coppelius.reference import Hyper, State, initialize
    from coppelius.reference.binding import BackendFailure, Concat, RecipeBind, Tensor, bind
    from coppelius.reference.checkpoint import identities, write_checkpoint
    from coppelius.reference.sources import CheckpointFileSource

    class Failing(MLXBindingBackend):
        def concat(self, xs, axis):
            import mlx.core as mx

            return mx.concatenate(list(xs), axis=axis + 5)  # MLX refuses the axis itself

    config = preset("test")
    D = config.d_model
    path = tmp_path / "ck.bin"
    write_checkpoint(path, config, identities(config, Hyper(), "fp32", 1, None, "0" * 64),
                     State.fresh(initialize(config)), 0)
    qkv = [Tensor(f"layers.0.attn.{x}.weight") for x in "qkv"]
    with CheckpointFileSource(path) as source, pytest.raises(BackendFailure) as info:
        bind({"layers.0.attn.qkv.weight": ("float32", (3 * D, D))},
             [RecipeBind("layers.0.attn.qkv.weight", Concat(qkv, 0))], source, Failing(),
             offered=[t.key for t in qkv])
    assert str(info.value).startswith("layers.0.attn.qkv.weight: backend mlx failed to realize")
    assert "\n" not in str(info.value)


def test_activations_locate_a_broken_operation_to_its_layer(monkeypatch):
    """MLX's SwiGLU broken in the second layer only: the comparison with the
    reference's intermediates names layers.1.mlp.h first (and layer 0's
    forward passes)."""
    from coppelius.conformance.activations import activation_rows, first_divergence
    from coppelius.reference.step import step_activations

    program = mlx_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    calls, original = [], mlx_backend.Model.swiglu_forward

    def broken(g, u):
        calls.append(1)
        a = original(g, u)
        return a * 1.01 if len(calls) % CONFIG.n_layer == 0 else a  # layer 1 of every forward

    monkeypatch.setattr(mlx_backend.Model, "swiglu_forward", staticmethod(broken))
    tokens = windows(1, seed=40)[0]
    rows = activation_rows(CONFIG, program.activations(tokens),
                           step_activations(CONFIG, fresh().P, tokens, "fp32"), "fp32")
    first = first_divergence(rows)
    assert first is not None and first.tensor == "layers.1.mlp.h", first
    assert next(r for r in rows if r.tensor == "layers.0.mlp.h").passed
