"""The parameter registry and the initialization generator (SPEC sections 1, 2).

The expected names, shapes and counts are written out here from the SPEC
text, and the generator is re-implemented in pure Python (integers modulo
2^64, the math module, one element at a time), so neither is the
reference checked against itself. fixtures/init_golden.json keeps a few
generated values per preset: it catches drift of the reference and of this
file's generator alike. Regenerate it (only when SPEC section 2 changes) with
    COPPELIUS_REGEN_FIXTURES=1 python -m pytest tests/test_params.py
"""

import json
import math
import os
import struct

import numpy as np
import pytest

from coppelius import reference
from coppelius.reference.config import SEED, Config, parameter_count, schema_identity
from coppelius.reference.errors import ConfigError, CoppeliusError

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fixtures", "init_golden.json")


# ---------------------------------------------------------------- SPEC section 2, written out
def expected_table(V, D, L, F):
    """[(name, shape, init, std)] in canonical order, from the SPEC table."""
    small = 0.02 / math.sqrt(2 * L)
    rows = [("tok_embedding.weight", (V, D), "normal", 0.02)]
    for l in range(L):
        rows += [
            (f"layers.{l}.attn_norm.weight", (D,), "ones", 0.0),
            (f"layers.{l}.attn_norm.bias", (D,), "zeros", 0.0),
            (f"layers.{l}.attn.q.weight", (D, D), "normal", 0.02),
            (f"layers.{l}.attn.k.weight", (D, D), "normal", 0.02),
            (f"layers.{l}.attn.v.weight", (D, D), "normal", 0.02),
            (f"layers.{l}.attn.o.weight", (D, D), "normal", small),
            (f"layers.{l}.mlp_norm.weight", (D,), "ones", 0.0),
            (f"layers.{l}.mlp_norm.bias", (D,), "zeros", 0.0),
            (f"layers.{l}.mlp.gate.weight", (F, D), "normal", 0.02),
            (f"layers.{l}.mlp.up.weight", (F, D), "normal", 0.02),
            (f"layers.{l}.mlp.down.weight", (D, F), "normal", small),
        ]
    rows += [("final_norm.weight", (D,), "ones", 0.0), ("final_norm.bias", (D,), "zeros", 0.0)]
    return rows


def table_of(config):
    return expected_table(config.vocab, config.d_model, config.n_layer, config.d_ff)


