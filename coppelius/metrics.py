"""Live metrics of `coppelius train`: model FLOP utilisation (MFU), device
memory, and the writers that send every step's numbers to TensorBoard event
files (tensorboardX) and, when asked, to Weights & Biases.

MFU is the model FLOP of a step (bench.flops_per_step: 6 N T plus the
attention products, per context) over the step's host seconds (its timing
record's) times the peak dense bf16 FLOP/s of the devices that took it. The
peak is --peak-tflops X when given, else the table below by the device's
name (CUDA), else unknown: no MFU (the reference and MLX, unless given).

TensorBoard (SPEC 11's reading in docs/SPEC.md): the training scalars of
step s are drawn at s, a held-out evaluation after u updates at u, as the
report's plot draws them. Each invocation writes a new event file whose
first event purges what earlier files drew at or after its first step (a
run resumed from an older checkpoint trains those steps again); the
held-out loss at the first step, which the earlier invocation evaluated and
this one does not, is read from the earlier event files and drawn again.
"""

from __future__ import annotations

import glob
import math
import os
import time

from coppelius.reference.errors import RunError
from coppelius.reference.fsutil import signals_deferred

# Peak dense (no sparsity) bf16 tensor FLOP/s in TFLOP/s, from the vendors'
# datasheets; the first entry whose every word is in the device's name (as
# CUDA reports it, lower-cased) is taken, so the more specific come first.
PEAK_TFLOPS = (
    (("h200", "nvl"), 835.0),
    (("h200",), 989.0),
    (("h100", "pcie"), 756.0),
    (("h100", "nvl"), 835.0),
    (("h100",), 989.0),  # SXM
    (("a100",), 312.0),
    (("l40s",), 362.0),
    (("l4",), 121.0),
    (("a10",), 125.0),
    (("rtx", "4090"), 165.0),
)
GIB = 2**30


def peak_tflops_of(name: str | None) -> float | None:
    """The table's peak for a device name, None when it is not in the table."""
    if not name:
        return None
    words = name.lower().replace("-", " ").split()
    for keys, tflops in PEAK_TFLOPS:
        if all(k in words for k in keys):
            return tflops
    return None


def device_name(backend: str) -> str | None:
    """The CUDA device's name on the cupy backend, else None."""
    if backend != "cupy":
        return None
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no device, or a stand-in without it: no name, no MFU
        return None


def device_memory(backend: str) -> float:
    """Device bytes the backend holds now: CuPy's memory pool, MLX's active
    memory; NaN where the backend has no device memory (the reference)."""
    try:
        if backend == "cupy":
            import cupy

            return float(cupy.get_default_memory_pool().total_bytes())
        if backend == "mlx":
            import mlx.core as mx

            return float(mx.get_active_memory())
    except Exception:  # an old library, a stand-in without it
        pass
    return math.nan


def check_peak(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise RunError(f"--peak-tflops {value}: must be a positive number (TFLOP/s)")
    return float(value)


class Meter:
    """Each step's MFU and device memory: `flops` per step, `peak` FLOP/s of
    all the run's devices together (None: unknown)."""

    def __init__(self, config, batch: int, backend: str, peak_tflops=None, devices: int = 1):
        from coppelius.bench import flops_per_step

        self.backend = backend
        self.flops = flops_per_step(config, batch)
        peak = check_peak(peak_tflops)
        self.device = device_name(backend)
        if peak is None:
            peak = peak_tflops_of(self.device)
        self.peak = None if peak is None else peak * 1e12 * devices

    def mfu(self, seconds: float) -> float:
        if self.peak is None or not seconds > 0:
            return math.nan
        return self.flops / (seconds * self.peak)

    def memory(self) -> float:
        return device_memory(self.backend)

    @staticmethod
    def text(mfu: float, memory: float) -> str:
        """'  mfu 41.3%  mem 2.10 GiB', the parts known."""
        out = f"  mfu {100 * mfu:.1f}%" if math.isfinite(mfu) else ""
        return out + (f"  mem {memory / GIB:.2f} GiB" if math.isfinite(memory) else "")


# ---------------------------------------------------------------- writers

def tensorboard_dir(options: dict, run_dir) -> str | None:
    """Where the event files go: --tensorboard DIR, else RUN_DIR/tb; None
    with --no-tensorboard (remembered as false)."""
    value = options.get("tensorboard")
    if value is False:
        return None
    return value if isinstance(value, str) else os.path.join(run_dir, "tb")


def check_writers(options: dict, run_dir) -> None:
    """Refuse, before anything is trained, a TensorBoard directory that
    cannot be written or without the tensorboardX package (a tree run
    without its install), and --wandb without the wandb package."""
    directory = tensorboard_dir(options, run_dir)
    if directory is not None:
        if not _importable("tensorboardX"):
            raise RunError(f"--tensorboard {directory}: the tensorboardX package is not "
                           f"installed (pip install tensorboardX), or --no-tensorboard")
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".coppelius-probe-{os.getpid()}")
            with open(probe, "xb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise RunError(f"--tensorboard {directory}: cannot write there "
                           f"({e.strerror or e})") from None
    if options.get("wandb"):
        if not _importable("wandb"):
            raise RunError(f"--wandb {options['wandb']}: the wandb package is not installed "
                           f"(pip install wandb)")


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # (None in sys.modules: ValueError)
        return False


