"""The CuPy backend (SPEC sections 13 and 14), the production path: the
whole training step -- forward, loss, backward, AdamW -- written as CUDA
kernels (accelerated/kernels/*.cu, launched by accelerated/cuda_kernels.py)
and cuBLAS products (accelerated/cublas.py) on one stream, captured once as
a CUDA graph and replayed.

Memory plan. Everything the step touches is allocated at capture and kept
for the program's life: P, M, V as flat float32 vectors with the
registry's layout (a parameter is an offset into them), the update count t
and the bias corrections on the device, the input slot (B, T+1) int32, the
gradient G, and every activation the backward needs, per layer. The
activation and scratch buffers, and G's segments (Gradient: one per layer,
the embedding's and the final norm's, each live from its first gradient to
AdamW), live in one arena where buffers whose lifetimes in the step do not
overlap share storage (accelerated/memory_plan.py: a dry run of this very
step gives each buffer's first and last command before anything is
allocated; COPPELIUS_NO_MEMORY_PLAN=1 gives each its own storage). Kernels
and products write in place; nothing is allocated, copied to or from the
host, or synchronized inside the captured step. New buffers are filled with
NaN (bf16: all ones bits, also a NaN), so an element a kernel forgets to
write shows up (with the plan, a region another buffer wrote before may
hold its values instead: COPPELIUS_NO_MEMORY_PLAN=1 restores the check).

Matrix products. Linear weights are (out, in) row-major slices of P, and
the registry puts q, k, v next to each other (one (3D, D) product) and gate,
up too (one (2F, D) product).

Attention (attention_path: one of three, chosen by measured thresholds).
Under bf16, where cuDNN serves the shape (accelerated/cudnn_attention.py:
the nvidia-cudnn-frontend package importable, cuDNN's graphs supported),
from a batch of cudnn_attention.MIN_BATCH on, it is cuDNN's fused attention
(SDPA forward and backward, deterministic): q, k, v read in place from the
(BT, 3D) projection, y written in the (BT, D) layout, per row the softmax's
log-sum-exp kept for the backward, which writes dv into the projections'
gradient and dq, dk into the rope backward's input. Else, with a head dim
of 16, 32 or 64, from a batch of cuda_kernels.ATTENTION_FUSED_MIN_BATCH on,
the project's fused kernels (flash-attention style,
kernels/attention_fused.cu's attention_forward_e*): tensor-core tiles over
the keys, causal tiles skipped, nothing of size T^2 in memory; per row
only the maximum and the sum of the softmax are kept for the backward,
which recomputes p. Otherwise (fp32, other head dims, small batches, where
the fused kernels leave the chip idle) it runs per batch element as
strided batched products over the heads, reading q, k, v straight out of
the (BT, 3D) projection with row stride 3D and writing y in the (BT, D)
layout with row stride D, with the scores materialized (B, H, T, T)
float32 and kept per layer for the backward. The report gives the path and
the one reason cuDNN's is not used.

bf16 policy (SPEC 6). Every operand of every product is a bfloat16
(rounded to nearest even) and every product accumulates in float32. The
parameters' bfloat16 copy Pb is written by AdamW as it updates P (and once
at capture); activations that are only ever operands (the normalized h,
rotated q and k, v, attention probabilities p, y, silu(g)*u, dlogits, ds,
and the gradients flowing into products) are written as bfloat16 by the
kernel that produces them. Products whose result is only another product's
operand (y = p v, dy, dv) let cuBLAS round their float32 result once.

Tied embedding: its gradient is the unembedding product dlogits^T hf,
written into G, plus the gather gradient that embedding_backward adds to
the rows of the ids present, each summed in position order. Layernorm weight gradients are reduced in a fixed order at
the end of the step, for every norm at once.

AdamW (SPEC 7): a one-thread kernel advances the device update count t and
computes c1 = float32(1 - beta1^t), c2 = float32(1 - beta2^t) with pow in
float64, then one elementwise kernel updates P, M, V (and Pb).

Capture (SPEC 13): the step runs once eagerly (compiles, sizes cuBLAS's
choices; its commands must be the memory plan's dry run's), the state is
restored from the host (capture performs no update), then the step is
recorded on a non-blocking stream. Replay is one graph launch. A capture
CUDA refuses falls back to running the same step eagerly on every replay
(reference.program.capture_or_fallback: the report says why).
COPPELIUS_NO_CAPTURE=1 runs the same step eagerly on every replay instead:
for debugging, not for training.
"""

from __future__ import annotations

import bisect
import copy
import re
import weakref
from dataclasses import dataclass, fields

import numpy as np

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

from coppelius.reference.adamw import AdamWConstants, float32_of, schedule_table
from coppelius.reference.config import LAYERNORM_EPS, Config, Hyper
from coppelius.reference.errors import RunError
from coppelius.reference.layers.rope import rope_tables
from coppelius.reference.params import registry
from coppelius.reference.program import (CapturedProgram, MemoryAnalysis, PartitionOutcome,
                                         ReplayError, Resource, capture_enabled,
                                         capture_or_fallback, check_capture, check_logits_tokens,
                                         check_replay_state, check_tokens, compilation_report,
                                         StepRecords, Submitted)
from coppelius.reference.semantic import activation_names, partitions
from coppelius.reference.state import State

from . import cuda_kernels
from . import cublas
from . import cudnn_attention
from .cublas import WORKSPACE_BYTES, Cublas
from .distributed import Collectives
from .memory_plan import (Buffer, CommandLog, MemoryPlan, PlannedBuffers, VirtualArray,
                          VirtualBuffers, liveness, place, planning_enabled)

BACKEND = "cupy"
EPS = np.float32(float(LAYERNORM_EPS))


def available() -> bool:
    """CuPy importable and at least one CUDA device present; never raises."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False



@dataclass(frozen=True)
class AttentionPath:
    """How a step's attention runs: "cudnn" (cuDNN's fused attention,
    accelerated/cudnn_attention.py), "fused" (the project's fused kernels,
    kernels/attention_fused.cu) or "materialized" (the (B,H,T,T) scores and
    cuBLAS batched products); `reason`: why not cuDNN ('' when cuDNN)."""

    kind: str
    reason: str


def attention_path(config: Config, precision: str, batch: int, context: int | None = None,
                   train: bool = True) -> AttentionPath:
    """The attention of a (batch, context) step (context: config.context by
    default; train: the backward too). Under bf16: cuDNN's from batch
    cudnn_attention.MIN_BATCH on where cuDNN serves the shape, else the
    project's fused kernels for their head dims from batch
    cuda_kernels.ATTENTION_FUSED_MIN_BATCH on, else the materialized scores
    (the thresholds are measured: each path's time per layer in
    cuda_kernels.py and cudnn_attention.py). fp32 keeps the materialized
    scores: both fused paths take bfloat16 operands."""
    if precision != "bf16":
        return AttentionPath("materialized", "fp32 policy: cuDNN's and the fused kernels' "
                                             "attention take bfloat16 operands")
    T = config.context if context is None else context
    H, E = config.n_head, config.head_dim
    if batch < cudnn_attention.MIN_BATCH:
        why = (f"batch {batch} < {cudnn_attention.MIN_BATCH}: cuDNN's attention is slower there "
               "than the project's")
    else:
        why = cudnn_attention.unavailable(batch, T, H, E, cuda_kernels.attention_scale(E), train)
    if not why:
        return AttentionPath("cudnn", "")
    kernels = E in cuda_kernels.ATTENTION_HEAD_DIMS and \
        batch >= cuda_kernels.ATTENTION_FUSED_MIN_BATCH
    return AttentionPath("fused" if kernels else "materialized", why)


def fused_attention(config: Config, precision: str, batch: int) -> bool:
    """Whether the attention of a (batch, T) step keeps no (T, T) scores in
    memory (cuDNN's or the project's fused kernels; else the materialized
    scores and cuBLAS batched products)."""
    return attention_path(config, precision, batch).kind != "materialized"


# The training step's classifier, cross-entropy and classifier backward run
# by chunks of rows (Model.classifier_loss): a chunk's float32 logits are at
# most this many bytes, so neither the (BT, V) logits nor their (BT, V)
# gradient ever exist whole; each chunk's cross-entropy reads the logits
# right after its product wrote them, and the chunk's gradient feeds the two
# backward products at once.
LOGITS_CHUNK_BYTES = 96 << 20


def logits_chunk_rows(rows: int, vocab: int) -> int:
    """Rows of one chunk of the step's logits (of `rows` in all): as many
    as LOGITS_CHUNK_BYTES of float32 logits hold, a multiple of 128 (whole
    tiles of the product) when that is at least 128, at least 1, at most
    `rows`."""
    n = max(1, LOGITS_CHUNK_BYTES // (4 * vocab))
    if n >= 128:
        n -= n % 128
    return min(rows, n)


def _ptr(a, offset: int = 0) -> int:
    """Device address of element `offset` of the contiguous array a."""
    return a.data.ptr + offset * a.itemsize


class Buffers:
    """Allocates device buffers, filled with NaN, and counts their bytes. The
    fills run on the program's stream, so they are ordered before its work
    (a non-blocking stream does not wait for the legacy default stream)."""

    def __init__(self, stream):
        self.stream = stream
        self.bytes = 0

    def __call__(self, shape, dtype, zeros=False):
        dtype = np.dtype(dtype)
        with self.stream:
            if zeros:
                a = cupy.zeros(shape, dtype=dtype)
            elif dtype == np.float32:
                a = cupy.full(shape, np.nan, dtype=dtype)
            elif dtype == np.uint16:  # bfloat16 bits: 0xffff is a NaN
                a = cupy.full(shape, 0xFFFF, dtype=dtype)
            else:
                a = cupy.zeros(shape, dtype=dtype)
        self.bytes += a.nbytes
        return a

    def upload(self, host):
        with self.stream:
            a = cupy.asarray(host)
        self.bytes += a.nbytes
        return a

    def arena(self, nbytes: int):
        """One uint8 buffer for the memory plan's shared storage, all ones
        bits: a NaN in float32 and bfloat16 alike."""
        with self.stream:
            a = cupy.full((nbytes,), 0xFF, dtype=np.uint8)
        self.bytes += a.nbytes
        return a


@dataclass(frozen=True)
class LayerOffsets:
    """Offsets into P (and G) of one layer's parameters."""

    attn_norm: int  # attn_norm.weight (D,), its bias right after
    qkv: int  # q, k, v weights, adjacent: one (3D, D) matrix
    o: int  # (D, D)
    mlp_norm: int  # mlp_norm.weight (D,), its bias right after
    gate_up: int  # gate, up weights, adjacent: one (2F, D) matrix
    down: int  # (D, F)


