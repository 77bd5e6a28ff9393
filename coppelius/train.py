"""`coppelius train`: the run loop of SPEC section 9.

One invocation takes S steps. Step s trains on contexts c0 + s*B + b; the
checkpoint is published every `interval` steps, after the last step, and on
SIGINT/SIGTERM after the step in flight. The step itself is captured once
(SPEC 13); per step the host uploads one input, replays, and reads back the
row losses for the result file.

Data parallelism (SPEC 19): with `--gpus N`, or under a launcher
(coppelius/launch.py), W ranks run this loop in lockstep, each on its own
GPU with its part of every batch. Before anything starts the ranks agree on
one plan (run_rank); rank 0 alone writes (run.json, the result file, the
checkpoint, the tokenizer beside it); a signal on any rank stops every rank
after the same step (the ranks' votes are summed in the step).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import traceback
import time
from dataclasses import dataclass, field

import numpy as np

from coppelius import accelerated
from coppelius import launch as ranks
from coppelius import metrics, report, sample
from coppelius.evaluate import held_out_losses
from coppelius.plan import (Plan, _positive, silence, check_gpus, make_plan, print_safely,
                            publish_tokenizer, resolve_options)
from coppelius.reference import checkpoint, results
from coppelius.reference.adamw import learning_rates
from coppelius.reference.config import PRESETS
from coppelius.reference.errors import (ConfigError, CoppeliusError, NonFiniteError,
                                        ResultFileError, RunError, StreamError)
from coppelius.reference.fsutil import signals_deferred
from coppelius.reference.params import registry
from coppelius.reference.state import State
from coppelius.run_file import write_run_file


# The BLAS threads of the host's products (the reference's step, every
# evaluation on the host). Measured on a 2-core machine with other work
# beside it, the tiny preset's reference step: 60 ms at B = 1 on one thread,
# 243 ms on two; with a neighbour spinning one core 102 ms and 2444 ms (B = 8:
# 905 ms and 5867 ms); the coppelius preset's step 13.2 s on one thread, and
# on two not 5 steps in 300 s. OpenBLAS's threads spin-wait for each other
# and for a core: under contention one thread is fastest at every size, so
# it is the default; an idle machine with many cores is told so with
# --blas-threads N (or the library's variables).
BLAS_ENVIRONMENT = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def limit_blas_threads(requested, env=None) -> str:
    """Set the BLAS thread count of this process (threadpoolctl) and say
    which and why: --blas-threads first, then the user's environment
    variable (left as the library read it), else one thread."""
    from threadpoolctl import threadpool_info, threadpool_limits

    env = os.environ if env is None else env
    if requested is not None:
        n, why = _positive(requested, "blas-threads"), "--blas-threads"
    else:
        name = next((v for v in BLAS_ENVIRONMENT if env.get(v)), None)
        n, why = (None, name) if name is not None else (1, "the default; --blas-threads N")
    if n is not None:
        threadpool_limits(limits=n, user_api="blas")  # for the rest of the process
    counts = sorted({pool["num_threads"] for pool in threadpool_info()
                     if pool["user_api"] == "blas"})
    count = "/".join(map(str, counts)) or "?"
    return f"BLAS threads {count} ({why})"


class Stopper:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal) set a flag; the loop
    publishes after the step in flight. The first signal is acknowledged
    at once on stderr, even while the step runs in one long call of NumPy or
    a backend (Python's own handler runs only once that call returns): the
    C handler writes the signal's number to a wake-up pipe, which a thread
    of its own reads."""

    def __init__(self, announce: bool = True):
        self.signum = None
        self.announce = announce
        self._old = {}
        self._pipe = self._thread = None
        self._old_wakeup = -1

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (ranks as threads, in tests): no signals
                break
        if self.announce and self._old:
            self._pipe = os.pipe()
            os.set_blocking(self._pipe[1], False)  # the C handler never blocks on it
            self._old_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
            self._thread = threading.Thread(target=self._acknowledge, daemon=True,
                                            name="coppelius-signal-acknowledge")
            self._thread.start()
        return self

    def _acknowledge(self):
        said = False
        while True:
            try:
                received = os.read(self._pipe[0], 64)
            except OSError:
                return
            if not received or 0 in received:  # __exit__'s sentinel
                return
            if not said:
                said = True
                signum = received[0]
                what = ("interrupted" if signum == signal.SIGINT else f"signal {signum}")
                again = (" (interrupt again to stop at once, publishing nothing)"
                         if signum == signal.SIGINT else "")
                print_safely(f"coppelius train: {what}: stopping after the step in flight"
                             f"{again}")

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second signal: stop now, nothing more is published
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            from coppelius.cli import Terminated  # status 128 + signum, as outside the loop

            raise Terminated(signum)
        self.signum = signum

    def __exit__(self, *exc):
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            try:
                os.write(self._pipe[1], b"\0")
            except OSError:  # full: the thread has ended reading or is about to
                pass
            self._thread.join(timeout=5)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
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

    def update(self, s, loss, held_out=None, extra=""):
        """After step s (0-based) of this invocation; `held_out`: the
        held-out loss evaluated after it, printed as a line of its own (a
        bar's postfix is overwritten by the next step); `extra`: the MFU and
        device memory (metrics.Meter.text)."""
        rate = (s + 1) * self.tps / max(time.perf_counter() - self.t0, 1e-9)
        try:
            if self.bar is not None:
                self.bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} tok/s{extra}",
                                         refresh=False)
                self.bar.update(1)
            elif (s + 1) % self.every == 0 or s + 1 == self.total:
                eta = (self.total - s - 1) * self.tps / rate
                print(f"step {self.first + s + 1}/{self.first + self.total}  loss {loss:.4f}"
                      f"  {rate:,.0f} tok/s{extra}  eta {eta:.0f}s", file=sys.stderr,
                      flush=True)
            if held_out is not None:
                line = (f"step {self.first + s + 1}: held-out loss {held_out:.4f} (perplexity "
                        f"{math.exp(min(held_out, 700)):,.1f})")
                if self.bar is not None:
                    self.bar.write(line, file=sys.stderr)  # above the bar, which stays
                else:
                    print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # the terminal or pipe is gone: train on, silently
            self.bar = None
            self.every = self.total + 1
            silence(sys.stderr)

    def close(self):
        if self.bar is not None:
            try:
                self.bar.close()
            except (OSError, ValueError):
                silence(sys.stderr)


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


