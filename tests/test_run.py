"""The run loop end to end on the reference backend (SPEC section 9):
exact resume across processes, SIGTERM, non-finite stop, refusals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from coppelius.cli import main
from coppelius.reference import checkpoint, results
from coppelius.reference.binding import load_state
from coppelius.reference.config import PRESETS

from tests.support import pattern_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = PRESETS["test"]


@pytest.fixture
def stream(tmp_path):
    """A synthetic token stream of 40 test-preset contexts (no tokenizer)."""
    return pattern_stream(tmp_path / "s.tokens", CFG, 40, noise=0.1)


def run_cli(*argv):
    """The command line in a new process: exit status, stdout, stderr."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "coppelius", *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def train_args(stream, run_dir, ckpt, *extra):
    backend = [] if "--backend" in extra else ["--backend", "reference"]
    return ["train", "--preset", "test", *backend, "--stream", stream,
            "--run-dir", str(run_dir), "--checkpoint", str(ckpt), "--no-sample", *extra]


def step_records(*paths):
    out = []
    for p in paths:
        r = results.read_results(p)
        assert r.stopped is None, r.stopped
        out += r.steps
    return out


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_resume_is_exact_across_processes(tmp_path, stream, backend):
    a, b = tmp_path / "a", tmp_path / "b"
    on = ["--backend", backend]
    # S1 + S2 = 3 + 2 steps in two processes ...
    rc, out, err = run_cli(*train_args(stream, a, a / "ck.bin", "--steps", "3", "--interval", "2", *on))
    assert rc == 0, err
    rc, out, err = run_cli(*train_args(stream, a, a / "ck.bin", "--steps", "2", *on))
    assert rc == 0, err
    # ... against 5 steps in one
    rc, out, err = run_cli(*train_args(stream, b, b / "ck.bin", "--steps", "5", *on))
    assert rc == 0, err
    assert (a / "ck.bin").read_bytes() == (b / "ck.bin").read_bytes()
    two = step_records(a / "results-0.bin", a / "results-3.bin")
    one = step_records(b / "results-0.bin")
    assert [s for s, _ in two] == [s for s, _ in one] == [0, 1, 2, 3, 4]
    for (_, x), (_, y) in zip(two, one):
        assert x.tobytes() == y.tobytes()
    ck = load_state(str(a / "ck.bin"), CFG)
    assert (ck.step, ck.contexts) == (5, 5)
    # the loss of the learnable stream falls
    means = [float(r.mean()) for _, r in one]
    assert means[-1] < means[0]


def test_result_file_records(tmp_path, stream):
    rc = main(train_args(stream, tmp_path, tmp_path / "ck.bin", "--steps", "4", "--batch", "2"))
    assert rc == 0
    r = results.read_results(str(tmp_path / "results-0.bin"))
    assert r.complete and len(r.steps) == 4 and len(r.timings) == 4
    assert r.header["batch"] == 2 and r.header["repeat_data"] is False
    assert r.forward.shape == (3, CFG.vocab)
    assert all(rows.shape == (2, CFG.context) for _, rows in r.steps)
    ck = load_state(str(tmp_path / "ck.bin"), CFG)
    emb = slice(0, CFG.context)
    assert np.array_equal(r.final["loss_block"][0], r.steps[-1][1][0])
    assert np.array_equal(r.final["loss_block"][2], ck.state.P[emb])
    assert np.array_equal(r.final["loss_block"][3], ck.state.M[emb])


def test_sigterm_publishes_the_last_completed_step(tmp_path, stream):
    env = dict(os.environ, PYTHONPATH=ROOT)
    ck = tmp_path / "ck.bin"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coppelius",
         *train_args(stream, tmp_path, ck, "--steps", "100000", "--interval", "100000",
                     "--repeat-data")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = tmp_path / "results-0.bin"
    deadline = time.time() + 120
    while time.time() < deadline:
        if res.exists() and len(results.read_results(str(res)).steps) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    r = results.read_results(str(res))
    ckp = load_state(str(ck), CFG)
    assert ckp.step == len(r.steps) >= 3
    assert ckp.contexts == ckp.step
    assert not r.complete


def test_nonfinite_stops_with_3_and_keeps_checkpoint(tmp_path, stream):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "2")) == 0
    before = ck.read_bytes()
    # resuming with another lr is refused (the learner identity), so start a
    # fresh run beside it with a huge rate: parameters overflow to inf
    ck2 = tmp_path / "ck2.bin"
    rc, out, err = run_cli(*train_args(stream, tmp_path / "x", ck2, "--steps", "6",
                                       "--interval", "1", "--lr", "1e38"))
    assert rc == 3, err
    assert "non-finite" in err and "Traceback" not in err
    assert ck.read_bytes() == before


