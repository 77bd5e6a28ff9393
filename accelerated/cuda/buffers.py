"""The CUDA step's device buffers: the allocator (Buffers, its fills on
the program's stream), the gradient G as segments (Gradient), every
activation of one step (Activations) and the step's other buffers
(StepBuffers, allocate_state). The memory plan (accelerated/cuda/memory_plan.py)
places the activations and G's segments in one arena by lifetime."""

from __future__ import annotations

import bisect
import copy
import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

from ...reference.adamw import AdamWConstants, float32_of, schedule_table
from ...reference.config import Config, Hyper
from ...reference.contract import recompute_mode
from ...reference.errors import RunError
from ...reference.layers.rope import rope_tables
from ...reference.layout import Layout, LayerOffsets, layout
from ...reference.params import registry

from . import adamw, attention, cudnn_attention, layernorm, linear_bias
from .cublas import WORKSPACE_BYTES
from .memory_plan import VirtualArray
from .policy import attention_path, logits_chunk_rows


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


@functools.lru_cache(maxsize=None)
def step_layout(config: Config) -> Layout:
    """The layout the step computes with: reference/layout.py's. With
    qkv_bias each of q, k and v is followed by its bias in P, so the three
    weights are no one matrix, which the reference's layout refuses: the
    columns, widths and the other offsets are then those of the same model
    without the biases' storage, every offset read from this config's
    registry; a layer's `qkv` is q's weight alone: the step's products read
    the three weights gathered side by side (allocate_state's qkv_weights),
    and their gradients go to the three apart in G (Model.qkv_parts)."""
    if not config.qkv_bias:
        return layout(config)
    base = layout(dataclasses.replace(config, qkv_bias=False))  # columns and widths
    reg = registry(config)
    D, F = config.d_model, config.d_ff

    def at(name):
        return reg[name].offset

    def offsets(l):
        p = f"layers.{l}."
        o = LayerOffsets(at(p + "attn_norm.weight"), at(p + "attn.q.weight"),
                         at(p + "attn.o.weight"), at(p + "mlp_norm.weight"),
                         at(p + "mlp.gate.weight"), at(p + "mlp.down.weight"))
        assert at(p + "mlp.up.weight") == o.gate_up + F * D, l  # gate | up: one matrix
        if config.norm_bias:
            assert at(p + "attn_norm.bias") == o.attn_norm + D, l
            assert at(p + "mlp_norm.bias") == o.mlp_norm + D, l
        return o

    final = at("final_norm.weight")
    assert not config.norm_bias or at("final_norm.bias") == final + D
    return dataclasses.replace(base, layers=tuple(offsets(l) for l in range(config.n_layer)),
                               final_norm=final)


