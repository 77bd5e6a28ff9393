"""The MLX backend (SPEC sections 13 and 14): the training step written in
MLX, differentiated by MLX's autodiff (`mx.value_and_grad`, independent of
the reference's hand-written backward) and compiled once with `mx.compile`.

The parameters live as a dict of MLX arrays keyed by the registry's names;
where the model is tied, `tok_embedding.weight` serves both the gather and
the logits, so autodiff sums its two gradients (untied, SPEC 21, the logits
read `lm_head.weight` and the embedding gets its gather gradient alone).
The flat P, M, V vectors of the shared State exist only at capture and in
`.state()`. Every member of the model family (SPEC 21) is the same step
with different values: the norm, the key/value heads, the rotated width,
the q/k/v biases are read from the config and the registry.

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
cotangent and both saved operands. A q/k/v bias is added in float32 after
its product, outside the rounded function.

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
import re
import tempfile

import numpy as np

try:
    import mlx.core as mx
except ImportError:  # the backend is simply unavailable
    mx = None

from ..reference.adamw import AdamWConstants, float32_of, schedule_table
from ..reference.config import Config, Hyper, check_implemented, check_precision
from ..reference.errors import RunError
from ..reference.layers.rope import rope_tables
from ..reference.params import registry
from ..reference.compilation import (MemoryAnalysis, PartitionOutcome, Resource,
                                             compilation_report)
from ..reference.contract import (CapturedProgram, ReplayError, StepRecords, Submitted,
                                          check_logits_tokens, check_replay_state, check_tokens,
                                          recompute_mode)
from ..reference.semantic import activation_names, gradient_name, partitions
from ..reference.state import State

BACKEND = "mlx"


def available() -> bool:
    return mx is not None



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

# The family's fields (SPEC 21) this backend computes; the others are refused
IMPLEMENTED = ("norm", "norm_eps", "n_kv_head", "tied", "rope_base", "rotary", "qkv_bias")


class Model:
    """The forward of SPEC sections 3 and 4 over a dict of MLX arrays. With
    recompute "gate-up", each layer's gate and up products and SwiGLU are
    one mx.checkpoint; with "block", each layer's whole forward, from the
    residual stream entering it: their outputs are not kept for the
    gradient, which computes them again (the same values)."""

    def __init__(self, config: Config, policy: str, recompute=None):
        check_implemented(config, IMPLEMENTED, BACKEND)
        self.config = config
        self.matmul = matmul_for(policy)
        self.recompute = recompute_mode(recompute)  # None, "gate-up" or "block"
        T, E = config.context, config.head_dim
        # (T,R/2), float64 then rounded; R = rotary * E elements of each head are rotated
        cos, sin = rope_tables(T, config.rotary_dim, np.float32, config.rope_base)
        self.cos, self.sin = mx.array(cos), mx.array(sin)
        self.scale = mx.array(np.float32(1.0 / math.sqrt(E)))  # float32(1/sqrt(E))
        self.eps = mx.array(np.float32(float(config.norm_eps)))
        # -inf where j > i (the future positions a row must not see), else 0:
        # added to the scores, exactly where's result (s + 0 is s, s + -inf is
        # -inf; the masked entries' gradient is p = 0 times what comes back).
        # An add, not mx.where: MLX 0.32's compile fails (`_Map_base::at`) on
        # the where's gradient in two or more layers and three or more
        # micro-batches (SPEC 19's accumulation).
        future = np.triu(np.ones((T, T), dtype=bool), k=1)
        self.mask = mx.array(np.where(future, -np.inf, 0.0).astype(np.float32))

    def linear_forward(self, x, W):
        # x (B,T,in), W (out,in) -> (B,T,out): y = x @ W.T, as one 2-D product
        B, T, n_in = x.shape
        return self.matmul(x.reshape(B * T, n_in), W.T).reshape(B, T, W.shape[0])

    def projection_forward(self, x, w, name):
        # q, k or v: x (B,T,D) -> (B,T,out), plus its bias (out,) in float32 where
        # qkv_bias is set (SPEC 21; only the product's operands are rounded, SPEC 6)
        y = self.linear_forward(x, w[name + ".weight"])
        return y + w[name + ".bias"] if self.config.qkv_bias else y

    def layernorm_forward(self, x, w, b):
        # x (B,T,D) -> (B,T,D); biased variance
        mu = mx.mean(x, axis=-1, keepdims=True)
        xc = x - mu
        var = mx.mean(xc * xc, axis=-1, keepdims=True)
        return xc * (1.0 / mx.sqrt(var + self.eps)) * w + b

    def rmsnorm_forward(self, x, w):
        # x (B,T,D) -> (B,T,D): x / sqrt(mean(x^2) + eps) * w, no bias (SPEC 21)
        ms = mx.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / mx.sqrt(ms + self.eps)) * w

    def norm_forward(self, x, w, name):
        # the config's norm of x (B,T,D) with the parameters `name`.weight (and .bias)
        if self.config.norm_bias:
            return self.layernorm_forward(x, w[name + ".weight"], w[name + ".bias"])
        return self.rmsnorm_forward(x, w[name + ".weight"])

    def rope_forward(self, x):
        # x (B,T,H,E): the first R elements of each head rotated, element j paired
        # with element j + R/2 (half-split within R); the other E - R pass through
        T, half = x.shape[1], self.cos.shape[-1]  # R/2
        R = 2 * half
        c, s = self.cos[:T, None, :], self.sin[:T, None, :]  # (T,1,R/2)
        x1, x2 = x[..., :half], x[..., half:R]
        rotated = [x1 * c - x2 * s, x2 * c + x1 * s]
        return mx.concatenate(rotated + ([x[..., R:]] if R < x.shape[-1] else []), axis=-1)

    def attention_forward(self, q, k, v):
        # q (B,H,T,E), k, v (B,Hkv,T,E) -> (B,H,T,E). Grouped heads (SPEC 21): query
        # head h attends with key/value head h // g, g = H / Hkv; repeating each kv
        # head g times in place makes autodiff sum its g query heads' gradients
        T, g = q.shape[2], q.shape[1] // k.shape[1]
        if g > 1:
            k, v = mx.repeat(k, g, axis=1), mx.repeat(v, g, axis=1)  # (B,H,T,E)
        s = self.matmul(q, k.swapaxes(-1, -2)) * self.scale  # (B,H,T,T)
        s = s + self.mask[:T, :T]
        # softmax is invariant to the shift, so the row maximum carries no gradient
        s = s - mx.stop_gradient(mx.max(s, axis=-1, keepdims=True))
        p = mx.exp(s)
        p = p / mx.sum(p, axis=-1, keepdims=True)
        return self.matmul(p, v)

    def logits(self, params, tokens, tap=None):
        """tokens (B,T) int32 -> logits (B,T,V). tap(name, x) -> x, when
        given, sees each named intermediate (reference/semantic.py) and
        returns what the step continues with (activations() adds a zero
        probe there to read the gradient at that point)."""
        keep = tap or (lambda name, x: x)
        c = self.config
        w = params
        x = keep("embedding.out", mx.take(w["tok_embedding.weight"], tokens, axis=0))  # (B,T,D)
        for l in range(c.n_layer):
            p = f"layers.{l}."
            if self.recompute == "block" and tap is None:
                # the layer's parameters as arguments, so that the gradient reaches them
                names = [name for name in w if name.startswith(p)]

                def block(x, *weights, l=l, names=names):
                    return self.layer_forward(x, dict(zip(names, weights)), l, keep)

                x = mx.checkpoint(block)(x, *(w[name] for name in names))
            else:
                x = self.layer_forward(x, w, l, keep, tap)
        h = keep("final_norm.out", self.norm_forward(x, w, "final_norm"))
        # lm_head.weight (V,D): its own tensor where untied; where tied the registry
        # resolves the alias to the embedding, whose gradient then sums both uses
        head = w[registry(c)["lm_head.weight"].name]
        return keep("logits", self.linear_forward(h, head))  # (B,T,V)

    def layer_forward(self, x, w, l, keep, tap=None):
        """Layer l: x (B,T,D), the residual stream entering it -> the stream
        leaving it; w the parameters by name (at least the layer's)."""
        c = self.config
        B, T = x.shape[0], x.shape[1]
        H, Hkv, E = c.n_head, c.kv_heads, c.head_dim
        D, KV = c.d_model, c.kv_dim  # H E and Hkv E: the widths of q and of k, v
        p = f"layers.{l}."
        h = keep(p + "attn_norm.out", self.norm_forward(x, w, p + "attn_norm"))
        q = self.projection_forward(h, w, p + "attn.q").reshape(B, T, H, E)
        k = self.projection_forward(h, w, p + "attn.k").reshape(B, T, Hkv, E)
        v = keep(p + "attn.v", self.projection_forward(h, w, p + "attn.v"))
        v = v.reshape(B, T, Hkv, E)
        q = keep(p + "attn.q", self.rope_forward(q).reshape(B, T, D)).reshape(B, T, H, E)
        k = keep(p + "attn.k", self.rope_forward(k).reshape(B, T, KV)).reshape(B, T, Hkv, E)
        y = self.attention_forward(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                   v.transpose(0, 2, 1, 3))  # (B,H,T,E)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, H * E)  # heads concatenated in order
        y = keep(p + "attn.y", y)
        x = keep(p + "mid", x + self.linear_forward(y, w[p + "attn.o.weight"]))
        h = keep(p + "mlp_norm.out", self.norm_forward(x, w, p + "mlp_norm"))
        if self.recompute == "gate-up" and tap is None:
            a = mx.checkpoint(self.mlp_inner)(h, w[p + "mlp.gate.weight"],
                                              w[p + "mlp.up.weight"])
        else:
            g = keep(p + "mlp.gate", self.linear_forward(h, w[p + "mlp.gate.weight"]))
            u = keep(p + "mlp.up", self.linear_forward(h, w[p + "mlp.up.weight"]))  # (B,T,F)
            a = keep(p + "mlp.h", self.swiglu_forward(g, u))
        x = keep(p + "out", x + self.linear_forward(a, w[p + "mlp.down.weight"]))
        return x

    def mlp_inner(self, h, w_gate, w_up):
        # h (B,T,D) -> silu(h Wgate^T) * (h Wup^T) (B,T,F)
        return self.swiglu_forward(self.linear_forward(h, w_gate), self.linear_forward(h, w_up))

    @staticmethod
    def swiglu_forward(g, u):
        # g, u (B,T,F) -> silu(g) * u, silu(g) = g * sigmoid(g)
        return g * (1.0 / (1.0 + mx.exp(-g))) * u

    @staticmethod
    def crossentropy_forward(logits, targets):
        # logits (B,T,V), targets (B,T) -> ce (B,T) = logsumexp(logits) - logits[target]
        # logsumexp is invariant to the shift, so the maximum carries no gradient
        top = mx.stop_gradient(mx.max(logits, axis=-1, keepdims=True))  # (B,T,1)
        lse = mx.log(mx.sum(mx.exp(logits - top), axis=-1)) + top[..., 0]
        picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return lse - picked

    def row_losses(self, params, inputs, targets):
        # inputs, targets (B,T) -> ce (B,T)
        return self.crossentropy_forward(self.logits(params, inputs), targets)

    def loss(self, params, inputs, targets):
        ce = self.row_losses(params, inputs, targets)
        return mx.mean(ce), ce

    def scaled_loss(self, params, inputs, targets, scale):
        # a micro-batch of an accumulated step (SPEC 19): the sum of its row
        # losses times 1/(B*T) of the whole batch, so the summed gradients
        # are the whole batch's mean-loss gradient
        ce = self.row_losses(params, inputs, targets)
        return mx.sum(ce) * scale, ce


# ---------------------------------------------------------------- AdamW

class AdamW:
    """SPEC section 7 on a dict of parameters; t is a device int32 scalar."""

    def __init__(self, config: Config, hyper: Hyper):
        k = AdamWConstants.of(hyper)  # each exact rational rounded once to float32
        f32 = lambda x: mx.array(np.float32(x))  # noqa: E731
        self.b1, self.omb1, self.b2, self.omb2 = f32(k.b1), f32(k.omb1), f32(k.b2), f32(k.omb2)
        self.eps = f32(k.eps)
        # (R, 2) a_t, b_t (lr and lr * weight_decay under the schedule), from
        # the host once; update t reads row min(t, R - 1) on the device (SPEC 7)
        self.rates = mx.array(schedule_table(hyper))
        self.clip = None if hyper.clip is None else f32(float32_of(hyper.clip))
        # float64 beta1, beta2, as the bias corrections are computed in float64
        self.beta64 = (float(hyper.beta1), float(hyper.beta2))
        self.decay = {s.name: s.decay for s in registry(config)}

    def bias_corrections(self, t):
        # t (int32 scalar) -> c1, c2 float32 = float32(1 - beta^t) computed in float64
        tf = t.astype(mx.float64, stream=mx.cpu)
        c = [(1.0 - mx.power(mx.array(beta, dtype=mx.float64), tf, stream=mx.cpu))
             .astype(mx.float32, stream=mx.cpu) for beta in self.beta64]
        return c[0], c[1]

    @staticmethod
    def gradient_norm(grads):
        # sqrt(sum g^2) over every element, summed in float32 (SPEC 7 allows
        # any order); the tied embedding has one gradient, counted once
        # in two levels, rows then tensor: MLX's CPU sum runs sequentially, and
        # one float32 sum over a million squares drifts by ~1e-5 (seen on tiny),
        # which the clip scale carries into every element of the update
        return mx.sqrt(sum(mx.sum(mx.sum(g * g, axis=-1)) for g in grads.values()))

    def clip_grads(self, grads, norm):
        """g * float32(c / n) where n > c (a non-finite n never clips)."""
        if self.clip is None:
            return grads
        scale = mx.where(mx.isfinite(norm) & (norm > self.clip), self.clip / norm,
                         mx.array(np.float32(1)))  # times 1 is exact: unclipped bits unchanged
        return {name: g * scale for name, g in grads.items()}

    def update(self, params, m, v, grads, t):
        """Update number t (already advanced, 1-based) -> fresh params, m, v."""
        c1, c2 = self.bias_corrections(t)
        row = mx.minimum(t, self.rates.shape[0] - 1)
        lr, lrwd = self.rates[row, 0], self.rates[row, 1]
        new_p, new_m, new_v = {}, {}, {}
        for name, p in params.items():
            g = grads[name]
            mn = self.b1 * m[name] + self.omb1 * g
            vn = self.b2 * v[name] + self.omb2 * g * g
            if self.decay[name]:  # two-dimensional parameters only
                p = p - lrwd * p
            new_p[name] = p - lr * (mn / c1) / (mx.sqrt(vn / c2) + self.eps)
            new_m[name], new_v[name] = mn, vn
        return new_p, new_m, new_v


# ---------------------------------------------------------------- the program

def _to_device(config: Config, flat: np.ndarray) -> dict:
    # (N,) float32 -> {name: mx.array of the parameter's shape}; aliases have no storage
    return {s.name: mx.array(flat[s.slice].reshape(s.shape)) for s in registry(config)}


def _to_host(config: Config, tensors: dict) -> np.ndarray:
    # {name: mx.array} -> (N,) float32 in the registry's layout
    reg = registry(config)
    flat = np.empty(reg.total, dtype=np.float32)
    for s in reg:
        flat[s.slice] = np.asarray(tensors[s.name], dtype=np.float32).reshape(-1)
    return flat


class DeviceState:
    """The optimizer state as the compiled step consumes and produces it."""

    backend = BACKEND

    def __init__(self, params: dict, m: dict, v: dict, t):
        self.params, self.m, self.v, self.t = params, m, v, t  # t: int32 scalar

    def arrays(self) -> list:
        return [*self.params.values(), *self.m.values(), *self.v.values(), self.t]


class Event:
    """A submitted replay; wait() blocks until its outputs are computed."""

    def __init__(self, arrays: list):
        self._arrays = arrays

    def wait(self):
        mx.eval(self._arrays)



class MLXProgram(CapturedProgram):
    """The captured training step on MLX (the TrainingProgram interface)."""

    backend = BACKEND

    def __init__(self, config: Config, hyper: Hyper, precision: str, batch: int, state: State,
                 accumulate: int | None = None, recompute=None):
        self._bind(config, hyper, precision, batch, state, accumulate)
        self.recompute = recompute_mode(recompute)  # None, "gate-up" or "block"
        self.model = Model(config, precision, self.recompute)
        self.adamw = AdamW(config, hyper)
        self.value_and_grad = mx.value_and_grad(self.model.loss)  # d loss / d params
        self.micro_value_and_grad = mx.value_and_grad(self.model.scaled_loss)
        self.traces = 0  # times the step function was traced (1 when compiled)
        self.replays = 0
        self._step = self._traced_step  # replaced by the compiled step when captured
        t = mx.array(int(state.t), dtype=mx.int32)  # the update count lives on the device
        self.device_state = DeviceState(_to_device(config, state.P), _to_device(config, state.M),
                                        _to_device(config, state.V), t)
        self._owned = self.device_state  # the state this program last produced
        self._tokens = None  # the input slot, (B,T+1) int32
        self._loss = self._rows = self._grads = None  # outputs of the last replay
        self._pending = None  # the Event of a replay submitted and not yet waited for
        self._eval = None  # the forward-only program, compiled on first evaluate()
        self.captured = self._capture()
        self._graph = self._count_graph()

    # -- the step ------------------------------------------------------------

    def _step_fn(self, params, m, v, t, tokens):
        # tokens (B,T+1): inputs the first T ids, targets the same window one on
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if self.accumulate == 1:
            (loss, rows), grads = self.value_and_grad(params, inputs, targets)
        else:
            loss, rows, grads = self._accumulated(params, inputs, targets)
        norm = self.adamw.gradient_norm(grads)  # before clipping: recorded every step
        t = t + 1  # this update's number, 1-based
        params, m, v = self.adamw.update(params, m, v, self.adamw.clip_grads(grads, norm), t)
        return params, m, v, t, loss, rows, grads, norm

    def _accumulated(self, params, inputs, targets):
        # SPEC 19: k micro-batches of B/k rows in order, each gradient scaled
        # by 1/(B*T), added left to right into G; the loss is the mean of all rows
        k, (B, T) = self.accumulate, inputs.shape
        b, scale = B // k, mx.array(np.float32(1.0) / np.float32(B * T))
        rows, grads = [], None
        for i in range(k):
            (_, ce), g = self.micro_value_and_grad(params, inputs[i * b:(i + 1) * b],
                                                   targets[i * b:(i + 1) * b], scale)
            rows.append(ce)
            grads = g if grads is None else {name: grads[name] + g[name] for name in grads}
        rows = mx.concatenate(rows, axis=0)
        return mx.mean(rows), rows, grads

    def _traced_step(self, params, m, v, t, tokens):
        self.traces += 1  # Python runs only while tracing: counts compilations
        return self._step_fn(params, m, v, t, tokens)

    def _placeholder(self):
        return mx.zeros((self.batch, self.config.context + 1), dtype=mx.int32)

    def _record(self) -> None:
        """Capture: compile the step and trace it once on a placeholder input.
        Nothing is evaluated, so no update happens."""
        compiled = mx.compile(self._traced_step)
        s = self.device_state
        compiled(s.params, s.m, s.v, s.t, self._placeholder())  # traces; errors surface here
        self._step = compiled

    def _count_graph(self) -> dict:
        """The primitive nodes of the step's lazy graph, before and after
        mx.compile (the same when not compiled)."""
        s = self.device_state
        graph = _primitives(self._step_fn(s.params, s.m, s.v, s.t, self._placeholder()))
        if self.captured:
            compiled = _primitives(self._step(s.params, s.m, s.v, s.t, self._placeholder()))
        else:
            compiled = graph
        return {"graph": graph, "compiled": compiled}

    # -- the TrainingProgram interface -----------------------------------------

    def upload_input(self, tokens):
        """tokens (B,T+1) ids -> the input slot. No wait for a pending replay is
        needed: MLX arrays are immutable and a submitted replay holds its own
        reference to its input, so replacing the slot cannot race with it."""
        tokens = check_tokens(self.config, self.batch, tokens)
        self._tokens = mx.array(tokens.astype(np.int32))  # the one host-to-device copy

    def replay(self) -> Event:
        """Submit one step without waiting; returns an event."""
        if self._tokens is None:
            raise ReplayError("replay before upload_input: the input slot is empty")
        s = self.device_state
        check_replay_state(s, self._owned, BACKEND)
        params, m, v, t, loss, rows, grads, norm = self._step(s.params, s.m, s.v, s.t,
                                                              self._tokens)
        self.device_state = self._owned = DeviceState(params, m, v, t)
        self._loss, self._rows, self._grads, self._norm = loss, rows, grads, norm
        outputs = [*self.device_state.arrays(), loss, rows, norm, *grads.values()]
        mx.async_eval(outputs)  # starts the graph; the host returns at once
        self.replays += 1
        self._pending = Event(outputs)  # no query: MLX tells completion only by waiting
        return self._pending

    def submit(self, tokens) -> Submitted:
        """One step submitted with async_eval; its records are the arrays
        this replay returned (immutable: later replays make new ones), read
        when records() is called."""
        self.upload_input(tokens)
        self.replay()
        loss, rows, norm = self._loss, self._rows, self._norm

        def read():
            mx.eval(loss, rows, norm)
            return StepRecords(float(loss.item()), np.array(rows, dtype=np.float32),
                               float(norm.item()), math.nan)

        return Submitted(read)

    def _release(self) -> None:
        self.device_state = self._owned = None
        self._tokens = self._loss = self._rows = self._grads = self._norm = None
        self._step = self._eval = self._pending = None
        mx.clear_cache()  # the freed buffers go back to the system, not to MLX's cache

    def _host_loss(self) -> float:
        return float(self._loss.item())  # the one device-to-host read per step

    def row_losses(self) -> np.ndarray:
        self._need_replay("row_losses")
        return np.array(self._rows, dtype=np.float32)  # (B,T)

    def gradients(self) -> np.ndarray:
        self._need_replay("gradients")
        return _to_host(self.config, self._grads)  # (N,)

    def grad_norm(self) -> float:
        self._need_replay("grad_norm")
        return float(self._norm.item())

    def state(self) -> State:
        self.wait()
        s = self.device_state
        mx.eval(s.arrays())
        return State(_to_host(self.config, s.params), _to_host(self.config, s.m),
                     _to_host(self.config, s.v), int(s.t.item()))

    def logits(self, tokens) -> np.ndarray:
        """tokens (B,T') with T' <= T -> logits (B,T',V) with the current parameters."""
        tokens = check_logits_tokens(self.config, tokens)
        out = self.model.logits(self.device_state.params, mx.array(tokens.astype(np.int32)))
        return np.array(out, dtype=np.float32)

    def evaluate(self, tokens) -> np.ndarray:
        """Held-out row losses (B,T) with the current parameters: the forward
        and loss alone, compiled once on first use (SPEC 18); no update."""
        tokens = check_tokens(self.config, self.batch, tokens, "evaluate input")
        if self._eval is None:
            self._eval = mx.compile(self.model.row_losses) if self.captured else \
                self.model.row_losses
        tokens = mx.array(tokens.astype(np.int32))
        rows = self._eval(self.device_state.params, tokens[:, :-1], tokens[:, 1:])
        return np.array(rows, dtype=np.float32)  # waits: the caller reads the losses

    def activations(self, tokens) -> dict:
        """tokens (B,T+1) -> every named intermediate of one step's forward and
        backward with the current parameters (no update). The backward's are
        gradients with respect to zero probes added at each named point of
        the forward (x + 0 is x: the forward's values are unchanged), taken
        by the same autodiff as the step."""
        tokens = check_tokens(self.config, self.batch, tokens, "activations input")
        self.wait()
        ids = mx.array(tokens.astype(np.int32))
        inputs, targets = ids[:, :-1], ids[:, 1:]
        params = self.device_state.params
        shapes = {}

        def shape_of(name, x):
            shapes[name] = x.shape
            return x

        self.model.logits(params, inputs, shape_of)  # lazy: only the shapes are read
        probes = {name: mx.zeros(shape, dtype=mx.float32) for name, shape in shapes.items()}

        def loss(probes):
            seen = {}

            def tap(name, x):
                x = x + probes[name]
                seen[name] = x
                return x

            ce = self.model.crossentropy_forward(self.model.logits(params, inputs, tap), targets)
            return mx.mean(ce), (ce, seen)

        (_, (ce, seen)), grads = mx.value_and_grad(loss)(probes)
        values = {**seen, "row_losses": ce}
        values.update({gradient_name(name): g for name, g in grads.items()})
        return {name: np.array(values[name], dtype=np.float32)
                for name, _ in activation_names(self.config)}

    def compilation_report(self) -> dict:
        return _report(self)

    def _partition_outcomes(self) -> list:
        return _partition_outcomes(self)

    def _executable_nodes(self):
        # MLX's autodiff builds the backward from its own primitives: its
        # nodes carry no record of the semantic operation they came from
        return None, "MLX's traced graph does not record which operation a primitive serves"

    def _executable_plan(self) -> list:
        return _executable_plan(self)

    def _memory_analysis(self) -> MemoryAnalysis:
        return _memory_analysis(self)

    def _runtime(self) -> dict:
        return {
            "mlx_version": mx.__version__,
            "device": str(mx.default_device()),
            "update_count": int(self.device_state.t.item()),  # a sync: not for the hot loop
            "active_bytes": int(mx.get_active_memory()),
            "peak_bytes": int(mx.get_peak_memory()),
        }


def capture(config: Config, hyper: Hyper, precision: str, batch: int, state: State,
            accumulate: int | None = None, recompute=None) -> MLXProgram:
    """Build and compile the step once; performs no training update.
    `accumulate` k (default: hyper.accumulate): SPEC 19's micro-batches.
    `recompute` (reference/contract.py recompute_mode: None or False off,
    "gate-up" or True, "block"): each layer's gate and up products, or its
    whole forward, computed again for the gradient (mx.checkpoint) instead
    of kept (the same values)."""
    if not available():
        raise RunError("backend 'mlx': mlx is not installed here")
    return MLXProgram(config, hyper, precision, batch, state, accumulate, recompute)


# ---------------------------------------------------------------- the report

_NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def _primitives(outputs) -> list:
    """Labels of the primitive nodes of the lazy graph behind `outputs` (MLX's
    DOT export is its one public view of the graph)."""
    arrays = [a for a in _leaves(outputs)]
    with tempfile.TemporaryFile("w+") as f:
        mx.export_to_dot(f, *arrays)
        f.seek(0)
        return _NODE.findall(f.read())


def _leaves(tree):
    if isinstance(tree, dict):
        for x in tree.values():
            yield from _leaves(x)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _leaves(x)
    else:
        yield tree


def _report(program: MLXProgram) -> dict:
    """What MLX did with the step, stage by stage (SPEC section 13). Most
    stages are MLX's own work ("inherited"); the counts are primitive nodes of
    the lazy graph before and after mx.compile."""
    graph, compiled = program._graph["graph"], program._graph["compiled"]
    n_params = len(program.device_state.params)
    n_in = 3 * n_params + 2  # P, M, V tensors, t, tokens
    n_out = 4 * n_params + 4  # P, M, V, G tensors, t, loss, row losses, gradient norm
    fused = sum(1 for label in compiled if label.startswith("Compiled"))
    products = sum(1 for label in graph if label == "Matmul")
    on = program.captured
    bf16 = program.precision == "bf16"
    stages = {
        "semantic_validation": ("applied", 1, 1),
        "replay_safety": ("analyzed", n_in, n_out),
        "decomposition": ("inherited", 1, len(graph)),
        "fusion": ("inherited" if on else "not_run", len(graph), len(compiled)),
        "placement": ("applied", len(graph), len(graph)),
        "precision": ("applied" if bf16 else "analyzed", products, products),
        "kernel_selection": ("inherited", len(compiled), len(compiled)),
        "lowering_validation": ("inherited" if on else "not_run", fused, fused),
        "memory_planning": ("inherited", n_in, n_out),
        "synchronization_planning": ("analyzed", 1, 1),
        "command_recording": ("applied" if on else "failed" if program.capture_refused
                              else "not_run", len(compiled), 1 if on else 0),
    }
    notes = {
        "semantic_validation": "configuration, precision, batch and state checked at capture",
        "replay_safety": "fixed shapes and no per-step Python values: t and the bias "
                         "corrections live on the device, so the step is traced once",
        "decomposition": "MLX autodiff (value_and_grad) turns the forward into primitives",
        "fusion": f"mx.compile fused elementwise chains into {fused} kernels" if on
                  else "disabled by COPPELIUS_NO_CAPTURE",
        "placement": f"{mx.default_device()}; the float64 bias corrections on the CPU stream",
        "precision": f"both operands of {products} matrix products rounded to bfloat16, "
                     "float32 accumulation and results" if bf16 else "every operation float32",
        "kernel_selection": "MLX primitives and its BLAS products",
        "lowering_validation": "MLX generates and builds the fused kernels" if on
                               else "not compiled",
        "memory_planning": "MLX allocator and its buffer reuse",
        "synchronization_planning": "one async_eval per replay; the host waits once per step",
        "command_recording": "mx.compile, traced once at capture" if on
                             else f"capture refused ({program.capture_refused}): traced every "
                                  "replay" if program.capture_refused
                             else "disabled by COPPELIUS_NO_CAPTURE: traced every replay",
    }
    N = registry(program.config).total
    B, T = program.batch, program.config.context
    return compilation_report(
        BACKEND, stages, kernels=len(compiled), graph_nodes=len(graph),
        device_bytes=4 * 4 * N + 4 * B * (T + 1),  # P, M, V, G and the input slot
        replays=program.replays, precision=program.precision, batch=B, captured=on,
        capture_refused=program.capture_refused or "", traces=program.traces,
        fused_kernels=fused if on else 0, notes=notes)


# ---------------------------------------------------------------- the analyses

def _partition_outcomes(program: MLXProgram) -> list:
    """What MLX makes of the step's fusion candidates: the autodiff graph has
    one product per weight and materialized attention scores; elementwise
    chains (a residual add and its norm, the loss and its gradient) are left
    to mx.compile, which fuses what it fuses (its regions are counted in
    the report's fused_kernels)."""
    out = []
    for part in partitions(program.config):
        if part.kind == "shared_input_products":
            out.append(PartitionOutcome("fallback", "one MLX product per weight"))
        elif part.kind == "attention":
            out.append(PartitionOutcome("fallback", "scores materialized by MLX primitives"))
        elif program.captured:
            out.append(PartitionOutcome("inherited", "elementwise chain left to mx.compile"))
        else:
            out.append(PartitionOutcome("fallback", "not compiled (capture off or refused)"))
    return out


def _executable_plan(program: MLXProgram) -> list:
    """The compiled graph's primitives (MLX's DOT export), in its order."""
    return [{"node": i, "primitive": label}
            for i, label in enumerate(program._graph["compiled"])]


def _memory_analysis(program: MLXProgram) -> MemoryAnalysis:
    note = "MLX's allocator owns every buffer of the step and reuses them itself"
    N = registry(program.config).total
    B, T = program.batch, program.config.context
    resources = [Resource(name, 4 * N, "state", None, None, False, False, None, note)
                 for name in ("P", "M", "V", "G")]
    resources.append(Resource("tokens", 4 * B * (T + 1), "input", None, None, False, False, None,
                              note))
    return MemoryAnalysis(tuple(resources), 0, 0, False, note)


# ---------------------------------------------------------------- binding

class MLXBindingBackend:
    """The binding layer's backend protocol (reference/binding.py,
    NumpyBackend) on MLX arrays: checkpoint leases become device arrays, and
    recipes (slice, concat, transpose, cast) run on the device. `alias`
    returns the very same array: the tied unembedding shares its storage."""

    name = "mlx"

    @staticmethod
    def _dtype(name: str):
        return {"float32": mx.float32, "bfloat16": mx.bfloat16}[name]

    def from_host(self, array: np.ndarray, dtype: str):
        host = np.ascontiguousarray(array)
        if host.dtype != np.float32:  # bfloat16 leases: widen exactly on the host
            host = host.astype(np.float32)
        return mx.array(host).astype(self._dtype(dtype))

    def slice(self, x, axis: int, start: int, stop: int):
        index = (slice(None),) * axis + (slice(start, stop),)
        return x[index]

    def concat(self, xs, axis: int):
        return mx.concatenate(list(xs), axis=axis)

    def transpose(self, x):
        return mx.transpose(x)

    def cast(self, x, dtype: str):
        return x.astype(self._dtype(dtype))  # float32 -> bfloat16 rounds to nearest even

    def alias(self, x):
        return x
