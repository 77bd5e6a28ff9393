"""The parameter registry and the initialization generator (SPEC sections 1,
2, and the family's registry of section 21).

The expected names, shapes and counts are written out here from the SPEC
text, and the generator is re-implemented in pure Python (integers modulo
2^64, the math module, one element at a time), so neither is the
reference checked against itself. fixtures/init_golden.json keeps a few
generated values per preset: it catches drift of the reference and of this
file's generator alike. Regenerate it (only when SPEC section 2 changes or a
preset is added; the entries already there must not change) with
    COPPELIUS_REGEN_FIXTURES=1 python -m pytest tests/test_params.py
"""

import dataclasses
import json
import math
import os
import struct
from fractions import Fraction

import numpy as np
import pytest

from coppelius import reference
from coppelius.reference.config import (FAMILY_FIELDS, SEED, Config, parameter_count,
                                        schema_identity)
from coppelius.reference.errors import ConfigError, CoppeliusError

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fixtures", "init_golden.json")


# ---------------------------------------------------------------- SPEC sections 2 and 21, written out
def expected_table(V, D, L, F, norm="layernorm", kv=None, qkv_bias=False, tied=True):
    """[(name, shape, init, std)] in canonical order, from the SPEC 2 table
    and SPEC 21's changes to it: an rmsnorm has no bias; k and v are
    (kv, D) with kv = n_kv_head * E; q, k, v biases follow their weights;
    an untied model ends with lm_head.weight."""
    kv = D if kv is None else kv
    small = 0.02 / math.sqrt(2 * L)

    def norm_rows(name):
        rows = [(name + ".weight", (D,), "ones", 0.0)]
        return rows + ([(name + ".bias", (D,), "zeros", 0.0)] if norm == "layernorm" else [])

    def qkv_rows(name, width):
        rows = [(name + ".weight", (width, D), "normal", 0.02)]
        return rows + ([(name + ".bias", (width,), "zeros", 0.0)] if qkv_bias else [])

    rows = [("tok_embedding.weight", (V, D), "normal", 0.02)]
    for l in range(L):
        rows += norm_rows(f"layers.{l}.attn_norm")
        rows += qkv_rows(f"layers.{l}.attn.q", D) + qkv_rows(f"layers.{l}.attn.k", kv)
        rows += qkv_rows(f"layers.{l}.attn.v", kv)
        rows += [(f"layers.{l}.attn.o.weight", (D, D), "normal", small)]
        rows += norm_rows(f"layers.{l}.mlp_norm")
        rows += [
            (f"layers.{l}.mlp.gate.weight", (F, D), "normal", 0.02),
            (f"layers.{l}.mlp.up.weight", (F, D), "normal", 0.02),
            (f"layers.{l}.mlp.down.weight", (D, F), "normal", small),
        ]
    rows += norm_rows("final_norm")
    if not tied:
        rows += [("lm_head.weight", (V, D), "normal", 0.02)]
    return rows


# Each preset's model as SPEC 1 and 21 state it (shape, then the family's
# fields away from their defaults: kv = n_kv_head * E), not read from the Config.
SPEC_MODELS = {
    "coppelius": dict(V=12288, D=512, L=16, F=1408),
    "tiny": dict(V=2048, D=128, L=4, F=352),
    "test": dict(V=64, D=32, L=2, F=96),
    # test with norm=rmsnorm, n_kv_head=1 (of H = 2: kv = E = 16), tied=false
    "test-llama": dict(V=64, D=32, L=2, F=96, norm="rmsnorm", kv=16, tied=False),
    "test-qwen": dict(V=64, D=32, L=2, F=96, norm="rmsnorm", kv=16, tied=False, qkv_bias=True),
    # test with rotary=1/2 (no parameter of its own), tied=false, n_kv_head=1
    "test-stablelm": dict(V=64, D=32, L=2, F=96, kv=16, tied=False),
    # H = 12 (E = 64), n_kv_head = 4: kv = 256; rope_base 500000 has no parameter
    "llama-124m": dict(V=32768, D=768, L=12, F=2048, norm="rmsnorm", kv=256, tied=False),
}


def table_of(name):
    return expected_table(**SPEC_MODELS[name])


def test_every_preset_is_written_out_here():
    assert set(SPEC_MODELS) == set(reference.PRESETS)


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
# A family preset (SPEC 21) keeps the grouped k weight and the untied head too.
def golden_tensors(name):
    spec = SPEC_MODELS[name]
    L = spec["L"]
    names = ["tok_embedding.weight", "layers.0.attn.o.weight", f"layers.{L - 1}.mlp.down.weight"]
    if spec.get("kv") is not None:
        names.append("layers.0.attn.k.weight")
    if not spec.get("tied", True):
        names.append("lm_head.weight")  # the last ordinal
    return names


def golden_elements(size):
    return sorted({i for i in (0, 1, 2, 1000, size - 1) if i < size})


def golden_of(preset_name, seed=SEED):
    """{name: {element: float32 bits as hex}} from the pure-Python generator."""
    table = table_of(preset_name)
    out = {}
    for name in golden_tensors(preset_name):
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
           "presets": {name: golden_of(name) for name in SPEC_MODELS}}
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


