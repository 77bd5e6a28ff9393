"""`coppelius bench`: milliseconds per training step of the reference, each
backend and the PyTorch peers (bench/torch_peer.py), at one or more batch
sizes, measured in one process on the same inputs and shown in one table
with ratios to the strongest peer.

A step is what training does per step: one input upload and one replay,
waited for. On CUDA the step is timed by CUDA events around the replay (the
upload is outside them, for every implementation alike); elsewhere by the
host's clock around the upload, the replay and the wait. The peers:

- `torch eager`: zero_grad, forward, backward, fused AdamW (PyTorch's
  default foreach AdamW on the CPU), `loss.item()`;
- `torch.compile + graph` (CUDA only): the same step with the loss compiled
  by torch.compile and the whole step captured once as one CUDA graph,
  PyTorch's fastest training step for this model.

Each implementation is built and warmed up on its own (compilation,
allocator growth, cuBLAS's choices), and its peak device memory read then:
CuPy's memory-pool growth for the CuPy program, `max_memory_allocated`
after `reset_peak_memory_stats` for a CUDA peer, else the program's own
device-bytes report. The timed steps are then interleaved: step i of every
implementation before step i+1 of any, so a change in the machine's load
touches all alike. Nothing here asserts a time.

The model is --preset's (default tiny) and --model's fields over it: any
member of the family (SPEC 21), which the peers build from the same Config.
A backend chosen by default that does not compute that member yet is a line
saying so, not the end of the run.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .. import accelerated
from ..reference.config import PRECISIONS, Config, Hyper, config_from_toml
from ..reference.config import preset as preset_config
from ..reference.contract import RECOMPUTE_MODES
from ..reference.errors import ConfigError, OutputError
from ..reference.limits import check_step_fits

EAGER, COMPILED = "torch eager", "torch.compile + graph"  # the peers' row names
PEERS = (EAGER, COMPILED)


@dataclass
class Timing:
    name: str  # implementation
    device: str  # cpu, cuda, gpu
    precision: str
    batch: int  # B
    ms: list  # milliseconds of each timed step by `clock`
    host_ms: list  # host milliseconds of each timed step (upload, step, wait)
    clock: str  # "cuda events" or "host"
    memory: float  # peak device bytes (NaN where unknown)
    memory_source: str
    loss: float  # mean loss of the last timed step (a sanity column, not a check)
    tokens: int  # tokens per step, B * T
    preset: str
    flops: float  # model FLOP per step (flops_per_step)
    setup_s: float = math.nan  # seconds to build and warm up (compilation included)

    @property
    def median(self) -> float:
        return float(np.median(self.ms))

    @property
    def host_median(self) -> float:
        return float(np.median(self.host_ms))


def windows(config: Config, batch: int, n: int, seed: int = 20260925) -> np.ndarray:
    """(n, B, T+1) ids uniform in [0, V): one distinct input per step."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab, size=(n, batch, config.context + 1), dtype=np.int64)


def flops_per_step(config: Config, batch: int) -> float:
    """Model FLOP of one training step: 6 N T + 6 L D T^2 per context (the
    usual estimate: 2 forward and 4 backward per multiply-add of a weight,
    plus the two attention products, causal mask not discounted). N counts
    the weights that multiply: an untied model's embedding is a gather
    (its lm_head is the product), a tied one's is also the unembedding."""
    from ..reference.params import registry

    N = registry(config).total - (0 if config.tied else config.vocab * config.d_model)
    T, L, D = config.context, config.n_layer, config.d_model
    return batch * (6.0 * N * T + 6.0 * L * D * T * T)


def preset_name(config: Config) -> str:
    from ..reference.config import PRESETS

    return next((name for name, c in PRESETS.items() if c == config), "custom")


def default_precision(backend: str) -> str:
    """SPEC section 6: bf16 on the CUDA backend, fp32 elsewhere (as declared)."""
    return accelerated.capabilities(backend).default_precision


def backend_device(backend: str) -> str:
    """cuda, gpu (MLX on Apple silicon) or cpu, as the backend declares."""
    import platform

    return accelerated.capabilities(backend).device_on(platform.system())


def computes_model(backends: list, config: Config, named: bool) -> tuple:
    """(the backends that compute this model, a line for each that does not).
    A backend refuses a family field (SPEC 21) it does not compute yet
    (its module's IMPLEMENTED) at capture: read here, before any work. One
    that --backend named is refused as `train` refuses it; one chosen by
    default is a line, so the others and the peers are still timed."""
    from ..reference.config import check_implemented

    kept, notes = [], []
    for name in backends:
        try:
            check_implemented(config, getattr(accelerated.backend_module(name), "IMPLEMENTED",
                                              ()), name)
        except ConfigError as e:
            if named:
                raise
            notes.append(f"{name}: not timed: {e}")
            continue
        kept.append(name)
    return kept, notes


