"""The model family's fields (SPEC 21) as configuration: validation, the
model identity they render, identities and model files read back, the
registry and the layouts derived from them, and the refusal of a backend
that does not compute a field (the reference computes all of them; the
refusal is checked with a smaller IMPLEMENTED)."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius.reference.config import (FAMILY_FIELDS, PRESETS, Config, check_implemented,
                                        config_from_identity, config_from_toml, parameter_count,
                                        tensor_count)
from coppelius.reference.errors import ConfigError
from coppelius.reference.layout import layout
from coppelius.reference.model import model_forward
from coppelius.reference.params import initialize, registry

TEST = PRESETS["test"]
SHAPE = dict(vocab=64, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96)


@st.composite
def family_configs(draw, qkv_bias=True):
    """A small model of any member of the family (SPEC 21)."""
    E = 2 * draw(st.integers(1, 4))  # even head dim
    H = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    R = 2 * draw(st.integers(1, E // 2))  # rotated elements, even
    return Config(vocab=draw(st.integers(2, 40)), context=draw(st.integers(1, 9)),
                  d_model=H * E, n_layer=draw(st.integers(0, 3)) or 1, n_head=H,
                  d_ff=draw(st.integers(1, 12)),
                  norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
                  norm_eps=draw(st.sampled_from([Fraction(1, 100000), Fraction(1, 1000000),
                                                 Fraction(3, 7)])),
                  n_kv_head=kv, tied=draw(st.booleans()),
                  rope_base=draw(st.sampled_from([Fraction(10000), Fraction(500000),
                                                  Fraction(10001, 2)])),
                  rotary=Fraction(R, E),
                  qkv_bias=draw(st.booleans()) if qkv_bias else False)


def test_the_defaults_render_exactly_the_version_2_identity():
    # the identity every version-2 checkpoint carries, written out by hand
    assert TEST.identity() == ("vocab=64|context=16|d_model=32|n_layer=2|n_head=2|d_ff=96"
                               "|norm=layernorm|eps=1/100000|rope_base=10000|tied=1")
    explicit = Config(**SHAPE, norm="layernorm", norm_eps="0.00001", n_kv_head=2, tied=True,
                      rope_base=10000, rotary=1, qkv_bias=False)
    assert explicit == Config(**SHAPE) and explicit.identity() == TEST.identity()
    assert Config(**SHAPE).non_default() == ()


def test_each_field_away_from_its_default_renders_as_spec_21_says():
    c = Config(**SHAPE, norm="rmsnorm", norm_eps="1e-6", n_kv_head=1, tied=False,
               rope_base=500000, rotary="1/2", qkv_bias=True)
    assert c.identity() == ("vocab=64|context=16|d_model=32|n_layer=2|n_head=2|d_ff=96"
                            "|norm=rmsnorm|eps=1/1000000|rope_base=500000|tied=0"
                            "|kv_heads=1|rotary=5/10|qkv_bias=1")
    assert c.non_default() == ("norm", "norm_eps", "n_kv_head", "tied", "rope_base",
                               "rotary", "qkv_bias")
    assert (c.kv_heads, c.kv_dim, c.rotary_dim, c.norm_bias) == (1, 16, 8, False)


@given(family_configs())
def test_every_member_reads_back_from_its_identity(config):
    assert config_from_identity(config.identity(), "ck.bin") == config


@pytest.mark.parametrize("fields, named", [
    (dict(norm="batchnorm"), "norm='batchnorm'"),
    (dict(n_kv_head=3), "n_kv_head=3"),
    (dict(n_kv_head=0), "n_kv_head=0"),
    (dict(n_kv_head=True), "n_kv_head=True"),
    (dict(tied="yes"), "tied='yes'"),
    (dict(qkv_bias=1), "qkv_bias=1"),
    (dict(norm_eps=0), "norm_eps"),
    (dict(norm_eps="-1/10"), "norm_eps"),
    (dict(norm_eps="1e-60"), "rounds to zero"),
    (dict(rope_base="x"), "rope_base"),
    (dict(rotary="3/2"), "rotary=15/10: must be in"),
    (dict(rotary="1/3"), "rotary=1/3: rotary \\* head dim"),  # R = 16/3
    (dict(rotary="1/16"), "rotary=625/10000"),  # R = 1: not even
])
def test_a_bad_family_field_is_refused_by_name(fields, named):
    with pytest.raises(ConfigError, match=named):
        Config(**SHAPE, **fields)


def test_grouping_follows_n_head_where_a_file_changes_it(tmp_path):
    # n_kv_head left at its default means "no grouping", whatever n_head becomes
    path = tmp_path / "m.toml"
    path.write_text("n_head = 4\n")
    config, _ = config_from_toml(str(path), TEST)
    assert config.kv_heads == 4 and config.identity() == TEST.identity().replace(
        "n_head=2", "n_head=4")


def test_a_model_file_sets_the_family_fields_exactly(tmp_path):
    path = tmp_path / "llama.toml"
    path.write_text('norm = "rmsnorm"\nnorm_eps = 1e-5\nn_kv_head = 1\ntied = false\n'
                    'rope_base = 500000\nrotary = "1/2"\nqkv_bias = true\n')
    config, _ = config_from_toml(str(path), TEST)
    assert config == Config(**SHAPE, steps=TEST.steps, interval=TEST.interval, norm="rmsnorm",
                            n_kv_head=1, tied=False, rope_base=500000, rotary=Fraction(1, 2),
                            qkv_bias=True)
    assert config.norm_eps == Fraction(1, 100000)  # the float's decimal text, exactly


@pytest.mark.parametrize("line, named", [
    ("norm = 1", "norm = 1: must be a string"),
    ("tied = 0", "tied = 0: must be true or false"),
    ("n_kv_head = 1.5", "n_kv_head = 1.5: must be an integer"),
    ("n_kv_head = 3", "n_kv_head=3: must be a positive integer dividing n_head=2"),
    ("rotary = true", "rotary = True: must be a number"),
    ("rope_base = \"ten\"", "rope_base='ten': not a number"),
])
def test_a_bad_family_key_in_a_model_file_names_the_file_and_key(tmp_path, line, named):
    path = tmp_path / "bad.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=f"model file {path}: .*{named}"):
        config_from_toml(str(path), TEST)


@given(family_configs())
def test_counts_from_the_config_equal_the_registry(config):
    reg = registry(config)
    assert parameter_count(config) == reg.total
    assert tensor_count(config) == len(reg.specs)


@given(family_configs())
def test_the_registry_follows_the_family(config):
    reg = registry(config)
    D, KV, V = config.d_model, config.kv_dim, config.vocab
    names = [s.name for s in reg]
    for l in range(config.n_layer):
        p = f"layers.{l}."
        assert reg[p + "attn.q.weight"].shape == (D, D)
        assert reg[p + "attn.k.weight"].shape == reg[p + "attn.v.weight"].shape == (KV, D)
        for norm in ("attn_norm", "mlp_norm"):
            assert (p + norm + ".bias" in names) == (config.norm == "layernorm")
        for part, width in (("q", D), ("k", KV), ("v", KV)):
            bias = p + f"attn.{part}.bias"
            assert (bias in names) == config.qkv_bias
            if config.qkv_bias:  # right after its weight, zeros, not decayed
                assert names.index(bias) == names.index(p + f"attn.{part}.weight") + 1
                assert reg[bias].shape == (width,) and reg[bias].init == "zeros"
                assert not reg[bias].decay
    if config.tied:
        assert "lm_head.weight" not in names and reg.aliases == {
            "lm_head.weight": "tok_embedding.weight"}
    else:  # the last parameter, the next ordinal (SPEC 21), normal(0, 0.02)
        head = reg.specs[-1]
        assert head.name == "lm_head.weight" and head.shape == (V, D)
        assert head.ordinal == len(names) - 1 and head.std == 0.02 and reg.aliases == {}
    assert [s.ordinal for s in reg] == list(range(len(names)))


@given(family_configs(qkv_bias=False))
def test_the_fused_layout_reads_the_registry_views(config):
    """The layout's offsets and columns, checked against the registry's own
    views of one P: the (q | k | v) matrix at `qkv` is the three weights
    stacked, and so on."""
    lay = layout(config)
    reg = registry(config)
    P = np.arange(reg.total, dtype=np.float64)
    w = reg.views(P)
    D, F = config.d_model, config.d_ff
    assert (lay.q.width, lay.k.width, lay.v.width) == (D, config.kv_dim, config.kv_dim)
    assert lay.qkv_width == D + 2 * config.kv_dim and lay.qk_width == D + config.kv_dim
    assert lay.gate_up_width == 2 * F and lay.rotary_dim == config.rotary_dim
    for l, o in enumerate(lay.layers):
        p = f"layers.{l}."
        qkv = P[o.qkv:o.qkv + lay.qkv_width * D].reshape(lay.qkv_width, D)
        for part, cols in (("q", lay.q), ("k", lay.k), ("v", lay.v)):
            np.testing.assert_array_equal(qkv[cols.start:cols.stop], w[p + f"attn.{part}.weight"])
        gu = P[o.gate_up:o.gate_up + 2 * F * D].reshape(2 * F, D)
        np.testing.assert_array_equal(gu[lay.gate.start:lay.gate.stop], w[p + "mlp.gate.weight"])
        np.testing.assert_array_equal(gu[lay.up.start:lay.up.stop], w[p + "mlp.up.weight"])
        for norm, at in (("attn_norm", o.attn_norm), ("mlp_norm", o.mlp_norm)):
            np.testing.assert_array_equal(P[at:at + D], w[p + norm + ".weight"])
            if lay.norm_bias:
                np.testing.assert_array_equal(P[at + D:at + 2 * D], w[p + norm + ".bias"])
        np.testing.assert_array_equal(P[o.o:o.o + D * D], w[p + "attn.o.weight"].ravel())
        np.testing.assert_array_equal(P[o.down:o.down + D * F], w[p + "mlp.down.weight"].ravel())
    np.testing.assert_array_equal(P[lay.final_norm:lay.final_norm + D], w["final_norm.weight"])


def test_a_bias_between_fused_weights_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.k\.weight: at offset"):
        layout(Config(**SHAPE, qkv_bias=True))


# each field away from its default, and how a refusal shows its value
FIELD_VALUES = [(dict(norm="rmsnorm"), "norm='rmsnorm'"), (dict(n_kv_head=1), "n_kv_head=1"),
                (dict(tied=False), "tied=False"), (dict(rotary="1/2"), "rotary=5/10"),
                (dict(qkv_bias=True), "qkv_bias=True"), (dict(norm_eps="1e-6"), "norm_eps=1/1000000"),
                (dict(rope_base=500000), "rope_base=500000")]


def test_the_reference_computes_every_field():
    from coppelius.reference import model, program

    assert set(model.IMPLEMENTED) == set(FAMILY_FIELDS) == set(program.IMPLEMENTED)


@pytest.mark.parametrize("fields, shown", FIELD_VALUES)
def test_a_field_a_backend_does_not_compute_is_refused_by_name(fields, shown, monkeypatch):
    """check_implemented refuses, naming the field and its value, a field
    missing from what a backend declares; the reference's forward refuses
    through its own IMPLEMENTED, here monkeypatched without the field."""
    from coppelius.reference import model

    config = Config(**SHAPE, **fields)
    name = next(iter(fields))
    others = tuple(f for f in FAMILY_FIELDS if f != name)
    with pytest.raises(ConfigError) as info:
        check_implemented(config, others, "a backend")
    assert str(info.value) == (f"a backend: config field {shown} (SPEC 21) is not implemented "
                               f"here yet")
    check_implemented(config, (name,), "a backend that computes it")  # no refusal
    check_implemented(Config(**SHAPE), (), "a backend of the defaults alone")
    tokens = np.zeros((1, 4), np.int64)
    assert np.isfinite(model_forward(config, initialize(config), tokens, "fp32")[0]).all()
    monkeypatch.setattr(model, "IMPLEMENTED", others)
    with pytest.raises(ConfigError, match=f"reference: config field {shown} .*not implemented"):
        model_forward(config, initialize(config), tokens, "fp32")
    model_forward(TEST, initialize(TEST), tokens, "fp32")  # the defaults: refused by no one


def test_a_refusal_names_the_first_field_in_spec_21s_order():
    config = PRESETS["test-qwen"]  # norm, n_kv_head, tied, qkv_bias away from their defaults
    with pytest.raises(ConfigError, match="b: config field n_kv_head=1 "):
        check_implemented(config, ("norm",), "b")
    with pytest.raises(ConfigError, match="b: config field qkv_bias=True "):
        check_implemented(config, ("norm", "n_kv_head", "tied"), "b")


def test_norm_eps_and_rope_base_reach_the_forward():
    tokens = np.arange(8).reshape(1, 8) % TEST.vocab
    P = initialize(TEST)

    def logits(**fields):
        return model_forward(Config(**SHAPE, **fields), P, tokens, "fp32")[0]

    base = logits()
    np.testing.assert_array_equal(logits(norm_eps="1/100000", rope_base=10000), base)
    for fields in (dict(norm_eps="1/10"), dict(rope_base=500000)):
        assert np.abs(logits(**fields) - base).max() > 1e-4, fields
    # position 0 is not rotated (theta = 0): its logits do not see the rope base
    np.testing.assert_array_equal(logits(rope_base=500000)[:, 0], base[:, 0])


@pytest.mark.mlx
def test_norm_eps_and_rope_base_flow_through_mlx():
    # the CUDA backend's: tests/cuda/test_program.py
    from tests.support import check_family_fields_reach_the_step

    check_family_fields_reach_the_step("mlx")


def test_a_hugging_face_export_of_a_member_it_cannot_write_is_refused(tmp_path):
    """SPEC 21: RMSNorm with partial rotary is no transformers architecture
    (Llama and Qwen2 rotate the whole head): refused by name, nothing written."""
    from coppelius.exchange import export
    from coppelius.hf import HfError
    from coppelius.reference import checkpoint
    from coppelius.reference.config import Hyper
    from coppelius.reference.state import State

    config = Config(**SHAPE, norm="rmsnorm", rotary="1/2")
    path = str(tmp_path / "ck.bin")
    ids = checkpoint.identities(config, Hyper(), "fp32", 1, None, "0" * 64)
    checkpoint.write_checkpoint(path, config, ids, State.fresh(initialize(config)), 0)
    with pytest.raises(HfError, match=r"config field rotary=5/10: an rmsnorm model is"):
        export(path, str(tmp_path / "hf"), fmt="hf", no_tokenizer=True)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("how, shown", [
    (["--preset", "test", "--model", "m.toml"], "norm='rmsnorm'"),
    (["--preset", "test-stablelm"], "rotary=5/10"),
])
def test_a_run_of_a_field_the_backend_does_not_compute_writes_nothing(tmp_path, capsys,
                                                                       monkeypatch, how, shown):
    """`coppelius train` asks the backend's module what it computes (its
    IMPLEMENTED) and refuses before it writes anything: one line, status 2.
    The reference computes every field, so it is given a smaller IMPLEMENTED."""
    from coppelius.cli import main
    from coppelius.reference import program

    monkeypatch.setattr(program, "IMPLEMENTED", ("norm_eps", "rope_base", "n_kv_head", "tied"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.toml").write_text('vocab = 300\nnorm = "rmsnorm"\n')
    status = main(["train", *how, "--backend", "reference", "--steps", "2", "--no-sample",
                   "--run-dir", str(tmp_path / "R")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert f"reference: config field {shown} (SPEC 21) is not implemented" in err[0]
    assert not (tmp_path / "R").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.toml"]  # nothing written anywhere
