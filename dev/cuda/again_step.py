"""The step with the gate/up products kept (float32 gu per layer) beside the
step computing them again in the SwiGLU backward (products.gate_up_again),
one process, the two programs' steps timed in turns: the side-by-side
timing that decides products.AGAIN_MAX_K.

    PYTHONPATH=. python dev/cuda/again_step.py bench/models/gpt-110m.toml [...]
        [--batch B] [--steps 20] [--rounds 3]

Each model: both programs captured from the same state (the rule's bound
set below and above the model's d_model), warmed, then `rounds` times
`steps` steps of each in turn; the median ms of each and the pool's peak
MiB. A short table last.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from coppelius.accelerated.cuda import products  # noqa: E402
from coppelius.bench import program_runner  # noqa: E402
from coppelius.reference.config import config_from_toml  # noqa: E402
from coppelius.reference.params import initialize  # noqa: E402
from coppelius.reference.state import State  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+", metavar="FILE.toml")
    p.add_argument("--batch", type=int, help="default: the file's batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    table = []
    for path in args.models:
        config, defaults = config_from_toml(path)
        B = args.batch or defaults.get("batch", 8)
        rng = np.random.default_rng(0)
        tokens = [rng.integers(0, config.vocab, (B, config.context + 1)) for _ in range(4)]
        state = State.fresh(initialize(config))
        runners = {}
        bound = products.AGAIN_MAX_K
        try:
            for name, k in (("gu kept", config.d_model - 1), ("gu again", config.d_model)):
                products.AGAIN_MAX_K = k
                runners[name] = program_runner("cupy", config, "bf16", B, state, tokens[:2],
                                               label=name)
        finally:
            products.AGAIN_MAX_K = bound
        ms = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, r in runners.items():
                for i in range(args.steps):
                    ms[name].append(1e3 * r.step(tokens[i % len(tokens)])[1])
        row = [os.path.basename(path), B]
        for name, r in runners.items():
            med = float(np.median(ms[name]))
            print(f"{path} B={B} {name}: median {med:.3f} ms (min {min(ms[name]):.3f}, "
                  f"max {max(ms[name]):.3f}), pool {r.memory / 2**20:,.0f} MiB", flush=True)
            row += [med, r.memory / 2**20]
        table.append(row)
        for r in runners.values():
            r.release()
        del runners
    print(f"\n{'model':<18} {'B':>3} {'kept ms':>9} {'MiB':>8} {'again ms':>9} {'MiB':>8} "
          f"{'again/kept':>10}")
    for name, B, t0, m0, t1, m1 in table:
        print(f"{name:<18} {B:>3} {t0:>9.3f} {m0:>8,.0f} {t1:>9.3f} {m1:>8,.0f} {t1 / t0:>10.3f}")


if __name__ == "__main__":
    main()
