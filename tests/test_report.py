"""`coppelius inspect` and `coppelius report`, run through the console
script's main on files the tests make; the printed numbers are compared
with this file's own computation."""

import csv
import hashlib
import math
import re
import statistics
from fractions import Fraction

import numpy as np
import pytest

from coppelius import cli
from coppelius.reference import results
from coppelius.stitch import CSV_COLUMNS
from coppelius.reference.checkpoint import identities, write_checkpoint
from coppelius.reference.config import Hyper, preset
from coppelius.reference.params import initialize, registry
from coppelius.reference.results import ResultWriter, result_header
from coppelius.reference.state import State

CONFIG = preset("test")
B, T, V = 3, CONFIG.context, CONFIG.vocab
IDS = identities(CONFIG, Hyper(), "bf16", B, None, hashlib.sha256(b"ids").hexdigest())
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_results(path, n_steps=30, first_step=10, final=True, seed=0):
    """A result file with decreasing, noisy row losses; returns what it holds."""
    rng = np.random.default_rng(seed)
    steps, hosts = [], []
    header = result_header(CONFIG, IDS, first_step, n_steps, B, "reference", False)
    with ResultWriter(path, header) as w:
        w.forward(rng.standard_normal((3, V)).astype(np.float32))
        for i in range(n_steps):
            rows = (4.0 - 2.0 * i / n_steps + rng.uniform(0, 1, (B, T))).astype(np.float32)
            host = float(rng.uniform(0.01, 0.1))
            w.step(first_step + i, rows)
            w.timing(first_step + i, host, math.nan)
            steps.append((first_step + i, rows))
            hosts.append(host)
        if final:
            w.final(np.zeros((4, T), np.float32), np.zeros(V, np.float32), [(1, 1)] * 3)
    return steps, hosts


def field(out: str, key: str) -> str:
    match = re.search(rf"^{re.escape(key)}\s+(.*)$", out, re.M)
    assert match, f"no line {key!r} in:\n{out}"
    return match.group(1)


