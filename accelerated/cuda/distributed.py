"""Collective operations of the data-parallel CUDA step (SPEC 19).

W ranks, one process per GPU, each with its own captured step. The ranks'
gradients are summed and their row losses gathered by NCCL inside each
rank's CUDA graph, so that a step is still one replay per rank:

    after the backward    all_reduce_sum(G)                  (N,) float32, in place
                          all_gather(rows, gathered)         (b*T,) -> (B*T,), rank order
                          all_reduce_sum(stop)               (1,): ranks asking to stop
    then                  the mean loss, the norm, the clip, AdamW on the summed G

With the optimizer state sharded (`shard`, SPEC 23) rank r of W keeps M
and V only for its shard of the parameter vector, elements [r*S, r*S + n_r)
with S = ceil(N/W) (the last shard n_r = N - (W-1)*S, shorter); P stays
whole on every rank (the forward reads it), so the update's float32 master
of the shard is the rank's slice of P:

    after the backward    reduce_scatter_sum(G, Gs)          (W*S,) -> (S,): the shard's sum
                          all_gather(rows, gathered), all_reduce_sum(stop)   as above
    the norm              each rank's partial sums of its shard's squares
                          all_gather(partial, partials)      (NB,) -> (W*NB,), rank order
                          the norm and clip scale from all W*NB partials, summed
                          in one fixed order: the same bits on every rank
    then                  AdamW on the shard: P[r*S:][:n_r], M, V (and Pb)
                          all_gather(P[r*S:][:S], P)         in place, (S,) -> (W*S,)
                          all_gather(Pb[r*S:][:S], Pb)       bf16: the operands, as bytes

G, P and Pb are W*S long (the padding after N is zeros, never a
parameter), so that every rank's part of a collective is S elements.

`Communicator` is one rank's NCCL communicator (cupy.cuda.nccl, created
from a unique id that reached every rank through the launcher's rendezvous,
coppelius/launch.py). `Collectives` issues the step's collectives on the
program's stream and logs them like the kernels and products (the memory
plan's dry run, accelerated/cuda/memory_plan.py, and the capture's counts); with
no communicator it only logs (the dry run).

NCCL's sum of W = 2 float32 values is one rounded addition, the same on
both ranks whatever the order; for W > 2 NCCL's ring fixes an order per
element that does not change from one replay to the next, and every rank
receives the same bits (it is reduced once, then broadcast): every rank
applies the same update to the same parameters.

A rank that fails is told to the others by the launcher's control channel;
the watcher there sets `failure` and calls `abort()` (ncclCommAbort), which
makes the collectives a graph is blocked in return, so the replay completes
with values that mean nothing: the program checks `failure` after every wait
and raises it instead of handing them on (accelerated/cuda/program.py).
"""

from __future__ import annotations

import os
import threading

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

from ...reference.errors import RunError

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def _multicast_off() -> None:
    # SPEC 19: NVLink multicast (NVLS) stays off unless the user says otherwise;
    # NCCL reads its variables when it first initializes, in this process
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def check_devices(n: int) -> None:
    """Refuse `--gpus n` on a host with fewer GPUs."""
    count = cupy.cuda.runtime.getDeviceCount()
    if count < n:
        raise RunError(f"--gpus {n}: this host has {count} GPU{'s' if count != 1 else ''}")


def use_device(local_rank: int | None, rank: int) -> int:
    """Make this rank's GPU the current device: LOCAL_RANK's, or (where the
    launcher sets none) the rank modulo this host's GPUs. -> its index."""
    count = cupy.cuda.runtime.getDeviceCount()
    device = rank % count if local_rank is None else local_rank
    if device >= count:
        raise RunError(f"rank {rank}: local rank {device}, but this host has {count} "
                       f"GPU{'s' if count != 1 else ''}")
    cupy.cuda.Device(device).use()
    return device


