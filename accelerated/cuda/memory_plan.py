"""Memory planning of the CuPy backend (SPEC 13): activation and scratch
buffers whose lifetimes in the step do not overlap share storage.

How the plan is made, before anything is allocated on the device:

1. A dry run of the step. The program's own allocation code builds every
   buffer as a VirtualArray (a shape, a dtype and an address in an address
   space of its own; no storage), and the program's own step code runs on
   them with kernels and cuBLAS that record each launch and product
   (CommandLog) instead of running it: the same code path, so the same
   commands in the same order as the real step.
2. Liveness. Every command touches some buffers: a kernel through its array
   arguments, a product through its three pointers, each mapped back to the
   buffer whose address range holds it. A buffer lives from the first
   command that touches it to the last.
3. Placement. The buffers are laid out in one arena by greedy interval
   colouring: each at the lowest offset where it overlaps no buffer
   already placed whose lifetime overlaps its own, in two orders (largest
   first; the buffers live at the fullest command first, by first use),
   the smaller arena kept.

Some buffers must keep their own storage whatever their lifetimes (pinned,
lifetime = the whole step): what the host reads after a replay (row losses,
loss) and what carries values from one step to the next (the attention
operand buffers whose zeros above the diagonal are written once, at
allocation). Everything the backward reads from the forward is live until
that read, so it keeps its values by the rule itself.

The plan changes addresses only: the kernels, products and their order are
the unplanned step's, so the results are bitwise the same
(tests/cuda/test_memory_plan.py checks that against COPPELIUS_NO_MEMORY_PLAN=1).
"""

from __future__ import annotations

import bisect
import math
import os
import types
from dataclasses import dataclass, field

import numpy as np

ALIGN = 512  # bytes: an arena offset keeps the alignment of CuPy's pool (its allocation unit)
VIRTUAL_BASE = 1 << 56  # far above any device address, so the two never meet


def planning_enabled() -> bool:
    """COPPELIUS_NO_MEMORY_PLAN=1 gives every buffer its own storage (the
    report still shows the plan, not applied): for debugging a kernel that
    writes outside its buffer, or to compare."""
    return os.environ.get("COPPELIUS_NO_MEMORY_PLAN", "") in ("", "0")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------- the dry run


class VirtualArray:
    """A buffer with a shape, a dtype and an address but no storage, for the
    dry run: what the launchers and the products read of an array (shape,
    size, itemsize, data.ptr), views by reshape and by first-axis index or
    slice, as the step takes them."""

    def __init__(self, shape, dtype, ptr: int):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.ptr = ptr

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ptr)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        assert math.prod(shape) == self.size, (shape, self.shape)
        return VirtualArray(shape, self.dtype, self.ptr)

    def __getitem__(self, index):
        row = math.prod(self.shape[1:]) * self.itemsize  # bytes per first-axis element
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            assert step == 1, index
            return VirtualArray((stop - start,) + self.shape[1:], self.dtype, self.ptr + start * row)
        index = int(index)
        assert 0 <= index < self.shape[0], (index, self.shape)
        return VirtualArray(self.shape[1:], self.dtype, self.ptr + index * row)


class VirtualBuffers:
    """The allocator interface of buffers.Buffers, handing out
    VirtualArrays at distinct aligned addresses; remembers every request in
    order (shape, dtype, zeros) and its address."""

    def __init__(self):
        self.bytes = 0
        self.requests = []  # (shape, dtype, zeros, ptr, nbytes)
        self._next = VIRTUAL_BASE

    def __call__(self, shape, dtype, zeros=False):
        shape = tuple(shape) if isinstance(shape, tuple) else (int(shape),)
        a = VirtualArray(shape, dtype, self._next)
        self.requests.append((a.shape, a.dtype, zeros, a.ptr, a.nbytes))
        self._next += _aligned(max(a.nbytes, 1))
        self.bytes += a.nbytes
        return a

    def upload(self, host):
        host = np.asarray(host)
        return self(host.shape, host.dtype)


