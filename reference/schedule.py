"""The learning rate of each step, from a learner identity (SPEC sections 7, 10).

A result file's header carries the learner identity, and with it everything
the schedule depends on (`|schedule=cosine(warmup=W,total=N,floor=f)`,
`|schedule=wsd(warmup=W,total=N,decay=D,floor=f)`), so a report can draw
the learning rate of a finished run from the file alone. The schedule
itself is `adamw.schedule_factor`, `adamw.wsd_factor` and `adamw.learning_rates`;
this module only turns the identity back into the learner that wrote it.
"""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np

from .adamw import learning_rates
from .config import Hyper, parse_rational
from .errors import ConfigError

COSINE = re.compile(r"cosine\(warmup=(\d{1,12}),total=(\d{1,12}),floor=([0-9/]{1,64})\)")
WSD = re.compile(r"wsd\(warmup=(\d{1,12}),total=(\d{1,12}),decay=(\d{1,12}),floor=([0-9/]{1,64})\)")


def learner_from_identity(learner: str, where: str = "result file") -> tuple:
    """-> (Hyper, precision) whose identity is exactly `learner`. Anything this
    version does not write (another optimizer, an unknown part, a form of a
    number that is not canonical) is refused, naming `where`."""
    def refuse():
        shown = learner if not isinstance(learner, str) or len(learner) <= 400 else learner[:400] + "..."
        return ConfigError(f"{where}: learner identity {shown!r} is not one this version implements")

    if not isinstance(learner, str):
        raise refuse()
    parts = dict(part.partition("=")[::2] for part in learner.split("|"))
    kwargs = {}
    try:
        for name in ("lr", "beta1", "beta2", "weight_decay", "epsilon"):
            kwargs[name] = parse_rational(parts[name], name)
        if "schedule" in parts:
            match = COSINE.fullmatch(parts["schedule"])
            wsd = WSD.fullmatch(parts["schedule"])
            if match is not None:
                kwargs.update(schedule="cosine", warmup=int(match[1]), total=int(match[2]),
                              floor=parse_rational(match[3], "floor"))
            elif wsd is not None:  # a non-canonical number fails `same` below
                kwargs.update(schedule="wsd", warmup=int(wsd[1]), total=int(wsd[2]),
                              decay=int(wsd[3]), floor=parse_rational(wsd[4], "floor"))
            else:
                raise refuse()
        if "clip" in parts:
            kwargs["clip"] = parse_rational(parts["clip"], "clip")
        if "accumulate" in parts:
            text = parts["accumulate"]
            if not (text.isascii() and text.isdigit()) or len(text) > 10:
                raise refuse()
            kwargs["accumulate"] = int(text)  # a non-canonical form fails `same` below
        precision = parts["precision"]
        hyper = Hyper(**kwargs)
        same = hyper.identity(precision) == learner
    except (KeyError, ValueError, ConfigError):  # ConfigError: a value Hyper refuses
        raise refuse() from None
    if not same:
        raise refuse()
    return hyper, precision


def parse_schedule(learner: str, where: str = "result file") -> tuple:
    """-> (kind, W, N, f): ("constant", 0, None, Fraction(0)), ("cosine", W, N, f)
    or ("wsd", W, N, f) (the wsd decay D is the learner's: learner_from_identity)."""
    hyper, _ = learner_from_identity(learner, where)
    return hyper.schedule, hyper.warmup, hyper.total, Fraction(hyper.floor)


def step_learning_rates(learner: str, steps, where: str = "result file") -> np.ndarray:
    """The learning rate a_t (SPEC 7) that step s applies, for each global
    0-based step number s of a result file (its update is t = s + 1): (S,)
    float64 holding the float32 values the update multiplies by."""
    hyper, _ = learner_from_identity(learner, where)
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)  # (S,)
    if hyper.schedule == "constant":
        return np.full(len(steps), float(learning_rates(hyper, 1)[0]))
    # beyond total + 1 every update has the floor's rate: clamp, then look up
    # each distinct t once (a run's steps are distinct, a stitched run's too)
    t = np.minimum(steps, hyper.total) + 1
    unique, inverse = np.unique(t, return_inverse=True)
    rates = np.array([float(learning_rates(hyper, int(u))[0]) for u in unique])
    return rates[inverse].reshape(-1)