class Publisher:
    """Checkpoint publication off the training loop. The state is copied off
    the device on the loop's thread (the next replay changes it: this is the
    one stall, a device-to-host copy); the finiteness check, the file, its
    fsync and the rename run on one background thread while training goes
    on. The file is still published atomically and durably (SPEC 10), a
    second publication waits for the first, and an error (a full disk, a
    non-finite parameter) surfaces at the next publication or at finish().
    A process told to stop ends only after the publication in flight
    (wait_out), so the path holds the old or the new checkpoint and no
    temporary is left. The wait is on an event the thread sets, not on
    Thread.join: a join cut short by a signal's exception takes the thread
    for ended on Python 3.11 (its lock released under it), and the
    interpreter would then exit in the middle of the write."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.in_flight = None  # the state of the publication in flight, until it is waited for
        self._thread = None
        self._done = None  # set by the thread as it ends
        self._error = None

    def submit(self, program, contexts: int) -> None:
        """Copy the program's state off the device and write it in the
        background. The previous publication is waited for first (its error
        raised here), so that its host copy is free again for this one."""
        self.finish()
        self.in_flight = state = program.state()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._publish, args=(state, contexts, self._done),
                                        name="coppelius-publish")
        self._thread.start()

    def _publish(self, state: State, contexts: int, done: threading.Event) -> None:
        try:
            publish(self.plan, state, contexts)
        except BaseException as e:  # handed to the training thread
            # without its frames' locals: the state's host copy goes back now
            traceback.clear_frames(e.__traceback__)
            self._error = e
        finally:
            done.set()

    def finish(self) -> None:
        """Wait for the publication in flight; raise what it raised. A
        signal's exception may cut the wait short: wait_out then waits."""
        if self._thread is not None:
            self._done.wait()
            self._thread.join()  # it has set the event: only its return is left
            self._thread = None
        self.in_flight = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait_out(self) -> None:
        """On the way out (an error, a second Ctrl-C): let the publication in
        flight end, signals held meanwhile, and drop what it raised."""
        if self._done is not None:
            with signals_deferred():
                self._done.wait()