@dataclass(frozen=True)
class Command:
    """One launch of the step: a kernel or a cuBLAS product."""

    index: int
    kind: str  # kernel or product
    name: str  # the kernel's name, or gemm / gemm_strided_batched
    launch: dict  # kernel: grid, block, shared_mem; product: m, n, k, batch, types, flags
    operations: tuple  # the semantic operations it lowers (reference/semantic.py)
    pointers: tuple  # the addresses of the arrays it touches (each inside one buffer)


class CommandLog:
    """Kept by the kernels and cuBLAS while set (`kernels.log`, `blas.log`):
    every launch in order, with the semantic operations the step code
    declared (Model.at) for it."""

    def __init__(self):
        self.commands = []
        self.operations = ()

    def add(self, kind: str, name: str, launch: dict, pointers) -> None:
        self.commands.append(Command(len(self.commands), kind, name, launch, self.operations,
                                     tuple(int(p) for p in pointers)))

    def signature(self) -> list:
        """(kind, name, launch) of every command: what must agree between
        the dry run and the real step."""
        return [(c.kind, c.name, c.launch) for c in self.commands]


# ---------------------------------------------------------------- the plan

@dataclass
class Buffer:
    name: str
    nbytes: int
    kind: str  # state, constant, input, activation, gradient, workspace
    candidate: bool  # may share storage
    note: str = ""  # why not, where not
    first: int | None = None  # command index
    last: int | None = None
    offset: int | None = None  # in the arena (candidates and pinned activations)


@dataclass
class MemoryPlan:
    buffers: list  # Buffer, every resource of the program
    activations: list  # the Activations buffers in allocation order (indices into buffers)
    arena_bytes: int  # the planned storage of the activations
    unplanned_bytes: int  # the same activations, each in a buffer of its own
    activation_shapes: list  # (shape, dtype) of each Activations request, in order
    commands: list = field(default_factory=list)  # Command, the dry run's
    touches: list = field(default_factory=list)  # per command, the buffers it touches

    @property
    def savings(self) -> int:
        return self.unplanned_bytes - self.arena_bytes

    def offsets(self) -> list:
        """Arena offset of each Activations request, in allocation order."""
        return [self.buffers[i].offset for i in self.activations]

    def aliased(self) -> set:
        """Indices of the buffers that share bytes with another one."""
        placed = sorted((self.buffers[i].offset, self.buffers[i].offset + self.buffers[i].nbytes, i)
                        for i in self.activations)
        out = set()
        for j, (start, end, i) in enumerate(placed):
            for start2, end2, i2 in placed[j + 1:]:
                if start2 >= end:
                    break
                out.update((i, i2))
        return out


def liveness(buffers: list, starts: list, commands: list) -> list:
    """Set each buffer's first and last command from the addresses the
    commands touch. `starts`: each buffer's start address, same order.
    -> per command, the sorted indices of the buffers it touches."""
    order = sorted(range(len(buffers)), key=lambda i: starts[i])
    keys = [starts[i] for i in order]
    touches = []
    for c in commands:
        touched = set()
        for ptr in c.pointers:
            j = bisect.bisect_right(keys, ptr) - 1
            if ptr == 0 or j < 0 or ptr >= starts[order[j]] + max(buffers[order[j]].nbytes, 1):
                continue  # a null optional argument, or no buffer's address
            i = order[j]
            touched.add(i)
            b = buffers[i]
            b.first = c.index if b.first is None else b.first
            b.last = c.index
        touches.append(sorted(touched))
    return touches


