"""Hostile input and misuse: special files, hangs, hostile headers, paths
that collide, two processes on one file. Every case ends in a one-line
error and exit status 2 (or a correct result), never in a hang: anything
that could block runs under a deadline (a subprocess timeout, or SIGALRM in
this process), so a regression fails instead of stopping the suite."""

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from coppelius.reference import fsutil
from coppelius.reference.checkpoint import identities, validate, write_checkpoint
from coppelius.reference.config import (PRESETS, Hyper, parameter_count, parse_rational,
                                        tensor_count)
from coppelius.reference.errors import (CheckpointError, ConfigError, InUseError,
                                        NotRegularFile, OutputError)
from coppelius.reference.params import initialize, registry
from coppelius.reference.state import State
from coppelius.reference.stream import write_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = PRESETS["test"]
N = registry(CFG).total
SHA = hashlib.sha256(b"ids").hexdigest()


# ------------------------------------------------------------------ helpers

@contextlib.contextmanager
def deadline(seconds=10):
    """Fail, rather than hang, when the block runs past `seconds` (a blocking
    open or read is interrupted: PEP 475 lets the handler's exception out)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(*argv, timeout=60, cwd=None):
    """The command line in a new process under a timeout: (status, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "coppelius", *map(str, argv)], cwd=cwd or ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def one_line_error(status, err, *words):
    """Exit 2, one line on stderr, no traceback, every word in it."""
    assert status == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for word in words:
        assert str(word) in err, (word, err)


def fifo(path):
    os.mkfifo(path)
    return path


def test_ids(batch=1, stream=SHA):
    return identities(CFG, Hyper(), "fp32", batch, None, stream)


test_ids.__test__ = False  # a helper, not a test


def state_at(t):
    P = initialize(CFG)
    return State(P, np.zeros_like(P), np.zeros_like(P), t=t)


@pytest.fixture
def stream(tmp_path):
    """A token stream of 40 test-preset contexts (no tokenizer beside it)."""
    ids = (np.arange(40 * CFG.context + 1) * 5 % CFG.vocab).astype(np.uint32)
    path = tmp_path / "s.tokens"
    write_stream(path, ids, source_mtime_ns=0, source_size=0)
    return path


def header_bytes(header) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def build_checkpoint(path, header=None, raw=None, payload=None):
    """A checkpoint with any header (or raw header bytes) and a valid digest."""
    if header is None:
        header = dict(test_ids(), step=0, contexts=0, parameters=registry(CFG).describe())
    raw = header_bytes(header) if raw is None else raw
    payload = bytes(12 * N) if payload is None else payload
    start = struct.pack("<8sII", b"CPLSCKPT", 1, len(raw)) + raw
    body = start + bytes(-len(start) % 4096) + payload
    path.write_bytes(body + struct.pack("<8sQ", b"CPLSDONE", len(payload))
                     + hashlib.sha256(body).digest())
    return path


# ------------------------------------------------------------------ the file layer

def test_publish_refuses_a_fifo_and_a_directory(tmp_path):
    pipe = fifo(tmp_path / "pipe")
    with pytest.raises(NotRegularFile, match="FIFO"):
        fsutil.publish(pipe, lambda f: f.write(b"x"))
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    with pytest.raises(IsADirectoryError):
        fsutil.publish(tmp_path, lambda f: f.write(b"x"))
    assert sorted(os.listdir(tmp_path)) == ["pipe"]  # no temporary left


@pytest.mark.parametrize("special", ["fifo", "directory", "devnull"])
def test_an_output_path_must_be_a_regular_file_or_absent(tmp_path, special):
    path = {"fifo": lambda: fifo(tmp_path / "p"), "directory": lambda: tmp_path,
            "devnull": lambda: os.devnull}[special]()
    with pytest.raises(OutputError, match="refusing to replace it") as e:
        fsutil.output_target(path, "checkpoint")
    assert f"checkpoint {path}: is a" in str(e.value)
    with pytest.raises(OutputError, match="empty path"):
        fsutil.output_target("", "checkpoint")


def test_a_symlink_is_published_through_to_its_target(tmp_path):
    target = tmp_path / "real.bin"
    target.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    fsutil.publish(link, lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_bytes() == b"new"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "made.bin")
    fsutil.publish(dangling, lambda f: f.write(b"made"))
    assert dangling.is_symlink() and (tmp_path / "made.bin").read_bytes() == b"made"


