"""The conformance suite (SPEC section 14): drive a backend's training
program and the reference definition (`reference.step`, `reference.forward`)
on the same inputs and compare every tensor.

Checks, in order, each producing one row per tensor:
  logits       program.logits vs reference.forward, initial parameters
  loss         mean loss of one step
  row_losses   (B, T) row losses of that step
  gradient     G of that step, one row per parameter (registry name)
  P, M, V      the state after that update, one row per parameter
  t            the update count after that update (exact)
  norm         the gradient norm before clipping of that step (SPEC 7)
  eval         held-out row losses of the forward-only program (SPEC 18),
               before and after that update
  trajectory   mean losses of `steps` consecutive steps (step 0 is the one above)
  resume       S1 steps, state(), a new capture from that state, S2 steps:
               row losses of every step and the final P, M, V and t must be
               bitwise equal to the S1 + S2 steps of one program (SPEC 9)
  learner      the same one step and trajectory under a cosine schedule
               (or wsd: `schedule`), its warm-up, decay and floor all inside
               the trajectory, with gradient clipping that clips (SPEC 7)

A backend that refuses the model at capture (a family field of SPEC 21 it
does not compute, named by its ConfigError) fails with one `capture` row
that carries the refusal, and nothing else is run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np

from .. import accelerated
from .. import reference  # the definition: reference.step, reference.forward
from ..reference.config import Config, Hyper, check_precision
from ..reference.config import preset as preset_config
from ..reference.errors import ConfigError
from ..reference.params import registry
from ..reference.state import State
from ..reference.step import check_accumulate

from . import cases
from .tolerances import passes, relative_error, tolerance


@dataclass
class Row:
    check: str  # logits, loss, row_losses, gradient, P, M, V, t, trajectory, resume, capture
    tensor: str  # registry name, or what the tensor is
    error: float  # ||a - b|| / ||b|| (NaN: a non-finite value)
    tolerance: float
    passed: bool
    worst: tuple  # index of the worst element in the tensor
    got: float  # the backend's value there
    want: float  # the reference's value there


def refusal_row(refusal: ConfigError) -> Row:
    """The one row of a model the backend refused at capture: it fails, and
    its tensor column is the refusal (the backend, the field and its value)."""
    return Row("capture", f"refused: {refusal}", math.nan, 0.0, False, (), math.nan, math.nan)


def capture_or_refusal(module, config: Config, hyper: Hyper, precision: str, batch: int,
                       state: State, **options):
    """(program, None), or (None, the refusal row) where the backend refuses
    the model at capture with a ConfigError naming what it does not compute."""
    try:
        return module.capture(config, hyper, precision, batch, state, **options), None
    except ConfigError as e:
        return None, refusal_row(e)


def compare(check: str, tensor: str, got, want, tol: float) -> Row:
    error, worst, a, b = relative_error(got, want)
    return Row(check, tensor, error, tol, passes(error, tol), worst, a, b)


def compare_bitwise(check: str, tensor: str, got, want) -> Row:
    """Exact equality of the float32 bits (so -0.0 != 0.0 and NaN fails)."""
    got = np.ascontiguousarray(got, dtype=np.float32)
    want = np.ascontiguousarray(want, dtype=np.float32)
    row = compare(check, tensor, got, want, 0.0)
    same = got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    row.passed = bool(same and np.isfinite(got).all())
    if not same and row.error == 0.0:  # only a signed zero differs: point at it
        flat = int(np.argmax(got.view(np.uint32) != want.view(np.uint32)))
        row.worst = tuple(int(i) for i in np.unravel_index(flat, got.shape))
        row.got, row.want = float(got.flat[flat]), float(want.flat[flat])
    return row


# ------------------------------------------------------------------ the report

@dataclass
class Report:
    backend: str
    preset: str
    precision: str
    batch: int | str  # B, or the range of B the random cases drew
    inputs: str  # where the tokens came from
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def failures(self) -> list:
        return [r for r in self.rows if not r.passed]

    @property
    def refused(self) -> str | None:
        """The backend's refusal of the model at capture, or None."""
        row = next((r for r in self.rows if r.check == "capture"), None)
        return row.tensor.removeprefix("refused: ") if row else None

    def row(self, check: str, tensor: str) -> Row:
        for r in self.rows:
            if r.check == check and r.tensor == tensor:
                return r
        raise KeyError((check, tensor))

    def sorted_by_error(self) -> list:
        """Worst first; a NaN error (non-finite value) is the worst of all."""
        return sorted(self.rows, key=lambda r: -math.inf if math.isnan(r.error) else -r.error)

    def table(self, rows=None) -> str:
        rows = self.rows if rows is None else rows
        width = max([len("tensor")] + [len(r.tensor) for r in rows])
        lines = [f"{'check':<11} {'tensor':<{width}} {'error':>10} {'tolerance':>9}  "
                 f"{'result':<6} worst element (backend vs reference)"]
        for r in rows:
            worst = f"[{', '.join(map(str, r.worst))}]" if r.worst else "[]"
            lines.append(f"{r.check:<11} {r.tensor:<{width}} {r.error:>10.3e} {r.tolerance:>9.0e}  "
                         f"{'PASS' if r.passed else 'FAIL':<6} {worst} {r.got:.9g} vs {r.want:.9g}")
        return "\n".join(lines)

    def summary(self) -> str:
        failed = len(self.failures)
        verdict = "PASS" if self.passed else "FAIL"
        head = (f"conformance {self.backend} {self.precision} preset {self.preset} B={self.batch}"
                f" ({self.inputs}): ")
        if self.refused:
            return head + f"refused at capture ({self.refused}): FAIL"
        line = head + (f"{len(self.rows)} checks, {len(self.rows) - failed} passed,"
                       f" {failed} failed: {verdict}")
        if failed:
            first = self.failures[0]
            line += f" (first failure: {first.check} {first.tensor}, error {first.error:.3e})"
        return line


