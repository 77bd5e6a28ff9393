"""The cross-entropy family (kernels/crossentropy.cu): row losses and the
logits' gradient in one kernel, and the mean loss."""

from __future__ import annotations

from .launch import Launcher, _cdiv, _threads_over, _vector, f32, i32

CE_THREADS = 512  # threads per row of crossentropy_forward_backward

KERNELS = ("crossentropy_forward_backward", "mean_loss")


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
