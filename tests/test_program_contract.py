"""The training-program contract (SPEC sections 9, 13 and 14), once, for every
backend: a new backend is tested by adding its name to BACKENDS.

Each test captures a program through coppelius.accelerated.backend_module
and checks it against the reference's *functions* (reference.step,
reference.forward), never against another program: one step and a short
trajectory within the SPEC 14 tolerances, bitwise reproducible replays,
exact resume, capture without update, the replay/event interface and the
refusals, on the `test` preset and (where the model matters) on each family
preset of SPEC 21 (the `config` fixture). What only one backend has (MLX's
single trace, CuPy's fused attention, each backend's replaced-state
detection) stays in that backend's test file. The CuPy rows run on a GPU, and elsewhere on the CPU stand-ins
of the CUDA backend, in this process (dev/cuda/emulated: the
cuda_emulation fixture of conftest.py)."""

import json
import math

import numpy as np
import pytest

from coppelius import accelerated, reference
from coppelius.conformance.cases import random_state
from coppelius.conformance.suite import step_rows
from coppelius.conformance.tolerances import tolerance
from coppelius.conformance.tolerances import relative_error as error_and_worst
from coppelius.reference.compilation import STAGE_STATES, STAGES, StageRecord
from coppelius.reference.config import Config, Hyper, preset
from coppelius.reference.contract import (MissingCapability, ProgramReset, ReplayError,
                                          ReplayEvent, TrainingProgram)
from coppelius.reference.errors import CoppeliusError
from coppelius.reference.semantic import activation_names, partitions, semantic_graph
from coppelius.reference.state import State
from coppelius.reference.step import step_activations

