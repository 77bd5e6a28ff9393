"""`coppelius sample`: configuration from a checkpoint, tokenizer lookup,
greedy and top-k sampling on the reference forward."""

import os
import re
import shutil
import sysconfig

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from coppelius import sample
from coppelius.cli import main
from coppelius.reference import Hyper, forward, initialize, preset
from coppelius.reference.checkpoint import identities, write_checkpoint
from coppelius.reference.config import MODEL_FIELDS, PRESETS, Config, config_from_identity
from coppelius.reference.errors import ConfigError, NonFiniteError
from coppelius.reference.params import registry
from coppelius.reference.state import State
from coppelius.tokenizer import tokenizer_sha, train_tokenizer

CONFIG = preset("test")  # V=64, T=16
TIE = 1e-5  # logits closer than this may order differently between two forwards


def spread_parameters(config, seed=0):
    """The initialization with every matrix scaled by 10: logits spread over a
    few units and depending on the context (at initialization they are nearly
    uniform, and each position mostly predicts its own token back)."""
    P = initialize(config, seed).copy()
    for spec in registry(config).specs:
        if len(spec.shape) == 2:
            P[spec.slice] *= 10
    return P


@pytest.fixture(scope="module")
def P():
    return spread_parameters(CONFIG)


def last_logits(config, P, ids):
    # (V,) float64: the prediction after `ids`, one forward of its last T ids
    window = np.array(ids[-config.context:], dtype=np.int64)[None, :]
    return forward(config, P, window, "fp32")[0, -1].astype(np.float64)


# ---------------------------------------------------------------------------
# The model identity

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_from_identity_recovers_every_preset(name):
    config = PRESETS[name]
    got = config_from_identity(config.identity())
    assert (got.vocab, got.context, got.d_model, got.n_layer, got.n_head, got.d_ff) == (
        config.vocab, config.context, config.d_model, config.n_layer, config.n_head, config.d_ff)


# norm=rmsnorm, tied=0 and another eps are members of the family since SPEC
# 21 (tests/test_model_config.py reads them back); what is not one is refused
@pytest.mark.parametrize("change", [
    ("norm=layernorm", "norm=batchnorm"), ("tied=1", "tied=2"), ("vocab=64", "vocab=064"),
    ("vocab=64|", ""), ("|tied=1", "|tied=1|extra=1"), ("n_head=2", "n_head=3"),
    ("d_ff=96", "d_ff=x"), ("eps=1/100000", "eps=0"), ("eps=1/100000", "eps=1e-5"),
    ("|tied=1", "|tied=1|kv_heads=2"), ("|tied=1", "|tied=1|rotary=1"),
    ("|tied=1", "|tied=1|qkv_bias=0"), ("|tied=1", "|tied=1|rotary=5/10|kv_heads=1"),
])
def test_config_from_identity_refuses_anything_else(change):
    model = CONFIG.identity().replace(*change)
    assert model != CONFIG.identity()
    with pytest.raises(ConfigError, match=r"ck\.bin: model identity"):
        config_from_identity(model, "ck.bin")


# ---------------------------------------------------------------------------
# Generation

@given(prompt=st.lists(st.integers(0, 63), min_size=1, max_size=6), n=st.integers(1, 10))
def test_greedy_picks_the_argmax_of_one_full_forward(P, prompt, n):
    out = sample.generate(CONFIG, P, prompt, n, temperature=0.0)
    assert out[:len(prompt)] == prompt and len(out) == len(prompt) + n <= CONFIG.context
    # causal: one forward of the whole sequence predicts every position at once
    logits = forward(CONFIG, P, np.array([out[:-1]]), "fp32")[0].astype(np.float64)  # (n,V)
    for j in range(len(prompt) - 1, len(out) - 1):
        chosen = out[j + 1]
        assert logits[j, chosen] >= logits[j].max() - TIE, (j, chosen, logits[j].argmax())


def test_greedy_slides_a_window_of_t_tokens(P):
    prompt = [5, 9, 1]
    out = sample.generate(CONFIG, P, prompt, 2 * CONFIG.context, temperature=0.0)
    T = CONFIG.context
    for j in range(T, len(out)):  # predicted from exactly the T ids before it
        logits = forward(CONFIG, P, np.array([out[j - T:j]]), "fp32")[0, -1].astype(np.float64)
        assert logits[out[j]] >= logits.max() - TIE, j


