"""The model forward (SPEC section 3), loss (section 4) and the hand-written
backward (section 5), composed from the layer functions.

Parameters arrive as the flat vector P; the tape gives the named tensors
(`registry(config).views(P)`). The dtype follows P: float32 normally, float64
for the finite-difference tests (precision policy fp32 only).

Each layer call goes through a tape (reference/tape.py): `t.op(name, kind,
fn, *args, out=names)` is `fn(*args)` under the operation's and its
outputs' names in the semantic graph (reference/semantic.py), which is
traced from these same functions.
"""

from __future__ import annotations

import numpy as np

from .config import Config, check_implemented
from .layers.attention import attention_backward, attention_forward
from .layers.crossentropy import crossentropy_backward, crossentropy_forward
from .layers.embedding import embedding_backward, embedding_forward
from .layers.layernorm import layernorm_backward, layernorm_forward
from .layers.linear import (linear_backward, linear_bias_backward, linear_bias_forward,
                            linear_forward)
from .layers.rmsnorm import rmsnorm_backward, rmsnorm_forward
from .layers.rope import rope_backward, rope_forward, rope_tables
from .layers.swiglu import swiglu_backward, swiglu_forward
from .tape import Tape, gradient_name

# The family's fields (SPEC 21) this model computes: all of them
IMPLEMENTED = ("norm", "norm_eps", "n_kv_head", "tied", "rope_base", "rotary", "qkv_bias")


def _heads(x, H):
    # (B,T,D) -> (B,H,T,E)
    B, T, D = x.shape
    return x.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)


def _merge(x):
    # (B,H,T,E) -> (B,T,D)
    B, H, T, E = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * E)


# The per-head layers on the model's (B,T,D) tensors, heads side by side

