"""`coppelius bench`: median milliseconds per training step of the reference,
each backend and the PyTorch peer (bench/torch_peer.py), measured in the
same run on the same inputs and shown side by side with ratios to the peer.

A step is what training does per step: one input upload and one replay,
waited for (`replay_and_wait`, whose loss read is the host-device sync). The
peer's step is zero_grad, forward, backward, AdamW and `loss.item()`.
Warmup steps (compilation, allocator growth, caches) are run and not timed.
Times are wall-clock on the host; a backend with a device clock also
reports the device time. Nothing here asserts a time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from coppelius import accelerated
from coppelius.reference.config import PRECISIONS, Config, Hyper, config_from_toml
from coppelius.reference.config import preset as preset_config
from coppelius.reference.errors import ConfigError


@dataclass
class Timing:
    name: str  # implementation
    device: str  # cpu, cuda, gpu
    precision: str
    ms: list  # host milliseconds of each timed step
    device_ms: list  # device milliseconds (NaN where there is no device clock)
    loss: float  # mean loss of the last timed step (a sanity column, not a check)
    tokens: int  # tokens per step, B * T
    preset: str
    flops: float  # model FLOP per step (flops_per_step)

    @property
    def median(self) -> float:
        return float(np.median(self.ms))

    @property
    def device_median(self) -> float:
        finite = [x for x in self.device_ms if math.isfinite(x)]
        return float(np.median(finite)) if finite else math.nan


def windows(config: Config, batch: int, n: int, seed: int = 20260925) -> np.ndarray:
    """(n, B, T+1) ids uniform in [0, V): one distinct input per step."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab, size=(n, batch, config.context + 1), dtype=np.int64)


def flops_per_step(config: Config, batch: int) -> float:
    """Model FLOP of one training step: 6 N T + 6 L D T^2 per context (the
    usual estimate: 2 forward and 4 backward per multiply-add of a weight,
    plus the two attention products, causal mask not discounted)."""
    from coppelius.reference.params import registry

    N = registry(config).total
    T, L, D = config.context, config.n_layer, config.d_model
    return batch * (6.0 * N * T + 6.0 * L * D * T * T)


def preset_name(config: Config) -> str:
    from coppelius.reference.config import PRESETS

    return next((name for name, c in PRESETS.items() if c == config), "custom")


def default_precision(backend: str) -> str:
    """SPEC section 6: bf16 on the CUDA backend, fp32 elsewhere."""
    return "bf16" if backend == "cupy" else "fp32"


def backend_device(backend: str) -> str:
    import platform

    if backend == "cupy":
        return "cuda"
    if backend == "mlx" and platform.system() == "Darwin":
        return "gpu"
    return "cpu"


@dataclass
class Runner:
    """One implementation ready to step: `step(tokens (B, T+1)) -> (loss, device seconds)`
    returns after the step has finished."""

    name: str
    device: str
    precision: str
    config: Config
    batch: int
    step: object


def program_runner(backend: str, config: Config, precision: str, batch: int,
                   label: str | None = None) -> Runner:
    """Capture once from the fresh state; a step is one upload and one replay, waited for."""
    from coppelius.reference.params import initialize
    from coppelius.reference.state import State

    module = accelerated.backend_module(backend)
    program = module.capture(config, Hyper(), precision, batch, State.fresh(initialize(config)))

    def step(tokens):
        program.upload_input(tokens)
        return program.replay_timed_and_wait()  # waits: the step's one sync point

    return Runner(label or backend, backend_device(backend), precision, config, batch, step)


def peer_runner(config: Config, precision: str, device: str, batch: int) -> Runner:
    import torch

    from coppelius.bench.torch_peer import TorchPeer
    from coppelius.reference.params import initialize

    peer = TorchPeer(config, initialize(config), precision=precision, device=device)

    def step(tokens):
        x = torch.from_numpy(tokens).to(device)  # the upload, as a backend's
        return peer.step(x).item(), math.nan  # .item() waits for the step: the sync point

    return Runner("torch peer", device, precision, config, batch, step)


def measure(runners: list, inputs: np.ndarray, warmup: int) -> list:
    """Step every runner through the same inputs, interleaved: step i of each
    before step i+1 of any, so a change in the machine's load during the run
    touches every implementation alike. The first `warmup` steps are not timed."""
    ms = [[] for _ in runners]
    device_ms = [[] for _ in runners]
    losses = [math.nan] * len(runners)
    for i, tokens in enumerate(inputs):
        for k, runner in enumerate(runners):
            start = time.perf_counter()
            loss, device_s = runner.step(tokens)
            elapsed = time.perf_counter() - start
            losses[k] = float(loss)
            if i >= warmup:
                ms[k].append(1e3 * elapsed)
                device_ms[k].append(1e3 * device_s)
    return [Timing(r.name, r.device, r.precision, ms[k], device_ms[k], losses[k],
                   r.batch * r.config.context, preset_name(r.config), flops_per_step(r.config, r.batch))
            for k, r in enumerate(runners)]


