"""Source text -> tokenizer -> token stream (SPEC section 8), the default
corpus, the stream cache and `coppelius tokenize`."""

import errno
import hashlib
import json
import os
import re
import shutil
import pathlib
import struct
import sysconfig

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coppelius import corpus, data
from coppelius.cli import main
from coppelius.reference import fsutil
from coppelius.reference.errors import ConfigError, StreamError
from coppelius.reference.stream import open_stream, read_stream_header
from coppelius.tokenizer import (encode, load_tokenizer, pieces, read_source, tokenizer_sha,
                                 train_tokenizer)

V = 320  # 256 byte symbols and 64 merges: trains in milliseconds


def sample_text() -> str:
    """A few tens of KB of real text: the json package of the running Python."""
    root = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    return "".join(open(os.path.join(root, name), encoding="utf-8").read()
                   for name in sorted(os.listdir(root)) if name.endswith(".py"))


def other_text() -> str:
    """Another source, trained to another tokenizer of the same V."""
    root = sysconfig.get_paths()["stdlib"]
    return "".join(open(os.path.join(root, name), encoding="utf-8").read()
                   for name in ("textwrap.py", "shlex.py"))


def decodes_to(stream_path, tokenizer_path, text) -> bool:
    """Whether the pair on disk gives back `text`: the stream's ids decoded
    with the tokenizer beside it."""
    ids = open_stream(stream_path, load_tokenizer(tokenizer_path).get_vocab_size()).ids
    return load_tokenizer(tokenizer_path).decode(ids.tolist()) == text


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([sample_text()], V)


def test_tokenizer_has_exactly_v_ids(tokenizer):
    assert tokenizer.get_vocab_size() == V
    assert sorted(tokenizer.get_vocab().values()) == list(range(V))
    ids = encode(tokenizer, sample_text())
    assert ids.dtype == np.uint32 and ids.max() < V
    # merges were learnt: fewer ids than bytes
    assert ids.size < len(sample_text().encode("utf-8"))


def test_training_is_deterministic(tokenizer):
    again = train_tokenizer([sample_text()], V)
    assert again.to_str() == tokenizer.to_str()


def test_pieces_train_like_the_whole_text(tokenizer):
    text = sample_text()
    in_pieces = train_tokenizer(list(pieces(text, 997)), V)
    assert in_pieces.to_str() == tokenizer.to_str()


@given(st.text())
def test_any_text_round_trips(tokenizer, text):
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == text


lines = st.lists(st.text(alphabet=st.sampled_from("ab \t'9é\u2028\r\n#"), max_size=12)
                 | st.sampled_from(["x", "  x", "\n", "def f():", "'s", ""]), max_size=60)


@given(lines, st.integers(1, 40))
def test_piece_boundaries_do_not_change_the_words_or_ids(tokenizer, parts, size):
    text = "\n".join(parts)
    chunks = list(pieces(text, size))
    assert "".join(chunks) == text
    # the pre-tokenizer's words (BPE never merges across them), then the ids
    split = tokenizer.pre_tokenizer.pre_tokenize_str
    assert [w for chunk in chunks for w, _ in split(chunk)] == [w for w, _ in split(text)]
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    assert [i for chunk in chunks for i in tokenizer.encode(chunk).ids] == whole


def test_a_source_too_small_is_refused_naming_it_and_the_count(tmp_path):
    source = tmp_path / "small.txt"
    source.write_text("abab abab")
    with pytest.raises(StreamError, match=r"small\.txt: yields (\d+) distinct tokens.*V=400") as e:
        train_tokenizer(source, 400)
    assert 256 < int(e.value.args[0].split("yields ")[1].split()[0]) < 400


def test_a_vocabulary_below_the_byte_symbols_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="vocab=64"):
        train_tokenizer(["text"], 64)
    with pytest.raises(ConfigError, match="vocab=255"):
        data.prepare_stream(vocab=255, cache_dir=tmp_path)
    assert os.listdir(tmp_path) == []  # refused before anything is written