BACKENDS = [
    pytest.param("reference"),
    pytest.param("mlx", marks=pytest.mark.mlx),
    pytest.param("cupy", marks=[pytest.mark.gpu, pytest.mark.emulated]),
]
PRECISIONS = ["fp32", "bf16"]
CONFIG = preset("test")
B = 2
# the family presets (SPEC 21): every backend computes every member, so the
# contract's checks against the reference run on each of them as on `test`
FAMILY = ["test-llama", "test-qwen", "test-stablelm"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The backend module under test (skipped by its marker where it is
    absent; cupy: on the CPU stand-ins where no GPU is here)."""
    if request.param == "cupy":
        request.getfixturevalue("cuda_emulation")
    return accelerated.backend_module(request.param)


@pytest.fixture(params=["test"] + FAMILY)
def config(request):
    """The model under test: the defaults' `test` preset, then each family preset."""
    return preset(request.param)


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

def test_program_satisfies_the_protocol(backend, config):
    program = backend.capture(config, Hyper(), "fp32", B, fresh(config))
    assert isinstance(program, TrainingProgram)
    assert (program.config, program.precision, program.batch) == (config, "fp32", B)
    assert program.backend in accelerated.BACKENDS
    assert accelerated.backend_module(program.backend) is backend
    program.upload_input(windows(1, config=config)[0])
    event = program.replay()
    assert isinstance(event, ReplayEvent)
    event.wait()
    assert program.state().t == 1


# ------------------------------------------------------------------ against the reference

@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_step_matches_the_reference(backend, config, precision):
    """Logits, loss, row losses, every gradient, P, M, V and t against
    reference.step, from a state in the middle of a run (norm weights and
    biases away from their initial ones and zeros)."""
    state = random_state(config, seed=3, t=41)
    program = backend.capture(config, Hyper(), precision, B, state.copy())
    rows = step_rows(program, config, Hyper(), precision, state,
                     windows(1, seed=4, config=config)[0])
    assert not failures(rows), failures(rows)


ODD = dict(vocab=37, context=9, d_model=18, n_layer=2, n_head=3, d_ff=13)


@pytest.mark.parametrize("fields", [{}, dict(norm="rmsnorm", n_kv_head=1, tied=False,
                                             rotary="1/3", qkv_bias=True, rope_base=500000)],
                         ids=["defaults", "family"])
def test_one_step_of_an_odd_shape_matches_the_reference(backend, fields):
    """No dimension a multiple of 32 (or even, where it may be odd), B = 3;
    and a member with every family field away from its default (E = 6,
    R = 2 of it rotated, 3 query heads on one key/value head)."""
    config = Config(**ODD, **fields)
    state = random_state(config, seed=16, t=7)
    for precision in PRECISIONS:
        program = backend.capture(config, Hyper(), precision, 3, state.copy())
        rows = step_rows(program, config, Hyper(), precision, state,
                         windows(1, seed=17, config=config, batch=3)[0])
        assert not failures(rows), (precision, failures(rows))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_trajectory_matches_the_reference(backend, config, precision):
    state = fresh(config)
    program = backend.capture(config, Hyper(), precision, B, state.copy())
    for tokens in windows(8, seed=5, config=config):
        program.upload_input(tokens)
        loss = program.replay_and_wait()
        want = reference.step(config, state, tokens, precision)
        state = want.state
        assert relative_error(np.float32(loss), np.float32(want.loss)) <= tolerance(
            "trajectory", precision)
        assert relative_error(program.row_losses(), want.row_losses) <= tolerance(
            "trajectory", precision)
    got = program.state()
    assert got.t == 8
    assert relative_error(got.P, state.P) <= 10 * tolerance("update", precision)


def test_logits_of_a_prefix_and_of_another_batch_use_the_current_parameters(backend, config):
    state = random_state(config, seed=8, t=3)
    program = backend.capture(config, Hyper(), "fp32", B, state.copy())
    for shape in [(1, config.context), (3, 5), (B, config.context)]:
        tokens = np.random.default_rng(9).integers(0, config.vocab, shape)
        got = program.logits(tokens)
        assert got.shape == (*shape, config.vocab) and got.dtype == np.float32
        assert relative_error(got, reference.forward(config, state.P, tokens, "fp32")) <= 1e-5
    program.upload_input(windows(1, config=config)[0])
    program.replay_and_wait()
    tokens = windows(1, config=config)[0][:, :-1]
    want = reference.forward(config, program.state().P, tokens, "fp32")
    assert not np.array_equal(want, reference.forward(config, state.P, tokens, "fp32"))
    assert relative_error(program.logits(tokens), want) <= 1e-5


# ------------------------------------------------------------------ capture and replay

@pytest.mark.parametrize("precision", PRECISIONS)
def test_capture_performs_no_update_and_replays_are_bit_reproducible(backend, config, precision):
    state = random_state(config, seed=11, t=5)
    one = backend.capture(config, Hyper(), precision, B, state.copy())
    check_same_state(one.state(), state)  # whatever warm-up capture ran was undone
    two = backend.capture(config, Hyper(), precision, B, state.copy())
    inputs = windows(3, seed=12, config=config)
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
def test_exact_resume(backend, config, precision):
    """S1 steps, state(), a new capture from it, S2 steps: the same bits as
    S1 + S2 steps of one program (SPEC section 9)."""
    inputs = windows(5, seed=13, config=config)
    rows, whole = run(backend.capture(config, Hyper(), precision, B, fresh(config)), inputs)
    rows1, middle = run(backend.capture(config, Hyper(), precision, B, fresh(config)), inputs[:2])
    rows2, resumed = run(backend.capture(config, Hyper(), precision, B, middle), inputs[2:])
    assert np.array_equal(bits(np.concatenate([rows1, rows2])), bits(rows))
    check_same_state(resumed, whole)


# ------------------------------------------------------------------ accumulation (SPEC 19)

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_step_matches_the_unaccumulated_reference(backend, precision, k):
    """k micro-batches of B/k, one update: logits, loss, row losses, every
    gradient, the norm, P, M, V and t within SPEC 14's tolerances of the
    unaccumulated reference step (float32 sums in another order)."""
    state = random_state(CONFIG, seed=3, t=41)
    program = backend.capture(CONFIG, Hyper(), precision, 4, state.copy(), accumulate=k)
    assert program.accumulate == k and program.batch == 4
    assert program.capture_refused is None  # the k passes inside the one captured step
    rows = step_rows(program, CONFIG, Hyper(), precision, state, windows(1, seed=4, batch=4)[0])
    assert not failures(rows), failures(rows)


@pytest.mark.parametrize("name", FAMILY)
def test_an_accumulated_step_of_a_family_preset_matches_the_reference(backend, name):
    config = preset(name)
    state = random_state(config, seed=3, t=41)
    for precision in PRECISIONS:
        program = backend.capture(config, Hyper(), precision, 4, state.copy(), accumulate=2)
        rows = step_rows(program, config, Hyper(), precision, state,
                         windows(1, seed=4, config=config, batch=4)[0])
        assert not failures(rows), (precision, failures(rows))


def test_accumulated_steps_are_bit_reproducible_and_clip_the_sum(backend):
    state = random_state(CONFIG, seed=11, t=5)
    inputs = windows(3, seed=12, batch=4)
    norm = reference.step(CONFIG, state.copy(), inputs[0], "fp32").grad_norm
    hyper = Hyper(clip=float(norm) / 2)  # the first step clips the accumulated G
    one = backend.capture(CONFIG, hyper, "fp32", 4, state.copy(), accumulate=2)
    check_same_state(one.state(), state)
    two = backend.capture(CONFIG, hyper, "fp32", 4, state.copy(), accumulate=2)
    rows1, s1 = run(one, inputs)
    rows2, s2 = run(two, inputs)
    assert np.array_equal(bits(rows1), bits(rows2))
    check_same_state(s1, s2)
    assert np.array_equal(bits(one.gradients()), bits(two.gradients()))
    want = reference.step(CONFIG, state.copy(), inputs[0], "fp32", hyper, accumulate=2)
    got = backend.capture(CONFIG, hyper, "fp32", 4, state.copy(), accumulate=2)
    got.upload_input(inputs[0])
    got.replay_and_wait()
    assert relative_error(got.state().P, want.state.P) <= tolerance("update", "fp32")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_exact_resume_with_accumulation(backend, precision):
    inputs = windows(5, seed=13, batch=4)

    def capture(state):
        return backend.capture(CONFIG, Hyper(), precision, 4, state, accumulate=2)

    rows, whole = run(capture(fresh()), inputs)
    rows1, middle = run(capture(fresh()), inputs[:2])
    rows2, resumed = run(capture(middle), inputs[2:])
    assert np.array_equal(bits(np.concatenate([rows1, rows2])), bits(rows))
    check_same_state(resumed, whole)


@pytest.mark.parametrize("k", [0, 3, -1])
def test_an_accumulation_that_does_not_divide_the_batch_is_refused(backend, k):
    with pytest.raises(CoppeliusError, match=f"accumulate={k}"):
        backend.capture(CONFIG, Hyper(), "fp32", 4, fresh(), accumulate=k)


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


@pytest.mark.parametrize("k", [1, 2])
def test_submitted_steps_keep_their_records_while_later_ones_run(backend, k):
    """submit() queues step s+1 before step s is read: each step's records
    are its own (the bits of a step waited for and read at once), whichever
    order they are read in, and the state is that of the waited steps."""
    inputs = windows(5, seed=12, batch=2 * B)
    hyper = Hyper(clip=0.5, accumulate=k)
    waited = backend.capture(CONFIG, hyper, "fp32", 2 * B, fresh())
    want = []
    for tokens in inputs:
        waited.upload_input(tokens)
        loss = waited.replay_and_wait()
        want.append((loss, waited.row_losses(), waited.grad_norm()))
    program = backend.capture(CONFIG, hyper, "fp32", 2 * B, fresh())
    pending = [program.submit(inputs[0]), program.submit(inputs[1])]
    first = pending[0].records()  # read while step 1 may still run
    pending += [program.submit(tokens) for tokens in inputs[2:]]  # three in flight
    records = [first] + [p.records() for p in reversed(pending[1:])][::-1]
    for s, (r, (loss, rows, norm)) in enumerate(zip(records, want)):
        assert r.row_losses.shape == (2 * B, CONFIG.context)
        assert np.array_equal(bits(r.row_losses), bits(rows)), s
        assert bits(r.loss) == bits(loss) and bits(r.grad_norm) == bits(norm), s
        assert math.isnan(r.device_seconds) or 0 < r.device_seconds < 10
    assert pending[0].records() is first  # read once, kept
    check_same_state(program.state(), waited.state())
    assert program.replay_count() == 5


def test_no_capture_switch_runs_the_same_step_eagerly(backend, config, monkeypatch):
    state = random_state(config, seed=14, t=2)
    inputs = windows(2, seed=15, config=config)
    rows, captured = run(backend.capture(config, Hyper(), "bf16", B, state.copy()), inputs)
    monkeypatch.setenv("COPPELIUS_NO_CAPTURE", "1")
    program = backend.capture(config, Hyper(), "bf16", B, state.copy())
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


# ------------------------------------------------------------------ the whole surface (seed)

def host_scalar(buffer) -> float:
    """The value of a backend's one-element loss buffer (a CuPy array has
    .get(); NumPy and MLX arrays convert directly)."""
    value = buffer.get() if hasattr(buffer, "get") else np.asarray(buffer)
    return float(np.asarray(value).reshape(-1)[0])


def test_loss_buffer_replay_count_completion_and_wait(backend):
    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    assert program.replay_count() == 0 and program.is_complete()  # nothing submitted yet
    with pytest.raises(ReplayError, match="no step"):
        program.loss()
    inputs = windows(3, seed=20)
    program.upload_input(inputs[0])
    loss = program.replay_and_wait()
    assert host_scalar(program.loss()) == loss  # the very value replay_and_wait read
    program.upload_input(inputs[1])
    program.replay()
    program.upload_input(inputs[2])  # waits for the pending replay's use of the input
    event = program.replay()
    assert program.replay_count() == 3
    try:
        program.is_complete()  # either answer is right while the step may still run
    except MissingCapability as e:
        assert program.backend in str(e)
    program.wait()
    assert program.is_complete()
    event.wait()
    want = reference.step(CONFIG, reference.step(CONFIG, reference.step(
        CONFIG, fresh(), inputs[0]).state, inputs[1]).state, inputs[2])
    assert relative_error(np.float32(host_scalar(program.loss())), want.loss) <= 1e-5
    assert program.state().t == 3


def call_every_method(program, tokens):
    """Each protocol method once, with arguments it accepts."""
    args = {"upload_input": (tokens,), "logits": (tokens[:, :-1],), "evaluate": (tokens,),
            "activations": (tokens,), "semantic_debug_report_json": ("x",),
            "debug_report_json": ("x",), "compilation_debug_report_json": ("x",)}
    from coppelius.reference.contract import _protocol_methods

    for name in _protocol_methods():
        yield name, (lambda name=name: getattr(program, name)(*args.get(name, ())))


def test_reset_releases_everything_and_refuses_every_later_use(backend):
    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    tokens = windows(1, seed=21)[0]
    program.upload_input(tokens)
    program.replay()  # pending: reset waits for it
    program.reset()
    names = []
    for name, call in call_every_method(program, tokens):
        with pytest.raises(ProgramReset) as info:
            call()
        assert name in str(info.value) and info.value.exit_status == 2
        assert "\n" not in str(info.value)
        names.append(name)
    assert {"reset", "replay", "wait", "loss", "state", "compilation_report"} <= set(names)
    # a new capture from the same starting state is unaffected
    again = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    again.upload_input(tokens)
    assert relative_error(np.float32(again.replay_and_wait()),
                          reference.step(CONFIG, fresh(), tokens).loss) <= 1e-5


def test_replay_timed_has_a_device_clock_or_refuses_before_submitting(backend):
    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    program.upload_input(windows(1, seed=22)[0])
    try:
        event = program.replay_timed()
    except MissingCapability as e:
        assert "clock" in str(e) and program.backend in str(e)
        assert program.replay_count() == 0 and program.state().t == 0  # nothing was submitted
        return
    seconds = event.device_seconds()  # waits for the step
    assert 0 < seconds < 10 and program.replay_count() == 1 and program.state().t == 1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_semantic_graph_is_the_backend_independent_step(backend, config, precision):
    program = backend.capture(config, Hyper(), precision, B, fresh(config))
    text = program.semantic_debug_report_json("step")
    assert text == semantic_graph(config, B, precision).debug_report_json("step")
    assert text == program.semantic_debug_report_json("step")  # deterministic
    doc = json.loads(text)
    assert doc["schema"] == "coppelius.semantic_graph.v1" and doc["batch"] == B
    L = config.n_layer
    # untied, the embedding's gradient is the gather's alone: no sum with the head's
    assert doc["operation_count"] == len(doc["operations"]) == 13 + 32 * L - (not config.tied)
    shapes = {t["tensor"]: t["shape"] for t in doc["tensors"]}
    assert shapes["layers.1.attn.q"] == [B, config.context, config.d_model]
    assert shapes["layers.1.attn.k"] == [B, config.context, config.kv_dim]
    assert shapes["logits"] == [B, config.context, config.vocab]
    # every input is produced before it is read, or is an input, parameter or state
    made = {t["tensor"] for t in doc["tensors"] if t["role"] in ("input", "parameter", "state")}
    made.add("G")  # the gradient vector; its parameter views are written by the backward
    for op in doc["operations"]:
        missing = [name for name in op["inputs"] if name not in made]
        assert not missing, (op["name"], missing)
        made.update(op["outputs"])
    assert {name for name, _ in activation_names(config)} <= made


@pytest.mark.parametrize("precision", PRECISIONS)
def test_compilation_debug_report(backend, config, precision):
    program = backend.capture(config, Hyper(), precision, B, fresh(config))
    program.upload_input(windows(1, seed=23, config=config)[0])
    program.replay_and_wait()
    text = program.compilation_debug_report_json("step")
    assert text == program.compilation_debug_report_json("step")  # deterministic
    doc = json.loads(text)
    assert doc["schema"] == "coppelius.training_compilation.v2" and doc["name"] == "step"
    assert doc["backend"] == program.backend and doc["replays"] == 1
    report = program.compilation_report()
    assert doc["stages"] == report["stages"]
    assert program.compilation_stages() == tuple(
        StageRecord(r["stage"], r["state"], r["inputs"], r["outputs"]) for r in report["stages"])
    assert [r.stage for r in program.compilation_stages()] == list(STAGES)
    assert doc["capture"] == {"state": "captured", "reason": ""}

    plan = doc["dnn_plan"]
    assert plan["graph_hash"] == semantic_graph(config, B, precision).graph_hash()
    assert plan["partition_count"] == len(plan["partitions"]) == len(partitions(config))
    if not config.qkv_bias:  # q, k, v of one input, each layer's; biased, they are linear_bias
        assert plan["partition_count"] == 5 * config.n_layer + 1
    assert plan["applied_partition_count"] + plan["inherited_partition_count"] + \
        plan["fallback_partition_count"] == plan["partition_count"]
    for row in plan["partitions"]:
        assert row["state"] in ("applied", "inherited", "fallback") and row["reason"], row

    lowering = doc["lowering_analysis"]
    ops = lowering["operations"]
    assert len(ops) == lowering["operation_count"] == plan["source_operation_count"]
    if lowering["attributed"]:  # every operation runs on at least one executable node
        assert all(o["executable_node_count"] >= 1 for o in ops), \
            [o["name"] for o in ops if not o["executable_node_count"]]
        assert plan["captured_operation_count"] == len(ops)
        assert lowering["direct_operation_count"] + lowering["fused_operation_count"] + \
            lowering["decomposed_operation_count"] >= len(ops)
    else:
        assert lowering["reason"]

    memory = doc["memory_analysis"]
    assert memory["resource_count"] == len(memory["resources"]) > 0
    saved = memory["unplanned_bytes"] - memory["planned_bytes"]
    assert memory["materialized_savings_bytes"] == (saved if memory["materialized"] else 0)
    assert memory["materialized"] or memory["fallback_reason"]

    plan_doc = json.loads(program.debug_report_json("step"))
    assert plan_doc["schema"] == "coppelius.executable_plan.v1"
    assert plan_doc["node_count"] == len(plan_doc["nodes"]) > 0


def test_a_refused_capture_runs_the_same_step_uncaptured(backend, monkeypatch, capfd):
    """The backend's capture (its _record) refuses with its library's kind
    of error: the step runs uncaptured with the same bits, the report says
    why, and one line goes to stderr."""
    state = random_state(CONFIG, seed=24, t=4)
    inputs = windows(2, seed=25)
    captured = backend.capture(CONFIG, Hyper(), "bf16", B, state.copy())
    rows, want = run(captured, inputs)

    def refuse(self):
        raise RuntimeError("injected capture failure\nsecond line")

    monkeypatch.setattr(type(captured), "_record", refuse)
    capfd.readouterr()
    program = backend.capture(CONFIG, Hyper(), "bf16", B, state.copy())
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "capture refused (RuntimeError: injected capture failure)" \
        in err, err
    rows_fallback, got = run(program, inputs)
    assert np.array_equal(bits(rows_fallback), bits(rows))
    check_same_state(got, want)
    stages = {r.stage: r.state for r in program.compilation_stages()}
    assert stages["command_recording"] == "failed"
    doc = json.loads(program.compilation_debug_report_json("fallback"))
    assert doc["capture"] == {"state": "refused",
                              "reason": "RuntimeError: injected capture failure"}
    assert doc["captured"] is False


@pytest.mark.parametrize("precision", PRECISIONS)
def test_activations_match_the_reference_under_one_naming_scheme(backend, config, precision):
    from coppelius.conformance.activations import activation_rows

    state = random_state(config, seed=26, t=6)
    program = backend.capture(config, Hyper(), precision, B, state.copy())
    program.upload_input(windows(1, seed=27, config=config)[0])
    program.replay_and_wait()
    kept = program.row_losses()
    tokens = windows(1, seed=28, config=config)[0]
    got = program.activations(tokens)
    assert list(got) == [name for name, _ in activation_names(config)]
    P = program.state().P
    want = step_activations(config, P, tokens, precision)
    for name in got:
        assert got[name].shape == want[name].shape and got[name].dtype == np.float32, name
    rows = activation_rows(config, got, want, precision)
    assert all(r.passed for r in rows), failures(rows)
    assert np.array_equal(program.row_losses(), kept)  # the last replay's results are kept
    assert program.state().t == 7


def test_activations_locate_the_first_diverging_layer(backend, monkeypatch):
    """A reference whose second layer's SwiGLU is broken: the comparison
    names that layer and tensor first, whatever follows it."""
    from coppelius.conformance.activations import activation_rows, first_divergence
    from coppelius.reference import model as reference_model

    program = backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    tokens = windows(1, seed=29)[0]
    got = program.activations(tokens)
    calls = []
    original = reference_model.swiglu_forward

    def broken(g, u):
        calls.append(1)
        a, cache = original(g, u)
        return (a * np.float32(1.01) if len(calls) == 2 else a), cache  # layer 1 only

    monkeypatch.setattr(reference_model, "swiglu_forward", broken)
    want = step_activations(CONFIG, fresh().P, tokens, "fp32")
    rows = activation_rows(CONFIG, got, want, "fp32")
    first = first_divergence(rows)
    assert first is not None and first.tensor == "layers.1.mlp.h", first
    assert all(r.passed for r in rows[:[r.tensor for r in rows].index("layers.1.mlp.h")])
