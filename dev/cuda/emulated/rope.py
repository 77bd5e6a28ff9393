"""The NumPy stand-ins of the rope kernels (accelerated/cuda/kernels/rope.cu,
launched by accelerated/cuda/rope.py): their contracts, not their code."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .common import _a, _store


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