def test_too_short_named_stream_is_refused(tmp_path, stream, capsys):
    rc = main(train_args(stream, tmp_path, tmp_path / "ck.bin", "--steps", "37"))
    assert rc == 2
    err = capsys.readouterr().err
    # 40 contexts, the last 4 held out (SPEC 18): 36 for training
    assert "needs 37 contexts but the stream holds 36 for training (4 held out" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ck.bin").exists()
    assert main(train_args(stream, tmp_path, tmp_path / "ck.bin", "--steps", "41",
                           "--repeat-data", "--interval", "100")) == 0
    r = results.read_results(str(tmp_path / "results-0.bin"))
    assert r.header["repeat_data"] is True
    # context 36 is context 0 again: step 36 saw the tokens of step 0
    assert len(r.steps) == 41


def test_resume_under_another_learner_is_refused(tmp_path, stream, capsys):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "1")) == 0
    before = ck.read_bytes()
    capsys.readouterr()
    assert main(train_args(stream, tmp_path, ck, "--steps", "1", "--lr", "0.001")) == 2
    err = capsys.readouterr().err
    assert "learner" in err and "lr=1/1000" in err and "lr=3/10000" in err
    assert ck.read_bytes() == before


def test_existing_results_path_is_refused(tmp_path, stream, capsys):
    ck = tmp_path / "ck.bin"
    existing = tmp_path / "mine.bin"
    existing.write_bytes(b"keep me")
    assert main(train_args(stream, tmp_path, ck, "--steps", "1", "--results", str(existing))) == 2
    assert existing.read_bytes() == b"keep me"
    assert not ck.exists()


def test_decimal_hyperparameters_are_exact(tmp_path, stream):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "1", "--lr", "0.0003",
                           "--beta2", "0.95")) == 0
    header = load_state(str(ck), CFG).header
    assert "lr=3/10000" in header["learner"] and "beta2=95/100" in header["learner"]


def test_results_on_the_checkpoint_path_is_refused(tmp_path, stream, capsys):
    ck = tmp_path / "same.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "1", "--results", str(ck))) == 2
    assert "checkpoint path" in capsys.readouterr().err
    assert not ck.exists()


def test_unwritable_checkpoint_directory_is_refused_before_training(tmp_path, stream, capsys):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")  # a file where a directory should be
    rc = main(train_args(stream, tmp_path / "run", blocker / "d" / "ck.bin", "--steps", "1"))
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(blocker) in err
    assert not list((tmp_path / "run").glob("results-*"))  # nothing was trained or written


@pytest.mark.parametrize("option, value, words", [
    ("--seed", "-1", "--seed=-1"),
    ("--seed", str(2**64), "2^64"),
    ("--lr", "1e400", "does not fit in float32"),
    ("--lr", "1e-60", "rounds to zero"),
    ("--weight-decay", "1e300", "lr * weight_decay"),
    ("--beta2", "0.99999999999999999999", "bias correction"),
    ("--epsilon", "0", "epsilon"),
    ("--steps", "0", "--steps=0"),
    ("--until", "-1", "--until=-1"),
    ("--warmup", "2", "add --schedule cosine"),
    ("--clip", "0", "clip=0/1: must be positive"),
    ("--clip", "x", "clip='x': not a number"),
    ("--floor", "0.5", "add --schedule cosine"),
    ("--eval-contexts", "40", "--eval-contexts=40: the stream"),
    ("--eval-contexts", "-1", "--eval-contexts=-1"),
    ("--eval-every", "-1", "--eval-every=-1"),
    ("--accumulate", "0", "--accumulate=0"),
    ("--accumulate", "3", "--accumulate=3: must divide --batch=1"),
])
def test_bad_options_get_one_line_and_exit_2(tmp_path, stream, capsys, option, value, words):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, option, value)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not ck.exists()


def test_a_failing_result_file_still_publishes_the_training(tmp_path, stream, monkeypatch, capsys):
    from coppelius.reference.errors import ResultFileError

    original = results.ResultWriter.step

    def step(self, step_no, rows):
        if step_no == 3:
            raise ResultFileError(f"result file {self.path}: cannot write: No space left on device")
        return original(self, step_no, rows)

    monkeypatch.setattr(results.ResultWriter, "step", step)
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "10", "--interval", "100")) == 2
    assert "No space left" in capsys.readouterr().err
    ckp = load_state(str(ck), CFG)
    # steps 0..3 trained, and step 4, queued before step 3 was read: all kept
    assert ckp.step == 5 and ckp.contexts == 5


