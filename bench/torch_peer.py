"""The PyTorch peer: the SPEC model (sections 1-7), and every member of its
family (SPEC 21), written plainly in PyTorch, the way a practitioner writes
a Llama-style model, for `coppelius bench` to time the project's backends
against.

Autograd instead of a hand-written backward; `F.layer_norm` or `F.rms_norm`
(float32, the config's eps); `F.scaled_dot_product_attention` (causal) for
attention, grouped-query attention by its `enable_gqa` or by
`repeat_interleave` of the key/value heads (query head h with kv head
h // g either way, see `gqa_idiom`); q/k/v biases in `F.linear`; partial
rotary on the first R elements of each head; an untied `lm_head`;
`torch.optim.AdamW` (fused on CUDA, PyTorch's default foreach on the CPU)
or the hand-written AdamW of SPEC section 7. Same parameter registry, same
initial bits, same inputs; `tests/test_bench.py` checks that its loss,
gradients and updates are the reference's on every family's preset, so the
timings compare like with like.

Two ways to run it: `TorchPeer.step`, eager (what the model costs written
plainly), and `CompiledGraphStep`, PyTorch's fastest training step for it:
`torch.compile` of the loss (forward, and through AOTAutograd its backward)
with the fused AdamW, the whole step captured once as one CUDA graph and
replayed, as the CUDA-graph recipe of PyTorch's documentation does it.

Precision: "fp32" everywhere, or "bf16" as `torch.autocast` (CUDA only):
matrix products and attention in bfloat16 with float32 accumulation, the
rest float32 (the residual stream, the norms, the rotation, the loss) —
PyTorch's usual mixed precision, close to but not exactly SPEC section 6.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from ..reference.config import Config, Hyper
from ..reference.params import registry

GQA_IDIOMS = ("auto", "sdpa", "repeat")


def rope_tables(T: int, R: int, base, device) -> tuple:
    # cos, sin (T, R/2): theta = t * base^(-2j/R) in float64, rounded to float32 (SPEC 3, 21)
    t = np.arange(T, dtype=np.float64)[:, None]
    j = np.arange(R // 2, dtype=np.float64)[None, :]
    theta = t * np.power(float(base), -2.0 * j / R)
    as_tensor = lambda a: torch.from_numpy(a.astype(np.float32)).to(device)  # noqa: E731
    return as_tensor(np.cos(theta)), as_tensor(np.sin(theta))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B,H,T,E), cos/sin (T,R/2): the first R elements of each head rotated,
    # half-split (element j pairs with j + R/2); the other E - R pass through
    R = 2 * cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat([rope(x[..., :R], cos, sin), x[..., R:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def gqa_idiom(gqa: str, precision: str, device) -> str:
    """How the peer gives query head h the key/value head h // g: "sdpa"
    (`enable_gqa=True`: the attention kernel reads each kv head once for its
    g query heads) or "repeat" (`repeat_interleave` of k and v to H heads
    first, Hugging Face's `repeat_kv`). "auto": sdpa, except fp32 on CUDA,
    where PyTorch's only fused fp32 attention (memory-efficient) takes no
    grouped heads and enable_gqa falls back to the unfused math attention,
    slower than the copy."""
    if gqa not in GQA_IDIOMS:
        raise ValueError(f"gqa {gqa!r}: one of {', '.join(GQA_IDIOMS)}")
    if gqa != "auto":
        return gqa
    return "repeat" if torch.device(device).type == "cuda" and precision == "fp32" else "sdpa"


class TorchPeer:
    """One training step of the SPEC model in PyTorch, from a flat float32 P.
    `gqa`: the grouped-query idiom (`gqa_idiom`), where n_kv_head < n_head."""

    def __init__(self, config: Config, P: np.ndarray, hyper: Hyper = Hyper(),
                 precision: str = "fp32", device: str = "cpu", optimizer: str = "torch",
                 capturable: bool = False, gqa: str = "auto"):
        if precision == "bf16" and not str(device).startswith("cuda"):
            raise ValueError("the peer's bf16 is torch.autocast on CUDA; use fp32 on the CPU")
        self.config, self.precision, self.device = config, precision, torch.device(device)
        self.gqa = gqa_idiom(gqa, precision, self.device)
        self.reg = registry(config)
        self.w = {}  # name -> Parameter, the registry's names and shapes
        for spec in self.reg:
            value = np.array(P[spec.slice], dtype=np.float32).reshape(spec.shape)
            self.w[spec.name] = torch.nn.Parameter(torch.from_numpy(value).to(self.device))
        # a float, not the config's Fraction: float(Fraction) inside the forward breaks
        # torch.compile's graph at every norm (and the recompiles by layer name then
        # hit dynamo's limit and leave the rest eager)
        self.eps = float(config.norm_eps)
        self.cos, self.sin = rope_tables(config.context, config.rotary_dim, config.rope_base,
                                         self.device)
        self.hyper = hyper
        self.optimizer = optimizer
        decay = [self.w[s.name] for s in self.reg if s.decay]  # the biases and norms do not
        rest = [self.w[s.name] for s in self.reg if not s.decay]
        groups = [{"params": decay, "weight_decay": float(hyper.weight_decay)},
                  {"params": rest, "weight_decay": 0.0}]
        if optimizer == "torch":
            # fused (one kernel for every tensor) on CUDA, PyTorch's default (foreach) elsewhere
            # capturable: the step count lives on the device, so that a CUDA graph
            # replay advances it and its bias corrections
            fused = True if self.device.type == "cuda" else None
            self.opt = torch.optim.AdamW(groups, lr=float(hyper.lr),
                                         betas=(float(hyper.beta1), float(hyper.beta2)),
                                         eps=float(hyper.epsilon), fused=fused,
                                         capturable=capturable)
        elif optimizer == "hand":
            self.m = {n: torch.zeros_like(p) for n, p in self.w.items()}
            self.v = {n: torch.zeros_like(p) for n, p in self.w.items()}
            self.t = 0
        else:
            raise ValueError(f"optimizer {optimizer!r}: 'torch' or 'hand'")

    # ---------------------------------------------------------------- forward
    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # x (B,T,D) float32: the config's norm, its eps (SPEC 3, 21)
        c, w, eps = self.config, self.w, self.eps
        if c.norm_bias:
            return F.layer_norm(x, (c.d_model,), w[name + ".weight"], w[name + ".bias"], eps)
        return F.rms_norm(x, (c.d_model,), w[name + ".weight"], eps)

    def projection(self, h: torch.Tensor, name: str) -> torch.Tensor:
        # h (B,T,D) -> h @ W^T (+ b where the registry has one: q, k, v with qkv_bias)
        return F.linear(h, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q (B,H,T,E), k, v (B,Hkv,T,E) -> y (B,H,T,E), causal, scale 1/sqrt(E);
        # query head h attends with kv head h // g, g = H / Hkv (SPEC 21)
        g = q.shape[1] // k.shape[1]
        if g == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.gqa == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B,H,T,E)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs (B,T) int64 -> logits (B,T,V)."""
        c, w = self.config, self.w
        B, T = inputs.shape
        H, Hkv, E, D = c.n_head, c.kv_heads, c.head_dim, c.d_model
        cos, sin = self.cos[:T], self.sin[:T]
        heads = lambda y, n: y.view(B, T, n, E).transpose(1, 2)  # noqa: E731  (B,T,nE) -> (B,n,T,E)
        x = w["tok_embedding.weight"][inputs]  # (B,T,D)
        for l in range(c.n_layer):
            p = f"layers.{l}."
            h = self.norm(x, p + "attn_norm")
            q = rope(heads(self.projection(h, p + "attn.q"), H), cos, sin)  # (B,H,T,E)
            k = rope(heads(self.projection(h, p + "attn.k"), Hkv), cos, sin)  # (B,Hkv,T,E)
            v = heads(self.projection(h, p + "attn.v"), Hkv)
            y = self.attention(q, k, v)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, D), w[p + "attn.o.weight"])
            h = self.norm(x, p + "mlp_norm")
            a = F.silu(F.linear(h, w[p + "mlp.gate.weight"])) * F.linear(h, w[p + "mlp.up.weight"])
            x = x + F.linear(a, w[p + "mlp.down.weight"])
        h = self.norm(x, "final_norm")
        head = w["tok_embedding.weight"] if c.tied else w["lm_head.weight"]  # (V,D)
        return F.linear(h, head)  # (B,T,V)

    def row_losses(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,T+1) -> ce (B,T) float32."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            logits = self.forward(tokens[:, :-1])
        B, T, V = logits.shape
        return F.cross_entropy(logits.float().reshape(B * T, V), tokens[:, 1:].reshape(B * T),
                               reduction="none").view(B, T)

    # ---------------------------------------------------------------- step
    def to_tokens(self, tokens) -> torch.Tensor:
        return torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=self.device)

    def loss_and_grads(self, tokens):
        """tokens (B,T+1) -> (mean loss, row losses (B,T), G (N,)) as NumPy, no update."""
        for p in self.w.values():
            p.grad = None
        ce = self.row_losses(self.to_tokens(tokens))
        loss = ce.mean()
        loss.backward()
        G = torch.cat([self.w[s.name].grad.reshape(-1) for s in self.reg])
        return float(loss.detach()), ce.detach().cpu().numpy(), G.cpu().numpy()

    def mean_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,T+1) -> the step's loss, 0-d float32 (what torch.compile compiles)."""
        return self.row_losses(tokens).mean()

    def zero_grad(self) -> None:
        for p in self.w.values():
            p.grad = None

    def step(self, tokens: torch.Tensor, loss_fn=None) -> torch.Tensor:
        """One training step; returns the mean loss as a 0-d tensor (no sync).
        `loss_fn` (tokens -> loss) replaces `mean_loss`: its compiled form."""
        self.zero_grad()
        loss = (loss_fn or self.mean_loss)(tokens)
        loss.backward()
        if self.optimizer == "torch":
            self.opt.step()
        else:
            self._adamw()
        return loss.detach()

    @torch.no_grad()
    def _adamw(self):
        # SPEC section 7, elementwise in float32
        h = self.hyper
        self.t += 1
        b1, b2 = float(h.beta1), float(h.beta2)
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        lr, lrwd, eps = float(h.lr), float(h.lr * h.weight_decay), float(h.epsilon)
        for s in self.reg:
            p, g, m, v = self.w[s.name], self.w[s.name].grad, self.m[s.name], self.v[s.name]
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            if s.decay:
                p.sub_(p * lrwd)
            p.sub_(lr * (m / c1) / (torch.sqrt(v / c2) + eps))

    def parameters_flat(self) -> np.ndarray:
        """P (N,) float32 in the registry's layout."""
        return torch.cat([self.w[s.name].detach().reshape(-1) for s in self.reg]).cpu().numpy()


