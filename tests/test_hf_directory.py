"""`coppelius export --format hf`, `import DIR` and `inspect DIR` without
transformers: the directory's files, the round trip, publication and every
refusal. tests/test_hf.py loads the same directories with transformers."""

import glob
import json
import os
import sysconfig
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from coppelius import hf
from coppelius.cli import main
from coppelius.tokenizer import train_tokenizer, tokenizer_sha
from coppelius.reference import Config, State, initialize, preset, registry, round_bf16
from coppelius.reference import fsutil
from coppelius.reference.binding import load_state
from coppelius.reference.checkpoint import IDENTITY_KEYS, identities, write_checkpoint
from coppelius.reference.config import Hyper, data_identity, initialization_identity

# The test preset's shape with a vocabulary a byte-level BPE can have (V >= 256)
SMALL = Config(vocab=320, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96)


def stdlib_text(*packages) -> str:
    """Real text: the standard library's modules of `packages`, concatenated."""
    root = sysconfig.get_paths()["stdlib"]
    files = [f for p in packages for f in sorted(glob.glob(os.path.join(root, p, "*.py")))]
    return "".join(open(f, encoding="utf-8").read() for f in files)


def trained_like(config, seed=0) -> np.ndarray:
    """Parameters P (N,) float32 that look trained rather than initialized:
    matrices with unit-gain fan-in scaling (so attention is peaked and the
    MLP nonlinear), norms far from ones and zeros, an embedding whose logits
    span tens of nats."""
    rng = np.random.default_rng(seed)
    P = initialize(config)
    for spec in registry(config):
        if spec.init == "ones":
            values = 1 + rng.normal(0, 0.3, spec.size)
        elif spec.init == "zeros":
            values = rng.normal(0, 0.3, spec.size)
        elif spec.name == "tok_embedding.weight":
            values = rng.normal(0, 0.5, spec.size)
        else:
            values = rng.normal(0, 1.2 / np.sqrt(spec.shape[1]), spec.size)
        P[spec.slice] = values.astype(np.float32)
    return P


def make_run(directory, config=SMALL, tokenizer_text=None, seed=0):
    """A run directory: checkpoint.bin (trained-like P, random moments, step
    7) whose data identity names the tokenizer.json beside it (or none)."""
    os.makedirs(directory, exist_ok=True)
    sha = None
    if tokenizer_text is not None:
        tok = train_tokenizer([tokenizer_text], config.vocab)
        tok.save(os.path.join(directory, "tokenizer.json"))
        sha = tokenizer_sha(os.path.join(directory, "tokenizer.json"))
    ids = identities(config, Hyper(lr="1/1000"), "fp32", 2, sha, "d" * 64)
    rng = np.random.default_rng(seed + 1)
    P = trained_like(config, seed)
    state = State(P, rng.standard_normal(P.shape).astype(np.float32),
                  rng.random(P.shape).astype(np.float32), t=7)
    path = os.path.join(directory, "checkpoint.bin")
    write_checkpoint(path, config, ids, state, contexts=14)
    return path, state, ids


@pytest.fixture(scope="module")
def text():
    return stdlib_text("json")


@pytest.fixture
def run(tmp_path, text):
    return make_run(tmp_path / "run", tokenizer_text=text)


