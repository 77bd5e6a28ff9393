"""The MLX backend (SPEC sections 13 and 14): the training step written in
MLX, differentiated by MLX's autodiff (`mx.value_and_grad`, independent of
the reference's hand-written backward) and compiled once with `mx.compile`.

The parameters live as a dict of MLX arrays keyed by the registry's names;
`tok_embedding.weight` serves both the gather and the logits (tied), so
autodiff sums its two gradients. The flat P, M, V vectors of the shared
State exist only at capture and in `.state()`.

One compiled function does the whole step:

    (params, m, v, t, tokens) -> (params', m', v', t', loss, row_losses, grads)

The optimizer state and the update count t are its inputs and outputs, so a
replay needs nothing from the host but the next tokens. MLX is lazy: replay
calls the compiled function (which only builds the graph) and
`mx.async_eval` starts it; the event's `wait()` is `mx.eval`.

Precision policies (SPEC section 6). `bf16` rounds each operand of each
matrix product to bfloat16 and multiplies in float32: a product of two
bfloat16 values is exact in float32, so the float32 product accumulates the
exact terms in float32 and its result stays float32 (an MLX matmul of
bfloat16 arrays would round its result to bfloat16). The backward products
get the same treatment through a custom vjp that rounds the incoming
cotangent and both saved operands.

AdamW (SPEC section 7) is written out here (mlx.optimizers.AdamW differs in
bias correction and decay mask). The bias corrections c1, c2 are computed
inside the compiled step from the device update count, in float64 on the
CPU stream (Metal has no float64), then rounded to float32: the same
float64 pow as the reference's host arithmetic, so the same bits.

COPPELIUS_NO_CAPTURE=1 turns `mx.compile` off (each replay then traces the
step again, eagerly): for debugging the graph, not for training.
"""

from __future__ import annotations

import math
import os
import re
import tempfile

import numpy as np

try:
    import mlx.core as mx
except ImportError:  # the backend is simply unavailable
    mx = None

from reference.adamw import AdamWConstants
from reference.config import LAYERNORM_EPS, Config, Hyper, check_precision
from reference.errors import RunError
from reference.layers.rope import rope_tables
from reference.params import registry
from reference.state import State

BACKEND = "mlx"
SCHEMA = "coppelius.training_compilation.v1"
STAGES = ("semantic_validation", "replay_safety", "decomposition", "fusion", "placement",
          "precision", "kernel_selection", "lowering_validation", "memory_planning",
          "synchronization_planning", "command_recording")


def available() -> bool:
    return mx is not None


class ReplayRefused(RunError):
    """A replay whose inputs or state do not match the capture."""


def capture_enabled() -> bool:
    return os.environ.get("COPPELIUS_NO_CAPTURE", "") in ("", "0")


# ---------------------------------------------------------------- precision

def round_bf16(x):
    """float32 -> float32 holding the nearest bfloat16 (MLX converts with
    round to nearest even)."""
    return x.astype(mx.bfloat16).astype(mx.float32)


def _matmul_fp32(a, b):
    return a @ b


def _make_matmul_bf16():
    @mx.custom_function
    def matmul_bf16(a, b):
        # (...,n,k) @ (...,k,m): operands rounded, float32 product and result
        return round_bf16(a) @ round_bf16(b)

    @matmul_bf16.vjp
    def matmul_bf16_vjp(primals, cotangent, output):
        # the backward products round their operands too, the cotangent included
        a, b = primals
        g = round_bf16(cotangent)
        da = g @ round_bf16(b).swapaxes(-1, -2)  # (...,n,m) @ (...,m,k)
        db = round_bf16(a).swapaxes(-1, -2) @ g  # (...,k,n) @ (...,n,m)
        return da, db

    return matmul_bf16


_MATMUL_BF16 = _make_matmul_bf16() if mx is not None else None


def matmul_for(policy: str):
    return _MATMUL_BF16 if check_precision(policy) == "bf16" else _matmul_fp32


# ---------------------------------------------------------------- forward

