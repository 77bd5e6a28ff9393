"""Backends with the reference's interface (SPEC sections 13 and 14).

Each backend module exposes `capture(config, hyper, precision, batch, state)
-> TrainingProgram` (see reference/contract.py for the interface) and
`available() -> bool`.
"""

from __future__ import annotations

import importlib
import platform

from ..reference.contract import RECOMPUTE_MODES, Capabilities
from ..reference.errors import ConfigError

BACKENDS = {
    "reference": "coppelius.reference.program",
    "mlx": "coppelius.accelerated.mlx_backend",
    "cupy": "coppelius.accelerated.cuda.program",
}

# What each backend can do, declared here as data so that reading it imports
# no backend (importing cupy takes seconds). tests/test_capabilities.py checks
# what it can against the programs themselves.
CAPABILITIES = {
    # the definition: NumPy on the host, fp32 by default; chosen where nothing else is
    "reference": Capabilities(default_precision="fp32", data_parallel=False, device_clock=False,
                              device_memory=False, host_data=True, recompute=(),
                              defines=True, device="cpu", preference=0),
    # Apple silicon's GPU, on unified memory (host memory); on Linux MLX runs
    # on the CPU with the netlib reference BLAS (about 30x slower than
    # NumPy's OpenBLAS on a large product): a conformance backend there,
    # never chosen by default
    "mlx": Capabilities(default_precision="fp32", data_parallel=False, device_clock=False,
                        device_memory=False, host_data=True, recompute=RECOMPUTE_MODES,
                        defines=False, device="gpu", preference=1, platforms=("Darwin",)),
    # an NVIDIA GPU (available() only where there is one): bf16 by default
    # (SPEC 6), CUDA events around a replay, CuPy's memory pool, NCCL ranks
    "cupy": Capabilities(default_precision="bf16", data_parallel=True, device_clock=True,
                         device_memory=True, host_data=False, recompute=RECOMPUTE_MODES,
                         defines=False, device="cuda", preference=2),
}

# a backend in BACKENDS without a declaration (a test's stand-in) can do the
# least: fp32 on the host, checked like any other, never chosen by default
UNDECLARED = Capabilities(default_precision="fp32", data_parallel=False, device_clock=False,
                          device_memory=False, host_data=True, recompute=(), defines=False,
                          device="cpu", preference=-1)


def capabilities(name: str) -> Capabilities:
    """What backend `name` declares it can do; a clear error if unknown."""
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r}: unknown (choose from {', '.join(BACKENDS)})")
    return CAPABILITIES.get(name, UNDECLARED)


def data_parallel_backends() -> list:
    """The backends that run W > 1 ranks (SPEC 19), by name."""
    return [name for name in BACKENDS if capabilities(name).data_parallel]


# what a backend's library is installed with (the extras of pyproject.toml)
INSTALL = {"mlx": "pip install 'coppelius[mlx]'", "cupy": "pip install 'coppelius[cuda]'"}


def backend_module(name: str):
    """The module of backend `name`; a clear error if unknown or unavailable here."""
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r}: unknown (choose from {', '.join(BACKENDS)})")
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as e:
        raise ConfigError(f"backend {name!r}: not available here ({e}){_install(name)}") from None
    if not module.available():
        raise ConfigError(f"backend {name!r}: not available on this machine{_install(name)}")
    return module


def _install(name: str) -> str:
    if name not in INSTALL:
        return ""
    needs = " (it needs an NVIDIA GPU)" if name == "cupy" else ""
    return f"; install its library with {INSTALL[name]}{needs}"


def available_backends() -> list:
    names = []
    for name, module_name in BACKENDS.items():
        try:
            if importlib.import_module(module_name).available():
                names.append(name)
        except ImportError:
            pass
    return names


def best_backend() -> str:
    """The available backend of the highest declared preference among those
    preferred on this platform: cupy with a GPU, else mlx on Apple silicon,
    else the reference (CAPABILITIES says why)."""
    system = platform.system()
    names = [name for name in available_backends() if capabilities(name).preferred_on(system)]
    return max(names, key=lambda name: capabilities(name).preference, default="reference")


def attention_note(report: dict) -> str:
    """A program's compilation report's attention path where it is not
    cuDNN's fused attention, with the reason (fp32's policy, a missing
    cuDNN frontend, the shape), else '': what `coppelius train` and
    `coppelius bench` say of a step slower than it could be."""
    reason = report.get("attention_reason") or ""
    return f"attention {report.get('attention')}, cuDNN's not used: {reason}" if reason else ""
