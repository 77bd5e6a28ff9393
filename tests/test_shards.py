"""Pre-tokenized shards and a validation set of its own (SPEC section 22):
llm.c shards (both versions), nanoGPT's raw uint16 .bin, folders and globs
of them, read as the project's own stream of the same ids would be."""

import hashlib
import json
import os

import numpy as np
import pytest

from coppelius import shards
from coppelius.cli import main
from coppelius.reference import results
from coppelius.reference.binding import load_state
from coppelius.reference.config import PRESETS
from coppelius.reference.stream import write_stream

CFG = PRESETS["test"]
T = CFG.context


def known_ids(contexts: int, seed: int = 3) -> np.ndarray:
    """(contexts T + 1,) ids below V: a learnable pattern with some noise."""
    rng = np.random.default_rng(seed)
    ids = (np.arange(contexts * T + 1) * 5 % CFG.vocab).astype(np.int64)
    noisy = rng.random(ids.size) < 0.1
    ids[noisy] = rng.integers(0, CFG.vocab, noisy.sum())
    return ids


def llmc_shard(path, ids, version: int, count: int | None = None, magic: int = 20240520):
    """llm.c's layout, written out here: 256 little-endian int32 (magic,
    version, count, zeros), then the ids as uint16 (version 1) or uint32."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    body = np.asarray(ids).astype("<u2" if version == 1 else "<u4")
    path.write_bytes(header.tobytes() + body.tobytes())
    return str(path)


def raw_bin(path, ids):
    path.write_bytes(np.asarray(ids).astype("<u2").tobytes())
    return str(path)


def own_stream(path, ids):
    write_stream(path, np.asarray(ids), source_mtime_ns=0, source_size=0)
    return str(path)


def windows(ids, T):
    """Section 8 written out again: context c is ids[T c : T c + T + 1]."""
    K = (len(ids) - 1) // T
    return np.stack([ids[T * c:T * c + T + 1] for c in range(K)]).astype(np.int64)


def split(ids, cuts):
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]


def forms(tmp_path, ids):
    """Every --stream form of the same ids -> {name: spec}."""
    out = {"v1": llmc_shard(tmp_path / "one_v1.bin", ids, 1),
           "v2": llmc_shard(tmp_path / "one_v2.bin", ids, 2),
           "raw": raw_bin(tmp_path / "nano.bin", ids)}
    folder = tmp_path / "folder"
    folder.mkdir()
    # uneven shards, so that contexts straddle them; names sort in stream order
    for i, part in enumerate(split(ids, [7, 7 + 3 * T + 5, 7 + 5 * T])):
        llmc_shard(folder / f"train_{i:06d}.bin", part, 1 + i % 2)
    (folder / "README.txt").write_text("not a shard: left out")
    out["folder"] = str(folder)
    globbed = tmp_path / "globbed"
    globbed.mkdir()
    for i, part in enumerate(split(ids, [T + 1, 2 * T + 3])):
        raw_bin(globbed / f"part-{i}.bin", part)
    raw_bin(globbed / "other-0.bin", ids[:10])  # not matched
    out["glob"] = str(globbed / "part-*.bin")
    return out


@pytest.mark.parametrize("form", ["v1", "v2", "raw", "folder", "glob"])
def test_every_form_reads_the_contexts_of_its_ids(tmp_path, form):
    ids = known_ids(9)
    spec = forms(tmp_path, ids)[form]
    s = shards.open_any(spec, CFG.vocab)
    try:
        assert isinstance(s, shards.ShardStream) and len(s) == len(ids)
        want = windows(ids, T)
        assert s.n_contexts(T) == len(want) == 9
        assert np.array_equal(s.contexts(range(9), T), want)
        assert np.array_equal(s.batch(2, 4, T), want[2:6])
        assert np.array_equal(s.batch(7, 4, T, repeat=True, contexts=8), want[[7, 0, 1, 2]])
        # the digest: the ids as little-endian uint32, whatever the file's id type
        assert s.sha256 == hashlib.sha256(ids.astype("<u4").tobytes()).hexdigest()
        assert all(isinstance(m, np.memmap) for m in s._maps)
    finally:
        s.close()


def test_the_own_stream_is_read_as_before_with_the_same_digest(tmp_path):
    from coppelius.reference.stream import Stream

    ids = known_ids(4)
    s = shards.open_any(own_stream(tmp_path / "s.tokens", ids), CFG.vocab)
    assert type(s) is Stream
    assert s.sha256 == hashlib.sha256(ids.astype("<u4").tobytes()).hexdigest()
    s.close()


def train_args(spec, run_dir, *extra):
    return ["train", "--preset", "test", "--backend", "reference", "--stream", spec,
            "--run-dir", str(run_dir), "--checkpoint", str(run_dir / "ck.bin"), "--no-sample",
            "--batch", "2", "--steps", "3", "--eval-contexts", "2", *extra]


def test_training_on_shards_is_training_on_the_own_stream_of_their_ids(tmp_path):
    ids = known_ids(12)
    spec = forms(tmp_path, ids)["folder"]
    own = own_stream(tmp_path / "own.tokens", ids)
    assert main(train_args(spec, tmp_path / "a")) == 0
    assert main(train_args(own, tmp_path / "b")) == 0
    ra = results.read_results(str(tmp_path / "a" / "results-0.bin"))
    rb = results.read_results(str(tmp_path / "b" / "results-0.bin"))
    assert [s for s, _ in ra.steps] == [0, 1, 2]
    for (_, x), (_, y) in zip(ra.steps, rb.steps):
        assert x.tobytes() == y.tobytes()
    assert [e[2].tobytes() for e in ra.evals] == [e[2].tobytes() for e in rb.evals]
    # the same ids are the same data identity: the checkpoints are one file
    assert (tmp_path / "a" / "ck.bin").read_bytes() == (tmp_path / "b" / "ck.bin").read_bytes()
    # and the run remembers the folder
    with open(tmp_path / "a" / "run.json") as f:
        assert json.load(f)["options"]["stream"] == os.path.abspath(spec)


def test_the_digest_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    calls = []
    digest = shards.digest

    def counting(stream):
        calls.append(stream.path)
        return digest(stream)

    monkeypatch.setattr(shards, "digest", counting)
    ids = known_ids(9)
    spec = forms(tmp_path, ids)["folder"]
    want = hashlib.sha256(ids.astype("<u4").tobytes()).hexdigest()
    for _ in range(2):
        s = shards.open_any(spec, CFG.vocab)
        assert s.sha256 == want
        s.close()
    assert len(calls) == 1
    caches = [n for n in os.listdir(spec) if n.startswith(".coppelius-ids-")]
    assert len(caches) == 1
    first = os.path.join(spec, "train_000000.bin")
    st = os.stat(first)
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # mtime moved: taken again
    assert shards.open_any(spec, CFG.vocab).sha256 == want and len(calls) == 2
    assert shards.open_any(spec, CFG.vocab).sha256 == want and len(calls) == 2
    # another size (an id more), same mtime: taken again, and the new digest
    more = np.concatenate([ids, [1]])
    parts = split(more, [7, 7 + 3 * T + 5, 7 + 5 * T])
    last = os.path.join(spec, "train_000003.bin")
    st = os.stat(last)
    llmc_shard(type(tmp_path)(last), parts[3], 2)
    os.utime(last, ns=(st.st_atime_ns, st.st_mtime_ns))
    s = shards.open_any(spec, CFG.vocab)
    assert len(calls) == 3 and s.sha256 == hashlib.sha256(more.astype("<u4").tobytes()).hexdigest()
    # a cache that cannot be written (a read-only folder) is not kept; the stream still opens
    monkeypatch.setattr(shards.fsutil, "publish", lambda *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")))
    for name in caches:
        os.unlink(os.path.join(spec, name))
    for _ in range(2):
        assert shards.open_any(spec, CFG.vocab).sha256 == s.sha256
    assert len(calls) == 5
    assert not [n for n in os.listdir(spec) if n.startswith(".coppelius-ids-")]


def one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_bad_shards_are_one_line_exit_2(tmp_path, capsys):
    ids = known_ids(4)
    run = tmp_path / "run"
    bad = {
        "version": llmc_shard(tmp_path / "version.bin", ids, 3),
        "count": llmc_shard(tmp_path / "count.bin", ids, 2, count=len(ids) + 1),
        "odd": str(tmp_path / "odd.bin"),
        "big": llmc_shard(tmp_path / "big.bin", np.concatenate([ids[:20], [CFG.vocab]]), 1),
    }
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    one_line_error(capsys, train_args(bad["version"], run), "version.bin", "version 3",
                   "offset 4")
    one_line_error(capsys, train_args(bad["count"], run), "count.bin", f"count {len(ids) + 1}",
                   "offset 8")
    one_line_error(capsys, train_args(bad["odd"], run), "odd.bin", "stray byte")
    one_line_error(capsys, train_args(bad["big"], run), "big.bin", f"id {CFG.vocab}",
                   f"offset {1024 + 2 * 20}", f"V={CFG.vocab}")
    # a shard of another magic among llm.c shards
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    llmc_shard(mixed / "a.bin", ids[:100], 1)
    llmc_shard(mixed / "b.bin", ids[100:], 1, magic=20240521)
    one_line_error(capsys, train_args(str(mixed), run), "b.bin", "magic 20240521")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(capsys, train_args(str(empty), run), f"--stream {empty}", "no shard")
    one_line_error(capsys, train_args(str(tmp_path / "none-*.bin"), run), "none-*.bin",
                   "matches no file")
    assert not run.exists()


def test_inspect_reads_every_form(tmp_path, capsys):
    ids = known_ids(5)
    f = forms(tmp_path, ids)
    f["own"] = own_stream(tmp_path / "own.tokens", ids)
    want = hashlib.sha256(ids.astype("<u4").tobytes()).hexdigest()
    kinds = {"v1": ["llm.c v1, uint16"], "v2": ["llm.c v2, uint32"], "raw": ["raw uint16"],
             "folder": ["llm.c v1, uint16", "llm.c v2, uint32"], "glob": ["raw uint16"],
             "own": ["coppelius, uint32"]}
    for name, spec in f.items():
        assert main(["inspect", spec]) == 0
        out = capsys.readouterr().out
        assert f"sha256          {want}" in out and f"ids             {len(ids)}" in out, out
        assert f"largest id      {ids.max()}" in out
        for kind in kinds[name]:
            assert kind in out, out
    assert "shards          4" in capsys.readouterr().out or main(["inspect", f["folder"]]) == 0
    assert "shards          4" in capsys.readouterr().out


def test_an_eval_stream_is_evaluated_and_none_of_the_stream_held_out(tmp_path, capsys):
    """--eval-stream: kind-5 records over its first K contexts, computed
    again here with the reference forward; training reads every context of
    its own stream; the data identity gains |eval=<its digest>."""
    from coppelius import reference

    train_ids, eval_ids = known_ids(10, seed=1), known_ids(8, seed=2)
    stream = own_stream(tmp_path / "train.tokens", train_ids)
    held = llmc_shard(tmp_path / "val.bin", eval_ids, 1)
    run = tmp_path / "run"
    argv = ["train", "--preset", "test", "--backend", "reference", "--stream", stream,
            "--run-dir", str(run), "--no-sample", "--batch", "2", "--eval-stream", held,
            "--eval-contexts", "3", "--eval-every", "2"]
    assert main([*argv, "--steps", "5", "--batch", "2"]) == 0  # 10 contexts, all for training
    ck = load_state(str(run / "checkpoint.bin"), CFG)
    sha = hashlib.sha256(eval_ids.astype("<u4").tobytes()).hexdigest()
    assert ck.header["data"].endswith(f"|eval={sha}") and "heldout=" not in ck.header["data"]
    assert ck.contexts == 10
    r = results.read_results(str(run / "results-0.bin"))
    assert [e[0] for e in r.evals] == [2, 4, 5]
    want = reference.row_losses(CFG, ck.state.P, windows(eval_ids, T)[:3]).astype(
        np.float64).mean(axis=1)
    assert np.allclose(r.evals[-1][2], want, rtol=1e-6)
    with open(run / "run.json") as f:
        assert json.load(f)["options"]["eval_stream"] == held
    # a resume keeps it (remembered); the repeated data reads contexts mod 10
    resume = ["train", "--run-dir", str(run), "--no-sample", "--backend", "reference",
              "--steps", "1", "--repeat-data"]
    assert main(resume) == 0
    r = results.read_results(str(run / "results-5.bin"))
    ck = load_state(str(run / "checkpoint.bin"), CFG)
    want = reference.row_losses(CFG, ck.state.P, windows(eval_ids, T)[:3]).astype(
        np.float64).mean(axis=1)
    assert [e[0] for e in r.evals] == [6] and np.allclose(r.evals[0][2], want, rtol=1e-6)
    capsys.readouterr()
    # another validation set is another data identity: refused, unless --new-data
    other = llmc_shard(tmp_path / "val2.bin", known_ids(8, seed=4), 2)
    one_line_error(capsys, [*resume, "--eval-stream", other], "data identity", "eval=")
    assert main([*resume, "--eval-stream", other, "--new-data"]) == 0
    # coppelius eval takes the run's eval stream's first K
    capsys.readouterr()
    assert main(["eval", str(run / "checkpoint.bin"), "--backend", "reference"]) == 0
    assert "the first 3 of 8 contexts of " + other in capsys.readouterr().out


def test_an_eval_source_without_a_tokenizer_is_refused(tmp_path, capsys):
    stream = own_stream(tmp_path / "train.tokens", known_ids(10))
    text = tmp_path / "val.txt"
    text.write_text("held out\n")
    run = tmp_path / "run"
    one_line_error(capsys, train_args(stream, run, "--eval-source", str(text)),
                   f"--eval-source {text}", "no tokenizer")
    one_line_error(capsys, train_args(stream, run, "--eval-stream", str(tmp_path / "nope.bin")),
                   "nope.bin")


def test_an_eval_source_is_tokenized_with_the_runs_tokenizer(tmp_path, monkeypatch):
    """--eval-source: encoded by the tokenizer beside the run's stream; its
    first K contexts are those of the ids `tokenizers` itself gives."""
    from tokenizers import Tokenizer, models

    from coppelius import reference

    monkeypatch.chdir(tmp_path)  # the default run directory here (the stream cache: conftest's)
    letters = "abcdefghijklmnopqrstuvwxyz ,.\n"
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(letters)}, merges=[]))
    folder = tmp_path / "train"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    stream = own_stream(folder / "train.tokens", known_ids(6) % len(letters))
    text = "the quick brown fox jumps over the lazy dog, again and again.\n" * 3
    (tmp_path / "val.txt").write_text(text)
    want_ids = np.array(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)
    assert len(want_ids) == len(text)  # one id a character: the encoding is the letters
    run = tmp_path / "run"
    assert main(["train", "--preset", "test", "--backend", "reference", "--stream", stream,
                 "--run-dir", str(run), "--no-sample", "--batch", "2", "--steps", "2",
                 "--eval-source", str(tmp_path / "val.txt"), "--eval-contexts", "4"]) == 0
    ck = load_state(str(run / "checkpoint.bin"), CFG)
    sha = hashlib.sha256(want_ids.astype("<u4").tobytes()).hexdigest()
    assert ck.header["data"].endswith(f"|eval={sha}")
    r = results.read_results(str(run / "results-0.bin"))
    want = reference.row_losses(CFG, ck.state.P, windows(want_ids, T)[:4]).astype(
        np.float64).mean(axis=1)
    assert [e[0] for e in r.evals] == [2] and np.allclose(r.evals[0][2], want, rtol=1e-6)
