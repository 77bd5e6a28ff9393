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
    from coppelius.tokenizer import tokenizer_beside

    folder = tmp_path / "src"
    folder.mkdir()
    os.rename(source_text(tmp_path), folder / "a.txt")
    (folder / os.fsdecode(b"\xff.txt")).write_text("never read\n")
    out = tmp_path / "c" / "a.tokens"
    status, stdout, err = cli("tokenize", folder, "--vocab", V, "--out", out)
    assert status == 0 and "Traceback" not in err, err
    assert "1 document, 1 other entry skipped" in stdout
    assert json.loads(open(data.documents_beside(out)).read())["skipped"] == ["\\xff.txt"]
    assert data.read_digest(out) is not None and os.path.exists(tokenizer_beside(out))
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


# ------------------------------------------------------------------ eval of a run's own tokenizer

def test_eval_encodes_the_runs_source_with_the_runs_tokenizer(tmp_path, monkeypatch):
    """A run trained with --tokenizer on a source is evaluated on that
    source encoded by that tokenizer (it used to train a BPE of its own,
    refused at V=64): by run.json's, or by eval --tokenizer naming the same
    file; another tokenizer is refused by name, nothing evaluated."""
    from tests.test_hostile import word_tokenizer

    monkeypatch.chdir(tmp_path)  # the stream cache, runs/data, under the test's folder
    tok = word_tokenizer(tmp_path / "tok.json")
    rng = np.random.default_rng(0)
    source = tmp_path / "words.txt"
    source.write_text(" ".join(f"w{i}" for i in rng.integers(0, CFG.vocab - 1, 60 * 17)) + "\n")
    run = tmp_path / "run"
    status, out, err = cli("train", "--preset", "test", "--backend", "reference", "--source",
                           source, "--tokenizer", tok, "--run-dir", run, "--checkpoint",
                           run / "ck.bin", "--steps", "2", "--no-sample")
    assert status == 0, err
    held = out.split("held-out loss at step 2: ")[1].split()[0]
    for extra in ([], ["--tokenizer", tok]):
        status, out, err = cli("eval", run, *extra)
        assert status == 0, err
        assert f"held-out loss {held}" in out
    other = word_tokenizer(tmp_path / "other.json", vocab=CFG.vocab - 1)
    status, out, err = cli("eval", run, "--tokenizer", other)
    one_line_error(status, err, "--tokenizer", other, "is not checkpoint", "tokenizer")
    assert out == ""
    status, _, err = cli("eval", run, "--tokenizer", tok, "--stream", tmp_path / "x.tokens")
    one_line_error(status, err, "--tokenizer", "a --stream is encoded already")


# ------------------------------------------------------------------ non-finite losses

def test_a_non_finite_loss_is_status_3_in_train_and_eval(tmp_path, stream, trained):
    """SPEC 9: `train --lr 1e30` stops at its first step with status 3,
    publishing nothing; `eval` of a checkpoint whose loss overflows is
    status 3 too, not a held-out loss of nan with status 0."""
    from tests.test_hostile import N, build_checkpoint, result_records

    run = tmp_path / "r"
    status, out, err = cli(*train_argv(stream, run, run / "ck.bin", "--steps", "2", "--lr", "1e30"))
    assert status == 3, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("coppelius train: error: step ") and \
        "non-finite" in err.strip().splitlines()[-1], err
    assert not (run / "ck.bin").exists()
    data, hn, start = result_records(trained)
    payload = np.frombuffer(data[start:len(data) - 48], dtype="<f4").copy()
    payload[:N] = 3e38  # finite parameters whose forward overflows
    huge = build_checkpoint(tmp_path / "huge.ck", raw=data[16:16 + hn], payload=payload.tobytes())
    status, out, err = cli("eval", huge, "--stream", stream)
    assert status == 3, err
    assert "not finite" in err or "non-finite" in err or "finite loss" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert cli("eval", trained, "--stream", stream)[0] == 0


# ------------------------------------------------------------------ numeric options at their edges