def batch_list(given, default: int) -> list:
    """The --batch values in order, each once; [default] when none was given."""
    batches = list(dict.fromkeys(given)) if given else [default]
    for b in batches:
        if b < 1:
            raise ConfigError(f"--batch={b}: must be a positive integer")
    return batches


# ------------------------------------------------------------------ implementations

@dataclass
class Runner:
    """One implementation, built and warmed up: `step(tokens (B, T+1)) ->
    (loss, device seconds or NaN)` returns after the step has finished."""

    name: str
    device: str
    precision: str
    config: Config
    batch: int
    step: object
    memory: float = math.nan  # peak device bytes, read after the warm-up
    memory_source: str = "-"
    setup_s: float = math.nan
    release: object = field(default=lambda: None)
    note: str = ""  # a line before the table: how it runs where that is not its fastest way


def _cupy_pool():
    """CuPy's default memory pool, emptied of free blocks: its total then
    grows by what the next program allocates (the pool never shrinks by
    itself, so that growth is the program's peak)."""
    import cupy

    gc.collect()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    return pool


def program_runner(backend: str, config: Config, precision: str, batch: int, state,
                   warm, label: str | None = None, recompute: str | None = None) -> Runner:
    """Capture once from `state`; a step is one upload and one replay, waited for.
    recompute: the mode of capture()'s (None, "gate-up", "block"): what the
    backward computes again instead of keeping."""
    module = accelerated.backend_module(backend)
    start = time.perf_counter()
    pool = _cupy_pool() if accelerated.capabilities(backend).device_memory else None
    base = pool.total_bytes() if pool is not None else 0
    program = module.capture(config, Hyper(), precision, batch, state, recompute=recompute)

    def step(tokens):
        program.upload_input(tokens)
        return program.replay_timed_and_wait()  # waits: the step's one sync point

    for tokens in warm:
        step(tokens)
    report = program.compilation_report()
    if pool is not None:
        memory, source = pool.total_bytes() - base, "CuPy memory pool growth"
    else:
        memory, source = report["device_bytes"], "program report"
    return Runner(label or backend, backend_device(backend), precision, config, batch, step,
                  float(memory), source, time.perf_counter() - start, program.reset,
                  accelerated.attention_note(report))


class _TorchMemory:
    """The peak of torch's CUDA allocator over what was allocated at the start."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> float:
        if not self.cuda:
            return math.nan
        self.torch.cuda.synchronize()
        return float(self.torch.cuda.max_memory_allocated() - self.base)


def _cuda_timed(torch, work):
    """(work(), device seconds between CUDA events around it); no wait."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = work()
    end.record()
    return out, (start, end)


def peer_runner(kind: str, config: Config, precision: str, device: str, batch: int, state,
                warm, first) -> Runner:
    """The eager or the compiled-and-graphed PyTorch peer; `first` is a real
    input for the compiled step's own warm-up (never zeros)."""
    import torch

    from . import torch_peer

    start = time.perf_counter()
    meter = _TorchMemory(device)
    cuda = device.startswith("cuda")
    held = {}  # the peer, dropped by release()
    if kind == EAGER:
        held["peer"] = torch_peer.TorchPeer(config, state.P, precision=precision, device=device)

        def work(tokens):
            x = torch.from_numpy(tokens).to(device)  # the upload, as a backend's
            return (lambda: held["peer"].step(x))
    else:
        held["peer"] = torch_peer.CompiledGraphStep(config, state.P, first, precision=precision,
                                                    device=device)

        def work(tokens):
            held["peer"].upload(tokens)
            return held["peer"].replay

    def step(tokens):
        run = work(tokens)  # the upload: outside the clock, as a backend's
        if not cuda:
            return run().item(), math.nan
        loss, (begin, end) = _cuda_timed(torch, run)
        loss = loss.item()  # waits for the step: its one sync point
        return loss, begin.elapsed_time(end) / 1e3

    for tokens in warm:
        step(tokens)
    memory = meter.peak()

    def release():
        held.clear()
        if kind == COMPILED:
            torch._dynamo.reset()  # the compiled code of this B and its guards

    return Runner(kind, "cuda" if cuda else "cpu", precision, config, batch, step, memory,
                  "torch.cuda.max_memory_allocated" if cuda else "-",
                  time.perf_counter() - start, release)


