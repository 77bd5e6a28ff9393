"""The run file, run.json (SPEC 9): what a run directory remembers of the
options that shaped its run, read and validated by `coppelius train` (which
also writes it) and by `coppelius eval` (which finds the run's stream in it)."""

from __future__ import annotations

import json
import os

from coppelius.reference import fsutil
from coppelius.reference.errors import RunError

# What run.json remembers (SPEC 9): every option that shapes the run. A
# later `coppelius train --run-dir D` takes these from D/run.json unless the
# command line gives them. Not remembered: how far to go this time (--steps;
# --until is remembered as the run's final step), where to write this
# invocation's results, the lifting switches, and the sample.
REMEMBERED = ("source", "stream", "tokenizer", "preset", "model", "backend", "precision", "batch", "accumulate",
              "gpus", "recompute", "shard_optimizer", "interval",
              "lr", "beta1", "beta2", "weight_decay", "epsilon", "schedule", "warmup", "total",
              "decay", "floor", "clip", "eval_contexts", "eval_every", "eval_source", "eval_stream",
              "seed", "checkpoint", "repeat_data", "final_step", "tensorboard", "wandb",
              "peak_tflops", "eos", "text_field")
# Of those, what the run is: its data, model, checkpoint, and every option
# its checkpoint's identities hold (or the contexts it reads). Remembered
# whenever given: the checkpoint holds them from then on, so the run cannot
# go on without them. The others (SETTINGS: how this invocation trains, and
# `final_step`, which only --until sets) are remembered when given without
# --steps: an invocation of `--steps S` (a smoke test, a few more steps) is
# for this time only, and leaves them as the run had them.
RUN_OPTIONS = ("source", "stream", "tokenizer", "preset", "model", "precision", "batch",
               "accumulate", "lr", "beta1", "beta2", "weight_decay", "epsilon", "schedule",
               "warmup", "total", "decay", "floor", "clip", "eval_contexts", "eval_source",
               "eval_stream", "seed", "checkpoint", "repeat_data", "eos", "text_field")
SETTINGS = tuple(k for k in REMEMBERED if k not in RUN_OPTIONS)
RUN_FILE = "run.json"
RUN_FORMAT = "coppelius-run-v1"
RUN_FILE_BYTES = 1 << 20  # five paths and a few numbers; anything larger is not a run file
RUN_FILE_DEPTH = 4  # the file nests 2 deep; a little more, so a wrong type is named as one
MAX_COUNT = 2**62  # the command line's bound on steps, batches and intervals (plan.MAX_STEP)

# What each remembered option must be, checked before any is used (the
# command line's own types and ranges, so that a hand-edited file cannot
# pass what `coppelius train` would refuse).
PATHS = ("source", "stream", "tokenizer", "model", "checkpoint", "eval_source", "eval_stream")  # absolute paths
POSITIVE = ("batch", "accumulate", "gpus", "interval", "total", "decay")
NONNEGATIVE = ("warmup", "eval_contexts", "eval_every", "final_step")
SWITCHES = ("shard_optimizer", "repeat_data")
# --recompute MODE; a file from when it was a switch holds true (gate-up) or false
RECOMPUTE = ("none", "gate-up", "block")
# --tensorboard DIR (an absolute path) or --no-tensorboard (false); --wandb
# PROJECT or --no-wandb (false); --peak-tflops X
OUTPUTS = ("tensorboard", "wandb")
RATIONALS = ("lr", "beta1", "beta2", "weight_decay", "epsilon", "floor", "clip")


def _choices() -> dict:
    from coppelius import accelerated
    from coppelius.reference.config import PRECISIONS, PRESETS, SCHEDULES

    return {"preset": sorted(PRESETS), "backend": sorted(accelerated.BACKENDS),
            "precision": list(PRECISIONS), "schedule": list(SCHEDULES)}


