"""Time the CuPy backend's memory-bound kernels one by one at the shapes of
one step (coppelius preset, bf16 policy, B contexts), this tree's kernels
beside another tree's (the kernels before a change): median device time per
launch, the bytes a launch must move at least, and the bandwidth that gives.

    PYTHONPATH=. python dev/cuda/kernel_bench.py [--old path/to/other/tree] [--batch 8]

--old: a source tree of the project whose kernels' module
(accelerated/cuda/, or accelerated/cuda_kernels.py and kernels/ before the
package) is loaded beside this tree's (its launchers' signatures as they
were then). Each kernel is launched `--launches` times back to back in one
CUDA graph, over enough copies of its buffers that a launch does not find
its inputs in the L2 cache (working set over 200 MB), and the graph is
replayed `--replays` times, timed by CUDA events: per launch, the median
replay over the launches. Buffers hold random values (ids: a Zipf-like draw,
as text has, so the embedding gradient's repeated ids are realistic).

Per step: each kernel's launches per step (B contexts, L layers) times its
time, summed: the step's memory-bound kernel time, old and new.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import compile as kernel_module  # noqa: E402
from coppelius.accelerated.cuda.adamw import NORM_BLOCKS  # noqa: E402
from coppelius.accelerated.cuda.buffers import Gradient, gradient_segments  # noqa: E402
from coppelius.accelerated.cuda.layernorm import layernorm_chunks  # noqa: E402
from coppelius.accelerated.cuda.policy import attention_path, logits_chunk_rows  # noqa: E402
from coppelius.reference.adamw import AdamWConstants  # noqa: E402
from coppelius.reference.config import Hyper, preset  # noqa: E402
from coppelius.reference.layers.rope import rope_tables  # noqa: E402
from coppelius.reference.layout import layout  # noqa: E402
from coppelius.reference.params import registry  # noqa: E402

WORKING_SET = 200e6  # bytes over the launches' copies: past the H200's 50 MB L2


def load_old(tree: str):
    """The other tree's kernels' module (its own kernel files): the CUDA
    package's compile.py, imported as the package old_cuda, or, in a tree
    from before the package, accelerated/cuda_kernels.py."""
    package = os.path.join(tree, "accelerated", "cuda")
    if os.path.exists(os.path.join(package, "compile.py")):
        spec = importlib.util.spec_from_file_location(
            "old_cuda", os.path.join(package, "__init__.py"), submodule_search_locations=[package])
        module = importlib.util.module_from_spec(spec)
        sys.modules["old_cuda"] = module
        spec.loader.exec_module(module)
        return importlib.import_module("old_cuda.compile")
    path = os.path.join(tree, "accelerated", "cuda_kernels.py")
    spec = importlib.util.spec_from_file_location("old_cuda_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def randn(shape, scale=1.0):
    if hasattr(cupy, "random"):
        return cupy.random.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    # the CPU stand-ins (dev/cuda/emulate.py --script): no cupy.random
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    return cupy.asarray(x * np.float32(scale))


def empty(shape, dtype=np.float32):
    return cupy.empty(shape, dtype=dtype)


def time_launches(stream, launch, copies, launches, replays):
    """Median device ms per launch: `launches` launches (cycling over the
    copies) in one graph, replayed."""
    # the copies were made on the default stream, which a non-blocking
    # stream does not wait for: their uploads (tables of addresses) first
    cupy.cuda.Device().synchronize()
    with stream:
        for c in copies[:2]:
            launch(c)  # compiles; warms the instruction cache
        stream.synchronize()
        stream.begin_capture()
        try:
            for i in range(launches):
                launch(copies[i % len(copies)])
        finally:
            graph = stream.end_capture()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    ms = []
    for _ in range(replays + 1):
        start.record(stream)
        graph.launch(stream=stream)
        end.record(stream)
        end.synchronize()
        ms.append(cupy.cuda.get_elapsed_time(start, end) / launches)
    return float(np.median(ms[1:]))


class Case:
    """One kernel: launches per step; for "new" and "old" each, how to make
    one copy of its buffers, how to launch it on them, the bytes it moves."""

    def __init__(self, name, per_step, make, run, nbytes, old_make=None, old_run=None,
                 old_bytes=None):
        self.name, self.per_step = name, per_step
        self.variants = {"new": (make, run, nbytes),
                         "old": (old_make or make, old_run or run, old_bytes or nbytes)}


def cases(config, B):
    T, D, F, V, H, L = (config.context, config.d_model, config.d_ff, config.vocab,
                        config.n_head, config.n_layer)
    BT = B * T
    N = registry(config).total
    rng = np.random.default_rng(0)
    # Zipf-like ids: a few frequent tokens throughout, a long tail
    zipf = np.minimum(rng.zipf(1.3, size=(B, T + 1)) - 1, V - 1).astype(np.int32)
    ids = cupy.asarray(zipf)
    distinct = len(np.unique(zipf[:, :T]))
    cos, sin = (cupy.asarray(x) for x in rope_tables(T, config.rotary_dim))
    # the q | k | v row of the layout (grouped heads: k and v Hkv E wide each)
    Hkv, QK, W = config.kv_heads, layout(config).qk_width, layout(config).qkv_width
    bf = np.uint16
    norms = 2 * L + 1
    offsets = cupy.asarray(np.arange(norms, dtype=np.int64) * 2 * D)
    k_adamw = AdamWConstants.of(Hyper())
    c4 = cupy.asarray(np.array([0.1, 0.01, 1e-3, 1e-4], np.float32))
    norm2 = cupy.asarray(np.array([1.0, 1.0], np.float32))
    eps = np.float32(1e-5)
    dce = np.float32(1.0 / BT)
    # the step's attention path: after cuDNN's, the rope backward reads bfloat16 dq, dk
    cudnn = attention_path(config, "bf16", B).kind == "cudnn"
    chunk = logits_chunk_rows(BT, V)
    new_chunks = layernorm_chunks(BT)
    old_chunks = -(-BT // 4)  # before: 4 rows per block of layernorm_backward

    def ln_back(chunks, h=False):
        def make():
            return dict(dout=randn((BT, D)), dres=randn((BT, D)), x=randn((BT, D)),
                        m=randn((BT,), 0.1), r=randn((BT,), 0.1) ** 2 + 1, w=randn((D,)),
                        op=empty((BT, D), bf), part=empty((chunks, 2 * D)),
                        **(dict(b=randn((D,)), h=empty((BT, D), bf)) if h else {}))
        return make

    def ln_back_run(k, b):
        k.layernorm_backward(b["dout"], b["dres"], b["x"], b["m"], b["r"], b["w"], b["dres"],
                             b["op"], b["part"], **{n: b[n] for n in ("b", "h") if n in b})

    def segments(G):
        # G as the step's Gradient: the registry's segments, views of the
        # flat buffer (older trees take the flat buffer itself)
        starts = [start for start, _ in gradient_segments(config)]
        if starts[-1] >= G.size:  # the norms' buffer: a segment per norm
            starts = list(range(0, G.size, 2 * D))
        ends = starts[1:] + [G.size]
        return Gradient(starts, [G[a:b] for a, b in zip(starts, ends)],
                        lambda shape, dtype: cupy.empty(shape, dtype))

    def param_grads(chunks, old=False):
        def make():
            part = randn((norms, chunks, 2 * D))
            table = cupy.asarray(np.array([part[n].data.ptr for n in range(norms)], np.uint64))
            G = empty((norms * 2 * D,))
            return dict(part=part, table=table, G=G if old else segments(G))
        return make

    def param_grads_run(k, b):
        if "table" in inspect.signature(k.layernorm_param_grads).parameters:
            k.layernorm_param_grads(list(b["part"]), b["table"], offsets, b["G"])
        else:  # an older tree's: one (norms, chunks, 2D) buffer
            k.layernorm_param_grads(b["part"], offsets, b["G"])

    def adamw_make(flat=False):
        # the registry's weight decay as runs of elements; G in the step's
        # segments, or (flat: trees before them) one buffer
        decay = registry(config).decay_ranges()
        return lambda: dict(P=randn((N,)), M=randn((N,), 1e-3), V=randn((N,), 1e-3) ** 2,
                            G=randn((N,), 1e-3) if flat else segments(randn((N,), 1e-3)),
                            d=cupy.asarray(decay), Pb=empty((N,), bf))

    ln_bytes = BT * D * (4 * 4 + 2)
    return [
        Case("embedding_forward", 1, lambda: dict(W=randn((V, D)), x=empty((BT, D))),
             lambda k, b: k.embedding_forward(ids, T + 1, T, b["W"], b["x"]), 2 * BT * D * 4),
        Case("embedding_backward", 1,
             lambda: dict(dx=randn((BT, D)), dW=randn((V, D)), index=empty((V, 2), np.int32)),
             lambda k, b: k.embedding_backward(b["dx"], ids, T + 1, T, b["dW"], b["index"]),
             BT * D * 4 + 2 * distinct * D * 4,
             old_run=lambda k, b: k.embedding_backward(b["dx"], ids, T + 1, T, b["dW"])),
        Case("layernorm_forward (residual)", 2 * L + 1,
             lambda: dict(x=randn((BT, D)), add=randn((BT, D)), xo=empty((BT, D)),
                          h=empty((BT, D), bf), m=empty((BT,)), r=empty((BT,)), w=randn((D,)),
                          b=randn((D,))),
             lambda k, b: k.layernorm_forward(b["x"], b["add"], b["xo"], b["h"], b["m"], b["r"],
                                              b["w"], b["b"], eps), BT * D * (3 * 4 + 2)),
        Case("layernorm_backward (residual)", 1, ln_back(new_chunks), ln_back_run,
             ln_bytes + new_chunks * 2 * D * 4, old_make=ln_back(old_chunks),
             old_bytes=ln_bytes + old_chunks * 2 * D * 4),
        # the step's in the layers: it also writes the norm's output h again
        Case("layernorm_backward (and h)", 2 * L, ln_back(new_chunks, h=True), ln_back_run,
             ln_bytes + BT * D * 2 + new_chunks * 2 * D * 4,
             old_run=lambda k, b: k.layernorm_backward(b["dout"], b["dres"], b["x"], b["m"],
                                                       b["r"], b["w"], b["dres"], b["op"],
                                                       b["part"]),
             old_bytes=ln_bytes + new_chunks * 2 * D * 4),
        Case("layernorm_param_grads", 1, param_grads(new_chunks), param_grads_run,
             norms * new_chunks * 2 * D * 4, old_make=param_grads(old_chunks, old=True),
             old_bytes=norms * old_chunks * 2 * D * 4),
        # (an older tree's rope launchers take H alone: the ungrouped layout)
        Case("rope_forward", L, lambda: dict(qkv=randn((BT, W)), out=empty((BT, W), bf)),
             lambda k, b: k.rope_forward(b["qkv"], b["out"], cos, sin, T, H, Hkv), BT * W * 6,
             old_run=lambda k, b: k.rope_forward(b["qkv"], b["out"], cos, sin, T, H)),
        Case("rope_backward", 0 if cudnn else L,
             lambda: dict(dqk=randn((BT, QK)), dqkv=empty((BT, W), bf)),
             lambda k, b: k.rope_backward(b["dqk"], b["dqkv"], cos, sin, T, H, Hkv), BT * QK * 6,
             old_run=lambda k, b: k.rope_backward(b["dqk"], b["dqkv"], cos, sin, T, H)),
        Case("rope_backward_operand", L if cudnn else 0,
             lambda: dict(dqk=randn((BT, QK)).astype(bf), dqkv=empty((BT, W), bf)),
             lambda k, b: k.rope_backward_operand(b["dqk"], b["dqkv"], cos, sin, T, H, Hkv),
             BT * QK * 4,
             old_run=lambda k, b: k.rope_backward_operand(b["dqk"], b["dqkv"], cos, sin, T, H)),
        Case("swiglu_forward", L, lambda: dict(gu=randn((BT, 2 * F), 3), a=empty((BT, F), bf)),
             lambda k, b: k.swiglu_forward(b["gu"], b["a"]), BT * F * (2 * 4 + 2)),
        # the step's: it also writes a again (old trees: dgu only)
        Case("swiglu_backward (and a)", L,
             lambda: dict(da=randn((BT, F)), gu=randn((BT, 2 * F), 3), dgu=empty((BT, 2 * F), bf),
                          a=empty((BT, F), bf)),
             lambda k, b: k.swiglu_backward(b["da"], b["gu"], b["dgu"], b["a"]),
             BT * F * (3 * 4 + 3 * 2),
             old_run=lambda k, b: k.swiglu_backward(b["da"], b["gu"], b["dgu"]),
             old_bytes=BT * F * (3 * 4 + 2 * 2)),
        Case("crossentropy_forward_backward", 1,
             lambda: dict(l=randn((BT, V), 4), ce=empty((BT,)), dl=empty((BT, V), bf)),
             lambda k, b: k.crossentropy_forward_backward(b["l"], ids, T + 1, T, b["ce"], b["dl"],
                                                          dce), BT * V * 6),
        # the step's: one chunk of rows at a time (here from L2-cold logits)
        Case(f"crossentropy ({chunk} rows)", -(-BT // chunk),
             lambda: dict(l=randn((chunk, V), 4), ce=empty((chunk,)), dl=empty((chunk, V), bf)),
             lambda k, b: k.crossentropy_forward_backward(b["l"], ids, T + 1, T, b["ce"], b["dl"],
                                                          dce), chunk * V * 6),
        Case("gradient_norm (2 kernels)", 1,
             lambda: dict(G=segments(randn((N,), 1e-3)), part=empty((NORM_BLOCKS,)),
                          n=empty((2,))),
             lambda k, b: k.gradient_norm(b["G"], b["part"], b["n"], 1.0), N * 4,
             old_make=lambda: dict(G=randn((N,), 1e-3), part=empty((NORM_BLOCKS,)),
                                   n=empty((2,)))),
        Case("adamw_update", 1, adamw_make(),
             lambda k, b: k.adamw_update(b["P"], b["M"], b["V"], b["G"], b["d"], b["Pb"], c4,
                                         norm2, k_adamw), N * (4 * 4 + 3 * 4 + 2),
             old_make=adamw_make(flat=True)),
        Case("accumulate_gradient (k > 1)", 0, lambda: dict(G=randn((N,)), Gm=randn((N,))),
             lambda k, b: k.accumulate_gradient(b["G"], b["Gm"]), N * 12),
        Case("round_bf16 (at capture)", 0, lambda: dict(x=randn((N,)), out=empty((N,), bf)),
             lambda k, b: k.round_bf16(b["x"], b["out"]), N * 6),
    ], distinct


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="coppelius")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--old", help="another tree of the project: its kernels beside these")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="time only the kernels whose name holds TEXT; repeatable")
    args = parser.parse_args()
    config = preset(args.preset)
    kernels = {"new": kernel_module.Kernels("bf16")}
    if args.old:
        kernels["old"] = load_old(args.old).Kernels("bf16")
    stream = cupy.cuda.Stream(non_blocking=True)
    table, distinct = cases(config, args.batch)
    if args.only:
        table = [c for c in table if any(text in c.name for text in args.only)]
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device {props['name'].decode()}, preset {args.preset}, B={args.batch} "
          f"({args.batch * config.context} rows), bf16; ids: {distinct} distinct", flush=True)
    rows = []
    for case in table:
        result = {}
        for which, k in kernels.items():
            make, run, moved = case.variants[which]
            first = make()
            size = sum(a.nbytes for a in first.values())
            n_copies = max(1, min(8, math.ceil(WORKING_SET / max(size, 1))))
            copies = [first] + [make() for _ in range(n_copies - 1)]
            try:
                ms = time_launches(stream, lambda b, _k=k, _r=run: _r(_k, b), copies,
                                   args.launches, args.replays)
            except Exception as e:  # a launcher whose signature changed, say
                print(f"  {case.name} ({which}): {type(e).__name__}: {e}", flush=True)
                ms = float("nan")
            result[which] = (ms, moved)
            del copies, first
            cupy.get_default_memory_pool().free_all_blocks()
        rows.append((case, result))
        print(f"  {case.name}: " + ", ".join(f"{w} {ms:.4f} ms" for w, (ms, _) in result.items()),
              flush=True)
    print(f"\n{'kernel':<30} {'per step':>8} {'old ms':>8} {'new ms':>8} {'x':>6} "
          f"{'MB':>8} {'old GB/s':>9} {'new GB/s':>9}")
    totals = dict.fromkeys(kernels, 0.0)
    nan = (float("nan"), 1.0)
    for case, result in rows:
        for which, (ms, _) in result.items():
            totals[which] += case.per_step * ms
        (new_ms, moved), (old_ms, old_moved) = result["new"], result.get("old", nan)
        print(f"{case.name:<30} {case.per_step:>8} {old_ms:>8.4f} {new_ms:>8.4f} "
              f"{old_ms / new_ms:>6.2f} {moved / 1e6:>8.1f} "
              f"{old_moved / old_ms / 1e6:>9.0f} {moved / new_ms / 1e6:>9.0f}")
    print(f"{'per step: launches x ms':<30} {'':>8} {totals.get('old', float('nan')):>8.3f} "
          f"{totals['new']:>8.3f}")


if __name__ == "__main__":
    main()
