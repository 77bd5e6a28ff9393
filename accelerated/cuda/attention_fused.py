"""The fused attention family (kernels/attention_fused.cu): flash-attention
style kernels over bfloat16 operands, one entry point per head dim."""

from __future__ import annotations

from .launch import Launcher, _cdiv, f32, i32, ungrouped_d

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
    # read from qkv (BT,qkv) operands, head h at column h*E of q's, k's and v's
    # columns (the ungrouped layout: ungrouped_d)
    def _attention(self, part, E, B, T, H, args):
        assert E in ATTENTION_HEAD_DIMS, E
        self._launch(f"attention_{part}_e{E}", (_cdiv(T, ATTENTION_TILE), B * H), 128, args)

    def attention_forward(self, qkv, y, m, l, B, T, H, scale):
        # qkv (BT,qkv) -> y (BT,D) operand; kept: m, l (B,H,T), the row maximum
        # of the scores times log2(e) and 1 / the row sum of exp(s - m)
        E = y.shape[1] // H
        ungrouped_d(qkv.shape[1], "qkv", H, E)
        self._attention("forward", E, B, T, H, (qkv, y, m, l, i32(T), i32(H), f32(scale)))

    def attention_backward(self, qkv, y, dy, m, l, dot, dqk, dqkv, B, T, H, scale):
        # y (BT,D) the forward's output, dy (BT,D) operands -> dq, dk into dqk
        # (BT,qk) float32, dv into dqkv's v columns, operand; dot (B,H,T)
        # scratch: sum_j dp p per row, written by the first kernel
        E = y.shape[1] // H
        ungrouped_d(qkv.shape[1], "qkv", H, E)
        self._attention("backward_dq", E, B, T, H, (qkv, y, dy, m, l, dot, dqk, i32(T), i32(H),
                                                    f32(scale)))
        self._attention("backward_dkdv", E, B, T, H, (qkv, dy, m, l, dot, dqk, dqkv, i32(T),
                                                      i32(H), f32(scale)))