def layer_offsets(config: Config) -> list:
    """Per layer, the offsets of its parameters; checks the adjacency the
    fused products rely on."""
    reg = registry(config)
    D, F = config.d_model, config.d_ff
    out = []
    for l in range(config.n_layer):
        s = {name.split(".", 2)[2]: spec.offset for name, spec in reg.by_name.items()
             if name.startswith(f"layers.{l}.")}
        assert s["attn.k.weight"] == s["attn.q.weight"] + D * D
        assert s["attn.v.weight"] == s["attn.k.weight"] + D * D
        assert s["mlp.up.weight"] == s["mlp.gate.weight"] + F * D
        assert s["attn_norm.bias"] == s["attn_norm.weight"] + D
        assert s["mlp_norm.bias"] == s["mlp_norm.weight"] + D
        out.append(LayerOffsets(s["attn_norm.weight"], s["attn.q.weight"], s["attn.o.weight"],
                                s["mlp_norm.weight"], s["mlp.gate.weight"], s["mlp.down.weight"]))
    return out


def norm_offsets(config: Config) -> np.ndarray:
    """(2L+1,) int64: offsets of every norm's weight, in the order of the
    layernorm partials: 2l attn_norm, 2l+1 mlp_norm, 2L final_norm."""
    reg = registry(config)
    offsets = []
    for l in range(config.n_layer):
        offsets += [reg[f"layers.{l}.attn_norm.weight"].offset,
                    reg[f"layers.{l}.mlp_norm.weight"].offset]
    final = reg["final_norm.weight"].offset
    assert reg["final_norm.bias"].offset == final + config.d_model
    return np.array(offsets + [final], dtype=np.int64)


def address_table(alloc, values: list, dtype):
    """A small buffer from `alloc` holding `values` (addresses of buffers,
    with their offsets), written once, at allocation, for kernels that reach
    several buffers through it; in the memory plan's dry run only allocated."""
    table = alloc(np.shape(values), dtype)
    if not isinstance(table, VirtualArray):
        table.set(np.array(values, dtype), stream=getattr(alloc, "stream", None))
    return table


def gradient_segments(config: Config) -> list:
    """[(first element, elements)] of the step's gradient segments, in the
    registry's order: the embedding's, one per layer (its norms, attention
    and MLP), the final norm's."""
    reg = registry(config)
    starts = ([reg["tok_embedding.weight"].offset]
              + [reg[f"layers.{l}.attn_norm.weight"].offset for l in range(config.n_layer)]
              + [reg["final_norm.weight"].offset])
    assert starts == sorted(starts) and starts[0] == 0, starts
    return [(start, end - start) for start, end in zip(starts, starts[1:] + [reg.total])]


class Gradient:
    """G, the gradient: (N,) float32 in the registry's layout, stored as
    segments. The step's (train without accumulation, on one GPU) has one
    per layer plus the embedding's and the final norm's (gradient_segments),
    each a buffer of the memory plan's arena, live from the first product
    or kernel that writes it to AdamW: at the step's fullest point (the
    loss, the last layer's backward) only a few exist, where a flat G would
    hold all N elements from one step to the next. With accumulation or
    several ranks G carries a sum across passes, or is all-reduced whole: one
    segment, a flat buffer of the state (`flat`).

    Products and kernels that write one parameter's gradient get an address
    (ptr, view); the kernels that reach G as a whole (AdamW, the norm, the
    layer norms' weight gradients) read `table`, (S, 2) int64, each
    segment's first element and address (kernels/common.cuh grad_at),
    written at allocation."""

    def __init__(self, starts: list, parts: list, alloc):
        # segment i holds elements [starts[i], starts[i] + parts[i].size), in order
        assert starts[0] == 0 and all(a + p.size == b for a, p, b in
                                      zip(starts, parts, starts[1:])), starts
        self.starts, self.parts = list(starts), list(parts)
        self.size = starts[-1] + parts[-1].size
        self.table = address_table(alloc, [[start, part.data.ptr]
                                           for start, part in zip(starts, parts)], np.int64)

    @classmethod
    def segments(cls, config: Config, alloc) -> "Gradient":
        """The step's segments (gradient_segments), each a buffer from alloc."""
        segments = gradient_segments(config)
        return cls([start for start, _ in segments],
                   [alloc((n,), np.float32) for _, n in segments], alloc)

    @classmethod
    def flat(cls, G, alloc) -> "Gradient":
        """One segment: the flat (N,) float32 buffer G."""
        return cls([0], [G], alloc)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def vector(self) -> bool:
        """Whether the kernels may read G 16 bytes at a time: every
        segment's start a multiple of 4 elements, its address 16-byte aligned."""
        return all(s % 4 == 0 for s in self.starts) and all(p.data.ptr % 16 == 0
                                                            for p in self.parts)

    def _segment(self, offset: int):
        i = bisect.bisect_right(self.starts, offset) - 1
        return self.parts[i], offset - self.starts[i]

    def ptr(self, offset: int) -> int:
        """Device address of element `offset` of G."""
        part, at = self._segment(offset)
        return _ptr(part, at)

    def view(self, offset: int, n: int):
        """Elements [offset, offset + n) of G, inside one segment."""
        part, at = self._segment(offset)
        assert at + n <= part.size, (offset, n)
        return part[at:at + n]

    def get(self, stream) -> np.ndarray:
        """(N,) float32 on the host."""
        return np.concatenate([part.get(stream=stream) for part in self.parts])

    def names(self, label: str) -> dict:
        """{address: name} of the buffers (the memory plan's report): a flat
        G is `label`; segments are G.tok_embedding, G.layers.<l>, G.final_norm."""
        if len(self.parts) == 1:
            out = {self.parts[0].ptr: label}
        else:
            L = len(self.parts) - 2
            out = {part.ptr: name for part, name in zip(
                self.parts, ["G.tok_embedding"] + [f"G.layers.{l}" for l in range(L)]
                + ["G.final_norm"])}
        out[self.table.ptr] = f"{label}.table"
        return out


class Activations:
    """Every buffer one step of (B, T) needs. With train=False (an eager
    forward) one layer's buffers serve every layer, the logits are whole
    and the backward's buffers are not allocated; with train=True the
    logits buffer holds one chunk of logits_chunk_rows(BT, V) rows. With
    recompute the gate and up products are not kept per layer: the
    forward's serve every layer, and the backward computes them again
    (Model.backward) into a buffer of its own."""

    def __init__(self, config: Config, B: int, T: int, op_dtype, alloc: Buffers, train: bool,
                 recompute: bool = False):
        D, F, H, V, L = config.d_model, config.d_ff, config.n_head, config.vocab, config.n_layer
        BT = B * T
        self.B, self.T, self.train = B, T, train
        self.recompute = recompute = recompute and train
        f32 = np.float32
        bf16 = op_dtype == np.uint16
        self.path = attention_path(config, "bf16" if bf16 else "fp32", B, T, train)
        cudnn = self.path.kind == "cudnn"
        self.fused = fused = self.path.kind != "materialized"  # no (T, T) scores in memory
        n = L if train else 1

        def per_layer(shape, dtype):
            own = [alloc(shape, dtype) for _ in range(n)]
            return [own[l % n] for l in range(L)]

        # forward (saved for the backward when training)
        self.x = per_layer((BT, D), f32) + [alloc((BT, D), f32)]  # residual input of layer l; x[L] final
        self.x_mid = per_layer((BT, D), f32)  # residual after attention
        self.mean1, self.rstd1 = per_layer((BT,), f32), per_layer((BT,), f32)
        self.mean2, self.rstd2 = per_layer((BT,), f32), per_layer((BT,), f32)
        # a norm's output, operand: one for both norms of every layer, read at
        # once by the product after it (q,k,v or gate,up); the backward's
        # layernorm writes it again, into h_back, for that product's weight
        # gradient
        self.h = alloc((BT, D), op_dtype)
        self.qkv = per_layer((BT, 3 * D), op_dtype)  # rotated q, k and v, operands
        if cudnn:  # per row: the softmax's log-sum-exp, for the backward
            self.att_stats = per_layer((B, H, T), f32)
        elif fused:  # per row: the softmax's maximum and sum, for the backward
            self.att_m, self.att_l = per_layer((B, H, T), f32), per_layer((B, H, T), f32)
        else:
            self.att = per_layer((B, H, T, T), f32)  # probabilities p
        self.y = per_layer((BT, D), op_dtype)  # p v, heads side by side, operand
        # cuDNN's workspaces, scratch of each attention execution: one per
        # direction, so that the backward's (16 MiB per context of the
        # coppelius preset) is not live in the forward and at the loss, the
        # step's peak, where the plan puts it over buffers dead by then
        self.att_workspace = {"forward": None, "backward": None}
        directions = (("forward", "backward") if train else ("forward",)) if cudnn else ()
        for direction in directions:
            nbytes = cudnn_attention.workspace_bytes(direction, B, T, H, config.head_dim,
                                                     cuda_kernels.attention_scale(config.head_dim))
            self.att_workspace[direction] = alloc((nbytes,), np.uint8) if nbytes else None
        # gate and up projections: kept per layer, or (recompute) one buffer
        # for every layer's forward and, below, one for the backward's
        self.gu = [alloc((BT, 2 * F), f32)] * L if recompute else per_layer((BT, 2 * F), f32)
        # silu(g) * u, operand: one for every layer, read at once by the down
        # product; the backward writes it again (swiglu_backward), into
        # a_back, for the down weight's gradient
        self.a = alloc((BT, F), op_dtype)
        self.meanf, self.rstdf = alloc((BT,), f32), alloc((BT,), f32)
        self.hf = alloc((BT, D), op_dtype)  # final_norm(x[L]), operand
        # the logits: whole for the eager forward; the step's classifier and
        # cross-entropy take them one chunk of rows at a time (Model.classifier_loss)
        self.logits = alloc((logits_chunk_rows(BT, V) if train else BT, V), f32)
        # scratch
        self.qkv32 = alloc((BT, 3 * D), f32)  # projections before rope
        self.proj = alloc((BT, D), f32)  # output of the o and down products
        # p as an operand: the kernels write its causal part only, the zeros
        # above the diagonal stay from here on
        self.att_op = alloc((B, H, T, T), op_dtype, zeros=True) if bf16 and not fused else None
        if not train:
            return
        # loss and backward
        self.ce = alloc((BT,), f32)  # row losses
        self.loss = alloc((1,), f32)
        self.dlogits = alloc((self.logits.shape[0], V), op_dtype)  # one chunk's, as the logits
        self.dh = alloc((BT, D), f32)  # gradient at a norm's output
        self.dres = alloc((BT, D), f32)  # gradient of the residual stream
        self.dres_op = alloc((BT, D), op_dtype) if bf16 else None
        self.da = alloc((BT, F), f32)
        self.dgu = alloc((BT, 2 * F), op_dtype)
        self.gu_back = alloc((BT, 2 * F), f32) if recompute else None
        # the forward's h and a, written again by the backward: buffers of
        # their own, so that the forward's are not live from the last layer's
        # forward to the loss, the step's peak, nor these before the backward
        self.h_back, self.a_back = alloc((BT, D), op_dtype), alloc((BT, F), op_dtype)
        self.dy = alloc((BT, D), op_dtype)
        if self.path.kind == "fused":  # (cuDNN's row terms live in its workspace)
            self.att_dot = alloc((B, H, T), f32)  # sum_j dp p per row
        elif not fused:
            self.dp = alloc((B, H, T, T), f32)
            self.ds = alloc((B, H, T, T), op_dtype, zeros=True)  # causal part written, as att_op
        # gradients of the rotated q, k: float32, or bfloat16 operands as
        # cuDNN's attention writes them (the rope backward reads either)
        self.dqk = alloc((BT, 2 * D), op_dtype if cudnn else f32)
        self.dqkv = alloc((BT, 3 * D), op_dtype)  # gradients of the q, k, v projections
        # each norm's weight and bias partial sums (2l attn_norm, 2l+1 mlp_norm,
        # 2L final_norm), reduced at the end of the backward through a table
        # of their addresses: buffers of their own, so that those of the
        # layers not yet reached are not live
        self.ln_partials = [alloc((cuda_kernels.layernorm_chunks(BT), 2 * D), f32)
                            for _ in range(2 * L + 1)]
        self.ln_table = address_table(alloc, [p.data.ptr for p in self.ln_partials], np.uint64)
        self.emb_index = alloc((V, 2), np.int32)  # per id: first position, count (scratch)


