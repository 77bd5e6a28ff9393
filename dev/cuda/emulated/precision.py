"""The NumPy stand-ins of the precision kernels (accelerated/cuda/kernels/precision.cu,
launched by accelerated/cuda/precision.py): their contracts, not their code."""

from __future__ import annotations

from .common import _a, _store


def k_round_bf16(bf16, x, out, n, n4):
    _store(out, _a(x)[:n], True)