def cli(capsys, *argv):
    """(exit status, stdout, stderr) of `coppelius argv...`."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def refused(capsys, command, *argv, words=()):
    status, _, err = cli(capsys, command, *argv)
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"coppelius {command}: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def export_dir(capsys, checkpoint, out, *options):
    status, _, err = cli(capsys, "export", checkpoint, out, "--format", "hf", *options)
    assert status == 0, err
    return out


# ------------------------------------------------------------------ the directory

def test_names_are_spec_20s():
    names = hf.hf_names(preset("test"))
    assert names["tok_embedding.weight"] == "model.embed_tokens.weight"
    assert names["layers.1.attn_norm.bias"] == "model.layers.1.input_layernorm.bias"
    assert names["layers.0.attn.k.weight"] == "model.layers.0.self_attn.k_proj.weight"
    assert names["layers.1.mlp_norm.weight"] == "model.layers.1.post_attention_layernorm.weight"
    assert names["layers.0.mlp.down.weight"] == "model.layers.0.mlp.down_proj.weight"
    assert names["final_norm.bias"] == "model.norm.bias"
    assert names["lm_head.weight"] == "lm_head.weight"
    assert len(set(names.values())) == len(names) == len(registry(preset("test")).specs) + 1


def test_export_writes_the_directory(run, tmp_path, capsys):
    checkpoint, state, ids = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config == hf.config_json(SMALL, "float32")
    assert hf.model_of(config, "config.json") == SMALL
    for key, value in {"model_type": "stablelm", "architectures": ["StableLmForCausalLM"],
                       "vocab_size": 320, "hidden_size": 32, "intermediate_size": 96,
                       "num_hidden_layers": 2, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "partial_rotary_factor": 1.0,
                       "rope_theta": 10000, "layer_norm_eps": 1e-5,
                       "max_position_embeddings": 16, "tie_word_embeddings": True,
                       "use_qkv_bias": False, "qk_layernorm": False,
                       "use_parallel_residual": False, "hidden_act": "silu",
                       "torch_dtype": "float32"}.items():
        assert config[key] == value, key  # SPEC 20's list
    tensors = load_file(str(out / "model.safetensors"))
    names = hf.hf_names(SMALL)
    reg = registry(SMALL)
    assert set(tensors) == {names[s.name] for s in reg.specs}  # no lm_head.weight: tied
    for spec in reg.specs:
        a = tensors[names[spec.name]]
        assert a.dtype == np.float32 and a.shape == spec.shape, spec.name
        assert a.tobytes() == state.P[spec.slice].tobytes(), spec.name
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        meta = f.metadata()
    assert meta == {"format": "pt", "step": "7", "contexts": "14",
                    **{key: str(ids[key]) for key in IDENTITY_KEYS}}
    # the run's tokenizer byte for byte: its SHA-256 is the one the data identity names
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "run" / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "model_max_length": 16}
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] is None and generation["top_k"] == 40


def test_export_bfloat16_rounds_to_nearest_even(run, tmp_path, capsys):
    checkpoint, state, _ = run
    # exact ties, so that round-half-even is what is tested
    P = state.P.copy()
    P[:4] = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e38], np.float32)
    P[4:8] = (np.array([1, 3, 5, 7], np.float32) * 2**-8 + 1).astype(np.float32)
    state = State(P, state.M, state.V, state.t)
    _, _, ids = run
    write_checkpoint(checkpoint, SMALL, ids, state, contexts=14)
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--dtype", "bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_file(str(out / "model.safetensors"))
    names = hf.hf_names(SMALL)
    for spec in registry(SMALL).specs:
        a = tensors[names[spec.name]]
        assert a.dtype == ml_dtypes.bfloat16, spec.name
        assert np.array_equal(a.astype(np.float32).reshape(-1), round_bf16(P[spec.slice]))
    emb = tensors["model.embed_tokens.weight"].astype(np.float32).reshape(-1)
    assert list(emb[:4]) == [1.0, 1 + 2**-6, -1.0, np.float32(round_bf16(np.float32(3.0e38)))]
    size = os.path.getsize(out / "model.safetensors")
    assert size < 0.55 * 4 * registry(SMALL).total
    # the safetensors format takes --dtype too
    path = tmp_path / "half.safetensors"
    assert cli(capsys, "export", checkpoint, path, "--dtype", "bfloat16")[0] == 0
    half = load_file(str(path))
    assert np.array_equal(half["tok_embedding.weight"], tensors["model.embed_tokens.weight"])


def test_export_bfloat16_refuses_a_value_beyond_its_range(run, tmp_path, capsys):
    checkpoint, state, ids = run
    P = state.P.copy()
    spec = registry(SMALL)["layers.1.mlp.up.weight"]
    P[spec.offset + 5] = np.finfo(np.float32).max
    write_checkpoint(checkpoint, SMALL, ids, State(P, state.M, state.V, 7), contexts=14)
    refused(capsys, "export", checkpoint, tmp_path / "hf", "--format", "hf", "--dtype", "bfloat16",
            words=["layers.1.mlp.up.weight", "[0, 5]", "bfloat16"])
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------ round trip

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_keeps_the_parameters_and_identities(run, tmp_path, capsys, dtype):
    checkpoint, state, ids = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--dtype", dtype)
    back = tmp_path / "back.ckpt"
    status, stdout, _ = cli(capsys, "import", out, back)
    assert status == 0 and "step 0" in stdout
    got = load_state(back, SMALL, expect=ids)  # every identity carried over
    P = state.P if dtype == "float32" else round_bf16(state.P)
    assert got.state.P.tobytes() == P.tobytes()
    assert not got.state.M.any() and not got.state.V.any()  # fresh moments, as for safetensors
    assert (got.step, got.contexts) == (0, 0)
    # and a float32 round trip's checkpoint exports to the same directory again
    if dtype == "float32":
        again = export_dir(capsys, back, tmp_path / "again", "--tokenizer", out / "tokenizer.json")
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (again / name).read_bytes() == (out / name).read_bytes()
        a, b = load_file(str(again / "model.safetensors")), load_file(str(out / "model.safetensors"))
        assert all(a[key].tobytes() == b[key].tobytes() for key in b)


def test_import_without_metadata_takes_the_directory_tokenizer(run, tmp_path, capsys):
    checkpoint, state, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    tensors = load_file(str(out / "model.safetensors"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    back = tmp_path / "back.ckpt"
    assert cli(capsys, "import", out, back)[0] == 0
    got = load_state(back, SMALL)
    assert got.state.P.tobytes() == state.P.tobytes()
    sha = tokenizer_sha(out / "tokenizer.json")
    assert got.header["data"] == data_identity(SMALL, 1, sha, "none")
    assert got.header["learner"] == Hyper().identity("fp32")
    assert got.header["initialization"] == initialization_identity()


def test_import_accepts_a_stored_tied_head_equal_to_the_embedding(run, tmp_path, capsys):
    checkpoint, state, ids = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert cli(capsys, "import", out, tmp_path / "back.ckpt")[0] == 0
    assert load_state(tmp_path / "back.ckpt", SMALL).state.P.tobytes() == state.P.tobytes()


# ------------------------------------------------------------------ the tokenizer

def test_export_finds_the_tokenizer_in_the_stream_cache(tmp_path, text, capsys, monkeypatch):
    checkpoint, _, _ = make_run(tmp_path / "runs" / "small", tokenizer_text=text)
    cache = tmp_path / "runs" / "data" / "stream-v320"  # the cache beside the runs (older layout)
    cache.mkdir(parents=True)
    os.replace(tmp_path / "runs" / "small" / "tokenizer.json", cache / "tokenizer.json")
    monkeypatch.chdir(tmp_path / "runs" / "small")  # so the default cache is elsewhere
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    assert (out / "tokenizer.json").read_bytes() == (cache / "tokenizer.json").read_bytes()


def test_export_refuses_when_the_tokenizer_is_missing(run, tmp_path, capsys, monkeypatch):
    checkpoint, _, ids = run
    moved = tmp_path / "elsewhere.json"
    os.replace(tmp_path / "run" / "tokenizer.json", moved)
    monkeypatch.chdir(tmp_path)
    sha = ids["data"].split("tokenizer=")[1].split("|")[0]
    refused(capsys, "export", checkpoint, tmp_path / "hf", "--format", "hf",
            words=[sha, "--tokenizer"])
    assert not (tmp_path / "hf").exists()
    export_dir(capsys, checkpoint, tmp_path / "hf", "--tokenizer", moved)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == moved.read_bytes()


def test_export_refuses_another_tokenizer(run, tmp_path, capsys):
    checkpoint, _, _ = run
    other = tmp_path / "other.json"
    train_tokenizer([stdlib_text("email")], SMALL.vocab).save(str(other))
    refused(capsys, "export", checkpoint, tmp_path / "hf", "--format", "hf", "--tokenizer", other,
            words=["other.json", "SHA-256", "tokenizer="])
    assert not (tmp_path / "hf").exists()


def test_export_of_a_run_without_a_tokenizer(tmp_path, text, capsys):
    checkpoint, state, _ = make_run(tmp_path / "run")  # tokenizer=none
    refused(capsys, "export", checkpoint, tmp_path / "hf", "--format", "hf",
            words=["tokenizer=none", "--tokenizer", "--no-tokenizer"])
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--no-tokenizer")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    # any tokenizer of V ids may be given to a run that names none, and one of other V may not
    given = tmp_path / "given.json"
    train_tokenizer([text], SMALL.vocab).save(str(given))
    export_dir(capsys, checkpoint, tmp_path / "hf2", "--tokenizer", given)
    train_tokenizer([text], 400).save(str(given))
    refused(capsys, "export", checkpoint, tmp_path / "hf3", "--format", "hf", "--tokenizer", given,
            words=["given.json", "400 ids", "V=320"])


@pytest.mark.parametrize("options, words", [
    (["--format", "hf", "--moments"], ["--moments"]),
    (["--moments", "--dtype", "bfloat16"], ["--moments", "float32"]),
    (["--tokenizer", "tokenizer.json"], ["--tokenizer", "--format hf"]),
    (["--no-tokenizer"], ["--no-tokenizer", "--format hf"]),
])
def test_export_refuses_options_that_do_not_go_together(run, tmp_path, capsys, options, words):
    checkpoint, _, _ = run
    refused(capsys, "export", checkpoint, tmp_path / "out", *options, words=words)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ publication

def test_export_takes_an_empty_directory_and_refuses_a_full_one(run, tmp_path, capsys):
    checkpoint, _, _ = run
    out = tmp_path / "hf"
    out.mkdir()
    export_dir(capsys, checkpoint, out)
    refused(capsys, "export", checkpoint, out, "--format", "hf", words=[str(out), "--force"])
    (tmp_path / "file").write_bytes(b"x")
    refused(capsys, "export", checkpoint, tmp_path / "file", "--format", "hf",
            words=["not a directory"])
    os.symlink(out, tmp_path / "link")
    refused(capsys, "export", checkpoint, tmp_path / "link", "--format", "hf", "--force",
            words=["symbolic link"])
    refused(capsys, "export", checkpoint, f"{tmp_path / 'link'}/", "--format", "hf", "--force",
            words=["symbolic link"])


def test_force_replaces_a_previous_export_only(run, tmp_path, capsys):
    checkpoint, state, ids = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--dtype", "bfloat16")
    export_dir(capsys, checkpoint, out, "--force")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]  # nothing left beside it
    # a directory holding anything an export does not write is never replaced
    (out / "notes.txt").write_text("mine")
    refused(capsys, "export", checkpoint, out, "--format", "hf", "--force",
            words=["notes.txt", "previous export"])
    assert (out / "notes.txt").read_text() == "mine"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text("{}")
    refused(capsys, "export", checkpoint, mine, "--format", "hf", "--force",
            words=["config.json", "previous export"])


@pytest.mark.parametrize("force", [False, True])
def test_export_publication_is_atomic(run, tmp_path, capsys, monkeypatch, force):
    checkpoint, _, _ = run
    out = tmp_path / "hf"
    if force:
        export_dir(capsys, checkpoint, out, "--dtype", "bfloat16")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)} if force else None
    written = []

    def disk_full(phase):
        if phase == "written":
            written.append(phase)
            if len(written) == 3:  # the third file of the directory
                raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsutil, "_hook", disk_full)
    argv = ["--force"] if force else []
    refused(capsys, "export", checkpoint, out, "--format", "hf", *argv,
            words=["No space left"])
    assert sorted(os.listdir(tmp_path)) == (["hf", "run"] if force else ["run"])
    if force:
        assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_force_replacement_puts_the_old_export_back_when_the_rename_fails(run, tmp_path, capsys,
                                                                          monkeypatch):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--dtype", "bfloat16")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    real = os.replace

    def failing(src, dst):
        if str(src).endswith(".tmp") and os.path.isdir(src):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(hf.os, "replace", failing)
    refused(capsys, "export", checkpoint, out, "--format", "hf", "--force",
            words=["Input/output error"])
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


# ------------------------------------------------------------------ import refusals

def edit_config(directory, change):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def set_key(key, value):
    return lambda c: c.update({key: value})


def drop_key(key):
    return lambda c: c.pop(key)


def rope_parameters(**values):
    def change(c):
        c.pop("rope_theta")
        c.pop("partial_rotary_factor", None)  # StableLM's only
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 1.0, **values}
    return change


@pytest.mark.parametrize("change, words", [
    (set_key("model_type", "gpt2"), ["model_type", '"gpt2"', "stablelm", "llama", "qwen2"]),
    (set_key("model_type", "llama"), ["architectures", "StableLmForCausalLM", "LlamaForCausalLM"]),
    (set_key("architectures", ["LlamaForCausalLM"]), ["architectures", "LlamaForCausalLM"]),
    (rope_parameters(rope_type="linear", factor=2.0), ["rope_type", "linear"]),
    (rope_parameters(factor=2.0), ["rope_parameters.factor", "2.0"]),
    (set_key("rope_parameters", {"rope_theta": 500000.0}),  # beside rope_theta 10000.0
     ["rope_theta", "10000.0", "rope_parameters.rope_theta", "500000.0"]),
    (set_key("rope_scaling", {"type": "linear", "factor": 2.0}), ["rope_scaling"]),
    (drop_key("partial_rotary_factor"), ["partial_rotary_factor", "missing"]),
    (drop_key("tie_word_embeddings"), ["tie_word_embeddings", "missing"]),
    (drop_key("num_key_value_heads"), ["num_key_value_heads", "missing"]),
    (drop_key("use_qkv_bias"), ["use_qkv_bias", "missing"]),
    (drop_key("layer_norm_eps"), ["layer_norm_eps", "missing"]),
    (drop_key("max_position_embeddings"), ["max_position_embeddings", "missing"]),
    (set_key("num_key_value_heads", None), ["num_key_value_heads", "null"]),
    (set_key("qk_layernorm", True), ["qk_layernorm", "true"]),
    (set_key("use_parallel_residual", True), ["use_parallel_residual", "true"]),
    (set_key("hidden_act", "gelu"), ["hidden_act", "gelu", "silu"]),
    (set_key("head_dim", 8), ["head_dim", "8", "16"]),
    (set_key("num_key_value_heads", 3), ["num_key_value_heads", "3", "dividing n_head=2"]),
    (set_key("partial_rotary_factor", 0.3), ["partial_rotary_factor", "0.3", "even integer"]),
    (set_key("partial_rotary_factor", 1.5), ["partial_rotary_factor", "1.5", "(0, 1]"]),
    (set_key("layer_norm_eps", -1e-5), ["layer_norm_eps", "-1e-05", "positive number"]),
    (set_key("rope_theta", "10000"), ["rope_theta", '"10000"', "positive number"]),
    (set_key("tie_word_embeddings", 1), ["tie_word_embeddings", "1", "true or false"]),
    (set_key("hidden_size", 30), ["not a shape", "n_head"]),
    (set_key("vocab_size", "320"), ["vocab_size", '"320"', "positive integer"]),
    (set_key("num_hidden_layers", True), ["num_hidden_layers", "true"]),
    (set_key("sliding_window", 4096), ["sliding_window", "not a field", "StableLmForCausalLM"]),
    (set_key("some_new_field", 1), ["some_new_field", "not a field"]),
    (set_key("num_experts", 8), ["num_experts", "mixture-of-experts"]),
    (set_key("num_local_experts", 8), ["num_local_experts", "mixture-of-experts"]),
    # a member of the family, but not the one the metadata names: config.json and
    # the tensors' metadata must describe one model
    (set_key("partial_rotary_factor", 0.25), ["metadata model", "config.json", "rotary=25/100"]),
    (set_key("num_key_value_heads", 1), ["metadata model", "config.json", "kv_heads=1"]),
    (set_key("tie_word_embeddings", False), ["metadata model", "config.json", "tied=0"]),
    (set_key("use_qkv_bias", True), ["metadata model", "config.json", "qkv_bias=1"]),
    (set_key("layer_norm_eps", 1e-6), ["metadata model", "config.json", "eps=1/1000000"]),
    (set_key("rope_theta", 500000.0), ["metadata model", "config.json", "rope_base=500000"]),
    (rope_parameters(rope_theta=500000.0), ["metadata model", "rope_base=500000"]),
    (set_key("intermediate_size", 64), ["metadata model", "config.json", "d_ff=64"]),
    (set_key("vocab_size", 400), ["metadata model", "config.json", "vocab=400"]),
])
def test_import_refuses_a_config_of_another_model(run, tmp_path, capsys, change, words):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    edit_config(out, change)
    dst = tmp_path / "back.ckpt"
    refused(capsys, "import", out, dst, words=words)
    assert not dst.exists()
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]


def test_import_refuses_a_tokenizer_with_more_ids_than_the_model(run, tmp_path, capsys, text):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--no-tokenizer")
    train_tokenizer([text], 400).save(str(out / "tokenizer.json"))
    refused(capsys, "import", out, tmp_path / "back.ckpt",
            words=["tokenizer.json", "400 ids", "V=320"])


def edit_tensors(directory, change, metadata=True):
    path = str(directory / "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata=meta if metadata else {"format": "pt"})


@pytest.mark.parametrize("change, words", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     ["model.layers.1.mlp.up_proj.weight", "missing tensor"]),
    (lambda t: t.pop("model.norm.bias"), ["model.norm.bias", "missing tensor"]),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": np.zeros((16, 64), np.float32)}),
     ["model.layers.0.self_attn.o_proj.weight", "shape", "[16, 64]"]),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": np.zeros((32, 95), np.float32)}),
     ["model.layers.0.mlp.down_proj.weight", "bytes"]),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
     ["model.layers.0.self_attn.q_proj.bias", "unexpected tensor"]),
    (lambda t: t.update({"model.layers.2.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)}),
     ["model.layers.2.self_attn.q_proj.weight", "unexpected tensor"]),
    (lambda t: t.update({"lm_head.weight": np.ones((320, 32), np.float32)}),
     ["lm_head.weight", "model.embed_tokens.weight", "ties"]),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float64)}),
     ["model.norm.weight", "bytes"]),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int32)}),
     ["model.norm.weight", "int32"]),
    (lambda t: t["model.layers.1.self_attn.v_proj.weight"].__setitem__((3, 4), np.nan),
     ["model.layers.1.self_attn.v_proj.weight", "non-finite", "[3, 4]"]),
])
def test_import_refuses_tensors_not_of_the_model(run, tmp_path, capsys, change, words):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    edit_tensors(out, change)
    dst = tmp_path / "back.ckpt"
    refused(capsys, "import", out, dst, words=words)
    assert not dst.exists()


def test_import_refuses_a_config_of_another_size_than_the_tensors(run, tmp_path, capsys):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    edit_tensors(out, lambda t: None, metadata=False)  # no model identity to compare with
    edit_config(out, set_key("intermediate_size", 64))
    refused(capsys, "import", out, tmp_path / "back.ckpt",
            words=["model.layers.0.mlp.gate_proj.weight", "bytes"])
    assert not (tmp_path / "back.ckpt").exists()


def listed(stdout) -> dict:
    """{tensor: (dtype, shape text)} of inspect's tensor table."""
    rows = [line.split(None, 2) for line in stdout.splitlines() if line.startswith("  ")]
    return {name: (dtype, shape) for name, dtype, shape in rows}


