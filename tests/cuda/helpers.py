"""What the CUDA backend's tests share: the device arrays (CuPy's, or the
stand-ins' where no GPU is here: conftest.py), poisoned buffers, placement
off a 16-byte boundary, the comparisons, fresh states and windows."""

import numpy as np
import pytest
from hypothesis import settings

from coppelius.conformance.tolerances import relative_error
from coppelius.reference.config import preset
from coppelius.reference.params import initialize
from coppelius.reference.precision import round_bf16
from coppelius.reference.state import State
from coppelius.accelerated.cuda import cudnn_attention
from coppelius.accelerated.cuda.buffers import Gradient
from coppelius.accelerated.cuda.step import kernels_for

cupy = pytest.importorskip("cupy")


CONFIG = preset("test")
B = 2
PRECISIONS = ["fp32", "bf16"]
small = settings(max_examples=12, deadline=None)


def kernels(precision="fp32"):
    return kernels_for(precision)


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


def gradient(G, cuts=(), aligned=True):
    """G (N,) float32 on the device as the step's Gradient: segments cut at
    `cuts`, each a buffer of its own (aligned=False: one element past a
    16-byte boundary)."""
    bounds = [0, *cuts, G.size]
    parts = [placed(G[a:b], aligned) for a, b in zip(bounds, bounds[1:])]
    return Gradient(bounds[:-1], parts, lambda shape, dtype: cupy.empty(shape, dtype))


def host_gradient(G):
    return np.concatenate([host(part) for part in G.parts])


def need_cudnn():
    if cudnn_attention.frontend() is None:
        pytest.skip("cuDNN's attention: " + cudnn_attention.import_error())