def _param_at(config, offset):
    for spec in registry(config):
        if spec.offset <= offset < spec.offset + spec.size:
            idx = np.unravel_index(offset - spec.offset, spec.shape)
            return f"{spec.name}{list(map(int, idx))}"
    return str(offset)


class _Nothing:
    """What a rank > 0 has instead of the result file and the publisher: it
    writes nothing (SPEC 19)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@dataclass
class Dist:
    """This process's part in a data-parallel run (SPEC 19)."""

    rank: int
    world: int
    group: object  # launch.Group: the control channel
    comm: object = None  # accelerated.distributed.Communicator
    failure: object = None  # a launch.PeerFailure, once another rank failed
    programs: list = field(default_factory=list)  # captured over comm: released before it

    def release(self) -> None:
        """Release the programs (their CUDA graphs hold NCCL work) before
        the communicator is aborted: NCCL frees a communicator only once
        the graphs holding its work are gone."""
        while self.programs:
            self.programs.pop().reset()


def train(plan: Plan, quiet=False, dist: Dist | None = None) -> dict:
    """Run the plan. Returns a summary dict; raises NonFiniteError (exit 3).
    With `dist`, this rank's part: every rank steps, evaluates and stops
    together; rank 0 alone writes the result file and publishes."""
    config, B, T = plan.config, plan.batch, plan.config.context
    first_step, c0 = plan.state.t, plan.contexts
    leader = dist is None or dist.rank == 0
    results_path = (plan.results or results.default_results_path(plan.run_dir, first_step)
                    if leader else None)
    header = results.result_header(config, plan.identities, first_step, plan.steps, B,
                                   plan.backend, plan.repeat)
    module = accelerated.backend_module(plan.backend)
    # captured first: a step that cannot be built (out of memory) leaves no result file
    ranks_of = {} if dist is None else {"comm": dist.comm}
    sharded = dist is not None and plan.shard_optimizer  # one rank: nothing to shard
    if sharded:
        ranks_of["shard"] = True
    program = module.capture(config, plan.hyper, plan.precision, B, plan.state, **ranks_of,
                             recompute=plan.recompute)
    note = accelerated.attention_note(program.compilation_report())
    if leader and not quiet and note:  # a step slower than it could be says why
        print_safely(f"coppelius train: {note}")
    # sharded, state() and gradients() gather from every rank: every rank
    # calls them where rank 0 does (and drops what it gets)
    gathers = leader or sharded
    if dist is not None:
        dist.programs.append(program)
    # What rank 0 writes besides the checkpoint (run.json, the tokenizer
    # beside the checkpoint, the result file, the event files) is written
    # once the first step has been taken (begin): a run that cannot take
    # one (out of memory in the step) leaves no changed run.json and no
    # result file of a header alone (SPEC 9, Reading).
    writer = live = _Nothing()
    if leader:
        meter = metrics.Meter(config, B, plan.backend, (plan.options or {}).get("peak_tflops"),
                              1 if dist is None else dist.world)
        publisher = Publisher(plan)
    else:
        publisher = _Nothing()
        meter = None
    forward = None  # the kind-1 record, computed before the first step

    def begin():
        nonlocal writer, live
        if not leader or not isinstance(writer, _Nothing):
            return
        live = _live(plan, meter)
        write_run_file(plan.run_dir, plan.remembered)
        publish_tokenizer(plan.tokenizer, plan.checkpoint)
        writer = results.ResultWriter(results_path, header)  # refuses an existing path
        writer.forward(forward)

    K_train = plan.stream.n_contexts(T) - plan.heldout

    def batch_at(s):  # (B, T+1): training reads only the contexts not held out
        # every rank reads the whole batch; the program takes its rows (SPEC 19)
        return plan.stream.batch(c0 + s * B, B, T, repeat=plan.repeat, contexts=K_train)

    def publish_after(steps_done):  # rank 0's: the state copied off the device, then written
        if leader:
            live.flush()  # the curves so far, as the checkpoint
            publisher.submit(program, c0 + steps_done * B)
        elif sharded:
            program.state()
    if gathers:
        # the first copy of the state off the device allocates its host
        # buffers (page-locked on CUDA, kept by the backend's pool for every
        # later copy): made here, before the clock starts, not at the first
        # publication
        program.state()

    first = batch_at(0)
    rows = results.prediction_rows(T)
    if leader:
        forward = program.logits(first[:1, :T])[0, rows]  # (3, V) before the first step

    losses, held_out = [], []
    done = 0
    t_start = t_trained = time.perf_counter()
    progress = Progress(plan.steps, first_step, B * T) if not quiet else None

    def on_grid(n, every):
        # after n steps of this invocation: the run's step is a multiple of
        # `every`, so a resumed run publishes and evaluates where an
        # uninterrupted one does (1250, 1500, ... after a stop at 1021)
        return (first_step + n) % every == 0

    def boundary(n):  # after n steps the host acts on the state: nothing may be queued
        return (n == plan.steps or on_grid(n, plan.interval)
                or bool(plan.evaluate and plan.eval_every and on_grid(n, plan.eval_every)))

    try:
        with Stopper(announce=not quiet) as stopper:
            agreed_stop = False  # with ranks: a step read so far says some rank asked to stop

            def asked():  # this process's signal; with ranks, any rank's, as every rank reads it
                return agreed_stop if dist is not None else stopper.signum is not None

            def submit(n):  # step n; with ranks, this rank's stop vote goes with it (SPEC 19)
                if dist is not None and stopper.signum is not None:
                    program.vote_stop()
                return program.submit(batch_at(n))

            # Step s+1 is submitted before step s's records are read, so the
            # device never waits for the host; never across a step after which
            # the state is published or evaluated, or once a stop is asked for.
            # With ranks every decision here is the same on every rank: each
            # step's collectives pair up.
            t_read = time.perf_counter()
            pending = submit(0)
            following, stream_error = None, None
            last_gradients = None  # the last step's, for the final record
            for s in range(plan.steps):
                if following is None and not boundary(s + 1) and not asked():
                    try:
                        following = submit(s + 1)
                    except StreamError as error:  # raised once step s is kept
                        stream_error = error
                records = pending.records()
                row_losses, loss = records.row_losses, records.loss
                agreed_stop = agreed_stop or records.stops > 0
                now = time.perf_counter()
                host_s, t_read = now - t_read, now
                step_no = first_step + s
                trained = s + 1 + (following is not None)  # steps the device has taken
                mfu = memory = math.nan
                try:
                    begin()  # the first step is taken: run.json and the result file
                    writer.step(step_no, row_losses)
                    writer.timing(step_no, host_s, records.device_seconds)
                    writer.norm(step_no, records.grad_norm)
                    if meter is not None:
                        mfu, memory = meter.mfu(host_s), meter.memory()
                        writer.metrics(step_no, meter.flops, meter.peak or math.nan, mfu, memory)
                except ResultFileError:
                    # the telemetry is lost (a full disk, say); the training is not
                    # (sharded, the state is every rank's to gather: rank 0's failure
                    # ends them all, and the last published checkpoint stays)
                    if np.isfinite(row_losses).all() and not sharded:
                        publish_after(trained)
                        publisher.finish()
                    raise
                # with ranks, every rank holds every row: all of them stop here alike
                if not np.isfinite(row_losses).all():
                    raise NonFiniteError(f"step {step_no}: non-finite row loss; "
                                         f"{plan.checkpoint} is left as it was")
                losses.append(float(loss))
                if meter is not None:
                    live.scalars(step_no, {
                        "train/loss": loss, "train/grad_norm": records.grad_norm,
                        "train/learning_rate": learning_rates(plan.hyper, step_no + 1)[0],
                        "train/tokens_per_second": B * T / host_s if host_s > 0 else math.nan,
                        "train/mfu": mfu, "train/device_memory_gib": memory / metrics.GIB})
                done = s + 1
                last = done == plan.steps
                stop = asked()  # read once: a signal may land any time
                evaluated = None
                if last and gathers:
                    # the final record's gradient, read before the evaluation
                    # (on CuPy it shares storage with the activations)
                    last_gradients = program.gradients()
                if plan.evaluate and plan.eval_every and (last or on_grid(done, plan.eval_every)) \
                        and not stop:
                    per_context = (held_out_losses(program, plan.stream, T, plan.heldout)
                                   if plan.eval_stream is None else  # SPEC 22: its first K
                                   held_out_losses(program, plan.eval_stream, T, plan.evaluate,
                                                   first=0))
                    writer.eval(first_step + done, per_context)
                    evaluated = float(per_context.astype(np.float64).mean())
                    held_out.append((first_step + done, evaluated))
                    # the mean the record holds (results.eval_mean), to TensorBoard and W&B
                    live.scalars(first_step + done, {"eval/loss": results.eval_mean(per_context)})
                if progress:
                    progress.update(s, loss, evaluated, metrics.Meter.text(mfu, memory))
                if stream_error is not None:
                    # the stream changed under the run (truncated, say): keep what is trained
                    if not on_grid(done, plan.interval):
                        publish_after(done)
                        publisher.finish()
                    raise stream_error
                if following is not None:  # the queued step is read next, whatever happens
                    pending, following = following, None
                    continue
                if last or on_grid(done, plan.interval) or stop:
                    publish_after(done)  # written in the background
                if stop and not last:
                    break
                try:
                    pending = submit(s + 1) if not last else None
                except StreamError:
                    if not on_grid(done, plan.interval):
                        publish_after(done)
                        publisher.finish()
                    raise
            # the clock of the training stops here: every step read, every
            # evaluation and publication but the last one's write done
            t_trained = time.perf_counter()
            if done == plan.steps and leader:
                _final_record(writer, program, config, batch_at(plan.steps - 1),
                              first_step + done, publisher.in_flight, last_gradients)
            publisher.finish()  # the run's last checkpoint is published when train() returns
    finally:
        if progress:
            progress.close()
        live.close()
        writer.close()
        if leader:  # leaving by an error: the publication in flight still ends
            publisher.wait_out()
    t_end = time.perf_counter()
    elapsed = t_trained - t_start
    return {"results": results_path, "checkpoint": plan.checkpoint, "steps": done,
            "first_step": first_step, "losses": losses, "held_out": held_out,
            "seconds": elapsed,
            "tokens_per_second": done * B * T / elapsed if elapsed > 0 else math.nan,
            # the final record and the wait for the last checkpoint's write and sync
            "finish_seconds": t_end - t_trained,
            "signal": stopper.signum if dist is None else (stopper.signum or (
                signal.SIGTERM if done < plan.steps else None)), "program": program}