def peer_plan(no_peer: bool, no_compile: bool, precisions: list) -> tuple:
    """([(kind, device, precision)], [lines saying which peer cannot run and why]).
    `precisions`: those of the rows timed on CUDA (the peers match them)."""
    if no_peer:
        return [], []
    try:
        import torch

        import coppelius.bench.torch_peer  # noqa: F401  (part of the source tree)
    except ImportError as e:
        return [], [f"PyTorch peers: not timed: torch is not importable ({e})"]
    if not torch.cuda.is_available():  # the CPU baseline: eager fp32
        return [(EAGER, "cpu", "fp32")], [
            f"{COMPILED}: not timed: torch sees no CUDA device (the CPU peer is eager)"]
    precisions = precisions or ["bf16"]
    targets = [(EAGER, "cuda", p) for p in precisions]
    notes = []
    if no_compile:
        notes.append(f"{COMPILED}: not timed (--no-compile)")
    else:
        targets += [(COMPILED, "cuda", p) for p in precisions]
    return targets, notes


def measure(runners: list, inputs: np.ndarray) -> list:
    """Step every runner through the same inputs, interleaved: step i of each
    before step i+1 of any."""
    ms = [[] for _ in runners]
    host_ms = [[] for _ in runners]
    losses = [math.nan] * len(runners)
    for tokens in inputs:
        for k, runner in enumerate(runners):
            start = time.perf_counter()
            loss, device_s = runner.step(tokens)
            elapsed = time.perf_counter() - start
            losses[k] = float(loss)
            host_ms[k].append(1e3 * elapsed)
            ms[k].append(1e3 * (device_s if math.isfinite(device_s) else elapsed))
    rows = []
    for k, r in enumerate(runners):
        clock = "cuda events" if all(math.isfinite(x) for x in ms[k]) and r.device == "cuda" \
            else "host"
        rows.append(Timing(r.name, r.device, r.precision, r.batch, ms[k], host_ms[k], clock,
                           r.memory, r.memory_source, losses[k], r.batch * r.config.context,
                           preset_name(r.config), flops_per_step(r.config, r.batch), r.setup_s))
    return rows


def release(runners: list) -> None:
    """Give every runner's device memory back before the next batch size."""
    for r in runners:
        r.release()
    runners.clear()
    gc.collect()
    if "cupy" in sys.modules:
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


# ------------------------------------------------------------------ the table

def strongest_peer(row: Timing, rows: list):
    """(the fastest peer row of the same preset and B, on the row's device at its
    precision, else the CPU fp32 peer; whether it was that fallback), or (None, False)."""
    peers = [p for p in rows if p.name in PEERS and p.preset == row.preset
             and p.batch == row.batch]
    for key, fallback in (((row.device, row.precision), False), (("cpu", "fp32"), True)):
        same = [p for p in peers if (p.device, p.precision) == key]
        if same:
            return min(same, key=lambda p: p.median), fallback
    return None, False


def _finite(x):
    return float(x) if x is not None and math.isfinite(x) else None


def compare(rows: list) -> list:
    """One dict per row: the times, throughput, memory, and the ratios to the
    strongest peer (None where there is no peer or no measure). The table
    and --json both show these."""
    out = []
    for r in rows:
        peer, fallback = strongest_peer(r, rows)
        seconds = r.median / 1e3
        x_time = r.median / peer.median if peer is not None else None
        x_memory = _finite(r.memory / peer.memory) if peer is not None and peer.memory > 0 \
            else None
        out.append({
            "implementation": r.name, "batch": r.batch, "precision": r.precision,
            "device": r.device, "preset": r.preset, "tokens": r.tokens,
            "median_ms": r.median, "clock": r.clock, "min_ms": min(r.ms),
            "host_median_ms": r.host_median, "ms": list(r.ms),
            "tokens_per_s": r.tokens / seconds, "tflops": r.flops / seconds / 1e12,
            "peak_memory_bytes": _finite(r.memory), "memory_source": r.memory_source,
            "peer": None if peer is None else f"{peer.name} {peer.device} {peer.precision}",
            "peer_fallback": fallback, "x_peer_time": x_time, "x_peer_memory": x_memory,
            "loss": _finite(r.loss), "setup_s": _finite(r.setup_s),
        })
    return out


LEGEND = ("ms: median per step, by CUDA events around the step on CUDA, the host's clock "
          "elsewhere; peak MiB: device memory at the step's peak; x peer: against the fastest "
          "PyTorch peer of the same B, device and precision (* the CPU fp32 peer, where there "
          "is none such)")


