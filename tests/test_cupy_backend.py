"""The CuPy backend on a CUDA device: each kernel against the reference's
layer function (forward and backward, hypothesis-drawn shapes and values),
the cuBLAS mapping against NumPy, AdamW and the bfloat16 rounding bitwise,
the whole step against reference.step (SPEC 14 tolerances), and the graph:
bit-reproducible replays, exact resume, capture without update, refusals,
the compilation report.

Every test needs a GPU (marker gpu): skipped elsewhere."""

import gc
import json
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coppelius.conformance.cases import random_state
from coppelius.conformance.suite import step_rows
from coppelius.conformance.tolerances import relative_error
from coppelius.reference.adamw import (AdamWConstants, adamw_update, bias_corrections,
                                       learning_rates, schedule_table)
from coppelius.reference.config import Config, Hyper, preset
from coppelius.reference.layers.attention import attention_backward, attention_forward
from coppelius.reference.layers.crossentropy import crossentropy_backward, crossentropy_forward
from coppelius.reference.layers.embedding import embedding_backward
from coppelius.reference.layers.layernorm import layernorm_backward, layernorm_forward
from coppelius.reference.layers.rope import rope_backward, rope_forward, rope_tables
from coppelius.reference.layers.swiglu import swiglu_backward, swiglu_forward
from coppelius.reference.params import initialize, registry
from coppelius.reference.precision import round_bf16
from coppelius.reference.program import STAGES, ProgramReset, ReferenceProgram, ReplayError
from coppelius.reference.semantic import semantic_graph
from coppelius.reference.state import State

cupy = pytest.importorskip("cupy")
from coppelius.accelerated import cublas, cuda_kernels, cudnn_attention, cupy_backend  # noqa: E402
from coppelius.accelerated.cupy_debug import (cudnn_from_batch, fused_from_batch,  # noqa: E402
                                              step_attention)

pytestmark = pytest.mark.gpu

CONFIG = preset("test")
B = 2
PRECISIONS = ["fp32", "bf16"]
small = settings(max_examples=12, deadline=None)


def kernels(precision="fp32"):
    return cupy_backend.kernels_for(precision)


def dev(x):
    return cupy.asarray(np.ascontiguousarray(x))


def host(x):
    cupy.cuda.Device().synchronize()
    return cupy.asnumpy(x)


def empty(shape, dtype=np.float32):
    # poisoned, so an element a kernel does not write fails the comparison
    kind = np.dtype(dtype)
    fill = 0xFFFF if kind == np.uint16 else -1 if kind.kind == "i" else np.nan
    return cupy.full(shape, fill, dtype=dtype)


def placed(x, aligned=True, dtype=None):
    """x on the device; aligned=False: one element past a 16-byte boundary,
    so the kernels take their element-by-element path whatever the shape."""
    x = np.ascontiguousarray(x, dtype=dtype)
    if aligned:
        return dev(x)
    buffer = dev(np.concatenate([np.zeros(1, x.dtype), x.reshape(-1)]))
    return buffer[1:].reshape(x.shape)


def empty_placed(shape, dtype=np.float32, aligned=True):
    """empty(), placed as placed() places."""
    if aligned:
        return empty(shape, dtype)
    return empty((int(np.prod(shape)) + 1,), dtype)[1:].reshape(shape)


def op_dtype(precision):
    return np.uint16 if precision == "bf16" else np.float32


def as_float(x, precision):
    """An operand buffer read back as float32 (bfloat16 bits widened)."""
    x = host(x)
    return (x.astype(np.uint32) << 16).view(np.float32) if precision == "bf16" else x


def policy(x, precision):
    """What the reference's value becomes as an operand under the policy."""
    return round_bf16(x) if precision == "bf16" else x


def check_close(what, got, want, tol):
    error, worst, a, b = relative_error(got, want)
    assert error <= tol, f"{what}: error {error:.3e} > {tol:.0e} at {worst}: {a!r} vs {b!r}"


