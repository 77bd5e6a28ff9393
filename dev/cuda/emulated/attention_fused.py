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


def _att_inputs(qkv, T, H, Hkv, W, K, V):
    """q (B,H,T,E) and k, v (B,H,T,E) repeated from their Hkv heads: query
    head h reads key/value head h // g, g = H / Hkv."""
    x = _widen(_a(qkv)).reshape(-1, W)
    E = (V - K) // Hkv
    B = x.shape[0] // T
    q = _heads(x[:, :H * E], B, T, H)
    k, v = (np.repeat(_heads(x[:, c:c + Hkv * E], B, T, Hkv), H // Hkv, axis=1) for c in (K, V))
    return q, k, v, B, E


def _group_sum(x, Hkv):
    # (B,H,T,E) per query head -> (B,Hkv,T,E): each key/value head's sum over its g query heads
    B, H, T, E = x.shape
    return x.reshape(B, Hkv, H // Hkv, T, E).sum(axis=2)


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


def k_attention_forward(bf16, qkv, y, m, l, T, H, Hkv, W, K, V, scale):
    T, H, Hkv, W, K, V = (int(x) for x in (T, H, Hkv, W, K, V))
    q, k, v, B, E = _att_inputs(qkv, T, H, Hkv, W, K, V)
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    s[..., _causal(T)] = -np.inf
    m2 = s.max(-1) * (scale * LOG2E)
    e = np.exp2(s * (scale * LOG2E) - m2[..., None])
    rl = f32(1.0) / e.sum(-1)
    _a(m)[...] = m2
    _a(l)[...] = rl
    _store(y, _unheads(np.matmul(_rounded(e * rl[..., None]), v)), True)


def _att_backward(qkv, dy, m, l, T, H, Hkv, W, K, V, scale):
    T, H, Hkv, W, K, V = (int(x) for x in (T, H, Hkv, W, K, V))
    q, k, v, B, E = _att_inputs(qkv, T, H, Hkv, W, K, V)
    dyh = _heads(_widen(_a(dy)), B, T, H)
    p = _att_p(q, k, _a(m), _a(l), T, scale)
    dp = np.matmul(dyh, np.swapaxes(v, -1, -2))
    return q, k, dyh, p, dp, E


def _att_ds(p, dp, dot, scale):
    return _rounded(p * (dp - dot[..., None]) * scale)


def k_attention_backward_dq(bf16, qkv, y, dy, m, l, dot, dqk, T, H, Hkv, W, K, V, QK, scale):
    q, k, dyh, p, dp, E = _att_backward(qkv, dy, m, l, T, H, Hkv, W, K, V, scale)
    d = (dp * p).sum(-1)
    _a(dot)[...] = d
    _a(dqk).reshape(-1, int(QK))[:, :int(H) * E] = _unheads(np.matmul(_att_ds(p, dp, d, scale), k))


def k_attention_backward_dkdv(bf16, qkv, dy, m, l, dot, dqk, dqkv, T, H, Hkv, W, K, V, QK, scale):
    # dk, dv of each key/value head: float32 sums over its query heads, dv rounded once
    q, k, dyh, p, dp, E = _att_backward(qkv, dy, m, l, T, H, Hkv, W, K, V, scale)
    Hkv, K, V = int(Hkv), int(K), int(V)
    ds = _att_ds(p, dp, _a(dot), scale)
    dk = _group_sum(np.matmul(np.swapaxes(ds, -1, -2), q), Hkv)
    dv = _group_sum(np.matmul(np.swapaxes(_rounded(p), -1, -2), dyh), Hkv)
    _a(dqk).reshape(-1, int(QK))[:, K:K + Hkv * E] = _unheads(dk)
    _a(dqkv).reshape(-1, int(W))[:, V:V + Hkv * E] = \
        _unheads(dv).astype(ml_dtypes.bfloat16).view(np.uint16)
