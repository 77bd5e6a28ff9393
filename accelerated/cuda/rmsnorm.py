"""The rmsnorm family (kernels/rmsnorm.cu): the forward with the residual
add and the backward with its per-block weight partials, in layernorm's
layout and partition (accelerated/cuda/layernorm.py: the register variants,
the rows per block), so that layernorm_param_grads reduces the partials of
either norm."""

from __future__ import annotations

from .launch import Launcher, _opt, _vector, f32, i32
from .layernorm import (VARIANTS, layernorm_chunk, layernorm_chunks, layernorm_variant,
                        norm_backward_threads, norm_forward_grid)

KERNELS = tuple(f"rmsnorm_{part}_{v}" for v in VARIANTS for part in ("forward", "backward"))


class RmsnormLaunchers(Launcher):
    """The launchers of kernels/rmsnorm.cu."""

    def rmsnorm_forward(self, x_prev, add, x_out, h, rstd, w, eps):
        # x_prev (+ add -> x_out) (rows,D) -> h (rows,D) operand, rstd (rows)
        rows, D = x_prev.shape
        vec = _vector(x_prev, add, x_out, h, w, lengths=(D,))
        self._launch(f"rmsnorm_forward_{layernorm_variant(D)}", *norm_forward_grid(rows, D),
                     (x_prev, _opt(add), _opt(x_out), h, rstd, w, i32(rows), i32(D), f32(eps),
                      i32(vec)))

    def rmsnorm_backward(self, dout, dres, x, rstd, w, dx, dx_op, partials, h=None):
        # dout (rows,D) -> dx (rows,D) (+ dres), dx_op, partials (chunks, D):
        # chunks = layernorm_chunks(rows), each the sums over layernorm_chunk(rows) rows;
        # h (not None): the forward's output h (rows,D) operand again, bitwise
        rows, D = dout.shape
        chunks = layernorm_chunks(rows)
        assert partials.shape == (chunks, D), (partials.shape, chunks, D)
        vec = _vector(dout, dres, x, w, h, dx, dx_op, lengths=(D,))
        self._launch(f"rmsnorm_backward_{layernorm_variant(D)}", chunks,
                     norm_backward_threads(D),
                     (dout, _opt(dres), x, rstd, w, _opt(h), dx, _opt(dx_op), partials,
                      i32(rows), i32(D), i32(layernorm_chunk(rows)), i32(vec)))