class Model:
    """The step's kernels and products over the program's buffers."""

    def __init__(self, config: Config, precision: str, kernels, blas, P, Pop, G, cos, sin,
                 norms):
        self.config, self.precision = config, precision
        self.norm_offsets = norms  # (2L+1,) int64 on the device: see norm_offsets()
        self.k, self.blas = kernels, blas
        self.P, self.Pop = P, Pop  # Pop: the parameters as operands (Pb or P)
        self.G = G  # Gradient
        self.cos, self.sin = cos, sin  # (T, E/2)
        self.op = "bfloat16" if precision == "bf16" else "float32"  # cuBLAS type of operands
        self.layers = layer_offsets(config)
        self.scale = cuda_kernels.attention_scale(config.head_dim)
        D = config.d_model
        V = config.vocab
        self.emb = registry(config)["tok_embedding.weight"].offset  # (V, D), tied
        self.final_norm = registry(config)["final_norm.weight"].offset
        self.G_emb = G.view(self.emb, V * D).reshape(V, D)
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
        # (part: (i, n), the i-th of n equal column blocks). Never set on the
        # captured program: a tap reads the device, which a capture forbids.
        if self.tap is not None:
            self.tap(name, buffer, part)

    def norm(self, offset):
        # (weight, bias) views of P for a norm whose weight starts at offset
        D = self.config.d_model
        return self.P[offset:offset + D], self.P[offset + D:offset + 2 * D]

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
        backward kept in a; an eager forward's a (train=False) also gets the
        whole logits (BT, V). The step's logits are classifier_loss()'s, by chunks."""
        c, k = self.config, self.k
        L, D, F, V = c.n_layer, c.d_model, c.d_ff, c.vocab
        T = a.T
        self.at("embedding")
        k.embedding_forward(ids, ids_stride, T, self.P[self.emb:self.emb + V * D].reshape(V, D),
                            a.x[0])
        for l, w in enumerate(self.layers):
            p = f"layers.{l}."
            # h = attn_norm(x), after the previous layer's residual add
            prev, add = (a.x[0], None) if l == 0 else (a.x_mid[l - 1], a.proj)
            self.at(*([f"layers.{l - 1}.mlp.residual"] if l else []), p + "attn_norm")
            k.layernorm_forward(prev, add, a.x[l] if l else None, a.h, a.mean1[l], a.rstd1[l],
                                *self.norm(w.attn_norm), EPS)
            self._tap(p + "attn_norm.out", a.h)
            self.at(p + "attn.q", p + "attn.k", p + "attn.v")
            self.linear_forward(a.h, w.qkv, a.qkv32, 3 * D, D)  # (BT,3D)
            self.at(p + "attn.rope_q", p + "attn.rope_k")
            k.rope_forward(a.qkv32, a.qkv[l], self.cos, self.sin, T, c.n_head)
            self.at(p + "attn.core")
            self.attention_forward(a, l)  # -> a.y[l] (BT,D)
            self.at(p + "attn.o")
            self.linear_forward(a.y[l], w.o, a.proj, D, D)
            # x_mid = x + y Wo^T ; h = mlp_norm(x_mid)
            self.at(p + "attn.residual", p + "mlp_norm")
            k.layernorm_forward(a.x[l], a.proj, a.x_mid[l], a.h, a.mean2[l], a.rstd2[l],
                                *self.norm(w.mlp_norm), EPS)
            self._tap(p + "mlp_norm.out", a.h)
            self.at(p + "mlp.gate", p + "mlp.up")
            self.linear_forward(a.h, w.gate_up, a.gu[l], 2 * F, D)  # (BT,2F)
            self.at(p + "mlp.swiglu")
            k.swiglu_forward(a.gu[l], a.a)
            self._tap(p + "mlp.h", a.a)
            self.at(p + "mlp.down")
            self.linear_forward(a.a, w.down, a.proj, D, F)
        # x[L] = x_mid + down(...) ; logits = final_norm(x[L]) W_emb^T
        self.at(f"layers.{L - 1}.mlp.residual", "final_norm")
        k.layernorm_forward(a.x_mid[L - 1], a.proj, a.x[L], a.hf, a.meanf, a.rstdf,
                            *self.norm(self.final_norm), EPS)
        if not a.train:
            self.at("lm_head")
            self.linear_forward(a.hf, self.emb, a.logits, V, D)

    def classifier_loss(self, a: Activations, ids, ids_stride: int, ce, dce,
                        backward: bool = True) -> None:
        """a.hf (BT, D) -> the row losses ce (BT), a.dh (BT, D) the gradient
        at hf, and the unembedding part of G_emb, for the mean's gradient
        dce, by chunks of a.logits' rows: each chunk's logits = hf W_emb^T
        into a.logits, the cross-entropy on them writes the chunk's rows of
        ce and its logits gradient into a.dlogits, then dh's rows =
        dlogits W_emb and G_emb += dlogits^T hf's rows (the first chunk
        writes G_emb, the others add: float32 sums, in chunk order); with
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
            self.linear_forward(hf, self.emb, logits, V, D)
            self._tap("logits", logits)
            self.at("loss", "loss.backward")
            self.k.crossentropy_forward_backward(logits, ids, ids_stride, a.T, ce[r0:r0 + n],
                                                 dlogits, dce, row0=r0)
            if not backward:
                continue
            self._tap("dlogits", dlogits)
            # logits = hf W_emb^T: dhf = dlogits W_emb, and the unembedding part of G_emb
            self.at("lm_head.backward")
            self.linear_backward_input(dlogits, self.emb, a.dh[r0:r0 + n], V, D)
            self.linear_backward_weight(dlogits, hf, self.emb, V, D, beta=0.0 if r0 == 0 else 1.0)

    def attention_forward(self, a: Activations, l: int) -> None:
        """a.qkv[l] (BT,3D) -> a.y[l] (BT,D); kept for the backward: a.att[l]
        (B,H,T,T) probabilities, or the fused kernels' a.att_m[l], a.att_l[l]
        (B,H,T) row maxima and sums."""
        c = self.config
        B, T, D, H, E = a.B, a.T, c.d_model, c.n_head, c.head_dim
        if a.path.kind == "cudnn":
            qkv = a.qkv[l]
            self._cudnn("forward", a, (_ptr(qkv), _ptr(qkv, D), _ptr(qkv, 2 * D), _ptr(a.y[l]),
                                       _ptr(a.att_stats[l])))
            return
        if a.fused:
            self.k.attention_forward(a.qkv[l], a.y[l], a.att_m[l], a.att_l[l], B, T, H,
                                     self.scale)
            return
        qkv, att, y = a.qkv[l], a.att[l], a.y[l]
        for b in range(B):  # one strided batched product over the H heads
            q, kk = _ptr(qkv, b * T * 3 * D), _ptr(qkv, b * T * 3 * D + D)
            # s_h (T,T) = q_h (T,E) @ k_h^T
            self.gemm(False, True, T, T, E, q, 3 * D, kk, 3 * D, _ptr(att, b * H * T * T), T,
                      batch=H, stride_a=E, stride_b=E, stride_c=T * T)
        self.k.attention_softmax_forward(att, a.att_op, self.scale)
        p = self.operand(att, a.att_op)
        for b in range(B):
            v = _ptr(qkv, b * T * 3 * D + 2 * D)
            # y_h (T,E) = p_h (T,T) @ v_h, at column h*E of y
            self.gemm(False, False, T, E, T, _ptr(p, b * H * T * T), T, v, 3 * D,
                      _ptr(y, b * T * D), D, c_type=self.op, batch=H, stride_a=T * T, stride_b=E,
                      stride_c=E)

    # -- loss and backward --------------------------------------------------------

    def backward(self, a: Activations, ids, ids_stride: int, rows: int | None = None,
                 ce=None) -> None:
        """Logits (by chunks: classifier_loss()), row losses, mean loss and every
        parameter's gradient into G, after forward(). A
        micro-batch of an accumulated step (SPEC 19) passes `rows`, the
        whole batch's B*T (its gradient is scaled by 1/rows), and `ce`, its
        slice of the whole batch's row losses; it computes no mean loss."""
        c, k = self.config, self.k
        L, D, F = c.n_layer, c.d_model, c.d_ff
        T, BT = a.T, a.B * a.T
        dce = np.float32(1.0 / (BT if rows is None else rows))  # d mean / d ce: float32 1/n
        # the logits, row losses, dh and the unembedding gradient, by chunks of rows
        self.classifier_loss(a, ids, ids_stride, a.ce if ce is None else ce, dce)
        if rows is None:
            self.at("loss.mean")
            k.mean_loss(a.ce, a.loss)
        self._tap("final_norm.dout", a.dh)
        dres_op = self.operand(a.dres, a.dres_op)
        self.at("final_norm.backward")
        k.layernorm_backward(a.dh, None, a.x[L], a.meanf, a.rstdf, self.norm(self.final_norm)[0],
                             a.dres, a.dres_op, a.ln_partials[2 * L])
        for l in reversed(range(L)):
            w = self.layers[l]
            p = f"layers.{l}."
            self._tap(p + "dout", a.dres)
            # x[l+1] = x_mid + down(silu(gate(h)) * up(h)), h = mlp_norm(x_mid)
            # a = silu(g) * u is not kept per layer: da = dres Wdown first, then
            # the swiglu backward writes a again (the forward's bits) for the
            # down weight's gradient dres^T a
            self.at(p + "mlp.down.backward")
            self.linear_backward_input(dres_op, w.down, a.da, D, F)
            self._tap(p + "mlp.dh", a.da)
            gu = a.gu[l]
            weight, bias = self.norm(w.mlp_norm)
            if a.recompute:
                # h = mlp_norm(x_mid) and g, u = h Wgate^T, h Wup^T again, by
                # the forward's kernel and product: the forward's bits
                self.at(p + "mlp_norm", p + "mlp.gate", p + "mlp.up")
                k.layernorm_forward(a.x_mid[l], None, None, a.h_back, a.mean2[l], a.rstd2[l],
                                    weight, bias, EPS)
                self.linear_forward(a.h_back, w.gate_up, a.gu_back, 2 * F, D)
                gu = a.gu_back
            self.at(p + "mlp.swiglu.backward", p + "mlp.swiglu")
            k.swiglu_backward(a.da, gu, a.dgu, a.a_back)
            self.at(p + "mlp.down.backward")
            self.linear_backward_weight(dres_op, a.a_back, w.down, D, F)
            self._tap(p + "mlp.dgate", a.dgu, (0, 2))
            self._tap(p + "mlp.dup", a.dgu, (1, 2))
            # dh = dh_gate + dh_up: the sum inside one (BT,2F) x (2F,D) product;
            # h = mlp_norm(x_mid) is not kept per layer either: the layernorm
            # backward writes it again (the forward's bits) for the gate and up
            # weights' gradient dgu^T h
            self.at(p + "mlp.gate.backward", p + "mlp.up.backward", p + "mlp_norm.dout_sum")
            self.linear_backward_input(a.dgu, w.gate_up, a.dh, 2 * F, D)
            self._tap(p + "mlp_norm.dout", a.dh)
            self.at(p + "mlp_norm.backward", p + "mlp.residual.backward",
                    *(() if a.recompute else (p + "mlp_norm",)))
            # (with recompute h_back holds h already)
            k.layernorm_backward(a.dh, a.dres, a.x_mid[l], a.mean2[l], a.rstd2[l], weight, a.dres,
                                 a.dres_op, a.ln_partials[2 * l + 1],
                                 **({} if a.recompute else {"b": bias, "h": a.h_back}))
            self.at(p + "mlp.gate.backward", p + "mlp.up.backward")
            self.linear_backward_weight(a.dgu, a.h_back, w.gate_up, 2 * F, D)
            self._tap(p + "dmid", a.dres)
            # x_mid = x + o(attention(rope(q(h)), rope(k(h)), v(h))), h = attn_norm(x)
            self.at(p + "attn.o.backward")
            self.gemm(False, False, BT, D, D, _ptr(dres_op), D, _ptr(self.Pop, w.o), D,
                      _ptr(a.dy), D, c_type=self.op)  # dy = dres Wo, an operand only
            self.gemm(True, False, D, D, BT, _ptr(dres_op), D, _ptr(a.y[l]), D, self.G.ptr(w.o),
                      D)
            self._tap(p + "attn.dy", a.dy)
            self.at(p + "attn.core.backward")
            self.attention_backward(a, l)  # -> a.dqkv (BT,3D)
            # dh = dh_q + dh_k + dh_v: the sum inside one (BT,3D) x (3D,D) product
            # (h = attn_norm(x) written again by the layernorm backward, as above)
            self.at(p + "attn.q.backward", p + "attn.k.backward", p + "attn.v.backward",
                    p + "attn_norm.dout_sum")
            self.linear_backward_input(a.dqkv, w.qkv, a.dh, 3 * D, D)
            self._tap(p + "attn_norm.dout", a.dh)
            self.at(p + "attn_norm.backward", p + "attn.residual.backward", p + "attn_norm")
            weight, bias = self.norm(w.attn_norm)
            k.layernorm_backward(a.dh, a.dres, a.x[l], a.mean1[l], a.rstd1[l], weight, a.dres,
                                 a.dres_op, a.ln_partials[2 * l], b=bias, h=a.h_back)
            self.at(p + "attn.q.backward", p + "attn.k.backward", p + "attn.v.backward")
            self.linear_backward_weight(a.dqkv, a.h_back, w.qkv, 3 * D, D)
        self._tap("embedding.dout", a.dres)
        # the gather gradient, added to the unembedding gradient already in G_emb
        self.at("embedding.backward", "tok_embedding.dweight_sum")
        k.embedding_backward(a.dres, ids, ids_stride, T, self.G_emb, a.emb_index)
        # every norm's weight and bias gradients, reduced from their partials at once
        self.at("final_norm.backward", *(f"layers.{l}.{norm}.backward" for l in range(L)
                                         for norm in ("attn_norm", "mlp_norm")))
        k.layernorm_param_grads(a.ln_partials, a.ln_table, self.norm_offsets, self.G)

    def attention_backward(self, a: Activations, l: int) -> None:
        """a.dy (BT,D) -> a.dqkv (BT,3D): dq, dk through rope, and dv."""
        c = self.config
        B, T, D, H, E = a.B, a.T, c.d_model, c.n_head, c.head_dim
        if a.path.kind == "cudnn":
            # q, k, v, y, dy, stats -> dq, dk (into dqk), dv (into dqkv[:, 2D:])
            qkv = a.qkv[l]
            self._cudnn("backward", a, (_ptr(qkv), _ptr(qkv, D), _ptr(qkv, 2 * D), _ptr(a.y[l]),
                                        _ptr(a.dy), _ptr(a.att_stats[l]), _ptr(a.dqk),
                                        _ptr(a.dqk, D), _ptr(a.dqkv, 2 * D)))
            self._rope_backward(a, l)
            return
        if a.fused:
            self.k.attention_backward(a.qkv[l], a.y[l], a.dy, a.att_m[l], a.att_l[l], a.att_dot,
                                      a.dqk, a.dqkv, B, T, H, self.scale)
            self._rope_backward(a, l)
            return
        qkv, att = a.qkv[l], a.att[l]
        for b in range(B):
            v = _ptr(qkv, b * T * 3 * D + 2 * D)
            # dp_h (T,T) = dy_h (T,E) @ v_h^T
            self.gemm(False, True, T, T, E, _ptr(a.dy, b * T * D), D, v, 3 * D,
                      _ptr(a.dp, b * H * T * T), T, batch=H, stride_a=E, stride_b=E,
                      stride_c=T * T)
        self.k.attention_softmax_backward(att, a.dp, a.ds, a.att_op, self.scale)
        p = self.operand(att, a.att_op)
        for b in range(B):
            q, kk = _ptr(qkv, b * T * 3 * D), _ptr(qkv, b * T * 3 * D + D)
            hh = dict(batch=H, stride_a=T * T, stride_b=E, stride_c=E)
            # dv_h (T,E) = p_h^T dy_h, an operand only: straight into dqkv[:, 2D:]
            self.gemm(True, False, T, E, T, _ptr(p, b * H * T * T), T, _ptr(a.dy, b * T * D), D,
                      _ptr(a.dqkv, b * T * 3 * D + 2 * D), 3 * D, c_type=self.op, **hh)
            # dq_h = ds_h k_h ; dk_h = ds_h^T q_h  (T,E), into dqk (BT,2D)
            ds = _ptr(a.ds, b * H * T * T)
            self.gemm(False, False, T, E, T, ds, T, kk, 3 * D, _ptr(a.dqk, b * T * 2 * D), 2 * D,
                      **hh)
            self.gemm(True, False, T, E, T, ds, T, q, 3 * D, _ptr(a.dqk, b * T * 2 * D + D),
                      2 * D, **hh)
        self._rope_backward(a, l)

    def _cudnn(self, direction: str, a: Activations, pointers: tuple) -> None:
        """One execution of cuDNN's attention graph for a's shape on the
        addresses `pointers` (cudnn_attention.Graph.tensors' order) with the
        workspace a.att_workspace[direction]; in the memory plan's dry run
        (buffers without storage) only recorded."""
        c = self.config
        g = cudnn_attention.graph(direction, a.B, a.T, c.n_head, c.head_dim, self.scale)
        buffer = a.att_workspace[direction]
        workspace = 0 if buffer is None else _ptr(buffer)
        if self.k.log is not None:
            self.k.log.add("library", f"cudnn_sdpa_{direction}", g.launch(),
                           (*pointers, workspace))
        if not isinstance(a.y[0], VirtualArray):
            g.execute(pointers, workspace)

    def _rope_backward(self, a: Activations, l: int) -> None:
        """a.dqk (BT,2D), the gradients of the rotated q and k (float32, or
        bfloat16 operands as cuDNN writes them) -> a.dqkv[:, :2D]."""
        p = f"layers.{l}."
        self._tap(p + "attn.dq", a.dqk, (0, 2))
        self._tap(p + "attn.dk", a.dqk, (1, 2))
        self._tap(p + "attn.dv", a.dqkv, (2, 3))
        self.at(p + "attn.rope_q.backward", p + "attn.rope_k.backward")
        if a.dqk.dtype == np.float32:
            self.k.rope_backward(a.dqk, a.dqkv, self.cos, self.sin, a.T, self.config.n_head)
        else:
            self.k.rope_backward_operand(a.dqk, a.dqkv, self.cos, self.sin, a.T,
                                         self.config.n_head)


