"""Hostile input and misuse: special files, hangs, hostile headers, paths
that collide, two processes on one file. Every case ends in a one-line
error and exit status 2 (or a correct result), never in a hang: anything
that could block runs under a deadline (a subprocess timeout, or SIGALRM in
this process), so a regression fails instead of stopping the suite."""

import contextlib
import errno
import fcntl
import hashlib
import io
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

from coppelius.reference import checkpoint, fsutil
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

class Hung(BaseException):
    """A block ran past its deadline (not an OSError: nothing may catch it)."""


@contextlib.contextmanager
def deadline(seconds=10):
    """Fail, rather than hang, when the block runs past `seconds` (a blocking
    open or read is interrupted: PEP 475 lets the handler's exception out).
    Code that could block inside a library (Rust or C that retries the
    interrupted call) runs in a subprocess instead: run_cli."""
    def expire(signum, frame):
        raise Hung(f"still running after {seconds} s")

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


def cli(*argv, seconds=60):
    """The command line in this process under a deadline: (status, stdout, stderr)."""
    from coppelius.cli import main

    out, err = io.StringIO(), io.StringIO()
    with deadline(seconds), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's usage errors
            status = e.code
    return status, out.getvalue(), err.getvalue()


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
    status, _, err = cli("tokenize", source, "--vocab", V, "--cache-dir", tmp_path / "c")
    one_line_error(status, err, source, "not a regular file")
    status, _, err = cli("train", "--preset", "tiny", "--backend", "reference", "--source",
                         source, "--run-dir", tmp_path / "run", "--steps", "1")
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
    status, _, err = cli("tokenize", source, "--vocab", V, "--out", target)
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
    status, stdout, err = cli("tokenize", source, "--vocab", V, "--out", out)
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
    assert sorted(os.listdir(tmp_path / "c")) == ["a.documents.json", "a.tokens", "a.tokens.sha256",
                                                  "tokenizer.json"]


# ------------------------------------------------------------------ commands

def train_argv(stream, run_dir, ckpt, *extra):
    return [str(a) for a in ["train", "--preset", "test", "--backend", "reference", "--stream",
                             stream, "--run-dir", run_dir, "--checkpoint", ckpt, "--no-sample",
                             *extra]]


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """A run of 2 steps on the `stream` fixture's ids, made once."""
    from coppelius.cli import main

    folder = tmp_path_factory.mktemp("trained")
    ids = (np.arange(40 * CFG.context + 1) * 5 % CFG.vocab).astype(np.uint32)
    write_stream(folder / "s.tokens", ids, source_mtime_ns=0, source_size=0)
    assert main(train_argv(folder / "s.tokens", folder / "run", folder / "run" / "ck.bin",
                           "--steps", "2")) == 0
    return folder / "run"


@pytest.fixture
def trained(tmp_path, stream, trained_once):
    """A checkpoint of 2 steps on `stream`, its result file and plot, in
    tmp_path/run, whose run.json names the copy's checkpoint and stream (a run
    directory belongs to one run: the copy is a run of its own)."""
    import shutil

    shutil.copytree(trained_once, tmp_path / "run")
    rewrite_run_file(tmp_path / "run", lambda options: None)
    return tmp_path / "run" / "ck.bin"


def reheader(src, dst, change):
    """`src` with its header changed by `change(header)` and the digest recomputed."""
    data = src.read_bytes()
    hn = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[16:16 + hn])
    change(header)
    payload = data[(16 + hn + 4095) // 4096 * 4096:len(data) - 48]
    return build_checkpoint(dst, raw=header_bytes(header), payload=payload)


def safetensors_of(ckpt, path, **meta_changes):
    """`coppelius export` of `ckpt` to `path`, its metadata then changed."""
    from safetensors.numpy import load_file, save_file

    from coppelius import exchange

    exchange.export(ckpt, path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))["__metadata__"]
    for key, (old, new) in meta_changes.items():
        meta[key] = meta[key].replace(old, new)
    save_file(load_file(path), path, metadata=meta)
    return path


