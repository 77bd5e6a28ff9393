"""Every execution plan cuDNN offers for the step's attention graphs
(accelerated/cuda/cudnn_attention.py's Graph: SDPA forward, and the
backward with the deterministic algorithm), each timed and checked: the
plans of heuristics modes A, B and the fallback, each built at its index,
executed twice on the same pseudo-random operands (outputs poisoned with
NaN first: every element written, finite, the two runs bitwise equal), and
timed by CUDA events over `--runs` executions; the plan the step builds
(the first that builds: build_plans' walk) is index 0's or the first
after it that builds.

    PYTHONPATH=. python dev/cuda/attention/cudnn_plans.py [--batch 8] [--preset coppelius]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

import cupy  # noqa: E402

from coppelius.accelerated.cuda import cudnn_attention as ca  # noqa: E402
from coppelius.accelerated.cuda.attention import attention_scale  # noqa: E402
from coppelius.reference.config import preset  # noqa: E402
from coppelius.reference.layout import qkv_columns  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="coppelius")
    p.add_argument("--batch", type=int, action="append")
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    c = preset(args.preset)
    cudnn = ca.frontend()
    print("versions", ca.versions())
    H, E, T = c.n_head, c.d_model // c.n_head, c.context
    Hkv = c.n_kv_head or H
    rows = []
    for B in args.batch or [8]:
        graphs = {d: ca.Graph(d, B, T, H, E, attention_scale(E), Hkv)
                  for d in ("forward", "backward")}
        D, BT = H * E, B * T
        q, k, v = qkv_columns(H, Hkv, E)
        rng = np.random.default_rng(0)

        def operand(cols):
            x = rng.standard_normal((BT, cols)).astype(np.float32)
            return cupy.asarray((x.view(np.uint32) >> 16).astype(np.uint16))

        qkv, dy = operand(v.stop), operand(D)
        y = cupy.empty((BT, D), np.uint16)
        stats = cupy.empty((B, H, T), np.float32)
        dqk = cupy.empty((BT, k.stop), np.uint16)
        dqkv = cupy.empty((BT, v.stop), np.uint16)
        ptr = lambda a, offset=0: a.data.ptr + offset * a.itemsize  # noqa: E731
        pointers = {"forward": (ptr(qkv), ptr(qkv, k.start), ptr(qkv, v.start), ptr(y),
                                ptr(stats)),
                    "backward": (ptr(qkv), ptr(qkv, k.start), ptr(qkv, v.start), ptr(y), ptr(dy),
                                 ptr(stats), ptr(dqk), ptr(dqk, k.start), ptr(dqkv, v.start))}
        outputs = {"forward": (y, stats), "backward": (dqk, dqkv)}
        stream = cupy.cuda.Stream(non_blocking=True)
        for direction in ("forward", "backward"):
            g = graphs[direction]
            gr = g.graph
            if direction == "backward":  # y and stats by the forward's plan 0 (the step's)
                f = graphs["forward"].graph
                ws = cupy.zeros(int(f.get_workspace_size_plan_at_index(0)) + 1, np.uint8)
                with stream:
                    f.execute_plan_at_index(dict(zip(graphs["forward"].tensors,
                                                     pointers["forward"])), ptr(ws), 0,
                                            handle=g.handle[0])
                stream.synchronize()
            try:
                gr.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B,
                                           cudnn.heur_mode.FALLBACK])
                gr.check_support()
            except Exception as e:
                print(f"B={B} {direction}: the plans of A, B and the fallback: {ca._one_line(e)}")
            count = gr.get_execution_plan_count()
            print(f"B={B} {direction}: {count} plans")
            for i in range(count):
                name = gr.get_plan_name_at_index(i)
                try:
                    gr.build_plan_at_index(i)
                    ws_bytes = int(gr.get_workspace_size_plan_at_index(i))
                except Exception as e:
                    rows.append((B, direction, i, name, "not built: " + ca._one_line(e)[:60],
                                 float("nan"), 0))
                    continue
                ws = cupy.zeros(ws_bytes + 1, np.uint8)
                pack = dict(zip(g.tensors, pointers[direction]))
                with stream:
                    cudnn.set_stream(g.handle[0], stream.ptr)
                    g.handle[1] = stream.ptr
                    runs = []
                    try:
                        for _ in range(2):
                            for o in outputs[direction]:
                                o.fill(0xFFFF if o.dtype == np.uint16 else np.nan)
                            gr.execute_plan_at_index(pack, ptr(ws), i, handle=g.handle[0])
                            stream.synchronize()
                            runs.append([cupy.asnumpy(o) for o in outputs[direction]])
                        start, end = cupy.cuda.Event(), cupy.cuda.Event()
                        start.record(stream)
                        for _ in range(args.runs):
                            gr.execute_plan_at_index(pack, ptr(ws), i, handle=g.handle[0])
                        end.record(stream)
                        end.synchronize()
                        us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.runs
                    except Exception as e:
                        rows.append((B, direction, i, name, "fails: " + ca._one_line(e)[:60],
                                     float("nan"), ws_bytes))
                        continue
                same = all(np.array_equal(a, b) for a, b in zip(*runs))
                last = runs[-1]
                if direction == "backward":  # of dqkv only dv is written
                    last = [last[0], last[1][:, v.start:]]
                finite = all(np.isfinite((x.astype(np.uint32) << 16).view(np.float32)
                                         if x.dtype == np.uint16 else x).all() for x in last)
                rows.append((B, direction, i, name,
                             f"{'bitwise' if same else 'DIFFERS'}, "
                             f"{'written' if finite else 'NOT WRITTEN'}", us, ws_bytes))
                print(rows[-1], flush=True)
    print(f"\n{'B':>3} {'graph':<9} {'i':>2} {'us':>8} {'workspace':>10}  check  plan")
    for B, direction, i, name, check, us, ws_bytes in rows:
        print(f"{B:>3} {direction:<9} {i:>2} {us:>8.1f} {ws_bytes:>10,}  {check}  {name[:70]}")


if __name__ == "__main__":
    main()
