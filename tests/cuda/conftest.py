"""The CUDA backend's tests run on the device where a GPU is present, and
elsewhere on the CPU stand-ins of dev/cuda/emulated (the fake `cupy`, the
NumPy kernels, cuBLAS's and cuDNN's stand-ins), in the main pytest process:
each test here, and the import of each test module here, runs with the
stand-ins installed, and everything they replace (module attributes,
sys.modules' `cupy` and `cudnn`) is restored after, so that no test
elsewhere sees a fake cupy. The `cuda_emulation` fixture is tests/conftest.py's."""

import pytest

from tests.conftest import emulation


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # a test module here imports cupy (through helpers.py) when collected
    if isinstance(collector, pytest.Module):
        with emulation():
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def _stand_ins(cuda_emulation):
    """Every test here on the device, or on the stand-ins where no GPU is."""
    yield
