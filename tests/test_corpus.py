"""Sources as lists of documents in the keyed order (SPEC section 8): a
folder's documents, what is skipped, the cache of a folder's stream and when
it goes stale, and `coppelius tokenize DIR`."""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from coppelius import corpus, data
from coppelius.cli import main
from coppelius.reference.errors import StreamError
from coppelius.reference.stream import open_stream, read_stream_header
from coppelius.tokenizer import load_tokenizer, tokenizer_beside

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 300  # 256 byte symbols and 44 merges: trains in milliseconds
M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    """SPEC 2's splitmix64 finalizer on plain Python ints."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def keyed(names) -> list:
    """SPEC 8, computed here: document i of the sorted names has the key
    mix(20260925 + (i + 1) * GAMMA); the text goes by increasing key."""
    keys = {n: mix((20260925 + (i + 1) * GAMMA) & M64) for i, n in enumerate(sorted(names))}
    return sorted(keys, key=keys.get)


def real_text(name: str) -> str:
    """A module of the running Python: real text to fill a document with."""
    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
        return f.read()


def write(root, files: dict) -> None:
    for rel, body in files.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(body if isinstance(body, bytes) else body.encode("utf-8"))


TEXTS = {  # relative path -> text: a document each
    "b.py": real_text("textwrap.py"),
    "a/z.txt": real_text("shlex.py"),
    "a-b.md": "no final newline",
    "a/c/d.txt": real_text("colorsys.py"),
    "\u00e9t\u00e9.txt": "caf\u00e9 \u2014 UTF-8 in the name and the text\n",
    "empty.txt": "",
    "late-nul.txt": "x" * 9000 + "\n",  # 8 KiB of text first: looked at whole, still text
    "bom.txt": "\ufeffa byte-order mark is text\n",
}
BINARY = {
    "img.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",  # a NUL within the first 8 KiB
    "late.bin": b"y" * 9000 + b"\x00",  # a NUL after the first 8 KiB
    "latin1.txt": "caf\u00e9\n".encode("latin-1"),  # not UTF-8
    "utf16.txt": "text".encode("utf-16"),
}
HIDDEN = {".git/config": "[core]\n", ".hidden.txt": "not read\n", "a/.swp": "not read\n"}


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "notes"
    write(root, {**TEXTS, **BINARY, **HIDDEN})
    return root


def expected_text(texts: dict) -> str:
    out = []
    for rel in keyed(texts):
        body = texts[rel]
        out.append(f"# file: {rel}\n" + body + ("\n" if body and not body.endswith("\n") else ""))
    return "".join(out)


def test_a_folder_is_its_text_files_in_the_keyed_order(folder):
    listing = corpus.list_source(folder)
    assert listing.kind == corpus.FOLDER and listing.name == "notes"
    assert listing.documents == keyed(TEXTS) != sorted(TEXTS)
    assert listing.text() == expected_text(TEXTS)
    assert listing.binary == sorted(BINARY) and listing.skipped == []
    newest = max(os.stat(folder / rel).st_mtime_ns for rel in TEXTS)
    assert listing.stamp == (newest, sum(len(t.encode("utf-8")) for t in TEXTS.values()))
    assert listing.summary() == "8 documents, 4 binary files skipped"


def test_the_order_and_the_stream_do_not_depend_on_where_the_folder_is(folder, tmp_path):
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(folder, copy)
    assert corpus.list_source(copy).text() == corpus.list_source(folder).text()
    a, _ = data.prepare_stream(source=folder, vocab=V, out=tmp_path / "s1" / "a.tokens")
    b, _ = data.prepare_stream(source=copy, vocab=V, out=tmp_path / "s2" / "b.tokens")
    assert open(a, "rb").read()[16:] == open(b, "rb").read()[16:]  # the ids, byte for byte


def test_a_single_file_is_one_document_as_it_is(tmp_path):
    source = tmp_path / "one.txt"
    source.write_text("no marker, no added newline", encoding="utf-8")
    listing = corpus.list_source(source)
    assert listing.kind == corpus.FILE and listing.text() == "no marker, no added newline"
    assert listing.documents == ["one.txt"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_links_fifos_and_sockets_are_skipped_without_blocking(folder, tmp_path):
    outside = tmp_path / "outside"
    write(outside, {"secret.txt": "outside the tree\n"})
    os.symlink(outside, folder / "linked-dir")
    os.symlink(outside / "secret.txt", folder / "linked.txt")
    os.mkfifo(folder / "a" / "pipe.txt")  # opening it for reading would block: never opened
    # in a new process with a time limit: a read that blocks fails the test
    # instead of hanging the suite
    code = textwrap.dedent(f"""
        from coppelius import corpus
        listing = corpus.list_source({str(folder)!r})
        print(listing.skipped, len(listing.documents))
        print(corpus.open_regular_file({str(folder / "a" / "pipe.txt")!r}))
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    skipped, count = p.stdout.splitlines()[0].rsplit(" ", 1)
    assert skipped == str(["a/pipe.txt", "linked-dir", "linked.txt"]) and int(count) == len(TEXTS)
    assert p.stdout.splitlines()[1] == "None"
    assert "outside the tree" not in corpus.list_source(folder).text()


