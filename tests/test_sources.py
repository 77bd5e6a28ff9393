"""Structured sources, existing tokenizers, document separators and
bounded-memory tokenization (SPEC 22): each stream's ids against the
`tokenizers` library's own batch encoding of the same documents, computed
here, with the separator appended; refusals as one line and exit 2; an
interrupted tokenization leaves nothing changed; the peak memory of
`coppelius tokenize` against the size of its corpus."""

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coppelius import corpus, data, hf
from coppelius.cli import main
from coppelius.plan import identity_hint
from coppelius.tokenizer import tokenizer_beside, tokenizer_sha, train_tokenizer

EOS = "<|endoftext|>"
VOCAB = 512


def words(n, seed=0):
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(1, 7)))
                  for _ in range(300)] + ["é", "日本", "🐍", "\t", "\n"]
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(0, 60)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE with <|endoftext|>, trained here with tokenizers alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(words(500, seed=9), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def library_ids(tokenizer_path, documents, eos=EOS):
    """What the stream must hold: tokenizers' encode_batch of each document,
    then the separator's id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tail = [] if eos is None else [tok.token_to_id(eos)]
    out = []
    for encoding in tok.encode_batch(documents, add_special_tokens=False):
        out.extend(encoding.ids + tail)
    return np.array(out, dtype=np.uint32)


def stream_ids(path):
    raw = open(path, "rb").read()
    return np.frombuffer(raw[16:], dtype="<u4")


def tokenize(capsys, *argv):
    status = main(["tokenize", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def write_jsonl(path, documents, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(documents):
            f.write(json.dumps({"id": i, field: text}) + "\n")


def test_jsonl_is_its_records_each_followed_by_the_tokenizers_eos(tmp_path, tokenizer_file,
                                                                  capsys):
    documents = words(300)
    write_jsonl(tmp_path / "a.jsonl", documents)
    out = tmp_path / "s" / "a.tokens"
    status, printed, err = tokenize(capsys, tmp_path / "a.jsonl", "--vocab", VOCAB,
                                    "--tokenizer", tokenizer_file, "--out", out)
    assert status == 0, err
    assert np.array_equal(stream_ids(out), library_ids(tokenizer_file, documents))
    assert f"{len(documents):,} documents" in printed and str(out) in printed
    assert "bytes per id" in printed
    # the header: the file's mtime and size (SPEC 8)
    st = os.stat(tmp_path / "a.jsonl")
    header = np.frombuffer(open(out, "rb").read(16), dtype=[("m", "<i8"), ("s", "<u8")])[0]
    assert (int(header["m"]), int(header["s"])) == (st.st_mtime_ns, st.st_size)
    # again: up to date, not rewritten
    status, printed, _ = tokenize(capsys, tmp_path / "a.jsonl", "--vocab", VOCAB,
                                  "--tokenizer", tokenizer_file, "--out", out)
    assert status == 0 and printed.startswith("up to date")


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_compressed_jsonl_is_read_as_the_plain_file(tmp_path, tokenizer_file, capsys, suffix):
    documents = words(200, seed=3)
    path = tmp_path / ("a" + suffix)
    if suffix.endswith(".gz"):
        write_jsonl(path, documents, opener=gzip.open)
    else:
        import zstandard

        body = "".join(json.dumps({"text": t}) + "\n" for t in documents).encode("utf-8")
        path.write_bytes(zstandard.ZstdCompressor().compress(body))
    out = tmp_path / "s" / "a.tokens"
    status, _, err = tokenize(capsys, path, "--vocab", VOCAB, "--tokenizer", tokenizer_file,
                              "--out", out)
    assert status == 0, err
    assert np.array_equal(stream_ids(out), library_ids(tokenizer_file, documents))


def test_parquet_by_row_group_with_a_text_field(tmp_path, tokenizer_file, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    documents = words(250, seed=4)
    table = pa.table({"n": list(range(len(documents))), "body": documents})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=64)
    assert pq.ParquetFile(tmp_path / "a.parquet").metadata.num_row_groups == 4
    out = tmp_path / "s" / "a.tokens"
    status, _, err = tokenize(capsys, tmp_path / "a.parquet", "--vocab", VOCAB, "--tokenizer",
                              tokenizer_file, "--text-field", "body", "--out", out)
    assert status == 0, err
    assert np.array_equal(stream_ids(out), library_ids(tokenizer_file, documents))


def test_a_folder_of_structured_files_in_the_keyed_file_order(tmp_path, tokenizer_file,
                                                              capsys):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    names = ["b.jsonl", "a.jsonl.gz", "sub/c.jsonl", "d.jsonl"]
    parts = {}
    for i, name in enumerate(names):
        parts[name] = words(40 + i, seed=10 + i)
        write_jsonl(folder / name, parts[name],
                    opener=gzip.open if name.endswith(".gz") else open)
    (folder / "notes.txt").write_text("not a record\n")
    out = tmp_path / "s" / "d.tokens"
    status, _, err = tokenize(capsys, folder, "--vocab", VOCAB, "--tokenizer", tokenizer_file,
                              "--out", out)
    assert status == 0, err
    ordered = sorted(names)  # sorted relative paths, then section 8's keyed order
    documents = [t for i in corpus.keyed_order(len(ordered)) for t in parts[ordered[i]]]
    assert np.array_equal(stream_ids(out), library_ids(tokenizer_file, documents))
    record = json.loads(open(data.documents_beside(out)).read())
    assert record["skipped"] == ["notes.txt"]


def test_own_bpe_with_eos_separates_documents_and_keeps_its_v(tmp_path, capsys):
    documents = words(400, seed=5)
    write_jsonl(tmp_path / "a.jsonl", documents)
    out = tmp_path / "s" / "a.tokens"
    status, _, err = tokenize(capsys, tmp_path / "a.jsonl", "--vocab", VOCAB, "--eos", EOS,
                              "--out", out)
    assert status == 0, err
    tokenizer = tokenizer_beside(out)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(tokenizer).get_vocab_size() == VOCAB
    ids = stream_ids(out)
    assert np.array_equal(ids, library_ids(tokenizer, documents))
    assert int((ids == Tokenizer.from_file(tokenizer).token_to_id(EOS)).sum()) == len(documents)


def test_own_bpe_on_records_without_eos_is_the_concatenation(tmp_path, capsys):
    documents = words(300, seed=6)
    write_jsonl(tmp_path / "a.jsonl", documents)
    out = tmp_path / "s" / "a.tokens"
    status, _, err = tokenize(capsys, tmp_path / "a.jsonl", "--vocab", VOCAB, "--out", out)
    assert status == 0, err
    assert np.array_equal(stream_ids(out),
                          library_ids(tokenizer_beside(out), documents, eos=None))


def test_a_text_folder_with_eos_separates_its_marked_documents(tmp_path, tokenizer_file, capsys):
    folder = tmp_path / "f"
    folder.mkdir()
    texts = {"x.txt": "alpha beta\n", "y.txt": "gamma", "z.txt": "delta\n\nepsilon\n"}
    for name, text in texts.items():
        (folder / name).write_text(text)
    out = tmp_path / "s" / "f.tokens"
    status, _, err = tokenize(capsys, folder, "--vocab", VOCAB, "--tokenizer", tokenizer_file,
                              "--out", out)
    assert status == 0, err
    names = sorted(texts)
    documents = []
    for i in corpus.keyed_order(len(names)):
        text = texts[names[i]]
        documents.append(f"# file: {names[i]}\n" + (text if text.endswith("\n") else text + "\n"))
    assert np.array_equal(stream_ids(out), library_ids(tokenizer_file, documents))


def test_an_eos_the_tokenizer_lacks_is_refused(tmp_path, tokenizer_file, capsys):
    write_jsonl(tmp_path / "a.jsonl", words(10))
    status, _, err = tokenize(capsys, tmp_path / "a.jsonl", "--vocab", VOCAB, "--tokenizer",
                              tokenizer_file, "--eos", "<nope>", "--out", tmp_path / "s" / "a.tokens")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "--eos" in err, err


def bad_jsonl(tmp_path):
    return [
        ("bad-json", '{"text": "a"}\n{"text": "b",\n', "line 2"),
        ("missing", '{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n', "line 3"),
        ("not-string", '{"text": 7}\n', "line 1"),
        ("not-object", '{"text": "a"}\n["text"]\n', "line 2"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, tokenizer_file, capsys, case):
    name, body, where = bad_jsonl(tmp_path)[case]
    path = tmp_path / f"{name}.jsonl"
    path.write_text(body)
    out = tmp_path / "s" / "a.tokens"
    status, _, err = tokenize(capsys, path, "--vocab", VOCAB, "--tokenizer", tokenizer_file,
                              "--out", out)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert str(path) in lines[0] and where in lines[0], lines[0]
    assert not out.exists() and not any(p.name.startswith(".") for p in out.parent.iterdir()) \
        if out.parent.exists() else True


def test_a_corrupt_gz_is_one_line(tmp_path, tokenizer_file, capsys):
    good = gzip.compress(("".join(json.dumps({"text": t}) + "\n" for t in words(2000))).encode())
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(good[:len(good) // 2])  # truncated
    status, _, err = tokenize(capsys, path, "--vocab", VOCAB, "--tokenizer", tokenizer_file,
                              "--out", tmp_path / "s" / "a.tokens")
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and str(path) in lines[0], err


@pytest.mark.parametrize("column,why", [("missing", "no such column"), ("n", "not a string")])
def test_a_bad_parquet_column_is_one_line(tmp_path, tokenizer_file, capsys, column, why):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"n": [1, 2], "text": ["a", "b"]}), tmp_path / "a.parquet")
    status, _, err = tokenize(capsys, tmp_path / "a.parquet", "--vocab", VOCAB, "--tokenizer",
                              tokenizer_file, "--text-field", column,
                              "--out", tmp_path / "s" / "a.tokens")
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and why in lines[0] and column in lines[0], err


def test_an_interrupted_tokenization_changes_nothing_published(tmp_path, tokenizer_file, capsys,
                                                               monkeypatch):
    source = tmp_path / "a.jsonl"
    write_jsonl(source, words(300))
    out = tmp_path / "s" / "a.tokens"
    assert tokenize(capsys, source, "--vocab", VOCAB, "--tokenizer", tokenizer_file,
                    "--out", out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    write_jsonl(source, words(600, seed=1))  # the source changes: the stream is rebuilt
    batches = data.document_batches

    def interrupted(documents, size=None):
        for i, batch in enumerate(batches(documents, size=2000)):
            if i == 3:
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(data, "document_batches", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.stream_for_source(source, VOCAB, out, tokenizer=tokenizer_file)
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before
    # and a fresh directory: no stream at all
    fresh = tmp_path / "t" / "a.tokens"
    with pytest.raises(KeyboardInterrupt):
        data.stream_for_source(source, VOCAB, fresh, tokenizer=tokenizer_file)
    assert not fresh.parent.exists()  # nor the folder made for it


PEAK = """
import resource, sys
from coppelius.cli import main
status = main(sys.argv[1:])
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
sys.exit(status)
"""


def peak_kib(tmp_path, tokenizer_file, megabytes):
    """Peak RSS (KiB) of `coppelius tokenize` on a JSONL corpus of about
    `megabytes` MB (one block of records written again and again)."""
    block = "".join(json.dumps({"text": t}) + "\n" for t in words(2000, seed=2))
    path = tmp_path / f"c{megabytes}.jsonl"
    with open(path, "w") as f:
        for _ in range(max(1, megabytes * 2**20 // len(block))):
            f.write(block)
    proc = subprocess.run([sys.executable, "-c", PEAK, "tokenize", str(path), "--vocab",
                           str(VOCAB), "--tokenizer", str(tokenizer_file), "--out",
                           str(tmp_path / f"s{megabytes}" / "c.tokens")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.split("PEAK")[-1].split()[0]), os.path.getsize(path)


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, tokenizer_file):
    small, small_bytes = peak_kib(tmp_path, tokenizer_file, 2)
    large, large_bytes = peak_kib(tmp_path, tokenizer_file, 18)
    assert large_bytes > 8 * small_bytes
    # 16 MB more source: held whole, its texts (~16 MB of str) and its ids
    # (~28 MB of uint32, more as Python lists) would add well over 40 MB
    print("peak KiB", small, large)
    assert large - small < 12 * 1024, (small, large)


def test_the_hf_export_names_the_separator(tmp_path):
    own = train_tokenizer(words(300), 300, eos=EOS)
    body = own.to_str().encode("utf-8")
    assert hf.tokenizer_eos(body) == (EOS, own.token_to_id(EOS))
    config = hf.tokenizer_config_json(corpus_config(), EOS)
    assert config["eos_token"] == EOS
    assert hf.generation_config_json(own.token_to_id(EOS))["eos_token_id"] == own.token_to_id(EOS)
    plain = train_tokenizer(words(300), 300)
    assert hf.tokenizer_eos(plain.to_str().encode("utf-8")) is None
    assert "eos_token" not in hf.tokenizer_config_json(corpus_config())


def corpus_config():
    from coppelius.reference import preset

    return preset("test")


def test_a_changed_tokenizer_is_named_with_the_continued_pretraining_command():
    header = {"learner": "lr=1", "data": "stream=a|tokenizer=aaa", "initialization": "x",
              "model": "m"}
    run = dict(header, data="stream=b|tokenizer=bbb")
    hint = identity_hint(header, run, {"data": True})
    assert "tokenizer aaa" in hint and "--tokenizer" in hint and "--new-data" in hint


def test_continued_pretraining_keeps_the_runs_tokenizer(tmp_path, capsys, monkeypatch):
    """train --run-dir D --source NEW --tokenizer <the run's tokenizer.json>
    --new-data goes on; another tokenizer is refused, naming the one the
    checkpoint was trained with and that command."""
    from tokenizers import Tokenizer

    from tests.test_run import imported_llama

    from coppelius.reference import checkpoint
    from coppelius.reference.stream import open_stream

    monkeypatch.chdir(tmp_path)
    imported, hf_dir, text, config = imported_llama(tmp_path, capsys)
    run_dir = tmp_path / "run"
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    write_jsonl(first, text.split("\n\n"))
    new_documents = [t for t in text.split("\n") if t][::-1]
    write_jsonl(second, new_documents, opener=gzip.open)
    common = ["--new-data", "--steps", "1", "--backend", "reference", "--no-sample"]
    assert main(["train", "--checkpoint", str(imported), "--run-dir", str(run_dir), "--source",
                 str(first), "--tokenizer", str(hf_dir), *common]) == 0, capsys.readouterr().err
    own = tokenizer_beside(imported)  # the run's copy of its tokenizer
    assert open(own, "rb").read() == (hf_dir / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), "--source", str(second), "--tokenizer",
                 own, *common]) == 0, capsys.readouterr().err
    assert checkpoint.validate(imported).header["step"] == 2
    [stream_path] = [p for p in Path(os.environ["COPPELIUS_CACHE"]).glob("b-*/*.tokens")]
    stream = open_stream(stream_path, config.vocab)
    assert np.array_equal(stream.ids, library_ids(own, new_documents, eos=None))
    stream.close()
    # another tokenizer: refused on the data identity, the hint says how to go on
    other = Tokenizer.from_file(own)
    other.add_tokens(["zzzq"])
    other_path = tmp_path / "other" / "tokenizer.json"
    other_path.parent.mkdir()
    other.save(str(other_path))
    capsys.readouterr()
    status = main(["train", "--run-dir", str(run_dir), "--source", str(second), "--tokenizer",
                   str(other_path), *common])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert tokenizer_sha(own) in err and f"--tokenizer {own})" in err, err  # it works: above