def _live(plan: Plan, meter) -> metrics.Live:
    """The invocation's TensorBoard event file and W&B run (rank 0's)."""
    options = plan.options or {}
    about = {"model": _model_name(plan), "backend": plan.backend, "precision": plan.precision,
             "batch": plan.batch, "first_step": int(plan.state.t), "steps": plan.steps,
             "flops_per_step": meter.flops, "device": meter.device, **plan.identities}
    return metrics.Live(metrics.tensorboard_dir(options, plan.run_dir), options.get("wandb"),
                        plan.run_dir, int(plan.state.t), about)


def _final_record(writer, program, config, last_tokens, updates, state, grads):
    """The result file's final record; `updates`: the update count after
    the last step; `state`: the program's state then, when already copied
    off the device (the last publication's), else None; `grads`: the last
    step's gradient, read before the evaluation after it."""
    T = config.context
    reg = registry(config)
    emb = reg["tok_embedding.weight"]
    state = program.state() if state is None else state
    assert state.t == updates, (state.t, updates)
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
    _positive(args.blas_threads, "blas-threads")  # refused before the data is prepared
    if args.prompt is not None and not args.no_sample:  # refused before anything is trained
        sample.check_prompt(args.prompt)
        if not args.prompt:
            raise ConfigError("--prompt '': empty; the sample continues a prompt (give some "
                              "text, or --no-sample)")
    launch = ranks.from_environment()
    if launch is not None:  # one rank of a launcher's (or of --gpus N's)
        if args.gpus is not None and args.gpus != launch.world:
            raise RunError(f"--gpus {args.gpus}: the launcher ({launch.launcher}) started "
                           f"{launch.world} ranks")
        return run_rank(args, launch)
    options = resolve_options(args)[1]
    gpus = _positive(options.get("gpus", 1), "gpus")
    if gpus > 1:
        backend = options.get("backend") or accelerated.best_backend()
        check_gpus(backend, gpus)
        accelerated.backend_module(backend)  # a clear error when it is not available here
        from coppelius.accelerated.cuda import distributed

        distributed.check_devices(gpus)
        argv = getattr(args, "argv", None) or sys.argv[1:]
        return ranks.spawn([sys.executable, "-m", "coppelius", *argv], gpus)
    with contextlib.ExitStack() as resources:  # the checkpoint's lock, held to the end
        t0 = time.perf_counter()
        plan = make_plan(args, resources)
        return _run(args, plan, time.perf_counter() - t0)


