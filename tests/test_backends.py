"""Backend selection (SPEC section 15)."""

import os
import subprocess
import sys

import pytest

from coppelius import accelerated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WITHOUT = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from coppelius import accelerated
print(",".join(accelerated.available_backends()), accelerated.best_backend())
"""


@pytest.mark.parametrize("blocked", [{"mlx"}, {"mlx", "cupy"}])
def test_selection_survives_missing_backends(blocked):
    p = subprocess.run([sys.executable, "-c", WITHOUT.format(blocked=blocked)], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    names, best = p.stdout.split()
    assert "mlx" not in names.split(",") and "reference" in names.split(",")
    assert best in ("reference", "cupy")


def test_unknown_backend_is_one_clear_error():
    with pytest.raises(accelerated.ConfigError, match="backend 'nope': unknown"):
        accelerated.backend_module("nope")


def test_mlx_is_never_the_default_on_linux(monkeypatch):
    monkeypatch.setattr(accelerated, "available_backends", lambda: ["reference", "mlx"])
    monkeypatch.setattr(accelerated.platform, "system", lambda: "Linux")
    assert accelerated.best_backend() == "reference"
    monkeypatch.setattr(accelerated.platform, "system", lambda: "Darwin")
    assert accelerated.best_backend() == "mlx"
    monkeypatch.setattr(accelerated, "available_backends", lambda: ["reference", "mlx", "cupy"])
    assert accelerated.best_backend() == "cupy"


def test_the_tests_own_packages_shadow_no_package_cupy_imports():
    """tests/cuda is `tests.cuda`: were tests/ on the path, `import cuda`
    (NVIDIA's bindings, which CuPy imports) would find it, CuPy would fail
    to import on a GPU machine and the GPU tests would run on the stand-ins."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("cuda")
    tests = os.path.dirname(os.path.abspath(__file__))
    assert spec is None or not any(os.path.abspath(p).startswith(tests)
                                   for p in (spec.submodule_search_locations or [spec.origin]))
