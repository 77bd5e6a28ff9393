"""Where a `coppelius train` run's time goes besides its steps: the run
loop's other work timed from outside (the capture, each held-out
evaluation, each copy of the state off the device, the publications on
their thread, the final record, the wait for the last checkpoint).

    PYTHONPATH=. python dev/cuda/train_probe.py train --no-sample [train options]

The arguments are `coppelius`'s own; the timers are printed after its
output. With the result file's per-step host and device seconds (kind 3)
this accounts for the whole run (dev/cuda/NOTES.md, "Training loop").
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import coppelius.train as run  # noqa: E402
from coppelius import accelerated, cli  # noqa: E402

SECONDS = collections.defaultdict(list)


def timed(name, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SECONDS[name].append(time.perf_counter() - start)
    return wrapper


def main(argv) -> int:
    run.held_out_losses = timed("held-out evaluation", run.held_out_losses)
    run.publish = timed("publication (its thread)", run.publish)
    run.Publisher.submit = timed("publication submitted (the copy)", run.Publisher.submit)
    run.Publisher.finish = timed("publication waited for", run.Publisher.finish)
    run._final_record = timed("final record", run._final_record)
    for name in accelerated.BACKENDS:
        try:
            module = accelerated.backend_module(name)
        except Exception:  # a backend not installed here is not probed
            continue
        module.capture = timed(f"{name}: capture", module.capture)
    start = time.perf_counter()
    try:
        return cli.main(argv)
    finally:
        print(f"wall {time.perf_counter() - start:.2f} s")
        for name, values in SECONDS.items():
            print(f"  {name:34s} n={len(values):3d} sum={sum(values):7.3f} s  "
                  f"max={max(values):.3f}  first={values[0]:.3f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
