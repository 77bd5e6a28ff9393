"""The plan of `coppelius train` (SPEC section 9): the options resolved
against the run directory's run.json, the model, learner and data chosen
and checked, and everything a run decides before its first step
(make_plan), with the checkpoint's loading and the hints of a refusal.
coppelius/train.py runs the plan."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass

from coppelius import accelerated
from coppelius.reference import checkpoint, fsutil, limits
from coppelius.reference.binding import load_state
from coppelius.reference.config import (PRESETS, SEED, Hyper, check_implemented,
                                        check_precision, config_from_identity, config_from_toml,
                                        parse_rational, preset)
from coppelius.reference.contract import recompute_mode
from coppelius.reference.errors import IdentityMismatch, RunError
from coppelius.reference.params import initialize
from coppelius.reference.state import State
from coppelius.shards import open_any as open_stream
from coppelius.run_file import (REMEMBERED, RUN_FILE, RUN_OPTIONS, acquire_run_lock, data_of,
                                 other_run, read_run_file, remembered_checkpoint, run_lock)

LEARNER_OPTIONS = ("lr", "beta1", "beta2", "weight_decay", "epsilon")
MAX_STEP = 2**62  # step numbers are uint64 in the result file; keep far from the edge
EVAL_CONTEXTS = 64  # SPEC 18's default held-out count (fewer on a short stream)


@dataclass
class Plan:
    """Everything decided before the first step."""

    config: object
    backend: str
    precision: str
    hyper: Hyper
    batch: int
    steps: int
    interval: int
    run_dir: str
    checkpoint: str
    results: str | None
    repeat: bool
    stream: object
    tokenizer: str | None
    identities: dict
    state: State
    contexts: int  # consumed before this invocation (c0)
    default_data: bool
    heldout: int = 0  # K: the stream's last K contexts, held out (SPEC 18)
    eval_stream: object = None  # --eval-source/--eval-stream: its first `evaluate` contexts
    evaluate: int = 0  # K evaluated: the held-out count, or the eval stream's first K (SPEC 22)
    eval_every: int = 0  # E: evaluate every E steps (0 never) and after the last
    remembered: dict | None = None  # what run.json will hold (run_file.RUN_OPTIONS, SETTINGS)
    options: dict | None = None  # this invocation's options: the command line over run.json
    final_step: int = 0  # the step this invocation trains to
    recompute: str | None = None  # reference/contract.py RECOMPUTE_MODES, None: off
    shard_optimizer: bool = False  # with W > 1 ranks, M and V sharded over them (SPEC 23)
    model_source: str = ""  # the preset's name, the model file, or the checkpoint it came from


def _positive(value, name):
    if value is not None and (value <= 0 or value >= MAX_STEP):
        raise RunError(f"--{name}={value}: must be a positive integer below 2^62")
    return value


def _nonnegative(value, name):
    if value is not None and not 0 <= value < MAX_STEP:
        raise RunError(f"--{name}={value}: must be an integer in [0, 2^62)")
    return value


PATH_OPTIONS = ("source", "stream", "checkpoint", "model", "tokenizer", "eval_source",
                "eval_stream")


def given_options(args) -> dict:
    """The remembered options the command line gives (paths absolute)."""
    given = {}
    for key in REMEMBERED:
        value = getattr(args, key, None)
        if key == "repeat_data":
            value = True if args.repeat_data else None
        if value is not None and (key in PATH_OPTIONS or (key == "tensorboard"
                                                          and isinstance(value, str))):
            value = os.path.abspath(value)
        if value is not None:
            given[key] = value
    return given


def _given_data(given: dict) -> tuple | None:
    return data_of(given) if given.get("source") or given.get("stream") else None


def _own_name(given: dict, differs: str) -> str:
    """The name of a run's own directory beside the default one: its
    checkpoint's stem when the checkpoint is what differs, else its data's."""
    if differs == "checkpoint":
        path = given["checkpoint"]
    else:
        path = _given_data(given)[1]
    stem = os.path.basename(os.path.normpath(path))
    for suffix in (".gz", ".zst", ".jsonl", ".parquet", ".bin", ".tokens", ".txt"):
        if stem.endswith(suffix) and stem != suffix:
            stem = stem[:-len(suffix)]
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem).strip("-.")
    return stem or "run"


def choose_run_dir(args, given: dict) -> tuple:
    """(run_dir, remembered, note): the run directory of this run and what its
    run.json remembers (SPEC 9: a directory belongs to one run). --run-dir
    as given; else runs/<name>, or, when that directory holds another run
    (another checkpoint, or data the command line names otherwise),
    runs/<name>-<this run's checkpoint or data>. A run that names other data
    than the directory's run is that run only with --new-data (continuing
    its checkpoint on the new data); one naming another checkpoint never is.
    A refusal names --run-dir."""
    if args.model:
        default_name = os.path.splitext(os.path.basename(args.model))[0]
    elif args.preset is None and args.checkpoint is not None:  # the checkpoint's model, below
        default_name = os.path.splitext(os.path.basename(args.checkpoint))[0]
    else:
        default_name = args.preset or default_preset()
    data = None if args.new_data else _given_data(given)
    checkpoint = given.get("checkpoint")
    run_dir = args.run_dir or os.path.join("runs", default_name)
    remembered = read_run_file(run_dir)
    differs = other_run(run_dir, remembered, checkpoint, data)
    if differs is None:
        return run_dir, remembered, None
    if args.run_dir:
        raise RunError(refusal(run_dir, differs, given))
    own = os.path.join("runs", f"{default_name}-{_own_name(given, differs[0])}")
    theirs = read_run_file(own)
    if other_run(own, theirs, checkpoint or os.path.abspath(os.path.join(own, "checkpoint.bin")),
                 data) is not None:
        raise RunError(f"{run_dir} and {own} hold other runs (their run.json); give this run a "
                       f"--run-dir of its own")
    return own, theirs, (f"note: {run_dir} holds the run of {differs[1]}; this run's "
                         f"directory is {own}")


def refusal(run_dir, differs: tuple, given: dict) -> str:
    """Why an explicit --run-dir is refused to a run that is not its run's,
    with what would work: a --run-dir of its own, and where the run's
    checkpoint could go on with the new data, the options that do so."""
    text = (f"run directory {run_dir} holds the run of {differs[1]} ({run_dir}/run.json); give "
            f"this run a --run-dir of its own")
    if differs[0] == "checkpoint":
        return text
    go_on = continue_options(run_dir, given)
    if go_on:
        text += f", or pass {go_on} to go on with that run's checkpoint on this data"
    return text


def continue_options(run_dir, given: dict) -> str | None:
    """The options with which the run in `run_dir` goes on with the data
    the command line names: --new-data, and --tokenizer with the run's own
    tokenizer when the new data is a source and the checkpoint has one;
    None where nothing would (a stream of another tokenizer)."""
    from coppelius import shards
    from coppelius.tokenizer import TOKENIZER_NAME, tokenizer_sha

    remembered = read_run_file(run_dir)
    ckpt = remembered_checkpoint(run_dir, remembered)
    if checkpoint.is_fresh(ckpt):
        return "--new-data"
    have = _part(checkpoint.validate(ckpt).header.get("data", ""), "tokenizer") or "none"
    if given.get("stream"):
        place = shards.tokenizer_place(given["stream"])
        theirs = tokenizer_sha(place) if os.path.lexists(place) else None
        return "--new-data" if (theirs or "none") == have else None
    if have == "none":
        return None  # a source is tokenized; the checkpoint's stream had no tokenizer
    if given.get("tokenizer"):
        return "--new-data"
    for place in (os.path.join(os.path.dirname(ckpt), TOKENIZER_NAME),
                  remembered.get("tokenizer")):
        if place and os.path.isfile(place) and tokenizer_sha(place) == have:
            return f"--new-data --tokenizer {place}"
    return None


def _part(identity: str, key: str):
    for part in str(identity).split("|"):
        name, _, value = part.partition("=")
        if name == key:
            return value
    return None


def resolve_options(args) -> tuple:
    """(run_dir, options, remembered, note): the options of this invocation
    (the command line over run.json over nothing) and what run.json is to
    remember after it (run_file.RUN_OPTIONS whenever given; the SETTINGS
    only when given without --steps; `final_step` only from --until). Paths
    are remembered absolute, so a run continues from any directory."""
    given = given_options(args)
    run_dir, remembered, note = choose_run_dir(args, given)
    options = dict(remembered)
    keep = dict(remembered)
    for key, value in given.items():
        options[key] = value
        if key in RUN_OPTIONS or args.steps is None:
            keep[key] = value
    options.pop("final_step", None)  # make_plan's: --steps, --until, else this
    if args.until is not None:
        keep["final_step"] = args.until
    for d in (options, keep):
        # the constant schedule has no warm-up, total or floor to remember, and
        # only wsd has a decay
        if args.schedule == "constant":
            for key in ("warmup", "total", "floor"):
                if getattr(args, key) is None:
                    d.pop(key, None)
        if args.schedule is not None and args.schedule != "wsd" and args.decay is None:
            d.pop("decay", None)
        # a new source replaces a remembered stream, and the other way round
        if args.source is not None:
            d.pop("stream", None)
        if args.stream is not None:
            d.pop("source", None)
        if getattr(args, "eval_source", None) is not None:
            d.pop("eval_stream", None)
        if getattr(args, "eval_stream", None) is not None:
            d.pop("eval_source", None)
            if getattr(args, "tokenizer", None) is None:  # a stream's tokenizer lies beside it
                d.pop("tokenizer", None)
    return run_dir, options, keep, note


def choose_model(options: dict, ckpt: str, name: str) -> tuple:
    """(Config, run defaults, where the model comes from) of a run: --model
    FILE over --preset (SPEC 17); with neither, the model of the checkpoint
    it resumes (its model identity: an imported one is fine-tuned as it is),
    else the default preset `name`."""
    if options.get("model"):  # SPEC 17: the file's fields over the preset's, if one is named
        config, defaults = config_from_toml(options["model"], preset(name) if options.get("preset")
                                            else None)
        return config, defaults, options["model"]
    if not options.get("preset") and not checkpoint.is_fresh(ckpt):
        header = checkpoint.validate(ckpt).header
        return config_from_identity(header["model"], f"checkpoint {ckpt}"), {}, ckpt
    return preset(name), {}, name


def default_decay(warmup: int, total: int) -> int:
    """--decay's default under wsd: the last fifth of the updates after the
    warm-up, at least one."""
    return max(1, (total - warmup) // 5)


def make_learner(options: dict, final_step: int) -> Hyper:
    kwargs = {k: parse_rational(options[k], k.replace("_", "-"))
              for k in LEARNER_OPTIONS if k in options}
    schedule = options.get("schedule", "constant")
    if schedule in ("cosine", "wsd"):
        kwargs.update(schedule=schedule, warmup=_nonnegative(options.get("warmup", 0), "warmup"),
                      total=_positive(options.get("total", final_step), "total"),
                      floor=parse_rational(options.get("floor", "0"), "floor"))
    elif any(k in options for k in ("warmup", "total", "floor")):
        raise RunError("--warmup, --total and --floor belong to the cosine and wsd schedules "
                       "(add --schedule cosine or --schedule wsd)")
    if schedule == "wsd":
        kwargs["decay"] = _positive(options.get("decay", default_decay(kwargs["warmup"],
                                                                        kwargs["total"])), "decay")
    elif "decay" in options:
        raise RunError("--decay belongs to the wsd schedule (add --schedule wsd)")
    if options.get("clip") is not None:
        kwargs["clip"] = parse_rational(options["clip"], "clip")
    if options.get("accumulate") is not None:
        kwargs["accumulate"] = options["accumulate"]
    return Hyper(**kwargs)


def heldout_count(options: dict, K_stream: int, path) -> int:
    """SPEC 18: --eval-contexts, else 64 or a tenth of the stream, none below 10."""
    K = options.get("eval_contexts")
    if K is None:
        return 0 if K_stream < 10 else min(EVAL_CONTEXTS, K_stream // 10)
    if not 0 <= K < K_stream:
        raise RunError(f"--eval-contexts={K}: the stream {path} holds {K_stream} contexts; "
                       f"hold out from 0 to {K_stream - 1}")
    return K


def eval_count(options: dict, K_eval: int, path) -> int:
    """SPEC 22: the eval stream's first K contexts, --eval-contexts or 64, all
    of them when it holds fewer."""
    K = options.get("eval_contexts")
    if K is None:
        K = min(EVAL_CONTEXTS, K_eval)
    if not 0 < K <= K_eval:
        raise RunError(f"--eval-contexts={K}: the eval stream {path} holds {K_eval} contexts; "
                       f"evaluate from 1 to {K_eval}")
    return K


def open_eval_stream(options: dict, vocab: int, tokenizer, leader: dict | None):
    """The validation set (SPEC 22): --eval-stream as it is, or --eval-source
    tokenized with the run's tokenizer (rank 0 prepares it; the others read
    the stream it names in `leader`)."""
    from coppelius import data

    if leader is not None and leader.get("eval_stream"):
        path = leader["eval_stream"]
    elif options.get("eval_stream"):
        path = options["eval_stream"]
        data.prepare_stream(stream=path, vocab=vocab)  # a missing path is named as one
    else:
        if tokenizer is None:
            raise RunError(f"--eval-source {options['eval_source']}: the run has no tokenizer "
                           f"to encode it with (its stream has no tokenizer.json beside it; pass "
                           f"--eval-stream)")
        path, _ = data.prepare_stream(source=options["eval_source"], vocab=vocab,
                                      tokenizer=tokenizer)
    return open_stream(path, vocab)


def check_gpus(backend: str, world: int) -> None:
    """SPEC 19: data parallelism is the CUDA backend's; MLX and the
    reference have one device."""
    if world > 1 and not accelerated.capabilities(backend).data_parallel:
        raise RunError(f"--gpus {world}: backend {backend} has one device; data parallelism "
                       f"runs on the {' and '.join(accelerated.data_parallel_backends())} "
                       f"backend")


def make_plan(args, resources: contextlib.ExitStack, world: int = 1, rank: int = 0,
              leader: dict | None = None) -> Plan:
    """Everything decided and checked before the first step. What the run
    holds (the checkpoint's lock, the open stream) is left to `resources`.
    With W = world ranks (SPEC 19), a rank > 0 makes its own plan from its
    own options and files but writes nothing and locks nothing: it reads
    the stream rank 0 prepared (`leader`, rank 0's plan_summary)."""
    from coppelius import data  # tokenizers is imported only when a run needs it
    from coppelius.tokenizer import check_tokenizer, tokenizer_sha

    writes = rank == 0
    # folders this plan makes, removed at the end when still empty (a run
    # refused, or out of memory, before its first step leaves none behind);
    # registered first, so it runs after the locks inside them are let go
    made = []
    resources.callback(remove_empty, made)
    run_dir, options, keep, note = resolve_options(args)
    # The run directory is locked before its run.json is trusted (or, when
    # the folder does not exist yet, as soon as it is made), and stays
    # locked until the run ends: a second run there is refused at once.
    dir_lock = run_lock(run_dir)
    resources.callback(dir_lock.release)
    if writes and os.path.isdir(run_dir):
        acquire_run_lock(dir_lock, run_dir)
        if resolve_options(args)[:3] != (run_dir, options, keep):
            raise RunError(f"run directory {run_dir}: another run wrote its {RUN_FILE} while "
                           f"this one started; start this one again")
    if writes and note:
        print_safely(note)
    backend = options.get("backend") or accelerated.best_backend()
    check_gpus(backend, world)
    module = accelerated.backend_module(backend)  # a clear error when it is not available here
    name = options.get("preset") or default_preset()
    if name not in PRESETS:
        raise RunError(f"preset {name!r}: unknown (choose from {', '.join(sorted(PRESETS))})")
    ckpt = options.get("checkpoint") or os.path.join(run_dir, "checkpoint.bin")
    fsutil.output_target(ckpt, "checkpoint")  # a FIFO or a device is refused, not replaced
    config, defaults, model_source = choose_model(options, ckpt, name)
    # a family field (SPEC 21) the backend does not compute: refused before anything is written
    check_implemented(config, getattr(module, "IMPLEMENTED", ()), backend)
    can = accelerated.capabilities(backend)
    precision = check_precision(options.get("precision") or can.default_precision)
    batch = _positive(options.get("batch", defaults.get("batch", 1)), "batch")
    accumulate = _positive(options.get("accumulate", 1), "accumulate")
    if batch % accumulate:
        raise RunError(f"--accumulate={accumulate}: must divide --batch={batch} (micro-batches of "
                       f"B/K contexts)")
    if batch % (world * accumulate):
        raise RunError(f"--batch={batch}: must divide by {world} GPUs x --accumulate "
                       f"{accumulate} (each GPU takes B/{world} contexts per step; SPEC §19)")
    interval = _positive(options.get("interval"), "interval") or config.interval
    eval_every = _nonnegative(options.get("eval_every"), "eval-every")
    eval_every = interval if eval_every is None else eval_every
    seed = options.get("seed", SEED)
    if not 0 <= seed < 2**64:
        raise RunError(f"--seed={seed}: must be in [0, 2^64)")
    _positive(args.steps, "steps")
    _nonnegative(args.until, "until")
    limits.check_step_fits(config, batch // (accumulate * world), can.host_data, model_source)
    if args.results and fsutil.same_file(args.results, ckpt):
        raise RunError(f"--results {args.results}: is the checkpoint path too")
    if writes and args.results and os.path.lexists(args.results):
        raise RunError(f"result file {args.results}: already exists (a run never overwrites one)")
    if args.results:
        fsutil.output_target(args.results, "result file")

    if writes:
        stream_path, tokenizer = data.prepare_stream(
            source=options.get("source"), stream=options.get("stream"),
            vocab=config.vocab, tokenizer=options.get("tokenizer"), eos=options.get("eos"),
            text_field=options.get("text_field"))  # in the user's stream cache
    else:  # the stream rank 0 prepared: its digest is compared through the data identity
        stream_path, tokenizer = leader["stream"], leader["tokenizer"]
    stream = open_stream(stream_path, config.vocab)
    resources.callback(stream.close)
    if tokenizer:
        check_tokenizer(tokenizer, config.vocab)  # ids below V: not found bad after training
    K_stream = stream.n_contexts(config.context)
    if K_stream == 0:
        raise RunError(f"stream {stream_path}: holds no context of {config.context + 1} tokens")
    eval_stream = None
    if options.get("eval_source") or options.get("eval_stream"):
        eval_stream = open_eval_stream(options, config.vocab, tokenizer, leader)
        resources.callback(eval_stream.close)
        heldout = 0  # SPEC 22: the validation set is held out, none of the training stream
        evaluate = eval_count(options, eval_stream.n_contexts(config.context), eval_stream.path)
    else:
        heldout = evaluate = heldout_count(options, K_stream, stream_path)
    # The checkpoint is locked before it is read (or, when its folder does
    # not exist yet, as soon as the folder is made: a refused plan leaves no
    # folder), and stays locked until the run ends: no other run publishes
    # it between this run's reading and its publishing.
    lock = fsutil.Lock(ckpt, "checkpoint")
    resources.callback(lock.release)
    if writes and os.path.isdir(os.path.dirname(lock.path)):
        lock.acquire()
    t0 = 0
    if not checkpoint.is_fresh(ckpt):
        t0 = checkpoint.validate(ckpt).header["step"]  # the update count decides the steps

    # How far (SPEC 9): --steps S more (this time only), else the run's final step
    # (--until's, remembered: keep's), else the model's step count (the
    # preset's or the model file's `steps`, read again each time).
    if args.steps is not None:
        final_step = t0 + args.steps
    else:
        final_step = keep.get("final_step", config.steps)
    options["final_step"] = final_step
    if options.get("schedule") in ("cosine", "wsd"):
        # the schedule's end is part of the learner: fixed when the run starts,
        # remembered, and not moved by a later --until (that needs --new-learner)
        options.setdefault("total", final_step)
        keep.setdefault("total", options["total"])
    hyper = make_learner(options, final_step)
    if hyper.schedule == "wsd":
        # and so is wsd's decay length: a later --total moves the decay, keeping its length
        options.setdefault("decay", hyper.decay)
        keep.setdefault("decay", options["decay"])
    ids = checkpoint.identities(config, hyper, precision, batch, tokenizer_sha(tokenizer),
                                stream.sha256, seed, heldout,
                                None if eval_stream is None else eval_stream.sha256)
    if checkpoint.is_fresh(ckpt):
        state, c0 = State.fresh(initialize(config, seed)), 0
    else:
        state, c0 = load_checkpoint(ckpt, config, ids, args.new_data, args.new_learner, options)
    steps = max(final_step - state.t, 0)

    default_data = options.get("source") is None and options.get("stream") is None
    repeat = bool(options.get("repeat_data"))
    K = K_stream - heldout  # contexts training may read
    need = c0 + steps * batch
    if need > K and not repeat:
        if not default_data:
            raise RunError(f"stream {stream_path}: the run needs {need} contexts but the stream "
                           f"holds {K} for training ({heldout} held out; use --repeat-data to "
                           f"cycle it)")
        repeat = True
        if writes:
            print_safely(f"note: the embedded corpus holds {K} contexts for training and this "
                         f"run needs {need}: repeating data (context c is read as c mod {K})")
    if steps and writes:
        from coppelius import metrics

        metrics.check_peak(options.get("peak_tflops"))  # a value refused before a folder is made
        # outputs: found unwritable now, not after the first interval of training
        tb_dir = metrics.tensorboard_dir(options, run_dir)
        for directory in (run_dir, os.path.dirname(os.path.abspath(ckpt)),
                          os.path.dirname(os.path.abspath(args.results or ckpt)), tb_dir):
            if directory is not None:
                made.extend(new_folders(directory))
        for directory in {run_dir, os.path.dirname(os.path.abspath(ckpt)),
                          os.path.dirname(os.path.abspath(args.results or ckpt))}:
            writable_directory(directory)
        metrics.check_writers(options, run_dir)  # TensorBoard's directory, the wandb package
        if not dir_lock.held:
            acquire_run_lock(dir_lock, run_dir)
            if os.path.lexists(os.path.join(run_dir, RUN_FILE)):  # none when the plan began
                raise RunError(f"run directory {run_dir}: another run wrote its {RUN_FILE} "
                               f"while this one started; start this one again")
        if not lock.held:
            lock.acquire()
            if not checkpoint.is_fresh(ckpt):
                raise RunError(f"checkpoint {ckpt}: another run published it while this one "
                               f"started; start this one again")
        fsutil.remove_stale(ckpt)  # temporaries of a run killed while it published
    return Plan(config=config, backend=backend, precision=precision, hyper=hyper, batch=batch,
                steps=steps, interval=interval, run_dir=run_dir, checkpoint=ckpt,
                results=args.results, repeat=repeat, stream=stream, tokenizer=tokenizer,
                identities=ids, state=state, contexts=c0, default_data=default_data,
                heldout=heldout, eval_every=eval_every, remembered=keep, options=options,
                final_step=final_step,
                eval_stream=eval_stream, evaluate=evaluate,
                recompute=recompute_mode(options.get("recompute")), model_source=model_source,
                shard_optimizer=bool(options.get("shard_optimizer", False)))


def new_folders(directory) -> list:
    """`directory` and those of its parents that do not exist yet, deepest first."""
    out, path = [], os.path.abspath(directory)
    while not os.path.lexists(path) and path != os.path.dirname(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def remove_empty(folders: list) -> None:
    """Remove each of `folders` that is empty, deepest first: the folders a
    plan made, for a run that wrote nothing in them."""
    for folder in sorted(set(folders), key=len, reverse=True):
        try:
            os.rmdir(folder)
        except OSError:
            pass


def writable_directory(directory) -> None:
    """Create `directory` if needed and prove a file can be published in it."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".coppelius-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RunError(f"{directory}: cannot write there ({e.strerror or e})") from None


def publish_tokenizer(tokenizer, checkpoint_path) -> None:
    """Keep the stream's tokenizer.json beside the checkpoint (where `coppelius
    sample` looks first) when nothing is there yet. A file already there is
    never replaced: an identical one is this run's already, any other one
    (another run's tokenizer, a checkpoint named tokenizer.json) is not this
    run's to replace; `sample` then finds the tokenizer by its digest in the
    stream cache, or is given it with --tokenizer."""
    if not tokenizer:
        return
    target = os.path.join(os.path.dirname(os.path.abspath(checkpoint_path)), "tokenizer.json")
    if fsutil.same_file(tokenizer, target) or fsutil.same_file(checkpoint_path, target):
        return
    try:
        with fsutil.open_regular(tokenizer) as f:
            body = f.read()
        fsutil.publish(target, lambda f: f.write(body), replace=False)
    except FileExistsError:
        try:
            with fsutil.open_regular(target) as f:
                same = f.read(len(body) + 1) == body
        except OSError:
            same = False
        if not same:
            print(f"note: {target} is another file; left as it is (`coppelius sample` finds "
                  f"this run's tokenizer by its digest)", file=sys.stderr)
    except OSError as e:
        raise RunError(f"{target}: cannot publish the tokenizer ({e.strerror or e})") from None


def load_checkpoint(path, config, identities, new_data=False, new_learner=False,
                    options: dict | None = None):
    """-> (State, contexts consumed): validated, identities compared, every
    parameter bound by name through the binding layer (SPEC 12). A refused
    identity says which option to repeat (`options`: the run's, for the
    hints that name its data)."""
    try:
        ck = load_state(path, config, expect=identities, new_data=new_data,
                        new_learner=new_learner)
    except IdentityMismatch as e:
        lifted = {"data": new_data, "learner": new_learner}
        hint = identity_hint(checkpoint.validate(path).header, identities, lifted,
                             dict(options or {}, checkpoint=os.path.abspath(path),
                                  new_data=new_data))
        raise IdentityMismatch(f"{e}{'; ' + hint if hint else ''}") from None
    return ck.state, ck.contexts


# identity part -> the option that sets it (SPEC 10's identities, SPEC 7, 18)
_OPTION_OF = {"batch": "--batch", "precision": "--precision", "lr": "--lr", "beta1": "--beta1",
              "beta2": "--beta2", "weight_decay": "--weight-decay", "epsilon": "--epsilon",
              "clip": "--clip", "heldout": "--eval-contexts",
              "eval": "--eval-source or --eval-stream", "seed": "--seed",
              "accumulate": "--accumulate"}


def identity_hint(header: dict, run: dict, lifted: dict | None = None,
                  options: dict | None = None) -> str:
    """'the checkpoint was trained with --batch 4', naming every option whose
    value differs between the checkpoint's identities and the run's, but
    the parts that --new-data and --new-learner lift where given (`lifted`:
    identity key -> whether its parts are lifted). `options`: the run's
    options (its data, its checkpoint), for hints with the real paths."""
    said = []
    for key in ("learner", "data", "initialization", "model"):
        have = dict(part.partition("=")[::2] for part in str(header.get(key, "")).split("|"))
        want = dict(part.partition("=")[::2] for part in str(run[key]).split("|"))
        if (lifted or {}).get(key):
            for part in checkpoint.LIFTED[key]:
                have.pop(part.rstrip("="), None)
                want.pop(part.rstrip("="), None)
        if key == "model" and have != want:
            name = next((n for n, c in PRESETS.items() if c.identity() == header[key]), None)
            said.append(f"--preset {name}" if name else "another model shape")
            continue
        for part in sorted(set(have) | set(want)):
            if have.get(part) == want.get(part):
                continue
            if part == "schedule":
                said.append(_schedule_options(have.get(part)))
            elif part == "stream":
                said.append("another stream (repeat its --source or --stream, or pass "
                            "--new-data)")
            elif part == "tokenizer" and have.get(part) not in (None, "none"):
                said.append(f"the tokenizer {have[part]}{_tokenizer_hint(have[part], options)}")
            elif part == "batch":
                said.append(f"--batch {have.get(part)} (the batch cannot change on resume, "
                            f"SPEC §9: another batch is a new run, with a --run-dir of its own)")
            elif part in _OPTION_OF:
                value = have.get(part)
                if value is None:  # the run adds a part the checkpoint lacks
                    value = {"clip": "(off)", "heldout": "0", "accumulate": "1"}.get(part, "(none)")
                said.append(f"{_OPTION_OF[part]} {value}")
    if not said:
        return ""
    text = "the checkpoint was trained with " + ", ".join(said)
    learner_only = all(o.split()[0] in ("--lr", "--beta1", "--beta2", "--weight-decay",
                                        "--epsilon", "--clip", "--schedule", "--accumulate")
                       for o in said)
    return text + (" (or pass --new-learner to change the learner)" if learner_only else "")


def _tokenizer_hint(sha: str, options: dict | None) -> str:
    """How a run goes on with the checkpoint's tokenizer (sha): on a source,
    with --tokenizer naming its copy beside the checkpoint (or the run's
    --tokenizer) and --new-data; a stream of another tokenizer cannot."""
    from coppelius.tokenizer import TOKENIZER_NAME, tokenizer_sha

    if options is None:  # nothing known of the run: the command in general
        return (" (to go on with it on a new source: coppelius train --run-dir RUN_DIR --source "
                "NEW --tokenizer RUN_DIR/tokenizer.json --new-data)")
    if options.get("stream") or not options.get("checkpoint"):
        return (" (a stream of another tokenizer cannot go on with this checkpoint; a "
                "--run-dir of its own starts a new run)")
    for place in (os.path.join(os.path.dirname(options["checkpoint"]), TOKENIZER_NAME),
                  options.get("tokenizer")):
        if place and os.path.isfile(place) and tokenizer_sha(place) == sha:
            more = "" if options.get("new_data") else " --new-data"
            return f" (to go on with it on this source: --tokenizer {place}{more})"
    return (" (no copy of it lies beside the checkpoint: pass --tokenizer with it, or give this "
            "run a --run-dir of its own)")


def _schedule_options(value) -> str:
    if value is None:
        return "--schedule constant"
    kind, _, rest = value.partition("(")
    inside = dict(p.partition("=")[::2] for p in rest[:-1].split(","))
    decay = f"--decay {inside.get('decay')} " if kind == "wsd" else ""
    return (f"--schedule {kind} --warmup {inside.get('warmup')} --total {inside.get('total')} "
            f"{decay}--floor {inside.get('floor')}")


def default_preset() -> str:
    """`coppelius` where the best backend has a CUDA device (a GPU with CuPy),
    else `tiny` (SPEC section 15)."""
    import platform

    from coppelius.accelerated import best_backend, capabilities

    return "coppelius" if capabilities(best_backend()).device_on(platform.system()) == "cuda" \
        else "tiny"


def print_safely(text: str, file=None, end: str = "\n") -> None:
    """Progress and messages: a closed pipe or terminal (EPIPE, EIO after a
    hang-up) must never stop training or lose a step (SPEC 9), so a failed
    write is dropped, and that stream is pointed at /dev/null so that Python's
    exit flush does not fail either."""
    stream = file or sys.stderr
    try:
        print(text, file=stream, end=end, flush=True)
    except (OSError, ValueError):
        silence(stream)


def silence(stream) -> None:
    """Send `stream` to /dev/null (a closed pipe or terminal: nothing more to say)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
