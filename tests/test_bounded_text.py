"""Plain-text sources tokenized in bounded memory (SPEC 22): files and
folders are read a block at a time and cut into the pieces the whole text
would be cut into, so the stream and its tokenizer are byte for byte those
of the whole-text path (the source joined in memory, trained on and encoded
by coppelius.tokenizer.pieces), and what is held at once does not grow with the source."""

import os
import sysconfig
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coppelius import corpus, data
from coppelius.reference.stream import open_stream
from coppelius.tokenizer import encode, pieces, stream_pieces, tokenizer_beside, train_tokenizer

V = 300
# characters that make the piece boundaries (printable ASCII around a
# newline), break them (spaces, tabs, other newlines) and need several UTF-8
# bytes (a block may cut one in two)
ALPHABET = st.sampled_from(list("ab Z!~\n\n\t\r") + ["é", "\u2028", "😀", "\x85"])
TEXTS = st.text(ALPHABET, max_size=400)


def base_text() -> str:
    """Real text that yields V ids (the json package of the running Python)."""
    root = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    return "".join(open(os.path.join(root, n), encoding="utf-8").read()
                   for n in sorted(os.listdir(root)) if n.endswith(".py"))


def whole_text_path(text: str, vocab: int):
    """The stream's ids and tokenizer as the source joined in memory gives them."""
    tokenizer = train_tokenizer([text], vocab)
    return encode(tokenizer, text), tokenizer.to_str()


@pytest.fixture
def small_bounds(monkeypatch):
    """Blocks, pieces and groups small enough that a small source crosses many."""
    monkeypatch.setattr(corpus, "SNIFF_BYTES", 7)
    monkeypatch.setattr(corpus, "BLOCK_BYTES", 61)
    monkeypatch.setattr("coppelius.tokenizer.PIECE_CHARS", 97)
    monkeypatch.setattr(data, "ENCODE_PIECES", 3)


@settings(max_examples=200)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 400), max_size=12),
       size=st.integers(1, 40))
def test_stream_pieces_are_the_pieces_of_the_whole_text(text, cuts, size):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert list(stream_pieces(chunks, size)) == list(pieces(text, size))


@settings(max_examples=15, deadline=None)
@given(documents=st.lists(TEXTS, min_size=1, max_size=6))
def test_a_folder_streams_to_the_ids_of_the_whole_text(tmp_path_factory, documents):
    """A folder of drawn documents (and a real one that yields V ids):
    the stream, its tokenizer and its freshness are those of the whole
    text, with blocks, pieces and groups far smaller than the documents."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "SNIFF_BYTES", 7)
        mp.setattr(corpus, "BLOCK_BYTES", 61)
        mp.setattr("coppelius.tokenizer.PIECE_CHARS", 97)
        mp.setattr(data, "ENCODE_PIECES", 3)
        folder = tmp_path_factory.mktemp("src")
        (folder / "base.txt").write_text(base_text(), encoding="utf-8", newline="")
        for i, text in enumerate(documents):
            (folder / f"d{i}.txt").write_text(text, encoding="utf-8", newline="")
        listing = corpus.list_source(folder)
        text = listing.text()
        assert listing.text_bytes == len(text.encode("utf-8"))
        want_ids, want_tokenizer = whole_text_path(text, V)
        out = tmp_path_factory.mktemp("c") / "a.tokens"
        data.prepare_stream(source=folder, vocab=V, out=out)
        assert np.array_equal(open_stream(out, V).ids, want_ids)
        assert open(tokenizer_beside(out), encoding="utf-8").read() == want_tokenizer
        assert data.is_fresh(out, folder, V)


def test_a_file_several_times_the_bounds_is_tokenized_in_bounded_memory(tmp_path, small_bounds,
                                                                      monkeypatch):
    """A 2 MB file, hundreds of times the block (4 KiB) and the group of
    pieces (3 x 4,000 characters): what Python holds at the peak stays near
    those bounds, where the whole-text path holds the text and every id
    (more than 5 MB); the ids are the whole-text path's."""
    monkeypatch.setattr(corpus, "BLOCK_BYTES", 4096)
    monkeypatch.setattr("coppelius.tokenizer.PIECE_CHARS", 4000)
    text = base_text()
    source = tmp_path / "big.txt"
    with open(source, "w", encoding="utf-8", newline="") as f:
        while f.tell() < 2_000_000:
            f.write(text)
    out = tmp_path / "c" / "a.tokens"
    tracemalloc.start()
    try:
        data.prepare_stream(source=source, vocab=V, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the trainer of `tokenizers` takes 256 pieces at a time (about 1 MB of
    # them here): the bound is that, not the file's 2 MB and its ids' 3 MB
    assert peak < 2_000_000, peak
    whole = source.read_text(encoding="utf-8")
    want_ids, want_tokenizer = whole_text_path(whole, V)
    assert np.array_equal(open_stream(out, V).ids, want_ids)
    assert open(tokenizer_beside(out), encoding="utf-8").read() == want_tokenizer


def test_a_document_changed_after_it_was_listed_stops_with_one_line(tmp_path):
    """A listing holds no text: a document that changes before it is read
    stops the tokenization, naming it, and nothing is published."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.txt").write_text(base_text())
    listing = corpus.list_source(folder)
    with open(folder / "a.txt", "a") as f:
        f.write("more\n")
    out = tmp_path / "c" / "a.tokens"
    with pytest.raises(data.StreamError, match="a.txt: changed since it was listed"):
        data.tokenize_source(listing, out, V)
    assert not (tmp_path / "c").exists()