def peer_targets() -> list:
    """(device, precision) of the peer rows this machine can run; [] without torch."""
    try:
        import torch

        import coppelius.bench.torch_peer  # noqa: F401  (part of the source tree)
    except ImportError:
        return []
    if torch.cuda.is_available():  # the CPU peer is not the comparison there, and slow
        return [("cuda", "fp32"), ("cuda", "bf16")]
    return [("cpu", "fp32")]


def peer_for(row: Timing, peers: list):
    """The peer a row is compared with: same device and precision, else the
    CPU fp32 peer (the machine's baseline)."""
    by_key = {(p.device, p.precision): p for p in peers if p.preset == row.preset}
    return by_key.get((row.device, row.precision)) or by_key.get(("cpu", "fp32"))


def format_table(rows: list, peers: list) -> str:
    lines = [f"{'implementation':<22} {'device':<6} {'precision':<9} {'median ms':>10} "
             f"{'min ms':>9} {'device ms':>9} {'tokens/s':>10} {'TFLOP/s':>8}  {'x peer time':>11}  loss"]
    for r in rows:
        peer = peer_for(r, peers)
        ratio = f"{r.median / peer.median:.2f}" if peer is not None and r is not peer else "-"
        if peer is not None and r is not peer and (peer.device, peer.precision) != (r.device, r.precision):
            ratio += f" ({peer.device} {peer.precision})"
        device = f"{r.device_median:.2f}" if math.isfinite(r.device_median) else "-"
        lines.append(f"{r.name:<22} {r.device:<6} {r.precision:<9} {r.median:>10.2f} "
                     f"{min(r.ms):>9.2f} {device:>9} {r.tokens / (r.median / 1e3):>10.0f} "
                     f"{r.flops / (r.median / 1e3) / 1e12:>8.3f}  "
                     f"{ratio:>11}  {r.loss:.4f}")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line

def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time a training step on every backend and the PyTorch peer",
        description="Median ms per training step of the reference, each available "
                    "backend and the PyTorch peer, in one run, with ratios to the peer.")
    parser.add_argument("--preset", help="model preset (default: tiny)")
    parser.add_argument("--model", metavar="FILE.toml",
                        help="model configuration file (SPEC §17); with --preset it overrides "
                             "the preset's fields")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="backend to time besides the reference; repeatable "
                             "(default: every available one)")
    parser.add_argument("--precision", action="append", choices=PRECISIONS,
                        help="precision of the backends; repeatable (default: bf16 on cupy, "
                             "fp32 elsewhere)")
    parser.add_argument("--batch", type=int, metavar="B",
                        help="contexts per step (default: the model file's batch, else 1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    parser.add_argument("--no-peer", action="store_true", help="skip the PyTorch peer")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the NumPy reference (seconds per step on the coppelius preset)")
    parser.add_argument("--gpus", type=int, metavar="N",
                        help="data parallelism: N GPUs at B = N x --batch against one GPU at "
                             "B = --batch, tokens/s and scaling (bench/distributed.py)")
    parser.add_argument("--reference-coppelius", type=int, default=0, metavar="N",
                        help="also time N steps of the reference on the coppelius preset "
                             "(seconds per step)")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.gpus is not None:
        from coppelius.bench.distributed import run as run_gpus

        return run_gpus(args)
    config, defaults = preset_config(args.preset or "tiny"), {}
    if args.model:
        config, defaults = config_from_toml(args.model, config if args.preset else None)
    if args.batch is None:
        args.batch = defaults.get("batch", 1)
    for name in ("steps", "batch"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be a positive integer")
    if args.warmup < 0 or args.reference_coppelius < 0:
        raise ConfigError("--warmup and --reference-coppelius must be >= 0")
    backends = args.backend or [n for n in accelerated.available_backends() if n != "reference"]
    for name in backends:
        accelerated.backend_module(name)  # unknown or unavailable: one clear line, before any work
    inputs = windows(config, args.batch, args.warmup + args.steps)
    runners = [] if args.no_reference else [
        program_runner("reference", config, precision, args.batch)
        for precision in args.precision or ["fp32"]]
    for name in backends:
        if name == "reference":
            continue
        for precision in args.precision or [default_precision(name)]:
            runners.append(program_runner(name, config, precision, args.batch))
    threads = None
    if not args.no_peer:
        targets = peer_targets()
        if targets:
            from coppelius.bench.torch_peer import set_threads

            threads = set_threads()
        runners += [peer_runner(config, precision, device, args.batch)
                    for device, precision in targets]
    rows = measure(runners, inputs, args.warmup)
    peers = [r for r in rows if r.name == "torch peer"]
    if args.reference_coppelius:  # seconds per step: timed on its own, after the rest
        big = preset_config("coppelius")
        runner = program_runner("reference", big, "fp32", 1, label="reference (coppelius)")
        rows += measure([runner], windows(big, 1, 1 + args.reference_coppelius), warmup=1)

    shape = f"model {args.model}" if args.model else f"preset {args.preset or 'tiny'}"
    print(f"coppelius bench: {shape}, B={args.batch}, T={config.context}, "
          f"{args.steps} timed steps after {args.warmup} warmup"
          + (f", torch threads {threads}" if threads else ""))
    print(format_table(rows, peers))
    if not args.no_peer and not peers:
        print("no PyTorch peer: torch (or bench/torch_peer.py of the source tree) is not importable")
    return 0