def test_report_summary_and_plot(tmp_path, capsys):
    path = tmp_path / "results-10.bin"
    steps, hosts = make_results(path)
    png = tmp_path / "loss.png"
    assert cli.main(["report", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    # This test's own means: math.fsum over the float32 values, in float64.
    means = [math.fsum(rows.astype(np.float64).ravel()) / rows.size for _, rows in steps]
    best = min(range(len(means)), key=means.__getitem__)
    for key, i in (("first loss", 0), ("last loss", len(steps) - 1), ("min loss", best)):
        loss, step = re.fullmatch(r"([0-9.]+) at step (\d+)", field(out, key)).groups()
        assert abs(float(loss) - means[i]) < 1e-6 and int(step) == steps[i][0], key
    rate = float(field(out, "tokens/s").split()[0])
    assert abs(rate - statistics.median(B * T / h for h in hosts)) < 0.051
    assert field(out, "steps read").startswith("30 of 30")
    assert field(out, "completed") == "yes"
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "results-10.bin"]  # no temporary


def test_plot_is_not_blank(tmp_path, capsys):
    from matplotlib.image import imread

    path = tmp_path / "r.bin"
    make_results(path, n_steps=3)
    png = tmp_path / "plot.png"
    assert cli.main(["report", str(path), "--plot", str(png)]) == 0
    image = imread(png)  # (H, W, 4) floats
    assert image.ndim == 3 and image.shape[1] > image.shape[0]
    assert np.unique(image.reshape(-1, image.shape[2]), axis=0).shape[0] > 20


def test_report_without_plot_writes_no_png(tmp_path, capsys):
    path = tmp_path / "r.bin"
    make_results(path, n_steps=2)
    assert cli.main(["report", str(path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.bin"]


def test_report_of_an_interrupted_run(tmp_path, capsys):
    path = tmp_path / "r.bin"
    steps, _ = make_results(path, n_steps=5, final=False)
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the last timing record cut short
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "steps read").startswith("5 of 5")
    assert re.fullmatch(r"no \(truncated record at offset \d+\)", field(out, "completed"))


def test_report_with_no_steps_is_an_error(tmp_path, capsys):
    path = tmp_path / "r.bin"
    make_results(path, n_steps=0, final=False)
    assert cli.main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no step records" in err and str(path) in err


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(3)
    N = registry(CONFIG).total
    state = State(initialize(CONFIG), rng.standard_normal(N).astype(np.float32),
                  rng.uniform(0, 1, N).astype(np.float32), t=17)
    path = tmp_path / "model.ckpt"
    write_checkpoint(path, CONFIG, IDS, state, contexts=51)
    return path


def test_inspect_checkpoint(ckpt, capsys):
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    for key, value in IDS.items():
        assert field(out, key) == str(value)
    assert field(out, "step") == "17" and field(out, "contexts") == "51"
    N = registry(CONFIG).total
    assert field(out, "parameters").startswith(f"{N} in {len(registry(CONFIG).specs)} tensors")
    assert field(out, "payload bytes").startswith(f"{12 * N} ")
    data = ckpt.read_bytes()
    digest = hashlib.sha256(data[:-48]).hexdigest()
    assert f"sha256 ok {digest}" in out


def test_inspect_damaged_payload_shows_the_envelope_and_the_mismatch(ckpt, capsys):
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x40
    ckpt.write_bytes(bytes(data))
    assert cli.main(["inspect", str(ckpt)]) == 2
    captured = capsys.readouterr()
    assert field(captured.out, "step") == "17"  # the envelope is still shown
    content = hashlib.sha256(bytes(data[:-48])).hexdigest()
    trailer = bytes(data[-32:]).hex()
    assert f"sha256 MISMATCH: trailer {trailer}, content {content}" in captured.out
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("coppelius inspect: error: ") and str(ckpt) in captured.err
    assert "SHA-256" in captured.err


def test_inspect_damaged_header_exits_2_with_one_line_only(ckpt, capsys):
    data = bytearray(ckpt.read_bytes())
    data[20] ^= 0x40  # inside the JSON header: the structure itself is untrustworthy
    ckpt.write_bytes(bytes(data))
    assert cli.main(["inspect", str(ckpt)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and str(ckpt) in captured.err


def test_inspect_results(tmp_path, capsys):
    path = tmp_path / "r.bin"
    make_results(path, n_steps=4, first_step=8)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "records") == "forward 1, steps 4, timings 4, norms 0, evals 0, final 1"
    assert field(out, "backend") == "reference" and field(out, "first_step") == "8"
    assert field(out, "step range") == "8..11" and field(out, "version") == "3"
    assert field(out, "complete") == "yes" and field(out, "stopped early") == "no"
    data = bytearray(path.read_bytes())
    data[-10] ^= 1  # inside the final record
    path.write_bytes(bytes(data))
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "records") == "forward 1, steps 4, timings 4, norms 0, evals 0, final 0"
    assert re.fullmatch(r"yes: bad CRC at offset \d+", field(out, "stopped early"))


def test_inspect_of_a_result_file_without_its_final_record_says_it_does_not_know(tmp_path,
                                                                                 capsys):
    """A run killed (or still running) leaves whole records and no final
    one: that it stopped early is not known, and inspect says so, naming
    the last step, rather than 'no'."""
    path = tmp_path / "r.bin"
    make_results(path, n_steps=5, first_step=3, final=False)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "complete") == "no"
    assert field(out, "stopped early").startswith("unknown: the file ends after step 7 without")


@pytest.mark.parametrize("content", [b"", b"hello world, not a checkpoint", b"CPLSRSLT\x01"])
def test_inspect_unknown_or_broken_file(tmp_path, capsys, content):
    path = tmp_path / "mystery.bin"
    path.write_bytes(content)
    assert cli.main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err


def test_inspect_missing_file(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nope.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.ckpt" in err


def test_ema_is_a_bias_corrected_weighted_mean():
    from coppelius.report import ema

    x = np.random.default_rng(7).standard_normal(50)
    beta = 0.9
    for k in (0, 1, 10, 49):
        w = (1 - beta) * beta ** np.arange(k, -1, -1)  # weights of x[0..k]
        assert ema(x, beta)[k] == pytest.approx(np.dot(w, x[:k + 1]) / w.sum(), rel=1e-12)
    assert np.allclose(ema(np.full(20, 3.25)), 3.25)


# ------------------------------------------------------------ whole runs

def write_file(path, first, n, *, ids=IDS, eval_every=4, final=True, seed=0, K=6):
    """A version-2 result file of steps first..first+n-1 with norm records and
    an evaluation after every `eval_every` updates and after the last step.
    Returns what it holds: {step: (mean loss, norm, host, device)}, {u: mean}."""
    rng = np.random.default_rng(seed)
    steps, evals = {}, {}
    with ResultWriter(path, result_header(CONFIG, ids, first, n, B, "reference", False)) as w:
        for s in range(first, first + n):
            rows = (4.0 - s / 50 + rng.uniform(0, 1, (B, T))).astype(np.float32)
            norm, host = np.float32(rng.uniform(0.5, 3)), float(rng.uniform(0.01, 0.1))
            device = math.nan if s % 3 else float(rng.uniform(0.001, 0.01))
            w.step(s, rows)
            w.timing(s, host, device)
            w.norm(s, norm)
            steps[s] = (math.fsum(rows.astype(np.float64).ravel()) / rows.size, norm, host, device)
            if (s + 1) % eval_every == 0 or s == first + n - 1:
                losses = rng.uniform(3, 5, K).astype(np.float32)
                w.eval(s + 1, losses)
                evals[s + 1] = results.eval_mean(losses)
        if final:
            w.final(np.zeros((4, T), np.float32), np.zeros(V, np.float32), [(1, 1)] * 3)
    return steps, evals


def test_run_directory_stitches_overlaps_and_gaps(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    a, a_evals = write_file(run / "results-0.bin", 0, 10, final=False, seed=1)  # 0..9, then a crash
    b, b_evals = write_file(run / "results-6.bin", 6, 8, final=False, seed=2)  # resumed at 6: 6..13
    c, c_evals = write_file(run / "results-18.bin", 18, 4, seed=3)  # 14..17 lost
    (run / "run.json").write_text("{}")  # other files of the run directory are not result files
    assert cli.main(["report", str(run), "--csv", str(tmp_path / "run.csv")]) == 0
    out = capsys.readouterr().out
    assert field(out, "replaced") == ("steps 6..9 of results-0.bin: results-6.bin resumed the run "
                                      "at step 6 (a later file wins)")
    assert field(out, "missing") == "steps 14..17: no result file holds them"
    assert field(out, "steps read") == "18, steps 0..21"
    assert field(out, "result files") == ("3: results-0.bin (0..9), results-6.bin (6..13), "
                                          "results-18.bin (18..21)")
    want = {s: v for s, v in a.items() if s < 6} | b | c
    assert re.fullmatch(r"([0-9.]+) at step 21", field(out, "last loss"))
    assert abs(float(field(out, "last loss").split()[0]) - want[21][0]) < 1e-6
    assert field(out, "completed") == "yes"
    assert (run / "run.png").read_bytes().startswith(PNG_SIGNATURE)  # a directory's default plot

    with open(tmp_path / "run.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_COLUMNS)
    table = {int(r[0]): dict(zip(CSV_COLUMNS[1:], r[1:])) for r in rows[1:]}
    # evaluations: a's after 4 (before b's first step 6) is kept, a's after 8
    # and 10 belong to the history b replaced; b's after 14 has no step record
    evals = {4: a_evals[4]} | b_evals | c_evals
    assert sorted(table) == sorted(set(want) | set(evals))
    for s, row in table.items():
        if s in want:
            mean, norm, host, device = want[s]
            assert float(row["train_loss"]) == pytest.approx(mean, rel=1e-12), s
            assert np.float32(row["grad_norm"]) == norm and float(row["host_seconds"]) == host
            assert row["device_seconds"] == ("" if math.isnan(device) else repr(device))
            assert np.float32(row["learning_rate"]) == np.float32(3e-4)
        else:
            assert row["train_loss"] == row["grad_norm"] == row["learning_rate"] == ""
        assert row["heldout_loss"] == (str(evals[s]) if s in evals else ""), s
    assert sorted(evals) == [4, 8, 12, 14, 20, 22]


def test_later_file_of_the_same_first_step_wins(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_file(run / "results-0.bin", 0, 5, final=False, seed=1)
    write_file(run / "results-0-2.bin", 0, 4, final=False, seed=2)
    c, _ = write_file(run / "results-0-10.bin", 0, 3, seed=3)  # -10 comes after -2, not before
    csv_path = tmp_path / "r.csv"
    assert cli.main(["report", str(run), "--plot", str(tmp_path / "p.png"), "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    assert "steps 0..4 of results-0.bin: results-0-2.bin resumed" in out
    assert "steps 0..3 of results-0-2.bin: results-0-10.bin resumed" in out
    with open(csv_path, newline="") as f:
        got = {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]}
    assert got == pytest.approx({s: v[0] for s, v in c.items()}, rel=1e-12)
    assert not (run / "run.png").exists()  # --plot put it elsewhere


@pytest.mark.parametrize("other, key", [
    (dict(config=preset("test"), seed=7), "initialization"),
    (dict(precision="fp32"), "learner"),  # --new-learner does not lift the precision
    (dict(batch=2), "data"),
])
def test_files_of_two_runs_are_refused(tmp_path, capsys, other, key):
    kwargs = dict(config=CONFIG, hyper=Hyper(), precision="bf16", batch=B, tokenizer_sha=None,
                  stream_sha=hashlib.sha256(b"ids").hexdigest())
    seed = other.pop("seed", None)
    kwargs.update(other)
    ids = identities(**kwargs, **({"seed": seed} if seed else {}))
    run = tmp_path / "run"
    run.mkdir()
    write_file(run / "results-0.bin", 0, 3)
    write_file(run / "results-3.bin", 3, 3, ids=ids)
    assert cli.main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(run / "results-0.bin") in err and str(run / "results-3.bin") in err
    assert f"their {key} identities differ" in err


def test_files_of_two_models_are_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_file(run / "results-0.bin", 0, 3)
    other = preset("tiny")
    ids = identities(other, Hyper(), "bf16", 1, None, "00" * 32)
    ResultWriter(run / "results-3.bin", result_header(other, ids, 3, 1, 1, "reference", False)).close()
    assert cli.main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "their model identities differ" in err
    assert "results-0.bin" in err and "results-3.bin" in err


def test_a_new_learner_is_one_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_file(run / "results-0.bin", 0, 4)
    cosine = Hyper(lr=Fraction(1, 1000), schedule="cosine", warmup=2, total=10, floor=Fraction(1, 2))
    ids = identities(CONFIG, cosine, "bf16", B, None, hashlib.sha256(b"ids").hexdigest())
    write_file(run / "results-4.bin", 4, 8, ids=ids)
    csv_path = tmp_path / "r.csv"
    assert cli.main(["report", str(run), "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    assert field(out, "learner") == ("changes at step 4 (results-4.bin): lr=1/1000, "
                                     "schedule=cosine(warmup=2,total=10,floor=5/10)")
    assert field(out, "learning rate") == ("0.0005 at step 11 "
                                           "(cosine: warmup 2, total 10, floor 5/10)")
    with open(csv_path, newline="") as f:
        lr = {int(r["step"]): np.float32(r["learning_rate"]) for r in csv.DictReader(f)
              if r["learning_rate"]}
    assert lr[3] == np.float32(3e-4)  # the first file's constant rate
    assert lr[4] == np.float32(spec_s(5, 2, 10, 0.5) * 0.001)  # update 5 of the cosine


def test_report_of_one_file_shows_heldout_and_norm(tmp_path, capsys):
    steps, evals = write_file(tmp_path / "r.bin", 0, 9, eval_every=4)
    assert cli.main(["report", str(tmp_path / "r.bin")]) == 0
    out = capsys.readouterr().out
    best = min(evals, key=lambda u: evals[u])
    assert field(out, "held-out loss") == (f"{evals[9]:.6f} after 9 updates (best {evals[best]:.6f} "
                                           f"after {best}; 3 evaluations, 6 contexts)")
    peak = max(steps, key=lambda s: steps[s][1])
    assert field(out, "gradient norm") == (f"{steps[8][1]:.4g} at step 8 "
                                           f"(max {steps[peak][1]:.4g} at step {peak})")
    assert field(out, "learning rate") == "0.0003 at step 8 (constant)"
    assert "replaced" not in out and "missing" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.bin"]  # a file's plot: only on request


def test_unknown_learner_still_reports(tmp_path, capsys):
    ids = dict(IDS, learner=IDS["learner"].replace("optimizer=adamw", "optimizer=lion"))
    write_file(tmp_path / "r.bin", 0, 3, ids=ids)
    assert cli.main(["report", str(tmp_path / "r.bin"), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert field(out, "learning rate").startswith("not known for r.bin")


def test_empty_run_directory_is_an_error(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "no result files" in err
    ResultWriter(tmp_path / "results-0.bin",
                 result_header(CONFIG, IDS, 0, 3, B, "reference", False)).close()
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no step records in its 1 result file" in capsys.readouterr().err


def red_pixels(png) -> int:
    """Pixels of matplotlib's C3 red (#d62728), the held-out curve's colour."""
    from matplotlib.image import imread

    image = imread(png)[..., :3]  # (H, W, 3)
    return int((np.abs(image - np.array([0xd6, 0x27, 0x28]) / 255).max(axis=-1) < 0.08).sum())


def test_train_plot_draws_the_heldout_loss(tmp_path):
    from matplotlib.image import imread

    from coppelius.report import plot
    from coppelius.reference.results import read_results

    write_file(tmp_path / "with.bin", 0, 12, eval_every=3)
    write_file(tmp_path / "without.bin", 0, 12, eval_every=100)  # only the evaluation after the last step
    make_results(tmp_path / "v1-like.bin", n_steps=12)  # no evaluation at all
    for name in ("with", "without", "v1-like"):
        plot(read_results(tmp_path / f"{name}.bin"), tmp_path / f"{name}.png")
    image = imread(tmp_path / "with.png")
    assert image.ndim == 3 and image.shape[2] in (3, 4) and image.shape[1] > image.shape[0] > 400
    assert red_pixels(tmp_path / "with.png") > red_pixels(tmp_path / "without.png") > 0
    assert red_pixels(tmp_path / "v1-like.png") == 0


# ------------------------------------------------------------ learning rate of each step

def spec_s(t, W, N, f):
    """SPEC 7's s(t), written out here from the SPEC's Python."""
    if t <= W:
        return t / W
    if t > N:
        return float(f)
    return float(f) + (1 - float(f)) * 0.5 * (1.0 + math.cos(math.pi * (t - W) / (N - W)))


def test_step_learning_rates_follow_spec_7():
    from coppelius.reference.schedule import parse_schedule, step_learning_rates

    h = Hyper(schedule="cosine", warmup=4, total=20, floor=Fraction(1, 10))
    ident = h.identity("fp32")
    assert parse_schedule(ident) == ("cosine", 4, 20, Fraction(1, 10))
    steps = [0, 1, 3, 4, 11, 19, 20, 21, 10**6, 2**63 - 1]  # step s applies update t = s + 1
    got = step_learning_rates(ident, steps)
    assert got.dtype == np.float64
    # by hand: warm-up t/W is exact, halfway (t = 12) s = 11/20, beyond N the floor
    exact = {0: Fraction(1, 4), 1: Fraction(1, 2), 3: Fraction(1), 11: Fraction(11, 20)}
    for s, frac in exact.items():
        assert got[steps.index(s)] == float(np.float32(float(Fraction(3, 10000) * frac))), s
    for i, s in enumerate(steps):
        assert got[i] == float(np.float32(0.0003 * spec_s(min(s + 1, 21), 4, 20, 0.1))), s
    assert got[-1] == got[-2] == got[-3] == got[-4] == float(np.float32(0.0003 * 0.1))
    # no warm-up: the first update is already on the cosine
    ident = Hyper(schedule="cosine", warmup=0, total=10, floor=Fraction(0)).identity("bf16")
    first = step_learning_rates(ident, [0])[0]
    assert first == float(np.float32(0.0003 * 0.5 * (1.0 + math.cos(math.pi / 10))))
    assert parse_schedule(Hyper().identity("fp32")) == ("constant", 0, None, Fraction(0))
    assert step_learning_rates(Hyper(lr="1/3").identity("fp32"), [0, 9]).tolist() == \
        [float(np.float32(1 / 3))] * 2


@pytest.mark.parametrize("edit", [
    lambda i: i.replace("optimizer=adamw", "optimizer=sgd"),
    lambda i: i.replace("floor=1/10", "floor=0.1"),  # not the canonical form
    lambda i: i.replace("total=20", "total=" + "9" * 5000),
    lambda i: i + "|mystery=1",
    lambda i: i.replace("cosine(", "linear("),
    lambda i: i.replace("|lr=3/10000", ""),
    lambda i: 17,
])
def test_learner_identities_this_version_does_not_write_are_refused(edit):
    from coppelius.reference.errors import ConfigError
    from coppelius.reference.schedule import learner_from_identity

    ident = Hyper(schedule="cosine", warmup=4, total=20, floor=Fraction(1, 10)).identity("fp32")
    assert learner_from_identity(ident)[1] == "fp32"
    with pytest.raises(ConfigError, match="not one this version implements") as e:
        learner_from_identity(edit(ident), "result file r.bin")
    assert str(e.value).startswith("result file r.bin: ") and len(str(e.value)) < 600


def as_version_1(path) -> None:
    """Rewrite a result file holding kinds 1 to 4 only as version 1 wrote it:
    the same records behind a header without the initialization identity."""
    import json
    import struct

    data = path.read_bytes()
    hn = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[16:16 + hn])
    del header["initialization"]
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    start = struct.pack("<8sII", b"CPLSRSLT", 1, len(raw)) + raw
    path.write_bytes(start + bytes(4096 - len(start)) + data[4096:])


def test_a_run_begun_before_version_2(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    old, _ = make_results(run / "results-0.bin", n_steps=5, first_step=0, final=False)
    as_version_1(run / "results-0.bin")
    write_file(run / "results-5.bin", 5, 4)
    assert cli.main(["report", str(run), "--csv", str(tmp_path / "r.csv")]) == 0
    out = capsys.readouterr().out
    assert field(out, "steps read") == "9, steps 0..8" and "missing" not in out
    with open(tmp_path / "r.csv", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert rows[0]["grad_norm"] == "" and rows[5]["grad_norm"] != ""  # version 1 has no norms
    assert float(rows[0]["train_loss"]) == pytest.approx(float(old[0][1].mean(dtype=np.float64)))


def test_inspect_counts_evaluations_and_norms(tmp_path, capsys):
    write_file(tmp_path / "r.bin", 0, 9, eval_every=4)
    assert cli.main(["inspect", str(tmp_path / "r.bin")]) == 0
    out = capsys.readouterr().out
    assert field(out, "records") == "forward 0, steps 9, timings 9, norms 9, evals 3, final 1"
    assert field(out, "evaluations") == "3 of 6 contexts, after 4, 8..9 updates"


def test_a_file_cut_short_by_a_crash_is_noted(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_file(run / "results-0.bin", 0, 6, final=False)
    data = (run / "results-0.bin").read_bytes()
    (run / "results-0.bin").write_bytes(data[:-5])  # the process died inside its last record
    write_file(run / "results-4.bin", 4, 3)
    assert cli.main(["report", str(run), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"results-0\.bin: truncated record at offset \d+", field(out, "stopped early"))
    assert field(out, "steps read") == "7, steps 0..6" and field(out, "completed") == "yes"
