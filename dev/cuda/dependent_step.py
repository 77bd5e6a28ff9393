"""The step with plain launches beside the step with dependent ones
(accelerated/cuda/dependent_launch.py), one process, the two programs'
steps timed in turns, and their row losses after the same steps compared
bit for bit.

    PYTHONPATH=. python dev/cuda/dependent_step.py [--preset coppelius] [--batches 1,8,32]
        [--model FILE.toml] [--precision bf16] [--steps 20] [--rounds 3]

A short table last: median ms of each, their ratio, and whether the losses
were equal.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from coppelius.accelerated.cuda import dependent_launch  # noqa: E402
from coppelius.accelerated.cuda.program import capture  # noqa: E402
from coppelius.reference.config import Hyper, config_from_toml, preset  # noqa: E402
from coppelius.reference.params import initialize  # noqa: E402
from coppelius.reference.state import State  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="coppelius")
    p.add_argument("--model", metavar="FILE.toml")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    config = config_from_toml(args.model)[0] if args.model else preset(args.preset)
    table = []
    for B in (int(b) for b in args.batches.split(",")):
        rng = np.random.default_rng(0)
        tokens = [rng.integers(0, config.vocab, (B, config.context + 1)) for _ in range(4)]
        state = State.fresh(initialize(config))
        programs = {}
        for name, setting in (("plain", "off"), ("dependent", "on")):
            os.environ[dependent_launch.ENV] = setting
            programs[name] = capture(config, Hyper(), args.precision, B, state.copy())
        os.environ.pop(dependent_launch.ENV)
        losses = {}
        for name, program in programs.items():  # the same steps from the same state
            rows = []
            for t in tokens:
                program.upload_input(t)
                program.replay_and_wait()
                rows.append(program.row_losses())
            losses[name] = np.stack(rows)
        same = losses["plain"].tobytes() == losses["dependent"].tobytes()
        ms = {name: [] for name in programs}
        for _ in range(args.rounds):
            for name, program in programs.items():
                for i in range(args.steps):
                    program.upload_input(tokens[i % len(tokens)])
                    ms[name].append(1e3 * program.replay_timed_and_wait()[1])
        med = {name: float(np.median(v)) for name, v in ms.items()}
        print(f"B={B}: plain {med['plain']:.3f} ms, dependent {med['dependent']:.3f} ms, "
              f"losses equal: {same}", flush=True)
        table.append((B, med["plain"], med["dependent"], same))
        del programs
    what = args.model or f"preset {args.preset}"
    print(f"\n{what}, {args.precision}")
    print(f"{'B':>3} {'plain ms':>9} {'dependent ms':>12} {'ratio':>6}  losses equal")
    for B, t0, t1, same in table:
        print(f"{B:>3} {t0:>9.3f} {t1:>12.3f} {t1 / t0:>6.3f}  {same}")


if __name__ == "__main__":
    main()
