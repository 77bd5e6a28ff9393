"""SPEC 23's shapes on the CuPy backend, each through the conformance suite
against the reference: every head dimension of a list (which attention
path serves it, cuDNN's or why not), a long context and a large vocabulary.
Small models otherwise, so the reference's step is quick.

    PYTHONPATH=. python dev/cuda/scale_shapes.py [--steps 4] [--only E96 ...]

One line per shape: its name, the attention path at the batch it ran,
the verdict; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys

from coppelius.reference.config import Config
from coppelius.accelerated import backend_module
from coppelius.accelerated.cuda.policy import attention_path
from coppelius.conformance.suite import run_suite


def shapes() -> dict:
    """name -> (config, batch, precision)"""
    out = {}
    for E in (32, 48, 64, 80, 96, 128, 160, 192, 256):
        H = max(2, 512 // E)
        out[f"E{E}"] = (Config(vocab=512, context=256, d_model=H * E, n_layer=1, n_head=H,
                               d_ff=512), 4, "bf16")
    out["E128 grouped"] = (Config(vocab=512, context=256, d_model=1024, n_layer=1, n_head=8,
                                  d_ff=512, norm="rmsnorm", n_kv_head=2), 4, "bf16")
    out["T8192"] = (Config(vocab=512, context=8192, d_model=256, n_layer=1, n_head=2,
                           d_ff=256), 1, "bf16")
    out["T8192 fp32"] = (Config(vocab=512, context=8192, d_model=128, n_layer=1, n_head=1,
                                d_ff=128), 1, "fp32")
    out["V131072"] = (Config(vocab=131072, context=64, d_model=128, n_layer=1, n_head=2,
                             d_ff=256), 2, "bf16")
    out["D8192"] = (Config(vocab=256, context=16, d_model=8192, n_layer=1, n_head=64,
                           d_ff=256), 1, "bf16")
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", action="append")
    args = p.parse_args()
    backend = backend_module("cupy")
    failed = 0
    for name, (config, batch, precision) in shapes().items():
        if args.only and name not in args.only:
            continue
        path = attention_path(config, precision, batch)
        how = path.kind + (f" ({path.reason[:90]})" if path.reason else "")
        try:
            report = run_suite(backend, config, precision, batch=batch, steps=args.steps)
            verdict = report.summary().rsplit(": ", 2)[-2:]
            verdict = " ".join(verdict)
            ok = report.passed
            if not ok:
                print(report.table(report.failures), flush=True)
        except Exception as e:  # a refusal or a failure: one line, go on
            verdict, ok = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}", False
        failed += not ok
        print(f"{name:14s} B={batch} {precision}  {how}  {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