def check_sum_close(what, got, want, magnitude, tol):
    """A sum's error within tol of the sum of its terms' magnitudes."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = np.linalg.norm(got - want) / max(np.linalg.norm(magnitude), 1e-30)
    assert error <= tol, f"{what}: error {error:.3e} > {tol:.0e} of the terms' magnitude"


def check_bitwise(what, got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), (f"{what}: {int(diff.sum())} elements differ, first at "
                            f"{np.argwhere(diff)[0]}: {got[diff][0]!r} vs {want[diff][0]!r}")


def operand_tol(precision):
    # fp32: float32 arithmetic in another order; bf16: the reference's float32
    # value and ours may round to neighbouring bfloat16 values now and then
    return 1e-5 if precision == "fp32" else 4e-3


def fresh(config=CONFIG):
    return State.fresh(initialize(config))


def windows(n, seed=0, config=CONFIG, batch=B):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab, size=(n, batch, config.context + 1))


# ------------------------------------------------------------------ precision

def test_round_bf16_matches_reference_bitwise():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-40, 38, 1 << 16)).astype(np.float32)
    # exact ties (a bfloat16 value plus half its last place), both parities
    ties = (rng.standard_normal(4096).astype(ml_dtypes.bfloat16).astype(np.float32)
            .view(np.uint32) | np.uint32(0x8000)).view(np.float32)
    special = np.float32([np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-45,
                          np.finfo(np.float32).max])
    x = np.concatenate([x, ties, special])
    out = empty(x.shape, np.uint16)
    kernels().round_bf16(dev(x), out)
    check_bitwise("round_bf16", as_float(out, "bf16"), round_bf16(x))
    nan = np.float32([np.nan, -np.nan])
    out = empty(nan.shape, np.uint16)
    kernels().round_bf16(dev(nan), out)
    assert np.isnan(as_float(out, "bf16")).all()


# ------------------------------------------------------------------ cuBLAS

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_gemm_row_major_against_numpy(precision, trans_a, trans_b):
    """C = op(A) @ op(B) in row-major terms, batched with strides and padded
    row strides, float32 accumulation over bfloat16 (or float32) operands."""
    rng = np.random.default_rng(1)
    batch, m, n, k, pad = 3, 37, 29, 53, 5
    shape_a = (k, m) if trans_a else (m, k)
    shape_b = (n, k) if trans_b else (k, n)
    a = rng.standard_normal((batch,) + shape_a).astype(np.float32)
    b = rng.standard_normal((batch,) + shape_b).astype(np.float32)
    # operands laid out with row strides wider than the rows
    A = np.full((batch, shape_a[0], shape_a[1] + pad), np.nan, np.float32)
    Bm = np.full((batch, shape_b[0], shape_b[1] + pad), np.nan, np.float32)
    A[:, :, :shape_a[1]], Bm[:, :, :shape_b[1]] = a, b
    kind = "bfloat16" if precision == "bf16" else "float32"
    to_op = (lambda x: dev(x.astype(ml_dtypes.bfloat16).view(np.uint16))) if precision == "bf16" \
        else dev
    dA, dB = to_op(A), to_op(Bm)
    ldc = n + 3
    for c_type in ("float32", kind):
        C = empty((batch, m, ldc), np.float32 if c_type == "float32" else np.uint16)
        cupy.cuda.Device().synchronize()  # the copies ran on the default stream
        stream = cupy.cuda.Stream(non_blocking=True)
        ws = cupy.empty(cublas.WORKSPACE_BYTES, np.uint8)
        blas = cublas.Cublas(stream.ptr, ws.data.ptr, cublas.WORKSPACE_BYTES)
        blas.gemm(trans_a, trans_b, m, n, k, dA.data.ptr, shape_a[1] + pad, dB.data.ptr,
                  shape_b[1] + pad, C.data.ptr, ldc, ab_type=kind, c_type=c_type, batch=batch,
                  stride_a=A[0].size, stride_b=Bm[0].size, stride_c=m * ldc)
        stream.synchronize()
        blas.close()
        got = as_float(C, "bf16" if c_type == "bfloat16" else "fp32")
        ra, rb = policy(a, precision).astype(np.float64), policy(b, precision).astype(np.float64)
        ra = np.swapaxes(ra, 1, 2) if trans_a else ra
        rb = np.swapaxes(rb, 1, 2) if trans_b else rb
        want = ra @ rb
        check_close(f"gemm {c_type}", got[:, :, :n], want, 1e-6 if c_type == "float32" else 4e-3)
        assert np.isnan(got[:, :, n:]).all(), "wrote outside the (m, n) block"


def test_fp32_products_are_not_tf32():
    """Operands whose low mantissa bits matter: TF32 (10 bits) would lose them."""
    m = n = k = 64
    a = np.full((m, k), 1 + 2.0 ** -20, np.float32)
    b = np.eye(k, n, dtype=np.float32)
    C, da, db = empty((m, n)), dev(a), dev(b)
    cupy.cuda.Device().synchronize()  # the copies ran on the default stream
    stream = cupy.cuda.Stream(non_blocking=True)
    ws = cupy.empty(cublas.WORKSPACE_BYTES, np.uint8)
    blas = cublas.Cublas(stream.ptr, ws.data.ptr, cublas.WORKSPACE_BYTES)
    blas.gemm(False, False, m, n, k, da.data.ptr, k, db.data.ptr, n, C.data.ptr, n,
              ab_type="float32", c_type="float32")
    stream.synchronize()
    blas.close()
    assert (host(C) == a).all()


# ------------------------------------------------------------------ layer kernels

# D: each register variant (128, 256, 512, 1024 features per row), rows of
# 4k and of other lengths (the element-by-element path)
dims = st.tuples(st.integers(1, 3), st.integers(1, 40),
                 st.sampled_from([1, 4, 6, 32, 40, 130, 256, 300, 512, 1000, 1024]),
                 st.integers(0, 2**31 - 1))


@small
@given(dims, st.sampled_from(PRECISIONS), st.booleans(), st.booleans())
def test_layernorm_forward(shape, precision, residual, aligned):
    Bn, T, D, seed = shape
    rng = np.random.default_rng(seed)
    rows = Bn * T
    x = (rng.standard_normal((rows, D)) * 3 + 1).astype(np.float32)
    add = rng.standard_normal((rows, D)).astype(np.float32)
    w, b = rng.standard_normal((2, D)).astype(np.float32)
    h, mean, rstd = empty((rows, D), op_dtype(precision)), empty((rows,)), empty((rows,))
    x_out = empty_placed((rows, D), aligned=aligned)
    kernels(precision).layernorm_forward(placed(x, aligned), dev(add) if residual else None,
                                         x_out if residual else None, h, mean, rstd, dev(w),
                                         dev(b), cupy_backend.EPS)
    xin = x + add if residual else x
    if residual:
        check_bitwise("residual", host(x_out), xin)
    out, (xhat, want_rstd, _) = layernorm_forward(xin, w, b, float(cupy_backend.EPS))
    check_close("h", as_float(h, precision), policy(out, precision), operand_tol(precision))
    check_close("rstd", host(rstd), want_rstd[:, 0], 1e-6)
    check_close("mean", host(mean), xin.mean(-1), 1e-6)


@small
@given(dims, st.sampled_from(PRECISIONS), st.booleans(), st.booleans())
def test_layernorm_backward_and_param_grads(shape, precision, residual, aligned):
    Bn, T, D, seed = shape
    rng = np.random.default_rng(seed)
    rows = Bn * T
    x = (rng.standard_normal((rows, D)) * 2 - 1).astype(np.float32)
    w, b = rng.standard_normal((2, D)).astype(np.float32)
    dout, dres = rng.standard_normal((2, rows, D)).astype(np.float32)
    _, cache = layernorm_forward(x, w, b, float(cupy_backend.EPS))
    want_dx, want_dw, want_db = layernorm_backward(dout, cache)
    if residual:
        want_dx = dres + want_dx
    k = kernels(precision)
    h, mean, rstd = empty((rows, D), op_dtype(precision)), empty((rows,)), empty((rows,))
    dx_x = dev(x)
    k.layernorm_forward(dx_x, None, None, h, mean, rstd, dev(w), dev(b), cupy_backend.EPS)
    # in place over dres, as the step does
    dx = placed(dres, aligned) if residual else empty_placed((rows, D), aligned=aligned)
    dx_op = empty((rows, D), np.uint16) if precision == "bf16" else None
    chunks = cuda_kernels.layernorm_chunks(rows)
    # two norms: this one, and a copy at another offset, each in a buffer of its own
    partials = [empty((chunks, 2 * D)), empty((chunks, 2 * D))]
    k.layernorm_backward(dev(dout), dx if residual else None, dx_x, mean, rstd, dev(w), dx, dx_op,
                         partials[0])
    partials[1][...] = partials[0]
    # G in two segments, a norm in each
    G = gradient(np.full(5 * D + 7, np.nan, np.float32), cuts=(3 * D + 5,))
    offsets = dev(np.array([D + 3, 3 * D + 7], np.int64))
    table = dev(np.array([p.data.ptr for p in partials], np.uint64))
    k.layernorm_param_grads(partials, table, offsets, G)
    check_close("dx", host(dx), want_dx, 1e-5)
    if dx_op is not None:
        check_close("dx operand", as_float(dx_op, "bf16"), round_bf16(host(dx)), 0)
    # the step keeps no h per layer: with the bias, the backward writes the forward's h again
    again = empty_placed((rows, D), op_dtype(precision), aligned)
    dx2 = placed(dres, aligned) if residual else empty_placed((rows, D), aligned=aligned)
    k.layernorm_backward(dev(dout), dx2 if residual else None, dx_x, mean, rstd, dev(w), dx2,
                         None, empty((chunks, 2 * D)), b=placed(b, aligned), h=again)
    check_bitwise("h (written again by the backward)", as_float(again, precision),
                  as_float(h, precision))
    check_bitwise("dx (with h)", host(dx2), host(dx))
    g = host_gradient(G)
    # dw and db are sums over the rows that can cancel: float32's error is
    # relative to the sum of the terms' magnitudes, not to the sum itself
    xhat = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + cupy_backend.EPS)
    for off in (D + 3, 3 * D + 7):
        check_sum_close("dw", g[off:off + D], want_dw, np.abs(dout * xhat).sum(0), 1e-5)
        check_sum_close("db", g[off + D:off + 2 * D], want_db, np.abs(dout).sum(0), 1e-5)
    assert np.isnan(g[:D + 3]).all() and np.isnan(g[3 * D + 3:3 * D + 7]).all()


@small
@given(st.integers(1, 3), st.integers(1, 20),
       st.sampled_from([(1, 2), (2, 4), (3, 6), (8, 64), (2, 8), (3, 16), (2, 24), (1, 12)]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_rope_forward_backward_bitwise(Bn, T, HE, aligned, seed):
    """Half-split pairs; the same float32 operations as the reference. Head
    dims of 8k take 4 pairs at a time (16-byte loads), others and misaligned
    rows one element at a time."""
    H, E = HE
    D = H * E
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((Bn * T, 3 * D)).astype(np.float32)
    Tmax = T + 3  # the table may be longer than the context (an eager prefix)
    cos, sin = rope_tables(Tmax, E)
    k = kernels("fp32")
    out = empty((Bn * T, 3 * D))
    k.rope_forward(placed(qkv, aligned), out, dev(cos), dev(sin), T, H)
    got = host(out).reshape(Bn, T, 3, H, E)
    x = qkv.reshape(Bn, T, 3, H, E)
    c, s = cos[:T], sin[:T]
    check_bitwise("q", got[:, :, 0], rope_forward(x[:, :, 0], c, s))
    check_bitwise("k", got[:, :, 1], rope_forward(x[:, :, 1], c, s))
    check_bitwise("v", got[:, :, 2], x[:, :, 2])

    dqk = rng.standard_normal((Bn * T, 2 * D)).astype(np.float32)
    dqkv = empty((Bn * T, 3 * D))
    k.rope_backward(placed(dqk, aligned), dqkv, dev(cos), dev(sin), T, H)
    got = host(dqkv).reshape(Bn, T, 3, H, E)
    d = dqk.reshape(Bn, T, 2, H, E)
    check_bitwise("dq", got[:, :, 0], rope_backward(d[:, :, 0], c, s))
    check_bitwise("dk", got[:, :, 1], rope_backward(d[:, :, 1], c, s))
    assert np.isnan(got[:, :, 2]).all(), "rope_backward wrote the v columns"


@small
@given(st.integers(1, 3), st.integers(1, 20),
       st.sampled_from([(1, 2), (2, 4), (3, 6), (8, 64), (2, 8), (3, 16), (1, 12)]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_rope_backward_of_operands_bitwise(Bn, T, HE, aligned, seed):
    """The rope backward after cuDNN's attention, which writes dq, dk as
    bfloat16: the reference's rope backward of the widened values, rounded
    (head dims of 8k 4 pairs at a time, others and misaligned rows one
    element at a time)."""
    H, E = HE
    D = H * E
    rng = np.random.default_rng(seed)
    dqk = round_bf16(rng.standard_normal((Bn * T, 2 * D)).astype(np.float32))
    cos, sin = rope_tables(T + 3, E)
    dqkv = empty((Bn * T, 3 * D), np.uint16)
    bits = (dqk.view(np.uint32) >> 16).astype(np.uint16)
    kernels("bf16").rope_backward_operand(placed(bits, aligned), dqkv, dev(cos), dev(sin), T, H)
    got = as_float(dqkv, "bf16").reshape(Bn, T, 3, H, E)
    d = dqk.reshape(Bn, T, 2, H, E)
    c, s = cos[:T], sin[:T]
    check_bitwise("dq", got[:, :, 0], round_bf16(rope_backward(d[:, :, 0], c, s)))
    check_bitwise("dk", got[:, :, 1], round_bf16(rope_backward(d[:, :, 1], c, s)))
    assert np.isnan(got[:, :, 2]).all(), "rope_backward_operand wrote the v columns"


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
    assert scale == cuda_kernels.attention_scale(E)
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


@small
@given(st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 5, 63, 64, 65, 130, 200]),
       st.sampled_from([16, 32, 64]), st.sampled_from(PRECISIONS), st.integers(0, 2**31 - 1))
def test_attention_matches_reference_layer(Bn, H, T, E, precision, seed):
    """The step's attention, forward and backward, against
    reference.layers.attention: under bf16 the project's fused kernels
    (query and key tiles of 64: T below, at and across tile edges), under
    fp32 the materialized scores."""
    rng = np.random.default_rng(seed)
    q, k = 2 * rng.standard_normal((2, Bn, H, T, E))  # scores of a few units: peaked rows
    v, dy = rng.standard_normal((2, Bn, H, T, E))
    q, k, v, dy = (policy(x.astype(np.float32), precision) for x in (q, k, v, dy))
    with fused_from_batch(1):
        path = cupy_backend.attention_path(Config(8, T, H * E, 1, H, 8), precision, Bn)
        assert path.kind == ("fused" if precision == "bf16" else "materialized")
        y, dq, dk, dv = step_attention(precision, q, k, v, dy)
    want_y, cache = attention_forward(q, k, v, precision)
    want_dq, want_dk, want_dv = attention_backward(dy, cache, precision)
    # y and dv are operands: one rounding to a neighbouring bfloat16 apart at
    # most; dq, dk come from the rounded ds, a roundoff apart now and then
    check_close("y", y, policy(want_y, precision), operand_tol(precision))
    check_close("dv", dv, policy(want_dv, precision), operand_tol(precision))
    tol = 1e-5 if precision == "fp32" else 1e-2
    check_close("dq", dq, want_dq, tol)
    check_close("dk", dk, want_dk, tol)


def need_cudnn():
    if cudnn_attention.frontend() is None:
        pytest.skip("cuDNN's attention: " + cudnn_attention.import_error())


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
        path = cupy_backend.attention_path(Config(8, T, H * E, 1, H, 8), "bf16", Bn)
        got = step_attention("bf16", q, k, v, dy)
        again = step_attention("bf16", q, k, v, dy)
    if path.kind != "cudnn":  # (T = 1: cuDNN 9.19 refuses it) the project's own, and why
        assert path.reason.startswith("cuDNN refuses"), path
        fused = E in cuda_kernels.ATTENTION_HEAD_DIMS and \
            Bn >= cuda_kernels.ATTENTION_FUSED_MIN_BATCH
        assert path.kind == ("fused" if fused else "materialized")
    want_y, cache = attention_forward(q, k, v, "bf16")
    want = (round_bf16(want_y), *attention_backward(dy, cache, "bf16"))
    for name, g, w, a in zip(("y", "dq", "dk", "dv"), got, want, again):
        check_close(name, g, w, 1e-2)
        check_bitwise(name + " (second run)", a, g)


@small
@given(st.integers(1, 50), st.integers(1, 70), st.sampled_from(PRECISIONS), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_swiglu_forward_backward(BT, F, precision, aligned, seed):
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((BT, 2 * F)) * 4).astype(np.float32)
    da = rng.standard_normal((BT, F)).astype(np.float32)
    g, u = gu[:, :F], gu[:, F:]
    want_a, cache = swiglu_forward(g, u)
    want_dg, want_du = swiglu_backward(da, cache)
    k = kernels(precision)
    a = empty((BT, F), op_dtype(precision))
    k.swiglu_forward(placed(gu, aligned), a)
    check_close("a", as_float(a, precision), policy(want_a, precision), operand_tol(precision))
    dgu = empty((BT, 2 * F), op_dtype(precision))
    k.swiglu_backward(placed(da, aligned), dev(gu), dgu)
    got = as_float(dgu, precision)
    check_close("dg", got[:, :F], policy(want_dg, precision), operand_tol(precision))
    check_close("du", got[:, F:], policy(want_du, precision), operand_tol(precision))
    # the step keeps no a per layer: the backward writes the forward's a again
    again, dgu2 = empty_placed((BT, F), op_dtype(precision), aligned), empty(dgu.shape, dgu.dtype)
    k.swiglu_backward(placed(da, aligned), placed(gu, aligned), dgu2, again)
    check_bitwise("a (written again by the backward)", as_float(again, precision),
                  as_float(a, precision))
    check_bitwise("dgu (with a)", as_float(dgu2, precision), got)


@small
@given(st.integers(1, 3), st.integers(1, 20), st.sampled_from([2, 7, 64, 1000, 12288, 16389,
                                                             20000]),
       st.sampled_from(PRECISIONS), st.booleans(), st.integers(0, 2**31 - 1))
def test_crossentropy_forward_backward(Bn, T, V, precision, aligned, seed):
    """Rows held in registers (up to 16384 logits) and longer ones, read
    16 bytes at a time (V of 4k) or one logit at a time."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((Bn, T, V)) * 5).astype(np.float32)
    ids = rng.integers(0, V, (Bn, T + 1))
    want_ce, cache = crossentropy_forward(logits, ids[:, 1:])
    n = Bn * T
    dce = np.float32(1.0 / n)
    want_dl = crossentropy_backward(np.full((Bn, T), dce, np.float32), cache)
    k = kernels(precision)
    ce, dl, loss = empty((n,)), empty((n, V), op_dtype(precision)), empty((1,))
    k.crossentropy_forward_backward(placed(logits.reshape(n, V), aligned),
                                    dev(ids.astype(np.int32)), T + 1, T, ce, dl, dce)
    k.mean_loss(ce, loss)
    check_close("ce", host(ce).reshape(Bn, T), want_ce, 1e-6)
    check_close("loss", host(loss)[0], want_ce.mean(dtype=np.float32), 1e-6)
    check_close("dlogits", as_float(dl, precision).reshape(Bn, T, V), policy(want_dl, precision),
                operand_tol(precision))


