"""One run's records in step order, stitched from the result files of its
run directory (SPEC 11: each invocation writes its own), and the run as CSV.

A file written later wins: an invocation starts from the run's checkpoint,
so whatever earlier files recorded from its first step on belongs to a
history the run left (a run resumed from an older checkpoint re-trains
those steps).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from coppelius.reference import checkpoint, results
from coppelius.reference.errors import CoppeliusError, ResultFileError
from coppelius.reference.fsutil import publish
from coppelius.reference.schedule import learner_from_identity, step_learning_rates

RESULT_NAME = re.compile(r"results-(\d+)(?:-(\d+))?\.bin")  # SPEC 11's default names
CSV_COLUMNS = ("step", "train_loss", "grad_norm", "learning_rate", "heldout_loss",
               "host_seconds", "device_seconds")


@dataclass
class Run:
    """A run's records in step order, stitched from its result files (or one
    file). Each kind's arrays share that kind's step numbers."""

    files: list  # [Results] in the order they were written
    steps: np.ndarray  # (S,) int64: steps with a step record
    rows: list  # [(B,T) float32]: their row losses
    loss: np.ndarray  # (S,) float64: the mean row loss of each step
    lr: np.ndarray  # (S,) float64: the learning rate a_t of each step's update; NaN: not known
    norm_steps: np.ndarray  # (R,) int64
    norms: np.ndarray  # (R,) float32: gradient norm before clipping
    eval_steps: np.ndarray  # (E,) int64: updates done
    eval_means: np.ndarray  # (E,) float32: mean held-out loss
    eval_k: np.ndarray  # (E,) int64: contexts of each evaluation
    timing_steps: np.ndarray  # (U,) int64
    host: np.ndarray  # (U,) float64 seconds
    device: np.ndarray  # (U,) float64 seconds, NaN: no device clock
    starts: list  # [first step of each file after the first]: where the run resumed
    clips: set  # the clip thresholds of the files' learners (None: off)
    notes: list = field(default_factory=list)  # [(key, text)] for the summary


def _name(r: results.Results) -> str:
    return os.path.basename(r.path)


def _without(identity: str, lifted: tuple) -> list:
    return [part for part in identity.split("|") if not part.startswith(lifted)]


def check_one_run(files: list) -> None:
    """Refuse files that are not of one run: the model and initialization must
    be the same, the data and learner the same but for what --new-data and
    --new-learner lift (SPEC 9). Version 1 has no initialization to compare."""
    first = files[0]
    for other in files[1:]:
        for key, lifted, option in (("model", (), None), ("initialization", (), None),
                                    ("data", checkpoint.LIFTED["data"], "--new-data"),
                                    ("learner", checkpoint.LIFTED["learner"], "--new-learner")):
            a, b = first.header.get(key), other.header.get(key)
            if a is None or b is None:
                continue
            if _without(a, lifted) != _without(b, lifted):
                beyond = f" beyond what {option} lifts" if option else ""
                raise ResultFileError(
                    f"result files {first.path} and {other.path} are not of one run: their {key} "
                    f"identities differ{beyond}: {a!r} and {b!r}")


def read_run_dir(path) -> list:
    """Every results-*.bin of a run directory, read, in the order written: by
    first step, then by the name's -1, -2 suffix. A run's checkpoint never
    goes back (each publication moves it on), so an invocation never starts
    before an earlier one did; one that starts at the same step was given
    the next free name."""
    try:
        names = sorted(n for n in os.listdir(path) if n.startswith("results-") and n.endswith(".bin"))
    except OSError as e:
        raise CoppeliusError(f"run directory {path}: cannot list: {e.strerror or e}") from None
    if not names:
        raise CoppeliusError(f"run directory {path}: no result files (results-*.bin) in it")
    files = [results.read_results(os.path.join(path, n)) for n in names]

    def written(r):
        m = RESULT_NAME.fullmatch(_name(r))
        return r.header["first_step"], int(m[2] or 0) if m else 0, _name(r)

    return sorted(files, key=written)


def step_ranges(steps: list) -> str:
    """[3, 4, 5, 9] -> '3..5, 9'."""
    out, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(f"{steps[i]}..{steps[j]}" if j > i else f"{steps[i]}")
        i = j + 1
    return ", ".join(out)


def stitch(files: list) -> Run:
    """Stitch the files (in the order written) into one run. A later file
    wins: it starts from a checkpoint, so what earlier files recorded for its
    first step and after belongs to a history the run left (a run resumed
    from an older checkpoint re-trains those steps). An evaluation after u
    updates is kept up to u = the next file's first step: that is the state
    the next file starts from."""
    check_one_run(files)
    notes = []
    steps, rows, lr, norms, timings, evals = [], [], [], [], [], {}
    clips = set()
    for i, r in enumerate(files):
        cut = files[i + 1].header["first_step"] if i + 1 < len(files) else math.inf
        kept = [(s, x) for s, x in r.steps if s < cut]
        if r.stopped and i + 1 < len(files):  # the last file's is the summary's "completed"
            notes.append(("stopped early", f"{_name(r)}: {r.stopped}"))
        left = sorted({s for s, _ in r.steps if s >= cut} | {s for s, _ in r.norms if s >= cut}
                      | {int(t[0]) for t in r.timings if t[0] >= cut})
        if left:
            notes.append(("replaced", f"steps {step_ranges(left)} of {_name(r)}: "
                                      f"{_name(files[i + 1])} resumed the run at step {cut} "
                                      f"(a later file wins)"))
        steps += [s for s, _ in kept]
        rows += [x for _, x in kept]
        norms += [(s, n) for s, n in r.norms if s < cut]
        timings += [t for t in r.timings if t[0] < cut]
        for u, mean, losses in r.evals:
            if u <= cut:
                evals[u] = (mean, len(losses))  # a later file's evaluation at u wins
        try:
            hyper, _ = learner_from_identity(r.header["learner"], f"result file {r.path}")
            clips.add(hyper.clip)
            lr.append(step_learning_rates(r.header["learner"], [s for s, _ in kept]))
        except CoppeliusError:
            notes.append(("learning rate", f"not known for {_name(r)}: its learner identity "
                                           f"is not one this version implements"))
            lr.append(np.full(len(kept), np.nan))
        if i and r.header["learner"] != files[i - 1].header["learner"]:
            old = files[i - 1].header["learner"].split("|")
            new = [p for p in r.header["learner"].split("|") if p not in old]
            notes.append(("learner", f"changes at step {r.header['first_step']} ({_name(r)}): "
                                     f"{', '.join(new) or 'parts removed'}"))
    order = np.argsort(np.array(steps, dtype=np.int64), kind="stable")
    steps = np.array(steps, dtype=np.int64)[order]
    rows = [rows[k] for k in order]
    gaps = [f"{a + 1}..{b - 1}" if b - a > 2 else f"{a + 1}"
            for a, b in zip(steps[:-1].tolist(), steps[1:].tolist()) if b - a > 1]
    if gaps:
        notes.append(("missing", f"steps {', '.join(gaps)}: no result file holds them"))
    norms.sort(key=lambda x: x[0])
    timings.sort(key=lambda x: x[0])
    u = sorted(evals)
    return Run(
        files=files, steps=steps, rows=rows,
        loss=np.array([x.mean(dtype=np.float64) for x in rows]),
        lr=np.concatenate(lr)[order] if lr else np.zeros(0),
        norm_steps=np.array([s for s, _ in norms], dtype=np.int64),
        norms=np.array([n for _, n in norms], dtype=np.float32),
        eval_steps=np.array(u, dtype=np.int64),
        eval_means=np.array([evals[k][0] for k in u], dtype=np.float32),
        eval_k=np.array([evals[k][1] for k in u], dtype=np.int64),
        timing_steps=np.array([t[0] for t in timings], dtype=np.int64),
        host=np.array([t[1] for t in timings], dtype=np.float64),
        device=np.array([t[2] for t in timings], dtype=np.float64),
        starts=[r.header["first_step"] for r in files[1:]], clips=clips, notes=notes)


def csv_rows(run: Run) -> list:
    """[CSV_COLUMNS as text] per step that has any record, in step order. A
    missing value (no evaluation at that step, no device clock) is empty;
    float32 values are written in their shortest exact form."""
    table = {}

    def row(step):
        return table.setdefault(int(step), dict.fromkeys(CSV_COLUMNS[1:], ""))

    for step, loss, lr in zip(run.steps, run.loss, run.lr):
        row(step)["train_loss"] = repr(float(loss))
        row(step)["learning_rate"] = str(np.float32(lr)) if np.isfinite(lr) else ""
    for step, norm in zip(run.norm_steps, run.norms):
        row(step)["grad_norm"] = str(np.float32(norm))
    for step, mean in zip(run.eval_steps, run.eval_means):
        row(step)["heldout_loss"] = str(np.float32(mean))
    for step, host, device in zip(run.timing_steps, run.host, run.device):
        row(step)["host_seconds"] = repr(float(host))
        row(step)["device_seconds"] = repr(float(device)) if not math.isnan(device) else ""
    return [[str(step)] + list(table[step].values()) for step in sorted(table)]


def csv_body(run: Run) -> bytes:
    """The --csv file of `coppelius report`: CSV_COLUMNS, then a row per record."""
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    w.writerows(csv_rows(run))
    return text.getvalue().encode("utf-8")
