"""`coppelius eval`: the held-out loss of a checkpoint (SPEC section 18).

The checkpoint's identities say everything the evaluation needs: the model,
the policy (learner identity), the batch and how many contexts the run held
out (data identity, `heldout=K`). The stream is the run's (run.json beside
the checkpoint; a run's --eval-source or --eval-stream: that set's first K
contexts, SPEC 22) unless --stream names another (any stream or shard form).
A run's source is encoded as the run encoded it: with its tokenizer (train
--tokenizer, remembered in run.json, or eval --tokenizer naming the same
one), its separator and its records' field. A run.json is trusted only
where it is the run of this checkpoint, and the stream it names only where
its digest is the one the checkpoint's data identity holds; the embedded
corpus is prepared with a note. The loss is computed by a backend's
forward-only evaluation program, B contexts at a time, exactly as training
evaluates: each context's mean row loss in float64, then their mean.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from coppelius import accelerated
from coppelius.reference.config import Hyper, config_from_identity
from coppelius.reference.errors import NonFiniteError, RunError
from coppelius.reference.fsutil import path_argument
from coppelius.shards import open_any as open_stream


def register(sub) -> None:
    p = sub.add_parser("eval", help="held-out loss and perplexity of a checkpoint",
                       description="Evaluate CHECKPOINT on the last K contexts of a stream "
                                   "(by default the run's own stream and held-out count) and "
                                   "print the mean loss and its perplexity (SPEC §18).")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint, or a run directory (its run's checkpoint, as report takes)")
    p.add_argument("--stream", metavar="STREAM",
                   help="a token stream, shard, or folder or glob of shards (default: the "
                        "run's, from run.json beside the checkpoint)")
    p.add_argument("--tokenizer", metavar="PATH", type=path_argument,
                   help="the tokenizer (a tokenizer.json, or a Hugging Face directory holding "
                        "one) that encodes the run's source, as train --tokenizer did; it must "
                        "be the checkpoint's (default: the run's own, from run.json; SPEC §22)")
    p.add_argument("--contexts", type=int, metavar="K",
                   help="evaluate the stream's last K contexts (default: the run's held-out K; a "
                        "run's --eval-source or --eval-stream: its first K)")
    p.add_argument("--backend", choices=sorted(accelerated.BACKENDS),
                   help="backend (default: the best available)")
    p.set_defaults(func=main)


def held_out_losses(program, stream, T: int, K: int, first: int | None = None) -> np.ndarray:
    """(K,) float32: the mean row loss of each of the stream's last K
    contexts (or K from context `first`: an eval stream's first K, SPEC 22),
    from the program's forward-only evaluation, B contexts at a time
    (SPEC 18). The last group is filled up with its last context, whose extra
    rows are dropped: the evaluation keeps its one captured shape. Each
    context's mean is taken in float64 and rounded once."""
    B = program.batch
    first = stream.n_contexts(T) - K if first is None else first
    out = []
    for start in range(0, K, B):
        index = np.arange(first + start, first + min(start + B, K))  # (b,) b <= B
        padded = np.concatenate([index, np.full(B - len(index), index[-1])])  # (B,)
        rows = program.evaluate(stream.contexts(padded, T))  # (B, T)
        out.append(rows[:len(index)].astype(np.float64).mean(axis=1))
    return np.concatenate(out).astype(np.float32)


def check_checkpoints_tokenizer(tokenizer, header: dict, path) -> None:
    """Refuse an eval --tokenizer that is not the one the checkpoint was
    trained with (its data identity's `tokenizer` part, SPEC 22): its ids
    would mean other text to the model."""
    from coppelius.tokenizer import tokenizer_file, tokenizer_sha

    want = _part(header["data"], "tokenizer")
    got = tokenizer_sha(tokenizer_file(tokenizer))
    if want is not None and got != want:
        theirs = "none" if want == "none" else f"{want[:12]}..."
        raise RunError(f"--tokenizer {tokenizer}: is not checkpoint {path}'s tokenizer (its "
                       f"SHA-256 {got[:12]}..., the checkpoint's {theirs})")


def _part(identity: str, key: str):
    for part in identity.split("|"):
        name, _, value = part.partition("=")
        if name == key:
            return value
    return None


def run_stream(path, run_dir, vocab: int, tokenizer: str | None = None) -> tuple:
    """(stream path, first, run options) of the run that trained the
    checkpoint `path`, from the run.json of its run directory (given, or the
    checkpoint's folder): refused where there is none, or where it is
    another run's (it names another checkpoint). `first`: 0 for the run's
    --eval-source or --eval-stream (its first K contexts), else None. The
    embedded corpus is prepared with a note (it may be tokenized now). The
    run's source is encoded as the run encoded it: its tokenizer (or
    `tokenizer`, eval --tokenizer, checked against the checkpoint already),
    separator and records' field."""
    from coppelius import data
    from coppelius.run_file import RUN_FILE, data_of, read_run_file, remembered_checkpoint

    run_dir = run_dir or os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(run_dir, RUN_FILE)):
        raise RunError(f"checkpoint {path}: no run.json beside it names the run's stream "
                       "(pass --stream)")
    options = read_run_file(run_dir)
    theirs = remembered_checkpoint(run_dir, options)
    if os.path.realpath(theirs) != os.path.realpath(path):
        raise RunError(f"checkpoint {path}: {os.path.join(run_dir, RUN_FILE)} is the run of "
                       f"{theirs}, not of this checkpoint (pass --stream)")
    if options.get("eval_stream"):
        return options["eval_stream"], 0, options
    kind, _ = data_of(options)
    if kind == "embedded":
        print("note: the run trained on the embedded corpus (the standard library): its stream "
              "is read from the stream cache, tokenized first if it is not there "
              "(--stream names one)", file=sys.stderr, flush=True)
    given = tokenizer or (options.get("tokenizer") if options.get("stream") is None else None)
    stream_path, tokenizer = data.prepare_stream(
        source=options.get("source"), stream=options.get("stream"), vocab=vocab,
        tokenizer=given, eos=options.get("eos"), text_field=options.get("text_field"))
    if options.get("eval_source"):
        stream_path, _ = data.prepare_stream(source=options["eval_source"], vocab=vocab,
                                             tokenizer=tokenizer)
        return stream_path, 0, options
    return stream_path, None, options