@small
@given(st.integers(1, 3), st.integers(1, 20), st.sampled_from([7, 64, 1000]), st.integers(1, 9),
       st.sampled_from(PRECISIONS), st.integers(0, 2**31 - 1))
def test_crossentropy_by_row_chunks(Bn, T, V, rows, precision, seed):
    """The step's loss runs the kernel on chunks of rows (Model.classifier_loss): each
    chunk's rows r0.. of the batch, their targets found from row0, give
    the bits of one launch over every row."""
    rng = np.random.default_rng(seed)
    n = Bn * T
    logits = (rng.standard_normal((n, V)) * 5).astype(np.float32)
    ids = dev(rng.integers(0, V, (Bn, T + 1)).astype(np.int32))
    dce = np.float32(1.0 / n)
    k = kernels(precision)
    ce, dl = empty((n,)), empty((n, V), op_dtype(precision))
    k.crossentropy_forward_backward(dev(logits), ids, T + 1, T, ce, dl, dce)
    ce2, dl2 = empty((n,)), empty((n, V), op_dtype(precision))
    chunk = empty((rows, V))
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        chunk[:m].set(logits[r0:r0 + m])
        k.crossentropy_forward_backward(chunk[:m], ids, T + 1, T, ce2[r0:r0 + m],
                                        dl2[r0:r0 + m], dce, row0=r0)
    check_bitwise("ce", host(ce2), host(ce))
    check_bitwise("dlogits", as_float(dl2, precision), as_float(dl, precision))


@small
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 50),
       st.sampled_from([1, 5, 32, 70, 512, 1000, 1024]), st.booleans(), st.integers(0, 2**31 - 1))
