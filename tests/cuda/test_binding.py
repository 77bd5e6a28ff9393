"""The checkpoint binding on CuPy arrays (accelerated/cuda/binding.py)."""

import ml_dtypes
import numpy as np
import pytest

from coppelius.reference.config import Hyper, preset
from coppelius.reference.params import initialize, registry
from coppelius.reference.state import State
from coppelius.accelerated.cuda.binding import CupyBindingBackend

from .helpers import CONFIG, fresh, cupy

# on a GPU; elsewhere on the CPU stand-ins (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.emulated]


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
    backend = CupyBindingBackend()
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

    class Failing(CupyBindingBackend):
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