def test_an_empty_folder_is_refused_with_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    write(empty, {".git/HEAD": "ref\n"})
    with pytest.raises(StreamError, match=f"source {empty}: a folder with no text file"):
        corpus.list_source(empty)
    write(tmp_path / "binaries", BINARY)
    status = main(["tokenize", str(tmp_path / "binaries"), "--vocab", str(V),
                   "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "binaries: a folder with no text file" in err and "4 binary files skipped" in err
    assert not (tmp_path / "cache").exists()


def test_cli_tokenize_a_folder_counts_documents_and_binary_files(folder, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert main(["tokenize", str(folder), "--vocab", str(V), "--preset", "test",
                 "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"folder {folder}: 8 documents, 4 binary files skipped" in out
    [entry] = cache.glob(f"notes-dir-v{V}-*")  # a folder's cache entry, keyed (SPEC 8)
    stream = entry / f"{entry.name}.tokens"
    tok = stream.parent / "tokenizer.json"
    ids = open_stream(stream, V).ids
    assert load_tokenizer(tok).decode(ids.tolist()) == expected_text(TEXTS)
    assert data.read_documents(stream)["documents"] == keyed(TEXTS)
    assert data.documents_summary(stream) == "8 documents, 4 binary files skipped"


def test_a_folder_and_a_file_of_the_same_name_have_cache_entries_of_their_own(folder, tmp_path):
    (tmp_path / "notes.txt").write_text(real_text("shlex.py"), encoding="utf-8")
    cache = tmp_path / "cache"
    a, _ = data.prepare_stream(source=folder, vocab=V, cache_dir=cache)
    b, _ = data.prepare_stream(source=tmp_path / "notes.txt", vocab=V, cache_dir=cache)
    assert os.path.dirname(a) != os.path.dirname(b)
    assert [name.rsplit("-", 1)[0] for name in sorted(os.listdir(cache))] == [
        f"notes-dir-v{V}", f"notes-v{V}"]


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = data.tokenize_source

    def tokenize_source(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "tokenize_source", tokenize_source)
    return calls


def test_a_folders_stream_goes_stale_when_any_document_changes(folder, tmp_path, counted):
    out = tmp_path / "cache" / "n.tokens"

    def build():
        stream, tok = data.prepare_stream(source=folder, vocab=V, out=out)
        return load_tokenizer(tok).decode(open_stream(stream, V).ids.tolist())

    texts = dict(TEXTS)
    assert build() == expected_text(texts) and len(counted) == 1
    assert build() == expected_text(texts) and len(counted) == 1  # fresh: reused

    # a document edited (a new mtime, the same size)
    body = (folder / "b.py").read_bytes()
    (folder / "b.py").write_bytes(body.replace(b"import", b"IMPORT", 1))
    texts["b.py"] = body.replace(b"import", b"IMPORT", 1).decode("utf-8")
    assert build() == expected_text(texts) and len(counted) == 2

    # renamed: the header does not move (same mtimes, same total size), the
    # order does; only the document list tells
    header = read_stream_header(out)
    os.rename(folder / "a-b.md", folder / "zz.md")
    texts["zz.md"] = texts.pop("a-b.md")
    assert corpus.list_source(folder).stamp == header
    assert build() == expected_text(texts) and len(counted) == 3

    # an empty document deleted: the same newest mtime and total size again
    header = read_stream_header(out)
    os.unlink(folder / "empty.txt")
    del texts["empty.txt"]
    assert corpus.list_source(folder).stamp == header
    assert build() == expected_text(texts) and len(counted) == 4

    # a binary file added: the same documents, the stream stands; the
    # summary beside it counts the new file
    (folder / "more.bin").write_bytes(b"\x00\x01")
    assert build() == expected_text(texts) and len(counted) == 4
    assert data.documents_summary(out) == "7 documents, 5 binary files skipped"

    # the document list lost: rebuilt rather than trusted
    os.unlink(data.documents_beside(out))
    assert build() == expected_text(texts) and len(counted) == 5


def test_the_document_list_is_published_after_the_stream(folder, tmp_path, monkeypatch):
    """A crash before the list is published leaves the old list beside the
    new stream: turned down, never taken for fresh (a renamed document is
    told apart only by the list)."""
    from coppelius.reference import fsutil

    out = tmp_path / "cache" / "n.tokens"
    data.prepare_stream(source=folder, vocab=V, out=out)
    os.rename(folder / "a-b.md", folder / "zz.md")
    published = []

    class Crash(BaseException):
        pass

    def hook(phase):
        if phase == "renamed":  # the tokenizer, the stream, then the list
            published.append(phase)
            if len(published) == 2:
                raise Crash()

    monkeypatch.setattr(fsutil, "_hook", hook)
    with pytest.raises(Crash):
        data.prepare_stream(source=folder, vocab=V, out=out)
    monkeypatch.setattr(fsutil, "_hook", None)
    now = corpus.list_source(folder)
    tok = load_tokenizer(tokenizer_beside(out))
    assert tok.decode(open_stream(out, V).ids.tolist()) == now.text()  # the new stream
    assert data.read_documents(out)["documents"] != now.documents  # the old list
    assert not data.is_fresh(out, folder, V)
