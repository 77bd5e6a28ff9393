"""Model configuration files (SPEC section 17): the loader's refusals, the
override semantics of --preset with --model, and runs of a custom shape
through `coppelius train`, `conformance` and `bench` on the reference."""

import json
import os

import pytest

from coppelius.cli import main
from coppelius.reference import checkpoint
from coppelius.reference.config import PRESETS, Config, config_from_toml
from coppelius.reference.errors import ConfigError

# A shape of no preset, small enough to train a few steps in well under a
# second on the reference: V >= 256 so that a byte-level BPE (and with it the
# sample) exists.
SMALL = dict(vocab=300, context=16, d_model=24, n_layer=1, n_head=2, d_ff=40)


def toml_file(path, fields: dict, extra: str = "") -> str:
    lines = [f"{k} = {v}" for k, v in fields.items()]
    path.write_text("\n".join(lines) + "\n" + extra, encoding="utf-8")
    return str(path)


def test_a_file_without_preset_sets_every_model_field(tmp_path):
    config, defaults = config_from_toml(toml_file(tmp_path / "m.toml", SMALL))
    assert config == Config(**SMALL, steps=1000, interval=250)  # tiny's run policy
    assert defaults == {}
    config, defaults = config_from_toml(toml_file(tmp_path / "r.toml", dict(
        SMALL, steps=7, interval=3, batch=5)))
    assert (config.steps, config.interval, defaults) == (7, 3, {"batch": 5})


def test_a_preset_is_the_base_the_file_overrides(tmp_path):
    tiny = PRESETS["tiny"]
    path = toml_file(tmp_path / "deeper.toml", {"n_layer": 6, "steps": 20})
    config, defaults = config_from_toml(path, tiny)
    assert config == Config(vocab=tiny.vocab, context=tiny.context, d_model=tiny.d_model,
                            n_layer=6, n_head=tiny.n_head, d_ff=tiny.d_ff, steps=20,
                            interval=tiny.interval)
    assert defaults == {}
    # an empty file is the preset itself
    assert config_from_toml(toml_file(tmp_path / "empty.toml", {}), tiny) == (tiny, {})