def check_stream(path, header: dict, stream, part: str) -> None:
    """The stream a run.json names must be the one the checkpoint's data
    identity names (its `stream=`, or `eval=` for a validation set): the
    data may have changed since, or the run gone on with --new-data."""
    want = _part(header.get("data", ""), part)
    if want is not None and stream.sha256 != want:
        raise RunError(f"checkpoint {path}: the {'validation ' if part == 'eval' else ''}stream "
                       f"{stream.path} of its run.json is not the one it was trained on (digest "
                       f"{stream.sha256[:16]}, the checkpoint's {want[:16]}); pass --stream")


def main(args) -> int:
    from coppelius.reference.binding import state_from_source
    from coppelius.reference.sources import CheckpointFileSource
    from coppelius.run_file import RUN_FILE, read_run_file

    path, run_dir = args.checkpoint, None
    if os.path.isdir(path):  # a run directory, as `report` takes: its run's checkpoint
        run_dir = path
        remembered = read_run_file(run_dir) if os.path.isfile(os.path.join(run_dir, RUN_FILE)) \
            else {}
        path = remembered.get("checkpoint") or os.path.join(run_dir, "checkpoint.bin")
        if not os.path.exists(path):
            raise RunError(f"run directory {run_dir}: holds no checkpoint ({path} is missing)")
    with CheckpointFileSource(path) as source:  # validated once, then bound by name
        header = source.header
        config = config_from_identity(header["model"], f"checkpoint {path}")
        state = state_from_source(source, config).state
    first = None  # the stream's last K contexts; an eval stream's first K (SPEC 22)
    if args.tokenizer is not None:
        if args.stream:
            raise RunError(f"--tokenizer {args.tokenizer}: encodes the run's source; a --stream "
                           f"is encoded already (its tokenizer is the tokenizer.json beside it)")
        check_checkpoints_tokenizer(args.tokenizer, header, path)
    checked = False  # the stream found in run.json: compared with the checkpoint's data identity
    if args.stream:
        stream_path = args.stream
    else:
        stream_path, first, options = run_stream(path, run_dir, config.vocab, args.tokenizer)
        checked = True
    stream = open_stream(stream_path, config.vocab)
    if checked:
        check_stream(path, header, stream, "eval" if first == 0 else "stream")
    K_stream = stream.n_contexts(config.context)
    K = args.contexts if args.contexts is not None else int(_part(header["data"], "heldout") or 0)
    if first == 0 and args.contexts is None:
        K = options.get("eval_contexts") or min(64, K_stream)  # plan.eval_count's rule
    if not 0 < K <= K_stream:
        raise RunError(f"--contexts={K}: the stream {stream_path} holds {K_stream} contexts; "
                       f"evaluate from 1 to {K_stream}")
    precision = _part(header["learner"], "precision")
    batch = int(_part(header["data"], "batch") or 1)
    backend = args.backend or accelerated.best_backend()
    program = accelerated.backend_module(backend).capture(config, Hyper(), precision, batch, state)
    losses = held_out_losses(program, stream, config.context, K, first)
    if not np.isfinite(losses).all():  # SPEC 9: a non-finite loss is status 3, as in training
        bad = int(np.flatnonzero(~np.isfinite(losses))[0])
        raise NonFiniteError(f"checkpoint {path}: the loss of held-out context {bad} of {K} "
                             f"({stream_path}) is {losses[bad]}; the checkpoint does not "
                             f"evaluate to a finite loss")
    mean = float(losses.astype(np.float64).mean())
    print(f"{path}: step {header['step']}, the {'first' if first == 0 else 'last'} {K} of "
          f"{K_stream} contexts of "
          f"{stream_path}, backend {backend}, {precision}")
    print(f"held-out loss {mean:.4f}, perplexity {math.exp(min(mean, 700)):,.2f}")
    return 0
