"""`coppelius train`: the run loop of SPEC section 9.

One invocation takes S steps. Step s trains on contexts c0 + s*B + b; the
checkpoint is published every `interval` steps, after the last step, and on
SIGINT/SIGTERM after the step in flight. The step itself is captured once
(SPEC 13); per step the host uploads one input, replays, and reads back the
row losses for the result file.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import tempfile
import sys
import time
from dataclasses import dataclass

import numpy as np

from coppelius import accelerated
from coppelius import report, sample
from coppelius.reference import checkpoint, fsutil, limits, results
from coppelius.reference.binding import load_state
from coppelius.reference.config import (PRESETS, SEED, Hyper, check_precision, parse_rational, preset,
                              rational_text)
from coppelius.reference.errors import NonFiniteError, ResultFileError, RunError, StreamError
from coppelius.reference.params import initialize, registry
from coppelius.reference.state import State
from coppelius.reference.stream import open_stream


def register(sub) -> None:
    p = sub.add_parser("train", help="train (or resume) a model and publish checkpoints",
                       description="Train a model on a token stream; resume from --checkpoint "
                                   "when it holds a checkpoint.")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model preset (default: coppelius with a GPU, else tiny)")
    p.add_argument("--backend", choices=sorted(accelerated.BACKENDS),
                   help="backend (default: the best available)")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="precision policy (default: bf16 on cupy, else fp32)")
    data = p.add_mutually_exclusive_group()
    path = fsutil.path_argument  # an empty path is refused, not taken for "not given"
    data.add_argument("--source", metavar="TEXT", type=path,
                      help="a text file to tokenize and train on")
    data.add_argument("--stream", metavar="STREAM", type=path, help="a token stream file to train on")
    p.add_argument("--checkpoint", metavar="PATH", type=path,
                   help="checkpoint to resume from and publish to (default: RUN_DIR/checkpoint.bin); "
                        "locked while the run uses it")
    p.add_argument("--results", metavar="PATH", type=path,
                   help="result file to write; must not exist (default: RUN_DIR/results-<step>.bin)")
    p.add_argument("--run-dir", metavar="DIR", type=path,
                   help="output directory (default: runs/<preset>)")
    p.add_argument("--steps", type=int, metavar="N", help="steps to take (default: the preset's)")
    p.add_argument("--interval", type=int, metavar="N",
                   help="publish a checkpoint every N steps (default: the preset's)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="contexts per step (default 1)")
    hyper = Hyper()
    for name in ("lr", "beta1", "beta2", "weight_decay", "epsilon"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="X",
                       default=rational_text(getattr(hyper, name)),
                       help=f"AdamW {name}, an exact rational or decimal "
                            f"(default {rational_text(getattr(hyper, name))})")
    p.add_argument("--seed", type=int, default=SEED, help=f"initialization seed (default {SEED})")
    p.add_argument("--repeat-data", action="store_true",
                   help="read context c as c mod K when the stream is too short")
    p.add_argument("--new-data", action="store_true",
                   help="resume on another stream (lifts only the data identity's stream digest)")
    p.add_argument("--no-sample", action="store_true", help="do not print a sample at the end")
    p.set_defaults(func=main)


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


def _positive(value, name):
    if value is not None and value <= 0:
        raise RunError(f"--{name}={value}: must be a positive integer")
    return value


def make_plan(args, resources: contextlib.ExitStack) -> Plan:
    """Everything decided and checked before the first step. What the run
    holds (the checkpoint's lock, the open stream) is left to `resources`."""
    from coppelius import data  # tokenizers is imported only when a run needs it

    backend = args.backend or accelerated.best_backend()
    accelerated.backend_module(backend)  # a clear error when it is not available here
    name = args.preset or data.default_preset()
    config = preset(name)
    precision = check_precision(args.precision or ("bf16" if backend == "cupy" else "fp32"))
    hyper = Hyper(**{k: parse_rational(getattr(args, k), k.replace("_", "-"))
                     for k in ("lr", "beta1", "beta2", "weight_decay", "epsilon")})
    batch = _positive(args.batch, "batch")
    steps = _positive(args.steps, "steps") or config.steps
    interval = _positive(args.interval, "interval") or config.interval
    if not 0 <= args.seed < 2**64:
        raise RunError(f"--seed={args.seed}: must be in [0, 2^64)")
    limits.check_fits(limits.step_bytes(config, batch, on_host=backend != "cupy"),
                      f"--batch={batch} on the {name} preset")
    run_dir = args.run_dir or os.path.join("runs", name)
    ckpt = args.checkpoint or os.path.join(run_dir, "checkpoint.bin")
    fsutil.output_target(ckpt, "checkpoint")  # a FIFO or a device is refused, not replaced
    if args.results and fsutil.same_file(args.results, ckpt):
        raise RunError(f"--results {args.results}: is the checkpoint path too")
    if args.results and os.path.lexists(args.results):
        raise RunError(f"result file {args.results}: already exists (a run never overwrites one)")
    if args.results:
        fsutil.output_target(args.results, "result file")

    stream_path, tokenizer = data.prepare_stream(
        source=args.source, stream=args.stream, vocab=config.vocab)  # cached under runs/data
    stream = open_stream(stream_path, config.vocab)
    resources.callback(stream.close)
    if tokenizer:
        data.check_tokenizer(tokenizer, config.vocab)  # not found bad after training
    ids = checkpoint.identities(config, hyper, precision, batch, data.tokenizer_sha(tokenizer),
                                stream.sha256, args.seed)
    # The checkpoint is locked before it is read (or, when its folder does
    # not exist yet, as soon as the folder is made: a refused plan leaves no
    # folder), and stays locked until the run ends: no other run publishes
    # it between this run's reading and its publishing.
    lock = fsutil.Lock(ckpt, "checkpoint")
    resources.callback(lock.release)
    if os.path.isdir(os.path.dirname(lock.path)):
        lock.acquire()
    if checkpoint.is_fresh(ckpt):
        state, c0 = State.fresh(initialize(config, args.seed)), 0
    else:
        state, c0 = load_checkpoint(ckpt, config, ids, args.new_data)

    default_data = args.source is None and args.stream is None
    repeat = args.repeat_data
    K = stream.n_contexts(config.context)
    need = c0 + steps * batch
    if K == 0:
        raise RunError(f"stream {stream_path}: holds no context of {config.context + 1} tokens")
    if need > K and not repeat:
        if not default_data:
            raise RunError(f"stream {stream_path}: the run needs {need} contexts but the stream "
                           f"holds {K} (use --repeat-data to cycle it)")
        repeat = True
        print(f"note: the embedded corpus holds {K} contexts and this run needs {need}: "
              f"repeating data (context c is read as c mod {K})", file=sys.stderr)
    # outputs: found unwritable now, not after the first interval of training
    for directory in {run_dir, os.path.dirname(os.path.abspath(ckpt)),
                      os.path.dirname(os.path.abspath(args.results or ckpt))}:
        writable_directory(directory)
    if not lock.held:
        lock.acquire()
        if not checkpoint.is_fresh(ckpt):
            raise RunError(f"checkpoint {ckpt}: another run published it while this one "
                           f"started; start this one again")
    fsutil.remove_stale(ckpt)  # temporaries of a run killed while it published
    return Plan(config=config, backend=backend, precision=precision, hyper=hyper, batch=batch,
                steps=steps, interval=interval, run_dir=run_dir, checkpoint=ckpt,
                results=args.results, repeat=repeat, stream=stream, tokenizer=tokenizer,
                identities=ids, state=state, contexts=c0, default_data=default_data)


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


def load_checkpoint(path, config, identities, new_data):
    """-> (State, contexts consumed): validated, identities compared, every
    parameter bound by name through the binding layer (SPEC 12)."""
    ck = load_state(path, config, expect=identities, new_data=new_data)
    return ck.state, ck.contexts


class Stopper:
    """SIGINT/SIGTERM/SIGHUP set a flag; the loop publishes after the step in flight."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second signal: stop now, nothing is published
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class Progress:
    """A tqdm bar on a terminal; plain periodic lines otherwise."""

    def __init__(self, total, first_step, tokens_per_step):
        self.total, self.first, self.tps = total, first_step, tokens_per_step
        self.bar = None
        self.every = max(1, total // 20)
        self.t0 = time.perf_counter()
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, s, loss):
        rate = (s + 1) * self.tps / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} tok/s", refresh=False)
            self.bar.update(1)
        elif (s + 1) % self.every == 0 or s + 1 == self.total:
            eta = (self.total - s - 1) * self.tps / rate
            print(f"step {self.first + s + 1}/{self.first + self.total}  loss {loss:.4f}  "
                  f"{rate:,.0f} tok/s  eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def publish(plan: Plan, state: State, contexts: int) -> None:
    """Publish the checkpoint, unless a parameter or moment is non-finite (the
    last published checkpoint then stays untouched: SPEC 9)."""
    for name in ("P", "M", "V"):
        a = getattr(state, name)
        if not np.isfinite(a).all():
            bad = int(np.flatnonzero(~np.isfinite(a))[0])
            raise NonFiniteError(f"step {state.t}: {name}[{_param_at(plan.config, bad)}] is "
                                 f"non-finite; {plan.checkpoint} is left as it was")
    checkpoint.write_checkpoint(plan.checkpoint, plan.config, plan.identities, state, contexts)


def _param_at(config, offset):
    for spec in registry(config):
        if spec.offset <= offset < spec.offset + spec.size:
            idx = np.unravel_index(offset - spec.offset, spec.shape)
            return f"{spec.name}{list(map(int, idx))}"
    return str(offset)


def train(plan: Plan, quiet=False) -> dict:
    """Run the plan. Returns a summary dict; raises NonFiniteError (exit 3)."""
    config, B, T = plan.config, plan.batch, plan.config.context
    first_step, c0 = plan.state.t, plan.contexts
    results_path = plan.results or results.default_results_path(plan.run_dir, first_step)
    header = results.result_header(config, plan.identities, first_step, plan.steps, B,
                                   plan.backend, plan.repeat)
    module = accelerated.backend_module(plan.backend)
    # captured first: a step that cannot be built (out of memory) leaves no result file
    program = module.capture(config, plan.hyper, plan.precision, B, plan.state)
    publish_tokenizer(plan.tokenizer, plan.checkpoint)
    writer = results.ResultWriter(results_path, header)  # refuses an existing path

    def batch_at(s):
        return plan.stream.batch(c0 + s * B, B, T, repeat=plan.repeat)  # (B, T+1)

    first = batch_at(0)
    rows = results.prediction_rows(T)
    writer.forward(program.logits(first[:1, :T])[0, rows])  # (3, V) before the first step

    losses = []
    done = 0
    t_start = time.perf_counter()
    progress = Progress(plan.steps, first_step, B * T) if not quiet else None
    try:
        with Stopper() as stopper:
            for s in range(plan.steps):
                try:
                    tokens = batch_at(s)
                except StreamError:
                    # the stream changed under the run (truncated, say): keep what is trained
                    if done % plan.interval:
                        publish(plan, program.state(), c0 + done * B)
                    raise
                t0 = time.perf_counter()
                program.upload_input(tokens)
                loss, device_s = program.replay_timed_and_wait()
                row_losses = program.row_losses()  # host copy: the result file needs it
                host_s = time.perf_counter() - t0
                step_no = first_step + s
                try:
                    writer.step(step_no, row_losses)
                    writer.timing(step_no, host_s, device_s)
                except ResultFileError:
                    # the telemetry is lost (a full disk, say); the training is not
                    if np.isfinite(row_losses).all():
                        publish(plan, program.state(), c0 + (s + 1) * B)
                    raise
                if not np.isfinite(row_losses).all():
                    raise NonFiniteError(f"step {step_no}: non-finite row loss; "
                                         f"{plan.checkpoint} is left as it was")
                losses.append(float(loss))
                done = s + 1
                if progress:
                    progress.update(s, loss)
                last = done == plan.steps
                stop = stopper.signum is not None  # read once: a signal may land any time
                if last or done % plan.interval == 0 or stop:
                    publish(plan, program.state(), c0 + done * B)
                if stop and not last:
                    break
            if done == plan.steps:
                _final_record(writer, program, config, batch_at(plan.steps - 1))
    finally:
        if progress:
            progress.close()
        writer.close()
    elapsed = time.perf_counter() - t_start
    return {"results": results_path, "checkpoint": plan.checkpoint, "steps": done,
            "first_step": first_step, "losses": losses, "seconds": elapsed,
            "tokens_per_second": done * B * T / elapsed if elapsed > 0 else math.nan,
            "signal": stopper.signum, "program": program}


def _final_record(writer, program, config, last_tokens):
    T = config.context
    reg = registry(config)
    emb = reg["tok_embedding.weight"]
    state = program.state()
    grads = program.gradients()
    block = np.stack([
        program.row_losses()[0],  # last step's row losses, batch element 0
        grads[emb.offset:emb.offset + T],  # first T elements of its embedding gradient
        state.P[emb.offset:emb.offset + T],  # ... of the embedding after the update
        state.M[emb.offset:emb.offset + T],  # ... of its first moment
    ]).astype(np.float32)  # (4, T)
    logits = program.logits(last_tokens[:1, :T])[0]  # (T, V) after the final update
    preds = [(int(np.argmax(logits[r])), int(np.isfinite(logits[r]).all()))
             for r in results.prediction_rows(T)]
    writer.final(block, logits[T - 1].astype(np.float32), preds)


def main(args) -> int:
    with contextlib.ExitStack() as resources:  # the checkpoint's lock, held to the end
        t0 = time.perf_counter()
        plan = make_plan(args, resources)
        return _run(args, plan, time.perf_counter() - t0)


def _run(args, plan: Plan, prepared: float) -> int:
    K = plan.stream.n_contexts(plan.config.context)
    print(f"coppelius train: preset {_preset_name(plan.config)}, backend {plan.backend}, "
          f"precision {plan.precision}, batch {plan.batch}, steps {plan.state.t}.."
          f"{plan.state.t + plan.steps}, stream {plan.stream.path} ({K} contexts"
          f"{', repeated' if plan.repeat else ''}); data and state ready in {prepared:.1f} s",
          file=sys.stderr)
    summary = train(plan)
    losses = summary["losses"]
    if summary["signal"] is not None:
        print(f"stopped by signal {summary['signal']} after {summary['steps']} steps; "
              f"checkpoint {plan.checkpoint} holds step {plan.state.t + summary['steps']}",
              file=sys.stderr)
        return 128 + summary["signal"]
    k = max(1, len(losses) // 10)  # single steps are noisy: average a tenth of the run
    print(f"trained {summary['steps']} steps in {summary['seconds']:.1f} s "
          f"({summary['tokens_per_second']:,.0f} tokens/s); mean loss {np.mean(losses[:k]):.4f} "
          f"over the first {k} steps, {np.mean(losses[-k:]):.4f} over the last {k}")
    print(f"checkpoint: {plan.checkpoint}")
    print(f"results:    {summary['results']}")
    png = report.plot_beside(results.read_results(summary["results"]), summary["results"])
    print(f"loss plot:  {png}")
    if not args.no_sample and plan.tokenizer:
        t1 = time.perf_counter()
        text = sample.generate_text(plan.checkpoint, prompt=sample.DEFAULT_PROMPT, tokens=80,
                                    temperature=0.8, top_k=40, seed=0, tokenizer=plan.tokenizer,
                                    logits_of=summary["program"].logits)
        print(f"sample ({time.perf_counter() - t1:.1f} s):\n" + text)
    return 0


def _preset_name(config):
    for name, c in PRESETS.items():
        if c == config:
            return name
    return "custom"
