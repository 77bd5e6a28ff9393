"""accelerated/cuda/dependent_launch.py without a GPU: the driver's
structures laid out as cuda.h lays them out, every kernel argument packed
as CuPy packs it (read back from the addresses handed to the driver), the
launch's configuration as given, and the choice of launch by device and
COPPELIUS_DEPENDENT_LAUNCH. The step's bits with and without dependent
launch are compared on the device (tests/cuda/test_dependent_launch.py)."""

import ctypes
import struct
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from coppelius.accelerated.cuda import dependent_launch as dl
from coppelius.reference.errors import ConfigError


def test_the_structures_have_cuda_h_layout():
    # CUlaunchAttribute: id (4), pad (4), value union (64); CUlaunchConfig:
    # six dims and the shared bytes (28), the stream at 32, attrs at 40, numAttrs at 48
    assert ctypes.sizeof(dl._Attribute) == 72
    assert dl._Attribute.value.offset == 8
    assert ctypes.sizeof(dl._Config) == 56
    assert (dl._Config.shared_mem.offset, dl._Config.stream.offset, dl._Config.attrs.offset,
            dl._Config.num_attrs.offset) == (24, 32, 40, 48)


class Array:  # a device array as the launchers pass it: its address at .data.ptr
    def __init__(self, ptr):
        self.data = types.SimpleNamespace(ptr=ptr)


def read_back(params, i, n):
    return ctypes.string_at(params[i], n)


ARG = st.one_of(
    st.integers(0, 2**64 - 1).map(lambda p: ("array", p)),
    st.integers(-2**31, 2**31 - 1).map(lambda v: ("int32", v)),
    st.integers(-2**63, 2**63 - 1).map(lambda v: ("int64", v)),
    st.integers(0, 2**64 - 1).map(lambda v: ("uint64", v)),
    st.floats(width=32, allow_nan=False).map(lambda v: ("float32", v)),
    st.floats(allow_nan=False).map(lambda v: ("float64", v)),
    st.integers(-2**63, 2**63 - 1).map(lambda v: ("int", v)),
    st.floats(allow_nan=False).map(lambda v: ("float", v)),
    st.just(("none", None)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(ARG, max_size=12))
def test_kernel_params_hold_each_arguments_bytes(drawn):
    args, want = [], []
    for kind, v in drawn:
        if kind == "array":
            args.append(Array(v)), want.append(struct.pack("<Q", v))
        elif kind == "none":
            args.append(None), want.append(struct.pack("<Q", 0))
        elif kind == "int":
            args.append(v), want.append(struct.pack("<q", v))
        elif kind == "float":
            args.append(v), want.append(struct.pack("<d", v))
        else:
            x = np.dtype(kind).type(v)
            args.append(x)
            want.append(struct.pack("<" + {"int32": "i", "int64": "q", "uint64": "Q",
                                           "float32": "f", "float64": "d"}[kind], v))
    params, held = dl.kernel_params(args)
    assert len(held) == len(args)
    for i, w in enumerate(want):
        assert read_back(params, i, len(w)) == w, (i, drawn[i])


def test_kernel_params_refuse_what_cupy_would_not_pass():
    with pytest.raises(TypeError, match="str"):
        dl.kernel_params(("a string",))


def fake_cupy(major, capturing=True):
    runtime = types.SimpleNamespace(getDevice=lambda: 0,
                                    getDeviceProperties=lambda i: {"major": major})
    stream = types.SimpleNamespace(ptr=0x5EED, is_capturing=lambda: capturing)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=runtime, get_current_stream=lambda: stream))


class Function:
    def __init__(self, ptr):
        self.ptr, self.calls = ptr, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_dependent_launch_is_taken_on_hopper_and_later_only(monkeypatch):
    monkeypatch.delenv(dl.ENV, raising=False)
    functions = {"a": Function(1), "b": types.SimpleNamespace(kernel=Function(2))}
    for major, dependent in ((8, False), (9, True), (10, True)):
        got = dl.wrap(functions, fake_cupy(major))
        assert all(isinstance(f, dl.DependentKernel) == dependent for f in got.values())
    assert [f.ptr for f in dl.wrap(functions, fake_cupy(9)).values()] == [1, 2]
    broken = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=None))
    assert dl.wrap(functions, broken) is functions  # no device: plain launches
    # switched off, the kernels still wrap (a module outlives the setting: each launch asks)
    monkeypatch.setenv(dl.ENV, "off")
    assert all(isinstance(f, dl.DependentKernel)
               for f in dl.wrap(functions, fake_cupy(9)).values())


@pytest.mark.parametrize("value", ["0", "yes", "OFF"])
def test_a_bad_setting_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv(dl.ENV, value)
    with pytest.raises(ConfigError, match=f"{dl.ENV}={value!r}: on or off"):
        dl.wrap({}, fake_cupy(9))


def test_a_launch_hands_the_driver_its_configuration(monkeypatch):
    monkeypatch.delenv(dl.ENV, raising=False)
    seen = {}

    def launch(config, function, params, extra):
        c = config._obj
        attribute = c.attrs[0]
        seen.update(grid=tuple(c.grid), block=tuple(c.block), shared=c.shared_mem,
                    stream=c.stream, n=c.num_attrs, id=attribute.id, value=attribute.value[0],
                    function=function.value, extra=extra,
                    args=[read_back(params, 0, 8), read_back(params, 1, 4)])
        return seen.pop("status", 0)

    monkeypatch.setattr(dl, "_LAUNCH", launch)
    kernel = dl.wrap({"k": Function(0xF00)}, fake_cupy(9))["k"]
    kernel((3, 2), (128,), (Array(0xABC), np.int32(-7)), shared_mem=4096)
    assert seen == dict(grid=(3, 2, 1), block=(128, 1, 1), shared=4096, stream=0x5EED, n=1,
                        id=dl.PROGRAMMATIC_STREAM_SERIALIZATION, value=1, function=0xF00,
                        extra=None, args=[struct.pack("<Q", 0xABC), struct.pack("<i", -7)])
    seen.clear()
    kernel((1,), (32,), (Array(1), np.int32(0)),
           stream=types.SimpleNamespace(ptr=77, is_capturing=lambda: True))
    assert seen["stream"] == 77 and seen["shared"] == 0
    seen["status"] = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx: CUresult 1"):
        kernel((1,), (32,), (Array(1), np.int32(0)))
    # an eager launch (no capture: the warm-up, sampling's forward) is CuPy's own, plain
    seen.clear()
    eager = Function(6)
    dl.DependentKernel(eager, fake_cupy(9, capturing=False))((2,), (64,), (np.int32(1),))
    assert eager.calls == [(((2,), (64,), (np.int32(1),)), {"shared_mem": 0})] and not seen
    # switched off after the program's module was loaded: the next captures launch plainly
    monkeypatch.setenv(dl.ENV, "off")
    plain = Function(5)
    dl.DependentKernel(plain, fake_cupy(9))((2,), (64,), (np.int32(1),), shared_mem=8)
    assert plain.calls == [(((2,), (64,), (np.int32(1),)), {"shared_mem": 8})]
