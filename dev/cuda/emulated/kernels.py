"""The stand-in of the compiled module (cupy.RawModule): every kernel
family's NumPy kernels by name (emulated/<family>.py, as
accelerated/cuda/<family>.py launches kernels/<family>.cu), launched as
commands of the current stream."""

from __future__ import annotations

from . import (adamw, attention, attention_fused, crossentropy, embedding, layernorm,
               linear_bias, precision, rmsnorm, rope, swiglu)
from .runtime import _STATE, _submit


# every family's k_<kernel>, by its kernel name
KERNELS = {name[2:]: fn for family in (precision, embedding, layernorm, rmsnorm, rope,
                                       linear_bias, attention, attention_fused, swiglu,
                                       crossentropy, adamw)
           for name, fn in vars(family).items() if name.startswith("k_")}
# the fused attention: one entry point per head dimension, one contract
_FUSED = {part: KERNELS.pop(f"attention_{part}") for part in ("forward", "backward_dq",
                                                              "backward_dkdv")}
for _E in (16, 32, 64):
    for _part, _fn in _FUSED.items():
        KERNELS[f"attention_{_part}_e{_E}"] = _fn
# the layernorm and rmsnorm kernels: one entry point per row width in
# registers (a warp's, _c<NC>, or a block's, _w<NC>), one contract
_NORMS = {f"{norm}_{part}": KERNELS.pop(f"{norm}_{part}") for norm in ("layernorm", "rmsnorm")
          for part in ("forward", "backward")}
for _variant in ("c1", "c2", "c4", "c8", "w2", "w4", "w8"):
    for _name, _fn in _NORMS.items():
        KERNELS[f"{_name}_{_variant}"] = _fn


class RawModule:
    def __init__(self, code, options=()):
        self.bf16 = "-DOPERAND_BF16" in options

    def get_function(self, name):
        body = KERNELS[name]
        bf16 = self.bf16

        def launch(grid, block, args, shared_mem=0):
            # On a GPU a kernel launched during a capture on any stream but
            # the capturing one runs at once and is missing from the graph
            capturing, current = _STATE.capturing, _STATE.current
            if capturing is not None and (not current or current[-1] is not capturing):
                raise AssertionError(f"kernel {name} launched outside the capturing stream")
            frozen = tuple(args)  # arguments are frozen at launch, as in a graph
            _submit(lambda: body(bf16, *frozen))

        return launch