# ---------------------------------------------------------------- the generator, pure Python
MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def to_f32(x):
    """Nearest float32 (struct packs with the C cast: round to nearest even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def init_value(seed, k, i, std):
    """Element i of the parameter with ordinal k: float32(std * z), SPEC section 2."""
    key = mix((seed + (k + 1) * GAMMA) & MASK64)
    r = mix((key + (i + 1) * GAMMA) & MASK64)
    u1 = ((r >> 40) + 0.5) / 2**24
    u2 = ((r & 0xFFFFFF) + 0.5) / 2**24
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return to_f32(std * z)


# The tensors and elements the golden file keeps, per preset: the first tensor,
# the first residual projection (the smaller std) and the last normal tensor.
def golden_tensors(config):
    L = config.n_layer
    return ["tok_embedding.weight", "layers.0.attn.o.weight", f"layers.{L - 1}.mlp.down.weight"]


def golden_elements(size):
    return sorted({0, 1, 2, 1000, size - 1})


def golden_of(config, seed=SEED):
    """{name: {element: float32 bits as hex}} from the pure-Python generator."""
    table = table_of(config)
    out = {}
    for name in golden_tensors(config):
        k = [row[0] for row in table].index(name)
        _, shape, _, std = table[k]
        out[name] = {str(i): f"0x{f32_bits(init_value(seed, k, i, std)):08x}"
                     for i in golden_elements(math.prod(shape))}
    return out


def test_regenerate_golden_fixture():
    """Writes fixtures/init_golden.json when COPPELIUS_REGEN_FIXTURES=1."""
    if os.environ.get("COPPELIUS_REGEN_FIXTURES") != "1":
        pytest.skip("set COPPELIUS_REGEN_FIXTURES=1 to rewrite fixtures/init_golden.json")
    doc = {"seed": SEED, "note": "float32 bits of initialize(preset) at chosen elements (SPEC 2)",
           "presets": {name: golden_of(config) for name, config in reference.PRESETS.items()}}
    with open(FIXTURE, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


@pytest.fixture(scope="module")
def golden():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def initialized():
    """initialize(preset) for every preset, computed once (coppelius takes seconds)."""
    return {name: reference.initialize(config) for name, config in reference.PRESETS.items()}


# ---------------------------------------------------------------- counts
@pytest.mark.parametrize("name,count", [("coppelius", 57_705_472), ("tiny", 1_067_264), ("test", 28_992)])
def test_parameter_counts(name, count):
    config = reference.preset(name)
    V, D, L, F = config.vocab, config.d_model, config.n_layer, config.d_ff
    assert V * D + L * (4 * D * D + 4 * D + 3 * F * D) + 2 * D == count  # the SPEC table is consistent
    assert parameter_count(config) == count
    assert reference.registry(config).total == count


def test_coppelius_payload_and_logits_row():
    config = reference.preset("coppelius")
    payload = 12 * parameter_count(config)  # P, M and V, float32 each
    assert payload == 692_465_664
    assert f"|payload={payload}" in schema_identity(config)
    assert 4 * config.vocab == 49_152  # one float32 logits row


# ---------------------------------------------------------------- the registry
@pytest.mark.parametrize("name", sorted(reference.PRESETS))
def test_registry_matches_the_spec_table(name):
    config = reference.preset(name)
    reg = reference.registry(config)
    table = table_of(config)
    assert [s.name for s in reg.specs] == [row[0] for row in table]
    offset = 0
    for k, (spec, (tname, shape, init, std)) in enumerate(zip(reg.specs, table)):
        assert (spec.shape, spec.init, spec.ordinal) == (shape, init, k), tname
        assert spec.std == std, tname  # sqrt(2L) in float64, bit for bit
        assert spec.offset == offset, f"{tname}: offset {spec.offset}, expected {offset} (contiguous)"
        assert spec.size == math.prod(shape) and spec.slice == slice(offset, offset + spec.size)
        offset += math.prod(shape)
    assert reg.total == offset
    assert reg.describe() == [{"name": n, "shape": list(s), "offset": o}
                              for (n, s, _, _), o in zip(table, [sp.offset for sp in reg.specs])]


@pytest.mark.parametrize("name", sorted(reference.PRESETS))
def test_decay_only_on_two_dimensional_parameters(name):
    config = reference.preset(name)
    reg = reference.registry(config)
    mask = reg.decay_mask()
    assert mask.shape == (reg.total,) and mask.dtype == bool
    for spec, (tname, shape, _, _) in zip(reg.specs, table_of(config)):
        want = len(shape) == 2  # the embedding and every Linear weight; no norm weight or bias
        assert spec.decay == want, tname
        assert mask[spec.slice].all() == want and mask[spec.slice].any() == want, tname


@pytest.mark.parametrize("name", sorted(reference.PRESETS))
def test_decay_ranges_are_the_mask(name):
    """The mask as sorted, disjoint, maximal runs: one per run of adjacent
    matrices (the embedding, then per layer q..o and gate..down)."""
    config = reference.preset(name)
    reg = reference.registry(config)
    ranges = reg.decay_ranges()
    assert ranges.dtype == np.int64 and ranges.shape == (2 * config.n_layer + 1, 2)
    mask = np.zeros(reg.total, dtype=bool)
    for start, end in ranges:
        assert not mask[start:end].any() and start < end
        mask[start:end] = True
    assert np.array_equal(mask, reg.decay_mask())
    assert (ranges[1:, 0] > ranges[:-1, 1]).all()  # sorted, and never two that touch


def test_lm_head_is_an_alias_of_the_embedding():
    config = reference.preset("test")
    reg = reference.registry(config)
    assert reg.aliases == {"lm_head.weight": "tok_embedding.weight"}
    assert "lm_head.weight" not in [s.name for s in reg.specs]  # no storage of its own
    assert reg["lm_head.weight"] is reg["tok_embedding.weight"]
    P = np.arange(reg.total, dtype=np.float32)
    views = reg.views(P)
    assert np.shares_memory(views["lm_head.weight"], views["tok_embedding.weight"])
    views["lm_head.weight"][3, 5] = -7.0  # a write through the alias is a write to the embedding
    assert P[3 * config.d_model + 5] == -7.0
    for spec in reg.specs:
        assert np.shares_memory(views[spec.name], P), spec.name
        assert views[spec.name].shape == spec.shape, spec.name
        assert views[spec.name].reshape(-1)[0] == spec.offset, spec.name


# ---------------------------------------------------------------- configuration validation
GOOD = dict(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96)


@pytest.mark.parametrize("field,value", [
    ("vocab", 0), ("context", -1), ("d_model", 0), ("n_layer", 0), ("n_head", -2), ("d_ff", 0),
    ("steps", 0), ("interval", -4),
    ("context", 16.0), ("d_model", "32"), ("n_layer", True), ("d_ff", None), ("vocab", 64.5),
])
def test_config_rejects_a_bad_field_and_names_it(field, value):
    with pytest.raises(ConfigError) as info:
        Config(**{**GOOD, field: value})
    message = str(info.value)
    assert field in message and "\n" not in message
    assert isinstance(info.value, CoppeliusError) and info.value.exit_status == 2


def test_config_rejects_d_model_not_divisible_by_n_head():
    with pytest.raises(ConfigError) as info:
        Config(**{**GOOD, "n_head": 3})  # 32 % 3 != 0
    assert "n_head" in str(info.value) and "d_model" in str(info.value)


def test_config_rejects_an_odd_head_dim():
    with pytest.raises(ConfigError) as info:
        Config(**{**GOOD, "d_model": 30, "n_head": 2})  # E = 15: rotary pairs need E even
    assert "n_head" in str(info.value) and "15" in str(info.value)


def test_presets_are_valid_and_unknown_preset_is_named():
    for config in reference.PRESETS.values():
        fields = {f: getattr(config, f) for f in (*GOOD, "steps", "interval")}
        assert Config(**fields) == config
    with pytest.raises(ConfigError, match="'huge'"):
        reference.preset("huge")


# ---------------------------------------------------------------- initialization
def test_golden_fixture_matches_the_pure_python_generator(golden):
    """The fixture and this file's generator agree: neither drifted."""
    assert golden["seed"] == SEED
    assert set(golden["presets"]) == set(reference.PRESETS)
    for name, config in reference.PRESETS.items():
        assert golden["presets"][name] == golden_of(config), name


