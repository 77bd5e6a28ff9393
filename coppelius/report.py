"""`coppelius inspect PATH` and `coppelius report RESULTS|RUN_DIR [--plot PNG] [--csv FILE]`.

inspect recognises a checkpoint (SPEC 10) or a result file (SPEC 11) by its
magic and shows its envelope after checking it, and describes a safetensors
file or a Hugging Face directory (coppelius.exchange); report summarises the
losses, held-out losses, gradient norms, learning rate and throughput of one
result file, or of every result file of a run directory stitched in step
order, and can plot them and write them as CSV.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from coppelius.reference import checkpoint, results
from coppelius.reference.config import rational_text
from coppelius.reference.errors import CoppeliusError, OutputError
from coppelius.reference.fsutil import (open_regular, output_target, path_argument, publish,
                                        same_file, stage)
from coppelius.reference.schedule import learner_from_identity
from coppelius.stitch import CSV_COLUMNS, Run, csv_body, read_run_dir, step_ranges, stitch

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EMA_BETA = 0.9  # smoothing of the plotted loss curve, bias-corrected as in Adam
LAST_FRACTION = 0.1  # the by-position curve averages the last 10% of steps (at least one)
RUN_PLOT = "run.png"  # the plot of `report RUN_DIR`, in the directory, unless --plot says
COMPARE_PLOT = "compare.png"  # the plot of `report --compare`, unless --plot says


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="check a checkpoint, result file, safetensors file, "
                                              "token stream or shards, or Hugging Face "
                                              "directory and describe it",
                              description="Recognise a checkpoint, a result file or a safetensors "
                                          "file by its magic, or a Hugging Face model directory, "
                                          "check it, and print its envelope or its tensors and "
                                          "the model they describe; a token stream, shard "
                                          "(.tokens, .bin), folder or glob of shards: each "
                                          "shard's format, id type and count, and the digest.")
    p.add_argument("path", metavar="PATH", type=path_argument)
    p.set_defaults(func=inspect_command)
    p = subparsers.add_parser(
        "report", help="summarise a result file or a whole run directory; plot, CSV",
        description="Summarise the training loss, held-out loss, gradient norm, learning rate "
                    "and throughput of one result file, or of every result file (results-*.bin) "
                    "of a run directory stitched in step order: a file written later replaces "
                    "the steps an earlier one recorded from its first step on (a run resumed "
                    "from an older checkpoint re-trains them).")
    p.add_argument("results", metavar="RESULTS|RUN_DIR", type=path_argument, nargs="?")
    p.add_argument("--compare", nargs="+", metavar="RUN_DIR", type=path_argument,
                   help=f"plot the training and held-out loss of these runs (and RUN_DIR's, if "
                        f"given) on one figure, by step and by tokens, a line per run and "
                        f"curve, the legend by run name (to --plot, default {COMPARE_PLOT})")
    p.add_argument("--plot", metavar="PNG", type=path_argument,
                   help=f"write the plot (PNG) to this path (a run directory's default: "
                        f"{RUN_PLOT} in it; a file's: none); an existing PNG is replaced, "
                        f"nothing else is")
    p.add_argument("--csv", metavar="FILE", type=path_argument,
                   help="write one row per step: " + ", ".join(CSV_COLUMNS) + "; an existing "
                        "CSV of this command is replaced, nothing else is")
    p.set_defaults(func=report_command)


def _line(key: str, value) -> None:
    print(f"{key:<16}{value}")


# -------------------------------------------------------------------- inspect

def inspect_command(args) -> int:
    from coppelius import exchange  # safetensors files and Hugging Face directories
    from coppelius import shards  # token streams and shards (SPEC 8, 22)

    if shards.is_pattern(args.path) or _shard_folder(args.path):
        return _inspect_stream(args.path)
    if os.path.isdir(args.path):
        exchange.inspect_hf(args.path, _line)
        return 0
    try:
        with open_regular(args.path) as f:  # a FIFO would block: never opened
            magic = f.read(9)
    except OSError as e:
        raise CoppeliusError(f"{args.path}: cannot read: {e.strerror or e}") from None
    if magic[:8] == checkpoint.MAGIC:
        return _inspect_checkpoint(args.path)
    elif magic[:8] == results.MAGIC:
        _inspect_results(args.path)
    elif magic[8:] == b"{":  # safetensors: a little-endian header length, then its JSON
        exchange.inspect_safetensors(args.path, _line)
    elif magic[:4] == shards.LLMC_MAGIC.to_bytes(4, "little") or \
            args.path.endswith(shards.SHARD_SUFFIXES):
        return _inspect_stream(args.path)
    else:
        raise CoppeliusError(f"{args.path}: not a checkpoint, result file, safetensors file, "
                             f"token stream (.tokens), shard (.bin) or Hugging Face directory "
                             f"(magic {magic[:8]!r})")
    return 0


def _shard_folder(path) -> bool:
    """A folder of shards: no config.json or safetensors file, and files
    ending in .bin or .tokens none of which is a checkpoint or result file
    (a run directory is not a stream)."""
    from coppelius import shards

    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if any(n == "config.json" or n.endswith(".safetensors") for n in names):
        return False
    found = False
    for n in names:
        if n.endswith(shards.SHARD_SUFFIXES) and not n.startswith("."):
            try:
                with open_regular(os.path.join(path, n)) as f:
                    magic = f.read(8)
            except OSError:
                continue
            if magic in (checkpoint.MAGIC, results.MAGIC):
                return False
            found = True
    return found


def _inspect_stream(path) -> int:
    from coppelius import shards

    for key, value in shards.describe(path):  # every shard checked before anything is printed
        _line(key, value)
    return 0


def _inspect_checkpoint(path) -> int:
    info = checkpoint.inspect(path)  # the structure is checked before anything is printed
    h = info.header
    count = info.payload_bytes // 12
    _line("checkpoint", info.path)
    for key in checkpoint.IDENTITY_KEYS:
        _line(key, h[key])
    _line("step", h["step"])
    _line("contexts", h["contexts"])
    _line("parameters", f"{count} in {len(h['parameters'])} tensors")
    _line("payload bytes", f"{info.payload_bytes} at offset {info.payload_offset}")
    _line("file bytes", info.file_size)
    if info.digest_ok:
        print(f"sha256 ok {info.sha256}")
        return _inspect_binding(info.path, h)
    print(f"sha256 MISMATCH: trailer {info.trailer_sha256}, content {info.sha256}")
    print(f"coppelius inspect: error: checkpoint {info.path}: SHA-256 mismatch: the file is "
          f"damaged and no run will load it", file=sys.stderr)
    return 2


def _inspect_binding(path, header: dict) -> int:
    """Whether the checkpoint's model binds every tensor as `train` binds
    it (names, shapes, dtypes, moments; reference/binding.py): a file whose
    digest is right but which no command loads says so, as train would."""
    from coppelius.reference.binding import bind_vectors
    from coppelius.reference.config import config_from_identity
    from coppelius.reference.sources import CheckpointFileSource

    try:
        config = config_from_identity(header["model"], f"checkpoint {path}")
        with CheckpointFileSource(path) as source:
            bind_vectors(source, config, moments=True)
    except CoppeliusError as e:
        print(f"binding        refused: {e}")
        print(f"coppelius inspect: error: {e}", file=sys.stderr)
        return 2
    print("binding        ok: every parameter and both moments bind to the model")
    return 0


def _inspect_results(path) -> None:
    r = results.read_results(path)
    _line("result file", r.path)
    for key in sorted(r.header):
        _line(key, r.header[key])
    _line("version", r.version)
    _line("records", f"forward {int(r.forward is not None)}, steps {len(r.steps)}, "
                     f"timings {len(r.timings)}, norms {len(r.norms)}, evals {len(r.evals)}, "
                     f"final {int(r.final is not None)}")
    if r.steps:
        _line("step range", f"{r.steps[0][0]}..{r.steps[-1][0]}")
    if r.evals:
        _line("evaluations", f"{len(r.evals)} of {len(r.evals[0][2])} contexts, after "
                             f"{step_ranges(r.eval_steps.tolist())} updates")
    _line("complete", "yes" if r.complete else "no")
    if r.stopped:
        _line("stopped early", f"yes: {r.stopped}")
    elif not r.complete:  # no final record and no reason: killed, or still being written
        _line("stopped early", f"unknown: the file ends after step {r.steps[-1][0]} without a "
                               "final record (the run was killed, or is still running)"
              if r.steps else "unknown: no step recorded yet")
    else:
        _line("stopped early", "no")


# --------------------------------------------------------------------- report

def summarize(run: Run) -> dict:
    """The numbers `report` prints. Mean losses are float64 means of the
    float32 row losses of each step."""
    steps, means = run.steps, run.loss
    B, T = run.files[-1].header["batch"], run.files[-1].header["context"]
    ok = np.isfinite(run.host) & (run.host > 0)
    rates = B * T / run.host[ok]
    best = int(np.nanargmin(means)) if np.isfinite(means).any() else None
    out = {
        "steps": len(steps),
        "first": (int(steps[0]), float(means[0])) if len(steps) else None,
        "last": (int(steps[-1]), float(means[-1])) if len(steps) else None,
        "min": (int(steps[best]), float(means[best])) if best is not None else None,
        "tokens_per_second": float(np.median(rates)) if len(rates) else None,
        "timed_steps": len(rates),
        "complete": run.files[-1].complete,
        "stopped": run.files[-1].stopped,
        "eval_last": None, "eval_best": None, "norm_last": None, "norm_max": None, "lr_last": None,
    }
    if len(run.eval_steps):
        out["eval_last"] = (int(run.eval_steps[-1]), float(run.eval_means[-1]), int(run.eval_k[-1]))
        if np.isfinite(run.eval_means).any():
            k = int(np.nanargmin(run.eval_means))
            out["eval_best"] = (int(run.eval_steps[k]), float(run.eval_means[k]))
    if len(run.norms):
        out["norm_last"] = (int(run.norm_steps[-1]), float(run.norms[-1]))
        if np.isfinite(run.norms).any():
            k = int(np.nanargmax(np.where(np.isfinite(run.norms), run.norms, np.nan)))
            out["norm_max"] = (int(run.norm_steps[k]), float(run.norms[k]))
    if len(steps) and np.isfinite(run.lr[-1]):
        out["lr_last"] = (int(steps[-1]), float(run.lr[-1]))
    return out


def _schedule_text(learner: str) -> str:
    try:
        hyper, _ = learner_from_identity(learner)
    except CoppeliusError:
        return "learner not understood"
    decay = f", decay {hyper.decay}" if hyper.schedule == "wsd" else ""
    text = "constant" if hyper.schedule == "constant" else (
        f"{hyper.schedule}: warmup {hyper.warmup}, total {hyper.total}{decay}, "
        f"floor {rational_text(hyper.floor)}")
    return text + (f"; clip {decimal_text(hyper.clip)}" if hyper.clip is not None else "")


def decimal_text(q) -> str:
    """An exact rational as a reader writes it: 1, 0.5, 2.25; one with no
    finite decimal form in lowest terms (1/3)."""
    numerator, _, denominator = rational_text(q).partition("/")
    if denominator == "1":
        return numerator
    if denominator.strip("0") != "1":  # not a power of ten
        return f"{numerator}/{denominator}"
    places = len(denominator) - 1
    sign, digits = ("-", numerator[1:]) if numerator.startswith("-") else ("", numerator)
    digits = digits.rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")


def _check_own_output(path, what: str, start: bytes, inputs, kind: str, option: str) -> None:
    """An output path of this command: a regular file or absent, none of
    the command's `inputs`, and if it exists, a file that begins with
    `start` (`kind`: one this command or a run wrote); any other file is not
    the command's to replace."""
    output_target(path, what)
    for other in inputs:
        if same_file(path, other):
            raise OutputError(f"{what} {path}: is {other}, an input of this command (or its other output)")
    try:
        with open_regular(path) as f:
            found = f.read(len(start))
    except FileNotFoundError:
        return
    except OSError as e:
        raise OutputError(f"{what} {path}: cannot read what is there ({e.strerror or e})") from None
    if found != start:
        raise OutputError(f"{what} {path}: exists and is not {kind}; refusing to replace it "
                          f"(give {option} another path)")


