"""The backends' declared capabilities (coppelius.accelerated.CAPABILITIES)
against what their programs do, where that is cheap to check, and
best_backend()'s choice from the declarations."""

import inspect
import math
import platform

import numpy as np
import pytest

from coppelius import accelerated
from coppelius.reference.config import Hyper, preset
from coppelius.reference.contract import RECOMPUTE_MODES, Capabilities, MissingCapability
from coppelius.reference.params import initialize
from coppelius.reference.state import State

CONFIG = preset("test")
B = 2


def available(name):
    return name in accelerated.available_backends()


def program_of(name, precision=None, **kw):
    module = accelerated.backend_module(name)
    precision = precision or accelerated.capabilities(name).default_precision
    return module.capture(CONFIG, Hyper(), precision, B, State.fresh(initialize(CONFIG)), **kw)


def tokens():
    rng = np.random.default_rng(3)
    return rng.integers(0, CONFIG.vocab, (B, CONFIG.context + 1))


LOCAL = [pytest.param(name, marks=pytest.mark.skipif(not available(name),
                                                     reason=f"backend {name} not available"))
         for name in ("reference", "mlx")]


def test_every_backend_declares_its_capabilities_and_nothing_else_is_declared():
    assert set(accelerated.CAPABILITIES) == set(accelerated.BACKENDS)
    assert all(isinstance(c, Capabilities) for c in accelerated.CAPABILITIES.values())


def test_one_backend_defines_and_it_is_the_reference_module():
    defining = [n for n, c in accelerated.CAPABILITIES.items() if c.defines]
    assert defining == ["reference"]
    assert accelerated.BACKENDS["reference"] == "coppelius.reference.program"


def test_default_precisions_follow_spec_6():
    # SPEC 6: bf16 on the CUDA backend, fp32 elsewhere
    for name, c in accelerated.CAPABILITIES.items():
        assert c.default_precision == ("bf16" if c.device == "cuda" else "fp32"), name


def test_declarations_agree_with_each_other():
    for name, c in accelerated.CAPABILITIES.items():
        assert c.device in ("cuda", "gpu", "cpu"), name
        assert c.host_data or c.device != "cpu", name  # a CPU step's buffers are in host memory
        assert not c.device_memory or c.device == "cuda", name  # bench reads CuPy's pool
        assert not c.data_parallel or c.device == "cuda", name  # NCCL ranks (SPEC 19)


@pytest.mark.parametrize("name", LOCAL)
def test_the_declared_default_precision_is_one_the_program_runs_and_reports(name):
    declared = accelerated.capabilities(name).default_precision
    program = program_of(name)
    program.upload_input(tokens())
    assert math.isfinite(program.replay_and_wait())
    assert program.precision == declared
    assert program.compilation_report()["precision"] == declared
    program.reset()


@pytest.mark.parametrize("name", LOCAL)
def test_the_declared_host_data_is_where_the_program_keeps_its_buffers(name):
    program = program_of(name)
    program.upload_input(tokens())
    program.replay_and_wait()
    loss = program.loss()
    if name == "reference":
        on_host = isinstance(loss, np.ndarray)
    else:  # MLX: the CPU device on Linux, unified memory on Apple silicon
        import mlx.core as mx

        on_host = mx.default_device() == mx.cpu or platform.system() == "Darwin"
    assert on_host == accelerated.capabilities(name).host_data
    program.reset()


@pytest.mark.parametrize("name", LOCAL)
def test_the_declared_device_clock_is_the_programs(name):
    program = program_of(name)
    program.upload_input(tokens())
    clock = accelerated.capabilities(name).device_clock
    if clock:
        assert math.isfinite(program.replay_timed().device_seconds())
    else:
        with pytest.raises(MissingCapability):
            program.replay_timed()
    _, seconds = program.replay_timed_and_wait()
    assert math.isnan(seconds) != clock
    program.reset()


@pytest.mark.parametrize("name", LOCAL)
def test_the_declared_recompute_and_data_parallelism_are_the_programs(name):
    c = accelerated.capabilities(name)
    assert set(c.recompute) <= set(RECOMPUTE_MODES)
    for mode in RECOMPUTE_MODES:  # each mode honoured or accepted and ignored
        program = program_of(name, recompute=mode)
        assert getattr(program, "recompute", None) == (mode if mode in c.recompute else None)
        program.reset()
    capture = accelerated.backend_module(name).capture
    assert ("comm" in inspect.signature(capture).parameters) == c.data_parallel


@pytest.mark.parametrize("system, names, want", [
    ("Linux", ["reference"], "reference"),
    ("Linux", ["reference", "mlx"], "reference"),  # MLX on Linux: a conformance backend
    ("Darwin", ["reference", "mlx"], "mlx"),
    ("Linux", ["reference", "mlx", "cupy"], "cupy"),
    ("Darwin", ["reference", "mlx", "cupy"], "cupy"),
    ("Windows", ["reference", "cupy"], "cupy"),
])
def test_best_backend_chooses_from_the_declarations(monkeypatch, system, names, want):
    monkeypatch.setattr(accelerated, "available_backends", lambda: list(names))
    monkeypatch.setattr(accelerated.platform, "system", lambda: system)
    assert accelerated.best_backend() == want


def test_an_undeclared_backend_can_do_the_least_and_an_unknown_one_is_refused(monkeypatch):
    from coppelius.reference.errors import ConfigError

    monkeypatch.setitem(accelerated.BACKENDS, "stand_in", "no.such.module")
    c = accelerated.capabilities("stand_in")
    assert c.default_precision == "fp32" and not (c.data_parallel or c.device_clock)
    assert c.preference < accelerated.capabilities("reference").preference
    with pytest.raises(ConfigError, match="unknown"):
        accelerated.capabilities("nonesuch")
