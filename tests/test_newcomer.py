"""The path a new user walks: the CPU under load (BLAS threads), what a run
prints (each evaluation, Ctrl-C), the wording of messages, a closed pipe
after `| head`, and evaluations on the run's own step grid after a resume."""

import os
import re
import subprocess
import sys

import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from coppelius.reference import results
from coppelius.reference.config import PRESETS

from tests.support import pattern_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = PRESETS["test"]
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@pytest.fixture
def stream(tmp_path):
    """A synthetic token stream of 40 test-preset contexts (no tokenizer)."""
    return pattern_stream(tmp_path / "s.tokens", CFG, 40, noise=0.1)


def cli(*argv, env=None, **kwargs):
    """The command line in a new process, without the BLAS variables unless
    `env` sets them -> CompletedProcess (text)."""
    base = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    base.update(PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-m", "coppelius", *argv], cwd=ROOT, env=base,
                          capture_output=True, text=True, timeout=300, **kwargs)


def train_argv(stream, run_dir, *extra):
    return ["train", "--preset", "test", "--backend", "reference", "--stream", stream,
            "--run-dir", str(run_dir), "--checkpoint", str(run_dir / "ck.bin"), "--no-sample",
            *extra]


def blas_counts():
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


# ---------------------------------------------------------------- BLAS threads

@pytest.fixture
def restore_blas():
    """Whatever a test sets, the BLAS thread counts are put back after it."""
    limiter = threadpool_limits(limits=None)  # records the counts now, changes nothing
    yield
    limiter.restore_original_limits()


def test_one_blas_thread_by_default_and_the_option_and_variables_override_it(restore_blas):
    from coppelius.train import limit_blas_threads

    threadpool_limits(limits=2, user_api="blas")
    assert limit_blas_threads(None, env={}) == "BLAS threads 1 (the default; --blas-threads N)"
    assert blas_counts() == {1}
    assert limit_blas_threads(2, env={}) == "BLAS threads 2 (--blas-threads)"
    assert blas_counts() == {2}
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        # the variable is the library's to read at start: the count is left alone
        assert limit_blas_threads(None, env={name: "2"}) == f"BLAS threads 2 ({name})"
        assert blas_counts() == {2}
    assert limit_blas_threads(1, env={"OMP_NUM_THREADS": "2"}) == \
        "BLAS threads 1 (--blas-threads)"
    assert blas_counts() == {1}


def test_train_says_its_blas_threads_and_refuses_a_bad_count(tmp_path, stream):
    p = cli(*train_argv(stream, tmp_path, "--steps", "1"))
    assert p.returncode == 0, p.stderr
    assert "BLAS threads 1 (the default; --blas-threads N)" in p.stderr + p.stdout
    p = cli(*train_argv(stream, tmp_path / "b", "--steps", "1"),
            env={"OPENBLAS_NUM_THREADS": "2"})
    assert p.returncode == 0, p.stderr
    assert "BLAS threads 2 (OPENBLAS_NUM_THREADS)" in p.stderr + p.stdout
    p = cli(*train_argv(stream, tmp_path / "c", "--steps", "1", "--blas-threads", "0"))
    assert p.returncode == 2 and "--blas-threads=0" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- each evaluation a line

def held_out_lines(text):
    """(step, loss) of each evaluation line printed."""
    return [(int(a), float(b)) for a, b in
            re.findall(r"^step (\d+): held-out loss (\d+\.\d+) \(perplexity", text, re.M)]