def test_import_refuses_directories_it_cannot_read(run, tmp_path, capsys):
    checkpoint, _, _ = run
    dst = tmp_path / "back.ckpt"
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(capsys, "import", empty, dst, words=["no config.json"])
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    weights = (out / "model.safetensors").read_bytes()
    os.unlink(out / "model.safetensors")
    refused(capsys, "import", out, dst, words=["no model.safetensors"])
    (out / "model.safetensors.index.json").write_text("{}")
    refused(capsys, "import", out, dst, words=["model.safetensors.index.json", "weight_map"])
    os.unlink(out / "model.safetensors.index.json")
    (out / "pytorch_model.bin").write_bytes(b"\x80\x04")
    refused(capsys, "import", out, dst, words=["pytorch_model.bin", "pickle"])
    os.mkfifo(out / "model.safetensors")
    refused(capsys, "import", out, dst, words=["model.safetensors", "not a regular file"])
    os.unlink(out / "model.safetensors")
    (out / "model.safetensors").write_bytes(weights)
    (out / "config.json").write_text("{not json")
    refused(capsys, "import", out, dst, words=["config.json", "JSON"])
    (out / "config.json").write_text("[]")
    refused(capsys, "import", out, dst, words=["config.json", "not an object"])
    os.unlink(out / "config.json")
    os.mkfifo(out / "config.json")  # would block a reader that opened it
    refused(capsys, "import", out, dst, words=["config.json", "not a regular file"])
    os.unlink(out / "config.json")
    (out / "config.json").write_text(json.dumps(hf.config_json(SMALL, "float32")))
    (out / "tokenizer.json").write_text("{}")
    refused(capsys, "import", out, dst, words=["tokenizer.json", "cannot load"])
    assert not dst.exists()


