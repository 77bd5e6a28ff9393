import contextlib
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# tests/ itself is never on the path: its package `tests.cuda` would shadow
# NVIDIA's `cuda` package, which CuPy imports (the tests' own modules are
# `tests.support`, `tests.cuda.helpers`)

settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


def emulated_cupy() -> bool:
    """Whether sys.modules' cupy is dev/cuda/emulated's stand-in."""
    return getattr(sys.modules.get("cupy"), "__version__", None) == "emulated"


def has_gpu() -> bool:
    """A CUDA device through the real CuPy: False where the stand-ins are
    installed (dev/cuda/emulate.py), whose cupy reports one device."""
    if emulated_cupy():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


_GPU = []  # has_gpu(), asked once without the stand-ins


def gpu_here() -> bool:
    if not _GPU and not emulated_cupy():
        _GPU.append(has_gpu())
    return bool(_GPU and _GPU[0])


def _emulated():
    """dev/cuda/emulated, the CUDA backend's CPU stand-ins."""
    if "emulated" not in sys.modules:
        folder = os.path.join(ROOT, "dev", "cuda")
        sys.path.insert(0, folder)
        try:
            import emulated  # noqa: F401
        finally:
            sys.path.remove(folder)
    return sys.modules["emulated"]


@contextlib.contextmanager
def emulation():
    """Inside the block the CUDA backend runs on the stand-ins where no GPU
    is here; restored after (dev/cuda/emulated's uninstall). Nothing where a
    GPU is, or where the stand-ins are installed already (emulate.py)."""
    if gpu_here() or emulated_cupy():
        yield
        return
    stand_ins = _emulated()
    stand_ins.install()
    try:
        yield
    finally:
        stand_ins.uninstall()


@pytest.fixture
def cuda_emulation():
    """The test on the device, or on the CPU stand-ins where no GPU is here
    (tests/cuda: every test; test_program_contract.py: the cupy rows)."""
    with emulation():
        yield


# The suite never writes into the real home: the user's stream cache
# (coppelius.data.default_cache_dir, $COPPELIUS_CACHE) is moved to a folder
# of the session's for the fixtures of wider scope, and to a folder of each
# test's own for the test (a test that tokenizes finds an empty cache, as it
# found an empty runs/data when the cache lay under the working folder).
# Subprocesses inherit it.

@pytest.fixture(scope="session", autouse=True)
def session_stream_cache(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("session-cache") / "coppelius")
    old = os.environ.get("COPPELIUS_CACHE")
    os.environ["COPPELIUS_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("COPPELIUS_CACHE", None)
    else:
        os.environ["COPPELIUS_CACHE"] = old


@pytest.fixture(autouse=True)
def stream_cache(tmp_path_factory, monkeypatch):
    """COPPELIUS_CACHE: a fresh folder of the test's own (made when first used)."""
    path = tmp_path_factory.mktemp("cache", numbered=True) / "coppelius"
    monkeypatch.setenv("COPPELIUS_CACHE", str(path))
    return path


def pytest_collection_modifyitems(config, items):
    gpu = gpu_here() or emulated_cupy()  # emulate.py --pytest*: the stand-ins' run
    try:
        import mlx.core  # noqa: F401

        mlx_ok = True
    except Exception:
        mlx_ok = False
    for item in items:
        # `emulated` gpu tests run on the stand-ins where no GPU is here
        if "gpu" in item.keywords and not gpu and "emulated" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="no NVIDIA GPU with CuPy here"))
        if "mlx" in item.keywords and not mlx_ok:
            item.add_marker(pytest.mark.skip(reason="MLX is not installed here"))