def test_a_source_not_utf8_is_refused_at_its_offset(tmp_path):
    source = tmp_path / "latin.txt"
    source.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(StreamError, match=r"latin\.txt: not UTF-8 at byte offset 3"):
        read_source(source)


# ---------------------------------------------------------------------------
# The default corpus

def fake_stdlib(root):
    files = {
        "os.py": b"import sys\n",
        "a-b.py": b"x = 1",  # no trailing newline
        "a/x.py": "s = 'caf\u00e9'\n".encode("utf-8"),
        "a/bad.py": b"s = 'caf\xe9'\n",  # latin-1: not UTF-8
        "a/notes.txt": b"not python\n",
        "site-packages/numpy.py": b"third party\n",
        "lib/site-packages/pkg/m.py": b"third party\n",
        "z/__init__.py": b"",
    }
    for rel, body in files.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(body)
    return files


M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    """SPEC 2's splitmix64 finalizer on plain Python ints (independent of the
    NumPy one the implementation uses)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def keyed(names) -> list:
    """SPEC 8: document i of the sorted names gets mix(20260925 + (i+1) GAMMA);
    the text is in increasing key order."""
    keys = {name: mix((20260925 + (i + 1) * GAMMA) & M64) for i, name in enumerate(sorted(names))}
    return sorted(keys, key=keys.get)


def test_keyed_order_of_the_first_documents():
    # written out once from the formula, so a change to the order (another
    # seed, keys sorted the other way, a 1-based i) cannot pass unnoticed
    assert corpus.keyed_order(5) == sorted(range(5), key=lambda i: mix(
        (20260925 + (i + 1) * GAMMA) & M64))
    assert keyed(["a", "b", "c"]) == [["a", "b", "c"][i] for i in corpus.keyed_order(3)]
    assert corpus.keyed_order(0) == [] and corpus.keyed_order(1) == [0]


def test_default_corpus_on_a_fake_stdlib(tmp_path, monkeypatch):
    root = str(tmp_path / "lib")
    files = fake_stdlib(root)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": root})
    kept = sorted(rel for rel in files
                  if rel.endswith(".py") and "site-packages" not in rel.split("/"))
    # plain string order of POSIX paths: "a-b.py" < "a/bad.py" ('-' < '/')
    assert kept == ["a-b.py", "a/bad.py", "a/x.py", "os.py", "z/__init__.py"]
    assert corpus.stdlib_files(root) == kept
    body = {"a-b.py": "x = 1\n",  # a final newline added
            "a/bad.py": "s = 'caf\ufffd'\n",  # the latin-1 byte replaced
            "a/x.py": "s = 'caf\u00e9'\n",
            "os.py": "import sys\n",
            "z/__init__.py": ""}  # empty: its marker line is all of it
    order = keyed(kept)
    assert order != kept  # five documents the shuffle moves
    expected = "".join(f"# file: {rel}\n{body[rel]}" for rel in order)
    listing = corpus.list_source(None)
    assert listing.kind == corpus.EMBEDDED and listing.documents == order
    assert listing.text() == expected
    # the stamp: the newest document's mtime and the documents' total size
    paths = [os.path.join(root, *rel.split("/")) for rel in kept]
    for k, path in enumerate(paths):
        os.utime(path, ns=(10**18 + k, 10**18 + k))
    assert corpus.list_source(None).stamp == (10**18 + len(paths) - 1,
                                              sum(len(files[rel]) for rel in kept))

    stream, tok = data.prepare_stream(vocab=256, cache_dir=tmp_path / "cache")
    assert read_stream_header(stream) == corpus.list_source(None).stamp
    assert decodes_to(stream, tok, expected)
    assert not os.path.exists(tmp_path / "cache" / "corpus")  # nothing materialised


def test_the_real_default_corpus_has_its_markers_in_keyed_order():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if "site-packages" not in p.relative_to(root).parts)
    assert corpus.stdlib_files(str(root)) == files and "os.py" in files
    listing = corpus.list_source(None)
    order = keyed(listing.documents)  # what was read (an unreadable file is left out)
    assert listing.documents == order and len(order) > 0.99 * len(files)
    text = listing.text()
    assert text.startswith(f"# file: {order[0]}\n")
    at = -1
    for rel in order:  # each marker is a line of its own, after the previous one
        at = text.index(f"# file: {rel}\n", at + 1)
        assert at == 0 or text[at - 1] == "\n", rel
    newest = max(os.stat(root / rel).st_mtime_ns for rel in order)
    assert listing.stamp == (newest, sum(os.stat(root / rel).st_size for rel in order))


# ---------------------------------------------------------------------------
# The stream cache

@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = data.tokenize_source

    def tokenize_source(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "tokenize_source", tokenize_source)
    return calls


def test_cache_is_reused_when_fresh_and_rebuilt_when_stale(tmp_path, counted):
    source = tmp_path / "corpus.txt"
    source.write_text(sample_text(), encoding="utf-8")
    cache = tmp_path / "cache"
    stream, tok = data.prepare_stream(source=source, vocab=V, cache_dir=cache)
    [entry] = os.listdir(cache)  # corpus-v<V>-<key of the source's identity>
    assert re.fullmatch(f"corpus-v{V}-[0-9a-f]{{16}}", entry)
    assert stream == os.path.join(cache, entry, f"{entry}.tokens")
    assert tok == os.path.join(cache, entry, "tokenizer.json")
    assert len(counted) == 1
    st = os.stat(source)
    assert read_stream_header(stream) == (st.st_mtime_ns, st.st_size)
    opened = open_stream(stream, V)
    tokenizer = load_tokenizer(tok)
    assert tokenizer.decode(opened.ids.tolist()) == sample_text()
    written = os.stat(stream).st_mtime_ns

    assert data.prepare_stream(source=source, vocab=V, cache_dir=cache) == (stream, tok)
    assert len(counted) == 1 and os.stat(stream).st_mtime_ns == written

    # touched (same content, new mtime): the same documents, the entry stands
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert data.prepare_stream(source=source, vocab=V, cache_dir=cache) == (stream, tok)
    assert len(counted) == 1
    # changed: another entry (the source's identity is another); the first stays
    source.write_text(sample_text() + "one more line\n", encoding="utf-8")
    stream2, tok = data.prepare_stream(source=source, vocab=V, cache_dir=cache)
    assert stream2 != stream and len(counted) == 2 and os.path.exists(stream)

    # the tokenizer gone: rebuilt
    os.unlink(tok)
    data.prepare_stream(source=source, vocab=V, cache_dir=cache)
    assert len(counted) == 3 and os.path.exists(tok)

    # another vocabulary into the same stream file: rebuilt with it
    data.prepare_stream(source=source, vocab=V + 16, out=stream2, cache_dir=cache)
    assert len(counted) == 4
    # a stream at a path of its own (not keyed) is stale by its stamp: touched, rebuilt
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    data.prepare_stream(source=source, vocab=V + 16, out=stream2, cache_dir=cache)
    assert len(counted) == 5
    assert read_stream_header(stream2)[0] == st.st_mtime_ns + 2 * 10**9
    assert load_tokenizer(tok).get_vocab_size() == V + 16
    assert tokenizer_sha(tok) == hashlib.sha256(open(tok, "rb").read()).hexdigest()
    # the stored tokenizer is the JSON the library writes, with the byte-level parts
    spec = json.loads(open(tok, encoding="utf-8").read())
    assert spec["model"]["type"] == "BPE" and spec["pre_tokenizer"]["type"] == "ByteLevel"
    assert spec["pre_tokenizer"]["add_prefix_space"] is False


def test_a_given_stream_is_used_as_is(tmp_path, counted):
    stream = tmp_path / "s.tokens"
    stream.write_bytes(struct.pack("<qQ3I", 0, 0, 1, 2, 3))
    assert data.prepare_stream(stream=stream, vocab=V) == (str(stream), None)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert data.prepare_stream(stream=stream, vocab=V) == (
        str(stream), os.path.join(tmp_path, "tokenizer.json"))
    assert counted == []
    with pytest.raises(StreamError, match="nothere.tokens: no such token stream"):
        data.prepare_stream(stream=tmp_path / "nothere.tokens", vocab=V)
    # a folder is a folder of shards (SPEC 22), its tokenizer.json inside it
    assert data.prepare_stream(stream=tmp_path, vocab=V) == (
        str(tmp_path), os.path.join(tmp_path, "tokenizer.json"))


def test_a_missing_source_is_refused_naming_it(tmp_path):
    with pytest.raises(StreamError, match=r"source .*absent\.txt: no such file"):
        data.prepare_stream(source=tmp_path / "absent.txt", vocab=V, cache_dir=tmp_path)
    assert os.listdir(tmp_path) == []
    assert tokenizer_sha(tmp_path / "tokenizer.json") is None


# ---------------------------------------------------------------------------
# coppelius tokenize

def test_cli_tokenize_writes_a_valid_stream(tmp_path, capsys):
    source = tmp_path / "corpus.txt"
    source.write_text(sample_text(), encoding="utf-8")
    out = tmp_path / "out" / "c.tokens"
    assert main(["tokenize", str(source), "--out", str(out), "--vocab", str(V),
                 "--preset", "tiny"]) == 0
    printed = capsys.readouterr().out
    stream = open_stream(out, V)
    tok = tmp_path / "out" / "tokenizer.json"
    assert load_tokenizer(tok).decode(stream.ids.tolist()) == sample_text()
    assert f"wrote {out}: {len(stream):,} ids, {stream.n_contexts(256):,} contexts" in printed
    assert hashlib.sha256(tok.read_bytes()).hexdigest() in printed
    assert main(["tokenize", str(source), "--out", str(out), "--vocab", str(V),
                 "--preset", "tiny"]) == 0
    assert f"up to date {out}" in capsys.readouterr().out


def test_cli_tokenize_missing_source_exits_2_with_one_line(tmp_path, capsys):
    status = main(["tokenize", str(tmp_path / "absent.txt"), "--vocab", str(V),
                   "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "absent.txt" in err and "Traceback" not in err
    assert err.startswith("coppelius tokenize: error: ")


# ---------------------------------------------------------------------------
# A stream and its tokenizer.json stay a pair

def test_head_and_tail_encode_to_the_ends_of_the_whole_encoding(tokenizer, monkeypatch):
    text = sample_text()
    ids = tokenizer.encode(text, add_special_tokens=False).ids  # one call, no pieces
    other = train_tokenizer([other_text()], V)
    for size in (40, 700, 9000, 10**6):  # the last: one piece, no tail
        monkeypatch.setattr("coppelius.tokenizer.PIECE_CHARS", size)
        head, tail = data.head_and_tail(text)
        assert text.startswith(head) and text.endswith(tail) and len(head) >= min(size, len(text))
        assert bool(tail) == (len(head) < len(text))
        assert tokenizer.encode(head).ids == ids[:len(tokenizer.encode(head).ids)]
        assert tokenizer.encode(tail).ids == ids[len(ids) - len(tokenizer.encode(tail).ids):]
        arr = np.array(ids, dtype=np.uint32)
        assert data.encodes_to(tokenizer, text, arr)
        assert not data.encodes_to(other, text, arr)
        for at in (0, -1):
            wrong = arr.copy()
            wrong[at] = (wrong[at] + 1) % V
            assert data.encodes_to(tokenizer, text, wrong) == (at == -1 and not tail
                                                               and len(head) < len(text))
        assert not data.encodes_to(tokenizer, text, arr[:10])


def test_a_second_stream_in_a_folder_is_refused_naming_both(tmp_path, capsys):
    a_src, b_src = tmp_path / "a.txt", tmp_path / "b.txt"
    a_src.write_text(sample_text(), encoding="utf-8")
    b_src.write_text(other_text(), encoding="utf-8")
    folder = tmp_path / "d"
    args = ["--vocab", str(V), "--preset", "test"]
    assert main(["tokenize", str(a_src), "--out", str(folder / "a.tokens")] + args) == 0
    tok = folder / "tokenizer.json"
    before = tok.read_bytes()
    capsys.readouterr()
    assert main(["tokenize", str(b_src), "--out", str(folder / "b.tokens")] + args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("coppelius tokenize: error: stream ")
    assert str(folder / "b.tokens") in err and str(folder / "a.tokens") in err
    assert tok.read_bytes() == before
    assert sorted(os.listdir(folder)) == ["a.documents.json", "a.tokens", "a.tokens.sha256",
                                          "tokenizer.json"]
    assert main(["tokenize", str(a_src), "--out", str(folder / "a.tokens")] + args) == 0
    assert f"up to date {folder / 'a.tokens'}" in capsys.readouterr().out
    assert decodes_to(folder / "a.tokens", tok, sample_text())


def test_a_stream_beside_another_streams_tokenizer_is_rebuilt(tmp_path, counted):
    a_src, b_src = tmp_path / "a.txt", tmp_path / "b.txt"
    a_src.write_text(sample_text(), encoding="utf-8")
    b_src.write_text(other_text(), encoding="utf-8")
    a, a_tok = data.prepare_stream(source=a_src, vocab=V, out=tmp_path / "d" / "a.tokens")
    b, b_tok = data.prepare_stream(source=b_src, vocab=V, out=tmp_path / "e" / "b.tokens")
    a_sha = tokenizer_sha(a_tok)
    assert a_sha != tokenizer_sha(b_tok) and len(counted) == 2
    shutil.copyfile(b_tok, a_tok)  # same V, header still fresh: only the ids tell
    assert read_stream_header(a) == (os.stat(a_src).st_mtime_ns, os.stat(a_src).st_size)
    assert not data.is_fresh(a, a_src, V)
    data.prepare_stream(source=a_src, vocab=V, out=a)
    assert len(counted) == 3 and tokenizer_sha(a_tok) == a_sha
    assert decodes_to(a, a_tok, sample_text())


def failing_at(phase, count, error):
    """An fsutil._hook raising `error` at the count-th time `phase` is reached."""
    seen = []

    def hook(name):
        if name == phase:
            seen.append(name)
            if len(seen) == count:
                raise error
    return hook


def folder_bytes(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


# publish_pair writes the staged stream first (publication 1), then the
# tokenizer (publication 2), then renames the staged stream (then publishes
# the document list and the digest of the ids).
@pytest.mark.parametrize("publication", [1, 2])
def test_a_failed_rebuild_leaves_the_old_pair_as_it_was(tmp_path, monkeypatch, publication):
    source = tmp_path / "a.txt"
    source.write_text(sample_text(), encoding="utf-8")
    stream, tok = data.prepare_stream(source=source, vocab=V, out=tmp_path / "d" / "a.tokens")
    before = folder_bytes(tmp_path / "d")
    source.write_text(other_text(), encoding="utf-8")  # the cache is stale now
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(fsutil, "_hook", failing_at("written", publication, full))
    with pytest.raises(StreamError, match=r"a\.tokens|tokenizer\.json") as e:
        data.prepare_stream(source=source, vocab=V, out=stream)
    assert "No space left on device" in str(e.value)
    assert folder_bytes(tmp_path / "d") == before  # no temporary left either
    monkeypatch.setattr(fsutil, "_hook", None)
    assert decodes_to(stream, tok, sample_text())
    data.prepare_stream(source=source, vocab=V, out=stream)
    assert decodes_to(stream, tok, other_text())


class Crash(BaseException):
    """The process dying between two steps (not an error anything catches)."""


@pytest.mark.parametrize("change", ["source", "vocabulary"])
def test_a_crash_between_the_two_renames_is_rebuilt(tmp_path, monkeypatch, counted, change):
    source = tmp_path / "a.txt"
    source.write_text(sample_text(), encoding="utf-8")
    out = tmp_path / "d" / "a.tokens"
    stream, tok = data.prepare_stream(source=source, vocab=V, out=out)
    old_stream = out.read_bytes()
    vocab = V
    if change == "source":
        source.write_text(other_text(), encoding="utf-8")
    else:
        vocab = V + 16  # same source and header: only the ids tell the pair apart
    # the tokenizer is renamed (the first rename), the stream is not
    monkeypatch.setattr(fsutil, "_hook", failing_at("renamed", 1, Crash()))
    with pytest.raises(Crash):
        data.prepare_stream(source=source, vocab=vocab, out=out)
    monkeypatch.setattr(fsutil, "_hook", None)
    assert out.read_bytes() == old_stream and load_tokenizer(tok).get_vocab_size() == vocab
    assert not data.is_fresh(out, source, vocab)
    data.prepare_stream(source=source, vocab=vocab, out=out)
    assert len(counted) == 3 and data.is_fresh(out, source, vocab)
    assert decodes_to(out, tok, source.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------
# File-system failures are one line naming the path

def test_out_naming_a_directory_is_refused(tmp_path, capsys):
    source = tmp_path / "a.txt"
    source.write_text(sample_text(), encoding="utf-8")
    folder = tmp_path / "streams"
    folder.mkdir()
    with pytest.raises(StreamError, match=f"stream {folder}: is a directory"):
        data.prepare_stream(source=source, vocab=V, out=folder)
    assert main(["tokenize", str(source), "--out", str(folder), "--vocab", str(V)]) == 2
    err = capsys.readouterr().err
    assert err == f"coppelius tokenize: error: stream {folder}: is a directory, not a token stream file\n"
    assert os.listdir(folder) == [] and sorted(os.listdir(tmp_path)) == ["a.txt", "streams"]


@pytest.mark.parametrize("with_source", [True, False])
def test_a_cache_dir_that_cannot_be_made_is_one_line(tmp_path, capsys, with_source):
    source = tmp_path / "a.txt"
    source.write_text(sample_text(), encoding="utf-8")
    blocker = tmp_path / "file"  # a file where the cache's parent directory should be
    blocker.write_text("")
    cache = blocker / "cache"
    argv = ["tokenize"] + ([str(source)] if with_source else []) + [
        "--cache-dir", str(cache), "--vocab", str(V)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("coppelius tokenize: error: ")
    assert f"{cache}{os.sep}" in err and "cannot write (Not a directory" in err
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "file"]


# ---------------------------------------------------------------------------
# One cache for the user (COPPELIUS_CACHE: the test's own, tests/conftest.py)

def test_tokenize_and_train_share_the_default_cache(tmp_path, monkeypatch, capsys, counted,
                                                    stream_cache):
    root = tmp_path / "lib"  # a standard library of one file of real text
    root.mkdir()
    (root / "json.py").write_text(sample_text(), encoding="utf-8")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(root)})
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert data.default_cache_dir() == str(stream_cache)
    assert main(["tokenize", "--vocab", str(V), "--preset", "tiny"]) == 0
    [entry] = os.listdir(stream_cache)
    assert entry.startswith(f"{corpus.default_source_name()}-v{V}-")
    expected = os.path.join(stream_cache, entry, entry + ".tokens")
    assert f"wrote {expected}: " in capsys.readouterr().out
    # what `coppelius train` asks for: the default cache, no rebuild, from any folder
    monkeypatch.chdir(tmp_path)
    assert data.prepare_stream(vocab=V, cache_dir=None) == (
        expected, os.path.join(stream_cache, entry, "tokenizer.json"))
    assert len(counted) == 1
    # --cache-dir still puts it elsewhere
    assert main(["tokenize", "--vocab", str(V), "--cache-dir", str(tmp_path / "c")]) == 0
    assert len(counted) == 2 and (tmp_path / "c" / entry / f"{entry}.tokens").is_file()
    assert os.listdir(work) == []  # nothing under the working folder
