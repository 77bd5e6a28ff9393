"""A run directory belongs to one run (SPEC 9, Reading): another checkpoint
or other data gets a directory of its own, or a one-line refusal naming
--run-dir whose hinted command works (each is run here); run.json remembers
what the user chose (--until, not --steps), is written only once a first
step is taken, and is locked against a second run; `eval` trusts a run.json
only for its own checkpoint and stream; the stream cache is keyed by the
source's identity in one user cache (SPEC 8, Reading). Each case is a
command line in a new process, under a timeout."""

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from coppelius.reference import results
from coppelius.reference.checkpoint import validate
from coppelius.reference.config import PRESETS

from tests.support import pattern_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = PRESETS["test"]
T = ["--preset", "test", "--backend", "reference", "--no-sample"]
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega").split()


def run(*argv, cwd, env=None, timeout=120):
    """`coppelius ARGV` in a new process in `cwd` -> (status, stdout, stderr)."""
    full = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "coppelius", *map(str, argv)], cwd=cwd, env=full,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def refused(status, err, *words):
    """Exit 2, one line, no traceback, every word in it -> the line."""
    assert status == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for word in words:
        assert str(word) in err, (word, err)
    return err.strip()


def stopped(status, err, *words):
    """A run that started: exit 2, its last line the error, no traceback."""
    assert status == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("coppelius train: error: "), err
    for word in words:
        assert str(word) in last, (word, err)


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def tree(folder) -> dict:
    """Every file under `folder` -> its SHA-256."""
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def options(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())["options"]


def batch_of(ckpt) -> str:
    return re.search(r"\|batch=(\d+)\|", validate(ckpt).header["data"]).group(1)


