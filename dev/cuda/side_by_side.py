"""One change to the CUDA step, measured side by side: the step without it
and with it (or with each of its forms) captured in one process from one
state, their row losses after the same four steps compared with the
first's (bit for bit, or their largest relative difference where the change
sums in another order), then `rounds` times `steps` steps of each in turn;
the median ms of each, its ratio to the first's, and each program's memory
(the CuPy pool's growth while it was captured and warmed). A short table
last.

    PYTHONPATH=. python dev/cuda/side_by_side.py CHANGE [coppelius | FILE.toml ...]
        [--batches 8] [--precision bf16] [--steps 20] [--rounds 3]

CHANGE (CHANGES below):
  again      the gate/up products kept (float32 gu a layer) against computed again in
             the SwiGLU backward (products.AGAIN_MAX_K set below and at d_model)
  dependent  plain launches against dependent ones (COPPELIUS_DEPENDENT_LAUNCH)
  sigmoid    the own products' SwiGLU epilogues with the IEEE sigmoid (SIGMOID_EXACT)
             against the fast one (kernels/swiglu.cu)
  wide       the products' rule against each fused epilogue (q | k | v + rope, gate/up
             + SwiGLU, down's dX + SwiGLU backward) taken at any K and N, and all three
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from coppelius.bench import _cupy_pool  # noqa: E402
from coppelius.accelerated.cuda import dependent_launch, gemm, products  # noqa: E402
from coppelius.accelerated.cuda.program import capture  # noqa: E402
from coppelius.reference.config import Hyper, config_from_toml, preset  # noqa: E402
from coppelius.reference.params import initialize  # noqa: E402
from coppelius.reference.state import State  # noqa: E402


@contextlib.contextmanager
def attribute(owner, name, value):
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, kept)


@contextlib.contextmanager
def attributes(owner, **values):
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(attribute(owner, name, value))
        yield


@contextlib.contextmanager
def environment(name, value):
    kept = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if kept is None:
            os.environ.pop(name)
        else:
            os.environ[name] = kept


# change -> (the step without it, with it): (label, the setting a capture is made under)
CHANGES = {
    "again": lambda c: (("gu kept", attribute(products, "AGAIN_MAX_K", c.d_model - 1)),
                        ("gu again", attribute(products, "AGAIN_MAX_K", c.d_model))),
    "dependent": lambda c: (("plain", environment(dependent_launch.ENV, "off")),
                            ("dependent", environment(dependent_launch.ENV, "on"))),
    "sigmoid": lambda c: (("exact", attribute(gemm, "compile_options", defined("SIGMOID_EXACT"))),
                          ("fast", contextlib.nullcontext())),
    "wide": lambda c: (("rule", contextlib.nullcontext()),
                       ("rope", attributes(products, **WIDE["rope"])),
                       ("swiglu", attributes(products, **WIDE["swiglu"])),
                       ("dswiglu", attributes(products, **WIDE["dswiglu"])),
                       ("all", attributes(products, **{k: v for w in WIDE.values()
                                                       for k, v in w.items()}))),
}
ANY = 1 << 30
WIDE = {"rope": {"ROPE_MAX_K": ANY, "ROPE_MAX_COLUMNS": ANY},
        "swiglu": {"SWIGLU_MAX_K": ANY},
        "dswiglu": {"DSWIGLU_MAX_K": ANY, "DSWIGLU_MAX_COLUMNS": ANY}}


def defined(name: str):
    """gemm.compile_options with -D name"""
    return lambda *args, **kw: COMPILE_OPTIONS(*args, **kw) + [f"-D{name}"]


COMPILE_OPTIONS = gemm.compile_options


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("change", choices=sorted(CHANGES))
    p.add_argument("models", nargs="*", default=["coppelius"],
                   help="presets or model files (FILE.toml)")
    p.add_argument("--batches", default="8")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    table = []
    for model in args.models:
        config = config_from_toml(model)[0] if model.endswith(".toml") else preset(model)
        for B in (int(b) for b in args.batches.split(",")):
            rng = np.random.default_rng(0)
            tokens = [rng.integers(0, config.vocab, (B, config.context + 1)) for _ in range(4)]
            state = State.fresh(initialize(config))
            programs, memory, losses = {}, {}, {}
            for label, setting in CHANGES[args.change](config):
                pool = _cupy_pool()
                base = pool.total_bytes()
                with setting:
                    program = capture(config, Hyper(), args.precision, B, state.copy())
                rows = []
                for t in tokens:  # the same steps from the same state
                    program.upload_input(t)
                    program.replay_and_wait()
                    rows.append(program.row_losses())
                programs[label], losses[label] = program, np.stack(rows)
                memory[label] = (pool.total_bytes() - base) / 2**20
            first = next(iter(losses))
            diff = {}
            for label, l1 in losses.items():
                l0 = losses[first]
                diff[label] = "bitwise" if l0.tobytes() == l1.tobytes() else \
                    f"{float(np.max(np.abs(l1 - l0) / np.abs(l0))):.1e}"
            ms = {label: [] for label in programs}
            for _ in range(args.rounds):
                for label, program in programs.items():
                    for i in range(args.steps):
                        program.upload_input(tokens[i % len(tokens)])
                        ms[label].append(1e3 * program.replay_timed_and_wait()[1])
            med = {label: float(np.median(v)) for label, v in ms.items()}
            print(f"{model} B={B}: " + ", ".join(
                f"{label} {med[label]:.3f} ms {memory[label]:,.0f} MiB ({diff[label]})"
                for label in programs), flush=True)
            for label in programs:
                table.append((os.path.basename(model), B, label, med[label], memory[label],
                              med[label] / med[first], diff[label]))
            del programs, program
    print(f"\n{args.change}, {args.precision}: each against the first of its model and B")
    print(f"{'model':<18} {'B':>3} {'':<10} {'ms':>9} {'MiB':>8} {'ratio':>6}  losses")
    for name, B, label, t, m, ratio, diff in table:
        print(f"{name:<18} {B:>3} {label:<10} {t:>9.3f} {m:>8,.0f} {ratio:>6.3f}  {diff}")


if __name__ == "__main__":
    main()
