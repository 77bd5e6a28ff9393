"""The model's launch sequence on CUDA: the forward and backward of the
step as kernel launches (accelerated/cuda/<family>.py) and cuBLAS products
over the buffers (accelerated/cuda/buffers.py), in the reference's
order (reference/model.py), each command tagged with the semantic
operations it lowers (reference/semantic.py)."""

from __future__ import annotations

import numpy as np

from ...reference.config import LAYERNORM_EPS, Config
from ...reference.params import registry

from . import attention, cudnn_attention
from .buffers import Activations, Gradient, StepBuffers, _ptr, step_layout
from .launch import fused_head_dim
from .memory_plan import VirtualArray

EPS = np.float32(float(LAYERNORM_EPS))  # the default norm_eps; a model's own is Model.eps


class Model:
    """The step's kernels and products over the program's buffers."""

    def __init__(self, config: Config, precision: str, kernels, blas, P, Pop, G, cos, sin,
                 norms, qkv_weights=None, qkv_offsets=None):
        self.config, self.precision = config, precision
        self.norm_offsets = norms  # (2L+1,) int64 on the device: see norm_offsets()
        self.k, self.blas = kernels, blas
        self.P, self.Pop = P, Pop  # Pop: the parameters as operands (Pb or P)
        self.G = G  # Gradient
        self.cos, self.sin = cos, sin  # (T, R/2): R = config.rotary_dim, E unless rotary < 1
        self.op = "bfloat16" if precision == "bf16" else "float32"  # cuBLAS type of operands
        # the fused q/k/v and gate/up columns and the parameters' offsets
        # (reference/layout.py, buffers.step_layout): every width and column
        # below is the layout's
        self.layout = step_layout(config)
        self.layers = self.layout.layers
        self.eps = np.float32(float(config.norm_eps))
        self.scale = attention.attention_scale(config.head_dim)
        D = config.d_model
        V = config.vocab
        reg = registry(config)
        self.emb = reg["tok_embedding.weight"].offset  # (V, D)
        # the logits' weight (V, D): lm_head.weight, the embedding's own where tied (an alias)
        self.head = reg["lm_head.weight"].offset
        self.final_norm = self.layout.final_norm
        self.G_emb = G.view(self.emb, V * D).reshape(V, D)
        # qkv_bias (SPEC 21): per layer, (columns of the q | k | v row, weight
        # offset, bias offset) of q, k and v, whose weights are not adjacent
        # in P: the products read them gathered into one matrix per layer,
        # qkv_weights (L, qkv_width * D) operands (buffers.allocate_state);
        # None: one product over the fused weights of P
        lay = self.layout
        self.qkv_parts = [tuple((cols, reg[f"layers.{l}.attn.{part}.weight"].offset,
                                 reg[f"layers.{l}.attn.{part}.bias"].offset)
                                for part, cols in zip("qkv", (lay.q, lay.k, lay.v)))
                          for l in range(config.n_layer)] if config.qkv_bias else None
        self.qkv_weights, self.qkv_offsets = qkv_weights, qkv_offsets
        assert (qkv_weights is None) == (self.qkv_parts is None)
        self.tap = None  # debugging: tap(name, buffer, part) sees the backward's intermediates

    def at(self, *operations):
        """The semantic operations (reference/semantic.py) the next commands
        lower, recorded with them while a command log is kept (the memory
        plan's dry run, the capture's count); nothing otherwise."""
        if self.k.log is not None:
            self.k.log.operations = operations

    def _tap(self, name, buffer, part=None):
        # activations(): the backward reuses its buffers layer after layer,
        # so an eager debugging step reads each intermediate as it is made
        # (part: the layout's Columns of the buffer's rows). Never set on the
        # captured program: a tap reads the device, which a capture forbids.
        if self.tap is not None:
            self.tap(name, buffer, part)

    def norm(self, offset):
        # (weight, bias) views of P for a norm whose weight starts at offset;
        # the layout checked that the bias follows the weight (None: rmsnorm's)
        D = self.config.d_model
        bias = self.P[offset + D:offset + 2 * D] if self.layout.norm_bias else None
        return self.P[offset:offset + D], bias

    def norm_forward(self, x_prev, add, x_out, h, mean, rstd, offset) -> None:
        """x_prev (+ add -> x_out, the residual) (rows,D) -> h (rows,D)
        operand, the row statistics (mean: layernorm's only), by the config's
        norm (SPEC 3, 21) with the weight (and bias) at offset into P."""
        weight, bias = self.norm(offset)
        if self.layout.norm_bias:
            self.k.layernorm_forward(x_prev, add, x_out, h, mean, rstd, weight, bias, self.eps)
        else:
            self.k.rmsnorm_forward(x_prev, add, x_out, h, rstd, weight, self.eps)

    def norm_backward(self, dout, dres, x, mean, rstd, offset, dx, dx_op, partials,
                      h=None) -> None:
        """dout (rows,D) -> dx (+ dres), dx_op, the weight (and bias) partials,
        and (h: not None) the forward's h again, by the config's norm."""
        weight, bias = self.norm(offset)
        if self.layout.norm_bias:
            self.k.layernorm_backward(dout, dres, x, mean, rstd, weight, dx, dx_op, partials,
                                      **({} if h is None else {"b": bias, "h": h}))
        else:
            self.k.rmsnorm_backward(dout, dres, x, rstd, weight, dx, dx_op, partials, h=h)

    def operand(self, a, a_op):
        """The operand form of a float32 buffer: its bfloat16 copy under bf16."""
        return a_op if a_op is not None else a

    # -- products -------------------------------------------------------------

    def gemm(self, trans_a, trans_b, m, n, k, A, lda, B, ldb, C, ldc, c_type="float32", **kw):
        self.blas.gemm(trans_a, trans_b, m, n, k, A, lda, B, ldb, C, ldc, ab_type=self.op,
                       c_type=c_type, **kw)

    def linear_forward(self, x, W, out, n_out, n_in):
        # x (rows, in) operand, W at offset into Pop (out, in) -> out (rows, out) = x @ W.T
        self.gemm(False, True, x.shape[0], n_out, n_in, _ptr(x), n_in, _ptr(self.Pop, W),
                  n_in, _ptr(out), n_out)

    def linear_backward(self, dy, x, W, dx, n_out, n_in):
        # dy (rows, out) operand -> dx (rows, in) = dy @ W ; G[W] (out, in) = dy.T @ x
        self.linear_backward_input(dy, W, dx, n_out, n_in)
        self.linear_backward_weight(dy, x, W, n_out, n_in)

    def linear_backward_input(self, dy, W, dx, n_out, n_in):
        # dy (rows, out) operand -> dx (rows, in) = dy @ W
        self.gemm(False, False, dy.shape[0], n_in, n_out, _ptr(dy), n_out, _ptr(self.Pop, W),
                  n_in, _ptr(dx), n_in)

    def linear_backward_weight(self, dy, x, W, n_out, n_in, beta=0.0):
        # dy (rows, out), x (rows, in) operands -> G[W] (out, in) = dy.T @ x (+ beta G[W])
        self.gemm(True, False, n_out, n_in, dy.shape[0], _ptr(dy), n_out, _ptr(x), n_in,
                  self.G.ptr(W), n_in, beta=beta)

    # -- forward ----------------------------------------------------------------

    def forward(self, a: Activations, ids, ids_stride: int) -> None:
        """ids (B, ids_stride) int32, the first T of each row the inputs ->
        a.hf (BT, D), the final norm's output, every activation of the
        backward kept in a (with recompute block, each layer's input x[l]:
        the backward does the rest again); an eager forward's a
        (train=False) also gets the whole logits (BT, V). The step's logits
        are classifier_loss()'s, by chunks."""
        c, k = self.config, self.k
        L, D, V = c.n_layer, c.d_model, c.vocab
        T = a.T
        if self.qkv_parts is not None:
            # the q, k, v weights side by side, from the operands of P as they are now
            self.at(*(f"layers.{l}.attn.{part}" for l in range(L) for part in "qkv"))
            k.linear_bias_gather_weights(self.Pop, self.qkv_weights, self.qkv_offsets,
                                         [[w for _, w, _ in parts] for parts in self.qkv_parts],
                                         [cols.width * D for cols, _, _ in self.qkv_parts[0]])
        self.at("embedding")
        k.embedding_forward(ids, ids_stride, T, self.P[self.emb:self.emb + V * D].reshape(V, D),
                            a.x[0])
        for l in range(L):
            self.layer_forward(a, l)
        # x[L] = x_mid + down(...) ; logits = final_norm(x[L]) W_head^T
        self.at(f"layers.{L - 1}.mlp.residual", "final_norm")
        self.norm_forward(a.x_mid[L - 1], a.proj, a.x[L], a.hf, a.meanf, a.rstdf,
                          self.final_norm)
        if not a.train:
            self.at("lm_head")
            self.linear_forward(a.hf, self.head, a.logits, V, D)

    def layer_forward(self, a: Activations, l: int, again: bool = False) -> None:
        """Layer l's forward: a.x_mid[l-1] + a.proj (the previous layer's
        residual add; a.x[0] for layer 0) -> a.x[l], and through the layer
        to a.proj, its MLP's output (the next residual add's). again=True
        (recompute block, in the backward): from a.x[l] as kept, by the same
        kernels and products on the same arguments (the forward's bits),
        everything the layer's backward reads (its norms' statistics, q | k
        | v, the attention's, y, x_mid, the gate and up products), the norms'
        outputs into a.h_back; not the SwiGLU and down product, whose output
        the backward does not read (it writes a again itself)."""
        c, k, lay, w = self.config, self.k, self.layout, self.layers[l]
        D, T = c.d_model, a.T
        p = f"layers.{l}."
        tap = (lambda *args: None) if again else self._tap  # seen once, in the forward
        h = a.h_back if again else a.h
        # h = attn_norm(x), after the previous layer's residual add
        if again:
            self.at(p + "attn_norm")
            self.norm_forward(a.x[l], None, None, h, a.mean1[l], a.rstd1[l], w.attn_norm)
        else:
            prev, add = (a.x[0], None) if l == 0 else (a.x_mid[l - 1], a.proj)
            self.at(*([f"layers.{l - 1}.mlp.residual"] if l else []), p + "attn_norm")
            self.norm_forward(prev, add, a.x[l] if l else None, h, a.mean1[l], a.rstd1[l],
                              w.attn_norm)
        tap(p + "attn_norm.out", h)
        if not self.qkv_rope(h, l, a.qkv[l], T, p):
            self.at(p + "attn.q", p + "attn.k", p + "attn.v")
            self.qkv_forward(h, l, a.qkv32)  # (BT,qkv)
            self.at(p + "attn.rope_q", p + "attn.rope_k")
            k.rope_forward(a.qkv32, a.qkv[l], self.cos, self.sin, T, lay.heads, lay.kv_heads)
        self.at(p + "attn.core")
        self.attention_forward(a, l)  # -> a.y[l] (BT,D)
        self.at(p + "attn.o")
        self.linear_forward(a.y[l], w.o, a.proj, D, D)
        # x_mid = x + y Wo^T ; h = mlp_norm(x_mid)
        self.at(p + "attn.residual", p + "mlp_norm")
        later = not again and self.gate_up_later(a, l)
        if later:  # h kept for the backward, which computes g and u again from it
            h = a.h_mlp[l]
        self.norm_forward(a.x[l], a.proj, a.x_mid[l], h, a.mean2[l], a.rstd2[l], w.mlp_norm)
        tap(p + "mlp_norm.out", h)
        if later:
            done = self.gate_up_swiglu(h, w.gate_up, None, a.a, p)
            assert done, "gate_up_later: the products' rule takes the a-only kernel"
        elif again or not self.gate_up_swiglu(h, w.gate_up, a.gu[l], a.a, p):
            self.at(p + "mlp.gate", p + "mlp.up")
            self.linear_forward(h, w.gate_up, a.gu[l], lay.gate_up_width, D)  # (BT,2F)
            if again:
                return
            self.at(p + "mlp.swiglu")
            k.swiglu_forward(a.gu[l], a.a)
        tap(p + "mlp.h", a.a)
        self.at(p + "mlp.down")
        self.linear_forward(a.a, w.down, a.proj, D, c.d_ff)

    def gate_up_later(self, a: Activations, l: int) -> bool:
        """Whether layer l's gate and up products are computed again inside
        the SwiGLU backward's kernel (products.py, gate_up_again): then the
        forward keeps each layer's mlp norm output h (a.h_mlp), an operand,
        instead of the float32 gate/up product (D bfloat16 against 2F float32
        a row: 8 against 92 MB a layer on the coppelius preset at B = 8), and
        the layer's norm backward does not write h again. Not with
        recompute (its own scheme), nor while an eager debugging step taps
        the values in between."""
        return a.recompute is None and self.tap is None \
            and hasattr(self.blas, "gate_up_again") \
            and self.blas.gate_up_again(a.B * a.T, self.config.d_ff, self.config.d_model,
                                        _ptr(self.Pop, self.layers[l].gate_up),
                                        _ptr(self.Pop, self.layers[l].down))

    def gate_up_swiglu(self, h, W, gu, out, p: str) -> bool:
        """gu = h W^T (the gate and up products) and out = silu(g) * u in
        one kernel, where the products choose it (products.py): True if
        done. gu None (gate_up_later): out alone."""
        if not hasattr(self.blas, "gemm_swiglu"):
            return False
        self.at(p + "mlp.gate", p + "mlp.up", p + "mlp.swiglu")
        D = self.config.d_model
        return self.blas.gemm_swiglu(h.shape[0], self.config.d_ff, D, _ptr(h), D,
                                     _ptr(self.Pop, W), D, 0 if gu is None else _ptr(gu),
                                     _ptr(out))

    def down_dswiglu(self, dres, W, gu, a: Activations, p: str) -> bool:
        """da = dres W_down and from it a.dgu and a.a_back (the swiglu
        backward's, gu (BT,2F) read) in one kernel, where the products
        choose it (products.py): True if done."""
        if not hasattr(self.blas, "gemm_dswiglu"):
            return False
        self.at(p + "mlp.down.backward", p + "mlp.swiglu.backward", p + "mlp.swiglu")
        D, F = self.config.d_model, self.config.d_ff
        return self.blas.gemm_dswiglu(dres.shape[0], F, D, _ptr(dres), D, _ptr(self.Pop, W), F,
                                      _ptr(gu), _ptr(a.dgu), _ptr(a.a_back))

    def down_dswiglu_again(self, dres, W, h, W_gu, a: Activations, p: str) -> bool:
        """down_dswiglu's with g | u = h W_gu^T computed again in the same
        kernel (the forward's bits) instead of read (gate_up_later): True if
        done."""
        self.at(p + "mlp.down.backward", p + "mlp.swiglu.backward", p + "mlp.swiglu",
                p + "mlp.gate", p + "mlp.up")
        D, F = self.config.d_model, self.config.d_ff
        return self.blas.gemm_dswiglu_again(dres.shape[0], F, D, _ptr(dres), D,
                                            _ptr(self.Pop, W), F, _ptr(h), D,
                                            _ptr(self.Pop, W_gu), D, _ptr(a.dgu),
                                            _ptr(a.a_back))

    def qkv_rope(self, h, l: int, out, T: int, p: str) -> bool:
        """out (BT,qkv) operands = rope(h Wqkv^T), no float32 q | k | v
        between, in one kernel where the products choose it (products.py;
        not with q, k, v biases, which come between): True if done."""
        if not hasattr(self.blas, "gemm_rope") or self.qkv_parts is not None:
            return False
        self.at(p + "attn.q", p + "attn.k", p + "attn.v", p + "attn.rope_q", p + "attn.rope_k")
        lay, D = self.layout, self.config.d_model
        W = lay.qkv_width
        E = fused_head_dim(W, "qkv", lay.heads, lay.kv_heads)
        return self.blas.gemm_rope(h.shape[0], W, D, _ptr(h), D, self.qkv_matrix(l), D,
                                   _ptr(out), W, _ptr(self.cos), _ptr(self.sin), T,
                                   lay.heads + lay.kv_heads, E, 2 * self.cos.shape[1])

    def qkv_matrix(self, l: int) -> int:
        """The address of layer l's (qkv, D) q | k | v weight operands: in P
        (adjacent there), or gathered (qkv_bias)."""
        if self.qkv_parts is None:
            return _ptr(self.Pop, self.layers[l].qkv)
        return _ptr(self.qkv_weights, l * self.qkv_weights.shape[1])

    def qkv_forward(self, h, l: int, out) -> None:
        """h (BT,D) operand -> out (BT,qkv) float32: the q | k | v products of
        layer l, one product over the (qkv, D) weights; with qkv_bias the
        biases then added in float32 (SPEC 6: only the products' operands
        are rounded)."""
        D, W = self.config.d_model, self.layout.qkv_width
        self.gemm(False, True, h.shape[0], W, D, _ptr(h), D, self.qkv_matrix(l), D, _ptr(out), W)
        if self.qkv_parts is not None:
            bq, bk, bv = (self.P[b:b + cols.width] for cols, _, b in self.qkv_parts[l])
            self.k.linear_bias_forward(out, bq, bk, bv, self.layout.k.start,
                                       self.layout.v.start)

    def qkv_backward(self, a: Activations, l: int) -> None:
        """a.dqkv (BT,qkv) operands, the gradients of the q | k | v products
        -> a.dh (BT,D) = dq Wq + dk Wk + dv Wv, and with qkv_bias the biases'
        gradients, the column sums of dq, dk, dv, in a fixed order: of
        a.dqkv as the step keeps it, so under bf16 of the bfloat16 operands
        the rope's and attention's backward write (no path keeps a float32
        dv, and cuDNN's dq, dk are bfloat16 already). The weights' gradients
        (which read h, written again by the norm's backward) are
        qkv_backward_weight's."""
        D, W, lay = self.config.d_model, self.layout.qkv_width, self.layout
        # the sum inside one (BT,qkv) x (qkv,D) product
        self.gemm(False, False, a.dh.shape[0], D, W, _ptr(a.dqkv), W, self.qkv_matrix(l), D,
                  _ptr(a.dh), D)
        if self.qkv_parts is None:
            return
        self.k.linear_bias_backward(a.dqkv, a.bias_partials)
        self.k.linear_bias_param_grads(a.bias_partials, *(self.G.view(b, cols.width)
                                                          for cols, _, b in self.qkv_parts[l]),
                                       lay.k.start, lay.v.start)

    def qkv_backward_weight(self, dqkv, h, l: int) -> None:
        """dqkv (BT,qkv), h (BT,D) operands -> G of the q, k, v weights: dqkv^T h,
        one product where they are adjacent in G, else (qkv_bias) one each."""
        D, W = self.config.d_model, self.layout.qkv_width
        if self.qkv_parts is None:
            self.linear_backward_weight(dqkv, h, self.layers[l].qkv, W, D)
            return
        for cols, weight, _ in self.qkv_parts[l]:
            self.gemm(True, False, cols.width, D, dqkv.shape[0], _ptr(dqkv, cols.start), W,
                      _ptr(h), D, self.G.ptr(weight), D)

    def classifier_loss(self, a: Activations, ids, ids_stride: int, ce, dce,
                        backward: bool = True) -> None:
        """a.hf (BT, D) -> the row losses ce (BT), a.dh (BT, D) the gradient
        at hf, and the head's gradient G_head (lm_head.weight's, or where
        tied the unembedding part of G_emb), for the mean's gradient dce, by
        chunks of a.logits' rows: each chunk's logits = hf W_head^T into
        a.logits, the cross-entropy on them writes the chunk's rows of ce
        and its logits gradient into a.dlogits, then dh's rows = dlogits
        W_head and G_head += dlogits^T hf's rows (the first chunk writes
        G_head, the others add: float32 sums, in chunk order); with
        backward=False (the evaluation) the row losses only. Neither
        the float32 logits nor dlogits are ever whole. A row's logits and dh
        are products over that row alone, but cuBLAS may choose another
        algorithm for another number of rows; the results agree with the
        whole products within SPEC 14 (and are the same run after run)."""
        V, D = self.config.vocab, self.config.d_model
        BT, rows = a.B * a.T, a.logits.shape[0]
        for r0 in range(0, BT, rows):
            n = min(rows, BT - r0)
            logits, dlogits, hf = a.logits[:n], a.dlogits[:n], a.hf[r0:r0 + n]
            self.at("lm_head")
            self.linear_forward(hf, self.head, logits, V, D)
            self._tap("logits", logits)
            self.at("loss", "loss.backward")
            self.k.crossentropy_forward_backward(logits, ids, ids_stride, a.T, ce[r0:r0 + n],
                                                 dlogits, dce, row0=r0)
            if not backward:
                continue
            self._tap("dlogits", dlogits)
            # logits = hf W_head^T: dhf = dlogits W_head, and G_head
            self.at("lm_head.backward")
            self.linear_backward_input(dlogits, self.head, a.dh[r0:r0 + n], V, D)
            self.linear_backward_weight(dlogits, hf, self.head, V, D,
                                        beta=0.0 if r0 == 0 else 1.0)

    def attention_forward(self, a: Activations, l: int) -> None:
        """a.qkv[l] (BT,qkv) -> a.y[l] (BT,D); kept for the backward: a.att[l]
        (B,H,T,T) probabilities, or the fused kernels' a.att_m[l], a.att_l[l]
        (B,H,T) row maxima and sums. Query head h attends with key/value
        head h // g, g = H / Hkv (SPEC 21)."""
        c, lay = self.config, self.layout
        B, T, D, H, E = a.B, a.T, c.d_model, c.n_head, c.head_dim
        Hkv, g = lay.kv_heads, lay.heads // lay.kv_heads
        W, K, Vc = lay.qkv_width, lay.k.start, lay.v.start  # the qkv row, k's and v's columns
        if a.path.kind == "cudnn":
            qkv = a.qkv[l]
            self._cudnn("forward", a, (_ptr(qkv), _ptr(qkv, K), _ptr(qkv, Vc), _ptr(a.y[l]),
                                       _ptr(a.att_stats[l])))
            return
        if a.fused:
            self.k.attention_forward(a.qkv[l], a.y[l], a.att_m[l], a.att_l[l], B, T, H, Hkv,
                                     self.scale)
            return
        qkv, att, y = a.qkv[l], a.att[l], a.y[l]
        # one strided batched product per batch element and member i of the
        # groups, over the Hkv key/value heads: query head h = kv g + i, at
        # column h*E of q, y and at (b, h) of att, with key/value head kv
        # (g = 1: one product over the H heads)
        for b in range(B):
            for i in range(g):
                q, kk = _ptr(qkv, b * T * W + i * E), _ptr(qkv, b * T * W + K)
                # s_h (T,T) = q_h (T,E) @ k_kv^T
                self.gemm(False, True, T, T, E, q, W, kk, W, _ptr(att, (b * H + i) * T * T), T,
                          batch=Hkv, stride_a=g * E, stride_b=E, stride_c=g * T * T)
        self.k.attention_softmax_forward(att, a.att_op, self.scale)
        p = self.operand(att, a.att_op)
        for b in range(B):
            for i in range(g):
                v = _ptr(qkv, b * T * W + Vc)
                # y_h (T,E) = p_h (T,T) @ v_kv, at column h*E of y
                self.gemm(False, False, T, E, T, _ptr(p, (b * H + i) * T * T), T, v, W,
                          _ptr(y, b * T * D + i * E), D, c_type=self.op, batch=Hkv,
                          stride_a=g * T * T, stride_b=E, stride_c=g * E)

    # -- loss and backward --------------------------------------------------------

    def backward(self, a: Activations, ids, ids_stride: int, rows: int | None = None,
                 ce=None) -> None:
        """Logits (by chunks: classifier_loss()), row losses, mean loss and every
        parameter's gradient into G, after forward(). A
        micro-batch of an accumulated step (SPEC 19) passes `rows`, the
        whole batch's B*T (its gradient is scaled by 1/rows), and `ce`, its
        slice of the whole batch's row losses; it computes no mean loss."""
        c, k, lay = self.config, self.k, self.layout
        L, D, F = c.n_layer, c.d_model, c.d_ff
        T, BT = a.T, a.B * a.T
        a = a.for_backward()  # recompute block: its own buffers of one layer's forward
        dce = np.float32(1.0 / (BT if rows is None else rows))  # d mean / d ce: float32 1/n
        # the logits, row losses, dh and the head's gradient, by chunks of rows
        self.classifier_loss(a, ids, ids_stride, a.ce if ce is None else ce, dce)
        if rows is None:
            self.at("loss.mean")
            k.mean_loss(a.ce, a.loss)
        self._tap("final_norm.dout", a.dh)
        dres_op = self.operand(a.dres, a.dres_op)
        self.at("final_norm.backward")
        self.norm_backward(a.dh, None, a.x[L], a.meanf, a.rstdf, self.final_norm, a.dres,
                           a.dres_op, a.ln_partials[2 * L])
        for l in reversed(range(L)):
            w = self.layers[l]
            p = f"layers.{l}."
            self._tap(p + "dout", a.dres)
            if a.recompute == "block":
                # the layer's forward again from its input x[l], into the
                # backward's buffers of one layer, for the backward below
                self.layer_forward(a, l, again=True)
            # x[l+1] = x_mid + down(silu(gate(h)) * up(h)), h = mlp_norm(x_mid)
            gu = a.gu[l]
            if a.recompute == "gate-up":
                # h = mlp_norm(x_mid) and g, u = h Wgate^T, h Wup^T again, by
                # the forward's kernel and product: the forward's bits
                self.at(p + "mlp_norm", p + "mlp.gate", p + "mlp.up")
                self.norm_forward(a.x_mid[l], None, None, a.h_back, a.mean2[l], a.rstd2[l],
                                  w.mlp_norm)
                self.linear_forward(a.h_back, w.gate_up, a.gu_back, lay.gate_up_width, D)
                gu = a.gu_back
            # a = silu(g) * u is not kept per layer: da = dres Wdown first, then
            # the swiglu backward writes a again (the forward's bits) for the
            # down weight's gradient dres^T a; in one kernel where the
            # products choose it (no float32 da; not while an eager debugging
            # step taps da), with g and u computed again in it from the kept
            # h where gate_up_later holds
            later = self.gate_up_later(a, l)
            if later:
                done = self.down_dswiglu_again(dres_op, w.down, a.h_mlp[l], w.gate_up, a, p)
                assert done, "gate_up_later: the products' rule takes the again kernel"
            elif self.tap is not None or not self.down_dswiglu(dres_op, w.down, gu, a, p):
                self.at(p + "mlp.down.backward")
                self.linear_backward_input(dres_op, w.down, a.da, D, F)
                self._tap(p + "mlp.dh", a.da)
                self.at(p + "mlp.swiglu.backward", p + "mlp.swiglu")
                k.swiglu_backward(a.da, gu, a.dgu, a.a_back)
            self.at(p + "mlp.down.backward")
            self.linear_backward_weight(dres_op, a.a_back, w.down, D, F)
            self._tap(p + "mlp.dgate", a.dgu, lay.gate)
            self._tap(p + "mlp.dup", a.dgu, lay.up)
            # dh = dh_gate + dh_up: the sum inside one (BT,2F) x (2F,D) product;
            # h = mlp_norm(x_mid) is not kept per layer either: the norm's
            # backward writes it again (the forward's bits) for the gate and up
            # weights' gradient dgu^T h
            self.at(p + "mlp.gate.backward", p + "mlp.up.backward", p + "mlp_norm.dout_sum")
            self.linear_backward_input(a.dgu, w.gate_up, a.dh, lay.gate_up_width, D)
            self._tap(p + "mlp_norm.dout", a.dh)
            self.at(p + "mlp_norm.backward", p + "mlp.residual.backward",
                    *(() if a.recompute or later else (p + "mlp_norm",)))
            # (with recompute h_back holds h already: the gate and up
            # products' operand, from the recompute above; gate_up_later: h
            # kept from the forward)
            h_mlp = a.h_mlp[l] if later else a.h_back
            self.norm_backward(a.dh, a.dres, a.x_mid[l], a.mean2[l], a.rstd2[l], w.mlp_norm,
                               a.dres, a.dres_op, a.ln_partials[2 * l + 1],
                               h=None if a.recompute or later else h_mlp)
            self.at(p + "mlp.gate.backward", p + "mlp.up.backward")
            self.linear_backward_weight(a.dgu, h_mlp, w.gate_up, lay.gate_up_width, D)
            self._tap(p + "dmid", a.dres)
            # x_mid = x + o(attention(rope(q(h)), rope(k(h)), v(h))), h = attn_norm(x)
            self.at(p + "attn.o.backward")
            self.gemm(False, False, BT, D, D, _ptr(dres_op), D, _ptr(self.Pop, w.o), D,
                      _ptr(a.dy), D, c_type=self.op)  # dy = dres Wo, an operand only
            self.gemm(True, False, D, D, BT, _ptr(dres_op), D, _ptr(a.y[l]), D, self.G.ptr(w.o),
                      D)
            self._tap(p + "attn.dy", a.dy)
            self.at(p + "attn.core.backward")
            self.attention_backward(a, l)  # -> a.dqkv (BT,qkv)
            # dh = dh_q + dh_k + dh_v (and the q, k, v biases' gradients)
            # (h = attn_norm(x) written again by the norm's backward, as above)
            self.at(p + "attn.q.backward", p + "attn.k.backward", p + "attn.v.backward",
                    p + "attn_norm.dout_sum")
            self.qkv_backward(a, l)
            self._tap(p + "attn_norm.dout", a.dh)
            self.at(p + "attn_norm.backward", p + "attn.residual.backward", p + "attn_norm")
            self.norm_backward(a.dh, a.dres, a.x[l], a.mean1[l], a.rstd1[l], w.attn_norm,
                               a.dres, a.dres_op, a.ln_partials[2 * l], h=a.h_back)
            self.at(p + "attn.q.backward", p + "attn.k.backward", p + "attn.v.backward")
            self.qkv_backward_weight(a.dqkv, a.h_back, l)
        self._tap("embedding.dout", a.dres)
        if c.tied:  # the gather gradient, added to the unembedding gradient already in G_emb
            self.at("embedding.backward", "tok_embedding.dweight_sum")
        else:  # untied (SPEC 21): the gather gradient alone
            self.at("embedding.backward")
        k.embedding_backward(a.dres, ids, ids_stride, T, self.G_emb, a.emb_index,
                             accumulate=c.tied)
        # every norm's weight (and bias) gradients, reduced from their partials at once
        self.at("final_norm.backward", *(f"layers.{l}.{norm}.backward" for l in range(L)
                                         for norm in ("attn_norm", "mlp_norm")))
        k.layernorm_param_grads(a.ln_partials, a.ln_table, self.norm_offsets, self.G)

    def attention_backward(self, a: Activations, l: int) -> None:
        """a.dy (BT,D) -> a.dqkv (BT,qkv): dq, dk through rope, and dv; the
        dk, dv of a key/value head are the sums over its g query heads."""
        c, lay = self.config, self.layout
        B, T, D, H, E = a.B, a.T, c.d_model, c.n_head, c.head_dim
        Hkv, g = lay.kv_heads, lay.heads // lay.kv_heads
        W, K, Vc = lay.qkv_width, lay.k.start, lay.v.start  # the qkv row, k's and v's columns
        if a.path.kind == "cudnn":
            # q, k, v, y, dy, stats -> dq, dk (into dqk), dv (into dqkv's v columns)
            qkv = a.qkv[l]
            self._cudnn("backward", a, (_ptr(qkv), _ptr(qkv, K), _ptr(qkv, Vc), _ptr(a.y[l]),
                                        _ptr(a.dy), _ptr(a.att_stats[l]), _ptr(a.dqk),
                                        _ptr(a.dqk, K), _ptr(a.dqkv, Vc)))
            self._rope_backward(a, l)
            return
        if a.fused:
            self.k.attention_backward(a.qkv[l], a.y[l], a.dy, a.att_m[l], a.att_l[l], a.att_dot,
                                      a.dqk, a.dqkv, B, T, H, Hkv, self.scale)
            self._rope_backward(a, l)
            return
        qkv, att = a.qkv[l], a.att[l]
        # the dqk row: dq, then dk at column K; with g > 1 also dv at column
        # Vc (float32: the sums over each group, rounded once by the rope
        # backward, which copies them into dqkv); with g = 1 dv goes straight
        # into dqkv's v columns, an operand
        QK = a.dqk.shape[1]
        dv, ldv, dv_type = (a.dqk, QK, "float32") if g > 1 else (a.dqkv, W, self.op)
        # the products as in the forward: per batch element and member i of
        # the groups, over the Hkv key/value heads (query head h = kv g + i)
        for b in range(B):
            for i in range(g):
                v = _ptr(qkv, b * T * W + Vc)
                # dp_h (T,T) = dy_h (T,E) @ v_kv^T
                self.gemm(False, True, T, T, E, _ptr(a.dy, b * T * D + i * E), D, v, W,
                          _ptr(a.dp, (b * H + i) * T * T), T, batch=Hkv, stride_a=g * E,
                          stride_b=E, stride_c=g * T * T)
        self.k.attention_softmax_backward(att, a.dp, a.ds, a.att_op, self.scale)
        p = self.operand(att, a.att_op)
        for b in range(B):
            kk = _ptr(qkv, b * T * W + K)
            for i in range(g):
                hh = dict(batch=Hkv, stride_a=g * T * T, stride_b=g * E, stride_c=E)
                first = dict(beta=0.0 if i == 0 else 1.0)  # sums over i, in order
                ph, ds = _ptr(p, (b * H + i) * T * T), _ptr(a.ds, (b * H + i) * T * T)
                # dv_kv (T,E) += p_h^T dy_h
                self.gemm(True, False, T, E, T, ph, T, _ptr(a.dy, b * T * D + i * E), D,
                          _ptr(dv, b * T * ldv + Vc), ldv, c_type=dv_type, **hh, **first)
                # dq_h = ds_h k_kv (T,E), into dqk at column h*E
                self.gemm(False, False, T, E, T, ds, T, kk, W, _ptr(a.dqk, b * T * QK + i * E),
                          QK, batch=Hkv, stride_a=g * T * T, stride_b=E, stride_c=g * E)
                # dk_kv (T,E) += ds_h^T q_h, into dqk at column K + kv*E
                self.gemm(True, False, T, E, T, ds, T, _ptr(qkv, b * T * W + i * E), W,
                          _ptr(a.dqk, b * T * QK + K), QK, **hh, **first)
        self._rope_backward(a, l)

    def _cudnn(self, direction: str, a: Activations, pointers: tuple) -> None:
        """One execution of cuDNN's attention graph for a's shape on the
        addresses `pointers` (cudnn_attention.Graph.tensors' order) with the
        workspace a.att_workspace[direction]; in the memory plan's dry run
        (buffers without storage) only recorded."""
        c = self.config
        g = cudnn_attention.graph(direction, a.B, a.T, c.n_head, c.head_dim, self.scale,
                                  kv_heads=c.kv_heads)
        buffer = a.att_workspace[direction]
        workspace = 0 if buffer is None else _ptr(buffer)
        if self.k.log is not None:
            self.k.log.add("library", f"cudnn_sdpa_{direction}", g.launch(),
                           (*pointers, workspace))
        if not isinstance(a.y[0], VirtualArray):
            g.execute(pointers, workspace)

    def _rope_backward(self, a: Activations, l: int) -> None:
        """a.dqk (BT,qk), the gradients of the rotated q and k (float32, or
        bfloat16 operands as cuDNN writes them), or (BT,qkv) with dv beside
        them (the materialized path's grouped heads) -> a.dqkv's q and k
        (and v) columns."""
        p, lay = f"layers.{l}.", self.layout
        self._tap(p + "attn.dq", a.dqk, lay.q)  # dqk's rows: dq, then dk at k's columns
        self._tap(p + "attn.dk", a.dqk, lay.k)
        # (dv beside dq, dk: the attention backward's sums, copied here too)
        self.at(p + "attn.rope_q.backward", p + "attn.rope_k.backward",
                *((p + "attn.core.backward",) if a.dqk.shape[1] == lay.qkv_width else ()))
        H, Hkv = lay.heads, lay.kv_heads
        if a.dqk.dtype == np.float32:
            self.k.rope_backward(a.dqk, a.dqkv, self.cos, self.sin, a.T, H, Hkv)
        else:
            self.k.rope_backward_operand(a.dqk, a.dqkv, self.cos, self.sin, a.T, H, Hkv)
        self._tap(p + "attn.dv", a.dqkv, lay.v)


def model_for(config: Config, precision: str, kernels, blas, s: StepBuffers,
              G: Gradient) -> Model:
    """The step's Model over the buffers s, its gradient into G."""
    return Model(config, precision, kernels, blas, s.P, s.Pb if s.Pb is not None else s.P, G,
                 s.cos, s.sin, s.norms, s.qkv_weights, s.qkv_offsets)
