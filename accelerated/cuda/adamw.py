"""The AdamW family (kernels/adamw.cu, SPEC 7): the bias corrections on the
device, the gradient's norm and clip scale, the update of P, M, V (and
Pb), and the sum of a micro-batch's gradient (SPEC 19)."""

from __future__ import annotations

import numpy as np

from .launch import THREADS, Launcher, _cdiv, _opt, _vector, f32, f64, i32, i64

NORM_BLOCKS = 1056  # blocks of the norm's first pass: 8 per SM of an H200, a fixed order

KERNELS = ("adamw_bias_corrections", "adamw_bias_corrections_table", "gradient_sum_squares",
           "gradient_norm_clip", "adamw_update", "accumulate_gradient")


def adamw_blocks(n: int) -> int:
    """At most the blocks of adamw_update over n parameters (one element
    per item where the vectors are not 16-byte aligned): the room for the
    partial sums it writes without clipping."""
    return max(1, _cdiv(n, THREADS))


class AdamwLaunchers(Launcher):
    """The launchers of kernels/adamw.cu."""

    def adamw_bias_corrections(self, t, c, beta1: float, beta2: float, rates):
        # t (1) int32 += 1; c (4) float32 = c1, c2, a_t, b_t of the new t;
        # rates (R, 2) float32: reference.adamw.schedule_table
        self._launch("adamw_bias_corrections", 1, 1,
                     (t, c, f64(beta1), f64(beta2), rates, i32(rates.shape[0])))

    def gradient_norm(self, G, partial, norm, clip: float):
        # G (N; buffers.Gradient, through its segments' table) -> partial
        # (NORM_BLOCKS) -> norm (2) = (||G||, clip scale); clip 0: off
        self.gradient_sum_squares(G, partial)
        self.gradient_norm_clip(partial, norm, clip)

    def gradient_sum_squares(self, G, partial):
        # G (buffers.Gradient) -> partial (NORM_BLOCKS): each block's sum of squares
        n4 = G.size // 4 if G.vector else 0
        self._launch("gradient_sum_squares", partial.size, THREADS,
                     (G.table, i32(len(G.parts)), i64(G.size), i64(n4), partial), reads=G.parts)

    def gradient_norm_clip(self, partial, norm, clip: float):
        # partial (any length) -> norm (2) = (sqrt of their sum, clip scale),
        # the sum in one fixed order; clip 0: off
        self._launch("gradient_norm_clip", 1, 1024, (partial, i32(partial.size), norm, f32(clip)))

    def adamw_bias_corrections_table(self, ts, c1, c2, beta1: float, beta2: float):
        self._elementwise("adamw_bias_corrections_table", ts.size,
                          (ts, c1, c2, i32(ts.size), f64(beta1), f64(beta2)))

    def adamw_update(self, P, M, V, G, decay, Pb, c, norm, k, partial=None, base: int = 0):
        # P, M, V, G (N) float32 (G: buffers.Gradient, through its
        # segments' table), decay (R, 2) int64: the decayed elements'
        # sorted, disjoint [start, end) runs (Registry.decay_ranges), Pb (N)
        # bfloat16 bits or None, c (4) c1, c2, a_t, b_t; norm (2) with the clip
        # scale norm[1]; k: reference.adamw.AdamWConstants (the betas and epsilon).
        # partial (at least adamw_blocks(N)) float32, clipping off: the scale is
        # 1 (norm unread) and each block's sum of G's squares goes to partial
        # (gradient_norm_finish takes the norm from them). base: the
        # vectors are one shard's, element 0 element `base` of the whole
        # vector (SPEC 23; decay holds whole-vector indices)
        n = P.size
        assert decay.dtype == np.int64 and decay.shape[1:] == (2,), decay.shape
        assert G.size == n, (G.size, n)
        n4 = n // 4 if _vector(P, M, V, Pb) and G.vector else 0
        blocks = max(1, _cdiv(n4 + n - 4 * n4, THREADS))
        assert partial is None or partial.size >= blocks, (partial.size, blocks)
        self._launch("adamw_update", blocks, THREADS,
                     (P, M, V, G.table, i32(len(G.parts)), decay, i32(decay.shape[0]), i64(base),
                      _opt(Pb), c, norm, i64(n), i64(n4), f32(k.b1), f32(k.omb1), f32(k.b2),
                      f32(k.omb2), f32(k.eps), _opt(partial)), reads=G.parts)
        return blocks

    def gradient_norm_finish(self, partial, blocks, norm):
        # partial[:blocks], adamw_update's sums of squares -> norm (2) = (||G||, 1)
        self._launch("gradient_norm_clip", 1, 1024, (partial, i32(blocks), norm, f32(0.0)))

    def accumulate_gradient(self, G, Gm):
        # G, Gm (N) float32: G += Gm (a micro-batch's gradient, SPEC 19)
        self._flat("accumulate_gradient", G.size, (G, Gm), G, Gm)