class Event:
    """A submitted replay: wait() blocks until the step has finished."""

    def __init__(self, event):
        self.event = event  # cupy.cuda.Event recorded after the graph launch

    def wait(self) -> None:
        self.event.synchronize()


class TimedEvent(Event):
    """A replay between two device timestamps (replay_timed())."""

    def __init__(self, start, end):
        super().__init__(end)
        self.start = start

    def device_seconds(self) -> float:
        """Device time between the timestamps; waits for the step."""
        self.event.synchronize()
        return cupy.cuda.get_elapsed_time(self.start, self.event) / 1e3


def pinned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized host array in page-locked memory."""
    n = int(np.prod(shape))
    memory = cupy.cuda.alloc_pinned_memory(max(n, 1) * np.dtype(dtype).itemsize)
    return np.frombuffer(memory, dtype, n).reshape(shape)


class StagingSlot:
    """Pinned host buffers for one submitted step: its tokens on the way in,
    its row losses, loss and norm on the way out. With W ranks the tokens
    are this rank's b = B/W contexts, the row losses all B, and a third
    scalar is the stop count (SPEC 19)."""

    def __init__(self, B: int, T: int, b: int | None = None):
        self.ids = pinned_empty((B if b is None else b, T + 1), np.int32)
        self.rows = pinned_empty((B * T,), np.float32)
        self.scalars = pinned_empty((3,), np.float32)  # the loss, the norm, the stop count
        self.copied = None  # the event recorded after the copies out
        self.submitted = None  # the step whose records the slot holds


class DeviceState:
    """The optimizer state the captured graph reads and writes."""

    backend = BACKEND

    def __init__(self, P, M, V, t):
        self.P, self.M, self.V, self.t = P, M, V, t  # (N,) float32 x3, (1,) int32



_KERNELS = {}  # precision -> Kernels: each policy's module is compiled once per process


def kernels_for(precision: str):
    if precision not in _KERNELS:
        _KERNELS[precision] = cuda_kernels.Kernels(precision)
    return _KERNELS[precision]


@dataclass
class StepBuffers:
    """The buffers of the step that are not activations: the optimizer
    state, the step's constants and input slot, and the gradient where it
    carries a sum (accumulation, several ranks); else the gradient is the
    arena's (Gradient, allocated after the activations)."""

    P: object  # (N,) float32 each: parameters, moments
    M: object
    V: object
    G: object  # (N,) float32, k > 1 or W > 1: the gradient, flat; else None
    Pb: object  # (N,) bfloat16 bits of P under bf16, else None
    t: object  # (1,) int32, the update count
    c: object  # (4,) float32: c1, c2, a_t, b_t of the current update
    rates: object  # (R, 2) float32: the schedule's a_t, b_t (SPEC 7), read by the device's t
    partial: object  # float32: the norm's first pass (gradient_norm's, or AdamW's: run_step)
    norm: object  # (2,) float32: ||G|| before clipping, and the clip scale
    decay: object  # (R, 2) int64: the decayed elements' [start, end) runs
    cos: object  # (T, E/2) float32 each, from float64 angles
    sin: object
    ids: object  # (B, T+1) int32: the input slot
    workspace: object  # cuBLAS's
    norms: object  # (2L+1,) int64: norm_offsets()
    clip: float  # float32(clip), 0: off
    adamw: AdamWConstants
    betas: tuple  # the float64 betas of the bias corrections
    accumulate: int = 1  # k micro-batches of B/(W*k) (SPEC 19)
    Gmicro: object = None  # (N,) float32, k > 1: micro-batch 1.. gradient, added into G
    grad: object = None  # Gradient over G (k > 1 or W > 1)
    grad_micro: object = None  # Gradient over Gmicro (k > 1)
    rows: object = None  # (b*T,) float32, k > 1 or W > 1: this rank's row losses (b = B/W)
    world: int = 1  # W ranks (SPEC 19): the input slot holds this rank's b = B/W contexts
    gathered: object = None  # (B*T,) float32, W > 1: every rank's row losses, batch order
    stop: object = None  # (1,) float32, W > 1: how many ranks ask to stop (summed in the step)


