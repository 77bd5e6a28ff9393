"""The fused causal attention (accelerated/cuda/kernels/attention_fused.cu,
attention_forward_e* and attention_backward_*_e*) against the reference
model's attention (grouped heads too), and timed against the materialized
path it replaces.

    PYTHONPATH=. python dev/cuda/attention/check.py [--batch 1 --batch 8] [--preset llama-124m]
    bash dev/cuda/attention/device_run.sh   # this, then dev/cuda/device_check.sh

Variants (each the step's attention, forward then backward, one layer):
  0  materialized: cuBLAS strided batched products per batch element over
     (B,H,T,T) float32 scores, the row-wise softmax kernels
  1  fused (v1.cu): mma.sync bfloat16 tiles of 64 queries x 64 keys, two
     passes in the forward (row max and sum, then round(p) v, p normalized as
     the reference's operand), dq per query tile in two passes (dot = sum dp p,
     then ds k), dk, dv per key tile; expf, IEEE division, a mask on every tile
  2  (v2.cu) 1 with exp2 of an fma (log2 e folded into the scale), 1/l once
     per row, cvt.rn.bf16x2 packing, the mask only on diagonal tiles
  3  (v3.cu) 2 with a one-pass forward (online softmax: the operand of p v
     is the unnormalized exp, rounded) and dot = dy . y (one pass for dq;
     ds of a row with a single key then comes out nonzero, not 0)
  4  (v4.cu) 2 with the one-pass forward of 3 (the backward of 2)
  5  2 with every tile copied by cp.async into double buffers (tile
     t+1 lands while tile t is used) and no transposed tiles: the b
     fragments of p v, ds k, p^T dy, ds^T q come from row-major tiles through
     ldmatrix.trans. The winner: it lives only in the package
     (accelerated/cuda/kernels/attention_fused.cu), checked as "in package".

Each vN.cu is a whole replacement of the package's attention_fused.cu: the
module is compiled with that one file swapped (compile.Kernels'
replace), every other kernel file as in the package, so a compiler error
names the variant's file and line. v1.cu .. v4.cu are the record of the
measurements in dev/cuda/NOTES.md: they index the ungrouped layout and take
the arguments the launchers passed then (qkv, ..., T, H, scale), not the
layout's strides (H, Hkv, W, K, V, QK) that the package's kernels take now,
so this harness runs them no more (the tree of their time does: git log
dev/cuda/attention); a new variant starts from the package's file.

Checks, on fresh random inputs: each variant against the reference
model's attention (NumPy float32 with the reference's own bf16 rounding;
query head h with key/value head h // g) at the preset's shape and smaller
ones (T across tile edges, E = 32 and 16, grouped heads Hkv = 1 of 4 and 2
of 6); every output element written (buffers start as NaN); two runs
bitwise equal. Timing: each variant captured as a CUDA graph and replayed
(median of 20), bf16, the preset's shape."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cudnn_check, beside this file

import cupy  # noqa: E402

from coppelius.accelerated.cuda.buffers import Activations, Buffers, Gradient  # noqa: E402
from coppelius.accelerated.cuda.compile import Kernels  # noqa: E402
from coppelius.accelerated.cuda.cublas import WORKSPACE_BYTES, Cublas  # noqa: E402
from coppelius.accelerated.cuda.model import Model  # noqa: E402
from coppelius.accelerated.cuda.step import kernels_for  # noqa: E402
from coppelius.conformance.tolerances import relative_error  # noqa: E402
from coppelius.reference.config import Config, preset  # noqa: E402
from coppelius.reference.layers.rope import rope_tables  # noqa: E402
from coppelius.reference.layout import layout  # noqa: E402
from coppelius.reference.params import registry  # noqa: E402
from coppelius.reference.precision import round_bf16  # noqa: E402
from coppelius.accelerated.cuda.cupy_debug import fused_from_batch, step_attention  # noqa: E402
from cudnn_check import reference_attention  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))


def variant_kernels(name):
    """The bf16 module with the package's attention_fused.cu replaced by
    dev/cuda/attention/<name> (None: the package's own file)."""
    if name is None:
        return Kernels("bf16")
    return Kernels("bf16", replace={"attention_fused.cu": os.path.join(HERE, name)})


def check(kernels, Bn, H, Hkv, T, E, seed):
    rng = np.random.default_rng(seed)
    q, dy = 2 * rng.standard_normal((Bn, H, T, E)), rng.standard_normal((Bn, H, T, E))
    k, v = 2 * rng.standard_normal((Bn, Hkv, T, E)), rng.standard_normal((Bn, Hkv, T, E))
    q, k, v, dy = (round_bf16(x.astype(np.float32)) for x in (q, k, v, dy))
    with fused_from_batch(1):
        got = step_attention("bf16", q, k, v, dy, kernels)
        again = step_attention("bf16", q, k, v, dy, kernels)
    y, dq, dk, dv = reference_attention(q, k, v, dy)
    want = (round_bf16(y), dq, dk, round_bf16(dv))
    ok = True
    for name, g, w, a in zip(("y", "dq", "dk", "dv"), got, want, again):
        err, worst, x1, x2 = relative_error(g, w)
        same = np.array_equal(g.view(np.uint32), a.view(np.uint32))
        print(f"  B={Bn} H={H} Hkv={Hkv} T={T} E={E} {name}: error {err:.2e} (worst at {worst}: "
              f"{x1} vs {x2}), all written {np.isfinite(g).all()}, replay bitwise {same}")
        ok &= err <= 1e-2 and np.isfinite(g).all() and same
    return ok


def timed(config, B, kernels):
    """ms per forward + backward of one layer's attention, graph replays."""
    fused = kernels is not None
    with fused_from_batch(1 if fused else 1 << 30):
        T, D = config.context, config.d_model
        stream = cupy.cuda.Stream(non_blocking=True)
        alloc = Buffers(stream)
        ws = alloc((WORKSPACE_BYTES,), np.uint8)
        blas = Cublas(stream.ptr, ws.data.ptr, WORKSPACE_BYTES)
        one = Config(vocab=8, context=T, d_model=D, n_layer=1, n_head=config.n_head, d_ff=8,
                     n_kv_head=config.kv_heads, rotary=config.rotary)
        P = alloc((registry(one).total,), np.float32)
        cos, sin = (alloc.upload(t) for t in rope_tables(T, one.rotary_dim))
        model = Model(one, "bf16", kernels or kernels_for("bf16"), blas, P, P,
                      Gradient.flat(P, alloc), cos, sin, None)
        acts = Activations(one, B, T, np.uint16, alloc, train=True)
        assert acts.fused == fused
        rng = np.random.default_rng(1)
        bits = lambda shape: (round_bf16(rng.standard_normal(shape).astype(np.float32))  # noqa
                              .view(np.uint32) >> 16).astype(np.uint16)
        acts.qkv[0].set(bits((B * T, layout(one).qkv_width)), stream=stream)
        acts.dy.set(bits((B * T, D)), stream=stream)

        def work():
            model.attention_forward(acts, 0)
            model.attention_backward(acts, 0)

        with stream:
            work()
            stream.begin_capture()
            work()
            graph = stream.end_capture()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        ms = []
        for _ in range(22):
            start.record(stream)
            graph.launch(stream=stream)
            end.record(stream)
            end.synchronize()
            ms.append(cupy.cuda.get_elapsed_time(start, end))
        blas.close()
        return float(np.median(ms[2:]))


VARIANTS = {"in package": None}  # (v1.cu .. v4.cu: see above)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--preset", default="coppelius")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS))
    args = parser.parse_args()
    config = preset(args.preset)
    # (B, H, Hkv, T, E): the preset's, then smaller ones, grouped and not
    shapes = [(1, config.n_head, config.kv_heads, config.context, config.head_dim),
              (2, 3, 3, 200, 32), (1, 2, 2, 77, 16), (2, 4, 1, 130, 64), (1, 6, 2, 65, 16)]
    names = args.variant or list(VARIANTS)
    batches = args.batch or [1, 2, 4, 8]
    ok_all, times = True, {}
    for name in names:
        kernels = variant_kernels(VARIANTS[name])
        print(f"variant {name}: bf16 against the reference model's attention")
        ok = True
        for i, shape in enumerate(shapes):
            ok &= check(kernels, *shape, seed=100 + i)
        print(f"variant {name}: {'correct' if ok else 'WRONG'}")
        ok_all &= ok
        times[name] = [timed(config, B, kernels) for B in batches]
    times["0 materialized"] = [timed(config, B, None) for B in batches]
    print(f"\nattention forward + backward, one layer, {args.preset} (T={config.context}, "
          f"H={config.n_head}, Hkv={config.kv_heads}, E={config.head_dim}), bf16, ms (graph "
          "replay, median of 20)")
    print(f"{'variant':<16}" + "".join(f"{f'B={B}':>9}" for B in batches))
    for name, row in times.items():
        print(f"{name:<16}" + "".join(f"{t:>9.3f}" for t in row))
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