@pytest.mark.parametrize("text, words", [
    ("d_model = 32\nd_modle = 3\n", ["unknown key 'd_modle'", "vocab, context"]),
    ("[model]\nd_model = 32\n", ["unknown key 'model'"]),
    ("d_model = 0\n", ["d_model = 0", "positive integer"]),
    ("n_head = -2\n", ["n_head = -2"]),
    ("d_ff = 3.5\n", ["d_ff = 3.5"]),
    ("vocab = '300'\n", ["vocab = '300'"]),
    ("n_layer = true\n", ["n_layer = True"]),
    ("context = 2147483648\n", ["context = 2147483648", "2^31"]),
    ("n_head = 3\n", ["n_head=3", "must divide d_model=128"]),  # tiny's d_model
    ("d_model = 132\nn_head = 4\n", ["head dim", "=33", "must be even"]),
    ("d_model = 128\nn_head = 4\nvocab =\n", ["not valid TOML", "line 3"]),
    ("d_model = 1 2\n", ["not valid TOML", "line 1"]),
])
def test_bad_values_are_refused_naming_the_file_and_the_key(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        config_from_toml(path, PRESETS["tiny"])
    message = str(e.value)
    assert message.startswith(f"model file {path}: ") and "\n" not in message
    for word in words:
        assert word in message


def test_head_dimension_must_be_even(tmp_path):
    path = toml_file(tmp_path / "odd.toml", dict(SMALL, d_model=30, n_head=2))  # E = 15
    with pytest.raises(ConfigError, match=r"odd\.toml: .*n_head=2.*d_model/n_head=15 must be even"):
        config_from_toml(path)


def test_a_missing_field_without_preset_is_refused_by_name(tmp_path):
    fields = {k: v for k, v in SMALL.items() if k != "d_ff"}
    with pytest.raises(ConfigError, match=r"m\.toml: missing key 'd_ff'.*without --preset"):
        config_from_toml(toml_file(tmp_path / "m.toml", fields))


def test_unreadable_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model file .*absent\.toml: no such file"):
        config_from_toml(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match=r"model file .*: not a regular file"):
        config_from_toml(tmp_path)
    (tmp_path / "latin.toml").write_bytes(b"vocab = 300\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin\.toml: line 2: not UTF-8"):
        config_from_toml(tmp_path / "latin.toml", PRESETS["tiny"])
    if hasattr(os, "mkfifo"):  # refused from its type: opening it would block
        os.mkfifo(tmp_path / "pipe.toml")
        with pytest.raises(ConfigError, match=r"pipe\.toml: not a regular file"):
            config_from_toml(tmp_path / "pipe.toml")


def test_brackets_and_digits_in_strings_and_comments_are_not_counted(tmp_path):
    """The depth and number bounds read values only: a comment or a string
    of brackets and digits (any of TOML's four string kinds) is not counted."""
    noise = "[" * 20 + "{" * 20 + "9" * 60
    extra = f'norm = "rmsnorm" # {noise} \'\n# {noise} "\n'
    path = toml_file(tmp_path / "m.toml", SMALL, extra)
    assert config_from_toml(path)[0].norm == "rmsnorm"
    for quoted in (f'"{noise}"', f"'{noise}'", f'"""\n{noise}"""', f"'''{noise}\n'''"):
        path = toml_file(tmp_path / "s.toml", SMALL, f"norm = {quoted}\n")
        with pytest.raises(ConfigError, match="must be one of layernorm, rmsnorm"):
            config_from_toml(path)  # the string reached the field's own check
    # an array 8 deep is parsed and refused by its type; 9 deep before parsing
    path = toml_file(tmp_path / "a.toml", SMALL, "norm = " + "[" * 8 + "]" * 8 + "\n")
    with pytest.raises(ConfigError, match="norm = an array: must be a string"):
        config_from_toml(path)
    path = toml_file(tmp_path / "a.toml", SMALL, "norm = " + "[" * 9 + "]" * 9 + "\n")
    with pytest.raises(ConfigError, match="line 7: norm: arrays or tables nested more than 8"):
        config_from_toml(path)


def test_a_sparse_model_file_is_refused_after_reading_its_bound(tmp_path):
    path = tmp_path / "big.toml"
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB of holes: reading it all would take hours
    with pytest.raises(ConfigError, match=r"big\.toml: larger than 1048576 bytes"):
        config_from_toml(path)


# ---------------------------------------------------------------------------
# coppelius train --model

@pytest.fixture
def source(tmp_path):
    """A folder of real text: enough for a BPE of 300 ids and tens of contexts."""
    import sysconfig

    root = tmp_path / "texts"
    root.mkdir()
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in ("textwrap.py", "shlex.py", "colorsys.py"):
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            (root / name).write_text(f.read(), encoding="utf-8")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02")
    return root


def train(tmp_path, *extra):
    return main(["train", "--backend", "reference", "--run-dir", str(tmp_path / "run"), *extra])


def test_a_custom_shape_trains_and_resumes_on_the_reference(tmp_path, source, capsys,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run directory (the stream cache: conftest's)
    model = toml_file(tmp_path / "small.toml", dict(SMALL, steps=3, batch=2))
    assert main(["train", "--backend", "reference", "--model", model, "--source", str(source),
                 "--prompt", "def"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "small"  # runs/<file stem>
    assert "trained 3 steps" in out and f"checkpoint: {os.path.join('runs', 'small')}" in out
    assert "(3 documents, 1 binary file skipped)" in out
    header = checkpoint.validate(run / "checkpoint.bin").header
    assert header["model"] == Config(**SMALL).identity()
    assert header["step"] == 3 and "|batch=2|" in header["data"]  # batch from the file
    assert sample_prompt(out) == "def"
    # run.json remembers the file: --run-dir alone continues the run
    assert json.loads((run / "run.json").read_text())["options"]["model"] == model
    assert main(["train", "--run-dir", str(run), "--steps", "2", "--no-sample"]) == 0
    assert checkpoint.validate(run / "checkpoint.bin").header["step"] == 5
    # --batch on the command line wins over the file's
    capsys.readouterr()
    assert train(tmp_path, "--model", model, "--source", str(source), "--batch", "1",
                 "--steps", "1", "--no-sample") == 0
    assert "|batch=1|" in checkpoint.validate(tmp_path / "run" / "checkpoint.bin").header["data"]


def test_a_checkpoint_of_one_shape_refuses_another(tmp_path, source, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = toml_file(tmp_path / "a.toml", SMALL)
    b = toml_file(tmp_path / "b.toml", dict(SMALL, d_ff=48))  # only the hidden width differs
    args = ("--source", str(source), "--steps", "1", "--no-sample")
    assert train(tmp_path, "--model", a, *args) == 0
    before = (tmp_path / "run" / "checkpoint.bin").read_bytes()
    capsys.readouterr()
    assert train(tmp_path, "--model", b, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("coppelius train: error: checkpoint ")
    assert "another model shape" in err
    assert (tmp_path / "run" / "checkpoint.bin").read_bytes() == before


def test_train_refuses_a_bad_model_file_with_one_line(tmp_path, source, capsys):
    bad = toml_file(tmp_path / "bad.toml", dict(SMALL, n_head=5))
    assert train(tmp_path, "--model", bad, "--source", str(source)) == 2
    err = capsys.readouterr().err
    assert err == (f"coppelius train: error: model file {bad}: config field n_head=5: "
                   f"must divide d_model=24\n")
    assert not (tmp_path / "run").exists()


def test_conformance_and_bench_take_a_model_file(tmp_path, capsys):
    model = toml_file(tmp_path / "small.toml", dict(SMALL, batch=2))
    assert main(["conformance", "--backend", "reference", "--model", model, "--steps", "2",
                 "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "preset custom B=2" in out and "PASS" in out
    assert main(["bench", "--model", model, "--steps", "1", "--warmup", "0", "--no-peer",
                 "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert f"model {model}, B=2, T=16" in out
    assert main(["bench", "--model", str(tmp_path / "absent.toml")]) == 2
    assert "absent.toml: no such file" in capsys.readouterr().err


def sample_prompt(out: str) -> str:
    """The prompt train's closing sample shows, marked off from the model's text."""
    marked = out.split("sample prompt (")[1].split("):\n", 1)[1]
    prompt, rest = marked.split("\nsample (80 tokens, as they are made):\n", 1)
    assert rest.rstrip().endswith("s)")  # the continuation, then how long it took
    return prompt


def test_the_sample_continues_a_line_of_the_last_context(tmp_path, source, capsys, monkeypatch):
    from coppelius import data, sample
    from coppelius.tokenizer import load_tokenizer
    from coppelius.reference.stream import open_stream

    monkeypatch.chdir(tmp_path)
    model = toml_file(tmp_path / "small.toml", dict(SMALL, steps=1))
    assert train(tmp_path, "--model", model, "--source", str(source)) == 0
    text = sample_prompt(capsys.readouterr().out)
    stream_path, tok_path = data.prepare_stream(source=source, vocab=SMALL["vocab"])
    stream = open_stream(stream_path, SMALL["vocab"])
    T = SMALL["context"]
    K = stream.n_contexts(T)
    tok = load_tokenizer(tok_path)
    last = tok.decode(stream.ids[(K - 1) * T:K * T].tolist())  # the last context's inputs
    prompt = sample.corpus_prompt(stream, Config(**SMALL), tok, K - 1)
    assert text == prompt and prompt != sample.DEFAULT_PROMPT
    assert "\n" + prompt in last  # a line of the held-out context, from its start
    capsys.readouterr()
    assert train(tmp_path, "--model", model, "--source", str(source), "--steps", "1",
                 "--prompt", "class") == 0
    assert sample_prompt(capsys.readouterr().out) == "class"