def allocate_state(alloc, config: Config, hyper: Hyper, precision: str, batch: int,
                   accumulate: int = 1, world: int = 1) -> StepBuffers:
    """Every buffer but the activations, from `alloc` (Buffers, or the
    memory plan's VirtualBuffers: the same allocations in the same order).
    With accumulate k > 1 also the micro-batches' gradient and the row
    losses; with W = world > 1 ranks (SPEC 19) the input slot holds this
    rank's b = B/W contexts, and the step also has this rank's row losses,
    everyone's gathered, and the stop count. G is a flat buffer here only
    with k > 1 or W > 1 (it carries a sum); else the step's Gradient is
    allocated with the activations, in the memory plan's arena."""
    reg = registry(config)
    N, T, E = reg.total, config.context, config.head_dim
    b = batch // world
    P, M, V = (alloc((N,), np.float32) for _ in range(3))
    G = alloc((N,), np.float32) if accumulate > 1 or world > 1 else None
    Pb = alloc((N,), np.uint16) if precision == "bf16" else None
    t = alloc((1,), np.int32)
    c = alloc((4,), np.float32)
    rates = alloc.upload(schedule_table(hyper))
    partial = alloc((max(cuda_kernels.NORM_BLOCKS, cuda_kernels.adamw_blocks(N)),), np.float32)
    norm = alloc((2,), np.float32)
    decay = alloc.upload(reg.decay_ranges())
    cos, sin = (alloc.upload(x) for x in rope_tables(T, E))
    ids = alloc((b, T + 1), np.int32)
    workspace = alloc((WORKSPACE_BYTES,), np.uint8)
    norms = alloc.upload(norm_offsets(config))
    clip = 0.0 if hyper.clip is None else float(float32_of(hyper.clip))
    Gmicro = alloc((N,), np.float32) if accumulate > 1 else None
    rows = alloc((b * T,), np.float32) if accumulate > 1 or world > 1 else None
    gathered = alloc((batch * T,), np.float32) if world > 1 else None
    # zero, and zero after every step's sum until a rank writes 1 (vote_stop)
    stop = alloc((1,), np.float32, zeros=True) if world > 1 else None
    grad = Gradient.flat(G, alloc) if G is not None else None
    grad_micro = Gradient.flat(Gmicro, alloc) if Gmicro is not None else None
    return StepBuffers(P, M, V, G, Pb, t, c, rates, partial, norm, decay, cos, sin, ids, workspace,
                       norms, clip, AdamWConstants.of(hyper),
                       (float(hyper.beta1), float(hyper.beta2)), accumulate, Gmicro, grad,
                       grad_micro, rows, world, gathered, stop)


def model_for(config: Config, precision: str, kernels, blas, s: StepBuffers,
              G: Gradient) -> Model:
    """The step's Model over the buffers s, its gradient into G."""
    return Model(config, precision, kernels, blas, s.P, s.Pb if s.Pb is not None else s.P, G,
                 s.cos, s.sin, s.norms)


def step_gradients(config: Config, s: StepBuffers, alloc) -> tuple:
    """(the step's Gradient, micro-batch 1..'s or None): s's flat ones, or
    (k = 1, one rank) the segments, from `alloc` (the activations')."""
    if s.grad is not None:
        return s.grad, s.grad_micro
    return Gradient.segments(config, alloc), None


def run_step(model: Model, kernels, a: Activations, s: StepBuffers, micro: Model = None,
             collectives=None) -> None:
    """Forward, backward and AdamW on the input slot: the captured work.
    With s.accumulate k > 1 (SPEC 19) the activations hold one micro-batch
    of m = b/k contexts: k forward and backward passes over the slot's rows
    [i*m, (i+1)*m), micro-batch 0's gradient into G, each later one's into
    s.Gmicro (by `micro`, the model over it) and added into G; each pass's
    row losses into its slice of s.rows. With W = s.world > 1 ranks the
    slot holds this rank's b = B/W contexts and every loss gradient is
    scaled by 1/(B*T) all the same; then `collectives` sum G over the
    ranks and gather every rank's row losses in rank order, which is the
    batch order (accelerated/distributed.py). The loss is the mean over
    all B*T rows; then the norm, clipping and AdamW on G, as without."""
    T = model.config.context
    k, W = s.accumulate, s.world
    if k == 1 and W == 1:
        model.forward(a, s.ids, T + 1)
        model.backward(a, s.ids, T + 1)
    else:
        m, rows = a.B, a.B * k * W * T  # rows: the whole batch's B*T
        for i in range(k):
            ids = s.ids[i * m:(i + 1) * m]
            mm = model if i == 0 else micro
            mm.forward(a, ids, T + 1)
            mm.backward(a, ids, T + 1, rows=rows, ce=s.rows[i * m * T:(i + 1) * m * T])
            if i:
                model.at()  # the sum of the gradients: no operation of its own
                kernels.accumulate_gradient(s.G, s.Gmicro)
        if W > 1:
            model.at()  # the sum over the ranks: part of the gradient, as the sum above
            collectives.all_reduce_sum(s.G)
            collectives.all_gather(s.rows, s.gathered)
            collectives.all_reduce_sum(s.stop)
        model.at("loss.mean")
        kernels.mean_loss(s.gathered if W > 1 else s.rows, a.loss)
    run_step_tail(model, kernels, s)


def run_step_tail(model: Model, kernels, s: StepBuffers) -> None:
    """The step after its gradient model.G: the norm, clipping and AdamW (SPEC 7)."""
    G = model.G
    if s.clip == 0:
        # clipping off: the norm is only recorded, so AdamW's own pass over G
        # sums its squares (SPEC 7: float32, any order) and no pass of its own
        # reads G's 4 N bytes again
        model.at("adamw", "gradient_norm")
        kernels.adamw_bias_corrections(s.t, s.c, *s.betas, s.rates)  # t += 1 on the device
        blocks = kernels.adamw_update(s.P, s.M, s.V, G, s.decay, s.Pb, s.c, s.norm, s.adamw,
                                      partial=s.partial)
        model.at("gradient_norm", "clip")
        kernels.gradient_norm_finish(s.partial, blocks, s.norm)
        return
    model.at("gradient_norm", "clip")
    kernels.gradient_norm(G, s.partial[:cuda_kernels.NORM_BLOCKS], s.norm, s.clip)  # and scale
    model.at("adamw")
    kernels.adamw_bias_corrections(s.t, s.c, *s.betas, s.rates)  # t += 1 on the device
    kernels.adamw_update(s.P, s.M, s.V, G, s.decay, s.Pb, s.c, s.norm, s.adamw)


# Activations buffers that keep storage of their own whatever their lifetimes
PINNED = {"ce": "row losses: read by the host after a replay",
          "ln_table": "the norms' partials' addresses: written at allocation, read every step",
          "loss": "the loss: read by the host after a replay",
          "G.table": "the gradient's segments' addresses: written at allocation, read every step"}
KINDS = {"P": "state", "M": "state", "V": "state", "G": "state", "Pb": "state", "t": "state",
         "ids": "input", "workspace": "workspace", "Gmicro": "workspace", "rows": "state",
         "gathered": "state", "stop": "state"}


def memory_plan(config: Config, hyper: Hyper, precision: str, batch: int,
                accumulate: int = 1, world: int = 1, recompute: bool = False) -> MemoryPlan:
    """The step's dry run (accelerated/memory_plan.py): every buffer, the
    commands in order with what they touch, each activation's lifetime, and
    the activations laid out in one arena. Allocates nothing; needs no GPU.
    With accumulate k and W = world ranks the activations are those of a
    micro-batch of B/(W*k); the collectives are logged, not run. recompute:
    the gate and up products computed again in the backward (Activations)."""
    v = VirtualBuffers()
    s = allocate_state(v, config, hyper, precision, batch, accumulate, world)
    names = {getattr(s, f.name).ptr: f.name for f in fields(StepBuffers)
             if isinstance(getattr(s, f.name), VirtualArray)}
    for label, grad in (("G", s.grad), ("Gmicro", s.grad_micro)):
        if grad is not None:
            names.update(grad.names(label))
    n_state = len(v.requests)
    acts = Activations(config, batch // (accumulate * world), config.context,
                       np.uint16 if precision == "bf16" else np.float32, v, train=True,
                       recompute=recompute)
    G, G_micro = step_gradients(config, s, v)
    names.update(G.names("G"))
    segments = {part.ptr for part in G.parts} if s.grad is None else set()  # in the arena
    for attr, value in vars(acts).items():
        if isinstance(value, VirtualArray):
            names[value.ptr] = f"acts.{attr}"
        elif isinstance(value, list):
            for l, x in enumerate(value):
                names.setdefault(x.ptr, f"acts.{attr}[{l}]")
        elif isinstance(value, dict):
            for key, x in value.items():
                if x is not None:
                    names[x.ptr] = f"acts.{attr}.{key}"
    log = CommandLog()
    kernels = cuda_kernels.Kernels(precision, dry=True)
    blas = Cublas(0, 0, 0, dry=True)
    collectives = Collectives(None, 0, rank=0, world=world)
    kernels.log = blas.log = collectives.log = log
    micro = model_for(config, precision, kernels, blas, s, G_micro) if accumulate > 1 else None
    run_step(model_for(config, precision, kernels, blas, s, G), kernels, acts, s, micro,
             collectives)

    buffers = []
    for i, (shape, dtype, zeros, ptr, nbytes) in enumerate(v.requests):
        name = names[ptr]
        if i < n_state:
            kind = KINDS.get(name, "constant")
            buffers.append(Buffer(name, nbytes, kind, False, "kept for the program's life"))
            continue
        attr = name[len("acts."):].split("[")[0] if name.startswith("acts.") else name
        note = PINNED.get(attr, "")
        if zeros:
            note = "zeros above the diagonal written once, at allocation, and kept"
        buffers.append(Buffer(name, nbytes, "gradient" if ptr in segments else "activation",
                              not note, note))
    touches = liveness(buffers, [r[3] for r in v.requests], log.commands)
    if accumulate > 1:
        # SPEC 19: each micro-batch's pass repeats micro-batch 0's commands on
        # the same activations, and no activation a placement may share
        # (every candidate) carries a value from one pass into the next or
        # past the last: lifetimes are those of the first pass, the commands
        # before the first that reads micro-batch 1's rows of the input slot
        second = s.ids[acts.B:2 * acts.B].ptr
        n_pass = next(c.index for c in log.commands if second in c.pointers)
        for i in range(n_state, len(buffers)):
            used = [c for c in range(n_pass) if i in touches[c]]
            if buffers[i].candidate:
                buffers[i].first, buffers[i].last = (used[0], used[-1]) if used else (None, None)
    for b in buffers:
        if b.kind == "gradient":
            # the host reads G after the replay: live to the step's end, so
            # that nothing after AdamW may take its storage
            b.last = len(log.commands) - 1
    products = [c.index for c in log.commands if c.kind == "product"]
    ws = buffers[[b.name for b in buffers].index("workspace")]
    ws.first, ws.last = (products[0], products[-1]) if products else (None, None)
    ws.note = "cuBLAS's, used by every product"
    activations = list(range(n_state, len(buffers)))
    arena = place(buffers, activations, len(log.commands))
    return MemoryPlan(buffers, activations, arena, sum(buffers[i].nbytes for i in activations),
                      [(r[0], r[1]) for r in v.requests[n_state:]], log.commands, touches)