# ---------------------------------------------------------------- data parallelism

# what every rank's plan must have as rank 0's has it (SPEC 19)
AGREED = ("identities", "batch", "backend", "precision", "step", "contexts", "steps", "interval",
          "eval_every", "heldout", "repeat", "shard_optimizer")


def plan_summary(plan: Plan) -> dict:
    """What rank 0 tells the others of its plan: AGREED, and the stream
    they are to read (rank 0 prepared it)."""
    return {"identities": dict(plan.identities), "batch": plan.batch, "backend": plan.backend,
            "precision": plan.precision, "step": int(plan.state.t), "contexts": plan.contexts,
            "steps": plan.steps, "interval": plan.interval, "eval_every": plan.eval_every,
            "heldout": plan.heldout, "repeat": plan.repeat,
            "shard_optimizer": plan.shard_optimizer, "stream": plan.stream.path,
            "tokenizer": plan.tokenizer,
            "eval_stream": None if plan.eval_stream is None else plan.eval_stream.path}


def plan_difference(mine: dict, leader: dict) -> str:
    """'' when the plans agree, else what differs first, both values."""
    for key in AGREED:
        a, b = mine.get(key), leader.get(key)
        if key == "identities":
            for name in sorted(set(a) | set(b)):
                if a.get(name) != b.get(name):
                    return (f"its {name} identity is {a.get(name)!r}, rank 0's "
                            f"{b.get(name)!r}")
        elif a != b:
            return f"its plan has {key} {a!r}, rank 0's {b!r}"
    return ""


