"""The CUDA backend (CLI name `cupy`; SPEC sections 13 and 14), the production path: the
whole training step -- forward, loss, backward, AdamW -- written as CUDA
kernels (accelerated/cuda/kernels/<family>.cu, launched by accelerated/cuda/<family>.py)
and cuBLAS products (accelerated/cuda/cublas.py) on one stream, captured once as
a CUDA graph and replayed.

Memory plan. Everything the step touches is allocated at capture and kept
for the program's life: P, M, V as flat float32 vectors with the
registry's layout (a parameter is an offset into them), the update count t
and the bias corrections on the device, the input slot (B, T+1) int32, the
gradient G, and every activation the backward needs, per layer. The
activation and scratch buffers, and G's segments (Gradient: one per layer,
the embedding's and the final norm's, each live from its first gradient to
AdamW), live in one arena where buffers whose lifetimes in the step do not
overlap share storage (accelerated/cuda/memory_plan.py: a dry run of this very
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
Under bf16, where cuDNN serves the shape (accelerated/cuda/cudnn_attention.py:
the nvidia-cudnn-frontend package importable, cuDNN's graphs supported),
from a batch of cudnn_attention.MIN_BATCH on, it is cuDNN's fused attention
(SDPA forward and backward, deterministic): q, k, v read in place from the
(BT, qkv) projection, y written in the (BT, D) layout, per row the softmax's
log-sum-exp kept for the backward, which writes dv into the projections'
gradient and dq, dk into the rope backward's input. Else, with a head dim
of 16, 32 or 64, from a batch of attention_fused.ATTENTION_FUSED_MIN_BATCH on,
the project's fused kernels (flash-attention style,
accelerated/cuda/kernels/attention_fused.cu's attention_forward_e*): tensor-core tiles over
the keys, causal tiles skipped, nothing of size T^2 in memory; per row
only the maximum and the sum of the softmax are kept for the backward,
which recomputes p. Otherwise (fp32, other head dims, small batches, where
the fused kernels leave the chip idle) it runs per batch element as
strided batched products over the heads, reading q, k, v straight out of
the (BT, qkv) projection and writing y in the (BT, D) layout with row
stride D, with the scores materialized (B, H, T, T) float32 and kept per
layer for the backward. The report gives the path and the one reason
cuDNN's is not used. Every path takes the layout's grouped heads (SPEC 21:
query head h with key/value head h // g, g = H / Hkv, a key/value head's
dk, dv the sum over its g query heads, in a fixed order) and the rope
kernels its partial rotary (the first R elements of each q and k head).

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
(reference.contract.capture_or_fallback: the report says why).
COPPELIUS_NO_CAPTURE=1 runs the same step eagerly on every replay instead:
for debugging, not for training.

The modules, one concern each, in the order the step is built:

    policy.py           which attention a step runs; the logits' chunk rows
    buffers.py          device buffers: the allocator, the gradient's segments,
                        the activations, the step's other buffers
    model.py            the forward and backward as kernel launches and products
    step.py             the training step (forward, backward, norm, AdamW) and
                        its memory plan's dry run
    program.py          CupyProgram: capture, replay, the TrainingProgram
                        interface; available(), capture() (the backend module)
    binding.py          the checkpoint binding's backend on CuPy arrays
    report.py           the compilation report, partitions, memory analysis
    memory_plan.py      lifetimes and the arena (a dry run, no GPU)
    cublas.py, cudnn_attention.py, distributed.py
                        cuBLAS's products, cuDNN's attention, NCCL's collectives
    compile.py          the kernels' module: source assembly (#line mapped),
                        compilation, Kernels (every family's launchers)
    launch.py           the launch machinery the families share
    <family>.py         a kernel family's launchers, beside kernels/<family>.cu:
                        precision, embedding, layernorm, rmsnorm, linear_bias,
                        rope, attention, attention_fused, swiglu, crossentropy,
                        adamw
    cupy_debug.py       debugging entry points (one part of the step alone)
"""
