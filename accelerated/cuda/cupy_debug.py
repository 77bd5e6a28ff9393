"""Debugging entry points of the CuPy backend: one part of the training step
run alone on host arrays, through the backend's own Model, buffers and
kernels. The GPU tests (tests/cuda/) and the kernel
experiments (dev/cuda/attention/check.py) both use them; training does not.

    from .cupy_debug import (cudnn_from_batch, fused_from_batch,
                                                       step_attention)

    with fused_from_batch(1):  # the project's fused attention kernels even at B=1
        y, dq, dk, dv = step_attention("bf16", q, k, v, dy)  # (B,H,T,E) each
    with cudnn_from_batch(1):  # cuDNN's attention where it serves the shape
        ...

Shapes use the project's letters (B, T, D, H, E; BT = B*T rows).
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

from ...reference.config import Config
from ...reference.layers.rope import rope_tables
from ...reference.params import registry

from . import attention_fused, cublas, cudnn_attention
from .buffers import Activations, Buffers, Gradient
from .model import Model
from .step import kernels_for


NEVER = 1 << 30  # a batch no step reaches


@contextlib.contextmanager
def fused_from_batch(n: int):
    """The step's attention the project's fused kernels from batch n on
    (bf16, head dims with kernels), instead of
    attention_fused.ATTENTION_FUSED_MIN_BATCH, and never cuDNN's, inside the
    block. Programs and Activations made inside it keep the path they got."""
    saved = attention_fused.ATTENTION_FUSED_MIN_BATCH, cudnn_attention.MIN_BATCH
    attention_fused.ATTENTION_FUSED_MIN_BATCH, cudnn_attention.MIN_BATCH = n, NEVER
    try:
        yield
    finally:
        attention_fused.ATTENTION_FUSED_MIN_BATCH, cudnn_attention.MIN_BATCH = saved


@contextlib.contextmanager
def cudnn_from_batch(n: int):
    """The step's attention cuDNN's from batch n on (bf16, where cuDNN serves
    the shape), instead of cudnn_attention.MIN_BATCH, inside the block."""
    saved = cudnn_attention.MIN_BATCH
    cudnn_attention.MIN_BATCH = n
    try:
        yield
    finally:
        cudnn_attention.MIN_BATCH = saved


def _as_float(x, precision: str) -> np.ndarray:
    """An operand buffer read back as float32 (bfloat16 bits widened)."""
    x = cupy.asnumpy(x)
    return (x.astype(np.uint32) << 16).view(np.float32) if precision == "bf16" else x


def step_attention(precision: str, q, k, v, dy, kernels=None):
    """The step's attention (Model.attention_forward, then
    attention_backward) of one layer on q, dy (B,H,T,E) and k, v
    (B,Hkv,T,E) float32 (under bf16 already bfloat16 values; Hkv < H:
    grouped heads), with the path the backend picks for them
    (attention_path). -> y, dq (B,H,T,E), dk, dv (B,Hkv,T,E) as float32 (y
    and dv are operands, dq and dk float32, or bfloat16 operands where
    cuDNN writes them so).

    kernels: a compile.Kernels to run instead of the backend's own for
    the precision (a kernel variant under test)."""
    Bn, H, T, E = q.shape
    D = H * E
    config = Config(vocab=8, context=T, d_model=D, n_layer=1, n_head=H, d_ff=8,
                    n_kv_head=k.shape[1])
    bf16 = precision == "bf16"
    stream = cupy.cuda.Stream(non_blocking=True)
    alloc = Buffers(stream)
    ws = alloc((cublas.WORKSPACE_BYTES,), np.uint8)
    blas = cublas.Cublas(stream.ptr, ws.data.ptr, cublas.WORKSPACE_BYTES)
    P = alloc((registry(config).total,), np.float32)  # the layer's weights are not read
    cos, sin = (alloc.upload(t) for t in rope_tables(T, config.rotary_dim))
    if kernels is None:
        kernels = kernels_for(precision)
    model = Model(config, precision, kernels, blas, P, P, Gradient.flat(P, alloc), cos, sin,
                  None)
    acts = Activations(config, Bn, T, np.uint16 if bf16 else np.float32, alloc, train=True)

    def rows(x):  # (B,H,T,E) -> (BT,H*E) in the operand type (H: x's heads)
        x = x.transpose(0, 2, 1, 3).reshape(Bn * T, -1)
        return x.astype(ml_dtypes.bfloat16).view(np.uint16) if bf16 else x

    def heads(x):  # (BT,H*E) -> (B,H,T,E) (H: x's heads)
        return x.reshape(Bn, T, -1, E).transpose(0, 2, 1, 3)

    acts.qkv[0].set(np.concatenate([rows(q), rows(k), rows(v)], axis=1), stream=stream)
    acts.dy.set(rows(dy), stream=stream)
    with stream:
        model.attention_forward(acts, 0)
        model.attention_backward(acts, 0)
    stream.synchronize()  # the results are read on the host next
    blas.close()
    dqk = _as_float(acts.dqk, "bf16" if acts.dqk.dtype == np.uint16 else "fp32")  # dq, dk
    lay = model.layout  # dqk's rows: dq | dk; dqkv's: dq | dk | dv
    dv = _as_float(acts.dqkv, precision)[:, lay.v.start:lay.v.stop]
    return (heads(_as_float(acts.y[0], precision)), heads(dqk[:, lay.q.start:lay.q.stop]),
            heads(dqk[:, lay.k.start:lay.k.stop]), heads(dv))