def test_top_k_draws_only_among_the_k_most_likely(P):
    rng = np.random.default_rng(7)
    out = sample.generate(CONFIG, P, [3], 40, temperature=2.0, top_k=3, rng=rng)
    for j in range(1, len(out)):
        logits = last_logits(CONFIG, P, out[:j])
        third = np.sort(logits)[-3]
        assert logits[out[j]] >= third - TIE, j
    # and a high temperature with k=3 does not always pick the argmax
    assert any(out[j] != np.argmax(last_logits(CONFIG, P, out[:j])) for j in range(1, len(out)))


def test_same_seed_same_sequence_other_seed_another(P):
    def run(seed):
        return sample.generate(CONFIG, P, [1, 2], 20, temperature=1.0, top_k=0,
                               rng=np.random.default_rng(seed))
    assert run(11) == run(11)
    assert run(11) != run(12)


def test_pick_draws_with_the_softmax_of_the_top_k():
    logits = np.array([1.0, 3.0, -2.0, 2.5, 2.9, 0.0], dtype=np.float32)
    temperature, k, n = 0.7, 3, 40000
    rng = np.random.default_rng(3)
    counts = np.bincount([sample.pick(logits, temperature, k, rng) for _ in range(n)], minlength=6)
    # independent: the three largest are ids 1, 4, 3
    expected = np.zeros(6)
    w = np.exp(np.array([3.0, 2.5, 2.9]) / temperature)
    expected[[1, 3, 4]] = w / w.sum()
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts / n - expected) <= 5 * sigma + 1e-12), (counts / n, expected)
    assert sample.pick(logits, 0.0, 0, rng) == 1
    assert sample.pick(logits, 5.0, 1, rng) == 1


def test_an_empty_prompt_is_refused(P):
    with pytest.raises(ConfigError, match="prompt is empty"):
        sample.generate(CONFIG, P, [], 3)


# ---------------------------------------------------------------------------
# The command line, on a checkpoint with a real tokenizer

BPE = Config(vocab=320, context=16, d_model=32, n_layer=2, n_head=2, d_ff=96)  # 256 bytes + 64 merges


