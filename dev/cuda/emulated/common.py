"""What the NumPy kernels share (as kernels/common.cuh does the CUDA
kernels'): null pointers, views of the stand-in arrays, operand stores
and loads (bfloat16 bits under bf16), the targets of a row, float32 views at an
address, and G's segments (grad_at)."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np


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


def _operand(x, bf16):
    """An operand buffer's values as float32 (bfloat16 bits widened exactly under bf16)."""
    if bf16:
        return (_a(x).astype(np.uint32) << 16).view(np.float32)
    return _a(x)


def _rows_ids(ids, stride, T, BT, shift=0):
    flat = _a(ids).reshape(-1)
    r = np.arange(BT)
    return flat[(r // T) * stride + r % T + shift]


f32 = np.float32


def _floats(ptr, count):
    return np.frombuffer((ctypes.c_float * count).from_address(ptr), dtype=np.float32)


def _gradient(gseg, S, n):
    """G's segments (kernels/common.cuh grad_at): [(first element, writable
    float32 view at its address)], by first element; the last runs to n."""
    table = _a(gseg).reshape(-1, 2)[:int(S)]
    ends = list(table[1:, 0]) + [int(n)]
    return [(int(start), _floats(int(addr), int(end) - int(start)))
            for (start, addr), end in zip(table, ends)]


def _gradient_whole(gseg, S, n):
    return np.concatenate([part for _, part in _gradient(gseg, S, n)])


def _causal(T):
    return np.triu(np.ones((T, T), dtype=bool), k=1)
