"""The CuPy backend on the CPU: stand-ins for the few CuPy pieces it uses
(runtime.py: arrays, streams, events, graphs, a memory pool counting the
arrays alive; nccl.py: NCCL's collectives over threads), NumPy versions of
its kernels, one module per kernel family with the family's name
(precision, embedding, layernorm, rmsnorm, linear_bias, rope, attention,
attention_fused, swiglu, crossentropy, adamw; common.py what they share, kernels.py the
stand-in compiled module), a column-major GEMM behind the cuBLAS entry
points (cublas.py) and cuDNN's attention graphs (cudnn.py).

install() points the backend's modules (coppelius.accelerated.cuda.*) at
the stand-ins and puts the fake `cupy` and `cudnn` modules in sys.modules;
uninstall() restores every attribute and sys.modules entry it replaced.
dev/cuda/emulate.py is the command line; tests/cuda/conftest.py installs
the stand-ins around each test where no GPU is present.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types

import numpy as np

from . import cublas, cudnn, kernels, nccl, runtime
from .cublas import FakeCublas
from .gemm import FakeGemmKernels
from .cudnn import fake_cudnn
from .kernels import KERNELS, RawModule
from .nccl import fake_nccl
from .runtime import (_NULL, _POOL, _STATE, Device, Event, Stream, _dev, alloc_pinned_memory,
                      asarray, asnumpy, empty, full, runtime as fake_runtime, zeros)

__all__ = ["KERNELS", "cublas", "cudnn", "fake_cudnn", "fake_cupy", "install", "installed_now",
           "kernels", "nccl", "runtime", "uninstall"]

fake_cupy = types.SimpleNamespace(
    __version__="emulated", full=full, zeros=zeros, asarray=asarray, empty=empty,
    asnumpy=asnumpy, RawModule=RawModule, get_default_memory_pool=lambda: _POOL,
    ascontiguousarray=lambda a: _dev(np.ascontiguousarray(a)),
    concatenate=lambda xs, axis=0: _dev(np.concatenate([np.asarray(x) for x in xs], axis=axis)),
    cuda=types.SimpleNamespace(Stream=Stream, Event=Event, Device=Device, runtime=fake_runtime,
                               nccl=fake_nccl, alloc_pinned_memory=alloc_pinned_memory,
                               get_elapsed_time=lambda a, b: 1.0,
                               get_current_stream=lambda: (_STATE.current[-1] if _STATE.current
                                                           else _NULL)))

PACKAGE = "coppelius.accelerated.cuda"
_MISSING = object()
_saved = None  # what install() replaced: [(owner, name, value)], restored by uninstall()


def backend_modules() -> list:
    """Every module of the CUDA backend's package, imported (before any fake
    is in sys.modules, so that each binds the CuPy of this machine)."""
    package = importlib.import_module(PACKAGE)
    return [importlib.import_module(f"{PACKAGE}.{m.name}")
            for m in pkgutil.iter_modules(package.__path__)]


def installed_now() -> bool:
    return _saved is not None


def install():
    """Point the backend's modules at the stand-ins; returns the backend
    module (coppelius.accelerated.cuda.program). Installing twice is one install."""
    global _saved
    modules = {m.__name__.rsplit(".", 1)[1]: m for m in backend_modules()}
    if _saved is not None:
        return modules["program"]
    saved = []

    def put(owner, name, value):
        if isinstance(owner, dict):
            saved.append((owner, name, owner.get(name, _MISSING)))
            owner[name] = value
        else:
            saved.append((owner, name, getattr(owner, name, _MISSING)))
            setattr(owner, name, value)

    for module in modules.values():
        if hasattr(module, "cupy"):
            put(module, "cupy", fake_cupy)
    put(modules["cublas"], "_LIB", FakeCublas())
    put(modules["gemm"], "Kernels", FakeGemmKernels)  # the own product kernel's stand-in
    put(modules["step"], "_KERNELS", {})  # each policy's module compiled by the stand-ins
    put(sys.modules, "cupy", fake_cupy)
    put(sys.modules, "cudnn", fake_cudnn)  # cudnn_attention imports it on first use
    attention = modules["cudnn_attention"]
    put(attention, "_frontend", None)
    put(attention, "_import_error", None)
    put(attention, "_handles", {})
    put(attention, "_graphs", {})
    _saved = saved
    return modules["program"]


def uninstall() -> None:
    """Restore what install() replaced, in reverse order."""
    global _saved
    if _saved is None:
        return
    for owner, name, value in reversed(_saved):
        if isinstance(owner, dict):
            if value is _MISSING:
                owner.pop(name, None)
            else:
                owner[name] = value
        elif value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    _saved = None