# the family presets' counts by hand: V D embedding, per layer the norms'
# weights (and biases), q (D, D), k and v (kv, D), their biases, o, and the
# MLP; the final norm; V D of an untied head
@pytest.mark.parametrize("name,count", [
    ("test-llama", 64 * 32 + 2 * (2 * 32 + 32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 96 * 32) + 32
     + 64 * 32),  # 28,832
    ("test-qwen", 28_832 + 2 * (32 + 16 + 16)),  # 28,960
    ("test-stablelm", 64 * 32 + 2 * (4 * 32 + 32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 96 * 32)
     + 2 * 32 + 64 * 32),  # 28,992: the head's V D for the k, v rows grouping drops
    ("llama-124m", 2 * 32768 * 768 + 12 * (2 * 768 + 2 * 768 * 768 + 2 * 256 * 768
                                           + 3 * 2048 * 768) + 768),  # 125,848,320
])
def test_family_parameter_counts(name, count):
    config = reference.preset(name)
    assert sum(math.prod(shape) for _, shape, _, _ in table_of(name)) == count
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
    table = table_of(name)
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
    assert len(reg.specs) == len(table_of(name))
    for spec, (tname, shape, _, _) in zip(reg.specs, table_of(name)):
        want = len(shape) == 2  # the embedding and every Linear weight; no norm weight or bias
        assert spec.decay == want, tname
        assert mask[spec.slice].all() == want and mask[spec.slice].any() == want, tname


@pytest.mark.parametrize("name", sorted(reference.PRESETS))
def test_decay_ranges_are_the_mask(name):
    """The mask as sorted, disjoint, maximal runs: one per run of adjacent
    matrices (the embedding, then per layer q..o and gate..down; q, k, v and
    o each alone where biases sit between them; an untied head last), the
    runs of the SPEC table's matrices."""
    config = reference.preset(name)
    reg = reference.registry(config)
    ranges = reg.decay_ranges()
    want, offset = [], 0
    for _, shape, _, _ in table_of(name):
        size = math.prod(shape)
        if len(shape) == 2 and want and want[-1][1] == offset:
            want[-1][1] += size
        elif len(shape) == 2:
            want.append([offset, offset + size])
        offset += size
    assert ranges.dtype == np.int64 and ranges.tolist() == want
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


def test_an_untied_head_has_storage_of_its_own():
    """SPEC 21: tied=false gives lm_head.weight (V, D) after final_norm, the
    next ordinal, no alias; writing it leaves the embedding alone."""
    config = reference.preset("test-llama")
    reg = reference.registry(config)
    assert reg.aliases == {} and reg.specs[-1].name == "lm_head.weight"
    head, emb = reg["lm_head.weight"], reg["tok_embedding.weight"]
    assert head is not emb and head.ordinal == len(reg.specs) - 1
    assert head.offset == reg["final_norm.weight"].offset + config.d_model  # no final_norm.bias
    P = np.zeros(reg.total, dtype=np.float32)
    views = reg.views(P)
    assert not np.shares_memory(views["lm_head.weight"], views["tok_embedding.weight"])
    views["lm_head.weight"][3, 5] = -7.0
    assert P[head.offset + 3 * config.d_model + 5] == -7.0 and not views["tok_embedding.weight"].any()


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
        fields = {f: getattr(config, f) for f in (*GOOD, "steps", "interval", *FAMILY_FIELDS)}
        assert Config(**fields) == config
    with pytest.raises(ConfigError, match="'huge'"):
        reference.preset("huge")


# ---------------------------------------------------------------- initialization
def test_the_family_presets_are_the_ones_spec_21_names():
    test = reference.preset("test")
    llama = dataclasses.replace(test, norm="rmsnorm", n_kv_head=1, tied=False)
    assert reference.preset("test-llama") == llama
    assert reference.preset("test-qwen") == dataclasses.replace(llama, qkv_bias=True)
    assert reference.preset("test-stablelm") == dataclasses.replace(
        test, rotary=Fraction(1, 2), tied=False, n_kv_head=1)
    assert reference.preset("llama-124m") == Config(
        vocab=32768, context=1024, d_model=768, n_layer=12, n_head=12, d_ff=2048, steps=10000,
        interval=1000, norm="rmsnorm", n_kv_head=4, tied=False, rope_base=500000)


def test_golden_fixture_matches_the_pure_python_generator(golden):
    """The fixture and this file's generator agree: neither drifted."""
    assert golden["seed"] == SEED
    assert set(golden["presets"]) == set(reference.PRESETS)
    for name in reference.PRESETS:
        assert golden["presets"][name] == golden_of(name), name


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


@pytest.mark.parametrize("preset_name", ["test", "test-qwen", "test-stablelm"])
def test_initialize_matches_the_pure_python_generator_bit_for_bit(initialized, preset_name):
    """Every element of the `test` preset and of family presets (the biases'
    zeros, the grouped k and v, the untied head's ordinal), one at a time."""
    config = reference.preset(preset_name)
    P = initialized[preset_name]
    table = table_of(preset_name)
    assert len(table) == len(reference.registry(config).specs)
    for (name, shape, init, std), spec in zip(table, reference.registry(config).specs):
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
    for name, shape, init, std in table_of("tiny"):
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