@pytest.mark.parametrize("special", ["fifo", "devnull", "directory"])
def test_open_regular_never_opens_a_special_file(tmp_path, special):
    path = {"fifo": lambda: fifo(tmp_path / "p"), "devnull": lambda: os.devnull,
            "directory": lambda: tmp_path}[special]()
    with deadline(10), pytest.raises(OSError, match="not a regular file"):
        fsutil.open_regular(path)
    with pytest.raises(FileNotFoundError):
        fsutil.open_regular(tmp_path / "absent")


def test_a_long_name_publishes_and_a_too_long_one_is_refused(tmp_path):
    long = tmp_path / ("c" * 250)  # its temporary would be 264 bytes unshortened
    fsutil.publish(long, lambda f: f.write(b"x"))
    fsutil.publish(long, lambda f: f.write(b"y"))
    assert long.read_bytes() == b"y" and os.listdir(tmp_path) == [long.name]
    with fsutil.Lock(long, "checkpoint"):
        assert len(os.listdir(tmp_path)) == 2
    with pytest.raises(OutputError, match="300 bytes, longer than the file system allows"):
        fsutil.output_target(tmp_path / ("c" * 300), "checkpoint")


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path):
    path = tmp_path / "ck.bin"
    stale = tmp_path / ".ck.bin.abcdefgh.coppelius.tmp"
    legacy = tmp_path / ".ck.bin.abcd_123.tmp"
    live = tmp_path / ".ck.bin.zzzzzzzz.coppelius.tmp"
    mine = tmp_path / ".ck.bin.notours.tmp"  # not a name publication makes
    for p in (stale, legacy, live, mine):
        p.write_bytes(b"partial")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer still at work
    try:
        fsutil.publish(path, lambda f: f.write(b"x"))
        assert sorted(os.listdir(tmp_path)) == sorted(["ck.bin", live.name, mine.name])
    finally:
        os.close(fd)
    assert fsutil.remove_stale(path) == 1 and not live.exists() and mine.exists()


def test_a_lock_refuses_a_second_holder_naming_the_pid(tmp_path):
    path = tmp_path / "ck.bin"
    first = fsutil.Lock(path, "checkpoint").acquire()
    with pytest.raises(InUseError) as e:
        fsutil.Lock(path, "checkpoint").acquire()
    assert f"checkpoint {path}: in use by process {os.getpid()}" in str(e.value)
    link = tmp_path / "other-name.bin"
    link.symlink_to(path)
    with pytest.raises(InUseError):  # every name of the file takes the one lock
        fsutil.Lock(link, "checkpoint").acquire()
    first.release()
    assert os.listdir(tmp_path) == ["other-name.bin"]
    # a crashed holder leaves its lock file, but no lock: it is stale
    (tmp_path / ".ck.bin.lock").write_text("999999999\n")
    with fsutil.Lock(path, "checkpoint") as lock:
        assert lock.held and (tmp_path / ".ck.bin.lock").read_text() == f"{os.getpid()}\n"


# ------------------------------------------------------------------ numbers and identities

@pytest.mark.parametrize("text", ["1e999999999", "1e-999999999", "1E+9_999_999", "7" * 5000])
def test_huge_rationals_are_refused_unbuilt(text):
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="exponent is out of range|characters"):
        parse_rational(text, "lr")
    assert time.perf_counter() - started < 1


def test_parameter_count_is_the_registrys_without_building_it():
    for config in PRESETS.values():
        assert parameter_count(config) == registry(config).total
        assert tensor_count(config) == len(registry(config).specs)
    huge = CFG.__class__(vocab=64, context=16, d_model=32, n_layer=10**8, n_head=2, d_ff=96)
    started = time.perf_counter()
    assert parameter_count(huge) > 10**11
    assert time.perf_counter() - started < 0.1


def with_(**changes):
    h = dict(test_ids(), step=0, contexts=0, parameters=registry(CFG).describe())
    h.update(changes)
    return h


