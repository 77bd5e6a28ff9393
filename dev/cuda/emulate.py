"""Run the CuPy backend on the CPU: a stand-in for the few CuPy pieces it
uses (arrays, streams, events, graphs, a memory pool counting the arrays
alive), NumPy versions of its kernels, and a column-major GEMM behind the
cuBLAS entry points. What this checks without a GPU is everything but the
CUDA source: the buffer plan, the launch arguments, the row-major to
column-major mapping of every product (pointers, leading dimensions, batch
strides), the order of the step, capture semantics (commands recorded once,
replayed later, pointers and scalars frozen at capture) and the program's
interface -- against reference.step through the conformance suite.

    python dev/cuda/emulate.py            # test preset, fp32 and bf16
    python dev/cuda/emulate.py PRESET     # another preset (reference/config.py PRESETS)
    python dev/cuda/emulate.py MODEL.toml # a model file (SPEC 17) over the test preset
    python dev/cuda/emulate.py MODEL.toml --steps 2 --one-context
                                          # fewer steps, B = 1 only (a wide model's quick check)
    python dev/cuda/emulate.py --pytest   # tests/cuda and the contract rows on the stand-ins
    python dev/cuda/emulate.py --script dev/cuda/attention/check.py --preset test
                                          # a dev/cuda script on the stand-ins
    python dev/cuda/emulate.py --pytest-files FILE... [pytest args]
                                          # those test files on the stand-ins

NCCL's stand-in (cupy.cuda.nccl) joins the ranks of one process: data
parallelism runs here with one thread per rank (SPEC 19), each thread with
its own stream and capture, as each rank is a process of its own on GPUs.

The stand-ins are the package dev/cuda/emulated/ (its __init__ lists them):
one NumPy module per kernel family, named as the family's kernel file and
launchers (accelerated/cuda/kernels/<family>.cu, accelerated/cuda/<family>.py),
following their contracts, not their code; the CUDA source itself is
checked on the device (tests/cuda/ on a GPU). The kernel files are still
read and assembled here (the stand-in RawModule is handed
compile.module_source()), so a missing or misnamed file fails. pytest runs
tests/cuda/ on the stand-ins in its own process where no GPU is present
(tests/cuda/conftest.py); --pytest here runs them in a process of their own.
"""

from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

import emulated  # noqa: E402  (dev/cuda/emulated, beside this file)


def install():
    """Point the backend's modules at the stand-ins (emulated.install());
    returns the backend module."""
    return emulated.install()


def main():
    from coppelius.conformance.suite import run_suite

    if sys.argv[1:2] == ["--pytest"]:  # the GPU tests, against the stand-ins
        import pytest

        install()
        # the backend's own tests (tests/cuda: the package's name is every
        # test's keyword there), and the program contract's rows for "cupy"
        tests = [os.path.join(ROOT, "tests", "cuda"),
                 os.path.join(ROOT, "tests", "test_program_contract.py")]
        sys.exit(pytest.main([*tests, "-q", "-k", "cuda or cupy", "-p", "no:cacheprovider",
                              *sys.argv[2:]]))

    if sys.argv[1:2] == ["--pytest-files"]:  # any test files, against the stand-ins
        import pytest

        install()
        sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[2:]]))

    if sys.argv[1:2] == ["--script"]:  # its plumbing (loading, launches), not its kernels
        install()
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return

    import argparse

    p = argparse.ArgumentParser(prog="emulate.py")
    p.add_argument("preset", nargs="?", default="test")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--one-context", action="store_true",
                   help="B = 1 only (not also B = 2 in two micro-batches)")
    args = p.parse_args()
    backend = install()
    backend.NAME = "cupy (emulated on the CPU)"
    status = 0
    preset = args.preset
    if preset.endswith(".toml"):  # a model file: the fields it sets over the test preset's
        from coppelius.reference.config import config_from_toml, preset as preset_config

        preset = config_from_toml(preset, preset_config("test"))[0]
    for precision in ("fp32", "bf16"):
        # one context per step, then two in two micro-batches (SPEC 19)
        for batch, k in ((1, 1), (2, 2))[:1 if args.one_context else 2]:
            report = run_suite(backend, preset, precision, batch=batch, steps=args.steps,
                               accumulate=k)
            print(report.table(report.failures) if report.failures else "", end="")
            print(report.summary())
            status |= not report.passed
    sys.exit(status)


if __name__ == "__main__":
    main()
