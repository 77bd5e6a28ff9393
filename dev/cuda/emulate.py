"""Run the CuPy backend on the CPU: a stand-in for the few CuPy pieces it
uses (arrays, streams, events, graphs, a memory pool counting the arrays
alive), NumPy versions of its kernels, and a column-major GEMM behind the
cuBLAS entry points. What this checks without a GPU is everything but the
CUDA source: the buffer plan, the launch arguments, the row-major to
column-major mapping of every product (pointers, leading dimensions, batch
strides), the order of the step, capture semantics (commands recorded once,
replayed later, pointers and scalars frozen at capture) and the program's
interface -- against reference.step through the conformance suite.

    python dev/cuda/emulate.py            # test preset, fp32 and bf16
    python dev/cuda/emulate.py --pytest   # the CuPy tests and contract rows on the stand-ins
    python dev/cuda/emulate.py --script dev/cuda/attention/check.py --preset test
                                          # a dev/cuda script on the stand-ins
    python dev/cuda/emulate.py --pytest-files FILE... [pytest args]
                                          # those test files on the stand-ins

NCCL's stand-in (cupy.cuda.nccl) joins the ranks of one process: data
parallelism runs here with one thread per rank (SPEC 19), each thread with
its own stream and capture, as each rank is a process of its own on GPUs.

The NumPy kernels follow the CUDA kernels' contracts (accelerated/kernels/*.cu
and their launchers in cuda_kernels.py), not their code; the CUDA source
itself is checked on the device (tests/test_cupy_backend.py). The kernel
files are still read and assembled here (the stand-in RawModule is handed
cuda_kernels.module_source()), so a missing or misnamed file fails.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys
import threading
import time
import types
import weakref

import ml_dtypes
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

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


class RawModule:
    def __init__(self, code, options=()):
        self.bf16 = "-DOPERAND_BF16" in options

    def get_function(self, name):
        body = KERNELS[name]
        bf16 = self.bf16

        def launch(grid, block, args, shared_mem=0):
            # On a GPU a kernel launched during a capture on any stream but
            # the capturing one runs at once and is missing from the graph
            capturing, current = _STATE.capturing, _STATE.current
            if capturing is not None and (not current or current[-1] is not capturing):
                raise AssertionError(f"kernel {name} launched outside the capturing stream")
            frozen = tuple(args)  # arguments are frozen at launch, as in a graph
            _submit(lambda: body(bf16, *frozen))

        return launch


# ---------------------------------------------------------------- NCCL (ranks as threads)

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


def _floats(ptr, count):
    return np.frombuffer((ctypes.c_float * count).from_address(ptr), dtype=np.float32)


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
        assert datatype == NCCL_FLOAT32
        self._captured()

        def run():
            parts = self._exchange(_floats(sendbuf, count).copy())
            if parts is not None:
                _floats(recvbuf, count * len(parts))[...] = np.concatenate(parts)

        _submit(run)

    def abort(self):
        self.aborted = True  # the abort flag: this rank's waiting collective returns
        with self.world.cond:
            self.world.cond.notify_all()
        deadline = time.monotonic() + 10
        while len(self.graphs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not len(self.graphs), "ncclCommAbort while a CUDA graph holds its work"


NCCL_FLOAT32, NCCL_SUM = 7, 0
fake_nccl = types.SimpleNamespace(
    NcclCommunicator=NcclCommunicator, NCCL_FLOAT32=NCCL_FLOAT32, NCCL_SUM=NCCL_SUM,
    get_unique_id=lambda: tuple(b - 256 if b > 127 else b for b in os.urandom(128)))


fake_cupy = types.SimpleNamespace(
    __version__="emulated", full=full, zeros=zeros, asarray=asarray, empty=empty,
    asnumpy=asnumpy, RawModule=RawModule, get_default_memory_pool=lambda: _POOL,
    ascontiguousarray=lambda a: _dev(np.ascontiguousarray(a)),
    concatenate=lambda xs, axis=0: _dev(np.concatenate([np.asarray(x) for x in xs], axis=axis)),
    cuda=types.SimpleNamespace(Stream=Stream, Event=Event, Device=Device, runtime=runtime,
                               nccl=fake_nccl, alloc_pinned_memory=alloc_pinned_memory,
                               get_elapsed_time=lambda a, b: 1.0,
                               get_current_stream=lambda: (_STATE.current[-1] if _STATE.current
                                                           else _NULL)))


# ---------------------------------------------------------------- kernels (NumPy)

def _null(p):
    return isinstance(p, np.uint64) and p == 0


def _a(x):
    return x.view(np.ndarray)


def _store(out, values, bf16):
    """Write float32 values into an operand buffer (bfloat16 bits under bf16)."""
    values = np.asarray(values, dtype=np.float32)
    if bf16:
        _a(out)[...] = values.astype(ml_dtypes.bfloat16).view(np.uint16).reshape(out.shape)
    else:
        _a(out)[...] = values.reshape(out.shape)


def _rows_ids(ids, stride, T, BT, shift=0):
    flat = _a(ids).reshape(-1)
    r = np.arange(BT)
    return flat[(r // T) * stride + r % T + shift]


f32 = np.float32


def k_round_bf16(bf16, x, out, n, n4):
    _store(out, _a(x)[:n], True)


def k_embedding_forward(bf16, ids, stride, T, W, x, BT, D, vec):
    _a(x)[...] = _a(W)[_rows_ids(ids, int(stride), int(T), int(BT))]


def k_embedding_index_reset(bf16, index, V):
    _a(index)[:, 0] = 0x7FFFFFFF
    _a(index)[:, 1] = 0


def k_embedding_index(bf16, ids, stride, T, BT, index):
    v = _rows_ids(ids, int(stride), int(T), int(BT))
    first = _a(index)[:, 0]
    np.minimum.at(first, v, np.arange(int(BT), dtype=np.int32))
    np.add.at(_a(index)[:, 1], v, 1)


def k_embedding_backward(bf16, dx, ids, stride, T, BT, dW, D, index, vec):
    acc = np.zeros(dW.shape, dtype=np.float32)
    np.add.at(acc, _rows_ids(ids, int(stride), int(T), int(BT)), _a(dx))
    _a(dW)[...] = _a(dW) + acc


def k_layernorm_forward(bf16, x_prev, add, x_out, h, mean, rstd, w, b, rows, D, eps, vec):
    x = _a(x_prev)
    if not _null(add):
        x = x + _a(add)
        _a(x_out)[...] = x
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(-1, keepdims=True)
    rs = f32(1.0) / np.sqrt(var + eps)
    _store(h, xc * rs * _a(w) + _a(b), bf16)
    _a(mean)[...] = mu[:, 0]
    _a(rstd)[...] = rs[:, 0]


def k_layernorm_backward(bf16, dout, dres, x, mean, rstd, w, b, h, dx, dx_op, partials, rows,
                         D, chunk, vec):
    dy = _a(dout)
    rs = _a(rstd)[:, None]
    xhat = (_a(x) - _a(mean)[:, None]) * rs
    if not _null(h):  # the forward's h, as k_layernorm_forward computes it
        _store(h, xhat * _a(w) + _a(b), bf16)
    dxhat = dy * _a(w)
    v = rs * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    if not _null(dres):
        v = _a(dres) + v
    _a(dx)[...] = v
    if not _null(dx_op):
        _store(dx_op, v, bf16)
    chunk = int(chunk)
    for c in range(partials.shape[0]):
        s = slice(c * chunk, (c + 1) * chunk)
        _a(partials)[c, :int(D)] = (dy[s] * xhat[s]).sum(0)
        _a(partials)[c, int(D):] = dy[s].sum(0)


def _gradient(gseg, S, n):
    """G's segments (kernels/common.cuh grad_at): [(first element, writable
    float32 view at its address)], by first element; the last runs to n."""
    table = _a(gseg).reshape(-1, 2)[:int(S)]
    ends = list(table[1:, 0]) + [int(n)]
    return [(int(start), _floats(int(addr), int(end) - int(start)))
            for (start, addr), end in zip(table, ends)]


def _gradient_whole(gseg, S, n):
    return np.concatenate([part for _, part in _gradient(gseg, S, n)])


def k_layernorm_param_grads(bf16, table, offsets, gseg, S, norms, chunks, D):
    # table: each norm's partials' address, (chunks, 2D) float32 there
    count = int(chunks) * 2 * int(D)
    segments = _a(gseg).reshape(-1, 2)[:int(S)]
    for n in range(int(norms)):
        off = int(_a(offsets)[n])
        part = _floats(int(_a(table)[n]), count).reshape(int(chunks), 2 * int(D))
        start, addr = next((int(st), int(a)) for st, a in reversed(segments) if st <= off)
        _floats(addr + 4 * (off - start), 2 * int(D))[...] = part.sum(0)


def _rope_split(x, H):
    # (BT, D) -> (BT, H, E/2) x2
    BT, D = x.shape
    x = x.reshape(BT, H, D // H)
    half = D // H // 2
    return x[..., :half], x[..., half:]


def k_rope_forward(bf16, qkv, out, cos, sin, BT, T, D, H, vec):
    D, H, T = int(D), int(H), int(T)
    x = _a(qkv)
    pos = np.arange(int(BT)) % T
    c, s = _a(cos)[pos][:, None, :], _a(sin)[pos][:, None, :]
    res = x.copy()
    for part in (0, 1):
        x1, x2 = _rope_split(x[:, part * D:(part + 1) * D], H)
        res[:, part * D:(part + 1) * D] = np.concatenate(
            [x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(-1, D)
    _store(out, res, bf16)


def k_rope_backward(bf16, dqk, dqkv, cos, sin, BT, T, D, H, vec):
    D, H, T = int(D), int(H), int(T)
    x = _a(dqk)
    pos = np.arange(int(BT)) % T
    c, s = _a(cos)[pos][:, None, :], _a(sin)[pos][:, None, :]
    res = np.empty_like(x)
    for part in (0, 1):
        d1, d2 = _rope_split(x[:, part * D:(part + 1) * D], H)
        res[:, part * D:(part + 1) * D] = np.concatenate(
            [d1 * c + d2 * s, d2 * c - d1 * s], axis=-1).reshape(-1, D)
    full_ = np.zeros((int(BT), 3 * D), dtype=np.float32)
    full_[:, :2 * D] = res
    if bf16:
        _a(dqkv)[:, :2 * D] = res.astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        _a(dqkv)[:, :2 * D] = res


def k_rope_backward_operand(bf16, dqk, dqkv, cos, sin, BT, T, D, H, vec):
    x = _a(dqk)
    widened = (x.astype(np.uint32) << 16).view(np.float32) if bf16 else x
    k_rope_backward(bf16, widened, dqkv, cos, sin, BT, T, D, H, vec)


def _causal(T):
    return np.triu(np.ones((T, T), dtype=bool), k=1)


def _store_causal(out, values, bf16):
    """Write the causal part (j <= i) of (..., T, T) values only."""
    T = out.shape[-1]
    keep = ~_causal(T)
    o = _a(out).reshape(-1, T, T)
    v = np.asarray(values, np.float32).reshape(-1, T, T)
    if bf16:
        v = v.astype(ml_dtypes.bfloat16).view(np.uint16)
    o[:, keep] = v[:, keep]


def k_attention_softmax_forward(bf16, s, p_op, rows, T, scale):
    T = int(T)
    x = _a(s).reshape(-1, T, T) * scale
    x[:, _causal(T)] = -np.inf
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(-1, keepdims=True)
    if _null(p_op):  # under fp32 the product reads s: its zeros are written too
        _a(s)[...] = p.reshape(s.shape)
    else:
        _store_causal(s, p, False)
        _store_causal(p_op, p, bf16)


def k_attention_softmax_backward(bf16, p, dp, ds, p_op, rows, T, scale):
    T = int(T)
    keep = ~_causal(T)
    P = np.where(keep, _a(p).reshape(-1, T, T), 0)  # the causal part only is read
    dP = np.where(keep, _a(dp).reshape(-1, T, T), 0)
    g = P * (dP - (dP * P).sum(-1, keepdims=True))
    g *= scale
    _store_causal(ds, g, bf16)
    if not _null(p_op):
        _store_causal(p_op, P, bf16)


def _widen(x):
    """bfloat16 bits -> float32 values."""
    return (np.asarray(x).astype(np.uint32) << 16).view(np.float32)


def _heads(x, B, T, H):
    # (BT, H*E) -> (B,H,T,E)
    return x.reshape(B, T, H, -1).transpose(0, 2, 1, 3)


def _att_inputs(qkv, T, H):
    x = _widen(_a(qkv))
    BT, D3 = x.shape
    D, B = D3 // 3, BT // T
    q, k, v = (_heads(x[:, i * D:(i + 1) * D], B, T, H) for i in range(3))
    return q, k, v, B, D


LOG2E = f32(1.4426950408889634)


def _att_p(q, k, m, l, T, scale):
    """p (B,H,T,T) from the kept m (row maximum times log2 e) and l (1 / row sum)."""
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    s[..., _causal(T)] = -np.inf
    return np.exp2(s * (scale * LOG2E) - m[..., None]) * l[..., None]


def _rounded(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _unheads(x):
    # (B,H,T,E) -> (BT, H*E)
    B, H, T, E = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * T, H * E)


def k_attention_forward(bf16, qkv, y, m, l, T, H, scale):
    T, H = int(T), int(H)
    q, k, v, B, D = _att_inputs(qkv, T, H)
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    s[..., _causal(T)] = -np.inf
    m2 = s.max(-1) * (scale * LOG2E)
    e = np.exp2(s * (scale * LOG2E) - m2[..., None])
    rl = f32(1.0) / e.sum(-1)
    _a(m)[...] = m2
    _a(l)[...] = rl
    _store(y, _unheads(np.matmul(_rounded(e * rl[..., None]), v)), True)


def _att_backward(qkv, dy, m, l, T, H, scale):
    q, k, v, B, D = _att_inputs(qkv, T, H)
    dyh = _heads(_widen(_a(dy)), B, T, H)
    p = _att_p(q, k, _a(m), _a(l), T, scale)
    dp = np.matmul(dyh, np.swapaxes(v, -1, -2))
    return q, k, dyh, p, dp, D


def _att_ds(p, dp, dot, scale):
    return _rounded(p * (dp - dot[..., None]) * scale)


def k_attention_backward_dq(bf16, qkv, y, dy, m, l, dot, dqk, T, H, scale):
    T, H = int(T), int(H)
    q, k, dyh, p, dp, D = _att_backward(qkv, dy, m, l, T, H, scale)
    d = (dp * p).sum(-1)
    _a(dot)[...] = d
    _a(dqk)[:, :D] = _unheads(np.matmul(_att_ds(p, dp, d, scale), k))


def k_attention_backward_dkdv(bf16, qkv, dy, m, l, dot, dqk, dqkv, T, H, scale):
    q, k, dyh, p, dp, D = _att_backward(qkv, dy, m, l, int(T), int(H), scale)
    ds = _att_ds(p, dp, _a(dot), scale)
    _a(dqk)[:, D:] = _unheads(np.matmul(np.swapaxes(ds, -1, -2), q))
    dv = _unheads(np.matmul(np.swapaxes(_rounded(p), -1, -2), dyh))
    _a(dqkv)[:, 2 * D:] = dv.astype(ml_dtypes.bfloat16).view(np.uint16)


def k_swiglu_forward(bf16, gu, a, BT, F, vec):
    F = int(F)
    g, u = _a(gu)[:, :F], _a(gu)[:, F:]
    sig = f32(1.0) / (f32(1.0) + np.exp(-g))
    _store(a, g * sig * u, bf16)


def k_swiglu_backward(bf16, da, gu, dgu, a, BT, F, vec):
    F = int(F)
    g, u = _a(gu)[:, :F], _a(gu)[:, F:]
    sig = f32(1.0) / (f32(1.0) + np.exp(-g))
    d = _a(da)
    du = d * g * sig
    dg = d * u * (sig + g * sig * (f32(1.0) - sig))
    _store(dgu, np.concatenate([dg, du], axis=1), bf16)
    if not _null(a):
        _store(a, g * sig * u, bf16)  # the forward's value, as k_swiglu_forward computes it


def k_crossentropy_forward_backward(bf16, logits, ids, stride, T, row0, ce, dlogits, V, dce,
                                    vec):
    l = _a(logits)
    BT = l.shape[0]
    target = _rows_ids(ids, int(stride), int(T), int(row0) + BT, shift=1)[int(row0):]
    mx = l.max(-1, keepdims=True)
    e = np.exp(l - mx)
    se = e.sum(-1, keepdims=True)
    _a(ce)[...] = (np.log(se) + mx)[:, 0] - l[np.arange(BT), target]
    p = e / se
    p[np.arange(BT), target] -= f32(1.0)
    _store(dlogits, p * dce, bf16)


def k_mean_loss(bf16, ce, loss, n):
    _a(loss)[0] = _a(ce)[:int(n)].mean(dtype=np.float32)


def k_accumulate_gradient(bf16, G, Gm, n, n4):
    n = int(n)
    _a(G)[:n] = _a(G)[:n] + _a(Gm)[:n]  # one float32 add per element


def k_adamw_bias_corrections(bf16, t, c, beta1, beta2, rates, rows):
    _a(t)[0] += 1
    tn = int(_a(t)[0])
    _a(c)[0] = f32(1.0 - float(beta1) ** tn)
    _a(c)[1] = f32(1.0 - float(beta2) ** tn)
    row = min(tn, int(rows) - 1)
    _a(c)[2:4] = _a(rates).reshape(-1, 2)[row]


def k_gradient_sum_squares(bf16, gseg, S, n, n4, partial):
    g = _gradient_whole(gseg, S, n)
    blocks = _a(partial).size
    for b in range(blocks):  # the kernel's strided sets, each summed in float32
        _a(partial)[b] = np.sum(np.square(g[b::blocks]), dtype=np.float32)


def k_gradient_norm_clip(bf16, partial, blocks, norm, clip):
    n = f32(np.sqrt(np.sum(_a(partial)[:int(blocks)], dtype=np.float32)))
    clip = f32(clip)
    _a(norm)[0] = n
    _a(norm)[1] = clip / n if clip > 0 and np.isfinite(n) and n > clip else f32(1)


def k_adamw_bias_corrections_table(bf16, ts, c1, c2, n, beta1, beta2):
    for i, tn in enumerate(_a(ts)[:int(n)]):
        _a(c1)[i] = f32(1.0 - float(beta1) ** int(tn))
        _a(c2)[i] = f32(1.0 - float(beta2) ** int(tn))


def k_adamw_update(bf16, P, M, V, gseg, S, decay, R, Pb, c, norm, n, n4, b1, omb1, b2, omb2,
                   eps, partial):
    G = _gradient_whole(gseg, S, n)
    p, m, v = _a(P), _a(M), _a(V)
    mask = np.zeros(p.size, dtype=bool)
    for start, end in _a(decay).reshape(-1, 2)[:int(R)]:
        mask[start:end] = True
    if not _null(partial):  # clipping off: scale 1, each block's sum of squares
        g = G[:int(n)]
        n4 = int(n4)
        squares = np.concatenate([np.square(g[:4 * n4]).reshape(-1, 4).sum(1, dtype=np.float32),
                                  np.square(g[4 * n4:])]).astype(np.float32)
        for b in range(0, squares.size, 256):  # blocks of 256 items (THREADS)
            _a(partial)[b // 256] = np.sum(squares[b:b + 256], dtype=np.float32)
        g = G
    else:
        g = G * _a(norm)[1]
    c1, c2, lr, lrwd = _a(c)[0], _a(c)[1], _a(c)[2], _a(c)[3]
    m[...] = b1 * m + omb1 * g
    v[...] = b2 * v + omb2 * g * g
    p[...] = np.where(mask, p - lrwd * p, p)
    p[...] = p - lr * (m / c1) / (np.sqrt(v / c2) + eps)
    if not _null(Pb):
        _store(Pb, p, True)


KERNELS = {name[2:]: fn for name, fn in globals().items() if name.startswith("k_")}
# the fused attention: one entry point per head dimension, one contract
_FUSED = {part: KERNELS.pop(f"attention_{part}") for part in ("forward", "backward_dq",
                                                              "backward_dkdv")}
for _E in (16, 32, 64):
    for _part, _fn in _FUSED.items():
        KERNELS[f"attention_{_part}_e{_E}"] = _fn
# the layernorm kernels: one entry point per row width in registers, one contract
_LAYERNORM = {part: KERNELS.pop(f"layernorm_{part}") for part in ("forward", "backward")}
for _NC in (1, 2, 4, 8):
    for _part, _fn in _LAYERNORM.items():
        KERNELS[f"layernorm_{_part}_c{_NC}"] = _fn


# ---------------------------------------------------------------- cuBLAS (column-major)

def _matrix(addr, dtype_code, rows, cols, ld, batch=0, stride=0):
    """The column-major (rows, cols) matrix at addr with leading dimension ld,
    as float32, by real pointer arithmetic on host memory."""
    itemsize = 4 if dtype_code == 0 else 2
    addr += batch * stride * itemsize
    span = ((cols - 1) * ld + rows) * itemsize
    buf = (ctypes.c_char * span).from_address(addr)
    raw = np.frombuffer(buf, dtype=np.float32 if dtype_code == 0 else np.uint16)
    view = np.lib.stride_tricks.as_strided(raw, shape=(rows, cols), strides=(itemsize, ld * itemsize))
    if dtype_code == 0:
        return view
    return (view.astype(np.uint32) << 16).view(np.float32)


def _write(addr, dtype_code, rows, cols, ld, values, batch=0, stride=0):
    itemsize = 4 if dtype_code == 0 else 2
    addr += batch * stride * itemsize
    span = ((cols - 1) * ld + rows) * itemsize
    buf = (ctypes.c_char * span).from_address(addr)
    raw = np.frombuffer(buf, dtype=np.float32 if dtype_code == 0 else np.uint16)
    view = np.lib.stride_tricks.as_strided(raw, shape=(rows, cols), strides=(itemsize, ld * itemsize),
                                           writeable=True)
    if dtype_code == 0:
        view[...] = values
    else:
        view[...] = values.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _value(ref):
    return ref._obj.value


def _addr(p):
    return p.value or 0


def _gemm(transa, transb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc,
          batch, compute):
    assert compute == 68, "CUBLAS_COMPUTE_32F expected"
    assert at == bt, "operand types differ"
    for i in range(batch):
        a = _matrix(A, at, *((m, k) if transa == 0 else (k, m)), lda, i, sa)
        b = _matrix(B, bt, *((k, n) if transb == 0 else (n, k)), ldb, i, sb)
        a = a if transa == 0 else a.T
        b = b if transb == 0 else b.T
        c = alpha * np.matmul(np.ascontiguousarray(a), np.ascontiguousarray(b))
        if beta != 0:
            c = c + beta * _matrix(C, ct, m, n, ldc, i, sc)
        _write(C, ct, m, n, ldc, c, i, sc)


# ---------------------------------------------------------------- cuDNN's attention (NumPy)

def _strided(addr, dims, strides, dtype):
    """The tensor at addr with dims and element strides, by real pointer
    arithmetic on host memory: a writable view."""
    itemsize = np.dtype(dtype).itemsize
    span = (sum((d - 1) * st for d, st in zip(dims, strides)) + 1) * itemsize
    raw = np.frombuffer((ctypes.c_char * span).from_address(addr), dtype=dtype)
    return np.lib.stride_tricks.as_strided(raw, shape=tuple(dims),
                                           strides=tuple(st * itemsize for st in strides),
                                           writeable=True)


class FakeCudnnTensor:
    def __init__(self, name, dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type = name, dim, stride, data_type
        self.output = False

    def set_output(self, value):
        self.output = value
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self

    def read(self, addr):  # -> float32 values
        x = _strided(addr, self.dim, self.stride, np.float32 if self.data_type == "FLOAT"
                     else np.uint16)
        return x.astype(np.float32) if self.data_type == "FLOAT" else \
            (x.astype(np.uint32) << 16).view(np.float32)

    def write(self, addr, values):
        if self.data_type == "FLOAT":
            _strided(addr, self.dim, self.stride, np.float32)[...] = values
        else:
            _strided(addr, self.dim, self.stride, np.uint16)[...] = \
                np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


class FakeCudnnGraph:
    """The classic pygraph calls cudnn_attention makes: one causal SDPA node
    (forward with its statistics, or backward), bfloat16 operands, float32
    arithmetic. The forward's operand of p v is round(p) of the normalized
    p, as the reference's; the backward's row term is dO . O, as cuDNN's;
    dq, dk, dv bfloat16, as the backend asks."""

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None,
                 handle=None):
        assert (io_data_type, intermediate_data_type, compute_data_type) == \
            ("BFLOAT16", "FLOAT", "FLOAT")
        self.node = None

    def tensor(self, name, dim, stride, data_type):
        return FakeCudnnTensor(name, list(dim), list(stride), data_type)

    def _causal(self, kw):
        assert kw == {"diagonal_alignment": "TOP_LEFT", "diagonal_band_right_bound": 0}, kw

    def sdpa(self, name, q, k, v, attn_scale, generate_stats, **mask):
        assert generate_stats is True
        self._causal(mask)
        self.node = ("forward", attn_scale, (q, k, v), (FakeCudnnTensor("o"),
                                                       FakeCudnnTensor("stats")))
        return self.node[3]

    def sdpa_backward(self, name, q, k, v, o, dO, stats, attn_scale, use_deterministic_algorithm,
                      **mask):
        assert isinstance(use_deterministic_algorithm, bool)
        self._causal(mask)
        outs = tuple(FakeCudnnTensor(n) for n in ("dq", "dk", "dv"))
        self.node = ("backward", attn_scale, (q, k, v, o, dO, stats), outs)
        return outs

    def validate(self):
        assert all(t.output and t.dim and t.stride and t.data_type for t in self.node[3])

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        assert modes

    def check_support(self):
        want = ["BFLOAT16", "FLOAT"] if self.node[0] == "forward" else ["BFLOAT16"] * 3
        assert [t.data_type for t in self.node[3]] == want, self.node[3]

    def build_plans(self):
        pass

    def get_workspace_size(self):
        return 4096

    def execute(self, pack, workspace, handle=None):
        capturing, current = _STATE.capturing, _STATE.current
        if capturing is not None and (not current or current[-1] is not capturing):
            raise AssertionError("cuDNN executed outside the capturing stream")
        assert workspace and all(isinstance(p, int) for p in pack.values())
        direction, scale, inputs, outputs = self.node
        frozen = [pack[t] for t in inputs + outputs]
        _submit(lambda: self._run(direction, np.float32(scale), inputs, outputs, frozen))

    @staticmethod
    def _run(direction, scale, inputs, outputs, addrs):
        x = [t.read(a) for t, a in zip(inputs, addrs)]
        q, k, v = x[:3]
        T = q.shape[2]
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        s[..., _causal(T)] = -np.inf
        if direction == "forward":
            m = s.max(-1, keepdims=True)
            e = np.exp(s - m)
            l = e.sum(-1, keepdims=True)
            p = round_bf16(e / l)
            outputs[0].write(addrs[3], np.matmul(p, v))
            outputs[1].write(addrs[4], m + np.log(l))
            return
        o, dO, stats = x[3:]
        p = np.exp(s - stats)
        dp = np.matmul(dO, np.swapaxes(v, -1, -2))
        ds = p * (dp - (dO * o).sum(-1, keepdims=True)) * scale
        dq, dk = np.matmul(round_bf16(ds), k), np.matmul(np.swapaxes(round_bf16(ds), -1, -2), q)
        dv = np.matmul(np.swapaxes(round_bf16(p), -1, -2), dO)
        for t, a, value in zip(outputs, addrs[6:], (dq, dk, dv)):
            t.write(a, value)


def round_bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


fake_cudnn = types.ModuleType("cudnn")
fake_cudnn.__version__ = "emulated"
fake_cudnn.backend_version = lambda: 0
fake_cudnn.data_type = types.SimpleNamespace(BFLOAT16="BFLOAT16", FLOAT="FLOAT")
fake_cudnn.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
fake_cudnn.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="TOP_LEFT")
fake_cudnn.pygraph = FakeCudnnGraph
fake_cudnn.create_handle = lambda: object()
fake_cudnn.set_stream = lambda handle, stream: None


class FakeCublas:
    """The entry points accelerated/cublas.py declares."""

    def __init__(self):
        self.gemms = 0

    def cublasCreate_v2(self, ref):
        return 0

    def cublasDestroy_v2(self, h):
        return 0

    def cublasSetStream_v2(self, h, s):
        return 0

    def cublasSetWorkspace_v2(self, h, p, n):
        return 0

    def cublasSetMathMode(self, h, mode):
        assert mode == 0
        return 0

    def cublasGetVersion_v2(self, h, ref):
        return 0

    def cublasGetStatusString(self, status):
        return b"emulated"

    def cublasGemmEx(self, h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc,
                     compute, algo):
        args = (ta, tb, m, n, k, _value(alpha), _addr(A), at, lda, 0, _addr(B), bt, ldb, 0,
                _value(beta), _addr(C), ct, ldc, 0, 1, compute)
        _submit(lambda: _gemm(*args))
        return 0

    def cublasGemmStridedBatchedEx(self, h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb,
                                   beta, C, ct, ldc, sc, batch, compute, algo):
        args = (ta, tb, m, n, k, _value(alpha), _addr(A), at, lda, sa, _addr(B), bt, ldb, sb,
                _value(beta), _addr(C), ct, ldc, sc, batch, compute)
        _submit(lambda: _gemm(*args))
        return 0


def install():
    """Point the backend's modules at the stand-ins; returns the backend module."""
    from coppelius.accelerated import (cublas, cuda_kernels, cudnn_attention, cupy_backend,
                                       cupy_debug, distributed)

    cupy_backend.cupy = fake_cupy
    cuda_kernels.cupy = fake_cupy
    cupy_debug.cupy = fake_cupy
    cudnn_attention.cupy = fake_cupy
    distributed.cupy = fake_cupy
    cublas._LIB = FakeCublas()
    cupy_backend._KERNELS.clear()
    sys.modules["cudnn"] = fake_cudnn  # cudnn_attention imports it on first use
    cudnn_attention._frontend = cudnn_attention._import_error = None
    cudnn_attention._handles.clear()
    cudnn_attention._graphs.clear()
    return cupy_backend