def format_table(table: list) -> str:
    def num(x, spec):
        return "-" if x is None else format(x, spec)

    def ratio(x, fallback):
        return "-" if x is None else f"{x:.2f}" + ("*" if fallback else "")

    lines = [f"{'implementation':<22} {'B':>3} {'precision':<9} {'device':<6} {'ms':>9} "
             f"{'host ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'peak MiB':>9} "
             f"{'x peer ms':>9} {'x peer mem':>10}  loss"]
    for r in table:
        memory = None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2 ** 20
        lines.append(
            f"{r['implementation']:<22} {r['batch']:>3} {r['precision']:<9} {r['device']:<6} "
            f"{r['median_ms']:>9.3f} {r['host_median_ms']:>9.3f} {r['tokens_per_s']:>10.0f} "
            f"{r['tflops']:>8.3f} {num(memory, '.1f'):>9} "
            f"{ratio(r['x_peer_time'], r['peer_fallback']):>9} "
            f"{ratio(r['x_peer_memory'], r['peer_fallback']):>10}  {num(r['loss'], '.4f')}")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line

def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time a training step on every backend and the PyTorch peers",
        description="Milliseconds per training step of the reference, each available "
                    "backend and the PyTorch peers (eager; torch.compile with the whole step "
                    "captured as one CUDA graph), in one run, at each --batch, with peak "
                    "device memory and the ratios to the strongest peer.")
    parser.add_argument("--preset", help="model preset (default: tiny)")
    parser.add_argument("--model", metavar="FILE.toml",
                        help="model configuration file (SPEC §17); with --preset it overrides "
                             "the preset's fields")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="backend to time besides the reference; repeatable "
                             "(default: every available one)")
    parser.add_argument("--precision", action="append", choices=PRECISIONS,
                        help="precision of the backends and the CUDA peers; repeatable "
                             "(default: bf16 on cupy, fp32 elsewhere)")
    parser.add_argument("--batch", type=int, action="append", metavar="B",
                        help="contexts per step; repeatable: one row per implementation and B "
                             "(default: the model file's batch, else 1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps of each implementation first (default: 2)")
    parser.add_argument("--recompute", action="append", nargs="?", const="gate-up",
                        choices=RECOMPUTE_MODES, metavar="MODE",
                        help="also time each backend that honours it with MODE (`train "
                             "--recompute MODE`): gate-up (the default MODE, rows named "
                             "'<backend> recompute') or block (rows '<backend> recompute "
                             "block'); repeatable")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="build, time and release each implementation before the next "
                             "(a model whose implementations do not fit on the device at "
                             "once); by default they are all built, then stepped in turn")
    parser.add_argument("--no-peer", action="store_true", help="skip the PyTorch peers")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile + CUDA graph peer (its compilation takes "
                             "tens of seconds per B)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the NumPy reference (seconds per step on the coppelius preset)")
    parser.add_argument("--gpus", type=int, metavar="N",
                        help="data parallelism: N GPUs at B = N x --batch against one GPU at "
                             "B = --batch, tokens/s and scaling (bench/distributed.py)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="with --gpus N: the N GPUs' optimizer state sharded (`train "
                             "--shard-optimizer`); one GPU alone: nothing to shard")
    parser.add_argument("--reference-coppelius", type=int, default=0, metavar="N",
                        help="also time N steps of the reference on the coppelius preset, B = 1 "
                             "(seconds per step)")
    parser.add_argument("--json", metavar="FILE", help="also write the table's rows as JSON")
    parser.set_defaults(func=run)


def progress(message: str) -> None:
    print(f"coppelius bench: {message}", file=sys.stderr, flush=True)