def nccl():
    """CuPy's NCCL module (cupy.cuda.nccl), imported on first use."""
    module = getattr(cupy.cuda, "nccl", None)
    if module is None:
        import importlib

        module = importlib.import_module("cupy.cuda.nccl")
    return module


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (made once, by rank 0) as 128 bytes."""
    _multicast_off()
    uid = nccl().get_unique_id()  # bytes (CuPy 14), or a tuple of signed chars (older)
    return bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(c % 256 for c in uid)


def _id_tuple(unique_id: bytes) -> tuple:
    # CuPy takes the id as a tuple of C chars, signed
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
    return tuple(b - 256 if b > 127 else b for b in unique_id)


class Communicator:
    """One rank's NCCL communicator on the current CUDA device (select the
    device first). The constructor returns once all `world` ranks have
    joined with the same unique id."""

    def __init__(self, unique_id: bytes, rank: int, world: int):
        self.rank, self.world = rank, world
        self.failure = None  # an exception, set by the launcher's watcher before abort()
        self._lock = threading.Lock()
        self._nccl = nccl()
        _multicast_off()
        try:  # CuPy 14 takes the id as bytes, older CuPy as a tuple of signed chars
            self._comm = self._nccl.NcclCommunicator(world, bytes(unique_id), rank)
        except TypeError:
            self._comm = self._nccl.NcclCommunicator(world, _id_tuple(unique_id), rank)

    def check(self) -> None:
        """Raise the failure of another rank, once one was reported."""
        if self.failure is not None:
            raise self.failure

    def all_reduce_sum(self, x, stream_ptr: int) -> None:
        """x (n,) float32 on the device: the sum over the ranks, in place."""
        self.check()  # an aborted communicator must not be called again
        nccl = self._nccl
        self._comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                             stream_ptr)

    def all_gather(self, send, recv, stream_ptr: int) -> None:
        """send (n,) of each rank -> recv (W*n,): rank r's at [r*n, (r+1)*n).
        float32, or any other type moved as its bytes (bfloat16 bits); in
        place where send is recv's slice of this rank."""
        self.check()
        assert recv.size == send.size * self.world and recv.dtype == send.dtype, \
            (send.size, recv.size)
        count, kind = _count(send, self._nccl)
        self._comm.allGather(send.data.ptr, recv.data.ptr, count, kind, stream_ptr)

    def reduce_scatter_sum(self, send, recv, stream_ptr: int) -> None:
        """send (W*n,) float32 of each rank -> recv (n,): rank r's the sum
        over the ranks of send[r*n:(r+1)*n] (NCCL's order, fixed per element:
        for W = 2 one rounded addition, as all_reduce_sum's)."""
        self.check()
        assert send.size == recv.size * self.world, (send.size, recv.size)
        nccl = self._nccl
        self._comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, nccl.NCCL_FLOAT32,
                                 nccl.NCCL_SUM, stream_ptr)

    def abort(self) -> None:
        """ncclCommAbort: NCCL first raises the communicator's abort flag,
        so that the kernels of a collective waiting for a lost rank return,
        then frees it. The freeing is an intra-node collective (every rank
        of the host calls it) and waits for the CUDA graphs holding this
        communicator's work: release the programs first (their graphs),
        at a normal end as after a failure. Also the normal end of a
        communicator once the last step is waited for. A second call while
        one is under way returns at once: it never waits for the first."""
        if not self._lock.acquire(blocking=False):
            return  # another thread is aborting it
        try:
            if self._comm is not None:
                comm, self._comm = self._comm, None
                comm.abort()
        finally:
            self._lock.release()


def _count(x, nccl) -> tuple:
    """(count, NCCL type) of x's elements: float32 as floats, else bytes."""
    if x.dtype == "float32":
        return x.size, nccl.NCCL_FLOAT32
    return x.size * x.itemsize, nccl.NCCL_UINT8


class Collectives:
    """The step's collective operations over `comm` on the program's stream
    (its pointer), each logged while `log` is set (a memory_plan.CommandLog)
    as a command of kind "collective". comm None: logged only (the memory
    plan's dry run) -- `rank` and `world` say whose step it is."""

    def __init__(self, comm, stream_ptr: int, rank: int | None = None, world: int | None = None):
        self.comm, self.stream = comm, stream_ptr
        self.rank = comm.rank if comm is not None else rank
        self.world = comm.world if comm is not None else world
        self.log = None

    def all_reduce_sum(self, x) -> None:
        if self.log is not None:
            self.log.add("collective", "all_reduce_sum", {"count": int(x.size)}, [x.data.ptr])
        if self.comm is not None:
            self.comm.all_reduce_sum(x, self.stream)

    def all_gather(self, send, recv) -> None:
        if self.log is not None:
            self.log.add("collective", "all_gather", {"count": int(send.size)}
                         | ({} if send.dtype == "float32" else {"dtype": str(send.dtype)}),
                         [send.data.ptr, recv.data.ptr])
        if self.comm is not None:
            self.comm.all_gather(send, recv, self.stream)

    def reduce_scatter_sum(self, send, recv) -> None:
        if self.log is not None:
            self.log.add("collective", "reduce_scatter_sum", {"count": int(recv.size)},
                         [send.data.ptr, recv.data.ptr])
        if self.comm is not None:
            self.comm.reduce_scatter_sum(send, recv, self.stream)