def test_import_refuses_metadata_of_another_model_than_the_config(run, tmp_path, capsys):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    tiny = preset("tiny").identity()
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        meta = f.metadata()
    save_file(load_file(str(out / "model.safetensors")), str(out / "model.safetensors"),
              metadata={**meta, "model": tiny})
    refused(capsys, "import", out, tmp_path / "back.ckpt", words=["metadata model", "config.json"])
    refused(capsys, "import", out, tmp_path / "back.ckpt", "--preset", "test",
            words=["metadata model"])


def test_import_refuses_a_preset_that_is_not_the_directory_model(run, tmp_path, capsys):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    refused(capsys, "import", out, tmp_path / "back.ckpt", "--preset", "test",
            words=["vocab=320", "preset test"])


def test_import_of_a_lone_transformers_file_says_to_import_its_directory(run, tmp_path, capsys):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    refused(capsys, "import", out / "model.safetensors", tmp_path / "back.ckpt",
            words=["transformers' names", "directory"])


# ------------------------------------------------------------------ inspect

def test_inspect_describes_an_exported_directory(run, tmp_path, capsys):
    checkpoint, _, ids = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--dtype", "bfloat16")
    status, stdout, err = cli(capsys, "inspect", out)
    assert status == 0, err
    assert "StableLmForCausalLM" in stdout and SMALL.identity() in stdout
    table = listed(stdout)
    assert table["model.layers.1.self_attn.o_proj.weight"] == ("bfloat16", "[32, 32]")
    assert len(table) == len(registry(SMALL).specs)
    assert f"{registry(SMALL).total:,} values" in stdout
    assert tokenizer_sha(out / "tokenizer.json") in stdout
    assert ids["data"] in stdout and "binds" in stdout
    lines = stdout.splitlines()
    order = [line.split()[0] for line in lines if line.startswith("  model.layers.")]
    assert order.index("model.layers.0.mlp.up_proj.weight") < order.index(
        "model.layers.1.input_layernorm.bias")


