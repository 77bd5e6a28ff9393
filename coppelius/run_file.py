"""The run file, run.json (SPEC 9): what a run directory remembers of the
options that shaped its run, read and validated by `coppelius train` (which
also writes it) and by `coppelius eval` (which finds the run's stream in it)."""

from __future__ import annotations

import json
import os
import stat

from coppelius.reference import fsutil
from coppelius.reference.errors import RunError

# What run.json remembers (SPEC 9): every option that shapes the run. A
# later `coppelius train --run-dir D` takes these from D/run.json unless the
# command line gives them. Not remembered: how far to go this time (--steps,
# --until: the remembered final step is), where to write this invocation's
# results, the lifting switches, and the sample.
REMEMBERED = ("source", "stream", "tokenizer", "preset", "model", "backend", "precision", "batch", "accumulate",
              "gpus", "recompute", "interval",
              "lr", "beta1", "beta2", "weight_decay", "epsilon", "schedule", "warmup", "total",
              "decay", "floor", "clip", "eval_contexts", "eval_every", "seed", "checkpoint",
              "repeat_data", "final_step")
RUN_FILE = "run.json"
RUN_FORMAT = "coppelius-run-v1"


def read_run_file(run_dir) -> dict:
    """The options run.json in `run_dir` remembers ({} when there is none)."""
    path = os.path.join(run_dir, RUN_FILE)
    if not os.path.lexists(path):
        return {}
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise RunError(f"{path}: not a regular file")
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunError(f"{path}: not a run file this version reads ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT or not isinstance(
            doc.get("options"), dict):
        raise RunError(f"{path}: not a run file this version reads (format {RUN_FORMAT})")
    unknown = sorted(set(doc["options"]) - set(REMEMBERED))
    if unknown:
        raise RunError(f"{path}: unknown option {unknown[0]!r}")
    return doc["options"]


def write_run_file(run_dir, options: dict) -> None:
    """Publish run.json atomically and durably, as a checkpoint is."""
    body = json.dumps({"format": RUN_FORMAT, "options": options}, sort_keys=True, indent=1)
    fsutil.publish(os.path.join(run_dir, RUN_FILE), lambda f: f.write(body.encode() + b"\n"))
