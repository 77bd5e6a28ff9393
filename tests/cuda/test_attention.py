"""The attention family (accelerated/cuda/attention.py, kernels/attention.cu):
the materialized softmax against the reference's layer functions, and the
step's materialized attention with grouped heads against the reference
model's (hypothesis-drawn shapes and values; on a GPU, or on
dev/cuda/emulated's stand-ins: conftest.py)."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.conformance.activations import activation_rows
from coppelius.conformance.cases import random_state
from coppelius.conformance.suite import step_rows
from coppelius.reference.config import Config, Hyper
from coppelius.reference.layers.attention import attention_forward
from coppelius.reference.model import _attention_backward, _attention_forward
from coppelius.reference.precision import round_bf16
from coppelius.reference.semantic import activation_names
from coppelius.reference.step import step_activations
from coppelius.accelerated.cuda.attention import attention_scale
from coppelius.accelerated.cuda.cupy_debug import NEVER, fused_from_batch, step_attention
from coppelius.accelerated.cuda.policy import attention_path
from coppelius.accelerated.cuda.program import capture

from .helpers import (PRECISIONS, small, kernels, dev, host, op_dtype, as_float, policy,
                      check_bitwise, check_close, check_sum_close, operand_tol, windows, cupy)

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


@small
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 70), st.sampled_from([2, 8, 64]),
       st.sampled_from(PRECISIONS), st.integers(0, 2**31 - 1))
def test_attention_softmax_forward_backward(Bn, H, T, E, precision, seed):
    check_attention_softmax(Bn, H, T, E, precision, seed)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_attention_softmax_rows_longer_than_the_registers(precision):
    check_attention_softmax(1, 1, 32 * 32 + 9, 4, precision, 18)


def check_attention_softmax(Bn, H, T, E, precision, seed):
    """The causal softmax over (B,H,T,T) scores and its backward. Under bf16
    only the causal part is written (the operand buffers keep the zeros
    above the diagonal that the program allocates them with); under fp32 the
    products read the float32 p itself, so its zeros are written."""
    rng = np.random.default_rng(seed)
    q, kk, v = (rng.standard_normal((3, Bn, H, T, E)) * 2).astype(np.float32)
    _, (_, _, _, p_want, scale) = attention_forward(q, kk, v, "fp32")  # p of the reference
    assert scale == attention_scale(E)
    s = dev(q @ np.swapaxes(kk, -1, -2))  # the unscaled product, as the kernel receives it
    causal = np.tril(np.ones((T, T), bool))
    bf16 = precision == "bf16"
    k = kernels(precision)
    p_op = cupy.zeros(s.shape, np.uint16) if bf16 else None
    k.attention_softmax_forward(s, p_op, scale)
    p = host(s)  # under bf16, the scores are left above the diagonal
    check_close("p", np.where(causal, p, 0), p_want, 1e-6)
    if bf16:
        check_close("p operand", as_float(p_op, "bf16"), round_bf16(np.where(causal, p, 0)), 0)
    else:
        assert (p[..., ~causal] == 0).all()

    dp = rng.standard_normal(p.shape).astype(np.float32)
    ds = cupy.zeros(p.shape, op_dtype(precision))
    p_op2 = cupy.zeros(p.shape, np.uint16) if bf16 else None
    k.attention_softmax_backward(dev(p), dev(dp), ds, p_op2, scale)
    p64, dp64 = np.where(causal, p, 0).astype(np.float64), dp.astype(np.float64)
    want = p64 * (dp64 - (dp64 * p64).sum(-1, keepdims=True)) * scale
    # ds cancels where one p is near 1 (a row of T = 2, say: both ds near 0):
    # float32's error is relative to its terms' magnitudes, not to ds
    terms = p64 * (np.abs(dp64) + (np.abs(dp64) * p64).sum(-1, keepdims=True)) * scale
    check_sum_close("ds", as_float(ds, precision), policy(want.astype(np.float32), precision),
                    terms, operand_tol(precision))
    if bf16:
        check_close("p operand (backward)", as_float(p_op2, "bf16"),
                    round_bf16(np.where(causal, p, 0)), 0)


# ------------------------------------------------------------ the step's materialized attention

def grouped_inputs(Bn, H, Hkv, T, E, precision, seed):
    """q, dy (B,H,T,E) and k, v (B,Hkv,T,E) as the policy's operands: scores
    of a few units (peaked rows)."""
    rng = np.random.default_rng(seed)
    q = 2 * rng.standard_normal((Bn, H, T, E))
    k = 2 * rng.standard_normal((Bn, Hkv, T, E))
    v = rng.standard_normal((Bn, Hkv, T, E))
    dy = rng.standard_normal((Bn, H, T, E))
    return [policy(x.astype(np.float32), precision) for x in (q, k, v, dy)]


def reference_attention(q, k, v, dy, precision):
    """The reference model's attention (reference/model.py: query head h
    with key/value head h // g, dk, dv summed over the g query heads) on
    (B,heads,T,E) inputs -> y, dq, dk, dv (B,heads,T,E)."""
    H = q.shape[1]
    rows = lambda x: x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)  # noqa: E731
    heads = lambda x, n: x.reshape(x.shape[0], x.shape[1], n, -1).transpose(0, 2, 1, 3)  # noqa
    y, cache = _attention_forward(rows(q), rows(k), rows(v), H, precision)
    dq, dk, dv = _attention_backward(rows(dy), cache, H, precision)
    Hkv = k.shape[1]
    return heads(y, H), heads(dq, H), heads(dk, Hkv), heads(dv, Hkv)


@small
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 1), (3, 3), (6, 2)]),
       st.sampled_from([1, 5, 33]), st.sampled_from([2, 8, 16]), st.sampled_from(PRECISIONS),
       st.integers(0, 2**31 - 1))
def test_materialized_attention_matches_the_reference_model(Bn, heads, T, E, precision, seed):
    """The step's materialized attention (the (B,H,T,T) scores and cuBLAS's
    batched products, per member of the groups), forward and backward,
    against the reference model's grouped-query attention."""
    H, Hkv = heads
    q, k, v, dy = grouped_inputs(Bn, H, Hkv, T, E, precision, seed)
    with fused_from_batch(NEVER):
        assert attention_path(Config(8, T, H * E, 1, H, 8, n_kv_head=Hkv), precision,
                              Bn).kind == "materialized"
        got = step_attention(precision, q, k, v, dy)
    want_y, want_dq, want_dk, want_dv = reference_attention(q, k, v, dy, precision)
    check_grouped("materialized", got, (want_y, want_dq, want_dk, want_dv), precision)


