"""cuDNN's attention (accelerated/cuda/cudnn_attention.py), as the step runs
it, against the reference's layer function."""

import numpy as np
import pytest

from coppelius.reference.config import Config
from coppelius.reference.layers.attention import attention_backward, attention_forward
from coppelius.reference.precision import round_bf16
from coppelius.accelerated.cuda import attention_fused
from coppelius.accelerated.cuda.policy import attention_path
from coppelius.accelerated.cuda.cupy_debug import cudnn_from_batch, step_attention

from .helpers import check_close, check_bitwise, need_cudnn

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
