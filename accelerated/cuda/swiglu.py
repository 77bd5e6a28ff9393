"""The swiglu family (kernels/swiglu.cu): silu(g) * u of the gate and up
projections, forward and backward."""

from __future__ import annotations

from .launch import Launcher, _opt, _vector, i32

KERNELS = ("swiglu_forward", "swiglu_backward")


class SwigluLaunchers(Launcher):
    """The launchers of kernels/swiglu.cu."""

    def swiglu_forward(self, gu, a):
        # gu (BT,2F) -> a (BT,F) operand
        BT, F = a.shape
        vec = _vector(gu, a, lengths=(F,))
        self._rowwise("swiglu_forward", BT, F // 4 if vec else F, (gu, a, i32(BT), i32(F),
                                                                   i32(vec)))

    def swiglu_backward(self, da, gu, dgu, a=None):
        # da (BT,F), gu (BT,2F) -> dgu (BT,2F) operands, and (a: not None) the
        # forward's a (BT,F) = silu(g) * u operand again, bitwise
        BT, F = da.shape
        vec = _vector(da, gu, dgu, a, lengths=(F,))
        self._rowwise("swiglu_backward", BT, F // 4 if vec else F,
                      (da, gu, dgu, _opt(a), i32(BT), i32(F), i32(vec)))
