"""The binding layer (SPEC section 12): sources, leases, recipes, and
binding a model fail-closed. Every error type has a test that triggers
exactly it, and checks that nothing was read (no lease granted) first."""

import hashlib
import json
import math
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

from coppelius.reference import State, forward, initialize, preset, registry
from coppelius.reference.binding import (Alias, BackendFailure, Bind, BindingError,
                                         ByteLengthMismatch, Cast, Concat,
                               DtypeMismatch, DuplicateBinding, InvalidName, MissingValue,
                               NumpyBackend, RecipeBind, RecipeError, ShapeMismatch, Slice,
                               SourceError, Tensor, Transpose, UnexpectedValue, bind,
                               check_bindings, default_bindings, flatten, load_state, materialize,
                               state_from_source)
from coppelius.reference.checkpoint import identities, validate, write_checkpoint
from coppelius.reference.config import Hyper
from coppelius.reference.errors import CheckpointError, CoppeliusError, IdentityMismatch
from coppelius.reference.sources import CheckpointFileSource, SafetensorsSource

CONFIG = preset("test")
REG = registry(CONFIG)
BF16 = np.dtype(ml_dtypes.bfloat16)


def named_params(config=CONFIG, seed=1):
    """{name: float32 array} of a random (not initialized) parameter set."""
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in registry(config)}


def safetensors_source(tmp_path, tensors, name="model.safetensors", **kw):
    path = tmp_path / name
    save_file(tensors, str(path))
    return SafetensorsSource(path, **kw)


@pytest.fixture
def params():
    return named_params()


# ------------------------------------------------------------------ binding a model