def test_embedding_forward_backward(Bn, T, V, D, aligned, seed):
    """The gather, and the gather gradient added to the unembedding gradient
    in position order: bitwise the reference's d_head + np.add.at."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((V, D)).astype(np.float32)
    ids = rng.integers(0, min(V, 4), (Bn, T + 1))  # few ids: many repeats
    k = kernels()
    x = empty_placed((Bn * T, D), aligned=aligned)
    k.embedding_forward(dev(ids.astype(np.int32)), T + 1, T, dev(W), x)
    check_bitwise("gather", host(x), W[ids[:, :T].reshape(-1)])
    dx = rng.standard_normal((Bn * T, D)).astype(np.float32)
    d_head = rng.standard_normal((V, D)).astype(np.float32)
    dW = dev(d_head)
    index = empty((V, 2), np.int32)
    k.embedding_backward(placed(dx, aligned), dev(ids.astype(np.int32)), T + 1, T, dW, index)
    check_bitwise("dW", host(dW), d_head + embedding_backward(dx.reshape(Bn, T, D), ids[:, :T], V))


@pytest.mark.parametrize("Bn, T, V, D, ids", [(3, 900, 37, 24, "uniform"), (2, 700, 300, 64, "one"),
                                              (1, 1000, 5000, 8, "distinct")])
def test_embedding_backward_many_positions(Bn, T, V, D, ids):
    """More positions than one pass of a block, with ids repeated throughout,
    one id everywhere (its block walks every position), or all distinct."""
    rng = np.random.default_rng(5)
    ids = {"uniform": lambda: rng.integers(0, V, (Bn, T + 1)),
           "one": lambda: np.full((Bn, T + 1), 7),
           "distinct": lambda: rng.permutation(V)[:Bn * (T + 1)].reshape(Bn, T + 1)}[ids]()
    dx = rng.standard_normal((Bn * T, D)).astype(np.float32)
    d_head = rng.standard_normal((V, D)).astype(np.float32)
    dW = dev(d_head)
    index = empty((V, 2), np.int32)
    kernels().embedding_backward(dev(dx), dev(ids.astype(np.int32)), T + 1, T, dW, index)
    check_bitwise("dW", host(dW), d_head + embedding_backward(dx.reshape(Bn, T, D), ids[:, :T], V))


# ------------------------------------------------------------------ AdamW

def test_bias_corrections_bitwise_for_t_up_to_10000():
    hyper = Hyper()
    ts = np.arange(1, 10001, dtype=np.int32)
    c1, c2 = empty((ts.size,)), empty((ts.size,))
    k = kernels()
    k.adamw_bias_corrections_table(dev(ts), c1, c2, float(hyper.beta1), float(hyper.beta2))
    want = np.array([bias_corrections(hyper, int(t)) for t in ts], dtype=np.float32)
    check_bitwise("c1", host(c1), want[:, 0])
    check_bitwise("c2", host(c2), want[:, 1])
    # the in-graph kernel: advances t on the device, then its c1, c2 and the
    # schedule's a_t, b_t from the host table (row min(t, R - 1))
    cosine = Hyper(schedule="cosine", warmup=3, total=50, floor="1/10")
    for h in (hyper, cosine):
        rates = dev(schedule_table(h))
        for t0 in (0, 1, 2, 41, 49, 50, 9999):
            t, c = dev(np.array([t0], np.int32)), empty((4,))
            k.adamw_bias_corrections(t, c, float(h.beta1), float(h.beta2), rates)
            assert int(host(t)[0]) == t0 + 1
            want = [*bias_corrections(h, t0 + 1), *learning_rates(h, t0 + 1)]
            check_bitwise(f"c at t={t0 + 1}", host(c), np.array(want, np.float32))


def cuts_of(n, kind):
    """Where G is cut into segments: none (flat); at multiples of 4 (the
    16-byte path, bitwise the flat pass); one element past them (one element
    at a time)."""
    if kind == "flat" or n < 16:
        return ()
    cuts = sorted({4 * (n // 12), 4 * (n // 8), 4 * (n // 5)})
    return tuple(c + 1 for c in cuts) if kind == "odd" else tuple(cuts)


@pytest.mark.parametrize("n", [1, 1000, 100_003, 3_000_001])
def test_gradient_norm_and_clip_scale(n):
    """||G|| against the float64 norm (float32 partial sums: a relative error
    of a few 1e-7), bit-reproducible, and the clip scale c / n; G flat or in
    segments (the 16-byte pass over segments cut at multiples of 4 gives the
    flat pass's bits)."""
    G = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    want = float(np.sqrt(np.sum(G.astype(np.float64) ** 2)))
    k = kernels()
    partial, norm = empty((cuda_kernels.NORM_BLOCKS,)), empty((2,))
    norms = {}
    for kind in ("flat", "segments", "odd"):
        runs = []
        for clip in (0.0, want / 3, want * 2):
            k.gradient_norm(gradient(G, cuts_of(n, kind)), partial, norm, clip)
            got = host(norm)
            runs.append(got[0])
            assert abs(got[0] - want) <= 1e-6 * want, (kind, got[0], want)
            scale = np.float32(np.float32(clip) / got[0]) if 0 < clip < got[0] else np.float32(1)
            check_bitwise(f"scale at clip {clip}", got[1:], np.array([scale]))
        check_bitwise(f"norm, three runs ({kind})", np.array(runs[1:]), np.array(runs[:2]))
        norms[kind] = runs[0]
    check_bitwise("norm over segments", np.array([norms["segments"]]), np.array([norms["flat"]]))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n, aligned, cuts", [(100_003, True, "segments"), (100_003, True, "odd"),
                                              (1_001, False, "flat"), (3, True, "flat")])
def test_adamw_update_bitwise(precision, n, aligned, cuts):
    """The same float32 operations as reference.adamw.adamw_update: 16-byte
    chunks then the n % 4 elements left, or (misaligned, or G's segments
    cut off the chunks) one at a time; G flat or in segments."""
    rng = np.random.default_rng(7)
    t = 17
    hyper = Hyper(lr="1/1000", weight_decay="3/10")
    P = rng.standard_normal(n).astype(np.float32)
    M = (1e-3 * rng.standard_normal(n)).astype(np.float32)
    V = (1e-5 * rng.random(n)).astype(np.float32)
    G = (1e-2 * rng.standard_normal(n)).astype(np.float32)
    # runs of 1 to 9 elements, decayed or not: boundaries inside 16-byte chunks
    decay = np.repeat(rng.random(n) < 0.5, rng.integers(1, 10, n))[:n]
    want = adamw_update(P, M, V, G, decay, hyper, t)
    dP, dM, dV = placed(P, aligned), dev(M), dev(V)
    Pb = empty((n,), np.uint16) if precision == "bf16" else None
    c = dev(np.array([*bias_corrections(hyper, t), *learning_rates(hyper, t)], np.float32))
    unclipped = dev(np.array([0.0, 1.0], np.float32))  # (norm, scale): scale 1 leaves G's bits
    kernels(precision).adamw_update(dP, dM, dV, gradient(G, cuts_of(n, cuts), aligned),
                                    dev(runs_of(decay)), Pb, c, unclipped,
                                    AdamWConstants.of(hyper))
    for name, got, w in zip("PMV", (dP, dM, dV), want):
        check_bitwise(name, host(got), w)
    if Pb is not None:
        check_bitwise("Pb", as_float(Pb, "bf16"), round_bf16(want[0]))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n, aligned", [(3_000_001, True), (100_003, False), (3, True)])
def test_adamw_update_sums_the_norm_when_clipping_is_off(precision, n, aligned):
    """With `partial` (clipping off) AdamW's pass also sums G's squares:
    P, M, V and Pb bitwise those of the kernel given scale 1, and the norm
    finished from the partials within float32 summation of the float64
    norm, the same bits run after run; the norm buffer is not read (NaN).
    G in segments."""
    rng = np.random.default_rng(n)
    hyper = Hyper(lr="1/1000", weight_decay="3/10")
    P = rng.standard_normal(n).astype(np.float32)
    M = (1e-3 * rng.standard_normal(n)).astype(np.float32)
    V = (1e-5 * rng.random(n)).astype(np.float32)
    G = (1e-2 * rng.standard_normal(n)).astype(np.float32)
    decay = dev(runs_of(rng.random(n) < 0.5))
    c = dev(np.array([*bias_corrections(hyper, 3), *learning_rates(hyper, 3)], np.float32))
    k, consts = kernels(precision), AdamWConstants.of(hyper)
    want = []
    for fused in (False, True, True):
        dP, dM, dV = placed(P, aligned), dev(M), dev(V)
        Pb = empty((n,), np.uint16) if precision == "bf16" else None
        norm = dev(np.array([0.0, 1.0 if not fused else np.nan], np.float32))
        partial = empty((cuda_kernels.adamw_blocks(n),)) if fused else None
        G_dev = gradient(G, cuts_of(n, "segments" if aligned else "odd"))
        blocks = k.adamw_update(dP, dM, dV, G_dev, decay, Pb, c, norm, consts, partial=partial)
        got = [host(dP), host(dM), host(dV)] + ([as_float(Pb, "bf16")] if Pb is not None else [])
        if not fused:
            want = got
            continue
        for name, a, b in zip(["P", "M", "V", "Pb"], got, want):
            check_bitwise(name, a, b)
        k.gradient_norm_finish(partial, blocks, norm)
        n64 = float(np.sqrt(np.sum(G.astype(np.float64) ** 2)))
        got_norm = host(norm)
        assert abs(got_norm[0] - n64) <= 2e-6 * n64 and got_norm[1] == 1.0, (got_norm, n64)
        want.append(got_norm)
    check_bitwise("norm, twice", want[-1], want[-2])


def gradient(G, cuts=(), aligned=True):
    """G (N,) float32 on the device as the step's Gradient: segments cut at
    `cuts`, each a buffer of its own (aligned=False: one element past a
    16-byte boundary)."""
    bounds = [0, *cuts, G.size]
    parts = [placed(G[a:b], aligned) for a, b in zip(bounds, bounds[1:])]
    return cupy_backend.Gradient(bounds[:-1], parts, lambda shape, dtype: cupy.empty(shape, dtype))


def host_gradient(G):
    return np.concatenate([host(part) for part in G.parts])