NOT_INTEGERS = ["1e400", "nan", "inf", "-inf", "1.5", "1e30"]
NOT_NUMBERS = ["nan", "inf", "-inf", "1e400"]
HUGE = "99999999999999999999999"
# option -> (extra arguments it needs, the values it refuses); every other
# value of -1, 0, HUGE, nan, inf, -inf, 1.5, 1e30 trains (or, for lr and
# weight decay, stops at a non-finite loss with status 3)
EDGES = {
    "steps": ([], ["-1", "0", HUGE] + NOT_INTEGERS),
    "until": ([], ["-1", HUGE] + NOT_INTEGERS),
    "interval": ([], ["-1", "0", HUGE] + NOT_INTEGERS),
    "batch": ([], ["-1", "0", HUGE] + NOT_INTEGERS),
    "accumulate": ([], ["-1", "0", HUGE] + NOT_INTEGERS),
    "gpus": ([], ["-1", "0", HUGE] + NOT_INTEGERS),
    "eval-contexts": ([], ["-1", HUGE] + NOT_INTEGERS),
    "eval-every": ([], ["-1", HUGE] + NOT_INTEGERS),
    "seed": ([], ["-1", HUGE] + NOT_INTEGERS),
    "blas-threads": ([], ["-1", "0", HUGE] + NOT_INTEGERS),
    "warmup": (["--schedule", "wsd"], ["-1", HUGE] + NOT_INTEGERS),
    "total": (["--schedule", "wsd"], ["-1", "0", HUGE] + NOT_INTEGERS),
    "decay": (["--schedule", "wsd"], ["-1", "0", HUGE] + NOT_INTEGERS),
    "floor": (["--schedule", "cosine"], ["-1", HUGE, "1.5", "1e30"] + NOT_NUMBERS),
    "lr": ([], ["-1", "0"] + NOT_NUMBERS),
    "beta1": ([], ["-1", HUGE, "1.5", "1e30"] + NOT_NUMBERS),
    "beta2": ([], ["-1", HUGE, "1.5", "1e30"] + NOT_NUMBERS),
    "weight-decay": ([], ["-1"] + NOT_NUMBERS),
    "epsilon": ([], ["-1", "0"] + NOT_NUMBERS),
    "clip": ([], ["-1", "0"] + NOT_NUMBERS),
    "peak-tflops": ([], ["-1", "0"] + NOT_NUMBERS),
}


def test_every_numeric_train_option_refuses_its_edge_values_in_one_line(tmp_path, stream):
    """Negative, zero, huge, nan and infinite values of every numeric train
    option that cannot be taken: one line naming the option and the value,
    exit 2, nothing made (not even the run's folder)."""
    run = tmp_path / "run"
    for option, (extra, refused) in EDGES.items():
        steps = [] if option in ("steps", "until") else ["--steps", "1"]
        for value in refused:
            status, _, err = cli(*train_argv(stream, run, run / "ck.bin", *steps, *extra,
                                             f"--{option}", value), seconds=30)
            name = option.replace("-", "_") if option.replace("-", "_") in err else option
            one_line_error(status, err, name)
            assert not run.exists(), (option, value)
            shown = err.split(name, 1)[1][:80]
            assert len(err) < 400, (option, value, err)  # a huge number is not printed whole
            assert any(v in shown for v in (value, "(huge)", "inf", "nan", "-1", "0")), \
                (option, value, err)


# ------------------------------------------------------------------ tokenizers whose ids are odd

def odd_tokenizer(path, change):
    """tests.test_hostile's word tokenizer of V ids, its JSON changed by `change(doc)`."""
    from tests.test_hostile import word_tokenizer

    word_tokenizer(path)
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    return path


def added_token(token_id, content):
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def vocab_of(doc):
    return doc["model"]["vocab"]