def norm_offsets(config: Config) -> np.ndarray:
    """(2L+1,) int64: offsets of every norm's weight, in the order of the
    norms' partials: 2l attn_norm, 2l+1 mlp_norm, 2L final_norm."""
    lay = step_layout(config)  # (which checks that each bias follows its weight)
    offsets = [at for w in lay.layers for at in (w.attn_norm, w.mlp_norm)]
    return np.array(offsets + [lay.final_norm], dtype=np.int64)


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
    recompute "gate-up" (reference/contract.py RECOMPUTE_MODES) the gate
    and up products are not kept per layer: the forward's serve every
    layer, and the backward computes them again (Model.backward) into a
    buffer of its own. With recompute "block" only each layer's input x[l]
    is kept per layer: every other buffer of a layer's forward is one for
    all layers, and the backward has a set of its own (for_backward), which
    it fills again for each layer in turn (Model.layer_forward) before that
    layer's backward reads it."""

    def __init__(self, config: Config, B: int, T: int, op_dtype, alloc: Buffers, train: bool,
                 recompute: str | None = None):
        D, F, H, V, L = config.d_model, config.d_ff, config.n_head, config.vocab, config.n_layer
        lay = step_layout(config)  # the fused rows' widths: qkv (q | k | v), gate_up (gate | up)
        BT = B * T
        self.B, self.T, self.train = B, T, train
        self.recompute = recompute = recompute_mode(recompute) if train else None
        f32 = np.float32
        bf16 = op_dtype == np.uint16
        self.path = attention_path(config, "bf16" if bf16 else "fp32", B, T, train)
        cudnn = self.path.kind == "cudnn"
        self.fused = fused = self.path.kind != "materialized"  # no (T, T) scores in memory
        kept = L if train else 1  # the layers' inputs x[l]
        n = 1 if recompute == "block" else kept  # every other buffer of a layer's forward

        def per_layer(shape, dtype, n=n):
            own = [alloc(shape, dtype) for _ in range(n)]
            return [own[l % n] for l in range(L)]

        # forward (saved for the backward when training)
        # residual input of layer l; x[L] final
        self.x = per_layer((BT, D), f32, kept) + [alloc((BT, D), f32)]
        self.x_mid = per_layer((BT, D), f32)  # residual after attention
        # each norm's row statistics: rstd, and the mean where it is a
        # layernorm (rmsnorm has none: a list of None)
        mean = per_layer if config.norm_bias else (lambda shape, dtype: [None] * L)
        self.mean1, self.rstd1 = mean((BT,), f32), per_layer((BT,), f32)
        self.mean2, self.rstd2 = mean((BT,), f32), per_layer((BT,), f32)
        # a norm's output, operand: one for both norms of every layer, read at
        # once by the product after it (q,k,v or gate,up); the backward's
        # layernorm writes it again, into h_back, for that product's weight
        # gradient
        self.h = alloc((BT, D), op_dtype)
        # the mlp norm's output kept per layer where the SwiGLU backward
        # computes the gate and up products again (Model.gate_up_later; the
        # gate/up products gu are then not kept, and the memory plan gives
        # whichever of the two the step does not touch no bytes)
        self.h_mlp = per_layer((BT, D), op_dtype)
        self.qkv = per_layer((BT, lay.qkv_width), op_dtype)  # rotated q, k and v, operands
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
                                                     attention.attention_scale(config.head_dim),
                                                     kv_heads=config.kv_heads)
            self.att_workspace[direction] = alloc((nbytes,), np.uint8) if nbytes else None
        # gate and up projections: kept per layer, or (recompute gate-up)
        # one buffer for every layer's forward and, below, one for the
        # backward's
        GU = lay.gate_up_width
        self.gu = ([alloc((BT, GU), f32)] * L if recompute == "gate-up"
                   else per_layer((BT, GU), f32))
        # silu(g) * u, operand: one for every layer, read at once by the down
        # product; the backward writes it again (swiglu_backward), into
        # a_back, for the down weight's gradient
        self.a = alloc((BT, F), op_dtype)
        self.meanf = alloc((BT,), f32) if config.norm_bias else None
        self.rstdf = alloc((BT,), f32)
        self.hf = alloc((BT, D), op_dtype)  # final_norm(x[L]), operand
        # the logits: whole for the eager forward; the step's classifier and
        # cross-entropy take them one chunk of rows at a time (Model.classifier_loss)
        self.logits = alloc((logits_chunk_rows(BT, V) if train else BT, V), f32)
        # scratch
        self.qkv32 = alloc((BT, lay.qkv_width), f32)  # projections (and biases) before rope
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
        self.dgu = alloc((BT, GU), op_dtype)
        self.gu_back = alloc((BT, GU), f32) if recompute == "gate-up" else None
        # the forward's h and a, written again by the backward: buffers of
        # their own, so that the forward's are not live from the last layer's
        # forward to the loss, the step's peak, nor these before the backward
        # (recompute block: a layer's forward done again writes its norms'
        # outputs into h_back too)
        self.h_back, self.a_back = alloc((BT, D), op_dtype), alloc((BT, F), op_dtype)
        self.dy = alloc((BT, D), op_dtype)
        if self.path.kind == "fused":  # (cuDNN's row terms live in its workspace)
            self.att_dot = alloc((B, H, T), f32)  # sum_j dp p per row
        elif not fused:
            self.dp = alloc((B, H, T, T), f32)
            self.ds = alloc((B, H, T, T), op_dtype, zeros=True)  # causal part written, as att_op
        # gradients of the rotated q, k: float32, or bfloat16 operands as
        # cuDNN's attention writes them (the rope backward reads either); the
        # materialized scores' products with grouped heads sum each key/value
        # head's dv here too, in float32, beside dk (the rope backward copies it)
        grouped = not fused and lay.kv_heads < lay.heads
        self.dqk = alloc((BT, lay.qkv_width if grouped else lay.qk_width),
                         op_dtype if cudnn else f32)
        self.dqkv = alloc((BT, lay.qkv_width), op_dtype)  # gradients of the q, k, v projections
        # each norm's weight (and bias) partial sums (2l attn_norm, 2l+1
        # mlp_norm, 2L final_norm), reduced at the end of the backward through
        # a table of their addresses: buffers of their own, so that those of
        # the layers not yet reached are not live
        self.ln_partials = [alloc((layernorm.layernorm_chunks(BT), lay.norm_params), f32)
                            for _ in range(2 * L + 1)]
        self.ln_table = address_table(alloc, [p.data.ptr for p in self.ln_partials], np.uint64)
        self.emb_index = alloc((V, 2), np.int32)  # per id: first position, count (scratch)
        # qkv_bias: the q, k, v bias gradients' partial column sums (scratch of each layer)
        self.bias_partials = (alloc((linear_bias.linear_bias_chunks(BT), lay.qkv_width), f32)
                              if config.qkv_bias else None)
        if recompute == "block":
            # the backward's own buffers of one layer's forward, which it
            # runs again for each layer (for_backward): so that the forward's
            # are not live at the loss, the step's peak, nor these before
            # the backward (the plan then shares their storage)
            for name in self._block_buffers():
                setattr(self, name + "_back", _same_buffers(getattr(self, name), alloc))
            # cuDNN's forward workspace too (its backward's is the backward's already)
            ws = self.att_workspace
            self.att_workspace_back = {"forward": _same_buffers(ws["forward"], alloc),
                                       "backward": ws["backward"]}

    def _block_buffers(self) -> list:
        """The attributes of one layer's forward (with the scratch it writes)
        that recompute "block" keeps once for every layer."""
        names = ["x_mid", "mean1", "rstd1", "mean2", "rstd2", "qkv", "att_stats", "att_m",
                 "att_l", "att", "y", "gu", "qkv32", "proj"]
        return [name for name in names if hasattr(self, name)]

    def for_backward(self) -> "Activations":
        """The buffers the backward uses: these, or with recompute "block" a
        view whose buffers of one layer's forward are the backward's own."""
        if self.recompute != "block":
            return self
        view = copy.copy(self)
        for name in self._block_buffers() + ["att_workspace"]:
            setattr(view, name, getattr(self, name + "_back"))
        return view