@pytest.mark.parametrize("extra, words", [
    (["--schedule", "cosine", "--warmup", "8", "--total", "8"], "total=8: must exceed warmup=8"),
    (["--schedule", "cosine", "--floor", "3/2"], "floor=15/10: must be in [0, 1]"),
    (["--schedule", "cosine", "--total", str(10**8)], "at most 10000000"),
])
def test_bad_schedules_get_one_line_and_exit_2(tmp_path, stream, capsys, extra, words):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not ck.exists() and not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("extra, words", [
    (["--schedule", "wsd", "--warmup", "2", "--total", "10", "--decay", "9"],
     "decay=9: must be an integer in [1, total - warmup] = [1, 8]"),
    (["--schedule", "wsd", "--decay", "0"], "--decay=0: must be a positive integer"),
    (["--schedule", "wsd", "--warmup", "3", "--total", "3"], "total=3: must exceed warmup=3"),
    (["--schedule", "wsd", "--floor", "2"], "floor=2/1: must be in [0, 1]"),
    (["--decay", "3"], "--decay belongs to the wsd schedule (add --schedule wsd)"),
    (["--schedule", "cosine", "--decay", "3"], "--decay belongs to the wsd schedule"),
])
def test_bad_wsd_schedules_get_one_line_and_exit_2(tmp_path, stream, capsys, extra, words):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "1", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not ck.exists() and not (tmp_path / "run.json").exists()


WSD = ["--schedule", "wsd", "--warmup", "2", "--total", "10", "--decay", "3", "--floor", "1/10"]