def _rope_forward(x, cos, sin, H):
    # x (B,T,D) -> (B,T,D): each head (B,T,H,E) rotated
    B, T, D = x.shape
    return rope_forward(x.reshape(B, T, H, D // H), cos, sin).reshape(B, T, D)


def _rope_backward(dout, cos, sin, H):
    # dout (B,T,D) -> dx (B,T,D)
    B, T, D = dout.shape
    return rope_backward(dout.reshape(B, T, H, D // H), cos, sin).reshape(B, T, D)


def _attention_forward(q, k, v, H, policy):
    # q (B,T,H*E), k, v (B,T,Hkv*E) -> y (B,T,H*E), the cache (on the (B,H,T,E) views).
    # Grouped heads (SPEC 21): query head h attends with key/value head h // g, g = H / Hkv
    g = q.shape[-1] // k.shape[-1]  # H / Hkv: q is H E wide, k and v Hkv E
    k, v = np.repeat(_heads(k, H // g), g, axis=1), np.repeat(_heads(v, H // g), g, axis=1)
    y, cache = attention_forward(_heads(q, H), k, v, policy)
    return _merge(y), (cache, g)


def _attention_backward(dy, cache, H, policy):
    # dy (B,T,H*E) -> dq (B,T,H*E), dk, dv (B,T,Hkv*E): a shared key/value head's
    # gradient is the sum over its g query heads
    cache, g = cache
    dq, dk, dv = attention_backward(_heads(dy, H), cache, policy)
    if g > 1:
        B, _, T, E = dk.shape
        dk = dk.reshape(B, H // g, g, T, E).sum(axis=2)
        dv = dv.reshape(B, H // g, g, T, E).sum(axis=2)
    return _merge(dq), _merge(dk), _merge(dv)


def _norm(t, config, name, x, w, eps, out):
    # the config's norm (SPEC 3, 21) of x: (out, cache)
    if config.norm_bias:
        return t.op(name, "layernorm", layernorm_forward, x, w[name + ".weight"],
                    w[name + ".bias"], eps, out=out)
    return t.op(name, "rmsnorm", rmsnorm_forward, x, w[name + ".weight"], eps, out=out)


def _norm_backward(t, config, name, dout, cache, g, out):
    # -> dx; the norm's parameter gradients go into g; out: (dx, dweight, dbias) names
    d = gradient_name
    if config.norm_bias:
        dx, g[name + ".weight"], g[name + ".bias"] = t.op(
            name + ".backward", "layernorm_backward", layernorm_backward, dout, cache,
            out=(out, d(name + ".weight"), d(name + ".bias")))
    else:
        dx, g[name + ".weight"] = t.op(name + ".backward", "rmsnorm_backward",
                                       rmsnorm_backward, dout, cache,
                                       out=(out, d(name + ".weight")))
    return dx


def _projection(t, config, name, h, w, policy, out):
    # q, k or v of h: (y, cache), with its bias where qkv_bias is set (SPEC 21)
    if config.qkv_bias:
        return t.op(name, "linear_bias", linear_bias_forward, h, w[name + ".weight"],
                    w[name + ".bias"], policy, out=out)
    return t.op(name, "linear", linear_forward, h, w[name + ".weight"], policy, out=out)


def _projection_backward(t, config, name, dy, cache, g, policy, out):
    # -> dh; the projection's parameter gradients go into g
    d = gradient_name
    if config.qkv_bias:
        dh, g[name + ".weight"], g[name + ".bias"] = t.op(
            name + ".backward", "linear_bias_backward", linear_bias_backward, dy, cache, policy,
            out=(out, d(name + ".weight"), d(name + ".bias")))
    else:
        dh, g[name + ".weight"] = t.op(name + ".backward", "linear_backward", linear_backward,
                                       dy, cache, policy, out=(out, d(name + ".weight")))
    return dh


def _add(*terms):
    # a + b + ..., left to right: the residuals, and the sums of partial gradients
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def model_forward(config: Config, P: np.ndarray, tokens: np.ndarray, policy: str,
                  record: dict | None = None, tape=None):
    """tokens (B,T) -> logits (B,T,V), and the cache for model_backward.
    `record`: a dict that receives each intermediate under its name in the
    project's naming scheme (reference/semantic.py), for debugging. `tape`:
    what makes the layer calls (default: a Tape(record) that runs them)."""
    check_implemented(config, IMPLEMENTED, "reference")
    t = Tape(record) if tape is None else tape
    w = t.parameters(config, P)
    H, Hkv = config.n_head, config.kv_heads
    B, T = tokens.shape
    eps = float(config.norm_eps)
    cos, sin = rope_tables(T, config.rotary_dim, P.dtype, config.rope_base)
    x = t.op("embedding", "embedding", embedding_forward, tokens, w["tok_embedding.weight"],
             out="embedding.out")  # (B,T,D)
    layers = []
    for l in range(config.n_layer):
        p = f"layers.{l}."
        c = {}
        h, c["ln1"] = _norm(t, config, p + "attn_norm", x, w, eps, out=p + "attn_norm.out")
        q, c["q"] = _projection(t, config, p + "attn.q", h, w, policy,
                                out=p + "attn.q_proj")  # (B,T,D)
        k, c["k"] = _projection(t, config, p + "attn.k", h, w, policy,
                                out=p + "attn.k_proj")  # (B,T,Hkv*E)
        v, c["v"] = _projection(t, config, p + "attn.v", h, w, policy, out=p + "attn.v")
        q = t.op(p + "attn.rope_q", "rope", _rope_forward, q, cos, sin, H, out=p + "attn.q")
        k = t.op(p + "attn.rope_k", "rope", _rope_forward, k, cos, sin, Hkv, out=p + "attn.k")
        y, c["attn"] = t.op(p + "attn.core", "attention", _attention_forward, q, k, v, H, policy,
                            out=p + "attn.y")
        y, c["o"] = t.op(p + "attn.o", "linear", linear_forward, y, w[p + "attn.o.weight"],
                         policy, out=p + "attn.out")
        x = t.op(p + "attn.residual", "add", _add, x, y, out=p + "mid")
        h, c["ln2"] = _norm(t, config, p + "mlp_norm", x, w, eps, out=p + "mlp_norm.out")
        g, c["gate"] = t.op(p + "mlp.gate", "linear", linear_forward, h,
                            w[p + "mlp.gate.weight"], policy, out=p + "mlp.gate")  # (B,T,F)
        u, c["up"] = t.op(p + "mlp.up", "linear", linear_forward, h, w[p + "mlp.up.weight"],
                          policy, out=p + "mlp.up")
        a, c["swiglu"] = t.op(p + "mlp.swiglu", "swiglu", swiglu_forward, g, u, out=p + "mlp.h")
        y, c["down"] = t.op(p + "mlp.down", "linear", linear_forward, a,
                            w[p + "mlp.down.weight"], policy, out=p + "mlp.out")  # (B,T,D)
        x = t.op(p + "mlp.residual", "add", _add, x, y, out=p + "out")
        layers.append(c)
    h, ln_f = _norm(t, config, "final_norm", x, w, eps, out="final_norm.out")
    logits, head = t.op("lm_head", "linear", linear_forward, h, w["lm_head.weight"], policy,
                        out="logits")  # (B,T,V); the embedding's weight where tied
    cache = dict(tokens=tokens, layers=layers, ln_f=ln_f, head=head, cos=cos, sin=sin)
    return logits, cache


def model_backward(config: Config, P: np.ndarray, dlogits: np.ndarray, cache, policy: str,
                   record: dict | None = None, tape=None):
    """dlogits (B,T,V) -> G, the gradient of every parameter as a fresh flat
    vector in the registry's layout. `record` and `tape`: as in
    model_forward; the gradient of each named intermediate is
    `layers.3.attn.dq`, ..., of a parameter `layers.3.attn.q.dweight`."""
    t = Tape(record) if tape is None else tape
    d = gradient_name
    g = {}  # each parameter's gradient by name, laid out as G at the end
    H, Hkv = config.n_head, config.kv_heads
    V = dlogits.shape[-1]
    cos, sin = cache["cos"], cache["sin"]

    dh, g["lm_head.weight"] = t.op("lm_head.backward", "linear_backward", linear_backward,
                                   dlogits, cache["head"], policy,
                                   out=("final_norm.dout", "lm_head.dweight"))
    dx = _norm_backward(t, config, "final_norm", dh, cache["ln_f"], g,
                        out=f"layers.{config.n_layer - 1}.dout")
    for l in reversed(range(config.n_layer)):
        p = f"layers.{l}."
        c = cache["layers"][l]
        # x = x + down(swiglu(gate(h), up(h))), h = mlp_norm(x)
        da, g[p + "mlp.down.weight"] = t.op(
            p + "mlp.down.backward", "linear_backward", linear_backward, dx, c["down"], policy,
            out=(p + "mlp.dh", d(p + "mlp.down.weight")))
        dgate, dup = t.op(p + "mlp.swiglu.backward", "swiglu_backward", swiglu_backward, da,
                          c["swiglu"], out=(p + "mlp.dgate", p + "mlp.dup"))
        dh1, g[p + "mlp.gate.weight"] = t.op(
            p + "mlp.gate.backward", "linear_backward", linear_backward, dgate, c["gate"],
            policy, out=(p + "mlp_norm.dout_gate", d(p + "mlp.gate.weight")))
        dh2, g[p + "mlp.up.weight"] = t.op(
            p + "mlp.up.backward", "linear_backward", linear_backward, dup, c["up"], policy,
            out=(p + "mlp_norm.dout_up", d(p + "mlp.up.weight")))
        dh = t.op(p + "mlp_norm.dout_sum", "add", _add, dh1, dh2, out=p + "mlp_norm.dout")
        dxn = _norm_backward(t, config, p + "mlp_norm", dh, c["ln2"], g, out=p + "mlp_norm.dx")
        dx = t.op(p + "mlp.residual.backward", "add", _add, dx, dxn, out=p + "dmid")
        # x = x + o(attention(rope(q(h)), rope(k(h)), v(h))), h = attn_norm(x)
        dy, g[p + "attn.o.weight"] = t.op(
            p + "attn.o.backward", "linear_backward", linear_backward, dx, c["o"], policy,
            out=(p + "attn.dy", d(p + "attn.o.weight")))
        dq, dk, dv = t.op(p + "attn.core.backward", "attention_backward", _attention_backward,
                          dy, c["attn"], H, policy,
                          out=(p + "attn.dq", p + "attn.dk", p + "attn.dv"))
        dq = t.op(p + "attn.rope_q.backward", "rope_backward", _rope_backward, dq, cos, sin, H,
                  out=p + "attn.dq_proj")
        dk = t.op(p + "attn.rope_k.backward", "rope_backward", _rope_backward, dk, cos, sin, Hkv,
                  out=p + "attn.dk_proj")
        dhq = _projection_backward(t, config, p + "attn.q", dq, c["q"], g, policy,
                                   out=p + "attn_norm.dout_q")
        dhk = _projection_backward(t, config, p + "attn.k", dk, c["k"], g, policy,
                                   out=p + "attn_norm.dout_k")
        dhv = _projection_backward(t, config, p + "attn.v", dv, c["v"], g, policy,
                                   out=p + "attn_norm.dout_v")
        dh = t.op(p + "attn_norm.dout_sum", "add", _add, dhq, dhk, dhv, out=p + "attn_norm.dout")
        dxn = _norm_backward(t, config, p + "attn_norm", dh, c["ln1"], g, out=p + "attn_norm.dx")
        # the gradient of the layer's input x: the previous layer's output
        dx = t.op(p + "attn.residual.backward", "add", _add, dx, dxn,
                  out=f"layers.{l - 1}.dout" if l else "embedding.dout")
    if config.tied:  # the unembedding gradient plus the gather gradient
        gather = t.op("embedding.backward", "embedding_backward", embedding_backward, dx,
                      cache["tokens"], V, out="tok_embedding.dweight_gather")
        g["tok_embedding.weight"] = t.op("tok_embedding.dweight_sum", "add", _add,
                                         g["lm_head.weight"], gather, out="tok_embedding.dweight")
    else:  # untied (SPEC 21): the gather gradient alone
        g["tok_embedding.weight"] = t.op("embedding.backward", "embedding_backward",
                                         embedding_backward, dx, cache["tokens"], V,
                                         out="tok_embedding.dweight")
    return t.flatten(config, g, P)


def loss_forward(logits, targets, tape=None):
    """-> row losses (B,T) and the cache for loss_backward."""
    t = Tape() if tape is None else tape
    return t.op("loss", "crossentropy", crossentropy_forward, logits, targets, out="row_losses")


def loss_backward(ce_cache, n_rows, dtype, tape=None):
    """Gradient of the mean over n_rows rows -> dlogits (B,T,V)."""
    t = Tape() if tape is None else tape
    probs, targets = ce_cache
    dce = np.full(targets.shape, 1.0 / n_rows, dtype=dtype)
    return t.op("loss.backward", "crossentropy_backward", crossentropy_backward, dce, ce_cache,
                out="dlogits")
