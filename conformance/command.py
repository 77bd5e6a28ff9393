"""`coppelius conformance` (register(), for coppelius/cli.py) and
`python -m coppelius.conformance` (main()): one command line, these options.

    --backend NAME      (repeatable) default: every available backend but the
                        reference (the reference against itself is a smoke check)
    --preset NAME       a preset (default: conformance.cases.PRESETS, test and
                        a preset per family of SPEC 21); with --checkpoint it
                        must name the checkpoint's model (it is otherwise taken
                        from the checkpoint)
    --model FILE.toml   a model configuration file (SPEC 17), over --preset's
                        fields when both are given; with --checkpoint, the same
    --precision P       (repeatable) fp32, bf16; default both
    --batch B --steps S the step shape and the trajectory length (default 1, 20)
    --stream S          token windows from a stream (contexts c0 + s*B + b,
                        c0 = --context) instead of seeded random windows
    --schedule K        the learner rows' schedule: cosine (default) or wsd
    --hypothesis N      also N random small cases per backend and policy
    --checkpoint CK     reference debugging: one step from a real checkpoint
                        on context --context of --stream, every tensor's
                        difference, worst first
    --activations       layer-by-layer debugging: every intermediate of one
                        step's forward and backward against the reference's,
                        in the step's order, and the first layer and tensor
                        beyond tolerance (from --checkpoint's state when
                        given, else the preset's initialization; the window
                        is context --context of --stream, or a seeded one)

Exit status 0 when every check passes, 1 when any fails, 2 for bad input.
"""

from __future__ import annotations

import argparse
import os

from .. import accelerated
from ..reference.config import PRECISIONS, Hyper, config_from_identity, config_from_toml
from ..reference.config import preset as preset_config
from ..reference.errors import CheckpointError, ConfigError, IdentityMismatch, RunError
from ..reference.fsutil import path_argument
from ..reference.limits import ID, check_fits, step_bytes

from . import cases
from .suite import LEARNER_SCHEDULES, Report, run_hypothesis, run_suite, step_rows

FAILED = 1  # exit status when a check fails (2 is bad input, as everywhere)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help=f"backend to check ({', '.join(accelerated.BACKENDS)}); repeatable; "
                             "default: every available one except the reference")
    parser.add_argument("--preset", default=None,
                        help=f"model preset (default: {', '.join(cases.PRESETS)}); with "
                             "--checkpoint it must be the checkpoint's model")
    parser.add_argument("--model", metavar="FILE.toml",
                        help="model configuration file (SPEC §17); with --preset it overrides "
                             "the preset's fields")
    parser.add_argument("--precision", action="append", choices=PRECISIONS,
                        help="precision policy; repeatable (default: fp32 and bf16)")
    parser.add_argument("--batch", type=int, default=None, metavar="B",
                        help="contexts per step (default: 1, --accumulate's K, or the "
                             "checkpoint's)")
    parser.add_argument("--accumulate", type=int, default=1, metavar="K",
                        help="also check K micro-batches of B/K per step against the "
                             "unaccumulated reference, and their exact resume (SPEC 19)")
    parser.add_argument("--steps", type=int, default=20, metavar="S",
                        help="length of the loss trajectory and the resume run (default: 20)")
    parser.add_argument("--stream", metavar="PATH", type=path_argument,
                        help="token stream file for the inputs")
    parser.add_argument("--context", type=int, default=0, metavar="C",
                        help="first context of --stream to use (default: 0)")
    parser.add_argument("--checkpoint", metavar="CK", type=path_argument,
                        help="debug one step from this checkpoint (needs --stream)")
    parser.add_argument("--schedule", choices=LEARNER_SCHEDULES, default="cosine",
                        help="the schedule of the learner rows (one step and a trajectory "
                             "with clipping, SPEC §7; default: cosine)")
    parser.add_argument("--hypothesis", type=int, default=0, metavar="N",
                        help="also run N hypothesis-drawn small cases per backend and policy")
    parser.add_argument("--failures-only", action="store_true",
                        help="print only the failing rows of each table")
    parser.add_argument("--activations", action="store_true",
                        help="compare every intermediate of one step's forward and backward "
                             "with the reference's and name the first layer and tensor that "
                             "diverges")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "conformance", help="check backends against the reference, tensor by tensor",
        description="Drive each backend and the reference on the same inputs and compare "
                    "logits, losses, every gradient, P, M, V, a loss trajectory and exact "
                    "resume (SPEC 14). Exit status 1 when any check fails.")
    add_arguments(parser)
    parser.set_defaults(func=run)


def check_plan(config, batch: int, steps: int) -> None:
    """Refuse a suite whose memory cannot exist here: its token windows
    (steps, B, T+1) and one step of the reference, at the least."""
    windows = steps * batch * (config.context + 1) * ID
    check_fits(windows + step_bytes(config, batch), f"--steps={steps} --batch={batch}")


def default_backends() -> list:
    names = accelerated.available_backends()
    checked = [n for n in names if not accelerated.capabilities(n).defines]
    return checked or [n for n in names if accelerated.capabilities(n).defines]


