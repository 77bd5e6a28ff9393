"""The training-program contract (SPEC sections 9, 13 and 14), once, for every
backend: a new backend is tested by adding its name to BACKENDS.

Each test captures a program through coppelius.accelerated.backend_module
and checks it against the reference's *functions* (reference.step,
reference.forward), never against another program: one step and a short
trajectory within the SPEC 14 tolerances, bitwise reproducible replays,
exact resume, capture without update, the replay/event interface and the
refusals. What only one backend has (MLX's single trace, CuPy's fused
attention, each backend's replaced-state detection) stays in that backend's
test file. The CuPy rows run on a GPU, and in CI on the CPU emulation of
the CUDA backend (dev/cuda/emulate.py --pytest)."""

import json
import math

import numpy as np
import pytest

from coppelius import accelerated, reference
from coppelius.conformance.cases import random_state
from coppelius.conformance.suite import step_rows
from coppelius.conformance.tolerances import tolerance
from coppelius.conformance.tolerances import relative_error as error_and_worst
from coppelius.reference.config import Config, Hyper, preset
from coppelius.reference.errors import CoppeliusError
from coppelius.reference.program import (STAGE_STATES, STAGES, ReplayError, ReplayEvent,
                                         TrainingProgram)
from coppelius.reference.state import State

BACKENDS = [
    pytest.param("reference"),
    pytest.param("mlx", marks=pytest.mark.mlx),
    pytest.param("cupy", marks=pytest.mark.gpu),
]
PRECISIONS = ["fp32", "bf16"]
CONFIG = preset("test")
B = 2


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The backend module under test (skipped by its marker where it is absent)."""
    return accelerated.backend_module(request.param)


def fresh(config=CONFIG) -> State:
    return State.fresh(reference.initialize(config))


def windows(n, seed=0, config=CONFIG, batch=B):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, config.vocab, (batch, config.context + 1)) for _ in range(n)]


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| (SPEC 14; NaN never passes a <= comparison)."""
    return error_and_worst(a, b)[0]


def bits(x):
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def check_same_state(a: State, b: State):
    for name in "PMV":
        assert np.array_equal(bits(getattr(a, name)), bits(getattr(b, name))), name
    assert a.t == b.t


def run(program, inputs):
    """Replay every input, waiting after each: (row losses (S,B,T), state)."""
    rows = []
    for tokens in inputs:
        program.upload_input(tokens)
        program.replay_and_wait()
        rows.append(program.row_losses())
    return np.stack(rows), program.state()


def failures(rows):
    return "\n".join(f"{r.check} {r.tensor}: {r.error:.3e} > {r.tolerance:.0e} at {r.worst}: "
                     f"{r.got} vs {r.want}" for r in rows if not r.passed)


# ------------------------------------------------------------------ the interface

def test_program_satisfies_the_protocol(backend):
    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    assert isinstance(program, TrainingProgram)
    assert (program.config, program.precision, program.batch) == (CONFIG, "fp32", B)
    assert program.backend in accelerated.BACKENDS
    assert accelerated.backend_module(program.backend) is backend
    program.upload_input(windows(1)[0])
    event = program.replay()
    assert isinstance(event, ReplayEvent)
    event.wait()
    assert program.state().t == 1


# ------------------------------------------------------------------ against the reference

@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_step_matches_the_reference(backend, precision):
    """Logits, loss, row losses, every gradient, P, M, V and t against
    reference.step, from a state in the middle of a run."""
    state = random_state(CONFIG, seed=3, t=41)
    program = backend.capture(CONFIG, Hyper(), precision, B, state.copy())
    rows = step_rows(program, CONFIG, Hyper(), precision, state, windows(1, seed=4)[0])
    assert not failures(rows), failures(rows)


def test_one_step_of_an_odd_shape_matches_the_reference(backend):
    """No dimension a multiple of 32 (or even, where it may be odd), B = 3."""
    config = Config(vocab=37, context=9, d_model=18, n_layer=2, n_head=3, d_ff=13)
    state = random_state(config, seed=16, t=7)
    for precision in PRECISIONS:
        program = backend.capture(config, Hyper(), precision, 3, state.copy())
        rows = step_rows(program, config, Hyper(), precision, state,
                         windows(1, seed=17, config=config, batch=3)[0])
        assert not failures(rows), (precision, failures(rows))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_trajectory_matches_the_reference(backend, precision):
    state = fresh()
    program = backend.capture(CONFIG, Hyper(), precision, B, state.copy())
    for tokens in windows(8, seed=5):
        program.upload_input(tokens)
        loss = program.replay_and_wait()
        want = reference.step(CONFIG, state, tokens, precision)
        state = want.state
        assert relative_error(np.float32(loss), np.float32(want.loss)) <= tolerance(
            "trajectory", precision)
        assert relative_error(program.row_losses(), want.row_losses) <= tolerance(
            "trajectory", precision)
    got = program.state()
    assert got.t == 8
    assert relative_error(got.P, state.P) <= 10 * tolerance("update", precision)


