"""The cross-entropy family (kernels/crossentropy.cu): row losses and the
logits' gradient in one kernel, the mean loss, and the row losses from
the partials of the classifier's loss in its product (gemm.py's lse
variants)."""

from __future__ import annotations

from .launch import Launcher, _cdiv, _threads_over, _vector, f32, i32

CE_THREADS = 512  # threads per row of crossentropy_forward_backward

KERNELS = ("crossentropy_forward_backward", "mean_loss", "crossentropy_combine")
COMBINE_THREADS = 256  # crossentropy_combine: a warp a row


class CrossentropyLaunchers(Launcher):
    """The launchers of kernels/crossentropy.cu."""

    def crossentropy_forward_backward(self, logits, ids, ids_stride, T, ce, dlogits, dce,
                                      row0=0):
        # logits (rows,V) -> ce (rows), dlogits (rows,V) operands for the mean's
        # gradient dce; the rows are rows row0.. of the batch's BT (their targets)
        rows, V = logits.shape
        assert ce.shape == (rows,) and dlogits.shape == (rows, V), (ce.shape, dlogits.shape)
        vec = _vector(logits, dlogits, lengths=(V,))
        self._launch("crossentropy_forward_backward", rows, _threads_over(_cdiv(V, 4), CE_THREADS),
                     (logits, ids, i32(ids_stride), i32(T), i32(row0), ce, dlogits, i32(V),
                      f32(dce), i32(vec)))

    def mean_loss(self, ce, loss):
        self._launch("mean_loss", 1, 1024, (ce, loss, i32(ce.size)))

    def crossentropy_combine(self, part, target, ce, stats):
        """part (rows, 2 tiles) float32, each tile's (maximum, sum of exp) of
        a row's logits, target (rows) the target's logit -> ce (rows) the row
        losses and stats (rows, 2) each row's (maximum, sum), for the
        gradient's product."""
        rows, tiles = part.shape[0], part.shape[1] // 2
        assert part.shape == (rows, 2 * tiles) and target.shape == (rows,), part.shape
        assert ce.shape == (rows,) and stats.shape == (rows, 2), (ce.shape, stats.shape)
        self._launch("crossentropy_combine", _cdiv(32 * rows, COMBINE_THREADS), COMBINE_THREADS,
                     (part, i32(tiles), target, ce, stats, i32(rows)))
