"""The model forward (SPEC section 3), loss (section 4) and the hand-written
backward (section 5), composed from the layer functions.

Parameters arrive as the flat vector P; `registry(config).views(P)` gives the
named tensors. The dtype follows P: float32 normally, float64 for the
finite-difference tests (precision policy fp32 only).
"""

from __future__ import annotations

import numpy as np

from .config import Config, check_implemented
from .layers.attention import attention_backward, attention_forward
from .layers.crossentropy import crossentropy_backward, crossentropy_forward
from .layers.embedding import embedding_backward, embedding_forward
from .layers.layernorm import layernorm_backward, layernorm_forward
from .layers.linear import linear_backward, linear_forward
from .layers.rope import rope_backward, rope_forward, rope_tables
from .layers.swiglu import swiglu_backward, swiglu_forward
from .params import registry

# The family's fields (SPEC 21) this model computes; the others are refused
IMPLEMENTED = ("norm_eps", "rope_base")


def _heads(x, H):
    # (B,T,D) -> (B,H,T,E)
    B, T, D = x.shape
    return x.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)


def _merge(x):
    # (B,H,T,E) -> (B,T,D)
    B, H, T, E = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * E)


def model_forward(config: Config, P: np.ndarray, tokens: np.ndarray, policy: str,
                  record: dict | None = None):
    """tokens (B,T) -> logits (B,T,V), and the cache for model_backward.
    `record`: a dict that receives each intermediate under its name in the
    project's naming scheme (reference/semantic.py), for debugging."""
    check_implemented(config, IMPLEMENTED, "reference")
    w = registry(config).views(P)
    H = config.n_head
    B, T = tokens.shape
    keep = record.__setitem__ if record is not None else (lambda name, value: None)
    eps = float(config.norm_eps)
    cos, sin = rope_tables(T, config.head_dim, P.dtype, config.rope_base)
    x = embedding_forward(tokens, w["tok_embedding.weight"])  # (B,T,D)
    keep("embedding.out", x)
    layers = []
    for l in range(config.n_layer):
        p = f"layers.{l}."
        c = {}
        h, c["ln1"] = layernorm_forward(x, w[p + "attn_norm.weight"], w[p + "attn_norm.bias"], eps)
        q, c["q"] = linear_forward(h, w[p + "attn.q.weight"], policy)  # (B,T,D)
        k, c["k"] = linear_forward(h, w[p + "attn.k.weight"], policy)
        v, c["v"] = linear_forward(h, w[p + "attn.v.weight"], policy)
        keep(p + "attn_norm.out", h)
        keep(p + "attn.q_proj", q)
        keep(p + "attn.k_proj", k)
        q = rope_forward(q.reshape(B, T, H, -1), cos, sin).reshape(B, T, -1)
        k = rope_forward(k.reshape(B, T, H, -1), cos, sin).reshape(B, T, -1)
        keep(p + "attn.q", q)
        keep(p + "attn.k", k)
        keep(p + "attn.v", v)
        y, c["attn"] = attention_forward(_heads(q, H), _heads(k, H), _heads(v, H), policy)
        keep(p + "attn.y", _merge(y))
        y, c["o"] = linear_forward(_merge(y), w[p + "attn.o.weight"], policy)
        keep(p + "attn.out", y)
        x = x + y
        keep(p + "mid", x)
        h, c["ln2"] = layernorm_forward(x, w[p + "mlp_norm.weight"], w[p + "mlp_norm.bias"], eps)
        g, c["gate"] = linear_forward(h, w[p + "mlp.gate.weight"], policy)  # (B,T,F)
        u, c["up"] = linear_forward(h, w[p + "mlp.up.weight"], policy)
        a, c["swiglu"] = swiglu_forward(g, u)
        y, c["down"] = linear_forward(a, w[p + "mlp.down.weight"], policy)  # (B,T,D)
        keep(p + "mlp_norm.out", h)
        keep(p + "mlp.gate", g)
        keep(p + "mlp.up", u)
        keep(p + "mlp.h", a)
        keep(p + "mlp.out", y)
        x = x + y
        keep(p + "out", x)
        layers.append(c)
    h, ln_f = layernorm_forward(x, w["final_norm.weight"], w["final_norm.bias"], eps)
    logits, head = linear_forward(h, w["lm_head.weight"], policy)  # (B,T,V), tied weight
    keep("final_norm.out", h)
    keep("logits", logits)
    cache = dict(tokens=tokens, layers=layers, ln_f=ln_f, head=head, cos=cos, sin=sin)
    return logits, cache