def test_logits_of_a_prefix_and_of_another_batch_use_the_current_parameters(backend):
    state = random_state(CONFIG, seed=8, t=3)
    program = backend.capture(CONFIG, Hyper(), "fp32", B, state.copy())
    for shape in [(1, CONFIG.context), (3, 5), (B, CONFIG.context)]:
        tokens = np.random.default_rng(9).integers(0, CONFIG.vocab, shape)
        got = program.logits(tokens)
        assert got.shape == (*shape, CONFIG.vocab) and got.dtype == np.float32
        assert relative_error(got, reference.forward(CONFIG, state.P, tokens, "fp32")) <= 1e-5
    program.upload_input(windows(1)[0])
    program.replay_and_wait()
    tokens = windows(1)[0][:, :-1]
    want = reference.forward(CONFIG, program.state().P, tokens, "fp32")
    assert not np.array_equal(want, reference.forward(CONFIG, state.P, tokens, "fp32"))
    assert relative_error(program.logits(tokens), want) <= 1e-5


# ------------------------------------------------------------------ capture and replay

@pytest.mark.parametrize("precision", PRECISIONS)
def test_capture_performs_no_update_and_replays_are_bit_reproducible(backend, precision):
    state = random_state(CONFIG, seed=11, t=5)
    one = backend.capture(CONFIG, Hyper(), precision, B, state.copy())
    check_same_state(one.state(), state)  # whatever warm-up capture ran was undone
    two = backend.capture(CONFIG, Hyper(), precision, B, state.copy())
    inputs = windows(3, seed=12)
    rows1, s1 = run(one, inputs)
    rows2, s2 = run(two, inputs)
    assert np.array_equal(bits(rows1), bits(rows2))
    check_same_state(s1, s2)
    assert s1.t == 8
    assert np.array_equal(bits(one.gradients()), bits(two.gradients()))


