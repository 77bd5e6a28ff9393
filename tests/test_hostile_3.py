"""Hostile input, round 3: signals during publication, full disks, file
names that are not UTF-8, tokenizers whose ids are not 0..V-1, numeric
options at their edges. Every case runs under a deadline (a subprocess
timeout, or tests.test_hostile's SIGALRM) and ends in a correct result or
one line and its exit status, nothing published changed."""

import errno
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from coppelius.reference import fsutil
from coppelius.reference.checkpoint import validate
from tests.test_hostile import (CFG, ROOT, V, cli, one_line_error, run_cli, source_text,
                                stream, train_argv, trained, trained_once, tree)

__all__ = ["stream", "trained", "trained_once"]  # fixtures, used by name


def leftovers(folder):
    """Temporaries and set-aside folders of publications under `folder`."""
    return sorted(p.name for p in folder.rglob(".*")
                  if p.name.endswith((fsutil.TEMP_SUFFIX, ".tmp", ".old", ".staged")))


# ------------------------------------------------------------------ signals while publishing

# A child that runs a command and, as the count-th file of the named thread
# is written (before it is synced and renamed), sends itself the signal
# twice, the second while the first is being acted on.
TWICE_CHILD = """
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
from coppelius.cli import main
from coppelius.reference import fsutil
count = [0]
def hook(phase):
    if phase == "written" and threading.current_thread().name == {thread!r}:
        count[0] += 1
        if count[0] == {at}:
            os.kill(os.getpid(), {signum})
            time.sleep(0.2)
            os.kill(os.getpid(), {signum})
            time.sleep(0.2)
fsutil._hook = hook
sys.exit(main(sys.argv[1:]))
"""


def run_child(code, argv, timeout=120):
    p = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("thread, at", [("coppelius-publish", 2), ("MainThread", 1)],
                         ids=["checkpoint", "run-file"])
def test_two_quick_signals_during_training_leave_no_temporary(tmp_path, stream, signum,
                                                              thread, at):
    """Two signals while a checkpoint (on its background thread) or the run
    file (on the main thread) is being written: the run stops at once with
    128 + N, the publication in flight ends whole or not at all, and no
    temporary is left (a join cut short by the second signal used to let
    the interpreter exit in the middle of the checkpoint's write)."""
    run = tmp_path / "run"
    argv = train_argv(stream, run, run / "ck.bin", "--steps", "6", "--interval", "1")
    code = TWICE_CHILD.format(root=ROOT, thread=thread, at=at, signum=int(signum))
    status, err = run_child(code, argv)
    assert status == 128 + signum, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("coppelius train: interrupted" if signum == signal.SIGINT
                                            else "coppelius train: stopped by signal 15")
    assert leftovers(tmp_path) == []
    if thread == "coppelius-publish":
        assert validate(run / "ck.bin").header["step"] == at