def _same_buffers(value, alloc):
    """New buffers from alloc of the shapes and dtypes of `value`: an array
    (or None), or a list of one buffer (or None) for every layer."""
    if isinstance(value, list):
        assert all(x is value[0] for x in value), "one buffer for every layer"
        return [_same_buffers(value[0], alloc)] * len(value)
    return None if value is None else alloc(value.shape, value.dtype)


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
    cos: object  # (T, R/2) float32 each, from float64 angles (R: config.rotary_dim)
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
    qkv_weights: object = None  # qkv_bias: (L, qkv_width * D) operands, each layer's q | k | v
    qkv_offsets: object = None  # qkv_bias: (L, 3) int64, their weights' offsets into P
    shard: "Shard" = None  # the sharded optimizer state (SPEC 23), else None: M, V its shard's
    Gshard: object = None  # (S,) float32, shard: this rank's shard of the summed gradient
    grad_shard: object = None  # Gradient over Gshard[:length]
    partials: object = None  # (W * NORM_BLOCKS,) float32, shard: every rank's norm partials


@dataclass
class Shard:
    """Rank r's shard of the parameter vector (SPEC 23): elements [offset,
    offset + length), of size = ceil(N/W) (the last rank's shorter), and
    the W*size buffers the collectives fill: P, G and Pb whole, padded
    after N with zeros (StepBuffers.P, .G and .Pb are their first N)."""

    offset: int
    length: int
    size: int
    P: object
    G: object
    Pb: object