def bench_batch(args, config: Config, state, batch: int, backends: list, peers: list,
                notes: list) -> list:
    """Build, warm up and time every implementation at one B; rows in build order."""
    inputs = windows(config, batch, args.warmup + args.steps)
    warm, timed = inputs[:args.warmup], inputs[args.warmup:]
    runners = []
    programs = [] if args.no_reference else [
        ("reference", precision) for precision in args.precision or ["fp32"]]
    programs += [(name, precision) for name in backends
                 if not accelerated.capabilities(name).defines
                 for precision in args.precision or [default_precision(name)]]
    variants = [(name, precision, None) for name, precision in programs]
    for mode in dict.fromkeys(args.recompute or ()):  # each mode once, in order
        variants += [(name, precision, mode) for name, precision in programs
                     if mode in accelerated.capabilities(name).recompute]
    rows = []

    def ready(runner):  # all built, then stepped in turn; or each alone (--one-at-a-time)
        runners.append(runner)
        if args.one_at_a_time:
            try:
                rows.extend(measure(runners, timed))
            finally:
                release(runners)

    for name, precision, recompute in variants:
        label = name + {None: "", "gate-up": " recompute", "block": " recompute block"}[recompute]
        runner = program_runner(name, config, precision, batch, state, warm, label, recompute)
        progress(f"B={batch} {label} {precision} ready in {runner.setup_s:.1f} s")
        if runner.note:
            notes.append(f"{label}, B={batch}, {precision}: {runner.note}")
            progress(notes[-1])
        ready(runner)
    for kind, device, precision in peers:
        try:
            runner = peer_runner(kind, config, precision, device, batch, state, warm, inputs[0])
        except Exception as e:  # a peer that cannot run is a line, not the end of the bench
            gc.collect()
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            notes.append(f"{kind}, B={batch}, {precision}: not timed: {type(e).__name__}: "
                         f"{reason}")
            progress(notes[-1])
            continue
        progress(f"B={batch} {kind} {device} {precision} ready in {runner.setup_s:.1f} s")
        ready(runner)
    if runners:
        try:
            rows.extend(measure(runners, timed))
        finally:
            release(runners)
    for r in rows:  # as they come: a run cut short still shows what it measured
        progress(f"B={batch} {r.name} {r.device} {r.precision}: {r.median:.3f} ms, "
                 f"peak {r.memory / 2 ** 20:.1f} MiB")
    return rows


def run(args) -> int:
    if args.gpus is not None:
        from .distributed import run as run_gpus

        return run_gpus(args)
    from ..reference import fsutil
    from ..reference.params import initialize
    from ..reference.state import State

    config, defaults = preset_config(args.preset or "tiny"), {}
    if args.model:
        config, defaults = config_from_toml(args.model, config if args.preset else None)
    batches = batch_list(args.batch, defaults.get("batch", 1))
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps}: must be a positive integer")
    if args.warmup < 0 or args.reference_coppelius < 0:
        raise ConfigError("--warmup and --reference-coppelius must be >= 0")
    target = fsutil.output_target(args.json, "--json") if args.json is not None else None
    backends = args.backend or [n for n in accelerated.available_backends()
                                if not accelerated.capabilities(n).defines]
    for name in backends:
        accelerated.backend_module(name)  # unknown or unavailable: one clear line, before any work
    backends, refused = computes_model(backends, config, named=bool(args.backend))
    cuda_precisions = sorted({p for name in backends if backend_device(name) == "cuda"
                              for p in args.precision or [default_precision(name)]})
    peers, notes = peer_plan(args.no_peer, args.no_compile, args.precision or cuda_precisions)
    notes = refused + notes
    threads = None
    if any(device == "cpu" for _, device, _ in peers):
        from .torch_peer import set_threads

        threads = set_threads()
    # a model that cannot fit is refused as train refuses it, before it is built
    on_host = any(accelerated.capabilities(n).host_data for n in backends) or \
        any(device == "cpu" for _, device, _ in peers)
    check_step_fits(config, max(batches), on_host,
                    args.model if args.model else f"preset {args.preset or 'tiny'}")
    state = State.fresh(initialize(config))  # every implementation starts from these bits
    rows = []
    for batch in batches:
        rows += bench_batch(args, config, state, batch, backends, peers, notes)
    if args.reference_coppelius:  # seconds per step: timed on its own, after the rest
        big = preset_config("coppelius")
        inputs = windows(big, 1, 1 + args.reference_coppelius)
        runner = program_runner("reference", big, "fp32", 1, State.fresh(initialize(big)),
                                inputs[:1], label="reference (coppelius)")
        rows += measure([runner], inputs[1:])

    table = compare(rows)
    torch_version = getattr(sys.modules.get("torch"), "__version__", None)
    shape = f"model {args.model}" if args.model else f"preset {args.preset or 'tiny'}"
    header = (f"coppelius bench: {shape}, B={','.join(map(str, batches))}, T={config.context}, "
              f"{args.steps} timed steps after {args.warmup} warmup"
              + (f", torch {torch_version}" if peers and torch_version else "")
              + (f", torch threads {threads}" if threads else ""))
    if target is not None:
        text = json.dumps({"command": header, "notes": notes, "rows": table}, indent=1)
        try:
            fsutil.publish(target, lambda f: f.write(text.encode("utf-8") + b"\n"))
        except OSError as e:
            raise OutputError(f"--json {args.json}: cannot write: {e.strerror or e}") from None
    print(header)
    for line in notes:
        print(line)
    print(LEGEND)
    print(format_table(table))  # last: the end of the output is the table
    return 0
