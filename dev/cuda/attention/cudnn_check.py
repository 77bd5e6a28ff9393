"""cuDNN's fused attention (accelerated/cuda/cudnn_attention.py) on the device:
the frontend and library found, the graphs built for the preset's shapes
(grouped heads too: --preset llama-124m), cuDNN's results against the
reference model's attention, the captured graph against the eager run, two
replays bitwise, and each attention path's time per layer beside the others.

    PYTHONPATH=. python dev/cuda/attention/cudnn_check.py [--batch 1 --batch 8] [--quick]
                                                          [--preset llama-124m]

Paths (each the step's attention of one layer, forward then backward, the
rope backward included, through Model.attention_forward / _backward on the
backend's own buffers):
  materialized  cuBLAS strided batched products over (B,H,T,T) float32
                scores, the row-wise softmax kernels
  fused         the project's kernels (kernels/attention_fused.cu)
  cudnn         cuDNN's SDPA forward and backward graphs (deterministic
                backward)

Timing: each path captured as a CUDA graph and replayed, median of 20 after
2, bf16, coppelius shape. --quick: versions, graphs and one check only."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import cudnn_attention  # noqa: E402
from coppelius.accelerated.cuda.attention import attention_scale  # noqa: E402
from coppelius.accelerated.cuda.buffers import Activations, Buffers, Gradient  # noqa: E402
from coppelius.accelerated.cuda.cublas import WORKSPACE_BYTES, Cublas  # noqa: E402
from coppelius.accelerated.cuda.model import Model  # noqa: E402
from coppelius.accelerated.cuda.policy import attention_path  # noqa: E402
from coppelius.accelerated.cuda.step import kernels_for  # noqa: E402
from coppelius.accelerated.cuda.cupy_debug import (NEVER, cudnn_from_batch,  # noqa: E402
                                              fused_from_batch, step_attention)
from coppelius.conformance.tolerances import relative_error  # noqa: E402
from coppelius.reference.config import Config, preset  # noqa: E402
from coppelius.reference.layers.rope import rope_tables  # noqa: E402
from coppelius.reference.layout import layout  # noqa: E402
from coppelius.reference.model import _attention_backward, _attention_forward  # noqa: E402
from coppelius.reference.params import registry  # noqa: E402
from coppelius.reference.precision import round_bf16  # noqa: E402

PATHS = {"materialized": lambda: fused_from_batch(NEVER), "fused": lambda: fused_from_batch(1),
         "cudnn": lambda: cudnn_from_batch(1)}


def reference_attention(q, k, v, dy):
    """The reference model's attention (query head h with key/value head
    h // g; dk, dv summed over the g query heads) on q, dy (B,H,T,E), k, v
    (B,Hkv,T,E) -> y, dq, dk, dv in those shapes, bf16 policy."""
    rows = lambda x: x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)  # noqa: E731
    heads = lambda x, n: x.reshape(x.shape[0], x.shape[1], n, -1).transpose(0, 2, 1, 3)  # noqa
    H, Hkv = q.shape[1], k.shape[1]
    y, cache = _attention_forward(rows(q), rows(k), rows(v), H, "bf16")
    dq, dk, dv = _attention_backward(rows(dy), cache, H, "bf16")
    return heads(y, H), heads(dq, H), heads(dk, Hkv), heads(dv, Hkv)


def check(Bn, H, Hkv, T, E, seed):
    """cuDNN's attention against the reference model's; -> ok."""
    rng = np.random.default_rng(seed)
    q, dy = 2 * rng.standard_normal((Bn, H, T, E)), rng.standard_normal((Bn, H, T, E))
    k, v = 2 * rng.standard_normal((Bn, Hkv, T, E)), rng.standard_normal((Bn, Hkv, T, E))
    q, k, v, dy = (round_bf16(x.astype(np.float32)) for x in (q, k, v, dy))
    with cudnn_from_batch(1):
        path = attention_path(Config(8, T, H * E, 1, H, 8, n_kv_head=Hkv), "bf16", Bn)
        got = step_attention("bf16", q, k, v, dy)
        again = step_attention("bf16", q, k, v, dy)
    y, dq, dk, dv = reference_attention(q, k, v, dy)
    want = (round_bf16(y), dq, dk, dv)
    print(f"  B={Bn} H={H} Hkv={Hkv} T={T} E={E}: path {path.kind} {path.reason}")
    ok = path.kind == "cudnn"
    for name, g, w, a in zip(("y", "dq", "dk", "dv"), got, want, again):
        err, worst, x1, x2 = relative_error(g, w)
        same = np.array_equal(g.view(np.uint32), a.view(np.uint32))
        print(f"    {name}: error {err:.2e} (worst at {worst}: {x1} vs {x2}), all written "
              f"{np.isfinite(g).all()}, second run bitwise {same}")
        ok &= err <= 1e-2 and bool(np.isfinite(g).all()) and same
    return ok


def layer(config, B, path):
    """(model, acts, stream) of one layer's attention on random operands."""
    T, D = config.context, config.d_model
    with PATHS[path]():
        stream = cupy.cuda.Stream(non_blocking=True)
        alloc = Buffers(stream)
        ws = alloc((WORKSPACE_BYTES,), np.uint8)
        blas = Cublas(stream.ptr, ws.data.ptr, WORKSPACE_BYTES)
        one = Config(vocab=8, context=T, d_model=D, n_layer=1, n_head=config.n_head, d_ff=8,
                     n_kv_head=config.kv_heads, rotary=config.rotary)
        P = alloc((registry(one).total,), np.float32)
        cos, sin = (alloc.upload(t) for t in rope_tables(T, one.rotary_dim))
        model = Model(one, "bf16", kernels_for("bf16"), blas, P, P, Gradient.flat(P, alloc), cos,
                      sin, None)
        acts = Activations(one, B, T, np.uint16, alloc, train=True)
    assert acts.path.kind == path, (path, acts.path)
    rng = np.random.default_rng(B)
    bits = lambda shape: (round_bf16(rng.standard_normal(shape).astype(np.float32))  # noqa
                          .view(np.uint32) >> 16).astype(np.uint16)
    acts.qkv[0].set(bits((B * T, layout(one).qkv_width)), stream=stream)
    acts.dy.set(bits((B * T, D)), stream=stream)
    return model, acts, stream, blas