class Refused(RunError):
    """A plan refused by one rank, and so by every rank (rank 0 says it)."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.exit_status = status


def agree(args, resources, group) -> Plan:
    """Every rank's plan, agreed with rank 0's before anything starts
    (SPEC 19): rank 0 plans and tells the others; each makes its own and
    says whether it agrees; one refusal (a bad batch split, an identity
    mismatch, a missing file) is every rank's."""
    r = group.rank
    if r == 0:
        try:
            plan = make_plan(args, resources, group.world, 0)
        except CoppeliusError as e:
            group.share({"refuse": str(e), "status": e.exit_status})
            raise Refused(str(e), e.exit_status) from None
        group.share({"plan": plan_summary(plan)})
        for q, verdict in sorted(group.gather().items()):
            if "refuse" in verdict:
                status = verdict.get("status", 2)
                group.share({"refuse": verdict["refuse"], "status": status})
                raise Refused(verdict["refuse"], status)
        return plan
    message = group.receive()
    if "refuse" in message:
        raise Refused(message["refuse"], message.get("status", 2))
    try:
        plan = make_plan(args, resources, group.world, r, leader=message["plan"])
        differs = plan_difference(plan_summary(plan), message["plan"])
        if differs:
            raise RunError(differs)
    except CoppeliusError as e:
        group.reply({"refuse": f"rank {r}: {e}", "status": e.exit_status})
        raise Refused(f"rank {r}: {e}", e.exit_status) from None
    group.reply({"agree": True})
    return plan