def check_plot_path(path, inputs=()) -> None:
    """An explicit plot path: if it exists, a PNG (a plot a run or report wrote)."""
    _check_own_output(path, "plot", PNG_MAGIC, inputs, "a PNG", "--plot")


def check_csv_path(path, inputs=()) -> None:
    """The --csv path (`inputs`: the command's result files and its plot):
    if it exists, a CSV this command wrote (its first line the CSV_COLUMNS
    header)."""
    _check_own_output(path, "csv", (",".join(CSV_COLUMNS) + "\n").encode(), inputs,
                      "a CSV of `coppelius report`", "--csv")


def report_command(args) -> int:
    if args.compare:
        return compare_command(args)
    if args.results is None:
        raise CoppeliusError("report: give RESULTS or RUN_DIR, or --compare RUN_DIR...")
    whole_run = os.path.isdir(args.results)
    inputs = [] if whole_run else [args.results]
    if args.plot is not None:  # before anything is read
        check_plot_path(args.plot, inputs)
    if args.csv is not None:
        check_csv_path(args.csv, inputs + ([args.plot] if args.plot is not None else []))
    if whole_run:
        files = read_run_dir(args.results)
        png = args.plot or os.path.join(args.results, RUN_PLOT)
    else:
        files = [results.read_results(args.results)]
        png = args.plot
    if png:  # the run directory's default plot too: a PNG or nothing is replaced
        check_plot_path(png, [r.path for r in files])
    if args.csv is not None:
        check_csv_path(args.csv, [r.path for r in files] + ([png] if png else []))
    run = stitch(files)
    if not len(run.steps):
        where = (f"run directory {args.results}: no step records in its {len(files)} result "
                 f"file{'s' if len(files) > 1 else ''}") if whole_run else \
            f"result file {files[0].path}: no step records to report"
        stopped = files[-1].stopped
        raise CoppeliusError(where + (f" ({stopped})" if stopped else ""))
    s = summarize(run)
    h = files[-1].header
    if whole_run:
        _line("run directory", args.results)
        _line("result files", f"{len(files)}: " + ", ".join(
            f"{os.path.basename(r.path)} ({step_ranges([x for x, _ in r.steps]) or 'no steps'})" for r in files))
        _line("backend", ", ".join(dict.fromkeys(r.header["backend"] for r in files)))
        _line("steps read", f"{s['steps']}, steps {run.steps[0]}..{run.steps[-1]}")
    else:
        _line("result file", files[0].path)
        _line("backend", h["backend"])
        _line("steps read", f"{s['steps']} of {h['steps']} planned, from step {h['first_step']}")
    for key, text in run.notes:
        _line(key, text)
    for key in ("first", "last", "min"):
        if s[key] is None:  # min: every loss is non-finite (a run stopped at its first step)
            _line(f"{key} loss", "none finite")
            continue
        step, loss = s[key]
        _line(f"{key} loss", f"{loss:.6f} at step {step}")
    if s["eval_last"]:
        step, loss, K = s["eval_last"]
        best = f"best {s['eval_best'][1]:.6f} after {s['eval_best'][0]}; " if s["eval_best"] else ""
        _line("held-out loss", f"{loss:.6f} after {step} updates ({best}{len(run.eval_steps)} "
                               f"evaluations, {K} contexts)")
    if s["norm_last"]:
        step, norm = s["norm_last"]
        peak = f" (max {s['norm_max'][1]:.4g} at step {s['norm_max'][0]})" if s["norm_max"] else ""
        _line("gradient norm", f"{norm:.4g} at step {step}{peak}")
    if s["lr_last"]:
        _line("learning rate", f"{s['lr_last'][1]:.4g} at step {s['lr_last'][0]} "
                               f"({_schedule_text(h['learner'])})")
    if s["tokens_per_second"] is None:
        _line("tokens/s", "n/a (no timing records)")
    else:
        _line("tokens/s", f"{s['tokens_per_second']:.1f} (median of {s['timed_steps']} steps)")
    # the metrics records (version 3): stitched files' steps may repeat; each file's own
    mfu = [m[3] for r in files for m in r.metrics if math.isfinite(m[3])]
    memory = [m[4] for r in files for m in r.metrics if math.isfinite(m[4])]
    if mfu:
        _line("MFU", f"{100 * float(np.median(mfu)):.2f}% (median of {len(mfu)} steps)")
    if memory:
        _line("device memory", f"{max(memory) / 2**30:.2f} GiB (the most in use)")
    if s["complete"]:
        _line("completed", "yes")
    else:
        _line("completed", f"no ({s['stopped'] or 'no final record'})")
    outputs = []  # (what, path, write_body): published together, or neither
    if png:
        outputs.append(("plot", png, png_writer(run_figure(run))))
    if args.csv:
        body = csv_body(run)
        outputs.append(("csv", args.csv, lambda f: f.write(body)))
    publish_together(outputs)
    for what, path, _ in outputs:
        _line(what, path)
    return 0


