"""Digests of a backend's training steps, to compare two trees bit for bit
(a restructuring must change no bit of the step).

    PYTHONPATH=TREE python dev/cuda/step_digest.py [--backend cupy] [--preset tiny]
        [--steps 4] [--batch 1 --batch 8] [--precision fp32 --precision bf16]

For each (precision, batch): a fresh state of the preset, `steps` replays on
fixed random windows, then one line with the SHA-256 (first 16 digits) of
the row losses of every step, of P, M and V, and of the last gradient and
an evaluation's row losses. Only the TrainingProgram interface (SPEC 13) is
used, so the same script runs on a tree before and after a change of the
backend's modules; run it under both and compare the lines.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    from coppelius import accelerated
    from coppelius.reference.config import Hyper, preset
    from coppelius.reference.params import initialize
    from coppelius.reference.state import State

    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cupy")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--precision", action="append")
    args = parser.parse_args()
    module = accelerated.backend_module(args.backend)
    config = preset(args.preset)
    for precision in args.precision or ["fp32", "bf16"]:
        for batch in args.batch or [1, 8]:
            rng = np.random.default_rng(1234)
            windows = [rng.integers(0, config.vocab, (batch, config.context + 1))
                       for _ in range(args.steps + 1)]
            program = module.capture(config, Hyper(clip="1"), precision, batch,
                                     State.fresh(initialize(config)))
            rows = []
            for tokens in windows[:-1]:
                program.upload_input(tokens)
                program.replay_and_wait()
                rows.append(program.row_losses())
            gradient = program.gradients()
            state = program.state()
            heldout = program.evaluate(windows[-1])
            print(f"{args.backend} {args.preset} {precision} B={batch} steps={args.steps}: "
                  f"rows {digest(*rows)} P {digest(state.P)} M {digest(state.M)} "
                  f"V {digest(state.V)} G {digest(gradient)} eval {digest(heldout)} "
                  f"loss {float(np.mean(rows[-1])):.6f}")


if __name__ == "__main__":
    main()
