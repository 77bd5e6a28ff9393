"""The attention family (kernels/attention.cu): the softmax of the
materialized (B,H,T,T) scores, forward and backward, between cuBLAS's
batched products (accelerated/cuda/model.py); and the scale every path uses."""

from __future__ import annotations

import math

import numpy as np

from .launch import WARPS, Launcher, _cdiv, _opt, f32, i32

KERNELS = ("attention_softmax_forward", "attention_softmax_backward")


def attention_scale(E: int) -> np.float32:
    """float32(1/sqrt(E)), as the reference's q.dtype.type(1.0 / np.sqrt(E))."""
    return np.float32(1.0 / math.sqrt(E))


class AttentionLaunchers(Launcher):
    """The launchers of kernels/attention.cu."""

    def attention_softmax_forward(self, s, p_op, scale):
        # s (B,H,T,T) scores -> probabilities in place (+ p_op operands)
        T = s.shape[-1]
        rows = s.size // T
        self._launch("attention_softmax_forward", _cdiv(rows, WARPS), 32 * WARPS,
                     (s, _opt(p_op), i32(rows), i32(T), f32(scale)))

    def attention_softmax_backward(self, p, dp, ds, p_op, scale):
        # p, dp (B,H,T,T) -> ds (B,H,T,T) operands (+ p_op)
        T = p.shape[-1]
        rows = p.size // T
        self._launch("attention_softmax_backward", _cdiv(rows, WARPS), 32 * WARPS,
                     (p, dp, ds, _opt(p_op), i32(rows), i32(T), f32(scale)))