# ------------------------------------------------------------------ the checks

def _backend(backend):
    """A backend name, or anything with `capture(...)` (a module or a test wrapper)."""
    if isinstance(backend, str):
        return backend, accelerated.backend_module(backend)
    return getattr(backend, "NAME", getattr(backend, "__name__", type(backend).__name__)), backend


def _config(preset) -> tuple:
    if isinstance(preset, Config):
        return "custom", preset
    return preset, preset_config(preset)


def state_rows(config: Config, got: State, want: State, precision: str) -> list:
    """P, M, V per parameter (tolerance of the "update" row), then t (exact)."""
    rows = []
    for label, a, b in (("P", got.P, want.P), ("M", got.M, want.M), ("V", got.V, want.V)):
        for spec in registry(config):
            rows.append(compare(label, spec.name, np.asarray(a[spec.slice]).reshape(spec.shape),
                                np.asarray(b[spec.slice]).reshape(spec.shape),
                                tolerance(label, precision)))
    rows.append(compare_bitwise("t", "update count t", np.float32(got.t), np.float32(want.t)))
    return rows


def resume_rows(config: Config, got: State, want: State) -> list:
    """P, M, V bitwise as whole vectors (one row each), then t. A difference
    is reported in the first parameter that holds one, by its name."""
    rows = []
    for label, a, b in (("P", got.P, want.P), ("M", got.M, want.M), ("V", got.V, want.V)):
        row = compare_bitwise("resume", label, a, b)
        if not row.passed:
            for spec in registry(config):
                part = compare_bitwise("resume", f"{label}:{spec.name}",
                                       a[spec.slice].reshape(spec.shape),
                                       b[spec.slice].reshape(spec.shape))
                if not part.passed:
                    row = part
                    break
        rows.append(row)
    rows.append(compare_bitwise("resume", "update count t", np.float32(got.t), np.float32(want.t)))
    return rows