def notes(folder, seed, files=2):
    """A folder of a few text files of words (a source a V = 320 BPE can learn)."""
    import random

    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for i in range(files):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(150))
        (folder / f"n{i}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture
def stream(tmp_path):
    """A synthetic stream of 200 test-preset contexts (no tokenizer)."""
    return pattern_stream(tmp_path / "s.tokens", CFG, 200, noise=0.1)


@pytest.fixture
def model(tmp_path):
    """m.toml: the test preset with V = 320, so that a source trains a BPE."""
    path = tmp_path / "m.toml"
    path.write_text("vocab = 320\n")
    return path


# ---------------------------------------------------------------- another checkpoint

def test_a_run_of_another_checkpoint_in_a_run_dir_is_refused_and_the_hint_works(tmp_path, stream):
    """Issue 28.1, 28.2: a fresh run with --checkpoint R/b.bin in the run
    directory of R/a.bin neither inherits a's --batch 4 nor takes over its
    run.json; the refusal names --run-dir, and with one of its own the run
    trains b.bin at batch 1. `eval R/a.bin` still evaluates a on its stream."""
    R = tmp_path / "R"
    status, _, err = run("train", *T, "--stream", stream, "--run-dir", R, "--checkpoint",
                         R / "a.bin", "--batch", "4", "--steps", "2", cwd=tmp_path)
    assert status == 0, err
    before = tree(R)
    again = ["train", *T, "--stream", stream, "--checkpoint", R / "b.bin", "--steps", "2"]
    line = refused(*run(*again, "--run-dir", R, cwd=tmp_path)[::2],
                   f"run directory {R} holds the run of the checkpoint {R / 'a.bin'}",
                   "--run-dir of its own")
    assert "--new-data" not in line  # another checkpoint is never the run's
    assert tree(R) == before  # nothing written, nothing changed
    status, _, err = run(*again, "--run-dir", tmp_path / "R2", cwd=tmp_path)  # the hint
    assert status == 0, err
    assert batch_of(R / "b.bin") == "1" and batch_of(R / "a.bin") == "4"
    assert tree(R) == before | {"b.bin": digest(R / "b.bin")}
    status, out, err = run("eval", R / "a.bin", cwd=tmp_path)
    assert status == 0 and f"of {stream}," in out, (out, err)


def test_the_default_run_dir_of_another_checkpoint_is_one_of_its_own(tmp_path, stream):
    """Issue 27.2: `train --batch 4`, then `train --checkpoint other.bin`
    (the default run directory both times): the second trains at batch 1 in
    runs/test-other, leaving runs/test as it was; a plain run then goes on
    with runs/test's own checkpoint at its batch 4."""
    status, _, err = run("train", *T, "--stream", stream, "--batch", "4", "--steps", "2",
                         cwd=tmp_path)
    assert status == 0, err
    first = tmp_path / "runs" / "test"
    before = tree(first)
    status, _, err = run("train", *T, "--stream", stream, "--steps", "2", "--checkpoint",
                         "other.bin", cwd=tmp_path)
    assert status == 0, err
    own = tmp_path / "runs" / "test-other"
    assert f"note: runs/test holds the run of the checkpoint {first / 'checkpoint.bin'}; this " \
           f"run's directory is runs/test-other" in err, err
    assert tree(first) == before and batch_of(tmp_path / "other.bin") == "1"
    assert options(own)["checkpoint"] == str(tmp_path / "other.bin")
    assert sorted(p.name for p in own.glob("results-*.bin")) == ["results-0.bin"]
    status, _, err = run("train", *T, "--stream", stream, "--steps", "1", cwd=tmp_path)
    assert status == 0, err
    assert validate(first / "checkpoint.bin").header["step"] == 3
    assert batch_of(first / "checkpoint.bin") == "4"
    # another other.bin: both directories hold other runs, and the hint works
    (tmp_path / "x").mkdir()
    third = ["train", *T, "--stream", stream, "--steps", "1", "--checkpoint", "x/other.bin"]
    refused(*run(*third, cwd=tmp_path)[::2], "runs/test and runs/test-other hold other runs",
            "give this run a --run-dir of its own")
    status, _, err = run(*third, "--run-dir", "runs/x", cwd=tmp_path)
    assert status == 0, err


def test_a_run_json_of_no_options_is_a_run_too(tmp_path, stream):
    """`coppelius train --steps 2` with the default preset on the embedded
    corpus remembers no option: its run.json still holds that run, so a run
    naming a stream takes a directory of its own."""
    R = tmp_path / "runs" / "test"
    R.mkdir(parents=True)
    (R / "run.json").write_text('{"format": "coppelius-run-v1", "options": {}}')
    status, _, err = run("train", *T, "--stream", stream, "--steps", "1", cwd=tmp_path)
    assert status == 0, err
    assert "note: runs/test holds the run of the embedded corpus; this run's directory is " \
           "runs/test-s" in err
    assert (R / "run.json").read_text() == '{"format": "coppelius-run-v1", "options": {}}'


# ---------------------------------------------------------------- how far; what is remembered

def test_a_steps_smoke_test_leaves_the_run_to_go_on_and_the_model_files_steps_hold(tmp_path,
                                                                                    stream):
    """Issue 27.2: `--steps 2 --eval-every 0` then a plain train goes on to
    the model's step count and evaluates (neither --steps nor the smoke
    test's --eval-every is remembered); editing `steps` in the model file
    moves the run's end; --until is remembered."""
    toml = tmp_path / "m.toml"
    toml.write_text("steps = 4\n")
    R = tmp_path / "R"
    base = ["train", "--preset", "test", "--backend", "reference", "--no-sample", "--run-dir", R]
    status, _, err = run(*base, "--model", toml, "--stream", stream, "--steps", "2",
                         "--eval-every", "0", cwd=tmp_path)
    assert status == 0, err
    assert "final_step" not in options(R) and "eval_every" not in options(R)
    status, out, err = run(*base, cwd=tmp_path)  # what the run remembers, and nothing else
    assert status == 0 and "steps 2..4" in err, (out, err)
    assert [e[0] for e in results.read_results(str(R / "results-2.bin")).evals] == [4]
    toml.write_text("steps = 6\n")
    status, out, err = run(*base, cwd=tmp_path)
    assert status == 0 and "steps 4..6" in err, (out, err)
    status, out, err = run(*base, "--until", "7", "--eval-every", "0", cwd=tmp_path)
    assert status == 0 and options(R)["final_step"] == 7 and options(R)["eval_every"] == 0
    status, out, err = run(*base, cwd=tmp_path)
    assert status == 0 and "nothing to do" in out and "step 7" in out, (out, err)


# ---------------------------------------------------------------- another source

def test_a_new_source_after_the_default_run_is_a_run_of_its_own_and_every_hint_works(
        tmp_path, model):
    """Issue 27.3: after the run in the default directory, `--source other/`
    trains in runs/m-other (and continues there the next time); continuing
    the default run on it with --new-data names the --tokenizer that works,
    and so does the refusal of an explicit --run-dir; each hint is run."""
    notes(tmp_path / "notes", 1)
    notes(tmp_path / "other", 2)
    notes(tmp_path / "third", 3)
    base = ["train", *T, "--model", model, "--steps", "1"]
    assert run(*base, "--source", "notes", cwd=tmp_path)[0] == 0
    default = tmp_path / "runs" / "m"
    status, _, err = run(*base, "--source", "other", cwd=tmp_path)
    assert status == 0, err
    assert "this run's directory is runs/m-other" in err
    status, _, err = run(*base, "--source", "other", cwd=tmp_path)
    assert status == 0 and "steps 1..2" in err, err
    assert validate(default / "checkpoint.bin").header["step"] == 1
    # go on with the default run's checkpoint on a third source: --new-data
    # alone trains another tokenizer, and the refusal names the one to reuse
    line = refused(*run(*base, "--source", "third", "--new-data", cwd=tmp_path)[::2],
                   f"--tokenizer {default / 'tokenizer.json'})")
    hint = line[line.index("--tokenizer"):-1].split()
    status, _, err = run(*base, "--source", "third", "--new-data", *hint, cwd=tmp_path)
    assert status == 0, err
    assert validate(default / "checkpoint.bin").header["step"] == 2
    assert options(default)["source"] == str(tmp_path / "third")
    # an explicit --run-dir whose run is on other data: its hint works as given
    line = refused(*run(*base, "--run-dir", default, "--source", "notes", cwd=tmp_path)[::2],
                   f"run directory {default} holds the run of source {tmp_path / 'third'}",
                   "--run-dir of its own")
    hint = line[line.index("or pass ") + 8:line.index(" to go on")].split()
    assert hint[0] == "--new-data", line
    status, _, err = run(*base, "--run-dir", default, "--source", "notes", *hint, cwd=tmp_path)
    assert status == 0, err
    assert validate(default / "checkpoint.bin").header["step"] == 3


# ---------------------------------------------------------------- the batch on resume

def test_another_batch_on_resume_is_refused_naming_what_works(tmp_path, stream):
    """Issue 27.13 (not lifted: SPEC 9's "nothing else may change"): the
    refusal names the checkpoint's batch and a run directory of its own;
    both work."""
    R = tmp_path / "R"
    base = ["train", *T, "--stream", stream, "--steps", "1"]
    assert run(*base, "--run-dir", R, "--batch", "2", cwd=tmp_path)[0] == 0
    before = tree(R)
    refused(*run(*base, "--run-dir", R, "--batch", "4", cwd=tmp_path)[::2],
            "the checkpoint was trained with --batch 2",
            "another batch is a new run, with a --run-dir of its own")
    assert tree(R) == before
    status, _, err = run(*base, "--run-dir", R, "--batch", "2", cwd=tmp_path)
    assert status == 0, err
    status, _, err = run(*base, "--run-dir", tmp_path / "R4", "--batch", "4", cwd=tmp_path)
    assert status == 0, err
    assert batch_of(tmp_path / "R4" / "checkpoint.bin") == "4"


# ---------------------------------------------------------------- when run.json is written

OUT_OF_MEMORY_CHILD = """
import sys
sys.path.insert(0, {root!r})
from coppelius.reference import program
capture = program.capture

def failing(*args, **kwargs):
    made = capture(*args, **kwargs)
    def submit(tokens):
        raise MemoryError
    made.submit = submit
    return made

program.capture = failing
from coppelius.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_out_of_memory_in_its_first_step_changes_no_run_json(tmp_path, stream):
    """Issue 28.6: a run that cannot take its first step (out of memory in
    the step) leaves run.json as it was and no result file of a header
    alone; an identity refusal (another --seed) likewise."""
    R = tmp_path / "R"
    base = ["train", *T, "--stream", stream, "--run-dir", R]
    assert run(*base, "--until", "1", cwd=tmp_path)[0] == 0
    before = tree(R)
    p = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY_CHILD.format(root=ROOT),
                        *map(str, base), "--until", "5", "--batch", "1", "--eval-every", "0"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    stopped(p.returncode, p.stderr, "out of memory")
    assert tree(R) == before
    fresh = tmp_path / "F"
    p = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY_CHILD.format(root=ROOT), "train",
                        *T, "--stream", str(stream), "--run-dir", str(fresh), "--steps", "1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    stopped(p.returncode, p.stderr, "out of memory")
    assert not fresh.exists()  # no run.json, no result file, no folder made for them
    refused(*run(*base, "--until", "5", "--seed", "7", cwd=tmp_path)[::2], "--seed 20260925")
    assert tree(R) == before


# ---------------------------------------------------------------- two runs at once

def test_a_second_run_in_a_run_dir_is_refused_while_the_first_trains(tmp_path, stream):
    """Issue 28.18: while a run trains in R, a second run there is refused at
    once naming the first's process and --run-dir, and takes nothing of the
    first's options; run.json keeps the first's."""
    R = tmp_path / "R"
    env = dict(os.environ, PYTHONPATH=ROOT)
    first = subprocess.Popen([sys.executable, "-m", "coppelius", "train", *T, "--stream",
                              str(stream), "--run-dir", str(R), "--batch", "2", "--until",
                              "100000", "--interval", "5", "--repeat-data"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        while not (R / "checkpoint.bin").exists() and first.poll() is None \
                and time.time() < deadline:
            time.sleep(0.05)
        assert (R / "checkpoint.bin").exists(), first.poll()
        second = ["train", *T, "--stream", stream, "--steps", "1"]
        refused(*run(*second, "--run-dir", R, cwd=tmp_path)[::2],
                f"run directory {R}: another run trains there (process {first.pid})",
                "--run-dir of its own")
        status, _, err = run(*second, "--run-dir", tmp_path / "R2", cwd=tmp_path)  # the hint
        assert status == 0, err
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM
    assert options(R)["batch"] == 2 and options(R)["final_step"] == 100000
    assert not (R / ".run.json.lock").exists()


# ---------------------------------------------------------------- eval and run.json

def test_eval_trusts_a_run_json_only_for_its_own_checkpoint_and_stream(tmp_path, stream):
    """Issue 28.21: `eval A.bin` beside a run.json of another checkpoint, or
    whose stream is no longer the one A was trained on, is refused asking for
    --stream (which then works)."""
    R = tmp_path / "R"
    assert run("train", *T, "--stream", stream, "--run-dir", R, "--steps", "2",
               cwd=tmp_path)[0] == 0
    shutil.copy(R / "checkpoint.bin", R / "copy.bin")
    refused(*run("eval", R / "copy.bin", cwd=tmp_path)[::2],
            f"is the run of {R / 'checkpoint.bin'}, not of this checkpoint (pass --stream)")
    kept = tmp_path / "kept.tokens"
    shutil.copy(stream, kept)
    pattern_stream(stream, CFG, 200, noise=0.5)  # the run's stream, made again otherwise
    refused(*run("eval", R / "checkpoint.bin", cwd=tmp_path)[::2],
            f"the stream {stream} of its run.json is not the one it was trained on",
            "pass --stream")
    status, out, err = run("eval", R / "checkpoint.bin", "--stream", kept, cwd=tmp_path)
    assert status == 0 and "held-out loss" in out, err


def test_eval_says_when_it_prepares_the_embedded_corpus(tmp_path, model, monkeypatch, capsys):
    """Issue 28.21: a run.json naming no stream is the embedded corpus: eval
    says it prepares it (a one-file standard library here), and refuses it
    when it is not the checkpoint's stream."""
    import sysconfig

    from coppelius.cli import main

    lib = tmp_path / "lib"
    notes(lib, 4, files=1)
    (lib / "n0.txt").rename(lib / "json.py")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(lib)})
    s = pattern_stream(tmp_path / "s.tokens", dataclasses.replace(CFG, vocab=320), 200, 0.1)
    R = tmp_path / "R"
    assert main(["train", *T, "--model", str(model), "--stream", s, "--run-dir", str(R),
                 "--steps", "1"]) == 0
    doc = json.loads((R / "run.json").read_text())
    del doc["options"]["stream"]  # as a run on the embedded corpus remembers it
    (R / "run.json").write_text(json.dumps(doc))
    capsys.readouterr()
    status = main(["eval", str(R / "checkpoint.bin")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "note: the run trained on the embedded corpus" in err
    assert "is not the one it was trained on" in err


# ---------------------------------------------------------------- the stream cache

def test_the_stream_cache_is_the_users_and_keyed_by_the_sources_documents(tmp_path):
    """Issue 27.5: two folders named notes in two working folders get entries
    of their own in one cache (neither replaces the other); the same
    documents copied elsewhere (other mtimes) find theirs made; the cache is
    $COPPELIUS_CACHE, else $XDG_CACHE_HOME/coppelius, else ~/.cache/coppelius;
    two processes making one entry at once make it once, whole."""
    cache = tmp_path / "cache"
    a, b = tmp_path / "a", tmp_path / "b"
    notes(a / "notes", 1)
    notes(b / "notes", 2)
    env = {"COPPELIUS_CACHE": str(cache)}
    outs = []
    for work in (a, b, a):
        status, out, err = run("tokenize", "notes", "--vocab", "320", cwd=work, env=env)
        assert status == 0, err
        outs.append(out.split(":")[0])
    assert outs[0].startswith(f"wrote {cache}{os.sep}notes-dir-v320-")
    assert outs[1].startswith("wrote ") and outs[1] != outs[0]
    assert outs[2] == outs[0].replace("wrote", "up to date")  # b's notes replaced nothing
    assert len(list(cache.iterdir())) == 2 and not (a / "runs").exists()
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(a / "notes", copy / "notes")  # the same documents, new mtimes
    os.utime(copy / "notes" / "n0.txt", ns=(10**18, 10**18))
    status, out, err = run("tokenize", "notes", "--vocab", "320", cwd=copy, env=env)
    assert status == 0 and out.split(":")[0] == outs[2], (out, err)
    # where the cache is when COPPELIUS_CACHE is not set
    bare = {k: v for k, v in os.environ.items() if k not in ("COPPELIUS_CACHE", "XDG_CACHE_HOME")}
    for extra, where in (({"XDG_CACHE_HOME": str(tmp_path / "xdg")}, tmp_path / "xdg"),
                         ({"HOME": str(tmp_path / "home")}, tmp_path / "home" / ".cache")):
        p = subprocess.run([sys.executable, "-c", "from coppelius import data; "
                            "print(data.default_cache_dir())"],
                           env=dict(bare, PYTHONPATH=ROOT, **extra), capture_output=True,
                           text=True, timeout=60)
        assert p.stdout.strip() == str(where / "coppelius"), p.stderr
    # two at once: one waits for the other, both read the one entry
    both = [subprocess.Popen([sys.executable, "-m", "coppelius", "tokenize", "notes", "--vocab",
                              "320", "--cache-dir", str(tmp_path / "c2")], cwd=b,
                             env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], done
    [entry] = (tmp_path / "c2").iterdir()
    assert sorted(n.name for n in entry.iterdir() if not n.name.startswith(".")) == sorted(
        [entry.name + ".tokens", entry.name + ".tokens.sha256", entry.name + ".documents.json",
         "tokenizer.json"])
    assert {out.split(":")[0].split()[-1] for out, _ in done} == {
        str(entry / (entry.name + ".tokens"))}