class CupyProgram(CapturedProgram):
    """The captured training step on CUDA (the TrainingProgram interface)."""

    backend = BACKEND

    def __init__(self, config: Config, hyper: Hyper, precision: str, batch: int, state: State,
                 accumulate: int | None = None, comm=None, recompute: bool = False):
        k = hyper.accumulate if accumulate is None else accumulate
        self.recompute = bool(recompute)
        check_capture(config, precision, batch, state, k)
        # SPEC 19: W ranks of b = B/W contexts each, in k micro-batches of B/(W*k)
        W = 1 if comm is None else comm.world
        if batch % (W * k):
            raise RunError(f"batch={batch}: must divide by {W} ranks x accumulate {k} (each "
                           f"rank's B/W contexts in micro-batches of B/(W*k))")
        self.comm, self.world, self.rank = comm, W, 0 if comm is None else comm.rank
        self.local_batch = batch // W
        self.accumulate, self.micro_batch = k, batch // (W * k)
        if config.d_model > cuda_kernels.MAX_D:
            raise RunError(f"d_model={config.d_model}: the CUDA backend's layernorm kernels hold "
                           f"a row in registers, at most {cuda_kernels.MAX_D} features")
        self.config, self.hyper, self.precision, self.batch = config, hyper, precision, batch
        self.replays = 0
        T = config.context
        bf16 = precision == "bf16"
        op_dtype = np.uint16 if bf16 else np.float32

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.alloc = alloc = Buffers(self.stream)
        self.buffers = s = allocate_state(alloc, config, hyper, precision, batch, k, W)
        # the names the rest of the program, its tests and dev/cuda/bench_step.py use
        self.P, self.M, self.V, self.Pb, self.t = s.P, s.M, s.V, s.Pb, s.t
        self.ids, self.norm, self.c, self.rates, self.partial, self.decay = \
            s.ids, s.norm, s.c, s.rates, s.partial, s.decay
        self.clip, self.adamw, self.betas = s.clip, s.adamw, s.betas

        # the process's compiled module, with a command log of this program's own
        self.kernels = copy.copy(kernels_for(precision))
        self.blas = Cublas(self.stream.ptr, _ptr(s.workspace), WORKSPACE_BYTES)
        self.collectives = Collectives(comm, self.stream.ptr) if W > 1 else None
        weakref.finalize(self, self.blas.close)
        # the memory plan, made by a dry run of this very step before any
        # activation exists (accelerated/memory_plan.py)
        self.plan = memory_plan(config, hyper, precision, batch, k, W, self.recompute)
        self.memory_planned = planning_enabled() and self.plan.savings > 0
        acts_alloc = PlannedBuffers(alloc, self.plan, self.stream) if self.memory_planned \
            else alloc
        self.acts = Activations(config, self.micro_batch, T, op_dtype, acts_alloc, train=True,
                                recompute=self.recompute)
        # the gradient: flat in s, or segments in the arena (after the activations, as planned)
        self.G, G_micro = step_gradients(config, s, acts_alloc)
        # whether G shares storage with the activations, so that an evaluation overwrites it
        self._gradient_shared = self.memory_planned and s.grad is None
        self._gradient_overwritten = False
        self.model = model_for(config, precision, self.kernels, self.blas, s, self.G)
        self.micro_model = (model_for(config, precision, self.kernels, self.blas, s, G_micro)
                            if k > 1 else None)
        self.device_state = self._owned = DeviceState(self.P, self.M, self.V, self.t)
        self._eager = None  # (B', T', Activations) of the last logits() shape
        self._uploaded = False
        self._stepped = False
        self._done = cupy.cuda.Event(disable_timing=True)  # recorded after each replay
        self._slots = None  # submit()'s pinned staging, on first use
        self.graph = None
        self.eval_ids = self.eval_ce = self.eval_rows = self.eval_graph = None  # evaluate()

        self._load(state)
        warm = CommandLog()
        self.recorded = self._counted(self._step, warm)  # compiles, lets cuBLAS choose
        if warm.signature() != [(c.kind, c.name, c.launch) for c in self.plan.commands]:
            # the plan's lifetimes are those of the dry run's commands
            raise AssertionError("the step's commands differ from the memory plan's dry run")
        self._load(state)  # the warm-up updated the state: capture performs no update
        self.captured = capture_enabled() and capture_or_fallback(self, self._record)
        self.stream.synchronize()

    # -- the step ----------------------------------------------------------------

    def _record(self) -> None:
        """Capture the step as a CUDA graph on the program's stream."""
        def record():
            self.stream.begin_capture()
            try:
                self._step()
            finally:
                graph = self.stream.end_capture()
            self.graph = graph  # only a capture that completed

        self.recorded = self._counted(record, CommandLog())

    def _load(self, state: State) -> None:
        """Host state -> the device buffers the graph reads (in place)."""
        self.P.set(state.P, stream=self.stream)
        self.M.set(state.M, stream=self.stream)
        self.V.set(state.V, stream=self.stream)
        self.t.set(np.array([state.t], dtype=np.int32), stream=self.stream)
        if self.Pb is not None:
            with self.stream:
                self.kernels.round_bf16(self.P, self.Pb)
        self.stream.synchronize()

    def _counted(self, work, log) -> dict:
        """Run work() on the stream with its commands logged; count them."""
        logged = [self.kernels, self.blas] + ([self.collectives] if self.collectives else [])
        for x in logged:
            x.log = log
        try:
            with self.stream:
                work()
        finally:
            for x in logged:
                x.log = None
        self.stream.synchronize()
        self._check_peers()
        kinds = [c.kind for c in log.commands]
        return {"kernel_launches": kinds.count("kernel"), "products": kinds.count("product"),
                "library_calls": kinds.count("library"),
                "collectives": kinds.count("collective"),
                "kernels": sorted({c.name for c in log.commands if c.kind == "kernel"})}

    def _step(self) -> None:
        run_step(self.model, self.kernels, self.acts, self.buffers, self.micro_model,
                 self.collectives)

    def _check_peers(self) -> None:
        """After a wait: the failure of another rank, reported while this
        one waited, is raised rather than the values of an aborted step
        handed on (accelerated/distributed.py)."""
        if self.comm is not None:
            self.comm.check()

    def _local(self, tokens) -> np.ndarray:
        """This rank's rows [r*b, (r+1)*b) of a (B, T+1) batch, int32."""
        b = self.local_batch
        return np.ascontiguousarray(tokens[self.rank * b:(self.rank + 1) * b], dtype=np.int32)

    def _evaluate(self) -> None:
        """Forward and row losses of the evaluation slot: the captured
        forward-only program (SPEC 18). It runs on the training step's own
        activations (free between steps, on the same stream; under the
        memory plan too: its commands are the step's forward and the
        classifier chunks' products and cross-entropy, in the step's order,
        so buffers sharing storage never live at once) and writes its losses
        to a buffer of its own, so the last step's row losses and loss stay
        readable. Its buffers share storage with the gradient's segments
        (the step's G, where it is not flat): gradients() refuses until the
        next step."""
        a, T = self.acts, self.config.context
        # the activations hold B/(W*k) contexts; the logits' gradient is scratch here
        b, dce = a.B, np.float32(1.0 / (a.B * T))
        for i in range(self.accumulate):
            ids = self.eval_ids[i * b:(i + 1) * b]
            self.model.forward(a, ids, T + 1)
            rows = self.eval_ce[i * b * T:(i + 1) * b * T]
            self.model.classifier_loss(a, ids, T + 1, rows, dce, backward=False)
        if self.world > 1:  # every rank's rows, in batch order
            self.collectives.all_gather(self.eval_ce, self.eval_rows)

    # -- the TrainingProgram interface -------------------------------------------------

    def upload_input(self, tokens) -> None:
        """tokens (B, T+1) ids -> the input slot. With W ranks, every rank is
        given the whole batch and takes its rows [r*b, (r+1)*b), b = B/W:
        rank r trains on contexts c0 + s*B + r*b + j (SPEC 19)."""
        tokens = check_tokens(self.config, self.batch, tokens)
        # a pending replay still reads the slot: the host waits for it before
        # the copy (free in training, where the previous step was waited for)
        self._done.synchronize()
        self.ids.set(self._local(tokens), stream=self.stream)
        self._uploaded = True

    def vote_stop(self) -> None:
        """W > 1: ask every rank to stop (a signal reached this one), from
        the next step submitted on. The step sums the ranks' counts in
        place (0 until a rank votes, and from then on nonzero), and every
        rank reads the same sum with the step's records (StepRecords.stops),
        so that all of them stop after the same step. Ordered on the stream
        after the step in flight: no wait."""
        self.buffers.stop.set(np.ones(1, np.float32), stream=self.stream)

    def stop_votes(self) -> int:
        """W > 1: the stop count of the last step (nonzero: some rank asked)."""
        self._last("stop_votes")
        return int(self.buffers.stop.get(stream=self.stream)[0])

    def replay(self) -> Event:
        """Submit one step without waiting; returns an event."""
        self._check_replay()
        self._submit()
        self._done.record(self.stream)
        self.replays += 1
        self._stepped = True
        return Event(self._done)

    def replay_timed(self) -> TimedEvent:
        """Submit one step between two device timestamps; returns at once."""
        self._check_replay()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()  # each replay's own pair
        start.record(self.stream)
        self._submit()
        self._done.record(self.stream)
        end.record(self.stream)
        self.replays += 1
        self._stepped = True
        return TimedEvent(start, end)

    def _check_replay(self) -> None:
        if not self._uploaded:
            raise ReplayError("replay before upload_input: the input slot is empty")
        check_replay_state(self.device_state, self._owned, BACKEND)

    def _submit(self) -> None:
        self._gradient_overwritten = False  # the step writes G again
        if self.graph is not None:
            self.graph.launch(stream=self.stream)
        else:
            with self.stream:
                self._step()

    def submit(self, tokens) -> Submitted:
        """Upload, replay and read back without the host waiting for the
        device: the tokens go through a pinned staging slot and an
        asynchronous copy ordered after the previous replay on the stream;
        after the replay, asynchronous copies of the row losses, the loss
        and the norm go to the same slot's pinned buffers, and records()
        waits for that slot's event alone. Two slots alternate, so step s is
        read while step s+1 runs; a slot is reused two submissions later,
        once the records it holds have been read (records() copies them)."""
        tokens = self._local(check_tokens(self.config, self.batch, tokens))  # this rank's rows
        check_replay_state(self.device_state, self._owned, BACKEND)
        slot = self._staging()[self.replays % 2]
        if slot.submitted is not None:  # two submissions ago: kept before the slot is reused
            slot.submitted.records()
        slot.ids[...] = tokens
        self.ids.set(slot.ids, stream=self.stream)
        self._uploaded = True
        timed = self.replay_timed()
        self._row_loss_buffer().get(stream=self.stream, out=slot.rows, blocking=False)
        self.acts.loss.get(stream=self.stream, out=slot.scalars[0:1], blocking=False)
        self.norm[0:1].get(stream=self.stream, out=slot.scalars[1:2], blocking=False)
        if self.world > 1:
            self.buffers.stop.get(stream=self.stream, out=slot.scalars[2:3], blocking=False)
        copied = slot.copied = cupy.cuda.Event(disable_timing=True)
        copied.record(self.stream)
        B, T = self.batch, self.config.context

        def read():
            copied.synchronize()
            self._check_peers()  # not the records of a step another rank's failure aborted
            return StepRecords(float(slot.scalars[0]), slot.rows.reshape(B, T).copy(),
                               float(slot.scalars[1]), timed.device_seconds(),
                               int(slot.scalars[2]) if self.world > 1 else 0)

        slot.submitted = Submitted(read)
        return slot.submitted

    def _staging(self) -> list:
        """The two pinned host slots of submit(), made on first use."""
        if self._slots is None:
            B, T = self.batch, self.config.context
            self._slots = [StagingSlot(B, T, self.local_batch) for _ in range(2)]
        return self._slots

    def _row_loss_buffer(self):
        """The device buffer of the last replay's (B*T) row losses: with W
        ranks, every rank's, gathered in batch order."""
        if self.world > 1:
            return self.buffers.gathered
        return self.acts.ce if self.accumulate == 1 else self.buffers.rows

    def replay_and_wait(self) -> float:
        self.replay().wait()
        self._check_peers()
        return float(self.acts.loss.get(stream=self.stream)[0])  # the step's one read back

    def replay_timed_and_wait(self):
        """-> (mean loss, device seconds between events around the launch)."""
        event = self.replay_timed()
        seconds = event.device_seconds()
        self._check_peers()
        return float(self.acts.loss.get(stream=self.stream)[0]), seconds

    def loss(self):
        """The captured loss buffer, (1,) float32 on the device; no wait."""
        if not self._stepped:
            raise ReplayError("loss: no step has been replayed yet")
        return self.acts.loss

    def is_complete(self) -> bool:
        return bool(self._done.done)  # cudaEventQuery: no wait

    def wait(self) -> None:
        self._done.synchronize()

    def _release(self) -> None:
        """Drop every device buffer, the graphs and the cuBLAS handle: the
        memory returns to CuPy's pool. (The compiled kernel module stays:
        it is shared by every program of the process.)"""
        self.blas.close()
        self.graph = self.eval_graph = None
        self.collectives = self.comm = None  # the communicator is its owner's to end
        self.acts = self.buffers = self.model = self._eager = None
        self.P = self.M = self.V = self.G = self.Pb = self.t = self.ids = self.norm = None
        self.c = self.rates = self.partial = self.decay = None
        self.device_state = self._owned = None
        self.eval_ids = self.eval_ce = self.eval_rows = None
        self._slots = None
        self.alloc.bytes = 0

    def _last(self, what):
        if not self._stepped:
            raise ReplayError(f"{what}: no step has been replayed yet")
        self._done.synchronize()
        self._check_peers()

    def row_losses(self) -> np.ndarray:
        """(B, T): with W ranks, every rank's rows gathered in batch order."""
        self._last("row_losses")
        ce = self._row_loss_buffer()
        return ce.get(stream=self.stream).reshape(self.batch, self.config.context)

    def gradients(self) -> np.ndarray:
        """G of the last step (before clipping), (N,) float32. Under the
        memory plan G's segments share storage with the activations, which
        evaluate() uses: read G before an evaluation."""
        self._last("gradients")
        if self._gradient_overwritten:
            raise ReplayError("gradients: an evaluation since the last step used their storage "
                              "(the memory plan shares it with the activations); read them "
                              "before evaluate()")
        return self.G.get(stream=self.stream)  # (N,)

    def grad_norm(self) -> float:
        self._last("grad_norm")
        return float(self.norm.get(stream=self.stream)[0])

    def evaluate(self, tokens) -> np.ndarray:
        """tokens (B, T+1) -> held-out row losses (B, T) with the current
        parameters; the forward-only graph is captured on first use."""
        tokens = self._local(check_tokens(self.config, self.batch, tokens, "evaluate input"))
        self._done.synchronize()  # a pending replay still uses the activations
        self._gradient_overwritten = self._gradient_shared
        if self.eval_ids is None:
            b, T = self.local_batch, self.config.context
            self.eval_ids = self.alloc((b, T + 1), np.int32)
            self.eval_ce = self.alloc((b * T,), np.float32)
            if self.world > 1:
                self.eval_rows = self.alloc((self.batch * T,), np.float32)
            self.eval_ids.set(tokens, stream=self.stream)
            with self.stream:
                self._evaluate()  # warm-up: the products' first use outside a capture
            if self.captured:
                with self.stream:  # the kernels must launch on the capturing stream
                    self.stream.begin_capture()
                    try:
                        self._evaluate()
                    finally:
                        self.eval_graph = self.stream.end_capture()
        self.eval_ids.set(tokens, stream=self.stream)
        if self.eval_graph is not None:
            self.eval_graph.launch(stream=self.stream)
        else:
            with self.stream:
                self._evaluate()
        rows = (self.eval_rows if self.world > 1 else self.eval_ce).get(stream=self.stream)
        self._check_peers()  # the read above waited for the evaluation
        return rows.reshape(self.batch, self.config.context)

    def state(self) -> State:
        """P, M and V copied into page-locked host memory (CuPy's pinned
        pool: a publication's copy runs at the link's speed, and its blocks
        return to the pool once the State is dropped), then t; one wait."""
        self._done.synchronize()

        def get(a):
            out = pinned_empty(a.shape, a.dtype)
            a.get(stream=self.stream, out=out, blocking=False)
            return out

        P, M, V = get(self.P), get(self.M), get(self.V)
        t = int(self.t.get(stream=self.stream)[0])  # waits, after the copies above
        return State(P, M, V, t)

    def logits(self, tokens) -> np.ndarray:
        """tokens (B', T') with T' <= T -> logits (B', T', V) with the current
        parameters: an eager forward on buffers of its own."""
        tokens = check_logits_tokens(self.config, tokens)
        B2, T2 = tokens.shape
        if self._eager is None or self._eager[:2] != (B2, T2):
            self._eager = None  # free the previous shape's buffers first
            op = np.uint16 if self.precision == "bf16" else np.float32
            acts = Activations(self.config, B2, T2, op, Buffers(self.stream), train=False)
            self._eager = (B2, T2, acts)
        acts = self._eager[2]
        ids = Buffers(self.stream).upload(tokens.astype(np.int32))
        self._done.synchronize()
        with self.stream:
            self.model.forward(acts, ids, T2)  # after any pending replay, on the same stream
        self.stream.synchronize()
        return acts.logits.get(stream=self.stream).reshape(B2, T2, self.config.vocab)

    def activations(self, tokens) -> dict:
        """tokens (B, T+1) -> every named intermediate of one step's forward
        and backward with the current parameters: an eager forward and
        backward on buffers of its own (every layer's kept, no memory plan,
        a gradient buffer of its own; no AdamW), so the program's state and
        last results stay as they are. The backward's intermediates are
        read as the step makes them (Model.tap): its buffers serve every
        layer in turn, as the logits' buffer serves every chunk of rows."""
        tokens = check_tokens(self.config, self.batch, tokens,
                              "activations input").astype(np.int32)
        c = self.config
        B, T = self.batch, c.context
        self._done.synchronize()  # a pending replay still uses the kernels' stream
        alloc = Buffers(self.stream)
        op = np.uint16 if self.precision == "bf16" else np.float32
        acts = Activations(c, B, T, op, alloc, train=True)
        G = Gradient.flat(alloc((registry(c).total,), np.float32), alloc)
        ids = alloc.upload(tokens)
        model = model_for(c, self.precision, self.kernels, self.blas, self.buffers, G)

        def read(buffer, part=None):  # -> (B, T, columns) float32 on the host
            x = _as_float32(buffer.get(stream=self.stream)).reshape(B * T, -1)
            if part is not None:
                i, n = part
                width = x.shape[1] // n
                x = x[:, i * width:(i + 1) * width]
            return x.reshape(B, T, -1)

        out, chunks = {}, {"logits": [], "dlogits": []}

        def tap(name, buffer, part):
            if name in chunks:  # one chunk of rows at a time (Model.classifier_loss), in order
                chunks[name].append(_as_float32(buffer.get(stream=self.stream)))
            else:
                out[name] = read(buffer, part)

        model.tap = tap
        with self.stream:
            model.forward(acts, ids, T + 1)
            model.backward(acts, ids, T + 1)
        self.stream.synchronize()
        out["embedding.out"] = read(acts.x[0])
        for l in range(c.n_layer):
            p = f"layers.{l}."
            for i, part in enumerate("qkv"):
                out[p + f"attn.{part}"] = read(acts.qkv[l], (i, 3))
            out[p + "attn.y"] = read(acts.y[l])
            out[p + "mid"] = read(acts.x_mid[l])
            out[p + "mlp.gate"] = read(acts.gu[l], (0, 2))
            out[p + "mlp.up"] = read(acts.gu[l], (1, 2))
            out[p + "out"] = read(acts.x[l + 1])
        out["final_norm.out"] = read(acts.hf)
        for name, parts in chunks.items():
            out[name] = np.concatenate(parts).reshape(B, T, -1)
        out["row_losses"] = read(acts.ce).reshape(B, T)
        return {name: out[name] for name, _ in activation_names(c)}

    def compilation_report(self) -> dict:
        return _report(self)

    def _partition_outcomes(self) -> list:
        return _partition_outcomes(self)

    def _executable_nodes(self):
        # the dry run's commands: the warm-up checked that the real step's agree
        return [c.operations for c in self.plan.commands], ""

    def _executable_plan(self) -> list:
        plan = self.plan
        return [{"node": c.index, "kind": c.kind, "name": c.name, "launch": c.launch,
                 "operations": list(c.operations),
                 "buffers": [plan.buffers[i].name for i in plan.touches[c.index]]}
                for c in plan.commands]

    def _memory_analysis(self) -> MemoryAnalysis:
        return _memory_analysis(self)

    def diagnostics(self) -> dict:
        report = _report(self)
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        free, total = cupy.cuda.runtime.memGetInfo()
        report["runtime"] = {
            "cupy_version": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cublas_version": self.blas.version,
            "cublas_library": cublas.LOADED_FROM,
            "cudnn": {**cudnn_attention.versions(), "attention": self.acts.path.kind,
                      "reason": self.acts.path.reason},
            "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "update_count": int(self.t.get(stream=self.stream)[0]),  # a sync: not in the loop
            "device_free_bytes": int(free),
            "device_total_bytes": int(total),
        }
        return report


