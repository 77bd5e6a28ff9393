"""`coppelius bench --gpus N`: the tokens per second of data parallelism
(SPEC 19) against one GPU, in the same run.

`--batch b` is per GPU: N GPUs train a global batch of B = N*b contexts
per step, one GPU a batch of b, so each GPU does the same work and the
ratio of tokens per second is the scaling (N at best). The command starts
N ranks on this host (coppelius/launch.py; under torchrun, mpirun or srun
the launcher's ranks). Rank 0 first times the one-GPU program alone, the
other ranks waiting, then releases it; then every rank captures its part of
the data-parallel step and they step together. A step is what training
does per step: one input upload and one replay, waited for; rank 0's host
clock times it (the NCCL collectives inside the step make every rank's
step as long as the slowest one's). Rank 0 prints the table.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time

import numpy as np

from .. import accelerated
from coppelius import launch as ranks
from ..reference.config import Hyper, config_from_toml
from ..reference.config import preset as preset_config
from ..reference.errors import CoppeliusError, ConfigError, RunError
from ..reference.limits import check_step_fits


def run(args) -> int:
    """The --gpus N dispatch of `coppelius bench`."""
    n = args.gpus
    if n < 1:
        raise ConfigError(f"--gpus={n}: must be a positive integer")
    launch = ranks.from_environment()
    if launch is not None:
        if launch.world != n:
            raise RunError(f"--gpus {n}: the launcher ({launch.launcher}) started "
                           f"{launch.world} ranks")
        return bench_rank(args, launch)
    parallel = accelerated.data_parallel_backends()
    for name in args.backend or parallel:
        if name not in parallel:
            raise ConfigError(f"--gpus {n}: backend {name} has one device; data parallelism "
                              f"runs on the {' and '.join(parallel)} backend")
        accelerated.backend_module(name)
    from ..accelerated.cuda import distributed

    distributed.check_devices(n)
    argv = getattr(args, "argv", None) or sys.argv[1:]
    return ranks.spawn([sys.executable, "-m", "coppelius", *argv], n, what="bench")


def _config(args):
    config, defaults = preset_config(args.preset or "tiny"), {}
    if args.model:
        config, defaults = config_from_toml(args.model, config if args.preset else None)
    batches = args.batch or [defaults.get("batch", 1)]  # --batch is repeatable in `bench`
    if len(batches) != 1:
        raise ConfigError(f"--gpus {args.gpus}: one --batch, the contexts per GPU (got "
                          f"{len(batches)})")
    # a model that cannot fit is refused as train refuses it, before it is built
    check_step_fits(config, batches[0], False, args.model or f"preset {args.preset or 'tiny'}")
    return config, batches[0]


def _time(program, inputs, warmup: int) -> tuple:
    """Step through inputs (S, B, T+1): (host ms, device ms) of the timed steps, last loss."""
    ms, device_ms, loss = [], [], math.nan
    for i, tokens in enumerate(inputs):
        start = time.perf_counter()
        program.upload_input(tokens)
        loss, device_s = program.replay_timed_and_wait()
        if i >= warmup:
            ms.append(1e3 * (time.perf_counter() - start))
            device_ms.append(1e3 * device_s)
    return ms, device_ms, loss


def bench_rank(args, launch, hard_exit: bool = True) -> int:
    """One rank of `bench --gpus N`; hard_exit False (ranks as threads, in
    tests): the process is never ended from here."""
    from .. import bench
    from ..accelerated.cuda import distributed
    from ..accelerated.cuda.program import capture
    from ..reference.params import initialize
    from ..reference.state import State

    r, n = launch.rank, launch.world
    parent = os.environ.get(ranks.PARENT_ENV) == "1"
    group = ranks.Group.open(launch, bind="127.0.0.1" if parent else None)
    comm = program = None
    status = 2
    try:
        config, b = _config(args)
        if b < 1 or args.steps < 1 or args.warmup < 0:
            raise ConfigError("--batch and --steps must be positive, --warmup >= 0")
        precision = (args.precision or ["bf16"])[0]
        modes = list(dict.fromkeys(args.recompute or ()))
        if len(modes) > 1:
            raise ConfigError(f"--gpus {n}: one --recompute mode (got {', '.join(modes)})")
        recompute = modes[0] if modes else None
        B = n * b
        state = State.fresh(initialize(config))
        inputs = bench.windows(config, B, args.warmup + args.steps)  # the same on every rank
        distributed.use_device(launch.local_rank, r)
        single = None
        if r == 0:  # one GPU alone first, the others waiting for "go"
            program = capture(config, Hyper(), precision, b, state.copy(),
                                           recompute=recompute)
            single = _time(program, inputs[:, :b], args.warmup)
            program.reset()
            program = None
            uid = group.go(distributed.new_unique_id)
        else:
            message = group.receive()
            if "go" not in message:
                return message.get("status", 2)
            uid = group.went(message)
        def on_failure(failure):  # the program raises it after its wait returns
            if comm is not None:
                comm.failure = failure
                threading.Thread(target=comm.abort, daemon=True).start()

        group.watch(on_failure, hard_exit=hard_exit)
        comm = distributed.Communicator(uid, r, n)
        shard = bool(getattr(args, "shard_optimizer", False))
        program = capture(config, Hyper(), precision, B, state.copy(), comm=comm,
                          recompute=recompute, shard=shard)
        several = _time(program, inputs, args.warmup)
        group.finish()
        status = 0
        if r != 0:
            return 0
        T = config.context
        rows = [("1 GPU", b, *single), (f"{n} GPUs", B, *several)]
        print(f"coppelius bench --gpus {n}: {bench.preset_name(config)} model, {precision}, "
              f"T={T}, {b} contexts per GPU, {args.steps} timed steps after {args.warmup} "
              f"warmup" + {None: "", "gate-up": ", gate and up recomputed (--recompute)",
                           "block": ", each layer recomputed (--recompute block)"}[recompute]
              + (", optimizer state sharded (--shard-optimizer)" if shard else ""))
        print(f"{'GPUs':<8} {'batch':>5} {'median ms':>10} {'min ms':>9} {'device ms':>9} "
              f"{'tokens/s':>12}  loss")
        rate = []
        for name, batch, ms, device_ms, loss in rows:
            median = float(np.median(ms))
            rate.append(batch * T / (median / 1e3))
            print(f"{name:<8} {batch:>5} {median:>10.2f} {min(ms):>9.2f} "
                  f"{float(np.median(device_ms)):>9.2f} {rate[-1]:>12,.0f}  {loss:.4f}")
        print(f"scaling: {rate[1] / rate[0]:.2f}x the tokens/s of one GPU with {n} GPUs "
              f"({100 * rate[1] / rate[0] / n:.0f}% of {n}x)")
        return 0
    except CoppeliusError as e:
        group.fail(f"rank {r} failed: {e}")
        print(f"coppelius bench: error: {'' if r == 0 else f'rank {r}: '}{e}", file=sys.stderr)
        return e.exit_status
    except BaseException as e:
        group.fail(f"rank {r} failed: {type(e).__name__}: {e}")
        raise
    finally:
        if hard_exit:  # everything is printed: no teardown may hang the exit
            ranks.exit_within(status, ranks.EXIT_GRACE if status == 0 else ranks.ABORT_GRACE)
        if program is not None:  # its graph holds NCCL work: released before the communicator
            program.reset()
        if comm is not None:
            comm.abort()
        group.close()