def check_grouped(what, got, want, precision, tol=None):
    """y and dv are operands: a rounding to a neighbouring bfloat16 apart at
    most; dq, dk come from the rounded ds, a roundoff apart now and then;
    a key/value head's dk, dv sum its query heads' in another order."""
    y, dq, dk, dv = got
    want_y, want_dq, want_dk, want_dv = want
    assert dk.shape == want_dk.shape and dv.shape == want_dv.shape, (dk.shape, want_dk.shape)
    check_close(f"{what} y", y, policy(want_y, precision), tol or operand_tol(precision))
    check_close(f"{what} dv", dv, policy(want_dv, precision), tol or operand_tol(precision))
    tol = tol or (1e-5 if precision == "fp32" else 1e-2)
    check_close(f"{what} dq", dq, want_dq, tol)
    check_close(f"{what} dk", dk, want_dk, tol)


# ------------------------------------------------------------ the whole step, grouped and partial

# (n_kv_head, rotary, batch) of H = 4 query heads: multi-query and grouped,
# whole and half rotary, each at B = 1; at B = 8 each Hkv and each rotary once
# (the suite's time)
FAMILY = [pytest.param(kv, rotary, batch, id=f"Hkv{kv}-rotary{float(rotary)}-B{batch}")
          for kv, rotary, batch in [(1, Fraction(1, 2), 1), (2, Fraction(1), 1),
                                    (1, Fraction(1), 1), (2, Fraction(1, 2), 1),
                                    (1, Fraction(1, 2), 8), (2, Fraction(1), 8)]]


def family_config(n_kv_head, rotary):
    """H = 4 heads of E = 16 (a head dim of the fused kernels, R = 8 at
    rotary 1/2: the rope kernels' 4-pair items), Hkv key/value heads, the
    rotated fraction; layernorm, tied, no q/k/v bias."""
    return Config(vocab=64, context=16, d_model=64, n_layer=2, n_head=4, d_ff=96, steps=8,
                  interval=4, n_kv_head=n_kv_head, rotary=rotary)


def check_family_step(config, precision, batch, kind):
    """The whole captured step of `config` on the attention path `kind`
    (kind None: cuDNN's, or the project's where cuDNN refuses the shape,
    with its reason) against reference.step within SPEC 14's tolerances,
    and two more captures' steps the same bits."""
    state = random_state(config, seed=21, t=9)
    tokens = windows(1, seed=22, config=config, batch=batch)[0]
    program = capture(config, Hyper(), precision, batch, state.copy())
    path = program.acts.path
    if kind is None:
        assert path.kind == "cudnn" or path.reason.startswith("cuDNN"), path
    else:
        assert path.kind == kind, path
    rows = step_rows(program, config, Hyper(), precision, state, tokens)
    failures = [r for r in rows if not r.passed]
    assert not failures, "\n".join(f"{r.check} {r.tensor}: {r.error:.3e} > {r.tolerance:.0e} "
                                   f"at {r.worst}: {r.got} vs {r.want}" for r in failures)
    # (step_rows evaluated after the step, which took G's storage: two more
    # captures' steps are compared)
    again, third = (capture(config, Hyper(), precision, batch, state.copy()) for _ in range(2))
    for p in (again, third):
        p.upload_input(tokens)
        p.replay_and_wait()
    check_bitwise("gradients", again.gradients(), third.gradients())
    check_bitwise("P", again.state().P, third.state().P)


@pytest.mark.parametrize("n_kv_head, rotary, batch", FAMILY)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_step_with_materialized_attention(n_kv_head, rotary, precision, batch):
    """Grouped heads and partial rotary through the whole step with the
    materialized scores (fp32's path; under bf16 with the fused kernels
    and cuDNN off)."""
    with fused_from_batch(NEVER):
        check_family_step(family_config(n_kv_head, rotary), precision, batch, "materialized")


def check_family_activations(config, precision, batch, kind):
    """Every intermediate the eager debugging step taps (program.activations:
    dq, dk and dv where each path leaves them, the rotated q and k) against
    the reference's, under one naming scheme."""
    state = random_state(config, seed=26, t=6)
    program = capture(config, Hyper(), precision, batch, state.copy())
    assert kind is None or program.acts.path.kind == kind, program.acts.path
    tokens = windows(1, seed=28, config=config, batch=batch)[0]
    got = program.activations(tokens)
    assert list(got) == [name for name, _ in activation_names(config)]
    want = step_activations(config, program.state().P, tokens, precision)
    rows = activation_rows(config, got, want, precision)
    bad = [r for r in rows if not r.passed]
    assert not bad, "\n".join(f"{r.tensor}: {r.error:.3e} > {r.tolerance:.0e}" for r in bad)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_activations_with_materialized_attention(precision):
    with fused_from_batch(NEVER):
        check_family_activations(family_config(2, Fraction(1, 2)), precision, 2, "materialized")
