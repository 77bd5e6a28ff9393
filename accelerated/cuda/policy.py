"""The CUDA step's policy: which attention a step runs (attention_path,
by measured thresholds) and the rows of one chunk of the step's logits."""

from __future__ import annotations

from dataclasses import dataclass

from ...reference.config import Config

from . import attention, attention_fused, cudnn_attention


@dataclass(frozen=True)
class AttentionPath:
    """How a step's attention runs: "cudnn" (cuDNN's fused attention,
    accelerated/cuda/cudnn_attention.py), "fused" (the project's fused kernels,
    accelerated/cuda/kernels/attention_fused.cu) or "materialized" (the (B,H,T,T) scores and
    cuBLAS batched products); `reason`: why not cuDNN ('' when cuDNN)."""

    kind: str
    reason: str


def attention_path(config: Config, precision: str, batch: int, context: int | None = None,
                   train: bool = True) -> AttentionPath:
    """The attention of a (batch, context) step (context: config.context by
    default; train: the backward too). Under bf16: cuDNN's from batch
    cudnn_attention.MIN_BATCH on where cuDNN serves the shape, else the
    project's fused kernels for their head dims from batch
    attention_fused.ATTENTION_FUSED_MIN_BATCH on, else the materialized scores
    (the thresholds are measured: each path's time per layer in
    accelerated/cuda/attention_fused.py and cudnn_attention.py). fp32 keeps the materialized
    scores: both fused paths take bfloat16 operands. Every path computes
    grouped heads (config.kv_heads < H: cuDNN's own grouped-query attention,
    where it serves the shape; the fused kernels and the materialized
    products index key/value head h // g); the rotary fraction is the rope
    kernels' alone."""
    if precision != "bf16":
        return AttentionPath("materialized", "fp32 policy: cuDNN's and the fused kernels' "
                                             "attention take bfloat16 operands")
    T = config.context if context is None else context
    H, Hkv, E = config.n_head, config.kv_heads, config.head_dim
    if batch < cudnn_attention.MIN_BATCH:
        why = (f"batch {batch} < {cudnn_attention.MIN_BATCH}: cuDNN's attention is slower there "
               "than the project's")
    else:
        why = cudnn_attention.unavailable(batch, T, H, E, attention.attention_scale(E), train,
                                          kv_heads=Hkv)
    if not why:
        return AttentionPath("cudnn", "")
    kernels = E in attention_fused.ATTENTION_HEAD_DIMS and \
        batch >= attention_fused.ATTENTION_FUSED_MIN_BATCH
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
