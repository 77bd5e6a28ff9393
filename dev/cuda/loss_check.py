"""Check and time the classifier's loss in its product (kernels/gemm_sm90.cu's
EPI_LSE and EPI_DLOGITS, kernels/crossentropy.cu's crossentropy_combine)
beside the step's other path (cuBLAS's float32 logits by chunks of rows,
then crossentropy_forward_backward), on a Hopper GPU:

    PYTHONPATH=$PWD python dev/cuda/loss_check.py [--shapes coppelius:8,coppelius:32]

A shape is a preset or model file and B (rows B T, the step's chunk rows,
logits_chunk_rows). Per shape: the row losses of the two paths (their
largest difference) and dlogits (relative error of the fused against the
other), then microseconds (a CUDA graph of 20 runs replayed 15 times, the
median per run) of: the other path whole; the fused path whole (lse over
every row, combine, dlogits by chunks); each lse variant alone, storing
nothing too ("bare": the products alone), and its dlogits by chunks. A
table last."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import cupy as cp  # noqa: E402

from coppelius.accelerated.cuda import gemm  # noqa: E402
from coppelius.accelerated.cuda.compile import Kernels as ProjectKernels  # noqa: E402
from coppelius.accelerated.cuda.cublas import WORKSPACE_BYTES, Cublas  # noqa: E402
from coppelius.accelerated.cuda.policy import logits_chunk_rows  # noqa: E402
from coppelius.reference.config import PRESETS, config_from_toml  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gemm_check import as_f64, bf16_bits, timed  # noqa: E402

PAIRS = (("gemm_lse_p_m2n128_s4", "gemm_dlogits_p_m2n128_s4"),
         ("gemm_lse_c_n256_s4", "gemm_dlogits_c_n256_s4"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="coppelius:1,coppelius:8,coppelius:32")
    args = p.parse_args()
    kernels = gemm.Kernels()
    project = ProjectKernels("bf16")
    stream = cp.cuda.Stream(non_blocking=True)
    workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)
    blas = Cublas(stream.ptr, workspace.data.ptr, WORKSPACE_BYTES)
    rng = np.random.default_rng(0)
    table, failures = [], []
    with stream:
        for shape in args.shapes.split(","):
            model, B = shape.rsplit(":", 1)
            c = config_from_toml(model)[0] if model.endswith(".toml") else PRESETS[model]
            T, V, D, B = c.context, c.vocab, c.d_model, int(B)
            M = B * T
            rows = logits_chunk_rows(M, V)
            hf = bf16_bits(rng, (M, D))
            W = bf16_bits(rng, (V, D), scale=2 * D ** -0.5)
            ids = cp.asarray(rng.integers(0, V, (B, T + 1)).astype(np.int32))
            dce = np.float32(1.0 / M)
            logits = cp.empty((rows, V), cp.float32)
            ce0, dl0 = cp.empty((M,), cp.float32), cp.empty((rows, V), cp.uint16)

            def other(last_only=False):
                for r0 in range(0, M, rows):
                    n = min(rows, M - r0)
                    blas.gemm(False, True, n, V, D, hf.data.ptr + 2 * r0 * D, D, W.data.ptr, D,
                              logits.data.ptr, V, ab_type="bfloat16", c_type="float32")
                    project.crossentropy_forward_backward(logits[:n], ids, T + 1, T,
                                                          ce0[r0:r0 + n], dl0[:n], dce, row0=r0)

            other()
            stream.synchronize()
            want_dl = as_f64(dl0[:min(rows, M - (M - 1) // rows * rows)])  # the last chunk's
            t_other = timed(stream, other)
            table.append((shape, "cuBLAS logits + crossentropy", t_other, 1.0, "-"))
            print(table[-1], flush=True)
            for fwd, back in PAIRS:
                v = gemm.VARIANTS[fwd]
                tiles = gemm.loss_tiles(V, v)
                part = cp.empty((M, 2 * tiles), cp.float32)
                tl, ce = cp.empty((M,), cp.float32), cp.empty((M,), cp.float32)
                stats, dl = cp.empty((M, 2), cp.float32), cp.full((rows, V), 0xFFFF, cp.uint16)
                loss = gemm.Loss(ids.data.ptr, T + 1, T, part=part.data.ptr, target=tl.data.ptr)
                lse = kernels.plan_pointers(fwd, M, V, D, hf.data.ptr, D, W.data.ptr, D, 0, V,
                                            loss=loss)
                bare = kernels.plan_pointers(fwd, M, V, D, hf.data.ptr, D, W.data.ptr, D, 0, 0,
                                             loss=loss)
                chunks = []
                for r0 in range(0, M, rows):
                    n = min(rows, M - r0)
                    chunks.append(kernels.plan_pointers(
                        back, n, V, D, hf.data.ptr + 2 * r0 * D, D, W.data.ptr, D, dl.data.ptr,
                        V, loss=gemm.Loss(ids.data.ptr, T + 1, T, r0,
                                          stats=stats.data.ptr + 8 * r0, dce=float(dce))))

                def fused():
                    lse.launch(stream)
                    project.crossentropy_combine(part, tl, ce, stats)
                    for plan in chunks:
                        plan.launch(stream)

                fused()
                stream.synchronize()
                d_ce = float(cp.abs(ce - ce0).max())
                got = as_f64(dl[:want_dl.shape[0]])
                err = float(cp.linalg.norm(got - want_dl) / cp.linalg.norm(want_dl))
                ok = d_ce < 1e-4 and err < 4e-3
                if not ok:
                    failures.append(f"{shape} {fwd}: ce differs by {d_ce:.2e}, dlogits {err:.2e}")
                check = f"{'ok' if ok else 'FAIL'} ce {d_ce:.1e} dlogits {err:.1e}"
                t = timed(stream, fused)
                table.append((shape, f"fused {fwd[9:]}", t, t / t_other, check))
                print(table[-1], flush=True)
                for label, plan in (("lse", lse), ("lse bare", bare)):
                    t = timed(stream, plan.launch)
                    table.append((shape, f"{label} {fwd[9:]}", t, t / t_other, "-"))
                    print(table[-1], flush=True)
                t = timed(stream, lambda: [plan.launch(stream) for plan in chunks])
                table.append((shape, f"dlogits chunks {back[13:]}", t, t / t_other, "-"))
                print(table[-1], flush=True)
    print("\n| shape | what | us | x other | check |\n| --- | --- | --- | --- | --- |")
    for shape, what, t, ratio, check in table:
        print(f"| {shape} | {what} | {t:.1f} | {ratio:.3f} | {check} |")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
