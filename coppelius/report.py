"""`coppelius inspect PATH` and `coppelius report RESULTS [--plot PNG]`.

inspect recognises a checkpoint (SPEC 10) or a result file (SPEC 11) by its
magic and shows its envelope after checking it; report summarises a result
file's losses and throughput and can plot them.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from coppelius.reference import checkpoint, results
from coppelius.reference.errors import CoppeliusError, OutputError
from coppelius.reference.fsutil import open_regular, output_target, path_argument, publish, same_file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EMA_BETA = 0.9  # smoothing of the plotted loss curve, bias-corrected as in Adam
LAST_FRACTION = 0.1  # the by-position curve averages the last 10% of steps (at least one)


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="check a checkpoint or result file and show its envelope",
                              description="Recognise a checkpoint or a result file by its magic, "
                                          "check it, and print its envelope.")
    p.add_argument("path", metavar="PATH", type=path_argument)
    p.set_defaults(func=inspect_command)
    p = subparsers.add_parser("report", help="summarise a result file; optionally plot its losses",
                              description="Summarise the losses and throughput of a result file.")
    p.add_argument("results", metavar="RESULTS", type=path_argument)
    p.add_argument("--plot", metavar="PNG", type=path_argument,
                   help="write a loss plot (PNG) to this path (an existing PNG is replaced, "
                        "nothing else is)")
    p.set_defaults(func=report_command)


def _line(key: str, value) -> None:
    print(f"{key:<16}{value}")


# -------------------------------------------------------------------- inspect

def inspect_command(args) -> int:
    try:
        with open_regular(args.path) as f:  # a FIFO would block: never opened
            magic = f.read(8)
    except OSError as e:
        raise CoppeliusError(f"{args.path}: cannot read: {e.strerror or e}") from None
    if magic == checkpoint.MAGIC:
        return _inspect_checkpoint(args.path)
    elif magic == results.MAGIC:
        _inspect_results(args.path)
    else:
        raise CoppeliusError(f"{args.path}: not a checkpoint or result file (magic {magic!r})")
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
        return 0
    print(f"sha256 MISMATCH: trailer {info.trailer_sha256}, content {info.sha256}")
    print(f"coppelius inspect: error: checkpoint {info.path}: SHA-256 mismatch: the file is "
          f"damaged and no run will load it", file=sys.stderr)
    return 2


def _inspect_results(path) -> None:
    r = results.read_results(path)
    _line("result file", r.path)
    for key in sorted(r.header):
        _line(key, r.header[key])
    _line("records", f"forward {int(r.forward is not None)}, steps {len(r.steps)}, "
                     f"timings {len(r.timings)}, final {int(r.final is not None)}")
    if r.steps:
        _line("step range", f"{r.steps[0][0]}..{r.steps[-1][0]}")
    _line("complete", "yes" if r.complete else "no")
    _line("stopped early", f"yes: {r.stopped}" if r.stopped else "no")


# --------------------------------------------------------------------- report

def summarize(r: results.Results) -> dict:
    """The numbers `report` prints. Mean losses are float64 means of the
    float32 row losses of each step."""
    steps = np.array([s for s, _ in r.steps], dtype=np.int64)
    means = np.array([rows.mean(dtype=np.float64) for _, rows in r.steps])
    B, T = r.header["batch"], r.header["context"]
    rates = [B * T / host for _, host, _ in r.timings if math.isfinite(host) and host > 0]
    best = int(np.argmin(means)) if len(means) else None
    return {
        "steps": len(steps),
        "first": (int(steps[0]), float(means[0])) if len(steps) else None,
        "last": (int(steps[-1]), float(means[-1])) if len(steps) else None,
        "min": (int(steps[best]), float(means[best])) if best is not None else None,
        "tokens_per_second": float(np.median(rates)) if rates else None,
        "timed_steps": len(rates),
        "complete": r.complete,
        "stopped": r.stopped,
    }


def check_plot_path(path, inputs=()) -> None:
    """An explicit plot path: a regular file or absent, none of the command's
    `inputs`, and if it exists, a PNG (a plot a run or report wrote): any
    other file is not this command's to replace."""
    output_target(path, "plot")
    for other in inputs:
        if same_file(path, other):
            raise OutputError(f"plot {path}: is {other}, an input of this command")
    try:
        with open_regular(path) as f:
            magic = f.read(len(PNG_MAGIC))
    except FileNotFoundError:
        return
    except OSError as e:
        raise OutputError(f"plot {path}: cannot read what is there ({e.strerror or e})") from None
    if magic != PNG_MAGIC:
        raise OutputError(f"plot {path}: exists and is not a PNG; refusing to replace it")


def report_command(args) -> int:
    if args.plot is not None:
        check_plot_path(args.plot, [args.results])  # before anything is read
    r = results.read_results(args.results)
    if not r.steps:
        raise CoppeliusError(f"result file {r.path}: no step records to report"
                             + (f" ({r.stopped})" if r.stopped else ""))
    s = summarize(r)
    h = r.header
    _line("result file", r.path)
    _line("backend", h["backend"])
    _line("steps read", f"{s['steps']} of {h['steps']} planned, from step {h['first_step']}")
    for key in ("first", "last", "min"):
        step, loss = s[key]
        _line(f"{key} loss", f"{loss:.6f} at step {step}")
    if s["tokens_per_second"] is None:
        _line("tokens/s", "n/a (no timing records)")
    else:
        _line("tokens/s", f"{s['tokens_per_second']:.1f} (median of {s['timed_steps']} steps)")
    if r.complete:
        _line("completed", "yes")
    else:
        _line("completed", f"no ({r.stopped or 'no final record'})")
    if args.plot:
        plot(r, args.plot)
        _line("plot", args.plot)
    return 0


def ema(x: np.ndarray, beta: float = EMA_BETA) -> np.ndarray:
    """Exponential moving average with the (1 - beta^k) bias correction."""
    out = np.empty(len(x))
    acc = 0.0
    for k, v in enumerate(x):
        acc = beta * acc + (1 - beta) * v
        out[k] = acc / (1 - beta ** (k + 1))
    return out


def plot(r: results.Results, path, replace: bool = True) -> None:
    """Mean loss per step (raw and smoothed) and mean loss by position in the
    context over the last steps; published atomically as a PNG. With
    replace=False an existing file is never replaced (FileExistsError)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = np.array([s for s, _ in r.steps])
    means = np.array([rows.mean(dtype=np.float64) for _, rows in r.steps])
    last = max(1, math.ceil(LAST_FRACTION * len(r.steps)))
    by_position = np.mean([rows.mean(axis=0, dtype=np.float64) for _, rows in r.steps[-last:]],
                          axis=0)  # (T,)

    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global state
    ax = fig.add_subplot(1, 2, 1)
    ax.plot(steps, means, lw=0.8, alpha=0.4, label="mean loss")
    ax.plot(steps, ema(means), lw=1.8, label=f"EMA ({EMA_BETA})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    ax.plot(np.arange(len(by_position)), by_position, lw=1.2)
    ax.set_xlabel("position in the context")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"loss by position, last {last} step{'s' if last > 1 else ''}")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{r.header['backend']}: {r.header['model']}", fontsize=8)
    try:
        publish(path, lambda f: fig.savefig(f, format="png", dpi=100), replace=replace)
    except FileExistsError:
        raise
    except OSError as e:
        raise CoppeliusError(f"plot {path}: cannot write: {e.strerror or e}") from None


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