def step_rows(program, config: Config, hyper: Hyper, precision: str, state: State,
              tokens: np.ndarray, notes: list | None = None) -> list:
    """Logits with the current parameters, then one step (loss, row losses,
    each gradient, P, M, V, t), of a program captured from `state`.
    tokens: (B, T+1) ids. The program is left one step on. A failing P, M
    or V row gets a diagnosis appended to `notes` (see update_diagnosis)."""
    reg = registry(config)
    tol = lambda check: tolerance(check, precision)  # noqa: E731
    rows = []
    inputs = tokens[:, :-1]  # (B, T)
    rows.append(compare("logits", "logits", program.logits(inputs),
                        reference.forward(config, state.P.copy(), inputs, precision), tol("logits")))

    held_out = tokens[::-1]  # another batch of the same shape
    rows.append(compare("eval", "held-out row losses", program.evaluate(held_out),
                        reference.row_losses(config, state.P.copy(), held_out, precision),
                        tol("eval")))
    want = reference.step(config, state.copy(), tokens, precision, hyper, grads=True)
    program.upload_input(tokens)
    loss = program.replay_and_wait()
    rows.append(compare("loss", "mean loss", np.float32(loss), np.float32(want.loss), tol("loss")))
    rows.append(compare("row_losses", "row losses", program.row_losses(), want.row_losses,
                        tol("row_losses")))
    rows.append(compare("norm", "gradient norm", np.float32(program.grad_norm()),
                        np.float32(want.grad_norm), tol("norm")))
    G = program.gradients()  # (N,)
    for spec in reg:
        rows.append(compare("gradient", spec.name, G[spec.slice].reshape(spec.shape),
                            want.grads[spec.slice].reshape(spec.shape), tol("gradient")))
    got = program.state()
    update = state_rows(config, got, want.state, precision)
    rows += update
    rows.append(compare("eval", "held-out row losses after the update", program.evaluate(held_out),
                        reference.row_losses(config, want.state.P, held_out, precision),
                        tol("eval")))
    failed = [r for r in update if not r.passed and r.check in ("P", "M", "V")]
    if failed:
        gradient_passed = {r.tensor for r in rows if r.check == "gradient" and r.passed}
        own = own_gradient_update(config, hyper, state, G)
        explained = []
        failed = [r for r in failed
                  if not _explained(config, r, own, got, gradient_passed, explained)]
        if notes is not None:
            notes += explained
            notes += update_diagnosis(config, hyper, precision, state, G, got, failed)
    return rows


def own_gradient_update(config: Config, hyper: Hyper, state: State, G: np.ndarray) -> dict:
    """The reference's update (SPEC 7: clipping, schedule, AdamW) of `state`
    applied to a backend's own gradient G: {"P": .., "M": .., "V": ..}."""
    from ..reference.adamw import adamw_update, clip_scale, gradient_norm

    scale = clip_scale(hyper, gradient_norm(G))
    update = G if scale is None else G * scale
    P, M, V = adamw_update(state.P, state.M, state.V, update, registry(config).decay_mask(),
                           hyper, state.t + 1)
    return {"P": P, "M": M, "V": V}


def _explained(config: Config, row: Row, own: dict, got: State, gradient_passed: set,
               notes: list) -> bool:
    """Whether a P, M or V row that misses the update tolerance is the
    reference's update of a gradient that passed (docs/SPEC.md, 14): the
    tensor's gradient within the gradient row, and the backend's P, M or V
    within the update row of the reference AdamW applied to that gradient.
    The difference is then the gradient's, amplified where AdamW's update is
    ill-conditioned (|g| near rounding noise: the first update from fresh
    moments, a key bias past the rotated elements, whose exact gradient is
    0). The row then passes, and a note says so."""
    if row.tensor not in gradient_passed:
        return False
    part = registry(config).by_name[row.tensor].slice
    error, *_ = relative_error(getattr(got, row.check)[part], own[row.check][part])
    if not error <= row.tolerance:
        return False
    row.passed = True
    notes.append(f"{row.check} {row.tensor}: error {row.error:.1e} against the reference's, "
                 f"{error:.1e} against the reference update of the backend's own gradient "
                 f"(which passes): the gradient's difference, amplified by AdamW; passes")
    return True


