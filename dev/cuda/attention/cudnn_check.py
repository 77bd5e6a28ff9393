"""cuDNN's fused attention (accelerated/cuda/cudnn_attention.py) on the device:
the frontend and library found, the graphs built for the coppelius shapes,
cuDNN's results against reference.layers.attention, the captured graph
against the eager run, two replays bitwise, and each attention path's time
per layer beside the others.

    PYTHONPATH=. python dev/cuda/attention/cudnn_check.py [--batch 1 --batch 8] [--quick]

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
from coppelius.reference.layers.attention import attention_backward, attention_forward  # noqa: E402
from coppelius.reference.layers.rope import rope_tables  # noqa: E402
from coppelius.reference.params import registry  # noqa: E402
from coppelius.reference.precision import round_bf16  # noqa: E402

PATHS = {"materialized": lambda: fused_from_batch(NEVER), "fused": lambda: fused_from_batch(1),
         "cudnn": lambda: cudnn_from_batch(1)}


def check(Bn, H, T, E, seed):
    """cuDNN's attention against the reference layer; -> ok."""
    rng = np.random.default_rng(seed)
    q, k = 2 * rng.standard_normal((2, Bn, H, T, E))
    v, dy = rng.standard_normal((2, Bn, H, T, E))
    q, k, v, dy = (round_bf16(x.astype(np.float32)) for x in (q, k, v, dy))
    with cudnn_from_batch(1):
        path = attention_path(Config(8, T, H * E, 1, H, 8), "bf16", Bn)
        got = step_attention("bf16", q, k, v, dy)
        again = step_attention("bf16", q, k, v, dy)
    y, cache = attention_forward(q, k, v, "bf16")
    want = (round_bf16(y), *attention_backward(dy, cache, "bf16"))
    print(f"  B={Bn} H={H} T={T} E={E}: path {path.kind} {path.reason}")
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
        one = Config(vocab=8, context=T, d_model=D, n_layer=1, n_head=config.n_head, d_ff=8)
        P = alloc((registry(one).total,), np.float32)
        cos, sin = (alloc.upload(t) for t in rope_tables(T, config.head_dim))
        model = Model(one, "bf16", kernels_for("bf16"), blas, P, P, Gradient.flat(P, alloc), cos,
                      sin, None)
        acts = Activations(one, B, T, np.uint16, alloc, train=True)
    assert acts.path.kind == path, (path, acts.path)
    rng = np.random.default_rng(B)
    bits = lambda shape: (round_bf16(rng.standard_normal(shape).astype(np.float32))  # noqa
                          .view(np.uint32) >> 16).astype(np.uint16)
    acts.qkv[0].set(bits((B * T, 3 * D)), stream=stream)
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
    H, E, T = config.n_head, config.head_dim, config.context
    scale = attention_scale(E)
    print(f"frontend: {cudnn_attention.versions() or cudnn_attention.import_error()}")
    print(f"torch imported: {'torch' in sys.modules}")
    batches = args.batch or [1, 2, 4, 8, 32]
    ok = cudnn_attention.frontend() is not None
    for B in batches:
        start = time.perf_counter()
        why = cudnn_attention.unavailable(B, T, H, E, scale, True)
        took = time.perf_counter() - start
        if why:
            print(f"graphs B={B}: {why} ({took:.2f} s)")
            ok = False
            continue
        fwd = cudnn_attention.graph("forward", B, T, H, E, scale)
        bwd = cudnn_attention.graph("backward", B, T, H, E, scale)
        print(f"graphs B={B}: built in {took:.2f} s; forward {fwd.launch()}, "
              f"backward {bwd.launch()}")
    print("cuDNN against reference.layers.attention (bf16)")
    shapes = [(1, H, T, E), (2, 3, 200, 32), (1, 2, 77, 16)]
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
          f"(T={T}, H={H}, E={E}), bf16, ms (graph replay, median of 20)")
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