def _print(report: Report, failures_only: bool, rows=None) -> None:
    rows = report.rows if rows is None else rows
    if failures_only:
        rows = [r for r in rows if not r.passed]
    if rows:
        print(report.table(rows))
    for note in report.notes:
        print(note)
    print(report.summary())
    print()


def run(args) -> int:
    if args.steps < 2:
        raise ConfigError(f"--steps={args.steps}: the suite needs at least 2")
    if args.batch is not None and args.batch < 1:
        raise ConfigError(f"--batch={args.batch}: must be a positive integer")
    if args.hypothesis < 0:
        raise ConfigError(f"--hypothesis={args.hypothesis}: must be >= 0")
    if args.hypothesis:
        try:
            import hypothesis  # noqa: F401
        except ImportError:
            raise ConfigError("--hypothesis needs the hypothesis package "
                              "(pip install 'coppelius[test]')") from None
    if args.context < 0:
        raise ConfigError(f"--context={args.context}: must be >= 0")
    backends = args.backend or default_backends()
    for name in backends:
        accelerated.backend_module(name)  # unknown or unavailable: one clear line, before any work
    if args.activations:
        return debug_activations(args, backends)
    if args.checkpoint:
        return debug_checkpoint(args, backends)

    # one preset or model file when named; else cases.PRESETS, the defaults'
    # model and a preset per family (SPEC 21). Every plan is checked before any work.
    names = [args.preset or "test"] if args.preset or args.model else list(cases.PRESETS)
    plans = [_suite_plan(args, name) for name in names]
    if any(accelerated.capabilities(name).defines for name in backends):
        print("note: the reference program replays the definition itself: checking it is a "
              "smoke check of the suite, not a conformance result\n")
    status = 0
    for name in backends:
        for precision in args.precision or list(PRECISIONS):
            for preset_name, batch, windows, inputs in plans:
                report = run_suite(name, preset_name, precision, batch=batch, steps=args.steps,
                                   windows=windows, inputs=inputs, accumulate=args.accumulate,
                                   schedule=args.schedule)
                _print(report, args.failures_only)
                status = status or (0 if report.passed else FAILED)
            if args.hypothesis:
                report = run_hypothesis(name, args.hypothesis, precision)
                _print(report, args.failures_only)
                status = status or (0 if report.passed else FAILED)
    return status


def _suite_plan(args, preset_name: str) -> tuple:
    """(preset name or Config, B, windows or None, inputs) of one suite run."""
    config = preset_config(preset_name)
    if args.model:  # run_suite takes the Config itself (reported as "custom")
        config, defaults = config_from_toml(args.model, config if args.preset else None)
        preset_name = config
    # with --accumulate K and no batch, the smallest batch K divides: K
    batch = args.batch or (defaults.get("batch", 1) if args.model else args.accumulate)
    if args.accumulate < 1 or batch % args.accumulate:
        raise ConfigError(f"--accumulate={args.accumulate}: must be a positive integer dividing "
                          f"--batch={batch}")
    check_plan(config, batch, args.steps)
    windows, inputs = None, None
    if args.stream:
        from ..reference.stream import open_stream

        stream = open_stream(args.stream, config.vocab)
        need, K = args.context + args.steps * batch, stream.n_contexts(config.context)
        if need > K:
            raise RunError(f"stream {args.stream}: --context {args.context} and --steps "
                           f"{args.steps} of --batch {batch} need {need} contexts, the stream "
                           f"holds {K}")
        windows = cases.stream_windows(stream, config, batch, args.steps, c0=args.context)
        inputs = f"stream {args.stream}, contexts from {args.context}"
    return preset_name, batch, windows, inputs


# ------------------------------------------------------------------ reference debugging

def _fields(identity: str, key: str, path) -> dict:
    """'a=1|b=2|flag' -> {'a': '1', 'b': '2'}; parts without '=' are dropped."""
    if not isinstance(identity, str):
        raise CheckpointError(f"checkpoint {path}: header key {key!r} is not a string")
    return dict(part.split("=", 1) for part in identity.split("|") if "=" in part)


def hyper_from_learner(learner: str, path) -> tuple:
    """The checkpoint's `learner` identity -> (Hyper, precision)."""
    f = _fields(learner, "learner", path)
    try:
        hyper = Hyper(**{k: f[k] for k in ("lr", "beta1", "beta2", "weight_decay", "epsilon")})
        precision = f["precision"]
    except KeyError as e:
        raise CheckpointError(f"checkpoint {path}: learner identity lacks field {e}") from None
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path}: learner identity: {e}") from None
    if precision not in PRECISIONS or hyper.identity(precision) != learner:
        raise CheckpointError(f"checkpoint {path}: learner identity {learner!r} is not one "
                              f"this version writes")
    return hyper, precision