def _learner_check(key: str, q):
    """The range the learner puts on a rational option (Hyper's own checks)."""
    from coppelius.reference.config import Hyper

    if key == "floor":
        return Hyper(schedule="cosine", total=1, floor=q)
    return Hyper(**{key: q})


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_option(key: str, value) -> str | None:
    """Why `value` cannot be the remembered option `key` (None: it can)."""
    from coppelius.reference.config import parse_rational
    from coppelius.reference.errors import ConfigError

    if key in PATHS:
        if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value:
            return "must be an absolute path (a string)"
    elif key in POSITIVE:
        if not _integer(value) or not 0 < value < MAX_COUNT:
            return "must be a positive integer below 2^62"
    elif key in NONNEGATIVE:
        if not _integer(value) or not 0 <= value < MAX_COUNT:
            return "must be an integer >= 0 below 2^62"
    elif key == "seed":
        if not _integer(value) or not 0 <= value < 2**64:
            return "must be an integer in [0, 2^64)"
    elif key == "recompute":
        if not isinstance(value, bool) and not (isinstance(value, str) and value in RECOMPUTE):
            return 'must be "none", "gate-up" or "block" (or true, false)'
    elif key in SWITCHES:
        if not isinstance(value, bool):
            return "must be true or false"
    elif key in OUTPUTS:
        if value is not False and not (isinstance(value, str) and value and "\0" not in value
                                       and (key != "tensorboard" or os.path.isabs(value))):
            return ("must be false or " + ("an absolute path (a string)" if key == "tensorboard"
                                           else "a project name (a string)"))
    elif key == "peak_tflops":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 < value < float("inf")):
            return "must be a positive number (TFLOP/s)"
    elif key in RATIONALS:
        if not isinstance(value, str):
            return 'must be a string of an exact rational or decimal ("3/10000", "3e-4")'
        try:
            _learner_check(key, parse_rational(value, key))
        except ConfigError as e:
            return f"refused ({e})"
    elif key in ("eos", "text_field"):  # a token, a field name (SPEC 22)
        if not isinstance(value, str) or not value:
            return "must be a non-empty string"
    else:  # a name among choices
        choices = _choices()[key]
        if value not in choices:
            return f"must be one of {', '.join(choices)}"
    return None


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_run_file(run_dir) -> dict:
    """The options run.json in `run_dir` remembers ({} when there is none),
    each checked against its type and range before any is used. A refusal
    is one RunError naming the file and the field; nothing is written."""
    path = os.path.join(run_dir, RUN_FILE)
    if not os.path.lexists(path):
        return {}
    try:
        raw = fsutil.read_bounded(path, RUN_FILE_BYTES)
    except OSError as e:
        raise RunError(f"{path}: cannot read the run file ({e.strerror or e})") from None
    if len(raw) > RUN_FILE_BYTES:
        raise RunError(f"{path}: larger than {RUN_FILE_BYTES} bytes, not a run file")
    try:
        doc = fsutil.parse_json(raw, RUN_FILE_DEPTH)
    except fsutil.DocumentError as e:
        raise RunError(f"{path}: not a run file this version reads ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT or not isinstance(
            doc.get("options"), dict) or set(doc) != {"format", "options"}:
        raise RunError(f"{path}: not a run file this version reads (format {RUN_FORMAT})")
    options = doc["options"]
    unknown = sorted(set(options) - set(REMEMBERED))
    if unknown:
        raise RunError(f"{path}: unknown option {unknown[0]!r}")
    for key in REMEMBERED:
        if key in options:
            why = check_option(key, options[key])
            if why:
                raise RunError(f"{path}: option {key} = {_shown(options[key])}: {why}")
    return options


def write_run_file(run_dir, options: dict) -> None:
    """Publish run.json atomically and durably, as a checkpoint is."""
    body = json.dumps({"format": RUN_FORMAT, "options": options}, sort_keys=True, indent=1)
    fsutil.publish(os.path.join(run_dir, RUN_FILE), lambda f: f.write(body.encode() + b"\n"))


# ---------------------------------------------------------------- one run per directory

def remembered_checkpoint(run_dir, remembered: dict) -> str:
    """The checkpoint of the run a run directory holds: its run.json's, else
    RUN_DIR/checkpoint.bin (absolute)."""
    return os.path.abspath(remembered.get("checkpoint") or os.path.join(run_dir, "checkpoint.bin"))


def data_of(options: dict) -> tuple:
    """(kind, path) of a run's training data: ("source", path), ("stream",
    path), or ("embedded", None) for the embedded corpus."""
    for kind in ("source", "stream"):
        if options.get(kind):
            return kind, options[kind]
    return "embedded", None


def describe_data(data: tuple) -> str:
    kind, path = data
    return "the embedded corpus" if kind == "embedded" else f"{kind} {path}"


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def other_run(run_dir, remembered: dict, checkpoint: str | None,
              data: tuple | None) -> tuple | None:
    """What makes this run another run than the one `run_dir` holds (its
    run.json: `remembered`) -> ("checkpoint" or "data", the directory's run's
    checkpoint or data in words), or None: `checkpoint` (absolute) names
    another checkpoint, or `data` ((kind, path), data_of) other training
    data. None given means the command line named none (the run's own).
    A run.json of no options (a run of defaults alone) is a run too."""
    if not remembered and not os.path.lexists(os.path.join(run_dir, RUN_FILE)):
        return None
    theirs = remembered_checkpoint(run_dir, remembered)
    if checkpoint is not None and not _same_path(checkpoint, theirs):
        return "checkpoint", f"the checkpoint {theirs}"
    mine = data_of(remembered)
    if data is not None and (data[0] != mine[0] or not _same_path(data[1], mine[1])):
        return "data", describe_data(mine)
    return None


def run_lock(run_dir):
    """The lock of a run directory (its run.json), held by the run that
    trains there from its plan to its end."""
    return fsutil.Lock(os.path.join(run_dir, RUN_FILE), "run file")


def acquire_run_lock(lock, run_dir) -> None:
    """Take the run directory's lock; another run holding it is refused
    at once (a run never waits: the other may train for hours)."""
    from coppelius.reference.errors import InUseError

    try:
        lock.acquire()
    except InUseError:
        try:
            with fsutil.open_regular(lock.path) as f:
                holder = f.read(32).decode("ascii", "replace").strip()
        except OSError:
            holder = ""
        by = f"process {holder}" if holder.isdigit() else "another process"
        raise InUseError(f"run directory {run_dir}: another run trains there ({by}); wait for "
                         f"it to finish, or give this run a --run-dir of its own") from None