def timed(config, B, path, replay_check=False):
    """ms per forward + backward of one layer's attention, graph replays;
    with replay_check also: the replay's outputs equal the eager run's and
    two replays are bitwise equal. -> (ms, ok)"""
    model, acts, stream, blas = layer(config, B, path)

    def work():
        model.attention_forward(acts, 0)
        model.attention_backward(acts, 0)

    outputs = lambda: [cupy.asnumpy(x).copy() for x in (acts.y[0], acts.dqk, acts.dqkv)]  # noqa
    with stream:
        work()
        stream.synchronize()
        eager = outputs()
        stream.begin_capture()
        work()
        graph = stream.end_capture()
    ok = True
    if replay_check:
        for x in (acts.y[0], acts.dqk, acts.dqkv):
            x.fill(0)  # so the replay must write every element again
        cupy.cuda.Device().synchronize()  # the fills ran on the default stream
        graph.launch(stream=stream)
        stream.synchronize()
        first = outputs()
        graph.launch(stream=stream)
        stream.synchronize()
        second = outputs()
        for name, e, a, b in zip(("y", "dqk", "dqkv"), eager, first, second):
            same_eager, same_replays = np.array_equal(e, a), np.array_equal(a, b)
            print(f"    {path} B={B} {name}: replay == eager {same_eager}, "
                  f"replay == replay {same_replays}")
            ok &= same_eager and same_replays
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    ms = []
    for _ in range(22):
        start.record(stream)
        graph.launch(stream=stream)
        end.record(stream)
        end.synchronize()
        ms.append(cupy.cuda.get_elapsed_time(start, end))
    blas.close()
    return float(np.median(ms[2:])), ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--preset", default="coppelius")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    config = preset(args.preset)
    H, Hkv, E, T = config.n_head, config.kv_heads, config.head_dim, config.context
    scale = attention_scale(E)
    print(f"frontend: {cudnn_attention.versions() or cudnn_attention.import_error()}")
    print(f"torch imported: {'torch' in sys.modules}")
    batches = args.batch or [1, 2, 4, 8, 32]
    ok = cudnn_attention.frontend() is not None
    for B in batches:
        start = time.perf_counter()
        why = cudnn_attention.unavailable(B, T, H, E, scale, True, kv_heads=Hkv)
        took = time.perf_counter() - start
        if why:
            print(f"graphs B={B}: {why} ({took:.2f} s)")
            ok = False
            continue
        fwd = cudnn_attention.graph("forward", B, T, H, E, scale, kv_heads=Hkv)
        bwd = cudnn_attention.graph("backward", B, T, H, E, scale, kv_heads=Hkv)
        print(f"graphs B={B}: built in {took:.2f} s; forward {fwd.launch()}, "
              f"backward {bwd.launch()}")
    print("cuDNN against the reference model's attention (bf16)")
    # (B, H, Hkv, T, E): the preset's, then smaller ones, grouped and not
    shapes = [(1, H, Hkv, T, E), (2, 3, 3, 200, 32), (1, 2, 2, 77, 16), (2, 4, 1, 130, 64),
              (1, 12, 4, 256, 64)]
    for i, s in enumerate(shapes[:1] if args.quick else shapes):
        ok &= check(*s, seed=100 + i)
    if args.quick:
        print(f"cudnn check: {'correct' if ok else 'WRONG'}")
        sys.exit(0 if ok else 1)
    print("captured graph against the eager run, two replays")
    for B in (1, 8):
        ok &= timed(config, B, "cudnn", replay_check=True)[1]
    times = {path: [timed(config, B, path)[0] for B in batches] for path in PATHS}
    # what the deterministic backward costs: the same graphs without it
    cudnn_attention.DETERMINISTIC = False
    print("cuDNN without the deterministic backward (for its cost only)")
    timed(config, 8, "cudnn", replay_check=True)
    times["cudnn nondet."] = [timed(config, B, "cudnn")[0] for B in batches]
    cudnn_attention.DETERMINISTIC = True
    print(f"\nattention forward + backward (rope backward included), one layer, {args.preset} "
          f"(T={T}, H={H}, Hkv={Hkv}, E={E}), bf16, ms (graph replay, median of 20)")
    print(f"{'path':<14}" + "".join(f"{f'B={B}':>9}" for B in batches))
    for path, row in times.items():
        print(f"{path:<14}" + "".join(f"{t:>9.3f}" for t in row))
    flops = [2 * 2 * B * H * T * T * E * 0.5 * 3.5 for B in batches]  # causal: fwd 2, bwd 5 products
    print(f"{'cudnn TFLOP/s':<14}" + "".join(f"{f / t / 1e9:>9.0f}"
                                             for f, t in zip(flops, times["cudnn"])))
    print(f"cudnn check: {'correct' if ok else 'WRONG'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
