"""The launch machinery every kernel family's launchers share: the block
sizes of the elementwise and warp-per-row kernels, the argument helpers,
and Launcher, the base of each family's launchers (accelerated/cuda/<family>.py)
and of Kernels, the compiled module (accelerated/cuda/compile.py).

Bandwidth. The memory-bound kernels move 16 bytes per load and store (a
float4, or 4 bfloat16 operands in 8 bytes) where every pointer is 16-byte
aligned and the row length is a multiple of 4: the launcher decides (`vec`,
_vector) and passes the decision, with the matching number of items; else
the same kernel takes one element at a time, the same values in the same
order.
"""

from __future__ import annotations

import numpy as np

from ...reference.layout import qkv_columns

THREADS = 256  # elementwise kernels
WARPS = 8  # warp-per-row kernels: rows per block

NULL = np.uint64(0)  # a null pointer argument
i32, i64, f32, f64 = np.int32, np.int64, np.float32, np.float64


def fused_head_dim(width: int, columns: str, H: int, Hkv: int) -> int:
    """E of a fused row `width` wide whose `columns` ("qkv": q | k | v, or
    "qk": q | k) are the step's layout (reference/layout.py) for H query
    and Hkv key/value heads, the layout kernels/rope.cu and
    kernels/attention_fused.cu index through the strides they are given;
    anything else is refused."""
    E = width // (H + (2 if columns == "qkv" else 1) * Hkv)
    q, k, v = qkv_columns(H, Hkv, E)
    assert H % Hkv == 0 and width == (v.stop if columns == "qkv" else k.stop), \
        (width, columns, H, Hkv)
    return E


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _threads_over(n: int, cap: int = 256) -> int:
    """A block of threads over n columns: a multiple of 32, at most cap."""
    return min(cap, 32 * _cdiv(n, 32))


def _opt(a):
    """An optional pointer argument: the array, or null."""
    return NULL if a is None else a


def _vector(*arrays, lengths=()) -> int:
    """1 when the kernels may move 16 bytes at a time: every array (None:
    absent) 16-byte aligned and every row length a multiple of 4."""
    aligned = all(a is None or a.data.ptr % 16 == 0 for a in arrays)
    return int(aligned and all(n % 4 == 0 for n in lengths))


class Launcher:
    """The launches of the module's kernels (Kernels, accelerated/cuda/compile.py,
    holds `functions` and `log`). Arguments are contiguous CuPy arrays
    (RawKernel checks neither strides nor dtypes: the launchers pass
    explicit numpy scalars). Every launch goes to the current CuPy stream,
    so a launcher called inside a stream capture is recorded into the graph."""

    def _launch(self, name, grid, block, args, shared_mem=0, reads=()):
        # grid: blocks, or a tuple of blocks per dimension; reads: buffers the
        # kernel reaches through an address table among args (for the log)
        self.launches += 1
        grid = tuple(int(g) for g in grid) if isinstance(grid, tuple) else (int(grid),)
        if self.log is not None:
            pointers = [a.data.ptr for a in (*args, *reads)
                        if hasattr(getattr(a, "data", None), "ptr")]
            self.log.add("kernel", name, {"grid": list(grid), "block": int(block),
                                          "shared_mem": int(shared_mem)}, pointers)
        self.functions[name](grid, (int(block),), args, shared_mem=int(shared_mem))

    def _rowwise(self, name, rows, items, args):
        # 2-D grid: x over a row's items, y over the rows (the kernel strides
        # by gridDim.y); the fewest blocks of at most THREADS per row, evened
        # out (352 items: 2 x 192 threads, not 2 x 256)
        blocks = _cdiv(items, THREADS)
        threads = _threads_over(_cdiv(items, blocks), THREADS)
        self._launch(name, (blocks, min(rows, 65535)), threads, args)

    def _elementwise(self, name, n, args):
        assert n < 2**31, (name, n)  # int indices
        self._launch(name, _cdiv(n, THREADS), THREADS, args)

    def _flat(self, name, n, args, *arrays):
        # the flat kernels' items: n4 = n // 4 chunks (vec), then the n % 4
        # elements left one by one; n4 = 0: n elements one by one
        n4 = n // 4 if _vector(*arrays) else 0
        self._launch(name, max(1, _cdiv(n4 + n - 4 * n4, THREADS)), THREADS,
                     (*args, i64(n), i64(n4)))