# A child that exports with --force and sends itself SIGTERM at one moment
# of the directory's publication: as the count-th file is renamed into the
# new folder, or as the old export, set aside, starts being removed.
EXPORT_CHILD = """
import os, shutil, signal, sys
sys.path.insert(0, {root!r})
from coppelius import hf
from coppelius.cli import main
from coppelius.reference import fsutil
count = [0]
def hook(phase):
    if phase == "renamed":
        count[0] += 1
        if count[0] == {at}:
            os.kill(os.getpid(), signal.SIGTERM)
real_rmtree = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if {at} == 0 and path.endswith(".old"):
        os.kill(os.getpid(), signal.SIGTERM)
    return real_rmtree(path, *args, **kwargs)
fsutil._hook = hook
hf.shutil.rmtree = rmtree
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("at", [0, 1, 3])
def test_sigterm_during_an_export_over_a_previous_one_leaves_no_folder_aside(tmp_path, trained,
                                                                              at):
    """SIGTERM while `export --format hf --force` publishes over a previous
    export: status 143, the folder holds a whole export (the old or the
    new), and neither the new folder nor the old one set aside is left."""
    out = tmp_path / "hf"
    argv = ["export", trained, out, "--format", "hf", "--no-tokenizer"]
    assert cli(*argv)[0] == 0
    before = sorted(p.name for p in out.iterdir())
    config = (out / "config.json").read_bytes()
    status, err = run_child(EXPORT_CHILD.format(root=ROOT, at=at), argv + ["--force"])
    assert status == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().endswith("stopped by signal 15"), err
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in out.iterdir()) == before  # a whole export, old or new
    assert (out / "config.json").read_bytes() == config


# ------------------------------------------------------------------ full disks

def full_disk_at(monkeypatch, at):
    """The at-th file written (through fsutil, where every output is) fails
    as a full disk does, once its body is written (ENOSPC at the flush)."""
    count = [0]

    def hook(phase):
        if phase == "written":
            count[0] += 1
            if count[0] == at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fsutil, "_hook", hook)
    return count


FULL_DISK_CASES = [  # (command, how many files it writes)
    ("report", 2), ("export", 1), ("export hf", 3), ("export hf --force", 3),
    ("tokenize", 4), ("tokenize --eos", 4), ("tokenize again", 4),
]


@pytest.mark.parametrize("command, files", FULL_DISK_CASES)
def test_a_full_disk_leaves_no_partial_output_and_exits_2(tmp_path, trained, monkeypatch,
                                                           command, files):
    """ENOSPC while any one of a command's files is written: one line
    naming that file, exit 2, and every file as it was before (no plot
    without its CSV, no stream without its digest, no folder made)."""
    out = tmp_path / "out"
    source = source_text(tmp_path)
    argv = {
        "report": ["report", trained.parent, "--plot", out / "p.png", "--csv", out / "p.csv"],
        "export": ["export", trained, out / "x.safetensors"],
        "export hf": ["export", trained, out / "hf", "--format", "hf", "--no-tokenizer"],
        "export hf --force": ["export", trained, out / "hf", "--format", "hf", "--no-tokenizer",
                              "--force"],
        "tokenize": ["tokenize", source, "--vocab", V, "--out", out / "c" / "a.tokens"],
        "tokenize --eos": ["tokenize", source, "--vocab", V, "--eos", "<|e|>", "--out",
                           out / "c" / "a.tokens"],
        "tokenize again": ["tokenize", source, "--vocab", V, "--out", out / "c" / "a.tokens"],
    }[command]
    if not command.startswith("tokenize"):  # tokenize makes its folder (and, failing, removes it)
        out.mkdir()
    if command == "export hf --force":
        assert cli(*argv[:-1])[0] == 0
    if command == "tokenize again":  # a stream made before, its source changed since
        assert cli(*argv)[0] == 0
        with open(source, "a") as f:
            f.write("\n# more\n")
    for at in range(1, files + 1):
        before = tree(tmp_path)
        count = full_disk_at(monkeypatch, at)
        status, _, err = cli(*argv)
        assert count[0] >= at, (at, count)
        one_line_error(status, err, "No space left on device")
        assert tree(tmp_path) == before, at
        assert leftovers(tmp_path) == []
    count = full_disk_at(monkeypatch, files + 1)  # it writes no more than that
    status, _, err = cli(*argv)
    assert status == 0 and count[0] == files, err


# ------------------------------------------------------------------ names that are not UTF-8

def test_a_folder_holding_a_name_that_is_not_utf8_is_tokenized_skipping_it(tmp_path):
    """A file named with the byte 0xff in a source folder is skipped and
    counted (its name could not be a marker line), the list of skipped
    entries shows it as \\xff, and the stream is published with its
    tokenizer, document list and digest; a file source so named is read."""
    from coppelius import data

    folder = tmp_path / "src"
    folder.mkdir()
    os.rename(source_text(tmp_path), folder / "a.txt")
    (folder / os.fsdecode(b"\xff.txt")).write_text("never read\n")
    out = tmp_path / "c" / "a.tokens"
    status, stdout, err = cli("tokenize", folder, "--vocab", V, "--out", out)
    assert status == 0 and "Traceback" not in err, err
    assert "1 document, 1 other entry skipped" in stdout
    assert json.loads(open(data.documents_beside(out)).read())["skipped"] == ["\\xff.txt"]
    assert data.read_digest(out) is not None and os.path.exists(data.tokenizer_beside(out))
    assert cli("tokenize", folder, "--vocab", V, "--out", out)[1].startswith("up to date")
    odd = tmp_path / os.fsdecode(b"x\xfe.txt")
    os.rename(folder / "a.txt", odd)
    out2 = tmp_path / "c2" / "a.tokens"
    status, stdout, err = cli("tokenize", odd, "--vocab", V, "--out", out2)
    assert status == 0 and "Traceback" not in err, err
    assert json.loads(open(data.documents_beside(out2)).read())["documents"] == ["x\\xfe.txt"]
    assert cli("tokenize", odd, "--vocab", V, "--out", out2)[1].startswith("up to date")


# ------------------------------------------------------------------ models too large to build

HUGE_MODEL = "vocab = 64\ncontext = 16\nd_model = 4096\nn_layer = 1000000\nn_head = 2\nd_ff = 96\n"


def test_bench_refuses_a_model_that_cannot_fit_at_once_as_train_does(tmp_path, stream):
    """`bench --model` of n_layer = 1000000 is refused before anything is
    built, with the words `train` refuses it with (one check, in
    reference.limits)."""
    model = tmp_path / "m.toml"
    model.write_text(HUGE_MODEL)
    status, _, err = run_cli("bench", "--model", model, "--backend", "reference", timeout=60)
    one_line_error(status, err, "--batch=1 on the", "needs at least", "of memory")
    t_status, _, t_err = cli(*train_argv(stream, tmp_path / "r", tmp_path / "r" / "ck",
                                         "--model", model))
    assert t_status == 2
    assert err.split("needs", 1)[1] == t_err.split("needs", 1)[1]