def main():
    from coppelius.conformance.suite import run_suite

    if sys.argv[1:2] == ["--pytest"]:  # the GPU test file, against the stand-ins
        import pytest

        sys.modules["cupy"] = fake_cupy
        install()
        # the backend's own tests, and the program contract's rows for "cupy"
        tests = [os.path.join(ROOT, "tests", name) for name in ("test_cupy_backend.py",
                                                                 "test_program_contract.py")]
        sys.exit(pytest.main([*tests, "-q", "-k", "cupy", "-p", "no:cacheprovider",
                              *sys.argv[2:]]))

    if sys.argv[1:2] == ["--pytest-files"]:  # any test files, against the stand-ins
        import pytest

        sys.modules["cupy"] = fake_cupy
        install()
        sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[2:]]))

    if sys.argv[1:2] == ["--script"]:  # its plumbing (loading, launches), not its kernels
        sys.modules["cupy"] = fake_cupy
        install()
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return

    backend = install()
    backend.NAME = "cupy (emulated on the CPU)"
    status = 0
    preset = sys.argv[1] if len(sys.argv) > 1 else "test"
    for precision in ("fp32", "bf16"):
        # one context per step, then two in two micro-batches (SPEC 19)
        for batch, k in ((1, 1), (2, 2)):
            report = run_suite(backend, preset, precision, batch=batch, steps=6, accumulate=k)
            print(report.table(report.failures) if report.failures else "", end="")
            print(report.summary())
            status |= not report.passed
    sys.exit(status)


if __name__ == "__main__":
    main()