def update_diagnosis(config: Config, hyper: Hyper, precision: str, state: State, G: np.ndarray,
                     got: State, failed: list) -> list:
    """Tell a wrong update from an amplified gradient difference.

    The reference AdamW is applied to the backend's own gradient G: if the
    backend's P, M, V match that, its optimizer is right and the difference
    entered through G. Adam's first update from zero moments is
    lr * g / (|g| + epsilon), nearly lr * sign(g): where |g| is near epsilon
    a gradient difference far inside the gradient tolerance moves P by up to
    lr, so a correct fp32 backend can miss the P tolerance there."""
    if not failed:
        return []
    reg = registry(config)
    own = own_gradient_update(config, hyper, state, G)
    notes = []
    for row in failed:
        spec = reg.by_name[row.tensor]
        error, *_ = relative_error(getattr(got, row.check)[spec.slice], own[row.check][spec.slice])
        if error <= tolerance(row.check, precision):
            g = np.abs(G[spec.slice])
            notes.append(f"{row.check} {row.tensor}: matches the reference update of the backend's "
                         f"own gradient (error {error:.1e}); the difference enters through the "
                         f"gradient ({int((g < 100 * float(hyper.epsilon)).sum())} elements with "
                         f"|g| < 100 epsilon, where AdamW's first update is ill-conditioned)")
        else:
            notes.append(f"{row.check} {row.tensor}: differs from the reference update of the "
                         f"backend's own gradient too (error {error:.1e}): the update is wrong")
    return notes


def trajectory(program, windows: np.ndarray):
    """Run every window (S, B, T+1) through `program`: (S,) mean losses, (S, B, T) row losses."""
    losses, row_losses = [], []
    for tokens in windows:
        program.upload_input(tokens)
        losses.append(program.replay_and_wait())
        row_losses.append(np.array(program.row_losses(), dtype=np.float32, copy=True))
    return np.asarray(losses, dtype=np.float32), np.stack(row_losses)


def reference_trajectory(config: Config, hyper: Hyper, precision: str, state: State,
                         windows: np.ndarray) -> np.ndarray:
    losses = []
    state = state.copy()
    for tokens in windows:
        result = reference.step(config, state, tokens, precision, hyper)
        losses.append(result.loss)
        state = result.state
    return np.asarray(losses, dtype=np.float32)


WARM_STEPS = 3  # reference updates before the one-step checks (see run_suite)


def warm_state(config: Config, hyper: Hyper, precision: str, state: State, batch: int) -> State:
    """`state` after WARM_STEPS reference updates on windows of another seed."""
    windows = cases.random_windows(config, batch, WARM_STEPS, seed=cases.TOKEN_SEED + 1)
    for tokens in windows:
        state = reference.step(config, state, tokens, precision, hyper).state
    return state


