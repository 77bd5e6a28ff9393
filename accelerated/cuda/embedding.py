"""The embedding family (kernels/embedding.cu): the token embedding's gather
and its gradient, each id's rows summed in position order (added to the
unembedding gradient where the embedding is tied)."""

from __future__ import annotations

import numpy as np

from .launch import Launcher, _cdiv, _vector, i32

EMBEDDING_THREADS = 256  # EMB_THREADS: positions per pass of embedding_backward (embedding.cu)

KERNELS = ("embedding_forward", "embedding_index_reset", "embedding_index",
           "embedding_backward", "embedding_backward_unseen")


class EmbeddingLaunchers(Launcher):
    """The launchers of kernels/embedding.cu."""

    def embedding_forward(self, ids, ids_stride, T, W, x):
        # ids (B, ids_stride), W (V,D) -> x (BT,D)
        BT, D = x.shape
        vec = _vector(W, x, lengths=(D,))
        self._elementwise("embedding_forward", BT * D // 4 if vec else BT * D,
                          (ids, i32(ids_stride), i32(T), W, x, i32(BT), i32(D), i32(vec)))

    def embedding_backward(self, dx, ids, ids_stride, T, dW, index, accumulate=True):
        # dx (BT,D) -> dW (V,D): accumulate, dW holding the unembedding gradient
        # (tied): dW += the gather gradient; else dW = the gather gradient (untied,
        # SPEC 21: the rows of ids absent from the batch zero). index (V,2) int32
        # scratch: each id's first position and count
        BT, D = dx.shape
        V = dW.shape[0]
        assert index.shape == (V, 2) and index.dtype == np.int32, (index.shape, index.dtype)
        vec = _vector(dx, dW, lengths=(D,))
        # 128 threads where they hold a row's chunks: most blocks leave at
        # once, and small blocks retire fast; a thread holds 4 features, so
        # rows wider than 4 * EMBEDDING_THREADS take slices of that many
        threads = 128 if vec and D <= 4 * 128 else EMBEDDING_THREADS
        slices = _cdiv(D, 4 * threads)
        self._elementwise("embedding_index_reset", V, (index, i32(V)))
        self._elementwise("embedding_index", BT, (ids, i32(ids_stride), i32(T), i32(BT), index))
        if not accumulate:
            assert V * D < 2**31, (V, D)  # int indices
            self._elementwise("embedding_backward_unseen", V * D // 4 if vec else V * D,
                              (index, dW, i32(V), i32(D), i32(vec)))
        self._launch("embedding_backward", (BT, slices), threads,
                     (dx, ids, i32(ids_stride), i32(T), i32(BT), dW, i32(D), index,
                      i32(accumulate), i32(vec)))