def test_default_bindings_bind_every_parameter_and_tie_the_head(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    values = bind(CONFIG, default_bindings(CONFIG), source, NumpyBackend())
    assert set(values) == set(REG.by_name) | {"lm_head.weight"}
    for name, a in params.items():
        assert values[name].dtype == np.float32 and np.array_equal(values[name], a), name
    # the alias is the very same array object: tied storage, no copy
    assert values["lm_head.weight"] is values["tok_embedding.weight"]
    # bound values are owned by the backend, not views of the lease
    assert all(v.flags.writeable and v.flags.owndata for v in values.values())


def test_check_bindings_reads_nothing(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    check_bindings(CONFIG, default_bindings(CONFIG), source)
    assert source.leases_granted == 0


def test_binding_is_by_name_not_by_file_order(tmp_path, params):
    shuffled = dict(reversed(list(params.items())))
    source = safetensors_source(tmp_path, shuffled)
    P = flatten(REG, bind(CONFIG, default_bindings(CONFIG), source, NumpyBackend()))
    expect = np.concatenate([params[s.name].reshape(-1) for s in REG.specs])
    assert np.array_equal(P, expect)


def fail(error_type, source, bindings, model=CONFIG, offered=None):
    """Bind, expect exactly `error_type`, and check nothing was read first;
    check_bindings refuses the same way."""
    before = source.leases_granted
    with pytest.raises(BindingError) as checked:
        check_bindings(model, bindings, source, offered=offered)
    with pytest.raises(BindingError) as info:
        bind(model, bindings, source, NumpyBackend(), offered=offered)
    assert type(info.value) is error_type, info.value
    assert type(checked.value) is error_type and str(checked.value) == str(info.value)
    assert isinstance(info.value, CoppeliusError) and info.value.exit_status == 2
    assert source.leases_granted == before, "a lease was granted before validation finished"
    return str(info.value)


def test_missing_value_no_binding(tmp_path, params):
    bindings = [b for b in default_bindings(CONFIG) if b.param != "layers.1.mlp.up.weight"]
    params.pop("layers.1.mlp.up.weight")
    source = safetensors_source(tmp_path, params)
    assert "layers.1.mlp.up.weight" in fail(MissingValue, source, bindings)


def test_missing_value_key_absent_from_source(tmp_path, params):
    params.pop("layers.0.attn.k.weight")
    source = safetensors_source(tmp_path, params)
    message = fail(MissingValue, source, default_bindings(CONFIG))
    assert message.endswith("missing tensor 'layers.0.attn.k.weight'")


def test_every_missing_and_unexpected_key_is_listed_in_one_error(tmp_path, params):
    """A checkpoint of another shape or naming: the one error lists them all."""
    for name in ("layers.0.attn.k.weight", "layers.1.attn.k.weight"):
        params[name.replace(".k.", ".key.")] = params.pop(name)
    source = safetensors_source(tmp_path, params)
    message = fail(MissingValue, source, default_bindings(CONFIG))
    assert message.endswith("missing tensors 'layers.0.attn.k.weight', 'layers.1.attn.k.weight'; "
                            "unexpected tensors 'layers.0.attn.key.weight', "
                            "'layers.1.attn.key.weight' (no parameter takes them)")


def test_missing_value_alias_of_nothing(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    bindings = [b for b in default_bindings(CONFIG) if not isinstance(b, Alias)]
    bindings.append(Alias("lm_head.weight", "tok_embeddings.weight"))
    assert "lm_head.weight" in fail(MissingValue, source, bindings)


def test_unexpected_value_binding_the_model_does_not_take(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    bindings = default_bindings(CONFIG) + [Bind("layers.2.attn.q.weight", "layers.0.attn.q.weight")]
    assert "layers.2.attn.q.weight" in fail(UnexpectedValue, source, bindings)


def test_unexpected_value_source_tensor_no_parameter_takes(tmp_path, params):
    params["layers.0.attn.qkv.bias"] = np.zeros(3 * CONFIG.d_model, np.float32)
    source = safetensors_source(tmp_path, params)
    assert "layers.0.attn.qkv.bias" in fail(UnexpectedValue, source, default_bindings(CONFIG))
    # the same source is fine when that key is not offered to this model
    offered = [key for key in source.tensors() if key != "layers.0.attn.qkv.bias"]
    bind(CONFIG, default_bindings(CONFIG), source, NumpyBackend(), offered=offered)


def test_duplicate_binding(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    bindings = default_bindings(CONFIG) + [Bind("final_norm.bias", "final_norm.bias")]
    assert "final_norm.bias" in fail(DuplicateBinding, source, bindings)


@pytest.mark.parametrize("bad", ["", "Final_norm.bias", "final_norm..bias", "m/final_norm.bias",
                                 "final norm.bias", ".bias", 7])
def test_invalid_name(tmp_path, params, bad):
    source = safetensors_source(tmp_path, params)
    bindings = default_bindings(CONFIG) + [Bind(bad, "final_norm.bias")]
    assert repr(bad) in fail(InvalidName, source, bindings)


def test_invalid_source_key(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    bindings = [b for b in default_bindings(CONFIG) if b.param != "final_norm.bias"]
    bindings.append(Bind("final_norm.bias", ""))
    assert "final_norm.bias" in fail(InvalidName, source, bindings)


def test_byte_length_mismatch(tmp_path, params):
    V, D = CONFIG.vocab, CONFIG.d_model
    params["tok_embedding.weight"] = np.zeros((V, D + 1), np.float32)
    source = safetensors_source(tmp_path, params)
    message = fail(ByteLengthMismatch, source, default_bindings(CONFIG))
    assert message.startswith("tok_embedding.weight:")
    assert str(V * (D + 1) * 4) in message and str(V * D * 4) in message


def test_byte_length_mismatch_bfloat16_without_cast(tmp_path, params):
    params["layers.1.attn.o.weight"] = params["layers.1.attn.o.weight"].astype(BF16)
    source = safetensors_source(tmp_path, params)
    assert "layers.1.attn.o.weight" in fail(ByteLengthMismatch, source, default_bindings(CONFIG))


def test_shape_mismatch_same_bytes(tmp_path, params):
    params["layers.0.mlp.down.weight"] = params["layers.0.mlp.down.weight"].T.copy()  # (F, D)
    source = safetensors_source(tmp_path, params)
    message = fail(ShapeMismatch, source, default_bindings(CONFIG))
    assert "layers.0.mlp.down.weight" in message and "[96, 32]" in message


def test_dtype_mismatch_same_bytes_same_shape(tmp_path, params):
    params["final_norm.weight"] = np.ones(CONFIG.d_model, np.int32)
    source = safetensors_source(tmp_path, params)
    assert "final_norm.weight" in fail(DtypeMismatch, source, default_bindings(CONFIG))


def test_source_error_lease_over_bound_names_the_parameter(tmp_path, params):
    V, D = CONFIG.vocab, CONFIG.d_model
    source = safetensors_source(tmp_path, params, max_lease_bytes=V * D * 4 - 1)
    message = fail(SourceError, source, default_bindings(CONFIG))
    assert message.startswith("tok_embedding.weight:") and str(V * D * 4) in message


def test_source_error_rows_outside_the_tensor(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    D = CONFIG.d_model
    model = {"head": ("float32", (2, D))}
    assert "head" in fail(SourceError, source, [Bind("head", "tok_embedding.weight",
                                                     rows=slice(CONFIG.vocab - 1, CONFIG.vocab + 1))],
                          model=model, offered=[])


@pytest.mark.parametrize("recipe, why", [
    (Concat((Tensor("layers.0.attn.q.weight"), Tensor("layers.0.mlp.up.weight")), 1), "concat"),
    (Concat((), 0), "concat of nothing"),
    (Slice(Tensor("layers.0.attn.q.weight"), 2, 0, 1), "axis"),
    (Slice(Tensor("layers.0.attn.q.weight"), 1, 4, 40), "outside"),
    (Transpose(Tensor("final_norm.weight")), "transpose"),
    (Cast(Tensor("layers.0.attn.q.weight"), "float16"), "cast to"),
])
def test_recipe_error(tmp_path, params, recipe, why):
    source = safetensors_source(tmp_path, params)
    model = {"fused": ("float32", (64, 64))}
    message = fail(RecipeError, source, [RecipeBind("fused", recipe)], model=model, offered=[])
    assert message.startswith("fused:") and why in message


def test_recipe_error_not_a_recipe(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    model = {"fused": ("float32", (64, 32))}
    recipe = Concat(("layers.0.attn.q.weight", Tensor("layers.0.attn.k.weight")), 0)
    assert "not a recipe" in fail(RecipeError, source, [RecipeBind("fused", recipe)],
                                  model=model, offered=[])


def test_recipe_error_alias_of_an_alias(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    model = {"a.weight": ("float32", (32,)), "b.weight": ("float32", (32,)),
             "c.weight": ("float32", (32,))}
    bindings = [Bind("a.weight", "final_norm.bias"), Alias("b.weight", "a.weight"),
                Alias("c.weight", "b.weight")]
    fail(RecipeError, source, bindings, model=model, offered=[])


class FailingBackend(NumpyBackend):
    """A backend whose own operations fail on a chosen source tensor (an
    upload) or on every concatenation, as a device out of memory would."""

    def __init__(self, upload_fails_for=None):
        super().__init__()
        self.upload_fails_for = upload_fails_for

    def from_host(self, array, dtype):
        if self.upload_fails_for is not None and array.shape == self.upload_fails_for:
            raise MemoryError("out of device memory allocating 8192 bytes\n(a second line)")
        return super().from_host(array, dtype)

    def concat(self, xs, axis):
        raise RuntimeError("concatenate: device error 700")


def test_a_backend_failure_while_realizing_names_the_parameter(tmp_path, params):
    """The backend's own exception, after every check passed, is a
    BindingError naming the parameter and the backend, on one line."""
    source = safetensors_source(tmp_path, params)
    shape = (CONFIG.d_model,)  # every norm's; the first realized is layers.0.attn_norm.weight
    with pytest.raises(BackendFailure) as info:
        bind(CONFIG, default_bindings(CONFIG), source, FailingBackend(upload_fails_for=shape))
    message = str(info.value)
    assert message.startswith("layers.0.attn_norm.weight: backend numpy failed")
    assert "MemoryError: out of device memory allocating 8192 bytes" in message
    assert "\n" not in message and info.value.exit_status == 2
    assert isinstance(info.value.__cause__, MemoryError)  # the backend's error is kept

    D = CONFIG.d_model
    qkv = [Tensor(f"layers.1.attn.{x}.weight") for x in "qkv"]
    with pytest.raises(BackendFailure, match=r"^layers\.1\.attn\.qkv\.weight: backend numpy "
                                             r"failed to realize the value: RuntimeError: "
                                             r"concatenate: device error 700$"):
        bind({"layers.1.attn.qkv.weight": ("float32", (3 * D, D))},
             [RecipeBind("layers.1.attn.qkv.weight", Concat(qkv, 0))], source, FailingBackend(),
             offered=[t.key for t in qkv])


def test_materialize_checks_byte_length_before_reading(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    declared = {"x.weight": ("bfloat16", (32, 32)), "y.weight": ("float32", (32, 32))}
    bindings = [RecipeBind("y.weight", Tensor("layers.0.attn.q.weight")),
                RecipeBind("x.weight", Tensor("layers.0.attn.k.weight"))]  # float32 for bfloat16
    with pytest.raises(ByteLengthMismatch, match="x.weight"):
        materialize(source, bindings, NumpyBackend(), declared)
    assert source.leases_granted == 0
    bindings[1] = RecipeBind("x.weight", Cast(Tensor("layers.0.attn.k.weight"), "bfloat16"))
    out = materialize(source, bindings, NumpyBackend(), declared)
    assert out["x.weight"].dtype == BF16
    assert np.array_equal(out["x.weight"].view(np.uint16),
                          params["layers.0.attn.k.weight"].astype(BF16).view(np.uint16))


# ------------------------------------------------------------------ recipes (hypothesis)

def _take(a, axis, start, stop):
    return a[(slice(None),) * axis + (slice(start, stop),)]


def _draw_recipe(data, leaves, depth):
    """(recipe, expected numpy value) of a random valid recipe tree."""
    ops = ["leaf"] if depth == 0 else ["leaf", "slice", "concat", "transpose", "cast"]
    op = data.draw(st.sampled_from(ops))
    if op == "leaf":
        key = data.draw(st.sampled_from(sorted(leaves)))
        return Tensor(key), leaves[key]
    x, a = _draw_recipe(data, leaves, depth - 1)
    if op == "slice":
        axis = data.draw(st.integers(0, a.ndim - 1))
        start = data.draw(st.integers(0, a.shape[axis]))
        stop = data.draw(st.integers(start, a.shape[axis]))
        return Slice(x, axis, start, stop), _take(a, axis, start, stop)
    if op == "concat":
        axis = data.draw(st.integers(0, a.ndim - 1))
        start = data.draw(st.integers(0, a.shape[axis]))
        stop = data.draw(st.integers(start, a.shape[axis]))
        first = data.draw(st.booleans())
        part = Slice(x, axis, start, stop)
        xs, arrays = ((x, part), (a, _take(a, axis, start, stop)))
        if not first:
            xs, arrays = xs[::-1], arrays[::-1]
        return Concat(xs, axis), np.concatenate(arrays, axis=axis)
    if op == "transpose":
        if a.ndim != 2:
            return x, a
        return Transpose(x), a.T
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    return Cast(x, dtype), a.astype(np.float32 if dtype == "float32" else BF16)


@given(st.data())
def test_recipe_inference_and_values(tmp_path_factory, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    leaves = {}
    for i in range(data.draw(st.integers(1, 3))):
        shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        leaves[f"t{i}"] = rng.standard_normal(shape).astype(np.float32)
    source = safetensors_source(tmp_path_factory.mktemp("recipes"), leaves)
    recipe, expect = _draw_recipe(data, leaves, data.draw(st.integers(0, 4)))

    dtype, shape, nbytes = recipe.infer(source)
    assert source.leases_granted == 0  # inference reads metadata only
    assert (dtype, shape, nbytes) == (expect.dtype.name, expect.shape, expect.nbytes)
    value = recipe.realize(source, NumpyBackend())
    assert (value.dtype.name, value.shape, value.nbytes) == (dtype, shape, nbytes)
    # bit-exact: the recipe is copies, reorderings and round-to-nearest casts
    assert value.tobytes() == np.ascontiguousarray(expect).tobytes()


# ------------------------------------------------------------------ fused q, k, v

def _layernorm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _rope(x, E):  # x (B, T, H, E), half-split pairs
    T = x.shape[1]
    j = np.arange(E // 2)
    theta = np.arange(T)[:, None] * 10000.0 ** (-2.0 * j / E)  # (T, E/2)
    cos = np.cos(theta).astype(np.float32)[None, :, None, :]  # tables rounded to float32 (SPEC 3)
    sin = np.sin(theta).astype(np.float32)[None, :, None, :]
    a, b = x[..., :E // 2], x[..., E // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def fused_forward(config, w, tokens):
    """SPEC section 3 in float64, with one (3D, D) q, k, v weight per layer."""
    H, E, D = config.n_head, config.head_dim, config.d_model
    w = {k: v.astype(np.float64) for k, v in w.items()}
    B, T = tokens.shape
    x = w["tok_embedding.weight"][tokens]  # (B,T,D)
    causal = np.triu(np.ones((T, T), bool), 1)
    for l in range(config.n_layer):
        p = f"layers.{l}."
        h = _layernorm(x, w[p + "attn_norm.weight"], w[p + "attn_norm.bias"])
        qkv = h @ w[p + "attn.qkv.weight"].T  # (B,T,3D)
        q, k, v = (t.reshape(B, T, H, E) for t in np.split(qkv, 3, axis=-1))
        q, k = _rope(q, E), _rope(k, E)
        s = np.einsum("bthe,bshe->bhts", q, k) / math.sqrt(E)  # (B,H,T,T)
        s[:, :, causal] = -np.inf
        s = np.exp(s - s.max(-1, keepdims=True))
        att = s / s.sum(-1, keepdims=True)
        y = np.einsum("bhts,bshe->bthe", att, v).reshape(B, T, D)
        x = x + y @ w[p + "attn.o.weight"].T
        h = _layernorm(x, w[p + "mlp_norm.weight"], w[p + "mlp_norm.bias"])
        g = h @ w[p + "mlp.gate.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ w[p + "mlp.up.weight"].T)) @ w[p + "mlp.down.weight"].T
    h = _layernorm(x, w["final_norm.weight"], w["final_norm.bias"])
    return h @ w["lm_head.weight"].T  # (B,T,V)


def test_fused_qkv_binding_gives_the_same_logits(tmp_path, params):
    source = safetensors_source(tmp_path, params)
    D = CONFIG.d_model
    fused_model, bindings = {}, []
    for spec in REG.specs:
        if ".attn.q." in spec.name or ".attn.k." in spec.name or ".attn.v." in spec.name:
            continue
        fused_model[spec.name] = ("float32", spec.shape)
        bindings.append(Bind(spec.name, spec.name))
    fused_model["lm_head.weight"] = ("float32", (CONFIG.vocab, D))
    bindings.append(Alias("lm_head.weight", "tok_embedding.weight"))
    for l in range(CONFIG.n_layer):
        p = f"layers.{l}.attn."
        fused_model[p + "qkv.weight"] = ("float32", (3 * D, D))
        bindings.append(RecipeBind(p + "qkv.weight", Concat(
            (Tensor(p + "q.weight"), Tensor(p + "k.weight"), Tensor(p + "v.weight")), 0)))
    fused = bind(fused_model, bindings, source, NumpyBackend())
    assert np.array_equal(fused["layers.1.attn.qkv.weight"][D:2 * D], params["layers.1.attn.k.weight"])

    unfused = bind(CONFIG, default_bindings(CONFIG), source, NumpyBackend())
    P = flatten(REG, unfused)
    tokens = np.random.default_rng(5).integers(0, CONFIG.vocab, (2, CONFIG.context))
    want = forward(CONFIG, P, tokens)  # the reference, unfused
    got = fused_forward(CONFIG, fused, tokens)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, err


# ------------------------------------------------------------------ leases

@pytest.fixture(params=["safetensors", "checkpoint"])
def any_source(request, tmp_path, params):
    """(source, {key: array}) of either kind holding the same parameters."""
    if request.param == "safetensors":
        return safetensors_source(tmp_path, params), params
    P = flatten(REG, {**params})
    rng = np.random.default_rng(2)
    state = State(P, rng.standard_normal(P.shape).astype(np.float32),
                  rng.random(P.shape).astype(np.float32), t=3)
    path = tmp_path / "state.ckpt"
    write_checkpoint(path, CONFIG, identities(CONFIG, Hyper(), "fp32", 1, None, "0" * 64), state, 3)
    expect = {}
    for spec in REG.specs:
        expect[spec.name] = state.P[spec.slice].reshape(spec.shape)
        expect["m/" + spec.name] = state.M[spec.slice].reshape(spec.shape)
        expect["v/" + spec.name] = state.V[spec.slice].reshape(spec.shape)
    return CheckpointFileSource(path), expect


def test_source_lists_and_leases_every_tensor(any_source):
    source, expect = any_source
    assert set(source.tensors()) == set(expect)
    for key, a in expect.items():
        info = source.tensors()[key]
        assert (info.dtype, info.shape, info.nbytes) == ("float32", a.shape, a.nbytes)
        assert np.array_equal(source.lease(key), a), key


def test_lease_rows_equals_the_slice(any_source):
    source, expect = any_source
    key = "layers.1.mlp.gate.weight"
    for rows in (slice(3, 17), slice(0, 1), slice(None, 5), slice(90, None), slice(7, 7),
                 slice(96, 96), slice(0, 96)):
        assert np.array_equal(source.lease(key, rows), expect[key][rows]), rows


def test_leases_are_read_only(any_source):
    source, _ = any_source
    for lease in (source.lease("tok_embedding.weight"), source.lease("final_norm.bias", slice(1, 4))):
        assert not lease.flags.writeable
        with pytest.raises(ValueError):
            lease[0] = 1.0


def test_lease_over_the_bound_is_refused(any_source):
    source, _ = any_source
    source.max_lease_bytes = 4096
    granted = source.leases_granted
    with pytest.raises(SourceError) as info:
        source.lease("tok_embedding.weight")  # 64 x 32 float32 = 8192 bytes
    assert "'tok_embedding.weight'" in str(info.value)
    assert "8192" in str(info.value) and "4096" in str(info.value)
    assert source.leases_granted == granted
    assert source.lease("tok_embedding.weight", slice(0, 32)).nbytes == 4096  # rows fit


def test_row_slice_recipe_leases_only_its_rows(tmp_path, params):
    # the embedding is 8192 bytes; a bound of 4096 admits half of its rows
    source = safetensors_source(tmp_path, params, max_lease_bytes=4096)
    with pytest.raises(SourceError, match="8192"):
        Tensor("tok_embedding.weight").infer(source)
    recipe = Slice(Tensor("tok_embedding.weight"), 0, 32, 64)
    assert recipe.infer(source) == ("float32", (32, 32), 4096)
    assert np.array_equal(recipe.realize(source, NumpyBackend()), params["tok_embedding.weight"][32:])
    with pytest.raises(SourceError, match="4224"):
        Slice(Tensor("tok_embedding.weight"), 0, 0, 33).infer(source)  # 33 rows: 4224 > 4096


@pytest.mark.parametrize("rows", [slice(0, 65), slice(-1, 3), slice(4, 2), slice(0, 8, 2), (0, 4)])
def test_bad_row_range_is_refused(any_source, rows):
    source, _ = any_source
    with pytest.raises(SourceError, match="tok_embedding.weight"):
        source.lease("tok_embedding.weight", rows)


def test_unknown_key_is_refused(any_source):
    source, _ = any_source
    with pytest.raises(SourceError, match="lm_head.weight"):
        source.lease("lm_head.weight")


def test_bfloat16_tensors_are_read_as_ml_dtypes_bfloat16(tmp_path):
    a = np.random.default_rng(3).standard_normal((5, 4)).astype(BF16)
    source = safetensors_source(tmp_path, {"w": a})
    assert source.tensors()["w"] == ("bfloat16", (5, 4), 40)
    lease = source.lease("w", slice(1, 3))
    assert lease.dtype == BF16 and lease.tobytes() == a[1:3].tobytes()
    widened = Cast(Tensor("w"), "float32").realize(source, NumpyBackend())
    assert widened.dtype == np.float32 and np.array_equal(widened, a.astype(np.float64))


# ------------------------------------------------------------------ lying safetensors files

def _raw_safetensors(path, header, data, header_length=None):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if header_length is None else header_length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


F32 = lambda shape, begin, end: {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}  # noqa: E731


@pytest.mark.parametrize("header, data, header_length, why", [
    ({"a": F32([2], 0, 8), "b": F32([2], 4, 12)}, bytes(12), None, "overlap"),
    ({"a": F32([2], 0, 8)}, bytes(8), 1 << 20, "beyond the file"),
    ({"a": F32([3], 0, 8)}, bytes(8), None, "12 bytes but data_offsets span 8"),
    ({"a": F32([2], 0, 16)}, bytes(8), None, "outside the 8 data bytes"),
    ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "data_offsets"),
    ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "dtype"),
    ({"__metadata__": {"step": 3}, "a": F32([2], 0, 8)}, bytes(8), None, "__metadata__"),
])
def test_lying_safetensors_refused_before_anything_is_read(tmp_path, monkeypatch, header, data,
                                                           header_length, why):
    import safetensors

    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a) or real(*a, **k))
    path = _raw_safetensors(tmp_path / "lie.safetensors", header, data, header_length)
    with pytest.raises(SourceError) as info:
        SafetensorsSource(path)
    assert why in str(info.value) and "lie.safetensors" in str(info.value)
    assert opened == []  # refused by the header checks, before the library read anything


def test_repeated_header_key_refused(tmp_path):
    entry = '{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    raw = ('{"a":%s,"a":%s}' % (entry, entry)).encode()
    path = tmp_path / "twice.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(SourceError, match="'a' appears twice"):
        SafetensorsSource(path)


def test_library_checks_apply_too(tmp_path):
    # A gap between tensors passes the overlap check but not the library's
    # contiguity rule: the library's error becomes a SourceError.
    path = _raw_safetensors(tmp_path / "gap.safetensors",
                            {"a": F32([2], 0, 8), "b": F32([2], 12, 20)}, bytes(20))
    with pytest.raises(SourceError, match="gap.safetensors"):
        SafetensorsSource(path)


def test_truncated_safetensors_refused(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(SourceError, match="too short"):
        SafetensorsSource(tmp_path / "short.safetensors")


# ------------------------------------------------------------------ checkpoint state

def _state(seed=4):
    P = initialize(CONFIG)
    rng = np.random.default_rng(seed)
    return State(P, rng.standard_normal(P.shape).astype(np.float32),
                 rng.random(P.shape).astype(np.float32), t=9)  # batch 1: contexts = step


IDS = identities(CONFIG, Hyper(), "fp32", 1, None, "a" * 64)


def test_load_state_equals_load_state(tmp_path):
    path = tmp_path / "c.ckpt"
    state = _state()
    write_checkpoint(path, CONFIG, IDS, state, contexts=9)
    got = load_state(path, CONFIG, expect=IDS)
    assert (got.step, got.contexts, got.state.t) == (9, 9, 9)
    for name in "PMV":
        assert getattr(got.state, name).tobytes() == getattr(state, name).tobytes(), name
        assert getattr(got.state, name).flags.writeable
    assert got.header["step"] == 9 and got.header["contexts"] == 9


def test_load_state_checks_identities(tmp_path):
    path = tmp_path / "c.ckpt"
    write_checkpoint(path, CONFIG, IDS, _state(), contexts=9)
    other = identities(CONFIG, Hyper(), "bf16", 1, None, "a" * 64)
    with pytest.raises(IdentityMismatch, match="learner"):
        load_state(path, CONFIG, expect=other)
    new_stream = identities(CONFIG, Hyper(), "fp32", 1, None, "b" * 64)
    with pytest.raises(IdentityMismatch, match="data"):
        load_state(path, CONFIG, expect=new_stream)
    load_state(path, CONFIG, expect=new_stream, new_data=True)  # --new-data lifts only the stream


def test_load_state_refuses_a_corrupt_checkpoint_before_mapping(tmp_path):
    path = tmp_path / "c.ckpt"
    write_checkpoint(path, CONFIG, IDS, _state(), contexts=9)
    raw = bytearray(path.read_bytes())
    raw[8192] ^= 1  # one payload bit
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        CheckpointFileSource(path)


def _republish(path, state):
    """Publish another valid checkpoint over `path` the way a run does: a
    rename over it (the old file lives on for whoever holds it open)."""
    other = path.with_name("republished.ckpt")
    write_checkpoint(other, CONFIG, IDS, state, contexts=state.t)
    os.replace(other, path)


def _assert_leases_give(source, state):
    for spec in REG.specs:
        for key, vector in ((spec.name, state.P), ("m/" + spec.name, state.M),
                            ("v/" + spec.name, state.V)):
            assert source.lease(key).tobytes() == vector[spec.slice].tobytes(), key


def test_checkpoint_source_maps_the_file_it_validated(tmp_path, monkeypatch):
    """A republication between the check and the mapping must not put an
    unchecked file under the leases: the source maps the very file it hashed."""
    path = tmp_path / "c.ckpt"
    original, replacement = _state(4), _state(5)
    write_checkpoint(path, CONFIG, IDS, original, contexts=9)
    real_memmap = np.memmap

    def republish_then_map(*args, **kwargs):  # the window between validation and mapping
        _republish(path, replacement)
        return real_memmap(*args, **kwargs)

    monkeypatch.setattr(np, "memmap", republish_then_map)
    with CheckpointFileSource(path) as source:
        monkeypatch.setattr(np, "memmap", real_memmap)
        _assert_leases_give(source, original)
        assert source.header["contexts"] == 9
    assert load_state(path, CONFIG).state.P.tobytes() == replacement.P.tobytes()


def test_checkpoint_source_keeps_its_file_when_the_path_is_republished(tmp_path):
    path = tmp_path / "c.ckpt"
    original = _state(4)
    write_checkpoint(path, CONFIG, IDS, original, contexts=9)
    with CheckpointFileSource(path) as source:
        _republish(path, _state(5))
        _assert_leases_give(source, original)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "c.ckpt"
    write_checkpoint(path, CONFIG, IDS, _state(), contexts=9)
    return path.read_bytes()


@given(st.data())
def test_checkpoint_source_refuses_what_validate_refuses(tmp_path_factory, good_checkpoint, data):
    """The source checks its open file as reference.checkpoint.validate checks
    a path: the same refusal, word for word, for a flipped byte or a cut."""
    n = len(good_checkpoint)
    bad = bytearray(good_checkpoint)
    if data.draw(st.booleans(), label="cut"):
        bad = bad[:data.draw(st.integers(0, n - 1), label="length")]
    else:
        offset = data.draw(st.one_of(st.integers(0, 4095), st.integers(0, n - 1),
                                     st.integers(n - 48, n - 1)), label="offset")
        bad[offset] ^= data.draw(st.integers(1, 255), label="mask")
    path = tmp_path_factory.mktemp("bad") / "bad.ckpt"
    path.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError) as want:
        validate(path)
    with pytest.raises(CheckpointError) as got:
        CheckpointFileSource(path)
    assert str(got.value) == str(want.value)


def test_checkpoint_source_learns_what_validate_learns(tmp_path_factory, good_checkpoint):
    path = tmp_path_factory.mktemp("good") / "c.ckpt"
    path.write_bytes(good_checkpoint)
    with CheckpointFileSource(path) as source:
        assert source.info == validate(path)
        assert source.info.sha256 == hashlib.sha256(good_checkpoint[:-48]).hexdigest()


def test_checkpoint_source_refuses_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a regular file"):
        CheckpointFileSource(tmp_path)


def count_hashed_bytes(monkeypatch, hashlib) -> list:
    """Make hashlib.sha256 record how many bytes it is fed; returns the record."""
    real, fed = hashlib.sha256, []

    class Counting:
        def __init__(self, data=b""):
            self._h = real()
            self.update(data)

        def update(self, data):
            fed.append(memoryview(data).nbytes)
            self._h.update(data)

        def digest(self):
            return self._h.digest()

        def hexdigest(self):
            return self._h.hexdigest()

    monkeypatch.setattr(hashlib, "sha256", Counting)
    return fed


def test_state_from_source_validates_once(tmp_path, monkeypatch):
    """Reading the header to learn the model and then the state costs one
    SHA-256 pass over the file, not two."""
    path = tmp_path / "c.ckpt"
    state = _state()
    write_checkpoint(path, CONFIG, IDS, state, contexts=9)
    hashed = count_hashed_bytes(monkeypatch, hashlib)
    with CheckpointFileSource(path) as source:
        assert source.header["model"] == CONFIG.identity()
        got = state_from_source(source, CONFIG, expect=IDS)
    assert sum(hashed) == os.path.getsize(path) - 48  # everything before the trailer, once
    for name in "PMV":
        assert getattr(got.state, name).tobytes() == getattr(state, name).tobytes(), name


def test_load_state_refuses_another_model(tmp_path):
    path = tmp_path / "c.ckpt"
    write_checkpoint(path, CONFIG, IDS, _state(), contexts=9)
    wider = type(CONFIG)(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=128)
    with pytest.raises(ByteLengthMismatch, match="layers.0.mlp.gate.weight"):
        load_state(path, wider)


def test_checkpoint_binds_by_name_whatever_its_order(tmp_path):
    """A checkpoint whose header lists the parameters in another order (a
    valid file: offsets contiguous in list order) binds by name."""
    state = _state()
    order = REG.specs[::-1]
    params, offset, parts = [], 0, {"P": [], "M": [], "V": []}
    for spec in order:
        params.append({"name": spec.name, "shape": list(spec.shape), "offset": offset})
        offset += spec.size
        for name in "PMV":
            parts[name].append(getattr(state, name)[spec.slice])
    header = dict(IDS, step=state.t, contexts=state.t, parameters=params)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    pad = -(16 + len(raw)) % 4096
    payload = b"".join(np.concatenate(parts[n]).astype("<f4").tobytes() for n in "PMV")
    body = b"CPLSCKPT" + struct.pack("<II", 1, len(raw)) + raw + bytes(pad) + payload
    path = tmp_path / "reordered.ckpt"
    path.write_bytes(body + b"CPLSDONE" + struct.pack("<Q", len(payload))
                     + hashlib.sha256(body).digest())
    got = load_state(path, CONFIG, expect=IDS)
    for name in "PMV":
        assert np.array_equal(getattr(got.state, name), getattr(state, name)), name
    assert os.path.getsize(path) == len(body) + 48
