"""Backends with the reference's interface (SPEC sections 13 and 14).

Each backend module exposes `capture(config, hyper, precision, batch, state)
-> TrainingProgram` (see reference/program.py for the interface) and
`available() -> bool`.
"""

from __future__ import annotations

import importlib
import platform

from coppelius.reference.errors import ConfigError

BACKENDS = {
    "reference": "coppelius.reference.program",
    "mlx": "coppelius.accelerated.mlx_backend",
    "cupy": "coppelius.accelerated.cuda.program",
}


def backend_module(name: str):
    """The module of backend `name`; a clear error if unknown or unavailable here."""
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r}: unknown (choose from {', '.join(BACKENDS)})")
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as e:
        raise ConfigError(f"backend {name!r}: not available here ({e})") from None
    if not module.available():
        raise ConfigError(f"backend {name!r}: not available on this machine")
    return module


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
    """cupy with a GPU, else mlx on Apple silicon, else the reference.

    MLX on Linux runs on the CPU with the netlib reference BLAS (about 30x
    slower than NumPy's OpenBLAS on a large product): it is a conformance
    backend there and never chosen by default."""
    names = available_backends()
    if "cupy" in names:
        return "cupy"
    if "mlx" in names and platform.system() == "Darwin":
        return "mlx"
    return "reference"