def capture(config: Config, hyper: Hyper, precision: str, batch: int, state: State,
            accumulate: int | None = None, comm=None, recompute: bool = False) -> CupyProgram:
    """Allocate, warm up and capture the step once; performs no training update.
    `accumulate` k (default: hyper.accumulate): SPEC 19's micro-batches, the
    activations sized for B/k. `comm`: this rank's communicator of W ranks
    (accelerated.distributed.Communicator; every rank captures at once, on
    its own device): the program is rank r's part of the global batch B,
    the activations sized for B/(W*k) (SPEC 19). `recompute`: the gate and
    up products are computed again in the backward instead of kept per
    layer (the same bits; less memory, more time)."""
    if not available():
        raise RunError("backend 'cupy': CuPy or a CUDA device is not available here")
    return CupyProgram(config, hyper, precision, batch, state, accumulate, comm, recompute)


# ---------------------------------------------------------------- binding

class CupyBindingBackend:
    """The binding layer's backend protocol (reference/binding.py,
    NumpyBackend) on CuPy arrays: a checkpoint lease is uploaded once, and
    recipes (slice, concat, transpose, cast) run on the device. `alias`
    returns the very same array: the tied unembedding shares its storage.
    bfloat16 arrays are held as their uint16 bits (CuPy has no bfloat16);
    a cast rounds to nearest even on the host's rules (ml_dtypes)."""

    name = "cupy"

    def from_host(self, array: np.ndarray, dtype: str):
        return cupy.asarray(self._host(np.ascontiguousarray(array), dtype))

    @staticmethod
    def _host(array: np.ndarray, dtype: str) -> np.ndarray:
        import ml_dtypes

        if dtype == "float32":
            return array.astype(np.float32)  # bfloat16 widens exactly
        return array.astype(ml_dtypes.bfloat16).view(np.uint16)  # RNE, kept as bits

    def slice(self, x, axis: int, start: int, stop: int):
        index = (slice(None),) * axis + (slice(start, stop),)
        return cupy.ascontiguousarray(x[index])

    def concat(self, xs, axis: int):
        return cupy.concatenate(list(xs), axis=axis)

    def transpose(self, x):
        return cupy.ascontiguousarray(x.T)

    def cast(self, x, dtype: str):
        # bits held as uint16 are bfloat16; the rounding itself follows the host's rules
        host = cupy.asnumpy(x)
        if host.dtype == np.uint16:
            import ml_dtypes

            host = host.view(ml_dtypes.bfloat16)
        return cupy.asarray(self._host(host, dtype))

    def alias(self, x):
        return x


