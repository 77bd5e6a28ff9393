"""The fused attention family (accelerated/cuda/attention_fused.py,
kernels/attention_fused.cu), as the step runs it, against the reference
model's attention, grouped heads included (hypothesis-drawn shapes and
values; on a GPU, or on dev/cuda/emulated's stand-ins: conftest.py)."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.config import Config
from coppelius.accelerated.cuda.policy import attention_path
from coppelius.accelerated.cuda.cupy_debug import fused_from_batch, step_attention

from .helpers import PRECISIONS, small
from .test_attention import (FAMILY, check_family_activations, check_family_step,
                             check_grouped, family_config, grouped_inputs, reference_attention)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 2), st.sampled_from([(1, 1), (3, 3), (2, 1), (4, 2), (4, 1)]),
       st.sampled_from([1, 5, 63, 64, 65, 130, 200]), st.sampled_from([16, 32, 64]),
       st.sampled_from(PRECISIONS), st.integers(0, 2**31 - 1))
def test_attention_matches_reference_model(Bn, heads, T, E, precision, seed):
    """The step's attention, forward and backward, against the reference
    model's (query head h with key/value head h // g): under bf16 the
    project's fused kernels (query and key tiles of 64: T below, at and
    across tile edges; a key tile's block walks each of its g query heads),
    under fp32 the materialized scores."""
    H, Hkv = heads
    q, k, v, dy = grouped_inputs(Bn, H, Hkv, T, E, precision, seed)
    with fused_from_batch(1):
        path = attention_path(Config(8, T, H * E, 1, H, 8, n_kv_head=Hkv), precision, Bn)
        assert path.kind == ("fused" if precision == "bf16" else "materialized")
        got = step_attention(precision, q, k, v, dy)
    check_grouped(path.kind, got, reference_attention(q, k, v, dy, precision), precision)


@pytest.mark.parametrize("n_kv_head, rotary, batch", FAMILY)
def test_step_with_fused_attention(n_kv_head, rotary, batch):
    """Grouped heads and partial rotary through the whole bf16 step with the
    project's fused kernels (from batch 1 on, cuDNN off)."""
    with fused_from_batch(1):
        check_family_step(family_config(n_kv_head, rotary), "bf16", batch, "fused")


def test_activations_with_fused_attention():
    with fused_from_batch(1):
        check_family_activations(family_config(2, Fraction(1, 2)), "bf16", 2, "fused")