def model_backward(config: Config, P: np.ndarray, dlogits: np.ndarray, cache, policy: str,
                   record: dict | None = None):
    """dlogits (B,T,V) -> G, the gradient of every parameter as a fresh flat
    vector in the registry's layout. `record`: as in model_forward, the
    gradient of each named intermediate (`layers.3.attn.dq`, ...)."""

    reg = registry(config)
    G = np.zeros_like(P)
    g = reg.views(G)
    H = config.n_head
    B, T, V = dlogits.shape
    keep = record.__setitem__ if record is not None else (lambda name, value: None)
    cos, sin = cache["cos"], cache["sin"]

    dh, d_head = linear_backward(dlogits, cache["head"], policy)
    keep("final_norm.dout", dh)
    dx, g["final_norm.weight"][...], g["final_norm.bias"][...] = layernorm_backward(dh, cache["ln_f"])
    for l in reversed(range(config.n_layer)):
        p = f"layers.{l}."
        c = cache["layers"][l]
        keep(p + "dout", dx)
        # x = x + down(swiglu(gate(h), up(h))), h = mlp_norm(x)
        da, g[p + "mlp.down.weight"][...] = linear_backward(dx, c["down"], policy)
        dgate, dup = swiglu_backward(da, c["swiglu"])
        dh1, g[p + "mlp.gate.weight"][...] = linear_backward(dgate, c["gate"], policy)
        dh2, g[p + "mlp.up.weight"][...] = linear_backward(dup, c["up"], policy)
        dh = dh1 + dh2
        keep(p + "mlp.dh", da)
        keep(p + "mlp.dgate", dgate)
        keep(p + "mlp.dup", dup)
        keep(p + "mlp_norm.dout", dh)
        dxn, g[p + "mlp_norm.weight"][...], g[p + "mlp_norm.bias"][...] = layernorm_backward(dh, c["ln2"])
        dx = dx + dxn
        keep(p + "dmid", dx)
        # x = x + o(attention(rope(q(h)), rope(k(h)), v(h))), h = attn_norm(x)
        dy, g[p + "attn.o.weight"][...] = linear_backward(dx, c["o"], policy)
        dq, dk, dv = attention_backward(_heads(dy, H), c["attn"], policy)
        keep(p + "attn.dy", dy)
        keep(p + "attn.dq", _merge(dq))
        keep(p + "attn.dk", _merge(dk))
        keep(p + "attn.dv", _merge(dv))
        dq = rope_backward(_merge(dq).reshape(B, T, H, -1), cos, sin).reshape(B, T, -1)
        dk = rope_backward(_merge(dk).reshape(B, T, H, -1), cos, sin).reshape(B, T, -1)
        dh, g[p + "attn.q.weight"][...] = linear_backward(dq, c["q"], policy)
        dhk, g[p + "attn.k.weight"][...] = linear_backward(dk, c["k"], policy)
        dhv, g[p + "attn.v.weight"][...] = linear_backward(_merge(dv), c["v"], policy)
        dh = dh + dhk + dhv
        keep(p + "attn_norm.dout", dh)
        dxn, g[p + "attn_norm.weight"][...], g[p + "attn_norm.bias"][...] = layernorm_backward(dh, c["ln1"])
        dx = dx + dxn
    keep("embedding.dout", dx)
    # tied embedding: the unembedding gradient plus the gather gradient
    g["tok_embedding.weight"][...] = d_head + embedding_backward(dx, cache["tokens"], V)
    return G


def loss_forward(logits, targets):
    """-> row losses (B,T) and the cache for loss_backward."""
    return crossentropy_forward(logits, targets)


def loss_backward(ce_cache, n_rows, dtype):
    """Gradient of the mean over n_rows rows -> dlogits (B,T,V)."""
    probs, targets = ce_cache
    dce = np.full(targets.shape, 1.0 / n_rows, dtype=dtype)
    return crossentropy_backward(dce, ce_cache)
