"""The stand-in CuPy runtime: host arrays for device memory (their
.data.ptr a real address), a memory pool counting the arrays alive,
streams, captures and graphs (commands recorded once, replayed later,
arguments frozen at capture), events, devices."""

from __future__ import annotations

import threading
import types
import weakref

import numpy as np


class _ThreadState(threading.local):
    """What a thread's stream work sees (one thread per rank in data
    parallelism, as one process per rank on GPUs)."""

    def __init__(self):
        self.recording = None  # the command list of the capturing stream, or None
        self.capturing = None  # the stream being captured, or None
        self.current = []  # the streams entered with `with stream:`, innermost last
        self.captured_comms = []  # NCCL communicators with work in the capture under way


_STATE = _ThreadState()


def _submit(command):
    if _STATE.recording is not None:
        _STATE.recording.append(command)
    else:
        command()


# ---------------------------------------------------------------- arrays

class DevArray(np.ndarray):
    """Host memory standing in for device memory: .data.ptr is a real address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def get(self, stream=None, out=None, blocking=True):
        if out is None:
            return np.array(self.view(np.ndarray), copy=True)
        # the copy into `out` (pinned memory on a GPU) is a stream command
        source = self.view(np.ndarray)
        if source.size != out.size:
            raise ValueError(f"get(out=): {source.size} elements into {out.size}")
        _submit(lambda: out.__setitem__(..., source.reshape(out.shape)))
        return out

    def set(self, arr, stream=None):
        self.view(np.ndarray)[...] = np.asarray(arr).reshape(self.shape)


_OWNERS = {}  # id -> weak reference of each array owning emulated device memory


def _dev(a):
    a = np.ascontiguousarray(a)
    if a.base is None:  # it owns its memory: counted while it (or any view of it) lives
        _OWNERS[id(a)] = weakref.ref(a, lambda ref, key=id(a): _OWNERS.pop(key, None))
    return a.view(DevArray)


class MemoryPool:
    """cupy.get_default_memory_pool() of the stand-ins: the bytes of every
    emulated device array still alive (views keep their owner alive)."""

    def used_bytes(self):
        arrays = (ref() for ref in list(_OWNERS.values()))
        return sum(a.nbytes for a in arrays if a is not None)

    def total_bytes(self):
        return self.used_bytes()  # nothing is cached

    def free_all_blocks(self):
        pass


_POOL = MemoryPool()


def full(shape, value, dtype):
    return _dev(np.full(shape, value, dtype=dtype))


def zeros(shape, dtype):
    return _dev(np.zeros(shape, dtype=dtype))


def asarray(a):
    return _dev(np.array(a, copy=True))


def empty(shape, dtype=np.float32):
    return _dev(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0xAB, dtype=dtype))


def asnumpy(a):
    return np.array(np.asarray(a).view(np.ndarray), copy=True)


class Graph:
    def __init__(self, commands):
        self.commands = commands
        for comm in _STATE.captured_comms:  # NCCL ties its work to the graph's life
            comm.graphs.add(self)
        _STATE.captured_comms = []

    def launch(self, stream=None):
        for command in self.commands:
            command()


class Stream:
    def __init__(self, non_blocking=False):
        self.ptr = 0

    def __enter__(self):
        _STATE.current.append(self)
        return self

    def __exit__(self, *exc):
        _STATE.current.pop()
        return False

    def synchronize(self):
        assert _STATE.recording is None, "synchronize during capture"

    def is_capturing(self):
        return _STATE.capturing is self

    def begin_capture(self):
        assert _STATE.recording is None
        _STATE.recording, _STATE.capturing = [], self

    def end_capture(self):
        graph = Graph(_STATE.recording)
        _STATE.recording = _STATE.capturing = None
        return graph


_NULL = Stream()  # the legacy default stream


def alloc_pinned_memory(nbytes):
    """Page-locked host memory on a GPU; any host buffer here."""
    return bytearray(nbytes)


class Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        assert _STATE.recording is None, "event recorded during capture"

    def synchronize(self):
        pass

    @property
    def done(self):
        return True  # the stand-ins run every command when it is submitted


class Device:
    def __init__(self, device=0):
        self.id = int(device)

    def use(self):
        pass

    def synchronize(self):
        assert _STATE.recording is None, "synchronize during capture"


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1,
    getDeviceProperties=lambda i: {"name": b"emulated"},
    memGetInfo=lambda: (0, 0),
    runtimeGetVersion=lambda: 0,
)