def shard_range(N: int, world: int, rank: int) -> tuple:
    """(offset, length, size) of rank's shard of N elements over `world`
    ranks: size = ceil(N/W), offset = rank * size, the last shorter."""
    size = -(-N // world)
    offset = rank * size
    length = min(size, N - offset)
    if length <= 0:
        raise RunError(f"--shard-optimizer: {N} parameters over {world} ranks leave rank "
                       f"{rank} none")
    return offset, length, size


def allocate_state(alloc, config: Config, hyper: Hyper, precision: str, batch: int,
                   accumulate: int = 1, world: int = 1, shard: bool = False,
                   rank: int = 0) -> StepBuffers:
    """Every buffer but the activations, from `alloc` (Buffers, or the
    memory plan's VirtualBuffers: the same allocations in the same order).
    With accumulate k > 1 also the micro-batches' gradient and the row
    losses; with W = world > 1 ranks (SPEC 19) the input slot holds this
    rank's b = B/W contexts, and the step also has this rank's row losses,
    everyone's gathered, and the stop count. G is a flat buffer here only
    with k > 1 or W > 1 (it carries a sum); else the step's Gradient is
    allocated with the activations, in the memory plan's arena. With
    `shard` (W > 1, SPEC 23) M and V are rank's shard's (Shard), P, G and Pb
    padded to W shards, and the step also has the shard's gradient and
    every rank's norm partials."""
    reg = registry(config)
    N, T = reg.total, config.context
    b = batch // world
    sharded = None
    if shard and world > 1:
        offset, length, size = shard_range(N, world, rank)
        P_all = alloc((world * size,), np.float32, zeros=True)
        M, V = (alloc((size,), np.float32) for _ in range(2))
        G_all = alloc((world * size,), np.float32, zeros=True)
        Pb_all = alloc((world * size,), np.uint16, zeros=True) if precision == "bf16" else None
        sharded = Shard(offset, length, size, P_all, G_all, Pb_all)
        P, G, Pb = P_all[:N], G_all[:N], None if Pb_all is None else Pb_all[:N]
    else:
        P, M, V = (alloc((N,), np.float32) for _ in range(3))
        G = alloc((N,), np.float32) if accumulate > 1 or world > 1 else None
        Pb = alloc((N,), np.uint16) if precision == "bf16" else None
    t = alloc((1,), np.int32)
    c = alloc((4,), np.float32)
    rates = alloc.upload(schedule_table(hyper))
    partial = alloc((max(adamw.NORM_BLOCKS, adamw.adamw_blocks(N)),), np.float32)
    norm = alloc((2,), np.float32)
    decay = alloc.upload(reg.decay_ranges())
    cos, sin = (alloc.upload(x) for x in rope_tables(T, config.rotary_dim, np.float32,
                                                     config.rope_base))
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
    # qkv_bias: each layer's q, k, v weights gathered into one operand matrix
    # (in P each is followed by its bias), written from the operands of P by
    # every forward (Model.forward): the one q | k | v product's operand
    qkv_weights = qkv_offsets = None
    if config.qkv_bias:
        qkv_weights = alloc((config.n_layer, step_layout(config).qkv_width * config.d_model),
                            np.uint16 if precision == "bf16" else np.float32)
        qkv_offsets = alloc.upload(qkv_weight_offsets(config))
    Gshard = grad_shard = partials = None
    if sharded is not None:
        Gshard = alloc((sharded.size,), np.float32)
        grad_shard = Gradient.flat(Gshard[:sharded.length], alloc)
        partials = alloc((world * adamw.NORM_BLOCKS,), np.float32)
    return StepBuffers(P, M, V, G, Pb, t, c, rates, partial, norm, decay, cos, sin, ids, workspace,
                       norms, clip, AdamWConstants.of(hyper),
                       (float(hyper.beta1), float(hyper.beta2)), accumulate, Gmicro, grad,
                       grad_micro, rows, world, gathered, stop, qkv_weights, qkv_offsets,
                       sharded, Gshard, grad_shard, partials)


def qkv_weight_offsets(config: Config) -> np.ndarray:
    """(L, 3) int64: each layer's q, k and v weights' offsets into P."""
    reg = registry(config)
    return np.array([[reg[f"layers.{l}.attn.{part}.weight"].offset for part in "qkv"]
                     for l in range(config.n_layer)], dtype=np.int64)
