"""The precision family (kernels/precision.cu): the bfloat16 copy of a
float32 vector, rounded to nearest even (SPEC 6)."""

from __future__ import annotations

from .launch import Launcher

KERNELS = ("round_bf16",)


class PrecisionLaunchers(Launcher):
    """The launchers of kernels/precision.cu."""

    def round_bf16(self, x, out):
        # x (n) float32 -> out (n) bfloat16 bits (uint16)
        self._flat("round_bf16", x.size, (x, out), x, out)