def on_a_terminal(argv):
    """The command with its stderr on a pseudo-terminal (tqdm's bar then
    draws) -> (exit status, what the terminal received)."""
    import pty

    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    proc = subprocess.Popen([sys.executable, "-m", "coppelius", *argv], cwd=ROOT,
                            env=dict(env, PYTHONPATH=ROOT, COLUMNS="100"),
                            stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    received = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        received += chunk
    os.close(leader)
    return proc.wait(timeout=300), received.decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.parametrize("terminal", [False, True])
def test_each_evaluation_is_printed_as_a_line_of_its_own(tmp_path, stream, terminal):
    argv = train_argv(stream, tmp_path, "--steps", "5", "--eval-every", "2")
    if terminal:
        status, text = on_a_terminal(argv)
    else:
        p = cli(*argv)
        status, text = p.returncode, p.stderr
    assert status == 0, text
    evals = results.read_results(str(tmp_path / "results-0.bin")).evals
    assert [step for step, _, _ in evals] == [2, 4, 5]
    printed = held_out_lines(text.replace("\r", "\n"))
    assert [step for step, _ in printed] == [2, 4, 5], text
    for (step, loss), (_, mean, _) in zip(printed, evals):
        assert abs(loss - mean) <= 5e-5


# ---------------------------------------------------------------- wording

def test_one_step_is_one_step(tmp_path, stream):
    p = cli(*train_argv(stream, tmp_path, "--steps", "1"))
    assert p.returncode == 0, p.stderr
    assert re.search(r"^trained 1 step in .* over the first 1 step, .* over the last 1$",
                     p.stdout, re.M), p.stdout
    p = cli(*train_argv(stream, tmp_path, "--steps", "2"))
    assert p.returncode == 0, p.stderr
    assert re.search(r"^trained 2 steps in .* over the first 1 step, ", p.stdout, re.M), p.stdout


@pytest.mark.parametrize("q, text", [("1", "1"), ("1/2", "0.5"), ("9/4", "2.25"),
                                      ("3/10000", "0.0003"), ("1/3", "1/3"), ("25/2", "12.5"),
                                      ("-3/8", "-0.375")])
def test_a_clip_reads_as_a_decimal(q, text):
    from fractions import Fraction

    from coppelius.report import decimal_text

    assert decimal_text(Fraction(q)) == text
    assert Fraction(text) == Fraction(q)


def test_the_report_says_clip_1_not_1_over_1(tmp_path, stream):
    from coppelius.cli import main

    assert main(train_argv(stream, tmp_path, "--steps", "1", "--clip", "1")) == 0
    p = cli("report", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert re.search(r"^learning rate .*\(constant; clip 1\)$", p.stdout, re.M), p.stdout


def test_an_unavailable_backend_says_how_to_install_it(tmp_path, stream):
    """MLX made unimportable in the process: the refusal names the extra
    of pyproject.toml that installs it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(d.startswith("mlx") for d in extras["mlx"])
    code = ("import sys; sys.modules['mlx'] = sys.modules['mlx.core'] = None; "
            "from coppelius.cli import main; sys.exit(main(sys.argv[1:]))")
    argv = train_argv(stream, tmp_path, "--steps", "1")
    argv[argv.index("reference")] = "mlx"
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "backend 'mlx': not available" in p.stderr
    assert "pip install 'coppelius[mlx]'" in p.stderr and "Traceback" not in p.stderr


def test_version():
    from importlib import metadata

    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"coppelius {metadata.version('coppelius')}"


@pytest.mark.parametrize("argv, command", [(["train", "--bogus"], "train"),
                                           (["inspect", "a", "b"], "inspect"),
                                           (["report", "--steps", "x", "a"], "report"),
                                           (["tokenize", "--nope"], "tokenize")])
def test_a_usage_error_points_at_its_subcommands_help(argv, command):
    p = cli(*argv)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().endswith(f"(see coppelius {command} --help)"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- | head

def with_stdout_closed(*argv):
    """The command with its stdout a pipe whose reader is gone before it
    prints (as after `| head` has what it wanted) -> (status, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    proc = subprocess.Popen([sys.executable, "-m", "coppelius", *argv], cwd=ROOT,
                            env=dict(env, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=300), err


def test_inspect_and_tokenize_end_quietly_into_a_closed_pipe(tmp_path, stream):
    from coppelius.cli import main

    assert main(train_argv(stream, tmp_path, "--steps", "1")) == 0
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(" ".join(f"word{j * 7 + i} of {j}" for j in range(400)))
    commands = [("inspect", str(tmp_path / "results-0.bin")),
                ("inspect", str(tmp_path / "ck.bin")),
                ("tokenize", "--preset", "test", "--vocab", "300", "--out",
                 str(tmp_path / "t" / "docs.tokens"), str(docs))]
    (tmp_path / "t").mkdir()
    for argv in commands:
        status, err = with_stdout_closed(*argv)
        assert status == 0 and err == "", (argv, err)
        p = cli(*argv)  # the same command prints, so the pipe had something refused
        assert p.returncode == 0 and p.stdout.strip(), (argv, p.stderr)


# ---------------------------------------------------------------- Ctrl-C

def test_ctrl_c_is_acknowledged_and_the_run_stops_after_the_step(tmp_path, stream):
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coppelius",
         *train_argv(stream, tmp_path, "--steps", "100000", "--interval", "100000",
                     "--repeat-data")],
        cwd=ROOT, env=dict(env, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    res = tmp_path / "results-0.bin"
    deadline = time.time() + 120
    while time.time() < deadline:
        if res.exists() and len(results.read_results(str(res)).steps) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = err.splitlines()
    ack = [i for i, line in enumerate(lines) if line == (
        "coppelius train: interrupted: stopping after the step in flight (interrupt again "
        "to stop at once, publishing nothing)")]
    stopped = [i for i, line in enumerate(lines) if line.startswith("stopped by signal 2 after")]
    assert len(ack) == 1 and len(stopped) == 1 and ack[0] < stopped[0], err


STOPPER_DURING_A_LONG_CALL = """
import sys, time
import numpy as np
from threadpoolctl import threadpool_limits
from coppelius.train import Stopper

a = np.ones((N, N), np.float32)
with threadpool_limits(1, "blas"), Stopper() as stopper:
    print("ready", flush=True)
    a @ a  # one call of the BLAS: Python's handler waits for it
    print("returned", flush=True)
    time.sleep(0)  # Python's handler has run by the end of this call
    print(f"flag {stopper.signum}", flush=True)
"""


def test_a_signal_is_acknowledged_while_a_long_call_runs():
    """The acknowledgement comes while one BLAS call is still running
    (the process prints "returned" right after it): the signal goes in
    just after "ready", and the call takes seconds."""
    import signal
    import threading
    import time

    code = STOPPER_DURING_A_LONG_CALL.replace("N, N", "4000, 4000")
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(env, PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    arrived = {}

    def read(stream, name):
        for line in stream:
            arrived.setdefault(name, []).append((time.monotonic(), line.strip()))

    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    readers = [threading.Thread(target=read, args=(proc.stdout, "returned")),
               threading.Thread(target=read, args=(proc.stderr, "acknowledged"))]
    for t in readers:
        t.start()
    assert proc.wait(timeout=300) == 0
    for t in readers:
        t.join()
    (returned, *_), acknowledged = arrived["returned"], arrived["acknowledged"]
    assert [line for _, line in arrived["returned"]] == [
        "returned", f"flag {int(signal.SIGTERM)}"]
    assert [line for _, line in acknowledged] == [
        f"coppelius train: signal {int(signal.SIGTERM)}: stopping after the step in flight"]
    # the call went on for a while after the acknowledgement
    assert acknowledged[0][0] - sent < returned[0] - sent - 0.1, arrived


# ---------------------------------------------------------------- the grid after a resume

def test_a_resumed_run_evaluates_and_publishes_on_multiples_of_the_interval(
        tmp_path, stream, monkeypatch):
    """Stopped at step 3, resumed for 6 more: evaluations and publications
    at the multiples of 4 from step 4 on, and after the last step (9), not
    at 3 + 4 = 7."""
    from coppelius import train
    from coppelius.cli import main

    published = []
    real = train.publish
    monkeypatch.setattr(train, "publish", lambda plan, state, contexts: (
        published.append(state.t), real(plan, state, contexts))[1])
    common = ("--interval", "4", "--eval-every", "4")
    assert main(train_argv(stream, tmp_path, "--steps", "3", *common)) == 0
    assert published == [3]
    del published[:]
    assert main(train_argv(stream, tmp_path, "--steps", "6", *common)) == 0
    first, last = 3, 9
    grid = [s for s in range(first + 1, last + 1) if s % 4 == 0]
    assert grid == [4, 8]
    assert published == grid + [last]
    evals = results.read_results(str(tmp_path / "results-3.bin")).evals
    assert [step for step, _, _ in evals] == grid + [last]


def test_program_alone_reports_the_main_jobs_model(capsys):
    """`coppelius program` with no --preset is the main job's model (tiny
    here, without a GPU), not a usage error."""
    import json

    from coppelius.cli import main
    from coppelius.plan import default_preset

    assert main(["program", "--backend", "reference"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == f"{default_preset()} B=1 fp32 on reference"


def test_a_source_too_small_for_the_vocabulary_names_options_that_exist(tmp_path, capsys):
    """The hint names where a vocabulary is chosen: tokenize's --vocab and a
    model file's vocab (train has no --vocab), and both work."""
    from coppelius.cli import build_parser, main

    small = tmp_path / "small.txt"
    small.write_text("x = 1\n")
    assert main(["train", "--source", str(small), "--steps", "1", "--run-dir",
                 str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tokenize --vocab N" in err and "--model" in err
    parser = build_parser()
    assert parser.parse_args(["tokenize", "--vocab", "256", str(small)]).vocab == 256
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--vocab", "256"])
    model = tmp_path / "m.toml"
    model.write_text("vocab = 256\ncontext = 4\nd_model = 8\nn_layer = 1\nn_head = 1\n"
                     "d_ff = 8\n")
    assert main(["train", "--source", str(small), "--model", str(model), "--steps", "1",
                 "--run-dir", str(tmp_path / "r2"), "--no-sample"]) == 0


def test_eval_takes_a_run_directory_as_report_does(tmp_path, stream, capsys):
    """`eval RUN_DIR` evaluates the run's checkpoint (the one its run.json
    names, or checkpoint.bin), giving the same line as `eval CHECKPOINT`."""
    from coppelius.cli import main

    run = tmp_path / "run"
    assert main(["train", "--preset", "test", "--backend", "reference", "--stream", str(stream),
                 "--run-dir", str(run), "--steps", "2", "--no-sample"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run / "checkpoint.bin"), "--backend", "reference"]) == 0
    by_file = capsys.readouterr().out
    assert main(["eval", str(run), "--backend", "reference"]) == 0
    assert capsys.readouterr().out == by_file and "loss" in by_file
    assert main(["eval", str(tmp_path), "--backend", "reference"]) == 2  # no run there
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no checkpoint" in err
