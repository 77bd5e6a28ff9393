"""Wall time of one reference training step, next to PyTorch eager on the CPU.

    python bench/reference_step.py [--presets tiny coppelius] [--tiny-steps 20] [--coppelius-steps 3]

For each preset: the NumPy reference (`reference.step`, fp32 and bf16) and
the same model in PyTorch eager fp32 (autograd, scaled_dot_product_attention,
torch.optim.AdamW), from the same initial parameters and the same fixed
batch of B = 1 context, with the same number of threads. Each timing is the
median over the timed steps after a warm-up step. The first step's loss of
PyTorch is checked against the reference's, so the two run the same model.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reference  # noqa: E402
from reference.config import LAYERNORM_EPS, ROPE_BASE, Hyper  # noqa: E402


# ---------------------------------------------------------------- PyTorch, SPEC section 3
class TorchModel:
    """The SPEC model in PyTorch: named parameters from the registry, tied
    unembedding, half-split rope, causal attention, SwiGLU; AdamW with weight
    decay on the two-dimensional parameters only."""

    def __init__(self, config, P, hyper):
        self.config = config
        reg = reference.registry(config)
        self.w = {s.name: torch.nn.Parameter(torch.from_numpy(P[s.slice].reshape(s.shape).copy()))
                  for s in reg.specs}
        T, E = config.context, config.head_dim
        t = np.arange(T, dtype=np.float64)[:, None]
        j = np.arange(E // 2, dtype=np.float64)[None, :]
        theta = t * np.power(float(ROPE_BASE), -2.0 * j / E)  # float64, then float32
        self.cos = torch.from_numpy(np.cos(theta).astype(np.float32))  # (T,E/2)
        self.sin = torch.from_numpy(np.sin(theta).astype(np.float32))
        groups = [{"params": [self.w[s.name] for s in reg.specs if s.decay],
                   "weight_decay": float(hyper.weight_decay)},
                  {"params": [self.w[s.name] for s in reg.specs if not s.decay], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=float(hyper.lr), betas=(float(hyper.beta1), float(hyper.beta2)),
                                     eps=float(hyper.epsilon))

    def rope(self, x):
        # x (B,H,T,E): element j pairs with element j + E/2
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin], dim=-1)

    def logits(self, ids):
        # ids (B,T) -> (B,T,V)
        c, w = self.config, self.w
        B, T = ids.shape
        H, E, D = c.n_head, c.head_dim, c.d_model
        eps = float(LAYERNORM_EPS)
        x = w["tok_embedding.weight"][ids]  # (B,T,D)
        for l in range(c.n_layer):
            p = f"layers.{l}."
            h = F.layer_norm(x, (D,), w[p + "attn_norm.weight"], w[p + "attn_norm.bias"], eps)
            q, k, v = (F.linear(h, w[p + f"attn.{n}.weight"]).view(B, T, H, E).transpose(1, 2) for n in "qkv")
            y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)  # (B,H,T,E)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, D), w[p + "attn.o.weight"])
            h = F.layer_norm(x, (D,), w[p + "mlp_norm.weight"], w[p + "mlp_norm.bias"], eps)
            a = F.silu(F.linear(h, w[p + "mlp.gate.weight"])) * F.linear(h, w[p + "mlp.up.weight"])
            x = x + F.linear(a, w[p + "mlp.down.weight"])
        h = F.layer_norm(x, (D,), w["final_norm.weight"], w["final_norm.bias"], eps)
        return F.linear(h, w["tok_embedding.weight"])  # tied

    def step(self, tokens):
        # tokens (B,T+1) int64 tensor -> mean loss (float)
        self.opt.zero_grad(set_to_none=True)
        logits = self.logits(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        return float(loss.detach())  # read the loss, as a training loop does


# ---------------------------------------------------------------- timing
def median_seconds(run_step, warmup, steps):
    """Median wall time of `steps` calls after `warmup` calls; -> (seconds, first loss)."""
    first = None
    for _ in range(warmup):
        loss = run_step()
        first = loss if first is None else first
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = run_step()
        times.append(time.perf_counter() - t0)
        first = loss if first is None else first
    return statistics.median(times), first


def reference_stepper(config, P, tokens, policy):
    """A step function that trains a fresh state on `tokens`; -> mean loss."""
    state = reference.State.fresh(P)

    def run():
        nonlocal state
        result = reference.step(config, state, tokens, policy)
        state = result.state
        return float(result.loss)

    return run


def bench_preset(name, steps, batch=1):
    config = reference.preset(name)
    P = reference.initialize(config)
    tokens = np.random.default_rng(reference.config.SEED).integers(0, config.vocab, (batch, config.context + 1))
    rows = []
    for policy in ("fp32", "bf16"):
        seconds, loss = median_seconds(reference_stepper(config, P, tokens, policy), 1, steps)
        rows.append((name, "reference (NumPy)", policy, seconds, loss))
        print(f"  {name} reference {policy}: {seconds:.4f} s/step", flush=True)
    model = TorchModel(config, P, Hyper())
    ids = torch.from_numpy(tokens.astype(np.int64))
    seconds, loss = median_seconds(lambda: model.step(ids), 1, steps)
    rows.append((name, "PyTorch eager", "fp32", seconds, loss))
    print(f"  {name} torch fp32: {seconds:.4f} s/step", flush=True)
    ref_loss = rows[0][4]
    assert abs(loss - ref_loss) <= 1e-4 * ref_loss, f"{name}: first losses differ: torch {loss}, reference {ref_loss}"
    return rows, batch * config.context


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "coppelius"], choices=sorted(reference.PRESETS))
    ap.add_argument("--tiny-steps", type=int, default=20, help="timed steps of small presets")
    ap.add_argument("--coppelius-steps", type=int, default=3, help="timed steps of the production preset")
    args = ap.parse_args(argv)

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads)  # NumPy's BLAS uses every core by default; so does this
    print(f"{platform.processor() or platform.machine()}, {threads} threads, numpy {np.__version__}, "
          f"torch {torch.__version__}, OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")

    table = []
    for name in args.presets:
        steps = args.coppelius_steps if name == "coppelius" else args.tiny_steps
        print(f"{name}: 1 warm-up + {steps} timed steps each", flush=True)
        rows, tokens_per_step = bench_preset(name, steps)
        torch_s = rows[-1][3]
        for preset, impl, policy, seconds, loss in rows:
            table.append((preset, impl, policy, seconds, tokens_per_step / seconds, seconds / torch_s, loss))

    print()
    print(f"{'preset':<10} {'implementation':<18} {'policy':<6} {'s/step':>9} {'tokens/s':>10} "
          f"{'x PyTorch':>9} {'first loss':>10}")
    for preset, impl, policy, seconds, tps, ratio, loss in table:
        print(f"{preset:<10} {impl:<18} {policy:<6} {seconds:>9.4f} {tps:>10.0f} {ratio:>9.2f} {loss:>10.4f}")
    print("x PyTorch: the step's wall time over PyTorch eager fp32's on the same preset (lower is faster).")
    assert all(math.isfinite(row[3]) for row in table)


if __name__ == "__main__":
    main()