def previous_scalar(tb_dir, tag: str, step: int):
    """The value of `tag` at `step` that TensorBoard shows now from the
    directory's event files (in their order, each one's session start
    purging what earlier ones drew at or after its step), or None. A file
    cut short (a run killed while writing) is read to its last whole event."""
    import struct

    from tensorboardX.proto import event_pb2

    found = None
    for path in sorted(glob.glob(os.path.join(glob.escape(os.fspath(tb_dir)),
                                              "events.out.tfevents.*"))):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        at = 0
        while at + 12 <= len(data):  # uint64 length, its CRC, the event, its CRC
            (n,) = struct.unpack_from("<Q", data, at)
            if at + 16 + n > len(data):
                break
            event = event_pb2.Event()
            try:
                event.ParseFromString(data[at + 12:at + 12 + n])
            except Exception:  # damage: nothing after it is trusted
                break
            at += 16 + n
            if event.HasField("session_log") and event.session_log.status == \
                    event.session_log.START and event.step <= step:
                found = None
            elif event.step == step and event.HasField("summary"):
                for value in event.summary.value:
                    if value.tag == tag:
                        found = float(value.simple_value)
    return found


class Live:
    """The TensorBoard event file (and W&B run) of one invocation; a no-op
    without either. scalars(step, values) draws one step's values; flush()
    at each publication; close() at the end."""

    def __init__(self, tb_dir, wandb_project, run_dir, first_step: int, config: dict):
        self.tb = self.wandb = None
        if tb_dir is not None:
            from tensorboardX import SummaryWriter

            # a file of its own (time, pid) whatever the invocation; its first
            # event purges what earlier ones drew from first_step on
            suffix = f".{time.time_ns()}.{os.getpid()}"
            earlier = previous_scalar(tb_dir, "eval/loss", first_step) if first_step else None
            self.tb = SummaryWriter(logdir=tb_dir, purge_step=first_step, flush_secs=3600,
                                    filename_suffix=suffix)
            if earlier is not None:
                self.tb.add_scalar("eval/loss", earlier, first_step)
        if wandb_project:
            import wandb  # what the environment says (WANDB_MODE=offline, say) holds

            try:
                self.wandb = wandb.init(project=wandb_project, name=os.path.basename(
                    os.path.abspath(run_dir)), dir=os.fspath(run_dir), config=config)
            except Exception as e:
                self.close()
                detail = (str(e).splitlines() or [type(e).__name__])[0]
                raise RunError(f"--wandb {wandb_project}: {detail}") from None

    # Each call holds the signals (fsutil.signals_deferred) until it returns:
    # a second Ctrl-C's exception raised inside tensorboardX's writer (its
    # multiprocessing queue is not safe against one) was seen to leave its
    # worker never receiving the stop, and the close then waited for ever.

    def scalars(self, step: int, values: dict) -> None:
        """values: tag -> number; NaN ones (unknown) are left out."""
        known = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        with signals_deferred():
            if self.tb is not None:
                for tag, v in known.items():
                    self.tb.add_scalar(tag, v, step)
            if self.wandb is not None and known:
                self.wandb.log(known, step=step)

    def flush(self) -> None:
        if self.tb is not None:
            with signals_deferred():
                self.tb.flush()

    def close(self) -> None:
        with signals_deferred():
            if self.tb is not None:
                self.tb.close()
                self.tb = None
            if self.wandb is not None:
                self.wandb.finish()
                self.wandb = None