def place(buffers: list, indices: list, horizon: int) -> int:
    """Greedy interval colouring of buffers[indices] into one arena, in two
    orders, the smaller arena kept: each buffer in turn at the lowest
    aligned offset where no placed buffer with an overlapping lifetime
    overlaps it. Orders: largest first; and first the buffers live at the
    step's fullest command, by first use (the forward's saved activations,
    freed by the backward in reverse: stacked, they leave no holes), then
    the others largest first. Ties: earlier, then in allocation order
    (deterministic). A buffer that is not a candidate lives over the whole
    step [0, horizon]; a candidate no command touches (the float32 q | k | v
    where the product's epilogue applies the rope) takes no bytes of its
    own, at offset 0. Sets each offset; returns the arena's bytes."""
    unused = [i for i in indices if buffers[i].candidate and buffers[i].first is None]
    for i in unused:
        buffers[i].offset = 0
    floor = max((_aligned(max(buffers[i].nbytes, 1)) for i in unused), default=0)
    indices = [i for i in indices if i not in set(unused)]

    def span(i):
        b = buffers[i]
        return (0, horizon) if not b.candidate or b.first is None else (b.first, b.last)

    spans = {i: span(i) for i in indices}
    live = np.zeros(horizon + 2, dtype=np.int64)  # bytes live at each command
    for i in indices:
        live[spans[i][0]] += buffers[i].nbytes
        live[spans[i][1] + 1] -= buffers[i].nbytes
    fullest = int(np.argmax(np.cumsum(live)))

    def at_fullest(i):
        return spans[i][0] <= fullest <= spans[i][1]

    orders = (sorted(indices, key=lambda i: (-buffers[i].nbytes, spans[i][0], i)),
              sorted(indices, key=lambda i: (0, spans[i][0], -spans[i][1], i) if at_fullest(i)
                     else (1, -buffers[i].nbytes, spans[i][0], i)))
    best = None
    for order in orders:
        offsets = _first_fit(buffers, order, spans)
        arena = max((offsets[i] + _aligned(max(buffers[i].nbytes, 1)) for i in indices),
                    default=0)
        if best is None or arena < best[0]:
            best = (arena, offsets)
    for i in indices:
        buffers[i].offset = best[1][i]
    return max(best[0], floor)  # the unused views lie inside the arena


def _first_fit(buffers: list, order: list, spans: dict) -> dict:
    """Each of buffers[order] in turn at the lowest aligned offset where no
    buffer placed before it with an overlapping lifetime (spans) overlaps
    it -> {index: offset}."""
    offsets, placed = {}, []  # placed: (offset, end, first, last)
    for i in order:
        nbytes, (first, last) = buffers[i].nbytes, spans[i]
        busy = sorted((o, e) for o, e, f, l in placed if f <= last and first <= l)
        offset = 0
        for o, e in busy:
            if offset + nbytes <= o:
                break
            offset = max(offset, _aligned(e))
        offsets[i] = offset
        placed.append((offset, offset + nbytes, first, last))
    return offsets


class PlannedBuffers:
    """The allocator interface of buffers.Buffers for the Activations:
    each request, in the order the plan saw them, is a view of one arena at
    its planned offset. The arena starts as all ones bits (a NaN in float32
    and in bfloat16, as unplanned buffers start); a request for zeros gets
    its own region zeroed (the plan pins such buffers)."""

    def __init__(self, alloc, plan: MemoryPlan, stream):
        self.plan = plan
        self.stream = stream
        self.arena = alloc.arena(plan.arena_bytes)
        self._requests = [plan.buffers[i] for i in plan.activations]
        self._shapes = plan.activation_shapes
        self._next = 0
        self.bytes = 0  # counted by alloc, once, for the arena

    def __call__(self, shape, dtype, zeros=False):
        i = self._next
        self._next += 1
        want_shape, want_dtype = self._shapes[i]
        shape = tuple(shape) if isinstance(shape, tuple) else (int(shape),)
        if (shape, np.dtype(dtype)) != (want_shape, want_dtype):
            raise AssertionError(f"allocation {i} is {shape} {np.dtype(dtype)}, the plan's "
                                 f"{want_shape} {want_dtype}: the plan is of another step")
        b = self._requests[i]
        view = self.arena[b.offset:b.offset + b.nbytes].view(np.dtype(dtype)).reshape(shape)
        if zeros:
            with self.stream:
                view.fill(0)
        return view

    def upload(self, host):
        raise AssertionError("the Activations upload nothing")