TOKENIZER_CASES = {  # name -> (change, None for a correct result or the refusal's words)
    "an id beyond V": (lambda d: vocab_of(d).update(w5=200), ["has 201 ids", "V=64"]),
    "an added token beyond V": (lambda d: d.update(added_tokens=[added_token(64, "<|e|>")]),
                                ["has 65 ids", "V=64"]),
    "an added token not in the vocabulary": (
        lambda d: d.update(added_tokens=[added_token(3, "<|e|>")]), ["has 65 ids", "V=64"]),
    "two tokens of one id": (lambda d: vocab_of(d).update(w5=6),
                             ["the tokens 'w5' and 'w6' share the id 6"]),
    "a negative id": (lambda d: vocab_of(d).update(w5=-1), ["cannot load", "-1"]),
    "an id of 2^40": (lambda d: vocab_of(d).update(w5=2**40), ["cannot load", "1099511627776"]),
    "an id that is not an integer": (lambda d: vocab_of(d).update(w5=1.5), ["cannot load", "1.5"]),
    "a hole": (lambda d: vocab_of(d).pop("w5"), None),
    "ids 1 to V-1": (lambda d: d["model"].update(vocab={f"w{i}": i + 1 for i in range(63)}),
                     None),
    "a special token in its vocabulary": (
        lambda d: d.update(added_tokens=[added_token(63, "[UNK]")]), None),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_a_tokenizer_whose_ids_are_not_0_to_v_minus_1(tmp_path, trained, case):
    """Holes (ids no token has, as a padded V has above the tokenizer's) are
    taken and give the library's own ids; an id at or beyond V, two tokens
    on one id, an id that is not a u32 are refused in one line by tokenize,
    train and sample alike, nothing written."""
    from tokenizers import Tokenizer

    from coppelius.reference.stream import open_stream

    change, words = TOKENIZER_CASES[case]
    tok = odd_tokenizer(tmp_path / "tok.json", change)
    rng = np.random.default_rng(0)
    source = tmp_path / "words.txt"
    source.write_text(" ".join(f"w{i}" for i in rng.integers(0, CFG.vocab - 1, 60 * 17)) + "\n")
    out = tmp_path / "c" / "a.tokens"
    run = tmp_path / "r"
    argvs = {
        "tokenize": ["tokenize", source, "--tokenizer", tok, "--vocab", CFG.vocab, "--out", out],
        "train": ["train", "--preset", "test", "--backend", "reference", "--stream", out,
                  "--run-dir", run, "--checkpoint", run / "ck", "--steps", "1", "--no-sample"],
        "sample": ["sample", trained, "--tokenizer", tok, "--prompt", "w1 w2", "--tokens", "4"],
    }
    if words is not None:
        argvs["train"][5:7] = ["--source", source, "--tokenizer", tok]
        for command, argv in argvs.items():
            before = tree(tmp_path)
            status, _, err = cli(*argv)
            one_line_error(status, err, tok, *words)
            assert tree(tmp_path) == before, command
        return
    status, _, err = cli(*argvs["tokenize"])
    assert status == 0, err
    want = Tokenizer.from_file(str(tok)).encode(source.read_text(), add_special_tokens=False).ids
    assert open_stream(out, CFG.vocab).ids.tolist() == want
    for command in ("train", "sample"):
        status, _, err = cli(*argvs[command])
        assert status == 0 and "Traceback" not in err, (command, err)


# ------------------------------------------------------------------ files that never end

def test_a_model_or_run_file_that_waits_for_data_is_refused_not_waited_on(tmp_path, stream,
                                                                            trained, monkeypatch):
    """A "regular" file whose read waits for data that may never come
    (/proc/kmsg, which only root may read: tests.test_hostile reads it
    there) stands here as a pipe with a writer that writes nothing, opened
    where the model file or run.json is opened: one line, exit 2, no hang,
    nothing made."""
    opened = fsutil._open_nonblocking_regular
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(read_end, False)
        model = tmp_path / "m.toml"
        model.write_text("vocab = 64\n")
        run_file = trained.parent / "run.json"

        def waiting(path):
            if os.fspath(path) in (str(model), str(run_file)):
                return os.dup(read_end)
            return opened(path)

        monkeypatch.setattr(fsutil, "_open_nonblocking_regular", waiting)
        before = tree(tmp_path)
        status, _, err = cli(*train_argv(stream, tmp_path / "r", tmp_path / "r" / "ck", "--model",
                                         model), seconds=20)
        one_line_error(status, err, model, "may never come")
        status, _, err = cli("train", "--run-dir", trained.parent, "--steps", "1", seconds=20)
        one_line_error(status, err, "run.json", "may never come")
        assert tree(tmp_path) == before
    finally:
        os.close(read_end)
        os.close(write_end)
