"""The conformance suite: it passes on correct backends, on the defaults'
model and on each family preset (SPEC 21), and it FAILS, naming the right
check and tensor, on backends broken on purpose, and with one row naming
the backend and the field where a backend refuses a model at capture."""

import math
import re
import sys
import types
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from coppelius import accelerated
from coppelius import reference
from coppelius.conformance import cases, run_hypothesis, run_suite, suite
from coppelius.conformance.tolerances import TOLERANCES, relative_error, tolerance
from coppelius.reference import checkpoint
from coppelius.reference.checkpoint import identities, write_checkpoint
from coppelius.reference.config import Hyper, check_implemented, config_from_identity
from coppelius.reference.errors import CheckpointError
from coppelius.reference.params import registry
from coppelius.reference.state import State
from coppelius.reference.stream import open_stream, write_stream

TEST = reference.preset("test")


# ------------------------------------------------------------------ the error measure

finite32 = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6), elements=finite32),
       st.data())
def test_relative_error_is_the_float64_norm_ratio(b, data):
    a = data.draw(hnp.arrays(np.float32, b.shape, elements=finite32))
    error, worst, got, want = relative_error(a, b)
    diffs = [float(x) - float(y) for x, y in zip(a.ravel(), b.ravel())]
    num = math.sqrt(math.fsum(d * d for d in diffs))
    den = math.sqrt(math.fsum(float(y) ** 2 for y in b.ravel()))
    if den == 0:
        assert error == (0.0 if num == 0 else math.inf)
    else:
        assert error == pytest.approx(num / den, rel=1e-12)
    assert abs(got - want) == max(abs(d) for d in diffs)
    assert (got, want) == (float(a[worst]), float(b[worst]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_never_passes(bad):
    b = np.ones((3, 4), np.float32)
    a = b.copy()
    a[1, 2] = bad
    row = suite.compare("logits", "x", a, b, tol=math.inf)  # even an infinite tolerance
    assert not row.passed and math.isnan(row.error) and row.worst == (1, 2)
    row = suite.compare("logits", "x", b, a, tol=math.inf)  # a broken reference fails too
    assert not row.passed


def test_bitwise_check_sees_a_signed_zero():
    a = np.array([1.0, 0.0, 2.0], np.float32)
    b = np.array([1.0, -0.0, 2.0], np.float32)
    row = suite.compare_bitwise("resume", "P", a, b)
    assert row.error == 0.0 and not row.passed and row.worst == (1,)
    assert suite.compare_bitwise("resume", "P", a, a.copy()).passed


def test_tolerance_table_covers_every_check_and_policy():
    for check in ("logits", "loss", "row_losses", "gradient", "P", "M", "V", "trajectory", "resume"):
        fp32, bf16 = tolerance(check, "fp32"), tolerance(check, "bf16")
        assert 0 <= fp32 <= bf16
    assert tolerance("P", "fp32") == TOLERANCES["update"]["fp32"]


# ------------------------------------------------------------------ correct backends pass

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_suite_passes_on_the_reference(precision):
    report = run_suite("reference", "test", precision)
    assert report.passed, report.table(report.failures)
    checks = {r.check for r in report.rows}
    assert checks == {"logits", "loss", "row_losses", "gradient", "P", "M", "V", "t",
                      "trajectory", "resume", "norm", "eval", "learner"}
    names = {s.name for s in registry(TEST)}
    for check in ("gradient", "P", "M", "V"):  # one row per parameter, by registry name
        assert {r.tensor for r in report.rows if r.check == check} == names
    # the reference program is the definition replayed: every error is exactly 0
    assert all(r.error == 0.0 for r in report.rows)
    assert report.row("trajectory", "mean loss, 20 steps")


def test_the_default_presets_are_a_member_of_each_family():
    """What the suite checks unless told (cases.PRESETS): the defaults' model
    and presets that set every family field of SPEC 21 that has parameters
    or a formula of its own, each at the test size."""
    configs = [reference.preset(name) for name in cases.PRESETS]
    assert configs[0] == TEST and all(c.d_model == TEST.d_model for c in configs)
    away = {field for c in configs for field in c.non_default()}
    assert away == {"norm", "n_kv_head", "tied", "rotary", "qkv_bias"}


@pytest.mark.parametrize("name, precision", [("test-llama", "fp32"), ("test-qwen", "bf16"),
                                             ("test-stablelm", "fp32")])
def test_suite_passes_on_the_reference_for_each_family(name, precision):
    report = run_suite("reference", name, precision, steps=4)
    assert report.passed, report.table(report.failures)
    names = {s.name for s in registry(reference.preset(name))}
    for check in ("gradient", "P", "M", "V"):  # one row per parameter of the member
        assert {r.tensor for r in report.rows if r.check == check} == names
    assert all(r.error == 0.0 for r in report.rows)


@pytest.mark.mlx
@pytest.mark.parametrize("name", cases.PRESETS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_suite_passes_on_mlx(precision, name):
    report = run_suite("mlx", name, precision, steps=20 if name == "test" else 6)
    assert report.passed, report.summary() + "\n" + report.table(report.failures)
    # an independent implementation is not bit-identical: the suite compared something
    assert any(r.error > 0 for r in report.rows if r.check == "gradient")


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlx", marks=pytest.mark.mlx),
                                     pytest.param("cupy", marks=pytest.mark.gpu)])
def test_accumulation_rows_pass_and_an_unscaled_micro_batch_fails_them(backend):
    """SPEC 19: k = 2 against the unaccumulated reference, and its exact
    resume; a backend scaling each micro-batch by 1/((B/k)*T) fails them."""
    if backend not in accelerated.available_backends():
        pytest.skip(f"the {backend} backend is not available here")
    report = run_suite(backend, "test", "fp32", batch=4, steps=3, accumulate=2)
    assert report.passed, report.table(report.failures)
    rows = [r for r in report.rows if "k=2" in r.tensor]
    assert {r.check for r in rows} == {"accumulate", "resume"}
    assert report.row("accumulate", "k=2 mean loss, 3 steps")
    ref = accelerated.backend_module("reference")

    def capture(config, hyper, precision, batch, state, accumulate=None):
        program = Wrapped(ref.capture(config, hyper, precision, batch, state, accumulate))
        if program.inner.accumulate > 1:  # each micro-batch's mean: twice the gradient
            program.gradients = lambda: program.inner.gradients() * np.float32(2)
        return program

    broken = types.SimpleNamespace(NAME="broken:unscaled", capture=capture, available=lambda: True)
    report = run_suite(broken, "test", "fp32", batch=4, steps=3, accumulate=2)
    assert {r.check for r in report.failures} == {"accumulate"}


def test_cli_accumulate_must_divide_the_batch(capsys):
    status, out, err = cli(["conformance", "--backend", "reference", "--batch", "4",
                            "--accumulate", "3"], capsys)
    assert status == 2 and "--accumulate=3" in err and "--batch=4" in err
    status, out, _ = cli(["conformance", "--backend", "reference", "--precision", "fp32",
                          "--batch", "2", "--accumulate", "2", "--steps", "2"], capsys)
    assert status == 0 and "k=2" in out
    # no --batch: the smallest batch K divides, K itself
    status, out, _ = cli(["conformance", "--backend", "reference", "--precision", "fp32",
                          "--accumulate", "2", "--steps", "2"], capsys)
    assert status == 0 and "B=2" in out and "k=2" in out


@pytest.mark.gpu
@pytest.mark.parametrize("name", cases.PRESETS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_suite_passes_on_cupy(precision, name):
    if "cupy" not in accelerated.available_backends():
        pytest.skip("the CuPy backend is not available here")
    report = run_suite("cupy", name, precision)
    assert report.passed, report.summary() + "\n" + report.table(report.failures)


# ------------------------------------------------------------------ broken backends fail

class Wrapped:
    """A reference program with one fault injected; everything else delegates."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def broken_backend(fault: str, tensor: str = "layers.1.mlp.up.weight"):
    """A backend (an object with capture/available) around the reference program."""
    ref = accelerated.backend_module("reference")

    def capture(config, hyper, precision, batch, state):
        if fault == "refuses_the_family":  # a backend of SPEC 1-5's model and two fields
            check_implemented(config, ("norm_eps", "rope_base"), "broken:refuses_the_family")
            return ref.capture(config, hyper, precision, batch, state)
        if fault == "no_weight_decay":
            return ref.capture(config, Hyper(lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                                             weight_decay=0, epsilon=hyper.epsilon),
                               precision, batch, state)
        if fault in ("ignores_clip", "ignores_schedule"):  # a learner half implemented
            keep = dict(lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                        weight_decay=hyper.weight_decay, epsilon=hyper.epsilon)
            if fault == "ignores_schedule":
                keep["clip"] = hyper.clip
            elif hyper.schedule != "constant":
                keep.update(schedule=hyper.schedule, warmup=hyper.warmup, total=hyper.total,
                            decay=hyper.decay, floor=hyper.floor)
            return ref.capture(config, Hyper(**keep), precision, batch, state)
        if fault == "wsd_as_cosine" and hyper.schedule == "wsd":  # the same W, N, f, no plateau
            hyper = replace(hyper, schedule="cosine", decay=None)
        if fault == "drops_moments_on_capture":  # a resume that restarts Adam's moments
            state = State(state.P, np.zeros_like(state.M), np.zeros_like(state.V), state.t)
        program = Wrapped(ref.capture(config, hyper, precision, batch, state))
        spec = registry(config).by_name[tensor]
        if fault == "perturbs_gradient":
            def gradients():
                G = program.inner.gradients()
                G[spec.slice] *= np.float32(1.1)
                return G
            program.gradients = gradients
        if fault == "nan_logit":
            def logits(tokens):
                out = program.inner.logits(tokens).copy()
                out[0, 1, 2] = np.nan
                return out
            program.logits = logits
        if fault == "breaks_swiglu_of_layer_1":  # a kernel wrong in one layer: all after it too
            def activations(tokens):
                from unittest import mock

                from coppelius.reference import model

                calls, original = [], model.swiglu_forward

                def swiglu(g, u):
                    calls.append(1)
                    a, cache = original(g, u)
                    return (a * np.float32(1.1) if len(calls) == 2 else a), cache

                with mock.patch.object(model, "swiglu_forward", swiglu):
                    return program.inner.activations(tokens)
            program.activations = activations
        return program

    return types.SimpleNamespace(NAME=f"broken:{fault}", capture=capture, available=lambda: True)


def failing(report, check=None):
    return {(r.check, r.tensor) for r in report.rows if not r.passed and (check is None or r.check == check)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_perturbed_gradient_fails_that_tensor_only(precision):
    report = run_suite(broken_backend("perturbs_gradient"), "test", precision, steps=4)
    assert failing(report) == {("gradient", "layers.1.mlp.up.weight"),
                               ("learner", "gradient layers.1.mlp.up.weight")}
    row = report.row("gradient", "layers.1.mlp.up.weight")
    assert row.error == pytest.approx(0.1, rel=1e-6)  # ||0.1 g|| / ||g||
    table = report.table()
    assert any("layers.1.mlp.up.weight" in line and "FAIL" in line for line in table.splitlines())
    assert "FAIL" in report.summary() and "layers.1.mlp.up.weight" in report.summary()


@pytest.mark.parametrize("name, tensor", [("test-qwen", "layers.0.attn.k.bias"),
                                          ("test-llama", "lm_head.weight"),
                                          ("test-stablelm", "layers.1.attn.v.weight")])
def test_a_perturbed_gradient_of_a_family_tensor_fails_that_tensor_only(name, tensor):
    report = run_suite(broken_backend("perturbs_gradient", tensor), name, "fp32", steps=3)
    assert failing(report) == {("gradient", tensor), ("learner", f"gradient {tensor}")}
    assert report.row("gradient", tensor).error == pytest.approx(0.1, rel=1e-6)


@pytest.mark.parametrize("name, field", [("test-llama", "norm='rmsnorm'"),
                                         ("test-stablelm", "n_kv_head=1")])
def test_a_refused_capture_is_one_failing_row_naming_backend_and_field(name, field):
    report = run_suite(broken_backend("refuses_the_family"), name, "fp32", steps=3)
    assert not report.passed and len(report.rows) == 1
    row = report.rows[0]
    assert row.check == "capture" and not row.passed
    refusal = f"broken:refuses_the_family: config field {field} (SPEC 21) is not implemented"
    assert row.tensor.startswith(f"refused: {refusal}") and report.refused.startswith(refusal)
    summary = report.summary()
    assert "\n" not in summary and summary.endswith("): FAIL")
    assert f"preset {name}" in summary and f"refused at capture ({refusal}" in summary
    assert refusal in report.table()
    assert run_suite(broken_backend("refuses_the_family"), "test", "fp32", steps=2).passed


def test_the_hypothesis_runner_shrinks_a_refusal_to_one_field():
    report = run_hypothesis(broken_backend("refuses_the_family"), examples=10)
    assert not report.passed and [r.check for r in report.rows] == ["capture"]
    assert "broken:refuses_the_family: config field" in report.refused
    minimal = report.notes[0]
    assert minimal.startswith("minimal failing case: ")
    # shrunk to the defaults but for the one field refused
    config = config_from_identity(minimal.split(": ", 1)[1].split(" B=")[0])
    assert len(config.non_default()) == 1 and config.non_default()[0] in report.refused


def test_skipped_weight_decay_fails_P_of_every_matrix_and_nothing_else_of_the_step():
    report = run_suite(broken_backend("no_weight_decay"), "test", "fp32", steps=4)
    matrices = {s.name for s in registry(TEST) if s.decay}
    vectors = {s.name for s in registry(TEST) if not s.decay}
    assert {t for c, t in failing(report, "P")} == matrices
    for check in ("logits", "loss", "row_losses", "gradient", "M", "V"):
        assert not failing(report, check), check
    assert all(report.row("P", name).passed for name in vectors)
    # P moved by lr * weight_decay * P: relative error ~3e-5, three times the tolerance
    row = report.row("P", "tok_embedding.weight")
    assert 2.5e-5 < row.error < 3.5e-5


def test_a_capture_that_loses_the_moments_fails_the_update_and_resume_checks():
    # the one-step checks start from a warm state (non-zero moments), so the
    # lost moments show in P, M and V after one update as well as in resume
    report = run_suite(broken_backend("drops_moments_on_capture"), "test", "fp32", steps=6)
    # (and the evaluation after that update, which runs on the updated P)
    assert {c for c, t in failing(report)} == {"resume", "P", "M", "V", "learner", "eval"}
    assert all(r.passed for r in report.rows if r.check in ("logits", "loss", "row_losses", "gradient", "trajectory"))
    assert {t.split(":")[0] for c, t in failing(report)} >= {"M", "V"}
    assert not report.row("resume", "update count t").error  # t itself was kept


@pytest.mark.parametrize("fault", ["ignores_clip", "ignores_schedule"])
def test_a_backend_without_clipping_or_schedule_fails_the_learner_rows_only(fault):
    report = run_suite(broken_backend(fault), "test", "fp32", steps=8)
    assert {c for c, t in failing(report)} == {"learner"}
    failed = {t for c, t in failing(report)}
    if fault == "ignores_clip":  # the moments see the unscaled gradient
        assert any(t.startswith("M ") for t in failed), failed
    else:  # the rates differ: P after one update, and the trajectory
        assert any(t.startswith("P ") for t in failed) and any("cosine" in t for t in failed)


@pytest.mark.parametrize("fault", ["ignores_schedule", "wsd_as_cosine"])
def test_a_backend_without_wsd_fails_the_wsd_learner_rows_only(fault):
    """--schedule wsd: the learner rows under wsd; a backend that runs the
    constant rate, or the cosine of the same warm-up, total and floor,
    fails the one step, taken halfway down wsd's decay: P, by the rate, and
    not the moments."""
    report = run_suite(broken_backend(fault), "test", "fp32", steps=8, schedule="wsd")
    assert {c for c, t in failing(report)} == {"learner"}
    failed = {t for c, t in failing(report)}
    assert any(t.startswith("P ") for t in failed), failed
    assert not any(t.startswith(("M ", "V ", "gradient ")) for t in failed), failed


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlx", marks=pytest.mark.mlx),
                                     "cupy"])
def test_wsd_learner_rows_pass_on_every_backend(backend, request):
    """The wsd schedule of SPEC 7 (version 3) on each backend, the CuPy one
    on its CPU stand-ins where no GPU is here: every phase of the schedule
    falls inside the 8-step trajectory."""
    if backend == "cupy":
        request.getfixturevalue("cuda_emulation")
    hyper = suite.production_learner(TEST, "fp32", cases.fresh_state(TEST),
                                     cases.random_windows(TEST, 1, 1)[0], 8, "wsd")
    W, N, D = hyper.warmup, hyper.total, hyper.decay
    assert hyper.schedule == "wsd" and 0 < W < N - D < N < 8  # warm-up, stable, decay, floor
    report = run_suite(backend, "test", "fp32", steps=8, schedule="wsd")
    assert report.passed, report.summary() + "\n" + report.table(report.failures)
    assert report.row("learner", f"mean loss, 8 steps, wsd W={W} N={N} D={D}, clip")
    if backend == "reference":
        assert all(r.error == 0.0 for r in report.rows)
    else:  # an implementation of its own: the suite compared something
        assert any(r.error > 0 for r in report.rows if r.check == "learner")


def test_cli_schedule_picks_the_learner_rows_schedule(capsys):
    from coppelius.conformance.command import main

    assert main(["--backend", "reference", "--preset", "test", "--precision", "fp32",
                 "--steps", "4", "--schedule", "wsd"]) == 0
    out = capsys.readouterr().out
    assert "wsd W=1 N=2 D=1, clip" in out and "cosine" not in out
    with pytest.raises(SystemExit) as e:
        main(["--backend", "reference", "--schedule", "linear"])
    assert e.value.code == 2 and "--schedule: invalid choice: 'linear'" in capsys.readouterr().err


def test_a_nan_logit_fails_logits_and_points_at_it():
    report = run_suite(broken_backend("nan_logit"), "test", "fp32", steps=2)
    assert failing(report) == {("logits", "logits"), ("learner", "logits logits")}
    row = report.row("logits", "logits")
    assert math.isnan(row.error) and row.worst == (0, 1, 2)


def test_update_diagnosis_tells_an_amplified_gradient_from_a_wrong_update():
    from coppelius.reference.adamw import adamw_update

    state = cases.fresh_state(TEST)
    G = reference.step(TEST, state.copy(), cases.random_windows(TEST, 1, 1)[0], grads=True).grads
    spec = registry(TEST).by_name["layers.0.attn.q.weight"]
    G_ref, G_backend = G.copy(), G.copy()
    G_ref[spec.offset + 5], G_backend[spec.offset + 5] = 1e-9, 3e-9  # both far below epsilon

    def update(G, hyper=Hyper()):
        return State(*adamw_update(state.P, state.M, state.V, G, registry(TEST).decay_mask(),
                                   hyper, 1), t=1)

    want = update(G_ref)
    # a gradient difference of 2e-9 (error ~1e-7 of that gradient) moves P by ~4e-5
    got = update(G_backend)
    bad = [r for r in suite.state_rows(TEST, got, want, "fp32") if not r.passed]
    assert [(r.check, r.tensor) for r in bad] == [("P", spec.name)]
    notes = suite.update_diagnosis(TEST, Hyper(), "fp32", state, G_backend, got, bad)
    assert len(notes) == 1 and "enters through the gradient" in notes[0]
    # the same gradient with weight decay skipped: the update itself is wrong
    got = update(G_backend, Hyper(weight_decay=0))
    bad = [r for r in suite.state_rows(TEST, got, want, "fp32") if not r.passed]
    notes = suite.update_diagnosis(TEST, Hyper(), "fp32", state, G_backend, got, bad)
    assert notes and all("the update is wrong" in n for n in notes)


def test_an_update_amplifying_a_passing_gradient_passes_and_a_wrong_update_fails():
    """SPEC 14's reading (docs/SPEC.md): with q/k/v bias and partial rotary, a
    key bias's elements past the rotated ones have exact gradient 0 (they add
    a constant to each row of scores); both sides' float32 gradients there
    are rounding noise, and AdamW's update turns any noise into +-lr. A
    backend whose gradient there is other noise passes its gradient row, and
    its P row passes because its update is the reference's of that gradient;
    the same gradient with a wrong learning rate fails."""
    import dataclasses

    from coppelius.reference.adamw import adamw_update

    config = dataclasses.replace(TEST, rotary=Fraction(1, 2), qkv_bias=True)
    state = cases.fresh_state(config)
    tokens = cases.random_windows(config, 1, 1)[0]
    spec = registry(config).by_name["layers.0.attn.k.bias"]
    E, R = config.head_dim, config.rotary_dim
    passthrough = np.array([i for i in range(spec.size) if i % E >= R]) + spec.offset
    G_ref = reference.step(config, state.copy(), tokens, grads=True).grads
    # rounding noise: about 1e-7 of the tensor's largest (rotated) element
    assert np.abs(G_ref[passthrough]).max() < 1e-6 * np.abs(G_ref[spec.slice]).max()
    G_backend = G_ref.copy()
    G_backend[passthrough] = np.float32(3e-11) * np.sign(np.arange(len(passthrough)) % 2 - 0.5)

    def program(hyper):
        inner = accelerated.backend_module("reference").capture(config, Hyper(), "fp32", 1,
                                                                state.copy())
        fake = Wrapped(inner)
        fake.gradients = lambda: G_backend.copy()
        fake.state = lambda: State(*adamw_update(state.P, state.M, state.V, G_backend,
                                                 registry(config).decay_mask(), hyper, 1), t=1)
        return fake

    notes = []
    rows = suite.step_rows(program(Hyper()), config, Hyper(), "fp32", state, tokens, notes)
    row = next(r for r in rows if (r.check, r.tensor) == ("P", spec.name))
    assert row.error > row.tolerance and row.passed  # the direct error, and why it passes
    assert all(r.passed for r in rows), [(r.check, r.tensor) for r in rows if not r.passed]
    assert any(n.startswith(f"P {spec.name}: error") and "passes" in n for n in notes)
    notes = []
    rows = suite.step_rows(program(Hyper(lr=Fraction(6, 10000))), config, Hyper(), "fp32",
                           state, tokens, notes)
    failed = {(r.check, r.tensor) for r in rows if not r.passed}
    assert ("P", spec.name) in failed and all(c == "P" for c, _ in failed)
    assert any("the update is wrong" in n for n in notes)


# ------------------------------------------------------------------ random cases

_, case_strategy = cases.strategies()


@given(case_strategy(precisions=("fp32", "bf16")))
def test_random_small_cases_pass_on_the_reference_program(case):
    config, batch, tokens, state, precision = case
    program = accelerated.backend_module("reference").capture(config, Hyper(), precision, batch,
                                                               state.copy())
    rows = suite.step_rows(program, config, Hyper(), precision, state, tokens)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    assert len(rows) == 3 + 4 * len(registry(config).specs) + 1 + 3  # + norm and 2 eval rows


def test_random_configs_draw_every_family_field():
    configs, _ = cases.strategies()
    # found, not shrunk; the same draws every run (a fixed seed), enough of them
    found = settings(database=None, phases=[Phase.generate], max_examples=2000, derandomize=True)
    for field, value in [("norm", "rmsnorm"), ("tied", False), ("qkv_bias", True),
                         ("norm_eps", Fraction(1, 10**6)), ("rope_base", Fraction(500000))]:
        find(configs(), lambda c: getattr(c, field) == value, settings=found)
    find(configs(), lambda c: c.kv_heads < c.n_head, settings=found)
    find(configs(), lambda c: c.rotary < 1, settings=found)


@given(case_strategy())
@settings(max_examples=10)
def test_random_states_are_valid_and_reproducible(case):
    config, batch, tokens, state, precision = case
    n = registry(config).total
    assert state.P.dtype == state.M.dtype == state.V.dtype == np.float32
    assert state.P.shape == state.M.shape == state.V.shape == (n,)
    assert (state.V >= 0).all() and np.isfinite(state.P).all() and state.t >= 0
    assert tokens.shape == (batch, config.context + 1)
    assert tokens.min() >= 0 and tokens.max() < config.vocab


@pytest.mark.mlx
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_random_small_cases_pass_on_mlx(precision):
    report = run_hypothesis("mlx", examples=3, precision=precision)
    assert report.passed, "\n".join(report.notes) + "\n" + report.table(report.failures)


def test_hypothesis_runner_shrinks_a_failure_to_a_named_tensor():
    report = run_hypothesis(broken_backend("perturbs_gradient", "final_norm.weight"), examples=5)
    assert not report.passed
    assert ("gradient", "final_norm.weight") in failing(report)
    assert report.notes and "minimal failing case" in report.notes[0]
    assert report.batch in (1, 2)  # the minimal case's B


# ------------------------------------------------------------------ inputs from a stream

def test_stream_windows_are_the_run_policy_contexts(tmp_path):
    T, B, S, c0 = TEST.context, 2, 3, 1
    ids = np.random.default_rng(5).integers(0, TEST.vocab, size=T * (c0 + B * S) + 1)
    write_stream(tmp_path / "s.tokens", ids, 0, 0)
    stream = open_stream(tmp_path / "s.tokens", TEST.vocab)
    windows = cases.stream_windows(stream, TEST, B, S, c0=c0)
    for s in range(S):
        for b in range(B):
            c = c0 + s * B + b  # SPEC 9
            np.testing.assert_array_equal(windows[s, b], ids[T * c: T * c + T + 1])


def test_random_windows_are_seeded():
    a = cases.random_windows(TEST, 2, 3)
    assert a.shape == (3, 2, TEST.context + 1) and a.max() < TEST.vocab
    np.testing.assert_array_equal(a, cases.random_windows(TEST, 2, 3))
    assert not np.array_equal(a, cases.random_windows(TEST, 2, 3, seed=cases.TOKEN_SEED + 1))


# ------------------------------------------------------------------ command line

def cli(argv, capsys):
    from coppelius.cli import main

    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(params=["perturbs_gradient"])
def broken_registered(monkeypatch, request):
    """Make a broken backend selectable by name, as `--backend broken`
    (the perturbed gradient unless the test asks for another fault)."""
    module = types.ModuleType("broken_backend_for_tests")
    backend = broken_backend(request.param)
    module.capture, module.available = backend.capture, backend.available
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(accelerated.BACKENDS, "broken", module.__name__)


def test_cli_passes_with_status_zero(capsys):
    status, out, _ = cli(["conformance", "--backend", "reference", "--precision", "fp32",
                          "--steps", "3"], capsys)
    assert status == 0
    assert "PASS" in out.splitlines()[-2] and "FAIL" not in out


def test_cli_fails_with_non_zero_status_and_names_the_tensor(capsys, broken_registered):
    status, out, _ = cli(["conformance", "--backend", "broken", "--precision", "fp32",
                          "--steps", "2", "--failures-only"], capsys)
    assert status == 1
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["gradient", "layers.1.mlp.up.weight"] and "FAIL" in lines[1]


def test_python_m_conformance_has_the_same_options(capsys, broken_registered):
    from coppelius.conformance.command import main

    assert main(["--backend", "broken", "--precision", "bf16", "--steps", "2"]) == 1
    assert main(["--backend", "reference", "--precision", "bf16", "--steps", "2",
                 "--hypothesis", "2"]) == 0
    assert main(["--backend", "nonesuch"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["conformance: error: backend 'nonesuch': unknown "
                                        "(choose from reference, mlx, cupy, broken)"]


def test_cli_refuses_bad_options_in_one_line(capsys):
    status, _, err = cli(["conformance", "--backend", "reference", "--steps", "1"], capsys)
    assert status == 2 and err.count("\n") == 1 and "--steps=1" in err
    status, _, err = cli(["conformance", "--backend", "reference", "--checkpoint", "x.ckpt"], capsys)
    assert status == 2 and "--stream" in err


def test_cli_takes_its_inputs_from_a_stream(tmp_path, capsys):
    ids = np.random.default_rng(2).integers(0, TEST.vocab, size=TEST.context * 5 + 1)
    write_stream(tmp_path / "s.tokens", ids, 0, 0)
    argv = ["conformance", "--backend", "reference", "--precision", "fp32", "--stream",
            str(tmp_path / "s.tokens"), "--context", "1"]
    status, out, _ = cli(argv + ["--steps", "4"], capsys)  # contexts 1..4 of 5
    assert status == 0 and f"stream {tmp_path / 's.tokens'}, contexts from 1" in out
    status, _, err = cli(argv + ["--steps", "5"], capsys)  # contexts 1..5: one too many
    assert status == 2 and "s.tokens" in err and err.count("\n") == 1


def write_run(tmp_path, batch=1, steps_done=3):
    """A real checkpoint after a few reference steps, and its stream."""
    T = TEST.context
    ids = np.random.default_rng(11).integers(0, TEST.vocab, size=T * 8 + 1)
    write_stream(tmp_path / "s.tokens", ids, 0, 0)
    stream = open_stream(tmp_path / "s.tokens", TEST.vocab)
    state = cases.fresh_state(TEST)
    for s in range(steps_done):
        state = reference.step(TEST, state, stream.batch(s * batch, batch, T)).state
    ident = identities(TEST, Hyper(), "fp32", batch, None, stream.sha256)
    write_checkpoint(tmp_path / "ck.bin", TEST, ident, state, contexts=steps_done * batch)
    return tmp_path / "ck.bin", tmp_path / "s.tokens"


def test_checkpoint_debugging_lists_every_tensor_worst_first(tmp_path, capsys, broken_registered):
    ck, stream = write_run(tmp_path)
    base = ["conformance", "--checkpoint", str(ck), "--stream", str(stream), "--context", "3"]
    status, out, _ = cli(base + ["--backend", "reference"], capsys)
    assert status == 0 and "checkpoint" in out and "step 3" in out
    status, out, _ = cli(base + ["--backend", "broken"], capsys)
    assert status == 1
    lines = out.splitlines()
    n = 3 + 4 * len(registry(TEST).specs) + 1 + 3  # + norm and 2 eval rows
    rows = lines[1:1 + n]
    assert rows[0].split()[:2] == ["gradient", "layers.1.mlp.up.weight"]  # the worst first
    errors = [float(re.search(r" (\S+) +\S+  (PASS|FAIL) ", line).group(1)) for line in rows]
    assert errors == sorted(errors, reverse=True)


def test_checkpoint_debugging_refuses_a_bad_file(tmp_path, capsys):
    _, stream = write_run(tmp_path)
    (tmp_path / "bad.bin").write_bytes(b"not a checkpoint at all" * 10)
    status, _, err = cli(["conformance", "--backend", "reference", "--checkpoint",
                          str(tmp_path / "bad.bin"), "--stream", str(stream)], capsys)
    assert status == 2 and "bad.bin" in err and err.count("\n") == 1
    ident = identities(TEST, Hyper(), "fp32", 1, None, "0" * 64)
    ident["model"] += "|rotary=1/2"  # the same tensors; a family field the reference refuses
    with pytest.MonkeyPatch.context() as m:  # a file of a model this version does not write
        m.setattr(checkpoint, "check_envelope", lambda *a: None)
        write_checkpoint(tmp_path / "other.bin", TEST, ident, cases.fresh_state(TEST), contexts=0)
    status, _, err = cli(["conformance", "--backend", "reference", "--checkpoint",
                          str(tmp_path / "other.bin"), "--stream", str(stream)], capsys)
    assert status == 2 and "other.bin" in err and "rotary=1/2" in err and err.count("\n") == 1


def test_checkpoint_debugging_checks_preset_against_the_checkpoint(tmp_path, capsys):
    ck, stream = write_run(tmp_path)
    base = ["conformance", "--backend", "reference", "--precision", "fp32", "--checkpoint",
            str(ck), "--stream", str(stream)]
    status, _, err = cli(base + ["--preset", "tiny"], capsys)
    assert status == 2 and err.count("\n") == 1, err
    for word in ("ck.bin", "tiny", TEST.identity(), reference.preset("tiny").identity()):
        assert word in err, word
    status, out, _ = cli(base + ["--preset", "test"], capsys)  # the checkpoint's model: fine
    assert status == 0 and "step 3" in out
    status, _, err = cli(base + ["--preset", "nonesuch"], capsys)
    assert status == 2 and "nonesuch" in err and err.count("\n") == 1


def test_checkpoint_debugging_hashes_the_file_once(tmp_path, monkeypatch):
    """Learning the model from the header and then binding the state is one
    SHA-256 pass over the checkpoint (692 MB for the coppelius preset), not two."""
    import hashlib

    from coppelius.conformance.command import load_checkpoint

    ck, _ = write_run(tmp_path)
    real, fed = hashlib.sha256, []

    class Counting:  # hashlib.sha256, recording how many bytes it is fed
        def __init__(self, data=b""):
            self._h = real()
            self.update(data)

        def update(self, data):
            fed.append(memoryview(data).nbytes)
            self._h.update(data)

        def digest(self):
            return self._h.digest()

        def hexdigest(self):
            return self._h.hexdigest()

    monkeypatch.setattr(hashlib, "sha256", Counting)
    config, hyper, precision, batch, state, header = load_checkpoint(str(ck))
    assert sum(fed) == ck.stat().st_size - 48  # everything before the trailer, once
    assert (config, hyper, precision, batch, state.t) == (TEST, Hyper(), "fp32", 1, 3)


def test_learner_identity_is_parsed_back_exactly():
    from coppelius.conformance.command import hyper_from_learner

    hyper = Hyper(lr="1/1000", weight_decay="0")
    assert hyper_from_learner(hyper.identity("bf16"), "ck") == (hyper, "bf16")
    with pytest.raises(CheckpointError, match="learner identity"):
        hyper_from_learner(hyper.identity("bf16").replace("decay=matrices", "decay=all"), "ck")
    with pytest.raises(CheckpointError, match="lr"):
        hyper_from_learner(hyper.identity("fp32").replace("lr=1/1000|", ""), "ck")


# ------------------------------------------------------------------ layer by layer

def test_activations_pass_on_the_reference(capsys):
    status, out, _ = cli(["conformance", "--activations", "--backend", "reference",
                          "--precision", "fp32"], capsys)
    assert status == 0
    assert "no divergence" in out and "51 checks, 51 passed" in out
    assert out.splitlines()[1].split()[:2] == ["forward", "embedding.out"]


@pytest.mark.parametrize("broken_registered", ["breaks_swiglu_of_layer_1"], indirect=True)
def test_activations_name_the_first_diverging_layer_and_tensor(capsys, broken_registered):
    status, out, _ = cli(["conformance", "--activations", "--backend", "broken", "--precision",
                          "fp32", "--failures-only"], capsys)
    assert status == 1
    assert "first divergence: layer 1, layers.1.mlp.h (forward): error" in out
    failed = [line.split()[1] for line in out.splitlines()
              if line.startswith(("forward", "backward")) and " FAIL " in line]
    assert failed[0] == "layers.1.mlp.h" and "layers.0.mlp.h" not in failed
    assert {"layers.1.out", "logits", "layers.0.dmid"} <= set(failed)  # all after it inherit it


@pytest.mark.parametrize("name", ["test-qwen", "test-stablelm"])
def test_activations_of_a_family_preset_pass_on_the_reference(capsys, name):
    from coppelius.reference.semantic import activation_names

    status, out, _ = cli(["conformance", "--activations", "--backend", "reference",
                          "--precision", "bf16", "--preset", name], capsys)
    n = len(activation_names(reference.preset(name)))
    assert status == 0 and "no divergence" in out and f"{n} checks, {n} passed" in out


def test_activations_from_a_checkpoint_and_a_stream(tmp_path, capsys):
    ck, stream = write_run(tmp_path)
    base = ["conformance", "--activations", "--backend", "reference", "--checkpoint", str(ck)]
    status, _, err = cli(base, capsys)
    assert status == 2 and "--stream" in err and err.count("\n") == 1
    status, out, _ = cli(base + ["--stream", str(stream), "--context", "2"], capsys)
    assert status == 0 and "step 3" in out and "context 2" in out and "fp32" in out


def test_cli_checks_every_default_preset(capsys):
    """Without --preset or --model: the defaults' model and a preset per
    family (cases.PRESETS), each its own report."""
    status, out, _ = cli(["conformance", "--backend", "reference", "--precision", "fp32",
                          "--steps", "2"], capsys)
    assert status == 0
    summaries = [line for line in out.splitlines() if line.startswith("conformance ")]
    assert [line.split(" preset ")[1].split(" ")[0] for line in summaries] == list(cases.PRESETS)