class Model:
    """The forward of SPEC sections 3 and 4 over a dict of MLX arrays."""

    def __init__(self, config: Config, policy: str):
        self.config = config
        self.matmul = matmul_for(policy)
        T, E = config.context, config.head_dim
        cos, sin = rope_tables(T, E)  # (T,E/2) float32, computed in float64 then rounded
        self.cos, self.sin = mx.array(cos), mx.array(sin)
        self.scale = mx.array(np.float32(1.0 / math.sqrt(E)))  # float32(1/sqrt(E))
        self.eps = mx.array(np.float32(float(LAYERNORM_EPS)))
        # True where j > i: the future positions a row must not see
        self.future = mx.array(np.triu(np.ones((T, T), dtype=bool), k=1))

    def linear(self, x, W):
        # x (B,T,in), W (out,in) -> (B,T,out): y = x @ W.T, as one 2-D product
        B, T, n_in = x.shape
        return self.matmul(x.reshape(B * T, n_in), W.T).reshape(B, T, W.shape[0])

    def layernorm(self, x, w, b):
        # x (B,T,D) -> (B,T,D); biased variance
        mu = mx.mean(x, axis=-1, keepdims=True)
        xc = x - mu
        var = mx.mean(xc * xc, axis=-1, keepdims=True)
        return xc * (1.0 / mx.sqrt(var + self.eps)) * w + b

    def rope(self, x):
        # x (B,T,H,E): element j pairs with element j + E/2 (half-split)
        T, half = x.shape[1], x.shape[-1] // 2
        c, s = self.cos[:T, None, :], self.sin[:T, None, :]  # (T,1,E/2)
        x1, x2 = x[..., :half], x[..., half:]
        return mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def attention(self, q, k, v):
        # q, k, v (B,H,T,E) -> (B,H,T,E)
        T = q.shape[2]
        s = self.matmul(q, k.swapaxes(-1, -2)) * self.scale  # (B,H,T,T)
        s = mx.where(self.future[:T, :T], -mx.inf, s)
        # softmax is invariant to the shift, so the row maximum carries no gradient
        s = s - mx.stop_gradient(mx.max(s, axis=-1, keepdims=True))
        p = mx.exp(s)
        p = p / mx.sum(p, axis=-1, keepdims=True)
        return self.matmul(p, v)

    def logits(self, params, tokens):
        # tokens (B,T) int32 -> logits (B,T,V)
        c = self.config
        B, T = tokens.shape
        H, E = c.n_head, c.head_dim
        W = params["tok_embedding.weight"]  # (V,D), tied: the gather and the logits
        x = mx.take(W, tokens, axis=0)  # (B,T,D)
        for l in range(c.n_layer):
            p = f"layers.{l}."
            h = self.layernorm(x, params[p + "attn_norm.weight"], params[p + "attn_norm.bias"])
            q = self.rope(self.linear(h, params[p + "attn.q.weight"]).reshape(B, T, H, E))
            k = self.rope(self.linear(h, params[p + "attn.k.weight"]).reshape(B, T, H, E))
            v = self.linear(h, params[p + "attn.v.weight"]).reshape(B, T, H, E)
            y = self.attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                               v.transpose(0, 2, 1, 3))  # (B,H,T,E)
            y = y.transpose(0, 2, 1, 3).reshape(B, T, H * E)
            x = x + self.linear(y, params[p + "attn.o.weight"])
            h = self.layernorm(x, params[p + "mlp_norm.weight"], params[p + "mlp_norm.bias"])
            g = self.linear(h, params[p + "mlp.gate.weight"])  # (B,T,F)
            u = self.linear(h, params[p + "mlp.up.weight"])
            a = g * (1.0 / (1.0 + mx.exp(-g))) * u  # silu(g) * u
            x = x + self.linear(a, params[p + "mlp.down.weight"])
        h = self.layernorm(x, params["final_norm.weight"], params["final_norm.bias"])
        return self.linear(h, W)  # (B,T,V)

    def row_losses(self, params, inputs, targets):
        # inputs, targets (B,T) -> ce (B,T) = logsumexp(logits) - logits[target]
        logits = self.logits(params, inputs)
        top = mx.stop_gradient(mx.max(logits, axis=-1, keepdims=True))  # (B,T,1)
        lse = mx.log(mx.sum(mx.exp(logits - top), axis=-1)) + top[..., 0]
        picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return lse - picked

    def loss(self, params, inputs, targets):
        ce = self.row_losses(params, inputs, targets)
        return mx.mean(ce), ce


# ---------------------------------------------------------------- AdamW

class AdamW:
    """SPEC section 7 on a dict of parameters; t is a device int32 scalar."""

    def __init__(self, config: Config, hyper: Hyper):
        k = AdamWConstants.of(hyper)  # each exact rational rounded once to float32
        f32 = lambda x: mx.array(np.float32(x))  # noqa: E731
        self.b1, self.omb1, self.b2, self.omb2 = f32(k.b1), f32(k.omb1), f32(k.b2), f32(k.omb2)
        self.lr, self.lrwd, self.eps = f32(k.lr), f32(k.lrwd), f32(k.eps)
        # float64 beta1, beta2, as the bias corrections are computed in float64
        self.beta64 = (float(hyper.beta1), float(hyper.beta2))
        self.decay = {s.name: s.decay for s in registry(config)}

    def bias_corrections(self, t):
        # t (int32 scalar) -> c1, c2 float32 = float32(1 - beta^t) computed in float64
        tf = t.astype(mx.float64, stream=mx.cpu)
        c = [(1.0 - mx.power(mx.array(beta, dtype=mx.float64), tf, stream=mx.cpu))
             .astype(mx.float32, stream=mx.cpu) for beta in self.beta64]
        return c[0], c[1]

    def update(self, params, m, v, grads, t):
        """Update number t (already advanced, 1-based) -> fresh params, m, v."""
        c1, c2 = self.bias_corrections(t)
        new_p, new_m, new_v = {}, {}, {}
        for name, p in params.items():
            g = grads[name]
            mn = self.b1 * m[name] + self.omb1 * g
            vn = self.b2 * v[name] + self.omb2 * g * g
            if self.decay[name]:  # two-dimensional parameters only
                p = p - self.lrwd * p
            new_p[name] = p - self.lr * (mn / c1) / (mx.sqrt(vn / c2) + self.eps)
            new_m[name], new_v[name] = mn, vn
        return new_p, new_m, new_v
