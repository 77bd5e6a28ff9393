"""The rope family (kernels/rope.cu): the rotation of q and k, forward
and backward (of float32 gradients, or of bfloat16 operands as cuDNN's
attention writes them)."""

from __future__ import annotations

from .launch import Launcher, _vector, i32, ungrouped_d

KERNELS = ("rope_forward", "rope_backward", "rope_backward_operand")


class RopeLaunchers(Launcher):
    """The launchers of kernels/rope.cu."""

    def rope_forward(self, qkv, out, cos, sin, T, H):
        # qkv (BT,qkv) float32 -> out (BT,qkv) operands; cos, sin (T, E/2)
        BT, W = qkv.shape
        D = ungrouped_d(W, "qkv", H, 2 * cos.shape[1])
        vec = _vector(qkv, out, cos, sin, lengths=(D // H // 2,))
        self._rowwise("rope_forward", BT, D // 2 if vec else W,
                      (qkv, out, cos, sin, i32(BT), i32(T), i32(D), i32(H), i32(vec)))

    def rope_backward(self, dqk, dqkv, cos, sin, T, H):
        # dqk (BT,qk) float32 -> dqkv's q and k columns (BT,qkv) operands
        self._rope_backward("rope_backward", dqk, dqkv, cos, sin, T, H)

    def rope_backward_operand(self, dqk, dqkv, cos, sin, T, H):
        # dqk (BT,qk) operands (cuDNN's attention writes dq, dk so) -> dqkv's q
        # and k columns (BT,qkv) operands: rope_backward on the widened values
        self._rope_backward("rope_backward_operand", dqk, dqkv, cos, sin, T, H)

    def _rope_backward(self, name, dqk, dqkv, cos, sin, T, H):
        BT, QK = dqk.shape
        D = ungrouped_d(QK, "qk", H, 2 * cos.shape[1])
        vec = _vector(dqk, dqkv, cos, sin, lengths=(D // H // 2,))
        self._rowwise(name, BT, D // 4 if vec else QK,
                      (dqk, dqkv, cos, sin, i32(BT), i32(T), i32(D), i32(H), i32(vec)))
