"""The fused attention family (kernels/attention_fused.cu): flash-attention
style kernels over bfloat16 operands, one entry point per head dim."""

from __future__ import annotations

from ...reference.layout import qkv_columns

from .launch import Launcher, _cdiv, f32, fused_head_dim, i32

ATTENTION_HEAD_DIMS = (16, 32, 64)  # head dims with fused attention kernels (attention_fused.cu)
# From this batch on the step's attention is fused. The fused kernels' grid
# is B*H*T/64 blocks of 4 warps and the longest block walks every key tile,
# so with few blocks the chip idles. Per layer, coppelius on an H200, fused
# vs materialized ms (dev/cuda/NOTES.md): B=1 0.111 vs 0.102, B=2 0.149 vs
# 0.206, B=4 0.235 vs 0.397, B=8 0.394 vs 0.769.
ATTENTION_FUSED_MIN_BATCH = 4
ATTENTION_TILE = 64  # ATT_TILE: query rows per block of the fused kernels, keys per tile

KERNELS = tuple(f"attention_{part}_e{E}" for E in (16, 32, 64)
                for part in ("forward", "backward_dq", "backward_dkdv"))


class AttentionFusedLaunchers(Launcher):
    """The launchers of kernels/attention_fused.cu."""

    # fused attention (bf16 policy, E in ATTENTION_HEAD_DIMS): q, k, v are
    # read from qkv (BT,qkv) operands of the layout for H query and Hkv
    # key/value heads (qkv_columns: q's head h at column h*E, k's and v's
    # head h // g at K + (h // g)*E and V + (h // g)*E, g = H / Hkv)
    def _attention(self, part, E, B, T, heads, args):
        # grid (tiles of T, B * heads): heads H (query tiles) or Hkv (key tiles)
        assert E in ATTENTION_HEAD_DIMS, E
        self._launch(f"attention_{part}_e{E}", (_cdiv(T, ATTENTION_TILE), B * heads), 128, args)

    @staticmethod
    def _columns(qkv, y, H, Hkv):
        # -> E and the layout's strides (W, K, V) of qkv's rows
        E = y.shape[1] // H
        assert fused_head_dim(qkv.shape[1], "qkv", H, Hkv) == E, (qkv.shape, y.shape, H, Hkv)
        _, k, v = qkv_columns(H, Hkv, E)
        return E, (i32(v.stop), i32(k.start), i32(v.start))

    def attention_forward(self, qkv, y, m, l, B, T, H, Hkv, scale):
        # qkv (BT,qkv) -> y (BT,D) operand; kept: m, l (B,H,T), the row maximum
        # of the scores times log2(e) and 1 / the row sum of exp(s - m)
        E, strides = self._columns(qkv, y, H, Hkv)
        self._attention("forward", E, B, T, H, (qkv, y, m, l, i32(T), i32(H), i32(Hkv), *strides,
                                                 f32(scale)))

    def attention_backward(self, qkv, y, dy, m, l, dot, dqk, dqkv, B, T, H, Hkv, scale):
        # y (BT,D) the forward's output, dy (BT,D) operands -> dq, dk into dqk
        # (BT,qk) float32, dv into dqkv's v columns, operand: dk, dv of a
        # key/value head summed over its query heads; dot (B,H,T) scratch:
        # sum_j dp p per row, written by the first kernel
        E, strides = self._columns(qkv, y, H, Hkv)
        _, k, _ = qkv_columns(H, Hkv, E)
        assert dqk.shape[1] == k.stop and dqkv.shape == qkv.shape, (dqk.shape, dqkv.shape)
        heads = (i32(T), i32(H), i32(Hkv), *strides, i32(k.stop))
        self._attention("backward_dq", E, B, T, H, (qkv, y, dy, m, l, dot, dqk, *heads,
                                                    f32(scale)))
        self._attention("backward_dkdv", E, B, T, Hkv, (qkv, dy, m, l, dot, dqk, dqkv, *heads,
                                                        f32(scale)))