# ---------------------------------------------------------------- the report

def _as_float32(x: np.ndarray) -> np.ndarray:
    """A buffer read back: bfloat16 bits (uint16) widened exactly, float32 as is."""
    return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x


def graph_nodes(graph):
    """Nodes of the captured graph, read from CUDA's DOT dump of it
    (cudaGraphDebugDotPrint through CuPy), or None where CuPy lacks it."""
    dump = getattr(graph, "debug_dot_str", None)
    if dump is None:
        return None
    try:
        return len(set(re.findall(r'"(graph_\d+_node_\d+)"', dump())))
    except Exception:
        return None


def _report(program: CupyProgram) -> dict:
    """What was done to the step, stage by stage (SPEC section 13). Counts:
    the commands (kernel launches, cuBLAS products and cuDNN executions)
    recorded into the graph, and its nodes as CUDA reports them (a product
    or an execution may be more than one kernel)."""
    B = program.batch
    on = program.graph is not None
    rec = program.recorded
    plan = program.plan
    candidates = sum(b.candidate for b in plan.buffers)
    aliased = len(plan.aliased()) if program.memory_planned else 0
    launches, products, calls = rec["kernel_launches"], rec["products"], rec["library_calls"]
    collectives = rec.get("collectives", 0)  # NCCL, W > 1 ranks (SPEC 19)
    commands = launches + products + calls + collectives
    path = program.acts.path
    nodes = graph_nodes(program.graph) if on else None
    bf16 = program.precision == "bf16"
    stages = {
        "semantic_validation": ("applied", 1, 1),
        "replay_safety": ("analyzed", 1, 1),
        "decomposition": ("applied", 1, commands),
        "fusion": ("applied", commands, commands),
        "placement": ("applied", commands, commands),
        "precision": ("applied" if bf16 else "analyzed", products, products),
        "kernel_selection": ("applied", commands, commands),
        "lowering_validation": ("analyzed", commands, commands),
        "memory_planning": ("applied" if program.memory_planned else "analyzed",
                            len(plan.buffers), aliased if program.memory_planned else candidates),
        "synchronization_planning": ("applied", 1, 1),
        "command_recording": ("applied" if on else "failed" if program.capture_refused
                              else "not_run", commands, 1 if on else 0),
    }
    notes = {
        "semantic_validation": "configuration, precision, batch and state checked at capture",
        "replay_safety": "fixed shapes; t and the bias corrections live on the device; the input "
                         "slot is the only per-step host input",
        "decomposition": "hand-written forward and backward: NVRTC kernels and cuBLAS products"
                         + ("; attention: cuDNN graphs" if path.kind == "cudnn" else ""),
        "fusion": "residual add into layernorm; loss, softmax and dlogits in one kernel; q,k,v "
                  "and gate,up as single products; operands rounded by their producers"
                  + ("; causal attention fused (scores never in memory)"
                     if program.acts.fused else ""),
        "placement": "one CUDA device, one non-blocking stream" if program.world == 1 else
                     f"rank {program.rank} of {program.world}: one CUDA device and one "
                     f"non-blocking stream per rank, {program.local_batch} of the batch's "
                     f"{B} contexts here",
        "precision": "bfloat16 operands, float32 accumulation and results" if bf16
                     else "float32 products, CUBLAS_COMPUTE_32F, no TF32",
        "kernel_selection": "cuBLAS heuristics (GemmEx, GemmStridedBatchedEx)"
                            + {"cudnn": "; attention: cuDNN's fused attention (SDPA graphs by "
                                        "cuDNN's heuristics, deterministic backward)",
                               "fused": "; attention: mma.sync bfloat16 tiles",
                               "materialized": ""}[path.kind]
                            + (f"; cuDNN attention not used: {path.reason}" if path.reason
                               else ""),
        "lowering_validation": "the step runs eagerly once before capture",
        "memory_planning": (f"{aliased} activation, scratch and gradient buffers share one "
                            f"arena by "
                            f"lifetime: {plan.savings} bytes saved" if program.memory_planned
                            else "plan not applied: " + _plan_off_reason(program))
                           + "; every buffer allocated before capture, none in the step"
                           + ("; the gate and up products computed again in the backward "
                              "(recompute)" if program.recompute else ""),
        "synchronization_planning": "stream order only; the host waits once per replay"
                                    + ("" if program.world == 1 else
                                       "; the gradient summed (NCCL all-reduce) and the row "
                                       "losses gathered (NCCL all-gather) inside the graph"),
        "command_recording": "CUDA graph by stream capture" if on
                             else f"capture refused ({program.capture_refused}): the step runs "
                                  "eagerly" if program.capture_refused
                             else "disabled by COPPELIUS_NO_CAPTURE: the step runs eagerly",
    }
    return compilation_report(
        BACKEND, stages, kernels=len(rec["kernels"]),
        graph_nodes=nodes if nodes is not None else (commands if on else 0),
        device_bytes=program.alloc.bytes, replays=program.replays, precision=program.precision,
        batch=B, accumulate=program.accumulate, world=program.world, rank=program.rank,
        collectives=collectives, captured=on,
        capture_refused=program.capture_refused or "",
        kernel_names=rec["kernels"], kernel_launches=launches, products=products,
        library_calls=calls, attention=path.kind, attention_reason=path.reason,
        memory_planned=program.memory_planned, memory_saved_bytes=(
            plan.savings if program.memory_planned else 0),
        graph_nodes_source=("cudaGraphDebugDotPrint" if nodes is not None
                            else "recorded commands" if on else "no graph"),
        notes=notes)


# ---------------------------------------------------------------- the analyses

def _plan_off_reason(program: CupyProgram) -> str:
    if not planning_enabled():
        return "disabled by COPPELIUS_NO_MEMORY_PLAN"
    return "no two activation buffers have disjoint lifetimes"


def _partition_outcomes(program: CupyProgram) -> list:
    """The step's fusion candidates as the CUDA step has them (Model)."""
    c, B = program.config, program.micro_batch  # the activations' batch (B/k, SPEC 19)
    path = program.acts.path
    if path.kind == "cudnn":
        attention = PartitionOutcome("applied", "cuDNN's fused attention (SDPA forward and "
                                                "backward): the (T, T) scores never in memory")
    elif path.kind == "fused":
        attention = PartitionOutcome("applied", "fused kernels (flash-attention style): the "
                                                "(T, T) scores never in memory; cuDNN not used: "
                                                + path.reason)
    elif program.precision != "bf16":
        attention = PartitionOutcome("fallback", "fp32 policy: the fused kernels take "
                                                 "bfloat16 operands")
    elif c.head_dim not in cuda_kernels.ATTENTION_HEAD_DIMS:
        attention = PartitionOutcome("fallback", f"head dim {c.head_dim}: no fused kernel; "
                                                 f"cuDNN not used: {path.reason}")
    else:
        attention = PartitionOutcome(
            "fallback", f"batch {B} < {cuda_kernels.ATTENTION_FUSED_MIN_BATCH}: the fused "
                        "kernels' few blocks would leave the GPU idle; scores materialized; "
                        f"cuDNN not used: {path.reason}")
    outcomes = {
        "shared_input_products": PartitionOutcome("applied", "one product over the adjacent "
                                                             "weights"),
        "residual_norm": PartitionOutcome("applied", "the residual add inside the layernorm "
                                                     "kernel"),
        "attention": attention,
        "loss": PartitionOutcome("applied", "row losses and dlogits in one kernel"),
    }
    return [outcomes[p.kind] for p in partitions(c)]


def _memory_analysis(program: CupyProgram) -> MemoryAnalysis:
    plan = program.plan
    on = program.memory_planned
    aliased = plan.aliased() if on else set()
    resources = tuple(
        Resource(b.name, b.nbytes, b.kind, b.first, b.last, b.candidate, i in aliased,
                 b.offset if on and b.kind in ("activation", "gradient") else None, b.note)
        for i, b in enumerate(plan.buffers))
    return MemoryAnalysis(resources, plan.arena_bytes, plan.unplanned_bytes, on,
                          "" if on else _plan_off_reason(program))