def test_initialize_matches_the_golden_fixture(golden, initialized):
    for name, config in reference.PRESETS.items():
        reg = reference.registry(config)
        P = initialized[name]
        assert P.dtype == np.float32 and P.shape == (reg.total,)
        bits = P.view(np.uint32)
        for tensor, elements in golden["presets"][name].items():
            spec = reg.by_name[tensor]
            for i, want in elements.items():
                got = f"0x{int(bits[spec.offset + int(i)]):08x}"
                assert got == want, f"{name}: {tensor}[{i}] = {got}, golden {want}"


def test_initialize_matches_the_pure_python_generator_bit_for_bit(initialized):
    """Every element of the `test` preset, one at a time."""
    config = reference.preset("test")
    P = initialized["test"]
    for (name, shape, init, std), spec in zip(table_of(config), reference.registry(config).specs):
        got = P[spec.slice].view(np.uint32)
        if init == "normal":
            want = np.array([f32_bits(init_value(SEED, spec.ordinal, i, std))
                             for i in range(math.prod(shape))], dtype=np.uint32)
        else:
            want = np.full(math.prod(shape), f32_bits(1.0 if init == "ones" else 0.0), np.uint32)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{name}[{bad[:1]}]: {got[bad[:1]]} != {want[bad[:1]]} ({bad.size} differ)"


def test_ones_and_zeros_are_exact_and_normals_have_their_std(initialized):
    config = reference.preset("tiny")
    P = initialized["tiny"]
    for name, shape, init, std in table_of(config):
        x = P[reference.registry(config).by_name[name].slice]
        if init == "ones":
            assert (x.view(np.uint32) == 0x3F800000).all(), name
        elif init == "zeros":
            assert (x.view(np.uint32) == 0).all(), name  # +0.0, not -0.0
        else:
            # sample std within 5 standard errors (n >= 16384 here)
            n = x.size
            assert abs(float(x.astype(np.float64).std()) / std - 1) < 5 / math.sqrt(2 * n), name
            assert abs(float(x.astype(np.float64).mean())) < 5 * std / math.sqrt(n), name


def test_seed_changes_the_normal_values_only():
    config = reference.preset("test")
    reg = reference.registry(config)
    a, b = reference.initialize(config), reference.initialize(config, seed=SEED + 1)
    for spec in reg.specs:
        same = np.array_equal(a[spec.slice], b[spec.slice])
        assert same == (spec.init != "normal"), spec.name
    # the other seed follows the same formula
    spec = reg.by_name["layers.1.attn.o.weight"]
    assert f32_bits(init_value(SEED + 1, spec.ordinal, 7, spec.std)) == int(b[spec.offset + 7:].view(np.uint32)[0])


def test_initialize_is_deterministic():
    config = reference.preset("test")
    assert reference.initialize(config).tobytes() == reference.initialize(config).tobytes()