def test_a_wsd_run_resumed_on_the_plateau_is_the_run_done_in_one_go(tmp_path, stream, capsys):
    """SPEC 7's wsd: a run stopped in the stable phase (--until 5) and taken
    on to 10 (through the decay) has the checkpoint bytes and step records
    of the run of 10 in one go; the learner identity says the schedule; the
    stable phase's updates are those of the constant rate lr itself."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(train_args(stream, a, a / "ck.bin", "--until", "5", "--interval", "2", *WSD)) == 0
    assert "wsd schedule (warm-up 2, stable to 7, total 10)" in capsys.readouterr().err
    remembered = json.loads((a / "run.json").read_text())["options"]
    assert (remembered["schedule"], remembered["warmup"], remembered["total"],
            remembered["decay"], remembered["floor"]) == ("wsd", 2, 10, 3, "1/10")
    assert main(["train", "--run-dir", str(a), "--until", "10", "--no-sample"]) == 0
    assert main(train_args(stream, b, b / "ck.bin", "--until", "10", *WSD)) == 0
    assert (a / "ck.bin").read_bytes() == (b / "ck.bin").read_bytes()
    header = load_state(str(a / "ck.bin"), CFG).header
    assert header["learner"].endswith("|decay=matrices|schedule=wsd(warmup=2,total=10,decay=3,"
                                      "floor=1/10)")
    two = step_records(a / "results-0.bin", a / "results-5.bin")
    one = step_records(b / "results-0.bin")
    assert [s for s, _ in two] == [s for s, _ in one] == list(range(10))
    assert all(x.tobytes() == y.tobytes() for (_, x), (_, y) in zip(two, one))
    # the report draws the rate of each step from the identity: t / 2, 1, then 1 - 0.9 (10 - t) / 3
    capsys.readouterr()
    assert main(["report", str(b), "--csv", str(b / "r.csv"), "--plot", str(b / "r.png")]) == 0
    assert "(wsd: warmup 2, total 10, decay 3, floor 1/10)" in capsys.readouterr().out
    rows = (b / "r.csv").read_text().splitlines()
    column = rows[0].split(",").index("learning_rate")
    rates = [np.float32(r.split(",")[column]) for r in rows[1:11]]  # float32s, written short
    s = [0.5, 1, 1, 1, 1, 1, 1, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1]
    assert rates == [np.float32(0.0003 * x) for x in s]
    # no warm-up: the updates before the decay are the constant rate's, bit for bit
    from fractions import Fraction

    from coppelius.reference.adamw import float32_of

    assert float32_of(Fraction(3, 10000)) == np.float32(3 / 10000)  # lr's two roundings agree
    plateau = ["--schedule", "wsd", "--total", "10", "--decay", "5"]
    assert main(train_args(stream, c / "wsd", c / "wsd.bin", "--until", "5", *plateau)) == 0
    assert main(train_args(stream, c / "constant", c / "constant.bin", "--until", "5",
                           "--schedule", "constant")) == 0
    wsd, constant = (load_state(str(c / name), CFG).state for name in ("wsd.bin", "constant.bin"))
    for x, y in ((wsd.P, constant.P), (wsd.M, constant.M), (wsd.V, constant.V)):
        assert x.tobytes() == y.tobytes()


def test_wsd_defaults_and_the_decay_remembered(tmp_path, stream, capsys):
    """--total defaults to the run's final step and --decay to a fifth of
    total - warmup; both are remembered, so a later --until goes on at the
    floor unless --new-learner --total moves the decay (of the same length)."""
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--until", "12", "--schedule", "wsd",
                           "--warmup", "2")) == 0
    assert load_state(str(ck), CFG).header["learner"].endswith(
        "|schedule=wsd(warmup=2,total=12,decay=2,floor=0/1)")
    capsys.readouterr()
    assert main(train_args(stream, tmp_path, ck, "--until", "13")) == 0  # remembered
    assert load_state(str(ck), CFG).header["learner"].endswith("total=12,decay=2,floor=0/1)")
    assert main(train_args(stream, tmp_path, ck, "--until", "14", "--total", "30",
                           "--new-learner")) == 0
    assert load_state(str(ck), CFG).header["learner"].endswith("total=30,decay=2,floor=0/1)")
    # another learner named in the refusal, with its decay
    capsys.readouterr()
    assert main(train_args(stream, tmp_path, ck, "--until", "15", "--schedule", "cosine")) == 2
    err = capsys.readouterr().err.strip()
    assert "--schedule wsd --warmup 2 --total 30 --decay 2 --floor 0/1 (or pass --new-learner" \
        in err and len(err.splitlines()) == 1, err


# ------------------------------------------------------------------ runs that remember (SPEC 9)

LEARNER = ["--schedule", "cosine", "--warmup", "20", "--floor", "1/10", "--clip", "1/2"]


def test_run_dir_alone_continues_an_interrupted_run_exactly(tmp_path, stream):
    """A cosine, clipped, evaluated run of 200 steps stopped by SIGTERM, then
    `coppelius train --run-dir D` alone: the same checkpoint bytes as the run
    done in one go (SPEC 9); run.json remembered every option."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    a, b = tmp_path / "a", tmp_path / "b"
    first = ["train", "--preset", "test", "--backend", "reference", "--stream", stream,
             "--no-sample", "--until", "200", "--interval", "50", "--eval-every", "40",
             "--repeat-data", *LEARNER]
    proc = subprocess.Popen([sys.executable, "-m", "coppelius", *first, "--run-dir", str(a)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        res = a / "results-0.bin"
        if res.exists() and len(results.read_results(str(res)).steps) >= 5:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = load_state(str(a / "checkpoint.bin"), CFG).step
    assert 5 <= stopped < 200, "the run finished before the signal: nothing was tested"
    rc, out, err = run_cli("train", "--run-dir", str(a), "--no-sample")
    assert rc == 0, err
    assert f"steps {stopped}..200, cosine schedule (warm-up 20, total 200)" in err
    rc, out, err = run_cli(*first, "--run-dir", str(b))
    assert rc == 0, err
    assert (a / "checkpoint.bin").read_bytes() == (b / "checkpoint.bin").read_bytes()
    run = json.loads((a / "run.json").read_text())["options"]
    assert run["schedule"] == "cosine" and run["total"] == 200 and run["clip"] == "1/2"
    # once there, a plain continuation has nothing to do and writes nothing
    rc, out, err = run_cli("train", "--run-dir", str(a), "--no-sample")
    assert rc == 0 and "nothing to do" in out, (out, err)
    assert sorted(p.name for p in a.glob("results-*.bin")) == ["results-0.bin",
                                                                f"results-{stopped}.bin"]


def test_identity_refusals_say_which_option_to_repeat(tmp_path, stream, capsys):
    ck = tmp_path / "ck.bin"
    learner = ["--schedule", "cosine", "--warmup", "1", "--floor", "1/10", "--clip", "1/2"]
    assert main(train_args(stream, tmp_path, ck, "--steps", "2", "--batch", "2", *learner)) == 0
    capsys.readouterr()
    learner += ["--total", "2"]
    cases = [(["--batch", "3", *learner], "the checkpoint was trained with --batch 2"),
             (["--batch", "2", "--schedule", "constant"],
              "--schedule cosine --warmup 1 --total 2 --floor 1/10 (or pass --new-learner"),
             (["--batch", "2", *learner, "--eval-contexts", "5"], "--eval-contexts 4"),
             (["--batch", "2", *learner, "--seed", "7"], "--seed 20260925")]
    for extra, words in cases:
        assert main(train_args(stream, tmp_path, ck, "--steps", "1", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, (extra, err)


def test_new_learner_lifts_the_rate_but_not_the_policy(tmp_path, stream, capsys):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "2")) == 0
    assert main(train_args(stream, tmp_path, ck, "--steps", "2", "--lr", "1/1000",
                           "--new-learner")) == 0
    assert "lr=1/1000" in load_state(str(ck), CFG).header["learner"]
    capsys.readouterr()
    assert main(train_args(stream, tmp_path, ck, "--steps", "1", "--lr", "1/1000",
                           "--precision", "bf16", "--new-learner")) == 2
    assert "beyond what --new-learner lifts" in capsys.readouterr().err


def test_held_out_contexts_are_evaluated_and_recorded(tmp_path, stream):
    """40 contexts, 4 held out (a tenth): kind-5 records after steps 2, 4 and
    5, each the mean row loss of the last 4 contexts under the parameters of
    that step, computed here with the reference forward."""
    from coppelius import reference
    from coppelius.reference.stream import open_stream

    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "5", "--eval-every", "2",
                           "--batch", "3")) == 0
    header = load_state(str(ck), CFG).header
    assert header["data"].endswith("|heldout=4")
    r = results.read_results(str(tmp_path / "results-0.bin"))
    assert [e[0] for e in r.evals] == [2, 4, 5]
    s = open_stream(stream, CFG.vocab)
    held = s.contexts(np.arange(36, 40), CFG.context)  # (4, T+1)
    want = reference.row_losses(CFG, load_state(str(ck), CFG).state.P, held).astype(
        np.float64).mean(axis=1)
    step, mean, per_context = r.evals[-1]
    assert np.allclose(per_context, want, rtol=1e-6) and abs(mean - want.mean()) < 1e-5
    # training never read a held-out context: 5 steps of 3 read contexts 0..14
    assert load_state(str(ck), CFG).contexts == 15


