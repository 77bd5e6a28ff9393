"""Helpers several test modules share (the tests folder is on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from coppelius.reference.stream import write_stream


def on_threads(n, work, timeout=30):
    """work(r) for r in range(n), each on a thread of its own (ranks as
    threads) -> their results in rank order. Every thread must end within
    `timeout` seconds; the first failure is raised."""
    out, failures = [None] * n, []

    def run(r):
        try:
            out[r] = work(r)
        except BaseException as e:  # noqa: BLE001 -- reported below
            failures.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank did not end"
    if failures:
        raise failures[0]
    return out


def pattern_stream(path, config, contexts: int, noise: float) -> str:
    """A synthetic token stream (no tokenizer) of `contexts` contexts of
    `config`: a learnable pattern (id 5 t mod V at position t), a fraction
    `noise` of its ids drawn at random instead. -> the path, as a str."""
    rng = np.random.default_rng(7)
    ids = (np.arange(contexts * config.context + 1) * 5 % config.vocab).astype(np.uint32)
    noisy = rng.random(ids.size) < noise
    ids[noisy] = rng.integers(0, config.vocab, noisy.sum())
    write_stream(path, ids, source_mtime_ns=0, source_size=0)
    return str(path)


def check_family_fields_reach_the_step(backend: str) -> None:
    """A model whose norm_eps and rope_base are not the defaults (SPEC 21):
    the backend's logits against the reference's within SPEC 14's fp32
    tolerance (the defaults' logits are far outside it, so the fields
    reached the step), and, while it does not compute norm=rmsnorm, that
    field refused at capture by name."""
    import pytest

    from coppelius import accelerated
    from coppelius.conformance.cases import random_state
    from coppelius.conformance.tolerances import relative_error, tolerance
    from coppelius.reference.config import Config, Hyper
    from coppelius.reference.errors import ConfigError
    from coppelius.reference.model import model_forward

    shape = dict(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96)
    module = accelerated.backend_module(backend)
    config = Config(**shape, norm_eps="1/1000", rope_base=500000)
    state = random_state(config, 3)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (2, config.context))
    program = module.capture(config, Hyper(), "fp32", 2, state)
    want = model_forward(config, state.P, tokens, "fp32")[0]
    assert relative_error(program.logits(tokens), want)[0] <= tolerance("logits", "fp32")
    default = model_forward(Config(**shape), state.P, tokens, "fp32")[0]
    assert relative_error(default, want)[0] > 100 * tolerance("logits", "fp32")
    if "norm" in module.IMPLEMENTED:
        return
    rms = Config(**shape, norm="rmsnorm")
    with pytest.raises(ConfigError, match=rf"{backend}: config field norm='rmsnorm'"):
        module.capture(rms, Hyper(), "fp32", 2, random_state(rms, 3))


# Test modules run whole on the CuPy backend's CPU stand-ins: a module's
# tests marked `inside` run only under dev/cuda/emulate.py, which the
# module's own run_inside_the_emulator(__file__) starts in a process of its own.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATE = os.path.join(ROOT, "dev", "cuda", "emulate.py")
EMULATED = getattr(sys.modules.get("cupy"), "__version__", None) == "emulated"
inside = pytest.mark.skipif(not EMULATED, reason="runs under dev/cuda/emulate.py, started by "
                                                 "test_on_the_emulated_backend")


def run_inside_the_emulator(test_file: str, timeout: int) -> None:
    """The module `test_file`'s tests on the stand-ins, in a process of
    their own; every one must pass."""
    if EMULATED:
        pytest.skip("the run itself")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, EMULATE, "--pytest-files", os.path.abspath(test_file),
                        "-q", "-x", "-p", "no:randomly"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and "failed" not in p.stdout, p.stdout[-2000:]
