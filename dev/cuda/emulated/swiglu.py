"""The NumPy stand-ins of the swiglu kernels (accelerated/cuda/kernels/swiglu.cu,
launched by accelerated/cuda/swiglu.py): their contracts, not their code."""

from __future__ import annotations

import numpy as np

from .common import _a, _null, _store, f32


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