class CompiledGraphStep:
    """PyTorch's fastest training step for the peer on CUDA: the loss
    compiled by `torch.compile` (static shapes: one compilation for this
    B), the fused AdamW, and the whole step (zero_grad, forward, backward,
    update) captured once as one CUDA graph, replayed on a static input.

    The recipe of PyTorch's CUDA-graph documentation: warm-up steps on a side
    stream (they compile, and let the allocator and cuBLAS settle), then the
    capture, with the gradients set to None so that the backward allocates
    them in the graph's private pool, where every replay finds them. The
    warm-up updated the parameters: they and the optimizer's state are put
    back afterwards (the capture itself runs nothing), so the first replay is
    update 1 from the given P, as a backend's first replay is."""

    def __init__(self, config: Config, P: np.ndarray, tokens, hyper: Hyper = Hyper(),
                 precision: str = "bf16", device: str = "cuda", warmup: int = 3,
                 gqa: str = "auto"):
        if not str(device).startswith("cuda") or not torch.cuda.is_available():
            raise ValueError("torch.compile with a CUDA graph needs a CUDA device for torch")
        self.peer = TorchPeer(config, P, hyper, precision=precision, device=device,
                              capturable=True, gqa=gqa)
        # one graph or an error: a graph break would leave parts of the step eager and
        # the peer slower than PyTorch is
        self.loss_fn = torch.compile(self.peer.mean_loss, dynamic=False, fullgraph=True)
        self.tokens = self.peer.to_tokens(tokens)  # (B,T+1), the static input slot
        saved = {n: p.detach().cpu() for n, p in self.peer.w.items()}  # on the host: no device peak
        side = torch.cuda.Stream(self.peer.device)
        side.wait_stream(torch.cuda.current_stream(self.peer.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.peer.step(self.tokens, self.loss_fn)
        torch.cuda.current_stream(self.peer.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.peer.zero_grad()  # the backward allocates G inside the graph's pool
        with torch.cuda.graph(self.graph):
            self.loss = self.peer.step(self.tokens, self.loss_fn)  # (), the captured loss buffer
        with torch.no_grad():  # capture ran nothing: undo the warm-up's updates
            for n, p in self.peer.w.items():
                p.copy_(saved[n])
            for state in self.peer.opt.state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        value.zero_()  # exp_avg, exp_avg_sq and the step count
        torch.cuda.synchronize(self.peer.device)

    def upload(self, tokens) -> None:
        """tokens (B,T+1) ids -> the static input slot."""
        self.tokens.copy_(torch.as_tensor(np.asarray(tokens, dtype=np.int64)))

    def replay(self) -> torch.Tensor:
        """One step; returns the captured loss buffer (no sync)."""
        self.graph.replay()
        return self.loss


def set_threads() -> int:
    """Use every core of the machine for the CPU peer."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))
    return n