def test_program_owns_its_buffers(backend):
    state = fresh()
    program = backend.capture(CONFIG, Hyper(), "fp32", B, state)
    P0 = state.P.copy()
    state.P[:] = 0.0  # the caller's arrays are not the program's
    program.state().P[:] = 1.0  # nor is the host copy it hands out
    assert np.array_equal(program.state().P, P0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_exact_resume(backend, precision):
    """S1 steps, state(), a new capture from it, S2 steps: the same bits as
    S1 + S2 steps of one program (SPEC section 9)."""
    inputs = windows(5, seed=13)
    rows, whole = run(backend.capture(CONFIG, Hyper(), precision, B, fresh()), inputs)
    rows1, middle = run(backend.capture(CONFIG, Hyper(), precision, B, fresh()), inputs[:2])
    rows2, resumed = run(backend.capture(CONFIG, Hyper(), precision, B, middle), inputs[2:])
    assert np.array_equal(bits(np.concatenate([rows1, rows2])), bits(rows))
    check_same_state(resumed, whole)


def test_queued_replays_equal_waited_ones_and_timed_replay(backend):
    """replay() submits without waiting; replays queued back to back give the
    bits of replays waited for one by one."""
    inputs = windows(4, seed=10)
    queued = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    for tokens in inputs:
        queued.upload_input(tokens)  # waits for the pending replay's use of the input
        event = queued.replay()
    event.wait()
    rows, waited = run(backend.capture(CONFIG, Hyper(), "fp32", B, fresh()), inputs)
    check_same_state(queued.state(), waited)
    assert np.array_equal(bits(queued.row_losses()), bits(rows[-1]))
    queued.upload_input(inputs[0])
    loss, seconds = queued.replay_timed_and_wait()
    assert math.isfinite(loss) and (math.isnan(seconds) or 0 < seconds < 10)
    assert queued.state().t == 5


def test_no_capture_switch_runs_the_same_step_eagerly(backend, monkeypatch):
    state = random_state(CONFIG, seed=14, t=2)
    inputs = windows(2, seed=15)
    rows, captured = run(backend.capture(CONFIG, Hyper(), "bf16", B, state.copy()), inputs)
    monkeypatch.setenv("COPPELIUS_NO_CAPTURE", "1")
    program = backend.capture(CONFIG, Hyper(), "bf16", B, state.copy())
    rows_eager, eager = run(program, inputs)
    assert np.array_equal(bits(rows_eager), bits(rows))
    check_same_state(eager, captured)


# ------------------------------------------------------------------ refusals

def test_reads_before_a_replay_and_a_replay_before_an_upload_are_refused(backend):
    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    with pytest.raises(ReplayError, match="upload"):
        program.replay()
    for read in (program.row_losses, program.gradients):
        with pytest.raises(ReplayError, match="no step"):
            read()


T, V = CONFIG.context, CONFIG.vocab


@pytest.mark.parametrize("bad, match", [
    (np.zeros((B, T), np.int64), "shape"),  # (B, T): the target column is missing
    (np.zeros((B + 1, T + 1), np.int64), "shape"),  # another batch
    (np.zeros((T + 1,), np.int64), "shape"),  # no batch axis
    (np.zeros((B, T + 1), np.float32), "dtype"),  # not ids
    (np.full((B, T + 1), V, np.int64), "outside"),  # outside [0, V)
    (np.full((B, T + 1), -1, np.int64), "outside"),
], ids=["BxT", "other-batch", "1-d", "float", "id-V", "id-negative"])
def test_a_wrong_upload_is_refused_and_changes_nothing(backend, bad, match):
    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    good = windows(1)[0]
    program.upload_input(good)
    with pytest.raises(ReplayError, match=match) as info:
        program.upload_input(bad)
    assert isinstance(info.value, CoppeliusError) and info.value.exit_status == 2
    assert "\n" not in str(info.value)
    program.replay_and_wait()  # the earlier input still replays
    want = reference.step(CONFIG, fresh(), good)
    assert relative_error(program.row_losses(), want.row_losses) <= 1e-5


@pytest.mark.parametrize("tokens", [np.zeros((1, T + 1), np.int64), np.full((1, 2), V),
                                    np.full((1, 2), -1)], ids=["too-long", "id-V", "id-negative"])
def test_logits_of_a_wrong_input_are_refused(backend, tokens):
    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    with pytest.raises(CoppeliusError):
        program.logits(tokens)


def test_capture_refuses_what_it_cannot_replay(backend):
    P = reference.initialize(CONFIG)
    bad_t = fresh()
    bad_t.t = -1
    short = fresh()
    short.M = short.M[:-1]
    for state, match in [(State.fresh(P[:-1]), "state.P"), (State.fresh(P.astype(np.float64)),
                                                            "state.P"),
                         (short, "state.M"), (bad_t, "t=-1")]:
        with pytest.raises(ReplayError, match=match):
            backend.capture(CONFIG, Hyper(), "fp32", B, state)
    with pytest.raises(CoppeliusError, match="fp16"):
        backend.capture(CONFIG, Hyper(), "fp16", B, fresh())
    for batch in (0, -1, 1.5, True):
        with pytest.raises(CoppeliusError, match="batch"):
            backend.capture(CONFIG, Hyper(), "fp32", batch, fresh())


# ------------------------------------------------------------------ the report

@pytest.mark.parametrize("precision", PRECISIONS)
def test_compilation_report(backend, precision):
    program = backend.capture(CONFIG, Hyper(), precision, B, fresh())
    for tokens in windows(2, seed=12):
        program.upload_input(tokens)
        program.replay_and_wait()
    report = program.compilation_report()
    assert report["schema"] == "coppelius.training_compilation.v1"
    assert report["backend"] == program.backend and report["replays"] == 2
    assert [row["stage"] for row in report["stages"]] == list(STAGES)
    for row in report["stages"]:
        assert row["state"] in STAGE_STATES, row
        assert isinstance(row["inputs"], int) and isinstance(row["outputs"], int), row
    for key in ("kernels", "graph_nodes", "device_bytes"):
        assert isinstance(report[key], int) and report[key] >= 0, key
    assert report["device_bytes"] >= 12 * reference.registry(CONFIG).total  # P, M, V at least
    diagnostics = program.diagnostics()
    assert diagnostics["runtime"]["update_count"] == 2
    json.dumps(report)
    json.dumps(diagnostics)