def publish_together(outputs: list) -> None:
    """Publish each (what, path, write_body) of `outputs`: every file is
    written and synced first, then each is renamed over its path, so that a
    failure while writing one (a full disk) publishes none."""
    staged = []
    try:
        for what, path, write_body in outputs:
            try:
                staged.append((what, path, stage(path, write_body)))
            except OSError as e:
                raise CoppeliusError(f"{what} {path}: cannot write: {e.strerror or e}") from None
        for what, path, file in staged:
            try:
                file.commit()
            except OSError as e:
                raise CoppeliusError(f"{what} {path}: cannot write: {e.strerror or e}") from None
    finally:
        for _, _, file in staged:
            file.discard()


# ----------------------------------------------------------------------- plot

def ema(x: np.ndarray, beta: float = EMA_BETA) -> np.ndarray:
    """Exponential moving average with the (1 - beta^k) bias correction."""
    out = np.empty(len(x))
    acc = 0.0
    for k, v in enumerate(x):
        acc = beta * acc + (1 - beta) * v
        out[k] = acc / (1 - beta ** (k + 1))
    return out


def _segments(steps: np.ndarray) -> list:
    """Slices of runs of consecutive step numbers: lines break at a gap, and
    the smoothing starts afresh after one."""
    cuts = [0] + (np.nonzero(np.diff(steps) > 1)[0] + 1).tolist() + [len(steps)]
    return [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def _broken(steps: np.ndarray, y: np.ndarray) -> tuple:
    """x and y with a NaN after each gap, so that one line does not bridge it."""
    xs, ys = [], []
    for part in _segments(steps):
        xs += [steps[part].astype(np.float64), [np.nan]]
        ys += [np.asarray(y[part], dtype=np.float64), [np.nan]]
    return np.concatenate(xs), np.concatenate(ys)


def _plot_summary(run: Run) -> list:
    s = summarize(run)
    files = len(run.files)
    out = [f"steps {run.steps[0]}..{run.steps[-1]}: {s['steps']} read"
           + (f" from {files} files" if files > 1 else ""),
           f"training loss  {s['last'][1]:.4f} at step {s['last'][0]}",
           f"  (EMA {ema(run.loss[_segments(run.steps)[-1]])[-1]:.4f}, "
           + (f"min {s['min'][1]:.4f})" if s["min"] else "none finite)")]
    if s["eval_last"]:
        out.append(f"held-out loss  {s['eval_last'][1]:.4f} after {s['eval_last'][0]}")
        if s["eval_best"]:
            out.append(f"  (best {s['eval_best'][1]:.4f} after {s['eval_best'][0]})")
    if s["norm_last"]:
        out.append(f"gradient norm  {s['norm_last'][1]:.4g} at step {s['norm_last'][0]}")
    schedule, _, clip = _schedule_text(run.files[-1].header["learner"]).partition("; ")
    kind, _, shape = schedule.partition(": ")
    out.append(f"learning rate  {kind}")
    out += [f"  ({shape})"] if shape else []
    out += [f"clipping       {clip.removeprefix('clip ')}"] if clip else []
    if s["tokens_per_second"] is not None:
        out.append(f"tokens/s       {s['tokens_per_second']:.0f} (median)")
    return out


def plot(r: results.Results, path, replace: bool = True) -> None:
    """The plot of one result file (train draws it when a run ends). With
    replace=False an existing file is never replaced (FileExistsError)."""
    plot_run(stitch([r]), path, replace=replace)


def plot_run(run: Run, path, replace: bool = True) -> None:
    """The run's figure (run_figure) published atomically as a PNG. With
    replace=False an existing file is never replaced (FileExistsError)."""
    try:
        publish(path, png_writer(run_figure(run)), replace=replace)
    except FileExistsError:
        raise
    except OSError as e:
        raise CoppeliusError(f"plot {path}: cannot write: {e.strerror or e}") from None


def png_writer(fig):
    """write_body of a publication: the figure as a PNG."""
    return lambda f: fig.savefig(f, format="png", dpi=100)


def run_figure(run: Run):
    """Training loss (raw, faint, and smoothed) with the held-out loss on the
    same axes, the loss by position in the context over the last steps, and
    below, on the same step axis, the gradient norm and the learning rate
    where the files have them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lower = (["norm"] if len(run.norms) else []) + (["lr"] if np.isfinite(run.lr).any() else [])
    fig = Figure(figsize=(12, 4.2 + 1.9 * len(lower)), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global state
    grid = fig.add_gridspec(1 + len(lower), 2, width_ratios=(2.2, 1),
                            height_ratios=(3.2,) + (1.4,) * len(lower))

    ax = fig.add_subplot(grid[0, 0])
    ax.plot(*_broken(run.steps, run.loss), lw=0.7, alpha=0.35, color="C0", label="training loss")
    smooth = np.concatenate([ema(run.loss[part]) for part in _segments(run.steps)])
    ax.plot(*_broken(run.steps, smooth), lw=1.8, color="C0", label=f"training, EMA ({EMA_BETA})")
    if len(run.eval_steps):
        K = int(run.eval_k[-1])
        ax.plot(run.eval_steps, run.eval_means, "o-", ms=4, lw=1.4, color="C3",
                label=f"held-out ({K} context{'s' if K > 1 else ''})")
    ax.set_ylabel("loss (nats)")
    ax.set_title("loss")
    left = [ax]
    for i, kind in enumerate(lower):
        a = fig.add_subplot(grid[1 + i, 0], sharex=ax)
        if kind == "norm":
            a.plot(*_broken(run.norm_steps, run.norms), lw=0.8, color="C2", label="before clipping")
            finite = run.norms[np.isfinite(run.norms)]
            if len(finite) and finite.min() > 0 and finite.max() > 20 * finite.min():
                a.set_yscale("log")  # early norms are orders of magnitude above later ones
            clips = [c for c in run.clips if c is not None]
            if len(clips) == 1:
                a.axhline(float(clips[0]), color="C3", lw=1, ls="--", label=f"clip {clips[0]}")
            a.set_ylabel("gradient norm")
        else:
            a.plot(*_broken(run.steps, run.lr), lw=1.2, color="C4")
            a.set_ylabel("learning rate")
            a.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
            a.set_ylim(bottom=0)
        left.append(a)
    for a in left:
        for i, start in enumerate(run.starts):  # where an invocation resumed the run
            a.axvline(start, color="0.55", lw=0.8, ls=":",
                      label="resumed" if i == 0 and a is ax else None)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(loc="upper right", fontsize=8)
        if a is not left[-1]:
            a.tick_params(labelbottom=False)
    left[-1].set_xlabel("step (updates done)")

    last = max(1, math.ceil(LAST_FRACTION * len(run.rows)))
    by_position = np.mean([x.mean(axis=0, dtype=np.float64) for x in run.rows[-last:]], axis=0)  # (T,)
    a = fig.add_subplot(grid[0, 1])
    a.plot(np.arange(len(by_position)), by_position, lw=1.2)
    a.set_xlabel("position in the context")
    a.set_ylabel("loss (nats)")
    a.set_title(f"loss by position, last {last} step{'s' if last > 1 else ''}")
    a.grid(alpha=0.3)
    if lower:  # the space below the by-position curve holds the summary's numbers
        a = fig.add_subplot(grid[1:, 1])
        a.axis("off")
        text = a.text(0.02, 0.98, "\n".join(_plot_summary(run)), va="top", ha="left",
                      fontsize=9, family="monospace", transform=a.transAxes)
        text.set_in_layout(False)  # the column's width is the curve's, not the text's
    backends = ", ".join(dict.fromkeys(r.header["backend"] for r in run.files))
    fig.suptitle(f"{backends}: {run.files[-1].header['model']}", fontsize=8)
    return fig


def plot_beside(r: results.Results, results_path) -> str:
    """A run's loss plot beside its result file: `<stem>.png`, or
    `<stem>-1.png`, `-2`, ... when that name is taken (by the checkpoint, a
    plot of another run, anything): a derived output never replaces a file.
    Returns the path written."""
    stem = os.path.splitext(os.fspath(results_path))[0]
    k = 0
    while True:
        path = f"{stem}.png" if k == 0 else f"{stem}-{k}.png"
        if os.path.lexists(path):  # whatever it is (a FIFO too): taken
            k += 1
            continue
        try:
            plot(r, path, replace=False)
            return path
        except FileExistsError:
            k += 1


# -------------------------------------------------------------------- compare

def compare_command(args) -> int:
    """`report --compare RUN_DIR...`: the runs' loss curves on one figure."""
    dirs = ([args.results] if args.results is not None else []) + list(args.compare)
    if args.csv is not None:
        raise CoppeliusError("--csv: not with --compare (one run's CSV: report RUN_DIR --csv)")
    for d in dirs:
        if not os.path.isdir(d):
            raise CoppeliusError(f"--compare {d}: not a run directory")
    png = args.plot or COMPARE_PLOT
    check_plot_path(png)
    runs = []
    for d in dirs:
        run = stitch(read_run_dir(d))
        if not len(run.steps):
            raise CoppeliusError(f"--compare {d}: no step records in its result files")
        runs.append(run)
    names = run_names(dirs)
    fig = compare_figure(runs, names)
    for d, name, run in zip(dirs, names, runs):
        held = (f", held-out {float(run.eval_means[-1]):.4f} after {int(run.eval_steps[-1])}"
                if len(run.eval_steps) else "")
        _line(name, f"loss {run.loss[-1]:.4f} at step {int(run.steps[-1])}{held} ({d})")
    _publish_figure(fig, png)
    _line("plot", png)
    return 0


def run_names(dirs: list) -> list:
    """Each run's legend name: its directory's name, or its path where two
    share a name."""
    base = [os.path.basename(os.path.normpath(os.path.abspath(d))) for d in dirs]
    return [b if base.count(b) == 1 else os.path.normpath(d) for b, d in zip(base, dirs)]


def tokens_of(run: Run, steps: np.ndarray) -> np.ndarray:
    """Tokens trained on before each step (updates done u: u B T), B and T
    the run's last file's."""
    h = run.files[-1].header
    return np.asarray(steps, dtype=np.float64) * h["batch"] * h["context"]


def compare_figure(runs: list, names: list):
    """The figure of `report --compare`: by step (left) and by tokens
    (right), per run its smoothed training loss (solid) and its held-out
    loss (dashed, markers) in one colour."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_tokens = fig.subplots(1, 2, sharey=True)
    for i, (run, name) in enumerate(zip(runs, names)):
        color = f"C{i % 10}"
        smooth = np.concatenate([ema(run.loss[part]) for part in _segments(run.steps)])
        for ax, x in ((by_step, run.steps), (by_tokens, tokens_of(run, run.steps))):
            xs, ys = _broken(run.steps, smooth)
            if ax is by_tokens:
                xs = tokens_of(run, xs)  # NaN stays NaN
            ax.plot(xs, ys, lw=1.6, color=color, label=f"{name}: training (EMA {EMA_BETA})")
            if len(run.eval_steps):
                ex = run.eval_steps if ax is by_step else tokens_of(run, run.eval_steps)
                ax.plot(ex, run.eval_means, "o--", ms=4, lw=1.2, color=color,
                        label=f"{name}: held-out")
    by_step.set_xlabel("step (updates done)")
    by_tokens.set_xlabel("tokens trained on")
    by_step.set_ylabel("loss (nats)")
    by_step.set_title("by step")
    by_tokens.set_title("by tokens")
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    return fig


def _publish_figure(fig, path) -> None:
    try:
        publish(path, lambda f: fig.savefig(f, format="png", dpi=100))
    except OSError as e:
        raise CoppeliusError(f"plot {path}: cannot write: {e.strerror or e}") from None
