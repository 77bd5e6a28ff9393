"""The NumPy stand-ins of the fused attention kernels (accelerated/cuda/kernels/attention_fused.cu,
launched by accelerated/cuda/attention_fused.py): their contracts, not their code."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .common import _a, _causal, _store, f32


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