def test_a_closed_pipe_never_stops_training(tmp_path, stream):
    env = dict(os.environ, PYTHONPATH=ROOT)
    ck = tmp_path / "ck.bin"
    proc = subprocess.Popen([sys.executable, "-m", "coppelius",
                             *train_args(stream, tmp_path, ck, "--steps", "300",
                                         "--repeat-data")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader of both streams goes away at once
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0
    assert load_state(str(ck), CFG).step == 300


def test_sighup_publishes_like_sigterm(tmp_path, stream):
    env = dict(os.environ, PYTHONPATH=ROOT)
    ck = tmp_path / "ck.bin"
    proc = subprocess.Popen([sys.executable, "-m", "coppelius",
                             *train_args(stream, tmp_path, ck, "--steps", "100000",
                                         "--interval", "100000", "--repeat-data")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    res = tmp_path / "results-0.bin"
    deadline = time.time() + 120
    while time.time() < deadline and not (
            res.exists() and len(results.read_results(str(res)).steps) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert load_state(str(ck), CFG).step >= 3


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_eval_command_gives_the_runs_last_held_out_loss(tmp_path, stream, capsys, backend):
    ck = tmp_path / "ck.bin"
    on = ["--backend", backend]
    assert main(train_args(stream, tmp_path, ck, "--steps", "3", "--batch", "3", *on)) == 0
    mean = results.read_results(str(tmp_path / "results-0.bin")).evals[-1][1]
    capsys.readouterr()
    assert main(["eval", str(ck), *on]) == 0  # stream and K from run.json and the identity
    out = capsys.readouterr().out
    assert f"held-out loss {mean:.4f}, perplexity {np.exp(mean):,.2f}" in out, out
    assert "the last 4 of 40 contexts" in out
    assert main(["eval", str(ck), "--stream", stream, "--contexts", "41"]) == 2
    assert "--contexts=41" in capsys.readouterr().err


def test_checkpoints_are_written_in_the_background_one_at_a_time(tmp_path, stream, monkeypatch):
    """Publication runs on its own thread while training goes on; a second
    publication waits for the first; the run ends with the last one done."""
    import threading

    real = checkpoint.write_checkpoint
    seen, active = [], []

    def slow_write(path, config, ids, state, contexts):
        active.append(1)
        assert len(active) == 1, "two publications at once"
        seen.append((threading.current_thread().name, state.t))
        time.sleep(0.05)
        real(path, config, ids, state, contexts)
        active.pop()

    monkeypatch.setattr(checkpoint, "write_checkpoint", slow_write)
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "6", "--interval", "2")) == 0
    assert seen == [("coppelius-publish", 2), ("coppelius-publish", 4), ("coppelius-publish", 6)]
    assert load_state(str(ck), CFG).step == 6


def test_a_failed_background_publication_stops_the_run_and_keeps_the_old_checkpoint(
        tmp_path, stream, monkeypatch, capsys):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "2")) == 0
    before = ck.read_bytes()

    def full_disk(*args):
        raise OSError(28, "No space left on device", str(ck))

    monkeypatch.setattr(checkpoint, "write_checkpoint", full_disk)
    assert main(train_args(stream, tmp_path, ck, "--steps", "4", "--interval", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "No space left on device" in err[-1] and len(err[-1]) < 300
    assert ck.read_bytes() == before


def test_accumulate_must_divide_the_batch_and_is_remembered_in_the_learner(tmp_path, stream,
                                                                         capsys):
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--batch", "4", "--accumulate", "3")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--accumulate=3" in err and "--batch=4" in err, err
    assert not ck.exists()
    # k = 2: exact resume across invocations; run.json remembers k, the learner identity holds it
    a, b = tmp_path / "a", tmp_path / "b"
    acc = ["--batch", "4", "--accumulate", "2"]
    assert main(train_args(stream, a, a / "ck.bin", "--steps", "2", *acc)) == 0
    assert json.loads((a / "run.json").read_text())["options"]["accumulate"] == 2
    assert main(["train", "--run-dir", str(a), "--steps", "1", "--no-sample"]) == 0
    assert main(train_args(stream, b, b / "ck.bin", "--steps", "3", *acc)) == 0
    assert (a / "ck.bin").read_bytes() == (b / "ck.bin").read_bytes()
    header = load_state(str(a / "ck.bin"), CFG).header
    assert header["learner"].endswith("|accumulate=2")
    # another k is another learner: refused, naming the option
    capsys.readouterr()
    assert main(train_args(stream, a, a / "ck.bin", "--steps", "1", "--accumulate", "1")) == 2
    err = capsys.readouterr().err
    assert "--accumulate 2" in err, err


def test_recompute_reaches_the_backend_and_is_remembered_but_is_not_part_of_the_learner(
        tmp_path, stream, monkeypatch):
    """--recompute (gate-up) and --recompute block reach the backend's
    capture and run.json; a later invocation keeps the mode unless it gives
    another or --no-recompute; a run.json from when it was a switch
    (`"recompute": true`) resumes as gate-up; the checkpoint's identities
    do not name it, so a run resumes with or without it. (The reference
    ignores it, so the bytes here are equal trivially; the accelerated
    backends' bits with and without it are checked in their own tests.)"""
    from coppelius.reference import program as reference_program

    seen = []
    capture = reference_program.capture

    def watched(*args, **kw):
        seen.append(kw.get("recompute", False))
        return capture(*args, **kw)

    monkeypatch.setattr(reference_program, "capture", watched)
    a, b = tmp_path / "a", tmp_path / "b"
    run_file = a / "run.json"

    def remembered():
        return json.loads(run_file.read_text())["options"]["recompute"]

    # remembered when given without --steps (SPEC 9, Reading)
    assert main(train_args(stream, a, a / "ck.bin", "--until", "1", "--recompute")) == 0
    assert remembered() == "gate-up"
    assert main(["train", "--run-dir", str(a), "--steps", "1", "--no-sample"]) == 0
    assert main(["train", "--run-dir", str(a), "--until", "3", "--no-sample",
                 "--recompute", "block"]) == 0
    assert remembered() == "block"
    assert main(["train", "--run-dir", str(a), "--until", "4", "--no-sample",
                 "--no-recompute"]) == 0
    assert remembered() == "none"
    doc = json.loads(run_file.read_text())
    doc["options"]["recompute"] = True  # as the switch wrote it
    run_file.write_text(json.dumps(doc))
    assert main(["train", "--run-dir", str(a), "--steps", "1", "--no-sample"]) == 0
    assert seen == ["gate-up", "gate-up", "block", None, "gate-up"]
    assert main(train_args(stream, b, b / "ck.bin", "--steps", "5")) == 0
    assert (a / "ck.bin").read_bytes() == (b / "ck.bin").read_bytes()
    assert "recompute" not in json.dumps(load_state(str(a / "ck.bin"), CFG).header)


def test_a_bad_recompute_mode_is_one_line_and_status_2(tmp_path, stream, capsys):
    """--recompute MODE outside none, gate-up, block, on the command line or
    in run.json: one line naming it, status 2, nothing written."""
    a = tmp_path / "a"
    with pytest.raises(SystemExit) as exit:
        main(train_args(stream, a, a / "ck.bin", "--steps", "1", "--recompute", "layer"))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--recompute" in err and "'layer'" in err and "block" in err
    assert not a.exists()
    assert main(train_args(stream, a, a / "ck.bin", "--steps", "1")) == 0
    doc = json.loads((a / "run.json").read_text())
    doc["options"]["recompute"] = "layer"
    (a / "run.json").write_text(json.dumps(doc))
    capsys.readouterr()
    before = (a / "ck.bin").read_bytes()
    assert main(["train", "--run-dir", str(a), "--steps", "1", "--no-sample"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "option recompute" in err, err
    assert "Traceback" not in err and (a / "ck.bin").read_bytes() == before


def test_the_next_step_is_queued_before_a_step_is_read_but_never_across_a_publication(
        tmp_path, stream, monkeypatch):
    """The run loop submits step s+1 before it reads step s's records, except
    where the state is read after step s (a publication, an evaluation, the
    end): there nothing is in flight. The result file and the checkpoint are
    those of a run that waits for every step."""
    from coppelius.reference.program import ReferenceProgram

    log, in_flight = [], []
    submit, state = ReferenceProgram.submit, ReferenceProgram.state

    def logged_submit(self, tokens):
        submitted = submit(self, tokens)
        n = len([e for e in log if e[0] == "submit"])
        log.append(("submit", n))
        in_flight.append(n)
        read = submitted.records

        def records():
            if n in in_flight:
                in_flight.remove(n)
                log.append(("read", n))
            return read()

        submitted.records = records
        return submitted

    def logged_state(self):
        log.append(("state", tuple(in_flight)))
        return state(self)

    monkeypatch.setattr(ReferenceProgram, "submit", logged_submit)
    monkeypatch.setattr(ReferenceProgram, "state", logged_state)
    a = tmp_path / "a"
    assert main(train_args(stream, a, a / "ck.bin", "--steps", "7", "--interval", "3")) == 0
    events = [e for e in log if e[0] != "state" or e[1] == ()]
    assert [e for e in log if e[0] == "state"] == [("state", ())] * len(
        [e for e in log if e[0] == "state"])  # the state is read with nothing in flight
    order = [e for e in events if e[0] != "state"]
    assert order[:4] == [("submit", 0), ("submit", 1), ("read", 0), ("submit", 2)]
    # step 2 ends the first interval: step 3 is submitted only after it is read and published
    i = order.index(("read", 2))
    assert order[i + 1] == ("submit", 3) and ("submit", 3) not in order[:i]
    monkeypatch.undo()
    b = tmp_path / "b"  # every step waited for: the loop before queueing, by hand
    assert main(train_args(stream, b, b / "ck.bin", "--steps", "7", "--interval", "1")) == 0
    assert (a / "ck.bin").read_bytes() == (b / "ck.bin").read_bytes()
    got, want = (step_records(*sorted(d.glob("results-*.bin"))) for d in (a, b))
    assert len(got) == len(want) == 7
    for x, y in zip(got, want):
        assert x[0] == y[0] and np.array_equal(np.asarray(x[1]), np.asarray(y[1]))


def test_the_state_is_copied_once_per_publication_and_the_final_record_reads_the_last(
        tmp_path, stream, monkeypatch):
    """One copy of the state off the device before the clock, one per
    publication and none more: the final record reads the last
    publication's, which is the checkpoint's state after the last step."""
    from coppelius.reference.params import registry
    from coppelius.reference.program import ReferenceProgram

    copies, state = [], ReferenceProgram.state

    def counted(self):
        copy = state(self)
        copies.append(copy.t)
        return copy

    monkeypatch.setattr(ReferenceProgram, "state", counted)
    ck = tmp_path / "ck.bin"
    assert main(train_args(stream, tmp_path, ck, "--steps", "6", "--interval", "2")) == 0
    assert copies == [0, 2, 4, 6]
    final = results.read_results(next(tmp_path.glob("results-*.bin"))).final
    saved = load_state(str(ck), CFG).state
    emb = registry(CFG)["tok_embedding.weight"]
    window = slice(emb.offset, emb.offset + CFG.context)
    assert np.array_equal(final["loss_block"][2], saved.P[window])
    assert np.array_equal(final["loss_block"][3], saved.M[window])


# ------------------------------------------------------------------ fine-tuning an import

def imported_llama(tmp_path, capsys, vocab_ids=300):
    """A Llama-family model (RMSNorm, grouped-query attention, untied) as a
    Hugging Face directory without coppelius metadata, as transformers saves
    one, with a tokenizer.json of `vocab_ids` ids (< V, as a padded
    vocabulary is), imported: -> (checkpoint, directory, its text)."""
    import dataclasses

    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from coppelius.reference import State, initialize
    from coppelius.reference.checkpoint import identities, write_checkpoint
    from coppelius.reference.config import Hyper

    config = dataclasses.replace(PRESETS["test-llama"], vocab=320)
    ck = tmp_path / "made.ckpt"
    write_checkpoint(ck, config, identities(config, Hyper(), "fp32", 1, None, "0" * 64),
                     State.fresh(initialize(config, 5)), contexts=0)
    hf_dir = tmp_path / "hf"
    assert main(["export", str(ck), str(hf_dir), "--format", "hf", "--no-tokenizer"]) == 0
    weights = str(hf_dir / "model.safetensors")
    save_file(load_file(weights), weights, metadata={"format": "pt"})  # no identities
    text = "".join(open(os.path.join(ROOT, "coppelius", name), encoding="utf-8").read()
                   for name in ("cli.py", "plan.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab_ids, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(hf_dir / "tokenizer.json"))
    imported = tmp_path / "imported.ckpt"
    assert main(["import", str(hf_dir), str(imported)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return imported, hf_dir, text, config


def test_train_fine_tunes_an_imported_checkpoint_with_its_tokenizer(tmp_path, capsys,
                                                                   monkeypatch):
    """No --preset: the model is the checkpoint's; --tokenizer DIR encodes the
    source with the directory's tokenizer.json, whose SHA-256 is the data
    identity's; the steps are the reference's steps on those ids."""
    import hashlib

    from tokenizers import Tokenizer

    from coppelius.reference import step
    from coppelius.reference.stream import open_stream

    monkeypatch.chdir(tmp_path)  # the run directory: runs/imported here
    imported, hf_dir, text, config = imported_llama(tmp_path, capsys)
    before = load_state(imported, config)
    source = tmp_path / "notes.txt"
    source.write_text(text, encoding="utf-8")
    rc = main(["train", "--checkpoint", str(imported), "--source", str(source), "--tokenizer",
               str(hf_dir), "--new-data", "--steps", "2", "--backend", "reference",
               "--no-sample"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "schema identity" not in err
    header = checkpoint.validate(imported).header
    assert header["model"] == config.identity() and header["step"] == 2
    sha = hashlib.sha256((hf_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert f"|tokenizer={sha}|" in header["data"]
    # the stream: the tokenizer's own encoding of the source, id for id
    [stream_path] = Path(os.environ["COPPELIUS_CACHE"]).glob("*/*.tokens")  # conftest's
    ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text).ids
    stream = open_stream(stream_path, config.vocab)
    assert stream.ids.tolist() == ids
    stream.close()
    # two reference steps from the imported parameters, on contexts 0 and 1
    T, state = config.context, before.state
    for c in range(2):
        state = step(config, state, np.array([ids[T * c:T * c + T + 1]])).state
    assert load_state(imported, config).state.P.tobytes() == state.P.tobytes()
    # the run directory is the checkpoint's name and remembers the tokenizer
    remembered = json.loads((tmp_path / "runs" / "imported" / "run.json").read_text())["options"]
    assert remembered["tokenizer"] == str(hf_dir) and "preset" not in remembered
    rc = main(["train", "--run-dir", str(tmp_path / "runs" / "imported"), "--steps", "1",
               "--no-sample"])
    assert rc == 0, capsys.readouterr().err
    assert checkpoint.validate(imported).header["step"] == 3


def test_eval_and_sample_take_the_imported_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    imported, hf_dir, text, config = imported_llama(tmp_path, capsys)
    assert main(["sample", str(imported), "--tokens", "4", "--prompt", "def",
                 "--temperature", "0"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("def")
    source = tmp_path / "notes.txt"
    source.write_text(text, encoding="utf-8")
    assert main(["train", "--checkpoint", str(imported), "--source", str(source), "--tokenizer",
                 str(hf_dir / "tokenizer.json"), "--new-data", "--steps", "1", "--backend",
                 "reference", "--no-sample", "--run-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["eval", str(imported), "--backend", "reference"]) == 0, capsys.readouterr().err
    assert "held-out loss" in capsys.readouterr().out


@pytest.mark.parametrize("option, words", [
    ("large", ["tokenizer", "400 ids", "V=320"]),
    ("folder", ["--tokenizer", "without tokenizer.json"]),
    ("missing", ["--tokenizer", "no such file"]),
    ("stream", ["--tokenizer", "--stream"]),
])
def test_train_refuses_a_tokenizer_that_does_not_fit(tmp_path, capsys, monkeypatch, option,
                                                    words):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    monkeypatch.chdir(tmp_path)
    imported, hf_dir, text, config = imported_llama(tmp_path, capsys)
    source = tmp_path / "notes.txt"
    source.write_text(text, encoding="utf-8")
    data = ["--source", str(source)]
    if option == "large":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator([text], trainers.BpeTrainer(
            vocab_size=400, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(tmp_path / "large.json"))
        given = tmp_path / "large.json"
    elif option == "folder":
        given = tmp_path / "empty"
        given.mkdir()
    elif option == "missing":
        given = tmp_path / "nothing.json"
    else:
        given = hf_dir
        data = ["--stream", str(pattern_stream(tmp_path / "s.tokens", config, 20, noise=0.1))]
    before = imported.read_bytes()
    rc = main(["train", "--checkpoint", str(imported), *data, "--tokenizer", str(given),
               "--new-data", "--steps", "1", "--backend", "reference", "--no-sample"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("coppelius train: error: ")
    for word in words:
        assert word in err, (word, err)
    assert imported.read_bytes() == before
    assert not (tmp_path / "runs" / "imported").exists()


def test_a_learner_change_on_an_import_names_the_option_not_the_lifted_parts(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    imported, hf_dir, text, config = imported_llama(tmp_path, capsys)
    source = tmp_path / "notes.txt"
    source.write_text(text, encoding="utf-8")
    argv = ["train", "--checkpoint", str(imported), "--source", str(source), "--tokenizer",
            str(hf_dir), "--new-data", "--steps", "1", "--backend", "reference", "--no-sample",
            "--lr", "1e-5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    hint = err.rsplit(";", 1)[-1]
    assert "--lr 3/10000" in hint and "--new-learner" in hint, err
    assert "stream" not in hint and "--eval-contexts" not in hint, err
    assert main(argv + ["--new-learner"]) == 0, capsys.readouterr().err
    assert "lr=1/100000" in checkpoint.validate(imported).header["learner"]


def test_conformance_debugs_a_step_of_an_imported_checkpoint(tmp_path, capsys):
    """conformance --checkpoint takes the checkpoint's model (no --preset)."""
    imported, _, _, config = imported_llama(tmp_path, capsys)
    stream = pattern_stream(tmp_path / "s.tokens", config, 4, noise=0.1)
    rc = main(["conformance", "--backend", "reference", "--checkpoint", str(imported),
               "--stream", str(stream)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "failed: " in out and ", 0 failed" in out and "PASS" in out