def test_inspect_describes_a_safetensors_file(run, tmp_path, capsys):
    checkpoint, _, ids = run
    path = tmp_path / "model.safetensors"
    assert cli(capsys, "export", checkpoint, path)[0] == 0
    status, stdout, _ = cli(capsys, "inspect", path)
    assert status == 0
    assert listed(stdout)["layers.0.attn.q.weight"] == ("float32", "[32, 32]")
    assert ids["learner"] in stdout and "binds" in stdout
    save_file({"x": np.zeros(3, np.float32)}, str(path))
    status, stdout, _ = cli(capsys, "inspect", path)
    assert status == 0 and "--preset" in stdout and listed(stdout) == {"x": ("float32", "[3]")}


def test_inspect_refuses_a_directory_import_would_refuse(run, tmp_path, capsys):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    edit_config(out, set_key("qk_layernorm", True))
    refused(capsys, "inspect", out, words=["qk_layernorm"])
    edit_config(out, set_key("qk_layernorm", False))
    edit_tensors(out, lambda t: t.pop("model.norm.bias"))
    refused(capsys, "inspect", out, words=["model.norm.bias"])
    refused(capsys, "inspect", tmp_path / "run", words=["no config.json"])


# ------------------------------------------------------------------ the model families (SPEC 21)