def runs_of(mask):
    """(R, 2) int64 [start, end) of the runs of True in mask, as the kernel takes them."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return edges.reshape(-1, 2).astype(np.int64)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("decayed", ["none", "all", "registry"])
def test_adamw_update_decay_runs(precision, decayed):
    """No run, one run over everything, and the registry's own runs of the
    test preset (the step's), against the reference's update with the mask;
    G in the step's segments."""
    reg = registry(CONFIG)
    n = reg.total
    mask = {"none": np.zeros(n, bool), "all": np.ones(n, bool),
            "registry": reg.decay_mask()}[decayed]
    ranges = reg.decay_ranges() if decayed == "registry" else runs_of(mask)
    rng = np.random.default_rng(8)
    hyper = Hyper(lr="1/100", weight_decay="1/2")
    P, G = rng.standard_normal((2, n)).astype(np.float32)
    M, V = np.zeros(n, np.float32), np.zeros(n, np.float32)
    want = adamw_update(P, M, V, G, mask, hyper, 1)
    dP, dM, dV = dev(P), dev(M), dev(V)
    c = dev(np.array([*bias_corrections(hyper, 1), *learning_rates(hyper, 1)], np.float32))
    cuts = [start for start, _ in cupy_backend.gradient_segments(CONFIG)][1:]
    kernels(precision).adamw_update(dP, dM, dV, gradient(G, cuts), dev(ranges.reshape(-1, 2)),
                                    empty((n,), np.uint16) if precision == "bf16" else None, c,
                                    dev(np.array([0.0, 1.0], np.float32)),
                                    AdamWConstants.of(hyper))
    for name, got, w in zip("PMV", (dP, dM, dV), want):
        check_bitwise(name, host(got), w)


@pytest.mark.parametrize("n, aligned", [(100_003, True), (1_001, False), (2, True)])
def test_accumulate_gradient_bitwise(n, aligned):
    """G += Gm: one float32 add per element (SPEC 19)."""
    rng = np.random.default_rng(n)
    G, Gm = rng.standard_normal((2, n)).astype(np.float32)
    dG = placed(G, aligned)
    kernels().accumulate_gradient(dG, dev(Gm))
    check_bitwise("G", host(dG), G + Gm)


@pytest.mark.parametrize("n, aligned", [(1 << 16, True), (4099, True), (4099, False)])
def test_round_bf16_paths(n, aligned):
    """16-byte chunks, the elements left, and misaligned vectors."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 1e3
    out = empty_placed((n,), np.uint16, aligned)
    kernels().round_bf16(placed(x, aligned), out)
    check_bitwise("round_bf16", as_float(out, "bf16"), round_bf16(x))


# ------------------------------------------------------------------ the whole step

@pytest.mark.parametrize("fault, reason", [
    ("raise", "cuDNN fails to execute the attention of B=3 T=48 H=2 E=32 (RuntimeError: refused)"),
    ("skip backward", "cuDNN's attention of B=3 T=48 H=2 E=32 leaves dqk elements unwritten or "
                      "not finite")])
def test_a_shape_is_served_only_after_its_trial(fault, reason, monkeypatch):
    """Before serving a shape, its graphs run twice on NaN-poisoned outputs:
    an execution that fails, or one that leaves outputs unwritten, makes
    the shape fall back to the project's kernels with that reason."""
    need_cudnn()
    monkeypatch.setattr(cudnn_attention, "_trials", {})  # this shape's trial runs again
    execute = cudnn_attention.Graph.execute

    def faulty(self, pointers, workspace):
        if fault == "raise":
            raise RuntimeError("refused")
        if self.direction == "forward":
            execute(self, pointers, workspace)

    monkeypatch.setattr(cudnn_attention.Graph, "execute", faulty)
    scale = cuda_kernels.attention_scale(32)
    assert cudnn_attention.unavailable(3, 48, 2, 32, scale, True) == reason
    if fault == "skip backward":  # a forward-only step runs no backward: served
        assert cudnn_attention.unavailable(3, 48, 2, 32, scale, False) == ""
    monkeypatch.setattr(cudnn_attention.Graph, "execute", execute)
    monkeypatch.setattr(cudnn_attention, "_trials", {})
    assert cudnn_attention.unavailable(3, 48, 2, 32, scale, True) == ""


def test_one_step_with_fused_attention():
    """The whole bf16 step at the batch from which attention is the
    project's fused kernels (cuDNN off): against reference.step, and
    bit-reproducible across two captures."""
    batch = cuda_kernels.ATTENTION_FUSED_MIN_BATCH
    with fused_from_batch(batch):
        check_one_step(batch, "fused", "attention_forward_e16")


def test_one_step_with_cudnn_attention(monkeypatch):
    """The whole bf16 step with cuDNN's attention: against reference.step,
    bit-reproducible across two captures, and the captured graph gives the
    eager step's bits (gradients and row losses)."""
    need_cudnn()
    with cudnn_from_batch(1):
        program, tokens, state = check_one_step(B, "cudnn", None)
        monkeypatch.setenv("COPPELIUS_NO_CAPTURE", "1")
        eager = cupy_backend.capture(CONFIG, Hyper(), "bf16", B, state.copy())
    assert eager.graph is None and eager.acts.path.kind == "cudnn"
    eager.upload_input(tokens)
    eager.replay_and_wait()
    check_bitwise("gradients (eager)", eager.gradients(), program.gradients())
    check_bitwise("row losses (eager)", eager.row_losses(), program.row_losses())
    report = program.compilation_report()
    assert report["library_calls"] == 2 * CONFIG.n_layer and report["attention"] == "cudnn"


def check_one_step(batch, path, kernel):
    state = random_state(CONFIG, seed=21, t=9)
    tokens = windows(1, seed=22, batch=batch)[0]
    program = cupy_backend.capture(CONFIG, Hyper(), "bf16", batch, state.copy())
    assert program.acts.path.kind == path, program.acts.path
    if kernel:
        assert kernel in program.compilation_report()["kernel_names"]
    rows = step_rows(program, CONFIG, Hyper(), "bf16", state, tokens)
    failures = [r for r in rows if not r.passed]
    assert not failures, "\n".join(f"{r.check} {r.tensor}: {r.error:.3e} > {r.tolerance:.0e} "
                                   f"at {r.worst}: {r.got} vs {r.want}" for r in failures)
    # (step_rows evaluated after the step, which took G's storage: two more
    # captures' gradients are compared, and the first one's update P, M, V)
    again, third = (cupy_backend.capture(CONFIG, Hyper(), "bf16", batch, state.copy())
                    for _ in range(2))
    for p in (again, third):
        p.upload_input(tokens)
        p.replay_and_wait()
    check_bitwise("gradients", again.gradients(), third.gradients())
    one, two = again.state(), program.state()
    for name in "PMV":
        check_bitwise(name, getattr(one, name), getattr(two, name))
    return again, tokens, state


def test_report_names_why_cudnn_is_not_used(monkeypatch):
    """The one reason cuDNN's attention is not used, in the report's kernel
    selection, the attention partition and the diagnostics."""
    monkeypatch.setenv("COPPELIUS_NO_CUDNN", "1")
    monkeypatch.setattr(cuda_kernels, "ATTENTION_FUSED_MIN_BATCH", 2)
    with cudnn_from_batch(1):
        program = cupy_backend.capture(CONFIG, Hyper(), "bf16", 2, fresh())
    reason = "disabled by COPPELIUS_NO_CUDNN"
    assert program.acts.path == cupy_backend.AttentionPath("fused", reason)
    report = program.diagnostics()
    assert report["notes"]["kernel_selection"].endswith("cuDNN attention not used: " + reason)
    assert report["attention_reason"] == reason and report["runtime"]["cudnn"]["reason"] == reason
    plan = json.loads(program.compilation_debug_report_json("x"))["dnn_plan"]
    attention = [p for p in plan["partitions"] if p["kind"] == "attention"]
    assert attention and all(p["reason"].endswith(reason) for p in attention), attention


# ------------------------------------------------------------------ the graph

def test_no_capture_switch_records_no_graph(monkeypatch):
    """(That the eager step gives the captured one's bits is in
    test_program_contract.py.)"""
    monkeypatch.setenv("COPPELIUS_NO_CAPTURE", "1")
    program = cupy_backend.capture(CONFIG, Hyper(), "bf16", B, fresh())
    assert program.graph is None and not program.compilation_report()["captured"]


def test_replay_returns_at_once_with_an_event_and_times_the_device():
    program = cupy_backend.capture(CONFIG, Hyper(), "bf16", B, fresh())
    program.upload_input(windows(1)[0])
    event = program.replay()
    assert isinstance(event.event, cupy.cuda.Event)
    event.wait()
    loss, seconds = program.replay_timed_and_wait()
    assert math.isfinite(loss) and 0 < seconds < 10
    assert program.state().t == 2


def test_a_replaced_state_is_refused():
    """(The refusals every backend shares are in test_program_contract.py.)"""
    program = cupy_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    program.upload_input(windows(1)[0])
    program.replay_and_wait()
    program.device_state = cupy_backend.DeviceState(program.P, program.M, program.V, program.t)
    with pytest.raises(ReplayError, match="replaced"):
        program.replay()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_compilation_report(precision):
    program = cupy_backend.capture(CONFIG, Hyper(), precision, B, fresh())
    program.upload_input(windows(1)[0])
    program.replay_and_wait()
    report = program.diagnostics()
    assert report["schema"] == "coppelius.training_compilation.v1"
    assert [s["stage"] for s in report["stages"]] == list(STAGES)
    assert report["captured"] and report["replays"] == 1
    # per chunk of the logits' rows the logits product and its two gradients,
    # 4 linear products per layer and their 8 gradients, and unless attention
    # is fused, per layer and batch element 2 attention products and their 4
    # gradients
    L = CONFIG.n_layer
    path = cupy_backend.attention_path(CONFIG, precision, B)
    assert program.acts.path == path
    fused = path.kind != "materialized"
    rows = B * CONFIG.context
    chunks = -(-rows // cupy_backend.logits_chunk_rows(rows, CONFIG.vocab))
    assert report["products"] == 3 * chunks + 12 * L + (0 if fused else 6 * L * B)
    assert report["library_calls"] == (2 * L if path.kind == "cudnn" else 0)
    E = CONFIG.head_dim
    attention = {"fused": {f"attention_{part}_e{E}" for part in ("forward", "backward_dq",
                                                                  "backward_dkdv")},
                 "materialized": {"attention_softmax_forward", "attention_softmax_backward"},
                 "cudnn": set()}[path.kind]
    rope = "rope_backward_operand" if program.acts.dqk.dtype == np.uint16 else "rope_backward"
    nc = cuda_kernels.layernorm_variant(CONFIG.d_model)
    layernorm = {f"layernorm_{part}_c{nc}" for part in ("forward", "backward")}
    others = {name for name in cuda_kernels.KERNELS if not name.startswith(
        ("attention_", "rope_backward", "layernorm_forward_", "layernorm_backward_"))}
    # k = 1, and clipping off: AdamW's pass sums the norm, no pass of its own
    assert set(report["kernel_names"]) == (others | attention | layernorm | {rope}) - {
        "round_bf16", "adamw_bias_corrections_table", "accumulate_gradient",
        "gradient_sum_squares"}
    assert report["kernels"] == len(report["kernel_names"])
    assert report["graph_nodes"] >= report["kernel_launches"] + report["products"]
    assert report["device_bytes"] >= 4 * 4 * registry(CONFIG).total
    assert report["runtime"]["update_count"] == 1


def test_available_and_backend_module():
    from coppelius import accelerated

    assert cupy_backend.available()
    assert accelerated.backend_module("cupy") is cupy_backend
    assert accelerated.best_backend() == "cupy"


def test_binding_through_the_cupy_backend(tmp_path):
    """The binding layer realizes a checkpoint on the GPU: the file's values,
    the tied head as the very same array, a fused qkv recipe as the
    concatenation, and a bfloat16 cast rounded to nearest even."""
    from coppelius.reference.binding import Cast, Concat, RecipeBind, Tensor, bind, default_bindings
    from coppelius.reference.checkpoint import identities, write_checkpoint
    from coppelius.reference.sources import CheckpointFileSource

    config = preset("test")
    reg = registry(config)
    P = initialize(config)
    path = tmp_path / "ck.bin"
    write_checkpoint(path, config, identities(config, Hyper(), "fp32", 1, None, "0" * 64),
                     State.fresh(P), 0)
    backend = cupy_backend.CupyBindingBackend()
    D = config.d_model
    with CheckpointFileSource(path) as source:
        values = bind(reg, default_bindings(config), source, backend,
                      offered=[s.name for s in reg.specs])
        for spec in reg.specs:
            got = cupy.asnumpy(values[spec.name])
            assert got.dtype == np.float32 and np.array_equal(
                got, P[spec.slice].reshape(spec.shape)), spec.name
        assert values["lm_head.weight"] is values["tok_embedding.weight"]
        qkv = [Tensor(f"layers.0.attn.{x}.weight") for x in "qkv"]
        fused = bind({"qkv": ("float32", (3 * D, D))}, [RecipeBind("qkv", Concat(qkv, 0))],
                     source, backend, offered=[t.key for t in qkv])["qkv"]
        q16 = bind({"q16": ("bfloat16", (D, D))},
                   [RecipeBind("q16", Cast(Tensor("layers.0.attn.q.weight"), "bfloat16"))],
                   source, backend, offered=["layers.0.attn.q.weight"])["q16"]
    want = np.concatenate([P[reg[f"layers.0.attn.{x}.weight"].slice].reshape(D, D) for x in "qkv"])
    assert np.array_equal(cupy.asnumpy(fused), want)
    q = P[reg["layers.0.attn.q.weight"].slice].reshape(D, D)
    assert np.array_equal(cupy.asnumpy(q16), q.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_a_cupy_failure_while_binding_names_the_parameter(tmp_path):
    """CuPy's own exception while realizing a value (an upload failing as an
    out-of-memory would) is a BackendFailure naming the parameter."""
    from coppelius.reference.binding import BackendFailure, bind, default_bindings
    from coppelius.reference.checkpoint import identities, write_checkpoint
    from coppelius.reference.sources import CheckpointFileSource

    class Failing(cupy_backend.CupyBindingBackend):
        def from_host(self, array, dtype):
            if array.shape == (CONFIG.d_ff, CONFIG.d_model):
                raise MemoryError(f"out of memory allocating {array.nbytes} bytes")
            return super().from_host(array, dtype)

    path = tmp_path / "ck.bin"
    write_checkpoint(path, CONFIG, identities(CONFIG, Hyper(), "fp32", 1, None, "0" * 64),
                     fresh(), 0)
    with CheckpointFileSource(path) as source, pytest.raises(BackendFailure) as info:
        bind(registry(CONFIG), default_bindings(CONFIG), source, Failing(),
             offered=[s.name for s in registry(CONFIG).specs])
    # (F, D): the first such tensor in the registry's order is layer 0's gate
    assert str(info.value).startswith("layers.0.mlp.gate.weight: backend cupy failed to realize")


# ------------------------------------------------------------------ memory plan

def run_steps(program, inputs):
    rows = []
    for tokens in inputs:
        program.upload_input(tokens)
        program.replay_and_wait()
        rows.append(program.row_losses())
    return np.stack(rows), program.gradients(), program.state()


def check_same_steps(first, second, inputs):
    """Both programs' steps on the inputs: row losses, G, P, M, V bit for
    bit. -> the first's (rows, G, state)."""
    rows1, G1, s1 = run_steps(first, inputs)
    rows2, G2, s2 = run_steps(second, inputs)
    check_bitwise("row losses", rows2, rows1)
    check_bitwise("G", G2, G1)
    for name in "PMV":
        check_bitwise(name, getattr(s2, name), getattr(s1, name))
    assert s1.t == s2.t
    return rows1, G1, s1


@pytest.mark.parametrize("precision, batch, accumulate", [
    ("fp32", 2, 1), ("bf16", 4, 1), ("bf16", 4, 2)], ids=["fp32", "bf16", "bf16-accumulate"])
def test_recomputing_the_gate_and_up_products_keeps_every_bit(precision, batch, accumulate):
    """recompute=True: the gate and up products computed again in the
    backward (the forward's norm kernel and product) instead of kept per
    layer: the same row losses, G, P, M, V and held-out losses, bit for
    bit, replay after replay; the plan keeps no per-layer gate and up
    buffers, and the production model's (the dry run) is smaller by at
    least L - 2 of them."""
    state = random_state(CONFIG, seed=43, t=3)
    inputs = windows(3, seed=44, batch=batch)
    kept = cupy_backend.capture(CONFIG, Hyper(), precision, batch, state.copy(), accumulate)
    again = cupy_backend.capture(CONFIG, Hyper(), precision, batch, state.copy(), accumulate,
                                 recompute=True)
    assert again.recompute and not kept.recompute
    assert "recompute" in again.diagnostics()["notes"]["memory_planning"]
    L = CONFIG.n_layer
    names = {b.name for b in again.plan.buffers}
    assert "acts.gu_back" in names and "acts.gu[1]" not in names
    assert again.plan.arena_bytes <= kept.plan.arena_bytes
    big = preset("coppelius")
    plans = [cupy_backend.memory_plan(big, Hyper(), precision, 2, recompute=r) for r in (0, 1)]
    big_gu = 2 * big.context * 2 * big.d_ff * 4
    assert plans[1].arena_bytes <= plans[0].arena_bytes - (big.n_layer - 2) * big_gu
    assert again.recorded["products"] == kept.recorded["products"] + accumulate * L
    check_same_steps(kept, again, inputs)
    held_out = windows(1, seed=45, batch=batch)[0]
    check_bitwise("held-out row losses", again.evaluate(held_out), kept.evaluate(held_out))


@pytest.mark.parametrize("precision, batch, path", [
    ("fp32", 2, "materialized"), ("bf16", 2, "materialized"), ("bf16", 4, "fused"),
    ("bf16", 2, "cudnn")], ids=["fp32", "bf16-materialized", "bf16-fused", "bf16-cudnn"])
def test_memory_plan_saves_memory_and_keeps_every_bit(precision, batch, path, monkeypatch):
    """Buffers sharing storage by lifetime: the same row losses, G, P, M, V
    and held-out losses, bit for bit, as every buffer in its own storage; the
    device bytes fall by exactly the plan's savings."""
    if path == "cudnn":
        need_cudnn()
    state = random_state(CONFIG, seed=31, t=3)
    inputs = windows(3, seed=32, batch=batch)
    force = cudnn_from_batch(1) if path == "cudnn" else fused_from_batch(4)
    with force:
        planned = cupy_backend.capture(CONFIG, Hyper(), precision, batch, state.copy())
        assert planned.acts.path.kind == path, planned.acts.path
        monkeypatch.setenv("COPPELIUS_NO_MEMORY_PLAN", "1")
        unplanned = cupy_backend.capture(CONFIG, Hyper(), precision, batch, state.copy())
    assert planned.memory_planned and not unplanned.memory_planned
    saved = planned.plan.savings
    assert saved > 0
    assert unplanned.alloc.bytes - planned.alloc.bytes == saved
    assert planned.compilation_report()["device_bytes"] == planned.alloc.bytes
    rows1, _, s1 = check_same_steps(planned, unplanned, inputs)
    assert s1.t == 6
    held_out = windows(1, seed=33, batch=batch)[0]
    check_bitwise("evaluate", planned.evaluate(held_out), unplanned.evaluate(held_out))
    check_bitwise("row losses after evaluate", planned.row_losses(), rows1[-1])
    memory = json.loads(planned.compilation_debug_report_json("plan"))["memory_analysis"]
    assert memory["materialized"] and memory["materialized_savings_bytes"] == saved
    assert memory["unplanned_bytes"] - memory["planned_bytes"] == saved
    stages = {r.stage: r.state for r in planned.compilation_stages()}
    assert stages["memory_planning"] == "applied"
    off = json.loads(unplanned.compilation_debug_report_json("off"))["memory_analysis"]
    assert not off["materialized"] and "COPPELIUS_NO_MEMORY_PLAN" in off["fallback_reason"]


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_holds_the_activations_of_a_micro_batch_and_plans_them(k, monkeypatch):
    """SPEC 19: activations of B/k contexts (fewer bytes than the step of B),
    laid out by the plan by the first pass's lifetimes: the same bits as
    every buffer in its own storage."""
    state = random_state(CONFIG, seed=36, t=2)
    inputs = windows(3, seed=37, batch=4)
    whole = cupy_backend.capture(CONFIG, Hyper(), "bf16", 4, state.copy())
    planned = cupy_backend.capture(CONFIG, Hyper(), "bf16", 4, state.copy(), accumulate=k)
    assert planned.acts.B == 4 // k and planned.micro_batch == 4 // k
    assert planned.memory_planned and planned.plan.savings > 0
    assert planned.plan.arena_bytes < whole.plan.arena_bytes
    monkeypatch.setenv("COPPELIUS_NO_MEMORY_PLAN", "1")
    unplanned = cupy_backend.capture(CONFIG, Hyper(), "bf16", 4, state.copy(), accumulate=k)
    assert not unplanned.memory_planned
    rows1, _, _ = check_same_steps(planned, unplanned, inputs)
    held_out = windows(1, seed=38, batch=4)[0]
    check_bitwise("evaluate", planned.evaluate(held_out), unplanned.evaluate(held_out))
    check_bitwise("row losses after evaluate", planned.row_losses(), rows1[-1])


def test_a_plan_that_ignores_lifetimes_is_caught(monkeypatch):
    """The check above can fail: every buffer that may share storage at
    offset 0 of a small arena (storage shared whatever the lifetimes; the
    pinned ones, the norms' address table among them, each after them)
    changes the results."""
    def overlap_everything(buffers, indices, horizon):
        def aligned(n):
            return -(-n // 256) * 256

        end = aligned(max(buffers[i].nbytes for i in indices if buffers[i].candidate))
        for i in indices:
            if buffers[i].candidate:
                buffers[i].offset = 0
            else:
                buffers[i].offset, end = end, end + aligned(buffers[i].nbytes)
        return end

    state = random_state(CONFIG, seed=34, t=1)
    inputs = windows(1, seed=35)
    good = run_steps(cupy_backend.capture(CONFIG, Hyper(), "fp32", B, state.copy()), inputs)
    monkeypatch.setattr(cupy_backend, "place", overlap_everything)
    bad = run_steps(cupy_backend.capture(CONFIG, Hyper(), "fp32", B, state.copy()), inputs)
    assert not np.array_equal(good[0], bad[0])


@pytest.mark.parametrize("config, batch, precision", [
    (CONFIG, 2, "fp32"), (CONFIG, 4, "bf16"),
    (Config(vocab=37, context=9, d_model=18, n_layer=2, n_head=3, d_ff=13), 3, "bf16"),
    (preset("coppelius"), 32, "bf16"),
], ids=["test-fp32", "test-fused", "odd", "coppelius-B32"])
def test_memory_plan_shares_storage_only_between_disjoint_lifetimes(config, batch, precision):
    """The plan itself, made by the dry run (no device memory, so even the
    production model at B=32): two activations whose bytes overlap never
    live at once; pinned buffers (host reads, persistent zeros) share
    nothing; the arena is no smaller than the bytes live at once."""
    plan = cupy_backend.memory_plan(config, Hyper(), precision, batch)
    acts = [plan.buffers[i] for i in plan.activations]
    assert all(b.first is not None for b in acts), [b.name for b in acts if b.first is None]
    for i, a in enumerate(acts):
        for b in acts[i + 1:]:
            if a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes:
                assert a.candidate and b.candidate, (a.name, b.name)
                assert a.last < b.first or b.last < a.first, (a.name, b.name)
    pinned = {b.name for b in acts if not b.candidate}
    assert {"acts.ce", "acts.loss"} <= pinned
    horizon = len(plan.commands)
    live = max(sum(b.nbytes for b in acts if not b.candidate or b.first <= t <= b.last)
               for t in range(horizon))
    assert live <= plan.arena_bytes < plan.unplanned_bytes
    assert plan.savings == plan.unplanned_bytes - plan.arena_bytes
    # every command lowers at least one semantic operation of the step
    names = {o.name for o in semantic_graph(config, batch, precision).operations}
    assert all(c.operations and set(c.operations) <= names for c in plan.commands)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_logits_chunk_rows_rule(rows, vocab):
    """At most LOGITS_CHUNK_BYTES of float32 logits (or one row), whole
    128-row tiles where at least one fits, never more rows than there are."""
    n = cupy_backend.logits_chunk_rows(rows, vocab)
    fit = cupy_backend.LOGITS_CHUNK_BYTES // (4 * vocab)
    assert 1 <= n <= rows
    assert n == 1 or 4 * vocab * n <= cupy_backend.LOGITS_CHUNK_BYTES
    if n < rows:  # a chunk as large as the rule allows
        assert n == (fit - fit % 128 if fit >= 128 else max(fit, 1))


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_the_step_never_holds_whole_logits(batch, monkeypatch):
    """The production model's plan (the dry run: no device memory): the
    float32 logits and their bfloat16 gradient are one chunk of rows each,
    every chunk of rows runs its product, its cross-entropy and its two
    backward products, and at the loss the bytes live are those with the
    whole (BT, V) logits and gradient less all but the chunk's rows (the
    arena, packed around them, shrinks by about as much)."""
    config = preset("coppelius")
    BT, V = batch * config.context, config.vocab
    plan = cupy_backend.memory_plan(config, Hyper(), "bf16", batch)
    sizes = {b.name: b.nbytes for b in plan.buffers}
    rows = cupy_backend.logits_chunk_rows(BT, V)
    assert sizes["acts.logits"] == rows * V * 4 and rows == min(BT, 2048)
    assert sizes["acts.dlogits"] == rows * V * 2  # bfloat16 operands, one chunk's
    assert not any(plan.buffers[i].nbytes >= BT * V * 2 for i in plan.activations) or rows == BT
    ce = [c for c in plan.commands if c.name == "crossentropy_forward_backward"]
    heads = [c for c in plan.commands if c.operations == ("lm_head",)]
    assert len(ce) == len(heads) == -(-BT // rows)
    assert [c.launch["grid"][0] for c in ce] == [min(rows, BT - r) for r in range(0, BT, rows)]
    backward = [c for c in plan.commands
                if c.operations == ("lm_head.backward",) and c.kind == "product"]
    weights = [c for c in backward if c.launch["trans_a"]]  # G_emb (+)= dlogits^T hf
    inputs = [c for c in backward if not c.launch["trans_a"]]  # dh's rows = dlogits W_emb
    assert [c.launch["k"] for c in weights] == [c.launch["grid"][0] for c in ce]
    assert [c.launch["m"] for c in inputs] == [c.launch["grid"][0] for c in ce]
    monkeypatch.setattr(cupy_backend, "LOGITS_CHUNK_BYTES", 4 * BT * V)  # one chunk: whole
    whole = cupy_backend.memory_plan(config, Hyper(), "bf16", batch)

    def live_at_the_loss(p):  # bytes live at the first cross-entropy
        t = next(c.index for c in p.commands if c.name == "crossentropy_forward_backward")
        return sum(b.nbytes for b in (p.buffers[i] for i in p.activations)
                   if not b.candidate or b.first <= t <= b.last)

    assert live_at_the_loss(whole) - live_at_the_loss(plan) == (BT - rows) * V * (4 + 2)
    assert whole.arena_bytes > plan.arena_bytes or rows == BT


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_the_production_plan_is_tight_at_the_loss(batch):
    """The production model's plan (the dry run): none of the buffers that
    only the forward or only the backward uses is live at the loss (the
    step's fullest point: every saved activation and dlogits), and the
    arena is within 1% of the bytes live at once."""
    plan = cupy_backend.memory_plan(preset("coppelius"), Hyper(), "bf16", batch)
    by_name = {b.name: b for b in plan.buffers}
    loss = [c.index for c in plan.commands if c.name == "crossentropy_forward_backward"]
    for name in ("acts.a", "acts.h", "acts.qkv32", "acts.att_workspace.forward"):
        if name in by_name:
            assert by_name[name].last < loss[0], (name, by_name[name].last, loss[0])
    for name in ("acts.a_back", "acts.h_back", "acts.att_workspace.backward", "acts.da",
                 "acts.dgu"):
        if name in by_name:
            assert by_name[name].first > loss[-1], (name, by_name[name].first, loss[-1])
    acts = [plan.buffers[i] for i in plan.activations]
    live = max(sum(b.nbytes for b in acts if not b.candidate or b.first <= t <= b.last)
               for t in range(len(plan.commands)))
    assert plan.arena_bytes <= 1.01 * live, (plan.arena_bytes, live)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_gradient_lives_from_its_first_write_to_adamw(batch):
    """The production model's plan (the dry run): G is no state buffer but
    a segment per layer, the embedding's and the final norm's, each in the
    arena from the command that first writes it (the embedding's: the first
    chunk's unembedding product; a layer's: its down weight's gradient, the
    first of its backward), last touched by AdamW and kept to the step's end
    (the host reads it after the replay); at the first chunk's cross-entropy
    none exists."""
    config = preset("coppelius")
    plan = cupy_backend.memory_plan(config, Hyper(), "bf16", batch)
    by_name = {b.name: b for b in plan.buffers}
    assert "G" not in by_name and not by_name["G.table"].candidate  # the table: pinned
    adamw = next(c.index for c in plan.commands if c.name == "adamw_update")
    first_emb = next(c.index for c in plan.commands
                     if c.operations == ("lm_head.backward",) and c.launch.get("trans_a"))
    segments = ["G.tok_embedding"] + [f"G.layers.{l}" for l in range(config.n_layer)] + \
        ["G.final_norm"]
    for name, (start, n) in zip(segments, cupy_backend.gradient_segments(config)):
        b = by_name[name]
        assert b.kind == "gradient" and b.candidate and b.nbytes == 4 * n, name
        index = plan.buffers.index(b)
        assert max(t for t, touched in enumerate(plan.touches) if index in touched) == adamw
        assert b.last == len(plan.commands) - 1, (name, b.last)
    assert by_name["G.tok_embedding"].first == first_emb
    for l in range(config.n_layer):
        down = next(c.index for c in plan.commands if c.kind == "product"
                    and c.operations == (f"layers.{l}.mlp.down.backward",)
                    and c.launch.get("trans_a"))
        assert by_name[f"G.layers.{l}"].first == down, l
    loss = next(c.index for c in plan.commands if c.name == "crossentropy_forward_backward")
    assert all(by_name[name].first > loss for name in segments)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_by_small_chunks_of_logits(monkeypatch, accumulate):
    """Chunks of 7 rows (the last one shorter) against reference.step, the
    held-out losses and the logits of activations() included; with
    accumulate 2, the chunks of each micro-batch's rows."""
    monkeypatch.setattr(cupy_backend, "LOGITS_CHUNK_BYTES", 7 * 4 * CONFIG.vocab)
    state = random_state(CONFIG, seed=23, t=4)
    tokens = windows(1, seed=24)[0]
    program = cupy_backend.capture(CONFIG, Hyper(), "bf16", B, state.copy(), accumulate)
    rows = B // accumulate * CONFIG.context
    assert program.acts.logits.shape == (7, CONFIG.vocab) and rows % 7
    assert program.acts.dlogits.shape == (7, CONFIG.vocab)
    seen = program.activations(tokens)
    check_close("activations' logits", seen["logits"], program.logits(tokens[:, :-1]), 1e-2)
    want = ReferenceProgram(CONFIG, Hyper(), "bf16", B, state.copy()).activations(tokens)
    for name in ("dlogits", "final_norm.dout"):
        check_close(f"activations' {name}", seen[name], want[name], 1e-2)
    rows = step_rows(program, CONFIG, Hyper(), "bf16", state, tokens)
    failures = [r for r in rows if not r.passed]
    assert not failures, "\n".join(f"{r.check} {r.tensor}: {r.error:.3e}" for r in failures)
    held_out = windows(1, seed=25)[0]
    # step_rows evaluated after the step: with accumulate 1 that took G's storage
    gradients = program.gradients() if accumulate > 1 else None
    want = ReferenceProgram(CONFIG, Hyper(), "bf16", B, program.state()).evaluate(held_out)
    check_close("held-out row losses", program.evaluate(held_out), want, 1e-2)
    if accumulate == 1:
        # G's segments share the arena with the activations the evaluation used
        with pytest.raises(ReplayError, match="evaluate"):
            program.gradients()
        program.upload_input(tokens)  # the next step's G is readable again
        program.replay_and_wait()
        assert np.isfinite(program.gradients()).all()
    else:
        # G carries the micro-batches' sum in a buffer of its own: the
        # evaluation runs the classifier's chunks without their backward
        check_bitwise("gradients after an evaluation", program.gradients(), gradients)


def test_reset_returns_the_device_memory():
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    program = cupy_backend.capture(CONFIG, Hyper(), "bf16", B, fresh())
    program.upload_input(windows(1)[0])
    program.replay()
    held = pool.used_bytes() - before
    assert held >= program.compilation_report()["device_bytes"]
    program.reset()
    gc.collect()
    assert pool.used_bytes() - before < held / 100, (pool.used_bytes() - before, held)
    with pytest.raises(ProgramReset):
        program.state()


# ------------------------------------------------------------------ capture fallback

def test_a_capture_refused_inside_the_stream_capture_falls_back(monkeypatch, capfd):
    """The failure inside the stream capture (a launch refused while the
    stream records, as CUDA refuses what a graph cannot hold): the capture
    ends cleanly, the step runs uncaptured with the same bits."""
    state = random_state(CONFIG, seed=36, t=2)
    inputs = windows(2, seed=37)
    rows, G, want = run_steps(cupy_backend.capture(CONFIG, Hyper(), "fp32", B, state.copy()),
                              inputs)
    original, record = cuda_kernels.Kernels.mean_loss, cupy_backend.CupyProgram._record
    capturing = []

    def refused_in_capture(self, ce, loss):
        if capturing:  # the stream is recording: half the step is in the graph already
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted "
                               "when stream is capturing")
        return original(self, ce, loss)

    def flagged_record(self):
        capturing.append(True)
        try:
            record(self)
        finally:
            capturing.clear()

    monkeypatch.setattr(cuda_kernels.Kernels, "mean_loss", refused_in_capture)
    monkeypatch.setattr(cupy_backend.CupyProgram, "_record", flagged_record)
    capfd.readouterr()
    program = cupy_backend.capture(CONFIG, Hyper(), "fp32", B, state.copy())
    err = capfd.readouterr().err
    assert "capture refused (RuntimeError: cudaErrorStreamCaptureUnsupported" in err
    assert err.count("\n") == 1
    assert program.graph is None and program.capture_refused
    rows2, G2, got = run_steps(program, inputs)
    check_bitwise("row losses", rows2, rows)
    check_bitwise("G", G2, G)
    check_bitwise("P", got.P, want.P)
    assert "capture refused" in program.compilation_report()["notes"]["command_recording"]


# ------------------------------------------------------------------ layer-by-layer debugging

def test_activations_locate_a_broken_kernel_to_its_layer(monkeypatch):
    """A SwiGLU launcher broken in the second layer only: the backend's
    activations against the reference's name layers.1.mlp.h first."""
    from coppelius.conformance.activations import activation_rows, first_divergence
    from coppelius.reference.step import step_activations

    program = cupy_backend.capture(CONFIG, Hyper(), "fp32", B, fresh())
    original = cuda_kernels.Kernels.swiglu_forward
    calls = []

    def broken(self, gu, a):
        original(self, gu, a)
        calls.append(1)
        if len(calls) == 2:  # activations() runs the one forward since the patch: layer 1
            with program.stream:
                a *= np.float32(1.01)

    monkeypatch.setattr(cuda_kernels.Kernels, "swiglu_forward", broken)
    tokens = windows(1, seed=38)[0]
    rows = activation_rows(CONFIG, program.activations(tokens),
                           step_activations(CONFIG, fresh().P, tokens, "fp32"), "fp32")
    first = first_divergence(rows)
    assert first is not None and first.tensor == "layers.1.mlp.h", first


def test_executable_plan_lists_the_captured_commands():
    program = cupy_backend.capture(CONFIG, Hyper(), "bf16", B, fresh())
    report = program.compilation_report()
    plan = json.loads(program.debug_report_json("step"))
    nodes = plan["nodes"]
    assert len(nodes) == report["kernel_launches"] + report["products"] + report["library_calls"]
    assert sorted({n["name"] for n in nodes if n["kind"] == "kernel"}) == report["kernel_names"]
    gemm = next(n for n in nodes if n["kind"] == "product")
    assert gemm["operations"] == ["layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v"]
    D = CONFIG.d_model
    assert (gemm["launch"]["m"], gemm["launch"]["n"], gemm["launch"]["k"]) == \
        (B * CONFIG.context, 3 * D, D)
    assert "acts.h" in gemm["buffers"] and "acts.qkv32" in gemm["buffers"]
