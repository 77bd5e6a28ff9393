"""The rope family (kernels/rope.cu): the rotation of q's and k's heads,
the first R elements of each (R = 2 * the tables' width), forward and
backward (of float32 gradients, or of bfloat16 operands as cuDNN's
attention writes them)."""

from __future__ import annotations

from ...reference.layout import qkv_columns

from .launch import Launcher, _vector, fused_head_dim, i32

KERNELS = ("rope_forward", "rope_backward", "rope_backward_operand")


class RopeLaunchers(Launcher):
    """The launchers of kernels/rope.cu."""

    def rope_forward(self, qkv, out, cos, sin, T, H, Hkv):
        # qkv (BT,qkv) float32 -> out (BT,qkv) operands: q's H heads and k's
        # Hkv heads rotated, v as is; cos, sin (T, R/2)
        BT, W = qkv.shape
        E = fused_head_dim(W, "qkv", H, Hkv)
        self._rope("rope_forward", qkv, out, cos, sin, T, H + Hkv, E, (W,))

    def rope_backward(self, dqk, dqkv, cos, sin, T, H, Hkv):
        # dqk (BT,qk) float32, the gradients of the rotated q and k, or (BT,qkv):
        # dv beside them, copied -> dqkv's q and k (and v) columns (BT,qkv) operands
        self._rope_backward("rope_backward", dqk, dqkv, cos, sin, T, H, Hkv)

    def rope_backward_operand(self, dqk, dqkv, cos, sin, T, H, Hkv):
        # dqk (BT,qk) operands (cuDNN's attention writes dq, dk so) -> dqkv's q
        # and k columns (BT,qkv) operands: rope_backward on the widened values
        self._rope_backward("rope_backward_operand", dqk, dqkv, cos, sin, T, H, Hkv)

    def _rope_backward(self, name, dqk, dqkv, cos, sin, T, H, Hkv):
        BT, W = dqkv.shape
        E = fused_head_dim(W, "qkv", H, Hkv)
        _, k, v = qkv_columns(H, Hkv, E)
        assert dqk.shape in ((BT, k.stop), (BT, v.stop)), (dqk.shape, dqkv.shape, H, Hkv)
        self._rope(name, dqk, dqkv, cos, sin, T, H + Hkv, E, (dqk.shape[1], W))

    def _rope(self, name, x, out, cos, sin, T, heads, E, widths):
        # x (BT, ldx) -> out (BT, ldo), widths (ldx, ldo) or (ldx,) when equal:
        # the first `heads` heads of E rotated in their first R elements, the
        # rest of x's columns copied
        BT, ldx = x.shape
        R = 2 * cos.shape[1]
        assert 0 < R <= E and R % 2 == 0 and cos.shape == sin.shape and cos.shape[0] >= T, \
            (R, E, cos.shape, sin.shape, T)
        vec = _vector(x, out, cos, sin, lengths=(R // 2, E))
        items = (heads * R // 2 + heads * (E - R) + ldx - heads * E) // 4 if vec else ldx
        self._rowwise(name, BT, items,
                      (x, out, cos, sin, i32(BT), i32(T), i32(heads), i32(E), i32(R), i32(ldx),
                       *(i32(w) for w in widths[1:]), i32(vec)))