def member(**fields):
    return Config(vocab=320, context=16, d_model=32, n_layer=2, n_head=4, d_ff=64, **fields)


LLAMA = member(norm="rmsnorm", n_kv_head=2, tied=False, rope_base=500000,
               norm_eps=Fraction(1, 1000000))
QWEN2 = member(norm="rmsnorm", n_kv_head=1, qkv_bias=True)
STABLELM = member(n_kv_head=2, tied=False, rotary=Fraction(1, 2), qkv_bias=True)
# config.json of each, written out here as SPEC 20 and 21 name the fields
EXPECTED = {
    "llama": (LLAMA, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu",
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "torch_dtype": "float32"}),
    "qwen2": (QWEN2, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": True, "use_sliding_window": False,
        "sliding_window": None, "hidden_act": "silu",
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "torch_dtype": "float32"}),
    "stablelm": (STABLELM, {
        "architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "vocab_size": 320,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0, "layer_norm_eps": 1e-5, "max_position_embeddings": 16,
        "tie_word_embeddings": False, "use_qkv_bias": True, "qk_layernorm": False,
        "use_parallel_residual": False, "hidden_act": "silu", "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "torch_dtype": "float32"}),
}


@pytest.fixture(params=sorted(EXPECTED))
def family_run(request, tmp_path, text):
    config, expected = EXPECTED[request.param]
    checkpoint, state, ids = make_run(tmp_path / "run", config, tokenizer_text=text)
    return request.param, config, expected, checkpoint, state, ids


def test_export_writes_the_architecture_of_each_member(family_run, tmp_path, capsys):
    name, config, expected, checkpoint, state, _ = family_run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text()) == expected
    tensors = load_file(str(out / "model.safetensors"))
    # the names of SPEC 20 and 21, written out: q, k, v biases where the model has them,
    # norm biases with layernorm only, lm_head.weight when untied
    want = {"model.embed_tokens.weight": (320, 32), "model.norm.weight": (32,)}
    if config.norm == "layernorm":
        want["model.norm.bias"] = (32,)
    if not config.tied:
        want["lm_head.weight"] = (320, 32)
    kv = 8 * config.kv_heads
    for layer in range(2):
        p = f"model.layers.{layer}."
        want.update({p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (kv, 32),
                     p + "self_attn.v_proj.weight": (kv, 32), p + "self_attn.o_proj.weight": (32, 32),
                     p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
                     p + "mlp.down_proj.weight": (32, 64)})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            want[p + norm + ".weight"] = (32,)
            if config.norm == "layernorm":
                want[p + norm + ".bias"] = (32,)
        if config.qkv_bias:
            want.update({p + "self_attn.q_proj.bias": (32,), p + "self_attn.k_proj.bias": (kv,),
                         p + "self_attn.v_proj.bias": (kv,)})
    assert {key: a.shape for key, a in tensors.items()} == want
    P = {spec.name: state.P[spec.slice].reshape(spec.shape) for spec in registry(config)}
    assert tensors["model.layers.1.self_attn.k_proj.weight"].tobytes() == \
        P["layers.1.attn.k.weight"].tobytes()
    if config.qkv_bias:
        assert tensors["model.layers.0.self_attn.v_proj.bias"].tobytes() == \
            P["layers.0.attn.v.bias"].tobytes()
    if not config.tied:
        assert tensors["lm_head.weight"].tobytes() == P["lm_head.weight"].tobytes()
    status, stdout, _ = cli(capsys, "inspect", out)
    assert status == 0 and f"{expected['architectures'][0]} (model_type {name})" in stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_member_round_trips(family_run, tmp_path, capsys, dtype):
    _, config, _, checkpoint, state, ids = family_run
    out = export_dir(capsys, checkpoint, tmp_path / "hf", "--dtype", dtype)
    back = tmp_path / "back.ckpt"
    assert cli(capsys, "import", out, back)[0] == 0
    got = load_state(back, config, expect=ids)
    assert got.state.P.tobytes() == (state.P if dtype == "float32" else round_bf16(state.P)).tobytes()
    # without coppelius' metadata (as transformers saves it): the model is config.json's
    save_file(load_file(str(out / "model.safetensors")), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    again = tmp_path / "again.ckpt"
    assert cli(capsys, "import", out, again)[0] == 0
    header = load_state(again, config).header
    assert header["model"] == config.identity()


@pytest.mark.parametrize("config, words", [
    (member(norm="rmsnorm", rotary=Fraction(1, 2)), ["rotary=5/10", "LlamaForCausalLM",
                                                     "Qwen2ForCausalLM", "whole head"]),
    (member(norm="rmsnorm", rotary=Fraction(1, 2), qkv_bias=True), ["rotary=5/10"]),
    (Config(vocab=320, context=16, d_model=24, n_layer=1, n_head=4, d_ff=64,
            rotary=Fraction(1, 3)), ["rotary=1/3", "0.333"]),
    (member(norm="rmsnorm", norm_eps=Fraction(1, 3)), ["norm_eps=1/3"]),
])
def test_export_refuses_a_member_no_architecture_is(tmp_path, capsys, text, config, words):
    checkpoint, _, _ = make_run(tmp_path / "run", config, tokenizer_text=text)
    refused(capsys, "export", checkpoint, tmp_path / "hf", "--format", "hf", words=words)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name, change, words", [
    ("llama", set_key("attention_bias", True), ["attention_bias", "true", "Qwen2ForCausalLM"]),
    ("llama", set_key("mlp_bias", True), ["mlp_bias", "true"]),
    ("llama", set_key("pretraining_tp", 2), ["pretraining_tp", "2"]),
    ("llama", set_key("partial_rotary_factor", 0.5), ["partial_rotary_factor", "0.5", "whole head"]),
    ("llama", rope_parameters(partial_rotary_factor=0.5), ["rope_parameters.partial_rotary_factor"]),
    ("llama", set_key("use_qkv_bias", True), ["use_qkv_bias", "not a field", "LlamaForCausalLM"]),
    ("llama", set_key("head_dim", 16), ["head_dim", "16", "8"]),
    ("llama", set_key("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), ["rope_scaling"]),
    ("llama", drop_key("rms_norm_eps"), ["rms_norm_eps", "missing"]),
    ("llama", drop_key("hidden_act"), ["hidden_act", "missing"]),
    ("llama", set_key("layer_norm_eps", 1e-5), ["layer_norm_eps", "not a field"]),
    ("qwen2", set_key("use_sliding_window", True), ["use_sliding_window", "true", "sliding"]),
    ("qwen2", set_key("layer_types", ["full_attention", "sliding_attention"]),
     ["layer_types", "sliding_attention"]),
    ("qwen2", set_key("layer_types", ["full_attention"]), ["layer_types"]),
    ("qwen2", set_key("use_mrope", True), ["use_mrope", "true"]),
    ("qwen2", set_key("attention_bias", True), ["attention_bias", "not a field"]),
    ("qwen2", set_key("num_experts", 60), ["num_experts", "mixture-of-experts"]),
    ("qwen2", set_key("moe_intermediate_size", 64), ["moe_intermediate_size", "mixture-of-experts"]),
    ("qwen2", set_key("model_type", "qwen2_moe"), ["model_type", "qwen2_moe"]),
])
def test_import_refuses_by_key_what_the_architecture_is_not(tmp_path, capsys, text, name, change,
                                                            words):
    config = EXPECTED[name][0]
    checkpoint, _, _ = make_run(tmp_path / "run", config, tokenizer_text=text)
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    edit_config(out, change)
    refused(capsys, "import", out, tmp_path / "back.ckpt", words=words)
    assert not (tmp_path / "back.ckpt").exists()


# what transformers writes beside the fields of the model (versions 4 and 5):
# none of it changes the model, and import takes it
BENIGN = {"transformers_version": "4.46.0", "dtype": "bfloat16", "torch_dtype": "bfloat16",
          "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0, "use_cache": True,
          "initializer_range": 0.02, "attention_dropout": 0.1, "_name_or_path": "somewhere",
          "output_hidden_states": False, "return_dict": True, "tokenizer_class": "X"}


@pytest.mark.parametrize("name, change", [
    ("llama", lambda c: c.update(BENIGN, pretraining_tp=1)),
    ("llama", rope_parameters(rope_theta=500000.0)),  # transformers 5's form
    ("llama", drop_key("rope_scaling")),
    ("llama", drop_key("attention_bias")),
    ("llama", drop_key("head_dim")),
    ("qwen2", lambda c: c.update(BENIGN, sliding_window=32768, max_window_layers=21,
                                 layer_types=["full_attention"] * 2)),
    ("qwen2", lambda c: [c.pop(k) for k in ("use_sliding_window", "sliding_window")]),
    ("qwen2", set_key("use_mrope", False)),
    ("llama", set_key("pretraining_tp", 1)),
    ("stablelm", lambda c: c.update(BENIGN, hidden_dropout=0.1)),
    ("stablelm", rope_parameters(partial_rotary_factor=0.5)),
])
def test_import_takes_what_leaves_the_model_as_it_is(tmp_path, capsys, text, name, change):
    config = EXPECTED[name][0]
    checkpoint, state, _ = make_run(tmp_path / "run", config, tokenizer_text=text)
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    edit_config(out, change)
    back = tmp_path / "back.ckpt"
    status, _, err = cli(capsys, "import", out, back)
    assert status == 0, err
    got = load_state(back, config)
    assert got.header["model"] == config.identity()
    assert got.state.P.tobytes() == state.P.tobytes()


def test_import_widens_float16_exactly(run, tmp_path, capsys):
    checkpoint, state, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    path = str(out / "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    half = {key: a.astype(np.float16) for key, a in load_file(path).items()}
    save_file(half, path, metadata=meta)
    back = tmp_path / "back.ckpt"
    assert cli(capsys, "import", out, back)[0] == 0
    want = state.P.astype(np.float16).astype(np.float32)  # every float16 is a float32
    assert load_state(back, SMALL).state.P.tobytes() == want.tobytes()


def shard(directory, groups: list, weight_map=None, metadata=None) -> dict:
    """Split DIR/model.safetensors into model-0000i-of-0000n.safetensors, one
    per group of tensor names (a name in two groups is in two shards), with
    the index save_pretrained writes (or `weight_map`). -> the index."""
    path = str(directory / "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() if metadata is None else metadata
    tensors = load_file(path)
    os.unlink(path)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(files, groups):
        save_file({key: tensors[key] for key in group}, str(directory / name), metadata=meta)
    if weight_map is None:
        weight_map = {key: name for name, group in zip(files, groups) for key in group}
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def layer_groups(directory) -> list:
    """The tensor names in three groups: the embedding, layer 0, the rest."""
    with safe_open(str(directory / "model.safetensors"), framework="numpy") as f:
        keys = sorted(f.keys())
    first = [k for k in keys if k.startswith("model.layers.0.")]
    return [["model.embed_tokens.weight"], first,
            [k for k in keys if k not in first and k != "model.embed_tokens.weight"]]


def test_a_sharded_directory_imports_as_one_file(run, tmp_path, capsys):
    checkpoint, state, ids = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    shard(out, layer_groups(out))
    back = tmp_path / "back.ckpt"
    assert cli(capsys, "import", out, back)[0] == 0
    assert load_state(back, SMALL, expect=ids).state.P.tobytes() == state.P.tobytes()
    status, stdout, _ = cli(capsys, "inspect", out)
    assert status == 0 and "model.safetensors.index.json" in stdout


SHARD_1, SHARD_2 = "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"


@pytest.mark.parametrize("how, words", [
    ("missing shard", [SHARD_2, "missing", "model.layers.0."]),
    ("in two shards", ["model.embed_tokens.weight", SHARD_2, "lists it in " + SHARD_1]),
    ("not listed", ["model.norm.weight", "does not list it"]),
    ("listed elsewhere", ["model.norm.weight", "lists it in " + SHARD_1]),
    ("listed, held by none", ["model.extra.weight", "does not hold it"]),
    ("a path", ["weight_map.model.norm.weight", "../x.safetensors", "beside the index"]),
    ("extra tensor", ["model.extra.weight", "unexpected tensor"]),
    ("missing tensor", ["model.norm.weight", "missing tensor"]),
    ("both", ["model.safetensors", "model.safetensors.index.json", "both"]),
    ("other metadata", [SHARD_1, SHARD_2, "metadata"]),
    ("unknown key", ["format", "shard index"]),
])
def test_import_refuses_shards_that_are_not_one_model(run, tmp_path, capsys, how, words):
    checkpoint, _, _ = run
    out = export_dir(capsys, checkpoint, tmp_path / "hf")
    weights = (out / "model.safetensors").read_bytes()
    groups = layer_groups(out)
    index = shard(out, groups)
    wm = index["weight_map"]
    if how == "missing shard":
        os.unlink(out / SHARD_2)
    elif how == "in two shards":  # the embedding also in the second shard
        resave(out / SHARD_2, lambda t: t.update(load_file(str(out / SHARD_1))))
    elif how == "not listed":
        del wm["model.norm.weight"]
    elif how == "listed elsewhere":
        wm["model.norm.weight"] = SHARD_1
    elif how == "listed, held by none":
        wm["model.extra.weight"] = SHARD_1
    elif how == "a path":
        wm["model.norm.weight"] = "../x.safetensors"
    elif how == "extra tensor":
        resave(out / groups_file(2), lambda t: t.update({"model.extra.weight": np.zeros(3, np.float32)}))
        wm["model.extra.weight"] = groups_file(2)
    elif how == "missing tensor":
        resave(out / groups_file(2), lambda t: t.pop("model.norm.weight"))
        del wm["model.norm.weight"]
    elif how == "both":
        (out / "model.safetensors").write_bytes(weights)
    elif how == "other metadata":
        save_file(load_file(str(out / SHARD_2)), str(out / SHARD_2), metadata={"format": "pt"})
    elif how == "unknown key":
        index["format"] = "pt"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(capsys, "import", out, tmp_path / "back.ckpt", words=words)
    assert not (tmp_path / "back.ckpt").exists()


def groups_file(i: int) -> str:
    return f"model-{i + 1:05d}-of-00003.safetensors"


def resave(path, change) -> None:
    """Change a safetensors file's tensors, keeping its metadata."""
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata=meta)