def run_suite(backend, preset="test", precision="fp32", batch: int = 1, steps: int = 20,
              resume_at: int | None = None, windows: np.ndarray | None = None,
              hyper: Hyper | None = None, state: State | None = None,
              inputs: str | None = None, accumulate: int = 1,
              schedule: str = "cosine") -> Report:
    """Every check of the module docstring for one backend, preset and policy.

    windows: (steps, B, T+1) token ids; by default `cases.random_windows`
    (seed cases.TOKEN_SEED). state: the starting state; by default the
    preset's fresh initialization. resume_at: S1 of the resume check (by
    default steps // 3, so the split is not at a checkpoint interval).
    accumulate: k > 1 adds the `accumulate` rows (accumulate_rows, SPEC 19).
    schedule: the learner rows' schedule, "cosine" or "wsd" (production_learner)."""
    check_precision(precision)
    name, module = _backend(backend)
    preset_name, config = _config(preset)
    hyper = hyper or Hyper()
    if steps < 2:
        raise ValueError("the suite needs at least 2 steps (one to check, one to resume into)")
    if windows is None:
        windows = cases.random_windows(config, batch, steps)
        inputs = inputs or f"random windows, seed {cases.TOKEN_SEED}"
    windows = np.asarray(windows)
    if windows.shape != (steps, batch, config.context + 1):
        raise ValueError(f"windows shape {windows.shape} != {(steps, batch, config.context + 1)}")
    state0 = state if state is not None else cases.fresh_state(config)
    S1 = resume_at if resume_at is not None else max(1, steps // 3)
    if not 1 <= S1 < steps:
        raise ValueError(f"resume_at={S1}: must be in [1, {steps})")
    report = Report(name, preset_name, precision, batch, inputs or "given windows")

    # The one-step checks start from a warm state (unless the caller gave
    # one): AdamW's first update from zero moments is lr * g / (|g| + eps),
    # about lr * sign(g), so a gradient element below epsilon -- harmless in
    # the gradient check -- moves P by up to lr and fails the 1e-5 check of
    # P on a correct backend (seen on `tiny` fp32). After WARM_STEPS reference
    # updates, v holds history and the update is well conditioned.
    one = state0 if state is not None else warm_state(config, hyper, precision, state0, batch)
    program, refused = capture_or_refusal(module, config, hyper, precision, batch, one.copy())
    if refused:
        report.rows.append(refused)
        return report
    report.rows += step_rows(program, config, hyper, precision, one, windows[0], report.notes)
    del program

    # the trajectory: every window from the starting state in one program
    program = module.capture(config, hyper, precision, batch, state0.copy())
    losses, row_losses = trajectory(program, windows)
    final = program.state()
    del program

    want = reference_trajectory(config, hyper, precision, state0, windows)
    report.rows.append(compare("trajectory", f"mean loss, {steps} steps", losses, want,
                               tolerance("trajectory", precision)))

    # exact resume: S1 steps, state(), a fresh capture from it, S2 steps
    first = module.capture(config, hyper, precision, batch, state0.copy())
    _, rows1 = trajectory(first, windows[:S1])
    middle = first.state()
    del first
    second = module.capture(config, hyper, precision, batch, middle.copy())
    _, rows2 = trajectory(second, windows[S1:])
    resumed = second.state()
    del second
    split = f"{S1}+{steps - S1} steps"
    report.rows.append(compare_bitwise("resume", f"row losses, {split}",
                                       np.concatenate([rows1, rows2]), row_losses))
    report.rows += resume_rows(config, resumed, final)
    report.rows += learner_rows(module, config, precision, batch, state0, one, windows, report,
                                schedule)
    if accumulate > 1:
        report.rows += accumulate_rows(module, config, hyper, precision, batch, accumulate,
                                       state0, one, windows, S1, report)
    return report


def accumulate_rows(module, config: Config, hyper: Hyper, precision: str, batch: int, k: int,
                    state0: State, one: State, windows: np.ndarray, S1: int, report) -> list:
    """SPEC 19: a program of k micro-batches against the unaccumulated
    reference -- one step (every tensor) and the trajectory -- within the
    usual tolerances; then its exact resume with the same k (bitwise)."""
    check_accumulate(batch, k)
    hyper = replace(hyper, accumulate=1)  # the reference side: the unaccumulated step
    rows = []
    program = module.capture(config, hyper, precision, batch, one.copy(), accumulate=k)
    for r in step_rows(program, config, hyper, precision, one, windows[0], report.notes):
        rows.append(Row("accumulate", f"k={k} {r.check} {r.tensor}", r.error, r.tolerance,
                        r.passed, r.worst, r.got, r.want))
    del program
    steps = len(windows)
    program = module.capture(config, hyper, precision, batch, state0.copy(), accumulate=k)
    losses, row_losses = trajectory(program, windows)
    final = program.state()
    del program
    want = reference_trajectory(config, hyper, precision, state0, windows)
    rows.append(compare("accumulate", f"k={k} mean loss, {steps} steps", losses, want,
                        tolerance("trajectory", precision)))
    first = module.capture(config, hyper, precision, batch, state0.copy(), accumulate=k)
    _, rows1 = trajectory(first, windows[:S1])
    middle = first.state()
    del first
    second = module.capture(config, hyper, precision, batch, middle.copy(), accumulate=k)
    _, rows2 = trajectory(second, windows[S1:])
    resumed = second.state()
    del second
    rows.append(compare_bitwise("resume", f"k={k} row losses, {S1}+{steps - S1} steps",
                                np.concatenate([rows1, rows2]), row_losses))
    for r in resume_rows(config, resumed, final):
        r.tensor = f"k={k} {r.tensor}"
        rows.append(r)
    return rows


LEARNER_SCHEDULES = ("cosine", "wsd")


def production_learner(config: Config, precision: str, state: State, tokens, steps: int,
                       schedule: str = "cosine") -> Hyper:
    """A cosine or wsd schedule whose warm-up, decay and floor (and wsd's
    stable phase, from 4 steps on) all fall inside `steps` updates from
    `state`, and a clip at half of the gradient norm at `state`, so that the
    first step clips (SPEC 7)."""
    if schedule not in LEARNER_SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}: the suite's learner rows take one of "
                          f"{', '.join(LEARNER_SCHEDULES)}")
    norm = reference.step(config, state.copy(), tokens, precision).grad_norm
    W = max(1, steps // 4)
    N = max(W + 1, steps - 2)
    extra = dict(decay=max(1, (N - W) // 2)) if schedule == "wsd" else {}
    return Hyper(schedule=schedule, warmup=state.t + W, total=state.t + N, **extra,
                 floor=Fraction(1, 10), clip=Fraction(float(norm)) / 2)


def learner_rows(module, config: Config, precision: str, batch: int, state0: State, one: State,
                 windows: np.ndarray, report, schedule: str = "cosine") -> list:
    """One step and a trajectory under a cosine (or wsd) schedule with clipping.
    The cosine's one step is in its warm-up; wsd's in its decay, halfway
    (the stable phase's rate is lr, the main rows' rate)."""
    rows = []
    steps = len(windows)
    hyper = production_learner(config, precision, one, windows[0], steps, schedule)
    if schedule == "wsd":  # update t = one.t + 1: s = f + (1 - f) * 1/2
        hyper = replace(hyper, warmup=0, total=one.t + 2, decay=2)
    program = module.capture(config, hyper, precision, batch, one.copy())
    for r in step_rows(program, config, hyper, precision, one, windows[0], report.notes):
        rows.append(Row("learner", f"{r.check} {r.tensor}", r.error, r.tolerance, r.passed,
                        r.worst, r.got, r.want))
    del program
    hyper = production_learner(config, precision, state0, windows[0], steps, schedule)
    program = module.capture(config, hyper, precision, batch, state0.copy())
    losses, _ = trajectory(program, windows)
    del program
    want = reference_trajectory(config, hyper, precision, state0, windows)
    decay = f" D={hyper.decay}" if schedule == "wsd" else ""
    rows.append(compare("learner", f"mean loss, {steps} steps, {schedule} W={hyper.warmup} "
                                   f"N={hyper.total}{decay}, clip", losses, want,
                        tolerance("trajectory", precision)))
    return rows


# ------------------------------------------------------------------ hypothesis

def run_hypothesis(backend, examples: int, precision: str = "fp32", seed: int | None = 0) -> Report:
    """One step from random small configurations, tokens and states
    (cases.strategies) on the backend's program vs reference.step.

    Passing: one row per check with the worst error over all examples.
    Failing: hypothesis shrinks to a minimal example, whose rows are kept."""
    from hypothesis import HealthCheck, Verbosity, given, settings
    from hypothesis import seed as hseed

    check_precision(precision)
    name, module = _backend(backend)
    _, case_strategy = cases.strategies()
    worst: dict = {}
    failing: dict = {}

    @settings(max_examples=examples, deadline=None, database=None, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck))
    @given(case_strategy(precisions=(precision,)))
    def one(case):
        config, batch, tokens, state, prec = case
        program, refused = capture_or_refusal(module, config, Hyper(), prec, batch, state.copy())
        notes = []
        rows = [refused] if refused else step_rows(program, config, Hyper(), prec, state,
                                                   tokens, notes)
        for r in rows:
            if r.check not in worst or not (r.error <= worst[r.check].error):
                worst[r.check] = r
        bad = [r for r in rows if not r.passed]
        if bad:
            failing["rows"], failing["case"], failing["notes"] = rows, (config, batch, state.t), notes
            raise AssertionError(f"{len(bad)} checks failed, first {bad[0].check} {bad[0].tensor}")

    if seed is not None:
        one = hseed(seed)(one)
    report = Report(name, "random small configs", precision, "1-2",
                    f"{examples} hypothesis cases, seed {seed}")
    try:
        one()
    except AssertionError:
        config, batch, t = failing["case"]
        report.rows = failing["rows"]
        report.batch = batch
        report.notes.append(f"minimal failing case: {config.identity()} B={batch} t={t}")
        report.notes += failing["notes"]
        return report
    for check, r in worst.items():
        report.rows.append(Row(check, f"worst of all cases: {r.tensor}", r.error, r.tolerance,
                               r.passed, r.worst, r.got, r.want))
    return report
