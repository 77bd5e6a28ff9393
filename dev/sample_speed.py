"""The rate of `coppelius sample`'s generation (sample.generate on a
backend's program, as the command runs it) for named shapes, on randomly
initialised parameters (reference.params.initialize; the rate does not
depend on the values).

    PYTHONPATH=. python dev/sample_speed.py --shape coppelius --shape 110M \\
        [--backend cupy] [--backend reference] [--precision bf16] [--tokens 256]

Shapes: `110M` (bench/models/gpt-110m.toml: V=32768, T=1024, D=768, L=12,
H=12, F=2048) or any preset (reference/config.py PRESETS, `coppelius`
among them). --backend and --precision repeat (default cupy, in its own
precision). Each (shape, backend, precision) builds the backend's program
at batch 1 (sample.backend_logits, the `build s` column), generates one
greedy token as a warm-up, then times --tokens greedy tokens from a prompt
of 8 ids: one forward of the window per token, the window growing from 8
ids up to T. One table row each: tokens/s and ms/token. A row that cannot
run (a backend not here, the reference asked for bf16) says why; the exit
status is then 1.

On this tree's CPU stand-ins of CuPy (the plumbing, not the speed):

    python dev/cuda/emulate.py --script dev/sample_speed.py --shape test --tokens 4
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

from coppelius import sample
from coppelius.reference.config import PRESETS, config_from_toml
from coppelius.reference.errors import CoppeliusError
from coppelius.reference.params import initialize, registry

MODEL_FILES = {"110M": "gpt-110m.toml"}  # shape name -> bench/models/ file
PROMPT = 8  # prompt ids: about a line of code (sample.PROMPT_TOKENS)
COLUMNS = ("shape", "backend", "precision", "build s", "tokens", "tokens/s", "ms/token")
WIDTHS = (10, 10, 10, 8, 7, 9, 9)


def shape_config(name: str):
    """The Config of a shape name: a bench model file (MODEL_FILES) or a preset."""
    if name in MODEL_FILES:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        config, _ = config_from_toml(os.path.join(root, "bench", "models", MODEL_FILES[name]))
        return config
    if name in PRESETS:
        return PRESETS[name]
    raise SystemExit(f"sample_speed: shape {name!r}: unknown "
                     f"(choose from {', '.join([*MODEL_FILES, *PRESETS])})")


def row(cells) -> str:
    return "  ".join(f"{c:<{w}}" if i < 3 else f"{c:>{w}}"
                     for i, (c, w) in enumerate(zip(cells, WIDTHS)))


def measure(config, P, backend: str, precision: str | None, tokens: int) -> tuple:
    """(precision, build seconds or None, generation seconds) of `tokens`
    greedy tokens on `backend` after one warm-up token."""
    precision = sample.backend_precision(backend, precision)
    t0 = time.perf_counter()
    logits_of = sample.backend_logits(backend, config, P, precision)  # None: the reference
    build = time.perf_counter() - t0 if logits_of is not None else None
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, config.vocab, PROMPT)]
    sample.generate(config, P, prompt, 1, logits_of=logits_of)  # kernels loaded, buffers made
    # generate's logits come back to the host each token (pick reads them),
    # so the clock stops after the device's last forward
    t0 = time.perf_counter()
    sample.generate(config, P, prompt, tokens, logits_of=logits_of)
    return precision, build, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", metavar="NAME",
                   help="110M or a preset name (default: coppelius and 110M)")
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="a backend of coppelius.accelerated.BACKENDS (default: cupy)")
    p.add_argument("--precision", action="append", choices=["fp32", "bf16"],
                   help="(default: the backend's own)")
    p.add_argument("--tokens", type=int, default=256, metavar="N",
                   help="timed tokens (default 256)")
    args = p.parse_args()
    if args.tokens <= 0:
        raise SystemExit(f"sample_speed: --tokens={args.tokens}: must be > 0")
    shapes = [(name, shape_config(name)) for name in args.shape or ("coppelius", "110M")]
    failed = 0
    print(row(COLUMNS))
    for name, config in shapes:
        t0 = time.perf_counter()
        P = initialize(config)
        print(f"# {name}: V={config.vocab} T={config.context} D={config.d_model} "
              f"L={config.n_layer} H={config.n_head} F={config.d_ff}, "
              f"{registry(config).total:,} parameters (initialised in "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        for backend in args.backend or ("cupy",):
            for precision in args.precision or (None,):
                try:
                    precision, build, seconds = measure(config, P, backend, precision,
                                                        args.tokens)
                except CoppeliusError as e:
                    failed += 1
                    print(row((name, backend, precision or "-")) + f"  cannot run: {e}",
                          flush=True)
                    continue
                finally:
                    gc.collect()  # the program's device buffers go before the next is built
                print(row((name, backend, precision,
                           "-" if build is None else f"{build:.1f}", str(args.tokens),
                           f"{args.tokens / seconds:.1f}",
                           f"{1000 * seconds / args.tokens:.2f}")), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