def run_rank(args, launch, hard_exit: bool = True, mpi=None) -> int:
    """One rank of W (SPEC 19): meet the others, agree on the plan, open the
    NCCL communicator on this rank's GPU, train in lockstep. -> the exit
    status. Errors are printed here, once: a refused plan by rank 0; a
    failure by the rank it happened on, and by the others (as "stopped:
    rank r failed ...") unless they run under `--gpus`, whose own line
    (for a rank killed by a signal) or the failed rank's says it all."""
    from coppelius.accelerated.cuda import distributed

    r = launch.rank
    parent = os.environ.get(ranks.PARENT_ENV) == "1"

    def say(text):
        print_safely(f"coppelius train: error: {'' if r == 0 else f'rank {r}: '}{text}")

    said = []

    def say_stopped(text):  # once: by the main thread, or by the watcher ending a stuck rank
        if not said:
            said.append(text)
            say(text)

    def leave(status, seconds=ranks.EXIT_GRACE):  # the process ends within `seconds`
        if hard_exit:
            ranks.exit_within(status, seconds)

    with contextlib.ExitStack() as resources:
        t0 = time.perf_counter()
        try:
            group = ranks.Group.open(launch, mpi=mpi, bind="127.0.0.1" if parent else None)
        except CoppeliusError as e:
            say(str(e))
            return e.exit_status
        resources.callback(group.close)
        dist = Dist(r, launch.world, group)

        def on_failure(failure):  # the watcher's thread
            dist.failure = failure
            comm = dist.comm
            if comm is not None:
                comm.failure = failure  # raised by the program after its wait returns
                threading.Thread(target=comm.abort, name="coppelius-nccl-abort",
                                 daemon=True).start()

        try:
            plan = agree(args, resources, group)
            if r == 0:
                uid = group.go(distributed.new_unique_id)
            else:
                message = group.receive()
                if "refuse" in message:
                    raise Refused(message["refuse"], message.get("status", 2))
                uid = group.went(message)
            group.watch(on_failure, hard_exit=hard_exit, say=None if parent else say_stopped)
            distributed.use_device(launch.local_rank, r)
            dist.comm = distributed.Communicator(uid, r, launch.world)
            resources.callback(dist.comm.abort)  # the end, normal too (after the next one)
            resources.callback(dist.release)  # the programs' graphs go before the communicator
            if dist.failure is not None:
                dist.comm.failure = dist.failure
                raise dist.failure
            status = _run(args, plan, time.perf_counter() - t0, dist)
            group.finish()
            leave(status)  # everything is written: no teardown may hang the exit
            return status
        except Refused as e:  # every rank refuses; rank 0 says why
            if r == 0:
                say(str(e))
            return e.exit_status
        except NonFiniteError as e:  # every rank saw the same rows: rank 0 says it
            group.finish()
            if r == 0:
                say(str(e))
            leave(e.exit_status)
            return e.exit_status
        except BaseException as e:
            failure = dist.failure or (e if isinstance(e, ranks.PeerFailure) else None)
            if failure is not None:  # another rank's failure ended this one
                if not parent:
                    say_stopped(str(failure))
                leave(failure.exit_status, ranks.ABORT_GRACE)
                return failure.exit_status
            group.fail(f"rank {r} failed: {e}")  # this rank's own: the others are told
            if isinstance(e, CoppeliusError):
                say(str(e))
                leave(e.exit_status, ranks.ABORT_GRACE)
                return e.exit_status
            raise