def corpus_text():
    path = os.path.join(sysconfig.get_paths()["stdlib"], "json", "decoder.py")
    return open(path, encoding="utf-8").read()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run laid out as `coppelius train` lays it out: RUN_DIR/checkpoint.bin
    and the stream cache RUN_DIR/../data/<stem>-v<V>/tokenizer.json."""
    root = tmp_path_factory.mktemp("runs")
    tok_path = root / "data" / "corpus-v320" / "tokenizer.json"
    tok_path.parent.mkdir(parents=True)
    tok = train_tokenizer([corpus_text()], BPE.vocab)
    tok_path.write_text(tok.to_str(), encoding="utf-8")
    P = spread_parameters(BPE, seed=1)
    ckpt = root / "tiny" / "checkpoint.bin"
    ckpt.parent.mkdir()
    ids = identities(BPE, Hyper(), "fp32", 1, tokenizer_sha(tok_path), "ab" * 32)
    write_checkpoint(ckpt, BPE, ids, State.fresh(P), contexts=0)
    return dict(ckpt=ckpt, tok=tok, tok_path=tok_path, P=P, ids=ids)


def test_load_parameters_gives_back_what_was_written(run):
    config, P, header = sample.load_parameters(run["ckpt"])
    assert config == Config(**{f: getattr(BPE, f) for f in MODEL_FIELDS})
    assert P.dtype == np.float32 and np.array_equal(P, run["P"])
    assert header["data"] == run["ids"]["data"]


def test_cli_greedy_sample_finds_the_tokenizer_and_continues(run, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing in the default cache (the test's own: conftest)
    prompt = "def decode(self, s"
    assert main(["sample", str(run["ckpt"]), "--prompt", prompt, "--tokens", "12",
                 "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    tok = run["tok"]
    ids = tok.encode(prompt).ids
    out = list(ids)
    for _ in range(12):  # greedy, independently of sample.generate
        out.append(int(np.argmax(last_logits(BPE, run["P"], out))))
    assert len(set(out[len(ids):])) > 3  # a continuation that depends on the context
    assert printed == tok.decode(out) + "\n"
    assert printed.startswith(prompt)


SPEED = re.compile(r"(\d+) tokens in \d+\.\d\d s: \d+\.\d tokens/s \((\w+), (\w+)\)")


def test_cli_reports_the_generation_s_rate_on_stderr(run, capsys, tmp_path):
    """One line on stderr after the text: the tokens asked for, their time
    and rate, the backend and precision; stdout holds the text alone. The
    tiny preset's model (V=2048) takes the run's 320-id tokenizer (SPEC 22)."""
    tiny = PRESETS["tiny"]
    ckpt = tmp_path / "tiny" / "checkpoint.bin"
    ckpt.parent.mkdir()
    shutil.copy(run["tok_path"], ckpt.parent / "tokenizer.json")
    ids = identities(tiny, Hyper(), "fp32", 1, tokenizer_sha(run["tok_path"]), "ab" * 32)
    write_checkpoint(ckpt, tiny, ids, State.fresh(initialize(tiny, 0)), contexts=0)
    assert main(["sample", str(ckpt), "--backend", "reference", "--tokens", "7",
                 "--temperature", "0", "--prompt", "def"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("def") and "tokens/s" not in printed.out
    lines = printed.err.splitlines()
    assert len(lines) == 1, printed.err  # the reference builds no program
    speed = SPEED.fullmatch(lines[0])
    assert speed and speed.groups() == ("7", "reference", "fp32"), lines[0]


def test_the_continuation_is_handed_on_as_it_is_made(run, monkeypatch, tmp_path):
    """on_text: pieces as the tokens come (more than one call, each after a
    new token), adding up to the decoded continuation; none of them ends
    inside a character."""
    monkeypatch.chdir(tmp_path)
    prompt, made, pieces = "def decode(self, s", [], []
    generate = sample.generate

    def counting(*a, **k):  # how many tokens exist when each piece is handed on
        inner = a[-1] if len(a) > 7 else k.get("on_token")
        return generate(*a[:7], on_token=lambda ids: (made.append(len(ids)), inner(ids)))

    monkeypatch.setattr(sample, "generate", counting)
    text = sample.generate_text(run["ckpt"], prompt=prompt, tokens=12, temperature=0,
                                on_text=lambda piece: pieces.append((len(made), piece)))
    assert text.startswith(prompt)
    assert "".join(p for _, p in pieces) == text[len(prompt):]
    assert len(pieces) > 1 and [n for n, _ in pieces] == sorted(n for n, _ in pieces)
    assert pieces[0][0] < 12  # the first piece came before the last token was made
    assert not any(p.endswith("\ufffd") for _, p in pieces[:-1])


def test_cli_refuses_a_missing_tokenizer(run, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing in the default cache (the test's own: conftest)
    lone = tmp_path / "elsewhere" / "checkpoint.bin"
    lone.parent.mkdir()
    lone.write_bytes(run["ckpt"].read_bytes())
    # a tokenizer.json beside it, but not the one the checkpoint names
    other = train_tokenizer([corpus_text()[:6000]], BPE.vocab)
    (lone.parent / "tokenizer.json").write_text(other.to_str(), encoding="utf-8")
    sha = tokenizer_sha(run["tok_path"])
    assert tokenizer_sha(lone.parent / "tokenizer.json") != sha
    assert main(["sample", str(lone), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("coppelius sample: error: ") and sha in err and str(lone) in err
    # --tokenizer overrides the lookup
    assert main(["sample", str(lone), "--tokens", "2", "--tokenizer", str(run["tok_path"])]) == 0


def test_cli_refuses_a_tokenizer_with_more_ids_than_the_model(run, capsys, tmp_path):
    large = tmp_path / "tokenizer.json"
    large.write_text(train_tokenizer([corpus_text()], 400).to_str(), encoding="utf-8")
    assert main(["sample", str(run["ckpt"]), "--tokenizer", str(large)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 400 ids" in err and "V=320" in err, err


def test_cli_takes_a_tokenizer_with_fewer_ids_than_the_model(run, capsys, tmp_path):
    """SPEC 22: V may exceed the tokenizer's vocabulary (an imported model's
    padded one); --tokenizer may name the directory that holds it."""
    small = tmp_path / "tokenizer.json"
    tok = train_tokenizer([corpus_text()], 300)
    small.write_text(tok.to_str(), encoding="utf-8")
    assert main(["sample", str(run["ckpt"]), "--tokenizer", str(tmp_path), "--tokens", "3",
                 "--temperature", "0", "--prompt", "def"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def")


@pytest.mark.parametrize("option", [["--tokens", "-1"], ["--temperature", "-0.5"],
                                    ["--temperature", "nan"], ["--temperature", "inf"],
                                    ["--top-k", "-2"], ["--seed", "-1"]])
def test_cli_refuses_bad_options(run, capsys, option):
    assert main(["sample", str(run["ckpt"])] + option) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"coppelius sample: error: {option[0]}={option[1]}: must be ")
    assert err.count("\n") == 1


def test_cli_refuses_a_missing_checkpoint(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "none.bin")]) == 2
    assert "none.bin" in capsys.readouterr().err


def greedy_text(run, prompt: str, n: int) -> str:
    """`prompt` and n greedy tokens, computed independently of sample.generate."""
    out = list(run["tok"].encode(prompt).ids)
    for _ in range(n):
        out.append(int(np.argmax(last_logits(BPE, run["P"], out))))
    return run["tok"].decode(out)


def test_the_default_prompt_is_def_without_a_trailing_space(run, capsys, monkeypatch, tmp_path):
    assert sample.DEFAULT_PROMPT == "def"
    monkeypatch.chdir(tmp_path)
    assert main(["sample", str(run["ckpt"]), "--tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy_text(run, "def", 6) + "\n"


@given(logits=st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=50),
       top_k=st.integers(0, 5), temperature=st.sampled_from([1e-320, 5e-324, 1e-300, 1e-30]))
@example(logits=[0.0, 7.7905e-38], top_k=0, temperature=1e-300)
def test_a_vanishing_temperature_draws_a_largest_logit(logits, top_k, temperature):
    logits = np.array(logits, dtype=np.float32)
    # the limit is greedy where every other logit's weight exp(-gap / T)
    # underflows to 0 in float64; a gap of 1e-37 at T = 1e-30 is no limit
    gaps = logits.max().astype(np.float64) - logits.astype(np.float64)
    with np.errstate(over="ignore"):  # a gap over a tiny temperature is inf: weight 0
        assume(((gaps == 0) | (gaps / temperature > 746)).all())
    got = sample.pick(logits, temperature, top_k, np.random.default_rng(0))
    assert logits[got] == logits.max()


def test_a_huge_temperature_draws_uniformly_from_the_top_k():
    logits = np.array([3.0, -1.0, 2.0, 0.5, 9.0], dtype=np.float32)
    rng = np.random.default_rng(5)
    n = 20000
    counts = np.bincount([sample.pick(logits, 1e308, 3, rng) for _ in range(n)], minlength=5)
    expected = np.array([1, 0, 1, 0, 1]) / 3  # ids 4, 0, 2 are the three largest
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts / n - expected) <= 5 * sigma + 1e-12), counts


def test_pick_refuses_non_finite_logits():
    with pytest.raises(NonFiniteError, match="id 2"):
        sample.pick(np.array([0.0, 1.0, np.nan, np.inf], dtype=np.float32), 1.0, 0,
                    np.random.default_rng(0))


def test_cli_a_tiny_temperature_samples_like_greedy(run, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    prompt = "def decode(self, s"
    assert main(["sample", str(run["ckpt"]), "--prompt", prompt, "--tokens", "12",
                 "--temperature", "1e-320"]) == 0
    assert capsys.readouterr().out == greedy_text(run, prompt, 12) + "\n"


def test_cli_refuses_a_checkpoint_with_non_finite_parameters(run, capsys, tmp_path):
    reg = registry(BPE)
    spec = next(s for s in reg.specs if len(s.shape) == 2 and s.ordinal > 0)
    later = reg.specs[-1]
    P = run["P"].copy()
    i, j = 3, 5
    P[spec.offset + i * spec.shape[1] + j] = np.nan  # (row i, column j) of the tensor
    P[later.offset] = np.inf  # a later one is not the first
    P[:spec.offset] = 1.0  # every earlier tensor finite
    ckpt = tmp_path / "nan.bin"
    write_checkpoint(ckpt, BPE, run["ids"], State.fresh(P), contexts=0)
    assert main(["sample", str(ckpt), "--tokenizer", str(run["tok_path"])]) == 2
    err = capsys.readouterr().err
    assert err == (f"coppelius sample: error: checkpoint {ckpt}: parameters are not finite "
                   f"(first: {spec.name}[{i}, {j}])\n")


def test_the_tokenizer_beside_the_checkpoint_is_found_first(run, capsys, monkeypatch, tmp_path):
    """A run on an explicit --stream: its stream and tokenizer lie elsewhere,
    the run copies the tokenizer beside its checkpoint."""
    monkeypatch.chdir(tmp_path)
    streams = tmp_path / "streams" / "mine"
    streams.mkdir(parents=True)
    shutil.copyfile(run["tok_path"], streams / "tokenizer.json")
    (streams / "mine.tokens").write_bytes(b"")  # where the stream was; sample never reads it
    run_dir = tmp_path / "experiments" / "first"
    run_dir.mkdir(parents=True)
    ckpt = run_dir / "checkpoint.bin"
    shutil.copyfile(run["ckpt"], ckpt)
    # without the copy: not found beside it, nor in the caches
    assert main(["sample", str(ckpt), "--tokens", "2"]) == 2
    assert "no tokenizer.json with SHA-256" in capsys.readouterr().err
    shutil.copyfile(run["tok_path"], run_dir / "tokenizer.json")
    # the same file in the default cache too: the copy beside the checkpoint comes first
    cached = tmp_path / "runs" / "data" / "corpus-v320"
    cached.mkdir(parents=True)
    shutil.copyfile(run["tok_path"], cached / "tokenizer.json")
    _, _, header = sample.load_parameters(ckpt)
    assert sample.find_tokenizer(ckpt, header) == str(run_dir / "tokenizer.json")
    assert main(["sample", str(ckpt), "--tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy_text(run, "def", 5) + "\n"


# ---------------------------------------------------------------------------
# The prompt of the sample `coppelius train` prints: from a held-out context

class Ids:
    """A stream of ids (N,), written to a stream file and opened as a run
    opens one; the batch method is what corpus_prompt reads."""

    def __init__(self, ids):
        import tempfile

        from coppelius.reference.stream import open_stream, write_stream

        ids = np.asarray(ids, dtype=np.uint32)
        self._folder = tempfile.TemporaryDirectory()  # removed with this object
        path = os.path.join(self._folder.name, "ids.tokens")
        write_stream(path, ids, source_mtime_ns=0, source_size=0)
        self.stream = open_stream(path, int(ids.max()) + 1)

    def batch(self, c0, B, T):
        return self.stream.batch(c0, B, T)


def lines_stream(tok, lines, T):
    """The ids of `lines` joined by line breaks, and the number of contexts."""
    ids = tok.encode("\n".join(lines), add_special_tokens=False).ids
    return Ids(ids), (len(ids) - 1) // T


def test_the_corpus_prompt_is_the_first_whole_line_of_the_context(run):
    tok = run["tok"]
    T = 64
    config = Config(vocab=BPE.vocab, context=T, d_model=32, n_layer=1, n_head=2, d_ff=8)
    lines = [f"    result_{i} = decode(value_{i})" for i in range(200)]  # 9 to 32 tokens each
    stream, K = lines_stream(tok, lines, T)
    for c in (0, 1, K // 2, K - 1):
        context = tok.decode(stream.batch(c, 1, T)[0, :T].tolist())
        # independently: the context's text after its first line break, up to the next
        expected = context.split("\n")[1]
        assert 8 < len(tok.encode(expected).ids) <= 32 and expected in lines
        assert sample.corpus_prompt(stream, config, tok, c) == expected


def test_the_corpus_prompt_keeps_short_lines_up_to_eight_tokens(run):
    tok = run["tok"]
    T = 48
    config = Config(vocab=BPE.vocab, context=T, d_model=32, n_layer=1, n_head=2, d_ff=8)
    stream, K = lines_stream(tok, ["", "x", "", "y", "z", "", "the long line " * 20] * 30, T)
    seen = set()
    for c in range(K):
        prompt = sample.corpus_prompt(stream, config, tok, c)
        context = tok.decode(stream.batch(c, 1, T)[0, :T].tolist())
        assert prompt and not prompt.endswith((" ", "\n")) and not prompt.startswith("\n")
        rest = context.split("\n", 1)[1] if "\n" in context[:-1] else context
        first = rest.lstrip("\n").split("\n")[0]  # the first line that is not blank
        if len(tok.encode(first).ids) > 32:  # a long line: its first 8 tokens
            assert first.startswith(prompt) and len(tok.encode(prompt).ids) <= 8
            seen.add("cut")
        else:  # whole lines: the first, and more while all take at most 8 tokens
            assert prompt.startswith(first) and (prompt + "\n") in rest
            if "\n" in prompt:
                assert len(tok.encode(prompt).ids) <= 8
                seen.add("lines")
    assert seen == {"cut", "lines"}


def test_the_corpus_prompt_falls_back_to_def_on_a_blank_context(run):
    tok = run["tok"]
    config = Config(vocab=BPE.vocab, context=16, d_model=32, n_layer=1, n_head=2, d_ff=8)
    stream, K = lines_stream(tok, ["   "] * 100, 16)
    assert K > 0 and sample.corpus_prompt(stream, config, tok, K - 1) == sample.DEFAULT_PROMPT


@pytest.mark.mlx
def test_cli_samples_on_another_backend_as_on_the_reference(run, capsys, monkeypatch, tmp_path):
    pytest.importorskip("mlx.core")
    monkeypatch.chdir(tmp_path)
    texts = []
    for backend in ("reference", "mlx"):
        assert main(["sample", str(run["ckpt"]), "--prompt", "def decode(self, s", "--tokens",
                     "10", "--temperature", "0", "--backend", backend]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("def decode(self, s") + 5
