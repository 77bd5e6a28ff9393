"""NCCL's stand-in (cupy.cuda.nccl): the ranks of one process, as threads,
join at a unique id; a collective is a command of the rank's stream that
meets the other ranks (SPEC 19)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
import types
import weakref

import numpy as np

from .common import _floats
from .runtime import _STATE, _submit


class _World:
    """The ranks of one unique id: a meeting point and one slot per rank."""

    def __init__(self, n):
        self.n = n
        self.slots = [None] * n
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0  # meetings completed

    def meet(self, aborted) -> bool:
        """Wait for every rank. False once aborted() (this rank's
        communicator, as NCCL's kernels return only after their own
        communicator's ncclCommAbort: another rank's abort, or its end,
        releases no one) or after 120 s (a lost rank never hangs a test)."""
        with self.cond:
            if aborted():
                return False
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.n:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return True
            deadline = time.monotonic() + 120
            while self.generation == generation:
                if aborted() or time.monotonic() > deadline:
                    self.arrived -= 1
                    return False
                self.cond.wait(0.01)
            return True


_WORLDS = {}
_WORLDS_LOCK = threading.Lock()


class NcclCommunicator:
    """cupy.cuda.nccl.NcclCommunicator for ranks that are threads of this
    process: the constructor returns once every rank joined the unique id;
    a collective is a command of the rank's stream (recorded by a capture,
    run at replay) that meets the other ranks. abort() raises this rank's
    abort flag: its collective waiting for the others returns with its
    buffer as it was, as NCCL's kernels do after ncclCommAbort (the other
    ranks' keep waiting until their own abort); then, as NCCL frees
    a communicator only once the CUDA graphs holding its work are gone,
    abort() waits for them (AssertionError after a while: a program still
    holds one)."""

    def __init__(self, ndev, commId, rank):
        assert len(commId) == 128 and 0 <= rank < ndev
        with _WORLDS_LOCK:
            self.world = _WORLDS.setdefault(tuple(commId), _World(ndev))
        assert self.world.n == ndev
        self.rank = rank
        self.graphs = weakref.WeakSet()
        self.aborted = False
        self._exchange(None)  # every rank has joined

    def _exchange(self, mine):
        """Every rank's contribution in rank order, or None once aborted."""
        w = self.world
        w.slots[self.rank] = mine
        if not w.meet(lambda: self.aborted):
            return None
        parts = list(w.slots)
        # every rank has read before a slot is written again
        return parts if w.meet(lambda: self.aborted) else None

    def _captured(self):
        if _STATE.recording is not None:
            _STATE.captured_comms.append(self)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert (datatype, op) == (NCCL_FLOAT32, NCCL_SUM)
        self._captured()

        def run():
            parts = self._exchange(_floats(sendbuf, count).copy())
            if parts is not None:
                total = parts[0]
                for part in parts[1:]:
                    total = total + part  # rank order, one float32 rounding per addition
                _floats(recvbuf, count)[...] = total

        _submit(run)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        assert datatype in (NCCL_FLOAT32, NCCL_UINT8)
        at = _floats if datatype == NCCL_FLOAT32 else _bytes
        self._captured()

        def run():  # each part copied before any is written: in place too
            parts = self._exchange(at(sendbuf, count).copy())
            if parts is not None:
                at(recvbuf, count * len(parts))[...] = np.concatenate(parts)

        _submit(run)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        assert (datatype, op) == (NCCL_FLOAT32, NCCL_SUM)
        self._captured()

        def run():
            n = recvcount
            parts = self._exchange(_floats(sendbuf, n * self.world.n).copy())
            if parts is not None:
                mine = [part[self.rank * n:(self.rank + 1) * n] for part in parts]
                total = mine[0]
                for part in mine[1:]:
                    total = total + part  # rank order, one float32 rounding per addition
                _floats(recvbuf, n)[...] = total

        _submit(run)

    def abort(self):
        self.aborted = True  # the abort flag: this rank's waiting collective returns
        with self.world.cond:
            self.world.cond.notify_all()
        deadline = time.monotonic() + 10
        while len(self.graphs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not len(self.graphs), "ncclCommAbort while a CUDA graph holds its work"


def _bytes(ptr, count):
    return np.frombuffer((ctypes.c_uint8 * count).from_address(ptr), dtype=np.uint8)


NCCL_UINT8, NCCL_FLOAT32, NCCL_SUM = 1, 7, 0
fake_nccl = types.SimpleNamespace(
    NcclCommunicator=NcclCommunicator, NCCL_FLOAT32=NCCL_FLOAT32, NCCL_UINT8=NCCL_UINT8,
    NCCL_SUM=NCCL_SUM,
    get_unique_id=lambda: tuple(b - 256 if b > 127 else b for b in os.urandom(128)))