def tree(folder):
    """Every file under `folder` with its bytes (FIFOs as None)."""
    return {p: (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("command", ["train", "report --plot", "tokenize --out", "export",
                                     "import"])
@pytest.mark.parametrize("special", ["fifo", "devnull"])
def test_no_command_replaces_a_special_file(tmp_path, stream, trained, command, special):
    target = fifo(tmp_path / "out") if special == "fifo" else os.devnull
    ck, res = trained, tmp_path / "run" / "results-0.bin"
    argv = {"train": train_argv(stream, tmp_path / "r2", target, "--steps", "1"),
            "report --plot": ["report", res, "--plot", target],
            "tokenize --out": ["tokenize", source_text(tmp_path), "--vocab", V, "--out", target],
            "export": ["export", ck, target, "--force"],
            "import": ["import", safetensors_of(ck, tmp_path / "x.safetensors"), target,
                       "--force"]}[command]
    before = tree(tmp_path)
    status, _, err = cli(*argv)
    one_line_error(status, err, target, "not a regular file; refusing to replace it")
    assert tree(tmp_path) == before
    if special == "fifo":
        assert stat.S_ISFIFO(os.lstat(target).st_mode)
    else:
        assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_symlinked_checkpoint_is_trained_through_to_its_target(tmp_path, stream, trained):
    from coppelius.cli import main
    from coppelius.reference.binding import load_state

    link = tmp_path / "link.bin"
    link.symlink_to(trained)
    assert main(train_argv(stream, tmp_path / "run", link, "--steps", "1")) == 0
    assert link.is_symlink() and load_state(trained, CFG).step == 3


@pytest.mark.parametrize("command", ["inspect", "report", "tokenize", "import", "train --source",
                                     "train --stream", "conformance --stream", "sample"])
def test_no_command_opens_a_fifo(tmp_path, stream, trained, command):
    pipe = fifo(tmp_path / "pipe")
    argv = {"inspect": ["inspect", pipe], "report": ["report", pipe],
            "tokenize": ["tokenize", pipe, "--vocab", V, "--out", tmp_path / "o.tokens"],
            "import": ["import", pipe, tmp_path / "o.ck"],
            "train --source": ["train", "--preset", "tiny", "--backend", "reference", "--source",
                               pipe, "--run-dir", tmp_path / "r2"],
            "train --stream": train_argv(pipe, tmp_path / "r2", tmp_path / "r2" / "ck"),
            "conformance --stream": ["conformance", "--backend", "reference", "--stream", pipe],
            "sample": ["sample", trained, "--tokenizer", pipe]}[command]
    # import would hand the path to the safetensors library: a subprocess, should it block there
    status, _, err = run_cli(*argv) if command == "import" else cli(*argv)
    one_line_error(status, err, pipe, "FIFO")


def test_a_fifo_tokenizer_beside_a_stream_is_refused_unopened(tmp_path, stream):
    fifo(tmp_path / "tokenizer.json")  # beside s.tokens
    status, _, err = run_cli(*train_argv(stream, tmp_path / "r", tmp_path / "r" / "ck"),
                             timeout=60)
    one_line_error(status, err, "tokenizer.json", "FIFO")


@pytest.mark.parametrize("command", ["export", "sample", "conformance", "inspect"])
def test_a_checkpoint_claiming_a_huge_model_is_refused_at_once(tmp_path, stream, trained,
                                                              command):
    big = reheader(trained, tmp_path / "big.ckpt", lambda h: h.update(
        model=h["model"].replace("n_layer=2", "n_layer=100000000")))
    argv = {"export": ["export", big, tmp_path / "o.safetensors"], "sample": ["sample", big],
            "conformance": ["conformance", "--backend", "reference", "--checkpoint", big,
                            "--stream", stream],
            "inspect": ["inspect", big]}[command]
    started = time.perf_counter()
    status, _, err = run_cli(*argv, timeout=60)
    one_line_error(status, err, big, "1100000003 tensors")
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize("change, words", [
    ({"model": ("n_layer=2", "n_layer=100000000")}, "1344000002112 parameters"),
    ({"data": ("batch=1", "batch=0")}, "metadata data"),
    ({"data": ("batch=1", "batch=-3")}, "metadata data"),
    ({"learner": ("lr=3/10000", "lr=1e999999999")}, "metadata learner"),
])
def test_import_refuses_hostile_metadata(tmp_path, trained, change, words):
    src = safetensors_of(trained, tmp_path / "x.safetensors", **change)
    # a claimed 10^8 layers could take minutes and gigabytes: a subprocess
    status, _, err = (run_cli if "model" in change else cli)("import", src, tmp_path / "o.ck")
    one_line_error(status, err, src, words)
    assert not (tmp_path / "o.ck").exists()


def test_an_import_naming_a_huge_batch_is_refused_by_conformance(tmp_path, stream, trained):
    src = safetensors_of(trained, tmp_path / "x.safetensors",
                         data=("batch=1", "batch=99999999999999999999"))
    status, _, err = cli("import", src, tmp_path / "o.ck")
    assert status == 0, err
    status, _, err = cli("conformance", "--backend", "reference", "--checkpoint",
                             tmp_path / "o.ck", "--stream", stream)
    one_line_error(status, err, "--batch=99999999999999999999", "memory")


@pytest.mark.parametrize("argv, words", [
    (["conformance", "--backend", "reference", "--context", "99999999999999999999",
      "--stream", "STREAM"], "the stream holds 40"),
    (["conformance", "--backend", "reference", "--steps", "100000000000000000000"], "memory"),
    (["conformance", "--backend", "reference", "--batch", "100000000000000000000"], "memory"),
    (["train", "--lr", "1e999999999"], "exponent is out of range"),
    (["train", "--lr", "-inf"], "lr='-inf': not a number"),
    (["train", "--lr", "-3e-4"], "lr=-3/10000: must be positive"),
    (["train", "--batch", "1000000000", "--repeat-data"], "memory"),
    (["train", "--batch", "x"], "invalid int value: 'x' (see coppelius train --help)"),
    (["train", "--checkpoint", ""], "--checkpoint: empty path"),
    (["train", "--results", ""], "--results: empty path"),
    (["report", "RESULTS", "--plot", ""], "--plot: empty path"),
    (["sample", "CKPT", "--prompt", "\udcff\udcfeabc"], "--prompt: not valid UTF-8 (byte 0xff"),
    (["tokenize", "--vocab", "99999999999999999999"], "at most 4294967295"),
    (["tokenize", "--vocab", "4294967296"], "at most 4294967295"),
])
def test_hostile_arguments_get_one_line(tmp_path, stream, trained, argv, words):
    fill = {"STREAM": stream, "RESULTS": tmp_path / "run" / "results-0.bin", "CKPT": trained}
    argv = [fill.get(a, a) for a in argv]
    if argv[0] == "train":
        argv = train_argv(stream, tmp_path / "r2", tmp_path / "r2" / "ck", *argv[1:])
    if argv[0] == "tokenize":
        argv += [source_text(tmp_path), "--out", tmp_path / "o.tokens"]
    before = tree(tmp_path)
    started = time.perf_counter()
    # 2^32 made the tokenizers library abort the process: that case in a subprocess
    status, _, err = (run_cli if "4294967296" in argv else cli)(*argv)
    one_line_error(status, err, words)
    assert time.perf_counter() - started < 30
    assert tree(tmp_path) == before  # nothing written, nothing left behind


# ------------------------------------------------------------------ outputs that collide

def word_tokenizer(path, vocab=CFG.vocab):
    """A tokenizer.json of exactly `vocab` ids (a word-level one: a byte-level
    BPE needs at least 256)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["[UNK]"] = vocab - 1
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_the_loss_plot_never_replaces_the_checkpoint(tmp_path, stream, trained):
    from coppelius.cli import main

    ck = tmp_path / "r.png"
    ck.write_bytes(trained.read_bytes())
    assert main(train_argv(stream, tmp_path, ck, "--steps", "1", "--results", tmp_path / "r.bin")) == 0
    validate(ck)  # still the checkpoint, one step on
    assert checkpoint.validate(ck).header["step"] == 3
    assert (tmp_path / "r-1.png").read_bytes()[:4] == b"\x89PNG"


def test_the_loss_plot_never_replaces_an_existing_png(tmp_path, stream, capsys):
    from coppelius.cli import main

    mine = tmp_path / "mine.png"
    mine.write_bytes(b"my picture")
    assert main(train_argv(stream, tmp_path, tmp_path / "ck", "--steps", "1",
                           "--results", tmp_path / "mine.bin")) == 0
    assert mine.read_bytes() == b"my picture"
    assert "loss plot:  " + str(tmp_path / "mine-1.png") in capsys.readouterr().out


def test_train_never_replaces_another_tokenizer_json(tmp_path, stream, capsys):
    from coppelius.cli import main

    word_tokenizer(tmp_path / "tokenizer.json")  # the stream's, beside s.tokens
    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.json").write_text('{"someone else": 1}')
    assert main(train_argv(stream, run, run / "ck", "--steps", "1")) == 0
    assert (run / "tokenizer.json").read_text() == '{"someone else": 1}'
    assert "is another file; left as it is" in capsys.readouterr().err
    # a checkpoint named tokenizer.json is trained, never replaced by a tokenizer
    # (the run of another checkpoint: a run directory of its own)
    ck = run / "tokenizer.json"
    ck.unlink()
    assert main(train_argv(stream, tmp_path / "run2", ck, "--steps", "1")) == 0
    assert main(train_argv(stream, tmp_path / "run2", ck, "--steps", "1")) == 0
    assert validate(ck).header["step"] == 2


@pytest.mark.parametrize("tokenizer", ["garbage", "wrong-size"])
def test_a_bad_tokenizer_beside_the_stream_is_refused_before_training(tmp_path, stream, capsys,
                                                                      tokenizer):
    from coppelius.cli import main

    if tokenizer == "garbage":
        (tmp_path / "tokenizer.json").write_text("{not json")
    else:
        word_tokenizer(tmp_path / "tokenizer.json", vocab=CFG.vocab + 1)
    assert main(train_argv(stream, tmp_path / "run", tmp_path / "run" / "ck", "--steps", "1")) == 2
    one_line_error(2, capsys.readouterr().err, tmp_path / "tokenizer.json")
    assert not (tmp_path / "run").exists()  # nothing trained, nothing published


def test_report_plot_never_replaces_its_input_or_a_file_not_a_png(tmp_path, trained):
    res = tmp_path / "run" / "results-0.bin"
    before = res.read_bytes()
    status, _, err = cli("report", res, "--plot", res)
    one_line_error(status, err, "an input of this command")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    status, _, err = cli("report", res, "--plot", notes)
    one_line_error(status, err, notes, "not a PNG; refusing to replace it")
    assert res.read_bytes() == before and notes.read_text() == "mine"
    png = tmp_path / "run" / "results-0.png"  # the run's own plot: a PNG, replaced
    status, _, err = cli("report", res, "--plot", png)
    assert status == 0, err


# ------------------------------------------------------------------ hostile result files

def result_records(path):
    data = path.read_bytes()
    hn = struct.unpack_from("<I", data, 12)[0]
    start = (16 + hn + 4095) // 4096 * 4096
    return data, hn, start


def test_a_step_number_out_of_sequence_stops_the_reader(tmp_path, trained):
    import zlib

    res = tmp_path / "run" / "results-0.bin"
    data, hn, pos = result_records(res)
    out = bytearray(data[:pos])
    while pos < len(data):
        kind, n = struct.unpack_from("<II", data, pos)
        payload = bytearray(data[pos + 8:pos + 8 + n])
        if kind == 2:
            struct.pack_into("<Q", payload, 0, 2**64 - 1)
        head = struct.pack("<II", kind, n)
        out += head + payload + struct.pack("<I", zlib.crc32(bytes(payload), zlib.crc32(head)))
        pos += 12 + n
    hostile = tmp_path / "hostile.bin"
    hostile.write_bytes(bytes(out))
    status, _, err = cli("report", hostile)
    one_line_error(status, err, hostile, "has step 18446744073709551615, expected 0")
    status, stdout, err = cli("inspect", hostile)
    assert status == 0 and "yes: step record at offset 4876 has step 18446744073709551615" in stdout, err


def test_a_tiny_result_file_claiming_a_huge_record_is_refused_unallocated(tmp_path, trained):
    res = tmp_path / "run" / "results-0.bin"
    data, hn, start = result_records(res)
    header = json.loads(data[16:16 + hn])
    for claim, words in (
            ({"vocab": 357913941}, "'vocab' is 357913941, the model identity's is 64"),
            ({"vocab": 357913941, "model": header["model"].replace("vocab=64", "vocab=357913941")},
             "truncated record at offset 4096")):  # consistent: the record is cut short, unread
        h = dict(header, **claim)
        raw = header_bytes(h)
        head = struct.pack("<8sII", b"CPLSRSLT", 1, len(raw)) + raw
        tiny = tmp_path / "tiny.bin"
        tiny.write_bytes(head + bytes(-len(head) % 4096) + struct.pack("<II", 1, 3 * 357913941 * 4)
                         + b"x" * 100)
        for command in ("inspect", "report"):
            status, stdout, err = cli(command, tiny)
            assert "Traceback" not in err and status in (0, 2), err
            assert words in err + stdout


def test_a_full_disk_at_the_result_header_leaves_no_result_file(tmp_path, monkeypatch):
    from coppelius.reference import results

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(results, "open", lambda *a, **k: Full(open(*a, **k)), raising=False)
    header = results.result_header(CFG, test_ids(), 0, 1, 1, "reference", False)
    with pytest.raises(results.ResultFileError, match="No space left"):
        results.ResultWriter(tmp_path / "r.bin", header)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ in use, killed, long names

def start_training(stream, run_dir, ckpt, *extra):
    """A long run in a new process, once it has published its checkpoint."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "coppelius",
                             *train_argv(stream, run_dir, ckpt, "--steps", "100000",
                                         "--interval", "5", "--repeat-data", *extra)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline_at = time.time() + 60
    while not os.path.exists(ckpt) and proc.poll() is None and time.time() < deadline_at:
        time.sleep(0.05)
    assert os.path.exists(ckpt), proc.stderr.read() if proc.poll() is not None else "no checkpoint"
    return proc


def test_a_second_trainer_on_one_checkpoint_is_refused_naming_the_first(tmp_path, stream):
    ck = tmp_path / "run" / "ck.bin"
    first = start_training(stream, tmp_path / "run", ck)
    try:
        status, _, err = cli(*train_argv(stream, tmp_path / "run", ck, "--steps", "1"))
        one_line_error(status, err, f"run directory {tmp_path / 'run'}: another run trains "
                                    f"there (process {first.pid})")
        status, _, err = cli(*train_argv(stream, tmp_path / "run2", ck, "--steps", "1"))
        one_line_error(status, err, f"checkpoint {ck}: in use by process {first.pid}")
        link = tmp_path / "alias.bin"
        link.symlink_to(ck)
        status, _, err = cli(*train_argv(stream, tmp_path / "other", link, "--steps", "1"))
        one_line_error(status, err, f"in use by process {first.pid}")
        # import --force onto it is refused too
        src = safetensors_of(tmp_path / "run" / "ck.bin", tmp_path / "x.safetensors")
        status, _, err = cli("import", src, ck, "--force")
        one_line_error(status, err, f"in use by process {first.pid}")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM
    step = validate(ck).header["step"]
    status, _, err = cli(*train_argv(stream, tmp_path / "run", ck, "--steps", "1",
                                         "--repeat-data"))
    assert status == 0, err
    assert validate(ck).header["step"] == step + 1  # no step lost, none went backwards
    assert sorted(os.listdir(tmp_path / "run"))[:1] == ["ck.bin"]  # the lock is gone


def test_a_lock_left_by_a_killed_trainer_is_stale(tmp_path, stream):
    ck = tmp_path / "run" / "ck.bin"
    first = start_training(stream, tmp_path / "run", ck)
    first.kill()
    first.communicate(timeout=60)
    assert (tmp_path / "run" / ".ck.bin.lock").exists()
    status, _, err = cli(*train_argv(stream, tmp_path / "run", ck, "--steps", "1",
                                         "--repeat-data"))
    assert status == 0, err
    left = [n for n in os.listdir(tmp_path / "run") if n.endswith(".tmp") or n.endswith(".lock")]
    assert left == []  # the dead run's temporaries (if any) are gone with its lock


def test_a_stream_truncated_during_a_run_stops_it_with_one_line(tmp_path, stream):
    ck = tmp_path / "run" / "ck.bin"
    proc = start_training(stream, tmp_path / "run", ck)
    os.truncate(stream, 16 + 4 * 20)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("coppelius train: error: ") and "truncated while in use" in last
    assert "Traceback" not in err
    header = validate(ck).header
    assert header["step"] == header["contexts"] >= 5  # what was trained is kept


# A child that runs a command and sends itself SIGTERM as the count-th file
# is being published (between writing its temporary and renaming it).
SIGTERM_CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from coppelius.cli import main
from coppelius.reference import fsutil
count = [0]
def hook(phase):
    if phase == "written":
        count[0] += 1
        if count[0] == {at}:
            os.kill(os.getpid(), signal.SIGTERM)
fsutil._hook = hook
sys.exit(main(sys.argv[1:]))
"""


def leftovers(folder):
    return [p.name for p in folder.rglob("*") if p.name.endswith((".tmp", ".staged"))]


@pytest.mark.parametrize("what, at", [("stream", 1), ("tokenizer", 2), ("final plot", 3)])
def test_sigterm_while_publishing_leaves_no_temporary(tmp_path, stream, what, at):
    if what == "final plot":  # publications: run.json, the checkpoint, then the plot
        argv = train_argv(stream, tmp_path / "run", tmp_path / "run" / "ck", "--steps", "1")
    else:  # publications: the stream (staged), the tokenizer, the digest
        argv = ["tokenize", str(source_text(tmp_path)), "--vocab", str(V), "--out",
                str(tmp_path / "c" / "a.tokens")]
    p = subprocess.run([sys.executable, "-c", SIGTERM_CHILD.format(root=ROOT, at=at), *argv],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert p.stderr.strip().splitlines()[-1].endswith("stopped by signal 15")
    assert leftovers(tmp_path) == []
    if what == "final plot":
        assert validate(tmp_path / "run" / "ck").header["step"] == 1
        assert not list((tmp_path / "run").glob("*.png"))


def test_a_250_character_checkpoint_name_trains_and_a_300_one_is_refused(tmp_path, stream):
    from coppelius.cli import main

    run = tmp_path / "run"
    ck = run / ("c" * 250)
    assert main(train_argv(stream, run, ck, "--steps", "2", "--interval", "1")) == 0
    assert validate(ck).header["step"] == 2
    assert sorted(os.listdir(run)) == sorted([ck.name, "results-0.bin", "results-0.png",
                                              "run.json", "tb"])
    status, _, err = cli(*train_argv(stream, tmp_path / "r2", tmp_path / "r2" / ("c" * 300),
                                         "--steps", "1"))
    one_line_error(status, err, "the name is 300 bytes, longer than the file system allows")
    assert not (tmp_path / "r2").exists()


def test_a_stream_being_made_is_waited_for_not_interleaved(tmp_path):
    from coppelius import data

    source = source_text(tmp_path)
    out = tmp_path / "c" / "a.tokens"
    data.prepare_stream(source=source, vocab=V, out=out)
    with fsutil.Lock(out, "stream"):  # another process making it, as far as tokenize can tell
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.Popen([sys.executable, "-m", "coppelius", "tokenize", str(source),
                                 "--vocab", str(V), "--out", str(out)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stderr.readline()
        assert f"note: stream {out} is being made by another process; waiting" in line
        assert proc.poll() is None
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stdout.startswith(f"up to date {out}"), err


def test_output_that_is_not_utf8_is_escaped_not_a_traceback(tmp_path, trained):
    odd = tmp_path / "\udcff.bin"  # the file name's byte 0xff, as Python holds it
    odd.write_bytes(trained.read_bytes())
    status, stdout, err = run_cli("inspect", odd)
    assert status == 0 and "Traceback" not in err, err
    assert "\\udcff.bin" in stdout


# ------------------------------------------------------------------ run files, model files, /proc

def rewrite_run_file(run, change):
    """run/run.json (copied from `trained_once`) naming the copy's checkpoint
    and stream, its options then changed by `change(options)` (or, when
    `change` is bytes, those bytes instead)."""
    path = run / "run.json"
    if isinstance(change, bytes):
        path.write_bytes(change)
        return
    doc = json.loads(path.read_text())
    doc["options"].update(checkpoint=str(run / "ck.bin"), stream=str(run.parent / "s.tokens"))
    change(doc["options"])
    path.write_text(json.dumps(doc))


RUN_FILE_CASES = [
    (lambda o: o.update(batch="4"), "option batch = \"4\""),
    (lambda o: o.update(repeat_data="no"), "option repeat_data = \"no\""),
    (lambda o: o.update(seed=1.5), "option seed = 1.5"),
    (lambda o: o.update(seed=2**64), "option seed"),
    (lambda o: o.update(batch=True), "option batch = true"),
    (lambda o: o.update(lr="-3e-4"), "option lr"),
    (lambda o: o.update(backend=["reference"]), "option backend"),
    (lambda o: o.update(stream="relative/s.tokens"), "absolute path"),
    (b'{"format": "coppelius-run-v1", "options": {"batch": 2, "batch": 3}}',
     "key 'batch' appears twice"),
    (b'{"format": "coppelius-run-v1", "options": {"batch": ' + b"[" * 100000 + b"]" * 100000
     + b"}}", "nested 100002 levels deep"),
    (b'{"format": "coppelius-run-v1", "options": {"seed": 1' + b"0" * 5000 + b"}}",
     "a number of 5001 characters"),
    (b" " * ((1 << 20) + 1), "larger than"),
]


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("change, words", RUN_FILE_CASES)
def test_a_hostile_run_file_is_refused_naming_the_field_and_changes_nothing(
        tmp_path, trained, command, change, words):
    run = trained.parent
    rewrite_run_file(run, change)
    argv = {"train": ["train", "--run-dir", run, "--steps", "1", "--no-sample"],
            "eval": ["eval", trained]}[command]
    before = tree(tmp_path)
    status, _, err = cli(*argv, seconds=30)
    one_line_error(status, err, "run.json", words)
    assert tree(tmp_path) == before  # no run.json rewritten, no result file made


def test_a_well_formed_run_file_still_continues_the_run(tmp_path, trained):
    rewrite_run_file(trained.parent, lambda options: None)
    status, _, err = cli("train", "--run-dir", trained.parent, "--steps", "1", "--no-sample")
    assert status == 0, err
    assert validate(trained).header["step"] == 3


MODEL = "vocab = 64\ncontext = 16\nd_model = 32\nn_layer = 2\nn_head = 2\nd_ff = 96\n"


@pytest.mark.parametrize("text, words", [
    (MODEL + "norm = " + "[" * 1000 + "]" * 1000 + "\n", ["line 7: norm", "nested more than"]),
    (MODEL + "norm = {a = " * 1000 + "1" + "}" * 1000 + "\n", ["line 7: norm", "nested more than"]),
    (MODEL.replace("n_layer = 2", "n_layer = " + "9" * 5000),
     ["line 4: n_layer", "a number of 5000 characters"]),
    (MODEL.replace("n_layer = 2", "n_layer = 0x" + "f" * 4000),
     ["line 4: n_layer", "a number of 4002 characters"]),
])
def test_a_model_file_nested_deeply_or_with_a_huge_number_is_refused_by_name(tmp_path, stream,
                                                                            text, words):
    model = tmp_path / "m.toml"
    model.write_text(text)
    before = tree(tmp_path)
    status, _, err = cli(*train_argv(stream, tmp_path / "r", tmp_path / "r" / "ck", "--model",
                                     model, "--steps", "1"), seconds=30)
    one_line_error(status, err, model, *words)
    assert tree(tmp_path) == before


@pytest.mark.skipif(os.environ.get("COPPELIUS_TEST_KMSG") != "1" or os.geteuid() != 0
                    or not os.access("/proc/kmsg", os.R_OK),
                    reason="reads (and so consumes) the kernel log: as root, with "
                           "COPPELIUS_TEST_KMSG=1 only")
def test_a_model_file_that_never_ends_is_refused_not_waited_on(tmp_path, stream):
    # /proc/kmsg is a "regular" file whose read blocks until the kernel logs more
    argv = train_argv(stream, tmp_path / "r", tmp_path / "r" / "ck", "--model", "/proc/kmsg")
    status, _, err = run_cli(*argv, timeout=60)
    one_line_error(status, err, "/proc/kmsg", "may never come")
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="no /proc")
@pytest.mark.parametrize("path", ["/proc/self/status", "/proc/self/environ", "/proc/version"])
@pytest.mark.parametrize("command", ["train", "eval", "conformance"])
def test_a_proc_file_of_size_zero_is_refused_as_a_stream(tmp_path, trained, path, command):
    argv = {"train": train_argv(path, tmp_path / "r", tmp_path / "r" / "ck", "--steps", "1"),
            "eval": ["eval", trained, "--stream", path],
            "conformance": ["conformance", "--backend", "reference", "--stream", path]}[command]
    before = tree(tmp_path)
    status, _, err = cli(*argv)
    one_line_error(status, err, path, "its size is 0 bytes yet it reads more", "not a token stream")
    assert tree(tmp_path) == before


def test_report_csv_never_replaces_a_file_that_is_not_its_csv(tmp_path, trained):
    run = trained.parent
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for target in (trained, notes, run / "run.json"):
        before = tree(tmp_path)
        status, _, err = cli("report", run, "--csv", target)
        one_line_error(status, err, target, "not a CSV of `coppelius report`; refusing to replace it")
        assert tree(tmp_path) == before  # the run's plot is not drawn either
    validate(trained)
    out = tmp_path / "steps.csv"  # a CSV report wrote: replaced by the next report
    assert cli("report", run, "--csv", out)[0] == 0
    first = out.read_text()
    lines = first.splitlines()
    assert lines[0] == ("step,train_loss,grad_norm,learning_rate,heldout_loss,host_seconds,"
                        "device_seconds")
    assert [row.split(",")[0] for row in lines[1:]] == ["0", "1", "2"]  # 2: the evaluation
    status, _, err = cli("report", run, "--csv", out)
    assert status == 0, err
    assert out.read_text() == first


def test_import_force_never_replaces_a_read_only_checkpoint(tmp_path, trained):
    src = safetensors_of(trained, tmp_path / "x.safetensors")
    kept = tmp_path / "kept.ck"
    kept.write_bytes(trained.read_bytes())
    kept.chmod(0o444)
    before = tree(tmp_path)
    status, _, err = cli("import", src, kept, "--force")
    one_line_error(status, err, kept, "read-only (mode 0444)")
    assert tree(tmp_path) == before and stat.S_IMODE(kept.stat().st_mode) == 0o444
    kept.chmod(0o644)  # writable: --force replaces it
    status, _, err = cli("import", src, kept, "--force")
    assert status == 0, err


def test_report_of_a_run_stopped_by_a_non_finite_first_step(tmp_path, stream, trained):
    data, hn, start = result_records(trained)  # a checkpoint's payload starts where a record would
    payload = np.frombuffer(data[start:len(data) - 48], dtype="<f4").copy()
    payload[:N] = 3e38  # finite parameters whose first forward overflows
    huge = build_checkpoint(tmp_path / "huge.ck", raw=data[16:16 + hn], payload=payload.tobytes())
    res = tmp_path / "r.bin"
    status, _, err = cli(*train_argv(stream, tmp_path / "r", huge, "--steps", "1",
                                     "--results", res))
    assert status == 3, err
    status, out, err = cli("report", res, "--plot", tmp_path / "r.png", "--csv", tmp_path / "r.csv")
    assert status == 0 and err == "", err
    assert "min loss        none finite" in out and "first loss      nan at step 2" in out
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "r.csv").read_text().splitlines()[1].startswith("2,nan,")


def test_an_empty_prompt_is_refused_before_anything_is_trained(tmp_path, stream):
    """`train --prompt ''` is refused at once, nothing published (it used to
    train, publish, then exit 2 at the sample)."""
    run = tmp_path / "run"
    argv = [a for a in train_argv(stream, run, run / "ck.bin", "--steps", "1")
            if a != "--no-sample"]
    status, out, err = cli(*argv, "--prompt", "")
    one_line_error(status, err, "--prompt")
    assert not (run / "ck.bin").exists() and not list(run.glob("results-*"))
    status, out, err = cli(*argv, "--prompt", "def")  # a prompt that is text is taken
    assert status == 0 and (run / "ck.bin").exists(), err


def test_until_below_the_checkpoints_step_says_the_checkpoint_is_past_it(tmp_path, trained):
    """--until N below the checkpoint's step: nothing to do, and the line
    says the checkpoint is past N (not that N is 'the run's final step');
    nothing is published or remembered."""
    run = trained.parent
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    status, out, err = cli("train", "--run-dir", run, "--checkpoint", trained, "--until", "1",
                           "--no-sample")
    assert status == 0 and "is at step 2, past --until 1" in out, (out, err)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def transpose_first_matrix(parameters):
    """The first tensor of two different dims listed with its shape reversed."""
    matrix = next(p for p in parameters if len(set(p["shape"])) == 2)
    matrix["shape"] = matrix["shape"][::-1]


@pytest.mark.parametrize("change", [
    lambda h: h["parameters"][1].update(name="layers.0.attn_norm.gamma"),  # renamed
    lambda h: transpose_first_matrix(h["parameters"]),
], ids=["renamed", "transposed"])
def test_inspect_says_what_train_says_of_a_checkpoint_that_does_not_bind(tmp_path, trained,
                                                                          change):
    """A checkpoint whose digest is right but whose tensors do not bind to
    its model: inspect refuses it with train's own words, not 'sha256 ok'."""
    bad = reheader(trained, tmp_path / "bad.bin", change)
    status, out, err = cli("inspect", bad)
    assert "sha256 ok" in out and "binding        refused" in out
    one_line_error(status, err)
    t_status, _, t_err = cli("train", "--run-dir", tmp_path / "r", "--checkpoint", bad,
                             "--stream", trained.parent.parent / "s.tokens", "--steps", "1",
                             "--no-sample", "--backend", "reference")
    assert t_status == 2
    assert err.split("error: ", 1)[1] == t_err.split("error: ", 1)[1]
    status, out, err = cli("inspect", trained)
    assert status == 0 and "binding        ok" in out


def test_ctrl_c_while_the_command_line_imports_is_one_line_not_a_traceback():
    """SIGINT at several moments of the first second (while NumPy and the
    project are imported, before any work): no traceback; status 130 (or
    killed by the signal, before Python's handler exists; or, on a loaded
    machine, the interpreter's own fatal error while it starts, which no
    program's code can reach)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for delay in (0.05, 0.2, 0.4, 0.7):
        p = subprocess.Popen([sys.executable, "-m", "coppelius", "program", "--backend",
                              "reference", "--preset", "test"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
        if "init_import_site" in err:  # the interpreter's own start, before any of ours
            continue
        assert "Traceback" not in err, (delay, err)
        assert p.returncode in (130, -signal.SIGINT, 0), (delay, p.returncode, err)
        if p.returncode == 130:
            assert err.strip().splitlines()[-1].endswith("interrupted"), err


def test_another_users_checkpoint_in_a_sticky_folder_is_refused_before_training(
        tmp_path, stream, trained, monkeypatch):
    """In a folder with the sticky bit only the file's owner, the folder's
    and root may replace a file: a run as another user is refused at once,
    naming the checkpoint, not after training at its first publication."""
    shared = tmp_path / "shared"
    shared.mkdir()
    ckpt = shared / "ck.bin"
    ckpt.write_bytes(trained.read_bytes())
    shared.chmod(0o1777)
    owner = os.stat(ckpt).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)  # neither the file's nor the folder's
    status, out, err = cli(*train_argv(stream, tmp_path / "r", ckpt, "--steps", "1"))
    one_line_error(status, err, str(ckpt), "sticky")
    assert "step 1" not in out
    monkeypatch.setattr(os, "geteuid", lambda: owner)  # the owner may
    status, out, err = cli(*train_argv(stream, tmp_path / "r", ckpt, "--steps", "1"))
    assert status == 0, err