def load_checkpoint(path, preset_name: str | None = None) -> tuple:
    """-> (config, hyper, precision, batch, state, header) of a checkpoint file.
    `preset_name`, when given, must name the checkpoint's model."""
    from ..reference.binding import state_from_source
    from ..reference.sources import CheckpointFileSource

    named = None if preset_name is None else preset_config(preset_name).identity()
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint {path}: no such checkpoint (missing or empty)")
    # The source validates the file (the SHA-256 pass over all of it) once;
    # the state is bound from that same source, not from a second validation.
    with CheckpointFileSource(path) as source:
        header = source.header
        config = config_from_identity(header["model"], where=f"checkpoint {path}")
        if named is not None and named != header["model"]:
            raise IdentityMismatch(f"checkpoint {path}: model identity differs from --preset "
                                   f"{preset_name}: checkpoint has {header['model']!r}, "
                                   f"--preset has {named!r}")
        hyper, precision = hyper_from_learner(header["learner"], path)
        try:
            batch = int(_fields(header["data"], "data", path)["batch"])
        except (KeyError, ValueError):
            raise CheckpointError(f"checkpoint {path}: data identity has no batch") from None
        state = state_from_source(source, config).state  # every parameter bound by name (SPEC 12)
    return config, hyper, precision, batch, state, header


def debug_checkpoint(args, backends: list) -> int:
    """One step from a real checkpoint on the reference and on each backend;
    every tensor's difference, worst first."""
    from ..reference.stream import open_stream

    if not args.stream:
        raise RunError("--checkpoint needs --stream (the token stream to take context --context from)")
    config, hyper, precision, batch, state, header = load_checkpoint(args.checkpoint, args.preset)
    if args.model:
        named = config_from_toml(args.model, preset_config(args.preset) if args.preset
                                 else None)[0]
        if named.identity() != header["model"]:
            raise IdentityMismatch(f"checkpoint {args.checkpoint}: model identity differs from "
                                   f"--model {args.model}: checkpoint has {header['model']!r}, "
                                   f"--model has {named.identity()!r}")
    batch = args.batch or batch
    check_plan(config, batch, 1)
    stream = open_stream(args.stream, config.vocab)
    tokens = stream.batch(args.context, batch, config.context)  # (B, T+1)
    precisions = args.precision or [precision]
    where = (f"checkpoint {args.checkpoint} (step {header.get('step')}), stream {args.stream} "
             f"context {args.context}")
    status = 0
    for name in backends:
        module = accelerated.backend_module(name)
        for prec in precisions:
            program = module.capture(config, hyper, prec, batch, state.copy())
            report = Report(name, "checkpoint", prec, batch, where)
            report.rows = step_rows(program, config, hyper, prec, state, tokens, report.notes)
            _print(report, args.failures_only, rows=report.sorted_by_error())
            status = status or (0 if report.passed else FAILED)
    return status


def debug_activations(args, backends: list) -> int:
    """Every intermediate of one step on each backend against the
    reference's, under one naming scheme; the first divergence named."""
    from ..reference.step import step_activations

    from .activations import activation_rows, first_divergence, layer_of

    if args.checkpoint:
        if not args.stream:
            raise RunError("--activations --checkpoint needs --stream (the token stream to take "
                           "context --context from)")
        config, hyper, precision, batch, state, header = load_checkpoint(args.checkpoint,
                                                                         args.preset)
        preset_name = f"of {args.checkpoint}"
        precisions = args.precision or [precision]
        where = f"checkpoint {args.checkpoint} (step {header.get('step')})"
    else:
        preset_name = args.preset or "test"
        config = preset_config(preset_name)
        hyper, batch, state = Hyper(), 1, cases.fresh_state(config)
        precisions = args.precision or list(PRECISIONS)
        where = "the initialization"
    batch = args.batch or batch
    if args.stream:
        from ..reference.stream import open_stream

        stream = open_stream(args.stream, config.vocab)
        tokens = stream.batch(args.context, batch, config.context)  # (B, T+1)
        where += f", stream {args.stream} context {args.context}"
    else:
        tokens = cases.random_windows(config, batch, 1)[0]
        where += f", a random window (seed {cases.TOKEN_SEED})"
    status = 0
    for name in backends:
        module = accelerated.backend_module(name)
        for prec in precisions:
            program = module.capture(config, hyper, prec, batch, state.copy())
            report = Report(name, preset_name, prec, batch, f"activations: {where}")
            want = step_activations(config, state.P, tokens, prec)
            report.rows = activation_rows(config, program.activations(tokens), want, prec)
            first = first_divergence(report.rows)
            report.notes.append(
                f"first divergence: {layer_of(first.tensor)}, {first.tensor} ({first.check}): "
                f"error {first.error:.3e} > {first.tolerance:.0e}" if first else
                "no divergence: every intermediate is within its tolerance")
            _print(report, args.failures_only)
            status = status or (0 if report.passed else FAILED)
    return status


def main(argv=None) -> int:
    """`python -m coppelius.conformance`: the same options as `coppelius conformance`."""
    import sys

    from ..reference.errors import CoppeliusError

    parser = argparse.ArgumentParser(prog="python -m coppelius.conformance",
                                     description="Check backends against the reference (SPEC 14).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CoppeliusError as e:
        print(f"conformance: error: {e}", file=sys.stderr)
        return e.exit_status
