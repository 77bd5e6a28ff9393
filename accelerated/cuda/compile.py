"""The CUDA kernels' module: its source assembled from the kernel files and
compiled once per precision policy, with every family's launchers (llm.c
style: one family's kernel source, accelerated/cuda/kernels/<family>.cu,
and its launchers, accelerated/cuda/<family>.py, one launcher per kernel;
names follow the reference's layer functions; the launch machinery they
share is accelerated/cuda/launch.py).

Shapes use the project's letters: B batch, T context, D d_model, H heads,
E = D/H head dim, F d_ff, V vocab, BT = B*T rows. Activations are row-major
float32. `floatX` is the type of a matrix-product operand under the
precision policy (SPEC section 6): float for fp32, the bits of a bfloat16
(unsigned short, rounded to nearest even) for bf16. A kernel that produces
a tensor whose only use is as a matrix-product operand writes it as floatX
directly, so the bf16 policy costs no separate rounding pass. The files
are concatenated into one module (module_source), compiled once per policy
(`-DOPERAND_BF16` selects bf16); no system header is included, so NVRTC
compiles it as is.

Determinism: no kernel uses floating-point atomics. Every reduction runs
in a fixed order (warp shuffles in a fixed tree, then shared memory in warp
order), so a replay gives the same bits every time and resume is exact
(SPEC 9). The norms' weight gradients and the q, k, v bias gradients
reduce in two passes (per-block partials, then the blocks in order); the
embedding gradient of an id is summed by one block over the positions
holding it, in position order, as the reference's np.add.at does
(integer atomics find each id's first position and count: a minimum and
a sum, the same in any order).

Elementwise formulas that the reference writes as separate float32
operations use the _rn intrinsics (no fused multiply-add) where that makes
the kernel reproduce the reference's rounding exactly: AdamW, rope, the
layernorm and rmsnorm normalizations, the q, k, v biases. Division and
sqrtf are IEEE (no fast math).
"""

from __future__ import annotations

import os

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None

from . import (adamw, attention, attention_fused, crossentropy, dependent_launch, embedding,
               layernorm, linear_bias, precision, rmsnorm, rope, swiglu)
from .precision import PrecisionLaunchers
from .embedding import EmbeddingLaunchers
from .layernorm import LayernormLaunchers
from .rmsnorm import RmsnormLaunchers
from .linear_bias import LinearBiasLaunchers
from .rope import RopeLaunchers
from .attention import AttentionLaunchers
from .attention_fused import AttentionFusedLaunchers
from .swiglu import SwigluLaunchers
from .crossentropy import CrossentropyLaunchers
from .adamw import AdamwLaunchers

# ---------------------------------------------------------------------------
# kernel source
# ---------------------------------------------------------------------------

# The kernels are package data, one file per layer family, concatenated in
# this order into one module: common.cuh first (the operand type floatX and
# the warp and block reductions the others use), then the families in the
# order of the step (rmsnorm.cu after layernorm.cu, whose partition and
# column sums it uses).
KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
FILES = ("common.cuh", "precision.cu", "embedding.cu", "layernorm.cu", "rmsnorm.cu",
         "linear_bias.cu", "rope.cu", "attention.cu", "attention_fused.cu", "swiglu.cu",
         "crossentropy.cu", "adamw.cu")


def module_source(replace: dict | None = None) -> str:
    """The module's CUDA source: the files of FILES in order, each after a
    `#line 1 "accelerated/cuda/kernels/<file>"` directive, so that NVRTC's errors
    and a profiler's source view name the file and its line. The files are
    concatenated, not #included: CuPy's compile cache is keyed on the source
    string (and the options), so an included file's edit would not be
    recompiled.

    replace: {name in FILES: path}, whole files swapped for this source
    (dev/cuda's kernel variants replace attention_fused.cu); the #line
    directive then names the path as given."""
    replace = dict(replace or {})
    unknown = sorted(set(replace) - set(FILES))
    if unknown:
        raise ValueError(f"replace: {', '.join(unknown)} not a kernel file (one of "
                         f"{', '.join(FILES)})")
    parts = []
    for name in FILES:
        path = replace.get(name, os.path.join(KERNEL_DIR, name))
        # forward slashes: a backslash in the directive's string would be an escape
        label = replace.get(name, f"accelerated/cuda/kernels/{name}").replace("\\", "/")
        with open(path, encoding="utf-8") as f:
            parts.append(f'#line 1 "{label}"\n{f.read()}')
    return "\n".join(parts)


# every kernel of the module, by family (each family's launcher module lists its own)
KERNELS = (*precision.KERNELS, *embedding.KERNELS, *layernorm.KERNELS, *rmsnorm.KERNELS,
           *linear_bias.KERNELS, *rope.KERNELS, *attention.KERNELS, *attention_fused.KERNELS,
           *swiglu.KERNELS, *crossentropy.KERNELS, *adamw.KERNELS)


def compile_options(precision: str) -> tuple:
    return ("-DOPERAND_BF16",) if precision == "bf16" else ()


class Kernels(PrecisionLaunchers, EmbeddingLaunchers, LayernormLaunchers, RmsnormLaunchers,
              LinearBiasLaunchers, RopeLaunchers, AttentionLaunchers, AttentionFusedLaunchers,
              SwigluLaunchers, CrossentropyLaunchers, AdamwLaunchers):
    """The module compiled for one precision policy, and one launcher per
    kernel (each family's, from its module: accelerated/cuda/<family>.py).
    Arguments are contiguous CuPy arrays (RawKernel checks neither
    strides nor dtypes: the launchers pass explicit numpy scalars). Every
    launch goes to the current CuPy stream, so a launcher called inside a
    stream capture is recorded into the graph. replace swaps whole kernel
    files, as module_source's (for dev/cuda's variants; the backend passes
    none). dry=True compiles nothing and launches nothing: with a `log`
    set, the launchers only record their launches (the memory plan's dry
    run, accelerated/cuda/memory_plan.py)."""

    def __init__(self, precision: str, replace: dict | None = None, dry: bool = False):
        self.precision = precision
        if dry:
            self.functions = {name: (lambda *args, **kwargs: None) for name in KERNELS}
        else:
            module = cupy.RawModule(code=module_source(replace),
                                    options=compile_options(precision))
            self.functions = {name: module.get_function(name) for name in KERNELS}
            if replace is None:  # the project's own files: every kernel waits (common.cuh)
                self.functions = dependent_launch.wrap(self.functions, cupy)
        self.launches = 0  # kernel launches so far (the capture counts its own)
        self.log = None  # a memory_plan.CommandLog recording every launch, or None