def _run(args, plan: Plan, prepared: float, dist: Dist | None = None) -> int:
    K = plan.stream.n_contexts(plan.config.context)
    leader = dist is None or dist.rank == 0
    if plan.steps == 0:
        if leader:
            final = plan.final_step
            where = (f"past --until {args.until}" if args.until is not None and final < plan.state.t
                     else "the run's final step")
            print(f"coppelius train: nothing to do: {plan.checkpoint} is at step "
                  f"{plan.state.t}, {where} (use --steps S or --until N to go further)")
        return 0
    blas = limit_blas_threads(getattr(args, "blas_threads", None))
    if leader:
        h = plan.hyper
        schedule = ("" if h.schedule == "constant" else
                    f", cosine schedule (warm-up {h.warmup}, total {h.total})"
                    if h.schedule == "cosine" else
                    f", wsd schedule (warm-up {h.warmup}, stable to {h.total - h.decay}, "
                    f"total {h.total})")
        c = plan.config
        shape = f"V={c.vocab} T={c.context} D={c.d_model} L={c.n_layer} H={c.n_head} F={c.d_ff}"
        gpus = "" if dist is None else f" on {dist.world} GPUs ({plan.batch // dist.world} each)"
        if plan.recompute in accelerated.capabilities(plan.backend).recompute:  # else ignored
            gpus += {"gate-up": ", gate and up recomputed in the backward",
                     "block": ", each layer recomputed in the backward"}[plan.recompute]
        if plan.shard_optimizer and dist is not None:  # else nothing to shard
            gpus += f", optimizer state sharded (1/{dist.world} of M and V a rank)"
        if accelerated.capabilities(plan.backend).device == "cpu":
            gpus += f", {blas}"
        print_safely(f"coppelius train: model {_model_name(plan)} ({shape}), backend "
                     f"{plan.backend}, precision {plan.precision}, batch {plan.batch}{gpus}, "
                     f"steps {plan.state.t}..{plan.state.t + plan.steps}{schedule}, stream "
                     f"{plan.stream.path} ({K - plan.heldout} contexts for training"
                     f"{', repeated' if plan.repeat else ''}, {plan.heldout} held out"
                     f"{'' if plan.eval_stream is None else ', eval stream '}"
                     f"{'' if plan.eval_stream is None else plan.eval_stream.path}); data "
                     f"and state ready in {prepared:.1f} s")
    summary = train(plan, quiet=not leader, dist=dist)
    losses = summary["losses"]
    if not leader:
        return 0 if summary["signal"] is None else 128 + summary["signal"]
    if summary["signal"] is not None:
        print_safely(f"stopped by signal {summary['signal']} after "
                     f"{_count(summary['steps'], 'step')}; "
                     f"checkpoint {plan.checkpoint} holds step {plan.state.t + summary['steps']}")
        return 128 + summary["signal"]
    k = max(1, len(losses) // 10)  # single steps are noisy: average a tenth of the run
    out = sys.stdout
    print_safely(f"trained {_count(summary['steps'], 'step')} in {summary['seconds']:.1f} s "
                 f"({summary['tokens_per_second']:,.0f} tokens/s; then "
                 f"{summary['finish_seconds']:.1f} s for the final record and the last "
                 f"checkpoint's write and sync); mean loss "
                 f"{np.mean(losses[:k]):.4f} over the first {_count(k, 'step')}, "
                 f"{np.mean(losses[-k:]):.4f} over the last {k}", out)
    if summary["held_out"]:
        step, loss = summary["held_out"][-1]
        print_safely(f"held-out loss at step {step}: {loss:.4f} (perplexity "
                     f"{math.exp(min(loss, 700)):,.1f}) over {plan.evaluate} contexts", out)
    from coppelius.data import documents_summary

    documents = documents_summary(plan.stream.path)  # None for a stream given as is
    print_safely(f"stream:     {plan.stream.path}{f' ({documents})' if documents else ''}", out)
    print_safely(f"checkpoint: {plan.checkpoint}", out)
    print_safely(f"results:    {summary['results']}", out)
    png = report.plot_beside(results.read_results(summary["results"]), summary["results"])
    print_safely(f"loss plot:  {png}", out)
    if not args.no_sample and plan.tokenizer:
        t1 = time.perf_counter()
        prompt, whence = args.prompt, "--prompt"
        if prompt is None:  # the last context: held out whenever any is (SPEC 18)
            prompt = sample.corpus_prompt(plan.stream, plan.config, plan.tokenizer,
                                          plan.stream.n_contexts(plan.config.context) - 1)
            whence = "the start of a line of the held-out text, not the model's"
        # the prompt marked off from what the model writes, which is shown as it is made
        print_safely(f"sample prompt ({whence}):\n{prompt}", out)
        print_safely("sample (80 tokens, as they are made):", out)
        rate = []  # the generation's alone (sample.speed_line), beside the whole time
        sample.generate_text(plan.checkpoint, prompt=prompt, tokens=80, temperature=0.8,
                             top_k=40, seed=0, tokenizer=plan.tokenizer,
                             logits_of=summary["program"].logits, backend=plan.backend,
                             precision=plan.precision,
                             on_text=lambda piece: print_safely(piece, out, end=""),
                             report=rate.append)
        print_safely(f"\n({rate[-1]}; sampled in {time.perf_counter() - t1:.1f} s)", out)
    return 0


def _count(n: int, noun: str) -> str:
    """"1 step", "2 steps"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _model_name(plan) -> str:
    """The preset's name, or the model file (and the preset it overrides),
    or the checkpoint the model was read from."""
    model, preset_name = plan.options.get("model"), plan.options.get("preset")
    if model:
        return f"{preset_name} with {model}" if preset_name else model
    if plan.model_source == plan.checkpoint:
        name = next((n for n, c in PRESETS.items() if c == plan.config), None)
        return f"of {plan.checkpoint}" + (f" (preset {name})" if name else "")
    for name, c in PRESETS.items():
        if c == plan.config:
            return name
    return "custom"
