"""Programmatic dependent launch: the project's kernels launched through the
driver's cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
so that a kernel's launch and its blocks' placement overlap the end of the
kernel before it in the stream (recorded into the step's graph as
programmatic edges). Every kernel's first statement, AFTER_PRIOR_GRIDS()
(kernels/common.cuh), waits until that kernel has completed and its writes
are visible, then lets the next one launch: what a kernel reads and writes
stays after its predecessor's end, and the step's bits are those of plain
launches (tests/cuda/test_dependent_launch.py).

Taken on devices of compute capability 9.0 and later, for the modules
assembled from the project's own kernel files (a dev/ variant swapped in
by compile.Kernels(replace=...) keeps plain launches: its kernels need not
wait). COPPELIUS_DEPENDENT_LAUNCH=off launches every kernel plainly (the
same bits; for a profile, or to rule it out). Kernels of cuBLAS, cuDNN and
NCCL keep their libraries' launches: the edge after one of them is a full
dependency, as before.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from ...reference.errors import ConfigError

ENV = "COPPELIUS_DEPENDENT_LAUNCH"
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, the value union (64 bytes)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint64 * 8)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


def wanted() -> bool:
    """COPPELIUS_DEPENDENT_LAUNCH: on (unset, empty or "on") or "off"."""
    choice = os.environ.get(ENV, "") or "on"
    if choice not in ("on", "off"):
        raise ConfigError(f"{ENV}={choice!r}: on or off")
    return choice == "on"


def supported(cupy) -> bool:
    """A CUDA device of compute capability 9.0 or later is current (CuPy's
    stand-ins report none)."""
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    except Exception:  # noqa: BLE001 -- no device, or a stand-in without the call
        return False
    return int(props.get("major", 0)) >= 9


def kernel_params(args) -> tuple:
    """(void*[] of the arguments' values, the objects holding them) as CuPy
    passes a raw kernel's arguments: an array its device address, a NumPy
    scalar its bytes, a Python int an int64, a float a double, a bool a
    byte, None a null address."""
    held = []
    for a in args:
        data = getattr(a, "data", None)
        if a is None:
            held.append(ctypes.c_uint64(0))
        elif hasattr(data, "ptr"):  # a CuPy array
            held.append(ctypes.c_uint64(data.ptr))
        elif isinstance(a, np.generic):
            held.append(ctypes.create_string_buffer(a.tobytes(), a.itemsize))
        elif isinstance(a, bool):
            held.append(ctypes.c_bool(a))
        elif isinstance(a, int):
            held.append(ctypes.c_int64(a))
        elif isinstance(a, float):
            held.append(ctypes.c_double(a))
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}")
    params = (ctypes.c_void_p * max(1, len(held)))(*[ctypes.addressof(h) for h in held])
    return params, held


_LAUNCH = None


def _launch_ex():
    global _LAUNCH
    if _LAUNCH is None:
        from .gemm import driver

        f = driver().cuLaunchKernelEx
        f.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        _LAUNCH = f
    return _LAUNCH


class DependentKernel:
    """A loaded kernel (CuPy's RawKernel or Function), called as CuPy's:
    (grid, block, args, shared_mem=0, stream=None), launched with
    programmatic stream serialization on the given (else the current)
    stream while that stream is being captured: the replayed graph is where
    the overlap is worth something. Eager launches (the warm-up step,
    sampling's forward a token, debugging steps) go plainly, by CuPy's own
    launch, which costs the host a fraction of this one's ctypes call
    (about 20 us a launch); so do all while COPPELIUS_DEPENDENT_LAUNCH is
    off (read at each captured launch: a program captured then keeps plain
    launches in its graph)."""

    def __init__(self, function, cupy):
        self.function = function
        self.cupy = cupy
        self.ptr = getattr(function, "kernel", function).ptr  # CUfunction

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        s = stream if stream is not None else self.cupy.cuda.get_current_stream()
        if not s.is_capturing() or not wanted():  # eager, or switched off: a plain launch
            extra = {} if stream is None else {"stream": stream}
            self.function(grid, block, args, shared_mem=shared_mem, **extra)
            return
        grid = (tuple(grid) + (1, 1))[:3]
        block = (tuple(block) + (1, 1))[:3]
        attribute = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        attribute.value[0] = 1  # programmaticStreamSerializationAllowed
        config = _Config((ctypes.c_uint * 3)(*(max(1, int(g)) for g in grid)),
                         (ctypes.c_uint * 3)(*(max(1, int(b)) for b in block)),
                         int(shared_mem), ctypes.c_void_p(s.ptr), ctypes.pointer(attribute), 1)
        params, held = kernel_params(args)
        status = _launch_ex()(ctypes.byref(config), ctypes.c_void_p(self.ptr), params, None)
        del held
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx: CUresult {status}")


def wrap(functions: dict, cupy) -> dict:
    """functions as DependentKernels where the device takes dependent
    launch (each asks COPPELIUS_DEPENDENT_LAUNCH at its launches: the module
    is compiled once a process, its programs captured later); else
    functions unchanged. A bad setting is refused here already."""
    wanted()
    if not supported(cupy):
        return functions
    return {name: DependentKernel(f, cupy) for name, f in functions.items()}
