"""cuDNN's attention (accelerated/cuda/cudnn_attention.py), as the step runs
it, against the reference's layer function and, with grouped heads, the
reference model's attention."""

from fractions import Fraction

import numpy as np
import pytest

from coppelius.reference.config import Config
from coppelius.reference.layers.attention import attention_backward, attention_forward
from coppelius.reference.precision import round_bf16
from coppelius.accelerated.cuda import attention_fused
from coppelius.accelerated.cuda.policy import attention_path
from coppelius.accelerated.cuda.cupy_debug import cudnn_from_batch, step_attention

from .helpers import check_close, check_bitwise, need_cudnn
from .test_attention import (FAMILY, check_family_activations, check_family_step,
                             family_config, grouped_inputs, reference_attention)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@pytest.mark.parametrize("Bn, H, T, E", [(1, 1, 1, 64), (2, 3, 65, 32), (1, 2, 200, 16),
                                         (3, 2, 130, 64), (2, 8, 1024, 64)])
def test_cudnn_attention_matches_reference_layer(Bn, H, T, E):
    """cuDNN's attention, forward and backward, against
    reference.layers.attention within SPEC 14's bf16 tolerances (its softmax
    is online: p v takes the rounded unnormalized exp, so y is not the
    reference's round(p) v to the last bit), and bitwise the same on a
    second run (the deterministic backward). A shape cuDNN refuses runs the
    project's kernels, with cuDNN's reason."""
    need_cudnn()
    rng = np.random.default_rng(T * 7 + E)
    q, k = 2 * rng.standard_normal((2, Bn, H, T, E))
    v, dy = rng.standard_normal((2, Bn, H, T, E))
    q, k, v, dy = (round_bf16(x.astype(np.float32)) for x in (q, k, v, dy))
    with cudnn_from_batch(1):
        path = attention_path(Config(8, T, H * E, 1, H, 8), "bf16", Bn)
        got = step_attention("bf16", q, k, v, dy)
        again = step_attention("bf16", q, k, v, dy)
    if path.kind != "cudnn":  # (T = 1: cuDNN 9.19 refuses it) the project's own, and why
        assert path.reason.startswith("cuDNN refuses"), path
        fused = E in attention_fused.ATTENTION_HEAD_DIMS and \
            Bn >= attention_fused.ATTENTION_FUSED_MIN_BATCH
        assert path.kind == ("fused" if fused else "materialized")
    want_y, cache = attention_forward(q, k, v, "bf16")
    want = (round_bf16(want_y), *attention_backward(dy, cache, "bf16"))
    for name, g, w, a in zip(("y", "dq", "dk", "dv"), got, want, again):
        check_close(name, g, w, 1e-2)
        check_bitwise(name + " (second run)", a, g)


@pytest.mark.parametrize("Bn, H, Hkv, T, E", [(1, 4, 1, 65, 32), (2, 4, 2, 130, 64),
                                              (3, 6, 2, 200, 16), (1, 12, 4, 256, 64)])
def test_cudnn_grouped_query_attention_matches_reference_model(Bn, H, Hkv, T, E):
    """cuDNN's grouped-query attention (k, v of dims (B, Hkv, T, E) inside
    the layout's (BT, qkv) row; dk, dv summed over each key/value head's
    query heads) against the reference model's, within SPEC 14's bf16
    tolerances, and bitwise the same on a second run. A shape cuDNN refuses
    runs the project's kernels, with cuDNN's reason naming Hkv."""
    need_cudnn()
    q, k, v, dy = grouped_inputs(Bn, H, Hkv, T, E, "bf16", T * 7 + E + Hkv)
    with cudnn_from_batch(1):
        path = attention_path(Config(8, T, H * E, 1, H, 8, n_kv_head=Hkv), "bf16", Bn)
        got = step_attention("bf16", q, k, v, dy)
        again = step_attention("bf16", q, k, v, dy)
    if path.kind != "cudnn":
        assert path.reason.startswith("cuDNN refuses") and f" Hkv={Hkv} " in path.reason, path
    want_y, want_dq, want_dk, want_dv = reference_attention(q, k, v, dy, "bf16")
    want = (round_bf16(want_y), want_dq, want_dk, round_bf16(want_dv))
    for name, g, w, a in zip(("y", "dq", "dk", "dv"), got, want, again):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        check_close(name, g, w, 1e-2)
        check_bitwise(name + " (second run)", a, g)


@pytest.mark.parametrize("n_kv_head, rotary, batch", FAMILY)
def test_step_with_cudnn_attention(n_kv_head, rotary, batch):
    """Grouped heads and partial rotary through the whole bf16 step with
    cuDNN's attention (from batch 1 on; where cuDNN refuses the shape, the
    project's kernels with its reason)."""
    need_cudnn()
    with cudnn_from_batch(1):
        check_family_step(family_config(n_kv_head, rotary), "bf16", batch, None)


def test_activations_with_cudnn_attention():
    need_cudnn()
    with cudnn_from_batch(1):
        check_family_activations(family_config(2, Fraction(1, 2)), "bf16", 2, None)