@pytest.mark.parametrize("header,raw,match", [
    pytest.param(None, header_bytes(with_(step=3, contexts=3))[:-1] + b',"step":0}',
                 "canonical", id="duplicate-key"),
    pytest.param(None, json.dumps(with_(), sort_keys=True).encode(), "canonical",
                 id="spaces"),
    pytest.param(None, json.dumps(with_(), separators=(",", ":")).encode(), "canonical",
                 id="keys-unsorted"),
    pytest.param(with_(step=3, contexts=2), None, "contexts 2 is not step 3", id="contexts"),
    pytest.param(with_(learner=""), None, "learner identity '' is not", id="empty-learner"),
    pytest.param(with_(learner="garbage"), None, "learner identity", id="bad-learner"),
    pytest.param(with_(data=""), None, "data identity", id="empty-data"),
    pytest.param(with_(data=test_ids(batch=1)["data"].replace("batch=1", "batch=0")), None,
                 "data identity", id="batch-zero"),
    pytest.param(with_(data=test_ids(batch=1)["data"].replace("batch=1", "batch=-3")), None,
                 "data identity", id="batch-negative"),
    pytest.param(with_(initialization=""), None, "initialization identity", id="empty-init"),
    pytest.param(with_(model=""), None, "model identity", id="empty-model"),
    pytest.param(with_(schema="coppelius-raw-pmv-f32-v1"), None, "schema identity",
                 id="schema"),
    pytest.param(with_(model=CFG.identity().replace("n_layer=2", "n_layer=100000000")), None,
                 "has 1100000003 tensors", id="n-layer-huge"),
])
def test_hostile_envelope_refused_before_hashing(tmp_path, header, raw, match):
    path = build_checkpoint(tmp_path / "h.ckpt", header, raw)
    with deadline(10), pytest.raises(CheckpointError, match=match) as e:
        validate(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_sparse_file_whose_claims_add_up_is_refused_unread(tmp_path):
    """4 GiB of holes behind a header whose parameter list covers them, under
    a model identity of a small model: refused before the SHA-256 pass."""
    payload = 12 * ((4 << 30) // 12)
    params = [{"name": "tok_embedding.weight", "shape": [payload // 12], "offset": 0}]
    header = with_(parameters=params)
    raw = header_bytes(header)
    path = tmp_path / "sparse.ckpt"
    with open(path, "wb") as f:
        f.write(struct.pack("<8sII", b"CPLSCKPT", 1, len(raw)) + raw)
        f.truncate(4096 + payload)
        f.seek(4096 + payload)
        f.write(struct.pack("<8sQ", b"CPLSDONE", payload) + bytes(32))
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match="the header lists 1 tensors"):
        validate(path)
    assert time.perf_counter() - started < 2


def test_write_refuses_an_inconsistent_envelope(tmp_path):
    with pytest.raises(CheckpointError, match="contexts 5 is not step 2 times the batch 1"):
        write_checkpoint(tmp_path / "c.ckpt", CFG, test_ids(), state_at(2), contexts=5)
    assert not (tmp_path / "c.ckpt").exists()


# ------------------------------------------------------------------ streams and sources

def source_text(tmp_path, name="a.txt") -> str:
    """A small real text (the json package of the running Python)."""
    import sysconfig

    root = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    text = "".join(open(os.path.join(root, n), encoding="utf-8").read()
                   for n in sorted(os.listdir(root)) if n.endswith(".py"))
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


V = 320  # trains in milliseconds on source_text


TRUNCATE = """
import os, sys
sys.path.insert(0, {root!r})
from coppelius.reference.errors import StreamError
from coppelius.reference.stream import open_stream
path = sys.argv[1]
s = open_stream(path, 64)
s.batch(0, 2, 16)
os.truncate(path, 16 + 4 * 20)  # the file shrinks under the open stream
try:
    s.batch(3, 2, 16)
except StreamError as e:
    print(e)
"""


def test_a_stream_truncated_in_use_is_an_error_not_sigbus(stream):
    p = subprocess.run([sys.executable, "-c", TRUNCATE.format(root=ROOT), str(stream)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr  # -SIGBUS with a mapping
    assert f"{stream}: is 96 bytes now, token 64 ends at offset 276" in p.stdout
    assert "truncated while in use" in p.stdout


def test_a_stream_changed_in_use_is_an_error(stream):
    from coppelius.reference.errors import StreamError
    from coppelius.reference.stream import open_stream

    s = open_stream(stream, CFG.vocab)
    with open(stream, "r+b") as f:
        f.seek(16 + 4 * 16 * 5)
        f.write(struct.pack("<I", 1000))  # an id no model of V=64 has
    with pytest.raises(StreamError, match="not below V=64 .was it changed while in use"):
        s.batch(5, 1, 16)


def test_context_numbers_of_any_size_neither_overflow_nor_allocate(stream):
    from coppelius.reference.errors import StreamError
    from coppelius.reference.stream import open_stream

    s = open_stream(stream, CFG.vocab)
    with pytest.raises(StreamError, match="contexts 99999999999999999999"):
        s.batch(10**20 - 1, 1, 16)
    with pytest.raises(StreamError, match="holds 40"):
        s.batch(0, 10**20, 16)
    assert s.batch(10**20, 2, 16, repeat=True).tolist() == s.batch(0, 2, 16).tolist()


@pytest.mark.parametrize("special", ["fifo", "devnull"])
def test_tokenize_and_train_never_open_a_special_source(tmp_path, special):
    source = fifo(tmp_path / "pipe.txt") if special == "fifo" else os.devnull
    status, _, err = run_cli("tokenize", source, "--vocab", V, "--cache-dir", tmp_path / "c",
                             timeout=60)
    one_line_error(status, err, source, "not a regular file")
    status, _, err = run_cli("train", "--preset", "tiny", "--backend", "reference", "--source",
                             source, "--run-dir", tmp_path / "run", "--steps", "1", timeout=60)
    one_line_error(status, err, source, "not a regular file")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("vocab, words", [
    ("99999999999999999999", "at most 4294967295"),
    ("4294967296", "at most 4294967295"),  # the tokenizers library aborted the process
    ("100000", "yields at most"),
])
def test_impossible_vocabularies_are_refused_first(tmp_path, vocab, words):
    source = source_text(tmp_path)
    started = time.perf_counter()
    status, _, err = run_cli("tokenize", source, "--vocab", vocab, "--out", tmp_path / "o.tokens")
    one_line_error(status, err, f"vocab={vocab}", words)
    assert time.perf_counter() - started < 30 and not (tmp_path / "o.tokens").exists()


@pytest.mark.parametrize("out", ["fifo", "source", "text", "tokenizer.json", "foreign-tokenizer"])
def test_tokenize_never_replaces_what_is_not_its_own(tmp_path, out):
    source = source_text(tmp_path)
    if out == "fifo":
        target = fifo(tmp_path / "s.tokens")
    elif out == "source":
        target = source
    elif out == "text":
        target = tmp_path / "notes.tokens"
        target.write_text("my notes\n")  # 9 bytes: no stream has them
    elif out == "tokenizer.json":
        target = tmp_path / "d" / "tokenizer.json"
    else:
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "tokenizer.json").write_text('{"mine": true}')
        target = tmp_path / "d" / "s.tokens"
    before = {p: (p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")}
    status, _, err = run_cli("tokenize", source, "--vocab", V, "--out", target)
    one_line_error(status, err, target)
    assert {p: (p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")} == before
    if out == "fifo":
        assert stat.S_ISFIFO(os.lstat(target).st_mode)


def test_a_cached_stream_changed_in_the_middle_is_rebuilt(tmp_path):
    from coppelius import data

    source = source_text(tmp_path)
    out = tmp_path / "c" / "a.tokens"
    data.prepare_stream(source=source, vocab=V, out=out)
    assert data.is_fresh(out, source, V)
    raw = bytearray(out.read_bytes())
    middle = 16 + 4 * ((len(raw) - 16) // 8)
    old = struct.unpack_from("<I", raw, middle)[0]
    struct.pack_into("<I", raw, middle, (old + 1) % V)  # head and tail still encode right
    out.write_bytes(bytes(raw))
    os.utime(out)  # the header, not the file's own mtime, names the source
    assert not data.is_fresh(out, source, V)
    status, stdout, err = run_cli("tokenize", source, "--vocab", V, "--out", out)
    assert status == 0 and stdout.startswith(f"wrote {out}"), err
    assert data.is_fresh(out, source, V)


def test_stale_temporaries_of_a_killed_tokenize_are_removed(tmp_path):
    from coppelius import data

    source = source_text(tmp_path)
    out = tmp_path / "c" / "a.tokens"
    data.prepare_stream(source=source, vocab=V, out=out)
    leftovers = [tmp_path / "c" / ".a.tokens.abcdefgh.coppelius.tmp",
                 tmp_path / "c" / ".a.tokens.abcdefgh.staged",  # what earlier versions left
                 tmp_path / "c" / ".tokenizer.json.abcdefgh.tmp"]
    for p in leftovers:
        p.write_bytes(b"half")
    data.prepare_stream(source=source, vocab=V, out=out)  # up to date: nothing republished
    assert sorted(os.listdir(tmp_path / "c")) == ["a.tokens", "a.tokens.sha256", "tokenizer.json"]
